"""torch-facing wrappers of the C GGUF kernels (see build.py). Callers check `supports` first
and take their torch path where the kernels are unavailable or do not cover a type."""
from __future__ import annotations

import torch

from pocketllm.core.gguf_types import block_size
from pocketllm.kernels.cpu.build import load_cpu_kernels


def supports(qtype: int) -> bool:
    lib = load_cpu_kernels()
    return lib is not None and bool(lib.gguf_supported(int(qtype)))


def supports_int8(qtype: int) -> bool:
    """Whether the fast path (integer dot products over 8-bit activations) covers the type here."""
    lib = load_cpu_kernels()
    return lib is not None and bool(lib.gguf_int8_supported(int(qtype)))


def row_pointers(parts: list[torch.Tensor]) -> torch.Tensor:
    """int64 [N]: the address of every row of the given uint8 [rows, row_bytes] parts, in order.
    The caller keeps the parts alive as long as the table is used."""
    tables = []
    for p in parts:
        assert p.dtype == torch.uint8 and p.dim() == 2 and p.is_contiguous()
        tables.append(p.data_ptr() + torch.arange(p.shape[0], dtype=torch.int64) * p.shape[1])
    return torch.cat(tables)


def gemm(x: torch.Tensor, rows: torch.Tensor, qtype: int, int8: int = 0, lib=None) -> torch.Tensor:
    """x [B, K] float32 @ dequant(W).T -> [B, N] float32, W given by its row pointer table;
    with `int8` (1 or 2 passes), over x quantized to 8 bits per block (see supports_int8 and
    gguf_gemm_int8). `lib`: another build of the kernels (load_cpu_kernels(isa)), for tests."""
    lib = lib or load_cpu_kernels()
    x = x.contiguous()
    b, k = x.shape
    n = rows.numel()
    y = torch.empty(b, n, dtype=torch.float32)
    args = (int(qtype), rows.data_ptr(), n, k, x.data_ptr(), b, y.data_ptr())
    if int8:
        rc = lib.gguf_gemm_int8(*args, int(int8), torch.get_num_threads())
    else:
        rc = lib.gguf_gemm(*args, torch.get_num_threads())
    assert rc == 0, f"gguf_gemm failed for type {qtype} with K={k}"
    return y


def heads_gemm(x: torch.Tensor, rows: torch.Tensor, n: int, qtype: int, passes: int, lib=None) -> torch.Tensor:
    """x [H, B, K] float32 -> [H, B, N]: head h's rows times its own matrix, rows h * N .. h * N + N - 1 of
    the pointer table, over 8-bit activations (1 or 2 passes, as gemm's int8)."""
    lib = lib or load_cpu_kernels()
    x = x.contiguous()
    h, b, k = x.shape
    assert rows.numel() == h * n, (rows.numel(), h, n)
    y = torch.empty(h, b, n, dtype=torch.float32)
    rc = lib.gguf_heads_gemm_int8(int(qtype), rows.data_ptr(), h, n, k, x.data_ptr(), b, y.data_ptr(), int(passes),
                                  torch.get_num_threads())
    assert rc == 0, f"gguf_heads_gemm_int8 failed for type {qtype} with K={k}"
    return y


def repack_x8(rows: torch.Tensor, qtype: int, k: int, lib=None) -> torch.Tensor | None:
    """The rows a pointer table names, interleaved eight at a time for gemm_x8 (the same bytes,
    reordered); None where this build or the shape has no such kernel (see gguf_repack_x8)."""
    lib = lib or load_cpu_kernels()
    n = rows.numel()
    if lib is None or not lib.gguf_x8_supported(int(qtype)) or n % 8 or k % block_size(qtype):
        return None
    out = torch.empty(lib.gguf_x8_nbytes(int(qtype), n, k), dtype=torch.uint8)
    assert lib.gguf_repack_x8(int(qtype), rows.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads()) == 0
    return out


def gemm_x8(x: torch.Tensor, packed: torch.Tensor, n: int, qtype: int, passes: int = 1, lib=None) -> torch.Tensor:
    """x [B, K] float32 @ dequant(W).T -> [B, N] float32 over 8-bit activations (1 or 2 passes, as
    gemm's int8), W repacked by repack_x8 (with the same `lib`)."""
    lib = lib or load_cpu_kernels()
    x = x.contiguous()
    b, k = x.shape
    y = torch.empty(b, n, dtype=torch.float32)
    rc = lib.gguf_gemm_x8(int(qtype), packed.data_ptr(), n, k, x.data_ptr(), b, y.data_ptr(), int(passes),
                          torch.get_num_threads())
    assert rc == 0, f"gguf_gemm_x8 failed for type {qtype} with K={k}"
    return y


def dequant_rows_x8(packed: torch.Tensor, qtype: int, n: int, k: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` (int64) of a matrix repacked by repack_x8, dequantized exactly -> [len(rows), K]."""
    lib = load_cpu_kernels()
    rows = rows.to(torch.int64).contiguous()
    out = torch.empty(rows.numel(), k, dtype=torch.float32)
    rc = lib.gguf_dequant_rows_x8(int(qtype), packed.data_ptr(), n, k, rows.data_ptr(), rows.numel(),
                                  out.data_ptr(), torch.get_num_threads())
    assert rc == 0, f"gguf_dequant_rows_x8 failed for type {qtype} with K={k}"
    return out


def dequant_row_ptrs(rows: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """Dequantize the rows a pointer table names -> [len(rows), K] float32."""
    lib = load_cpu_kernels()
    out = torch.empty(rows.numel(), k, dtype=torch.float32)
    rc = lib.gguf_dequant_row_ptrs(int(qtype), rows.data_ptr(), k, rows.numel(), out.data_ptr(),
                                   torch.get_num_threads())
    assert rc == 0, f"gguf_dequant_row_ptrs failed for type {qtype} with K={k}"
    return out


def dequant_rows(data: torch.Tensor, qtype: int, k: int, rows: torch.Tensor) -> torch.Tensor:
    """Dequantize the given rows of data [N, row_bytes] -> [len(rows), K] float32."""
    lib = load_cpu_kernels()
    rows = rows.to(torch.int64).contiguous()
    out = torch.empty(rows.numel(), k, dtype=torch.float32)
    rc = lib.gguf_dequant_rows(int(qtype), data.data_ptr(), k, rows.data_ptr(), rows.numel(),
                               out.data_ptr(), torch.get_num_threads())
    assert rc == 0, f"gguf_dequant_rows failed for type {qtype} with K={k}"
    return out
