"""torch-facing wrappers of the C GGUF kernels (see build.py). They return None when the
kernels are unavailable or do not cover a type, and the caller takes its torch path."""
from __future__ import annotations

import torch

from pocketllm.kernels.cpu.build import load_gguf_kernels


def supports(qtype: int) -> bool:
    lib = load_gguf_kernels()
    return lib is not None and bool(lib.gguf_supported(int(qtype)))


def gemm(x: torch.Tensor, data: torch.Tensor, qtype: int, n: int) -> torch.Tensor:
    """x [B, K] float32 @ dequant(data [N, row_bytes]).T -> [B, N] float32."""
    lib = load_gguf_kernels()
    x = x.contiguous()
    b, k = x.shape
    y = torch.empty(b, n, dtype=torch.float32)
    rc = lib.gguf_gemm(int(qtype), data.data_ptr(), n, k, x.data_ptr(), b, y.data_ptr(),
                       torch.get_num_threads())
    assert rc == 0, f"gguf_gemm failed for type {qtype} with K={k}"
    return y


def dequant_rows(data: torch.Tensor, qtype: int, k: int, rows: torch.Tensor) -> torch.Tensor:
    """Dequantize the given rows of data [N, row_bytes] -> [len(rows), K] float32."""
    lib = load_gguf_kernels()
    rows = rows.to(torch.int64).contiguous()
    out = torch.empty(rows.numel(), k, dtype=torch.float32)
    rc = lib.gguf_dequant_rows(int(qtype), data.data_ptr(), k, rows.data_ptr(), rows.numel(),
                               out.data_ptr(), torch.get_num_threads())
    assert rc == 0, f"gguf_dequant_rows failed for type {qtype} with K={k}"
    return out
