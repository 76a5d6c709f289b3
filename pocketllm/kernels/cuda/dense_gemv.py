"""bf16 / fp16 GEMV in CUDA C (``dense_gemv.cu``): a mixture of experts' grouped pairs in decode steps
(``triton.moe.grouped_dense_gemv``: each pair one activation row against its expert's rows), and products
of any number of activation rows, ``MAX_ROWS`` a block (``linear``: the routers of ``layers.moe``). Each
output row's bits depend only on its activation row and the weights, not on how many rows or pairs the
launch has.

Block-scaled FP8 weights (``fp8_linear``: ``quant/fp8.py``'s ``Fp8Linear`` in decode steps) stream at half
the bytes: each 16-byte piece is 16 e4m3 values, widened by integer operations, its sum scaled by its tile's
scale.

Dense projections (``Linear``) stay on cuBLAS: this kernel streams one row's weights faster (Qwen3-30B-A3B's
o projection 5.7 against 8.7 us), but at five rows it is 1.6-2x slower (results/h200-dense-gemv.txt), and
one row on it with several on cuBLAS would give a speculative step's rows other bits than plain decoding's.
"""
from __future__ import annotations

import logging
from functools import cache
from pathlib import Path

import torch

from ..triton.gguf import num_sms
from . import runtime

log = logging.getLogger("pocketllm")
SOURCE = Path(__file__).with_name("dense_gemv.cu")
MAX_ROWS = 8  # activation rows a block: each a float accumulator a weight row and thread
DTYPES = (torch.bfloat16, torch.float16)
_failed: set = set()  # dtypes (or "fp8") whose kernel NVRTC could not build here


@cache
def source() -> str:
    return SOURCE.read_text()


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``x [M, K] . w [N, K]^T`` can run here: CUDA, bf16 / fp16 alike, K a multiple of 8, rows on
    16-byte boundaries."""
    k = w.shape[-1]
    return (x.is_cuda and x.dtype in DTYPES and w.dtype == x.dtype and x.dtype not in _failed and k % 8 == 0
            and w.is_contiguous() and w.data_ptr() % 16 == 0 and x.stride(-1) == 1 and x.stride(0) % 8 == 0
            and x.data_ptr() % 16 == 0 and runtime.available())


def tile(n: int, pieces: int, blocks_y: int, device: torch.device) -> tuple[int, int]:
    """(R weight rows a block, NT threads): a block's threads cover a row's 16-byte pieces in as few
    passes as 128 threads allow, and R shrinks until the blocks fill the GPU twice over."""
    nt = min(128, -(-pieces // 32) * 32)
    r = 4
    while r > 1 and -(-n // r) * blocks_y < 2 * 4 * num_sms(device):
        r //= 2
    return r, nt


@cache
def _kernel(dtype: torch.dtype, grouped: bool, r: int, nt: int, max_m: int, device: torch.device,
            block: tuple[int, int] | None = None):
    """``block``: an FP8 weight's scale tile (rows, cols); None for bf16 / fp16 weights."""
    name = (f"dense_gemv_r{r}_t{nt}_m{max_m}_{str(dtype).split('.')[-1]}{'_grouped' if grouped else ''}"
            f"{'' if block is None else f'_fp8_{block[0]}x{block[1]}'}")
    defines = dict(KERNEL=name, R=r, NT=nt, MAXM=max_m, GROUPED=int(grouped), HALF=int(dtype == torch.float16),
                   FP8=int(block is not None), BR=block[0] if block else 1, BC=block[1] if block else 1)
    return runtime.kernel(source(), name, defines, device)


def _launch(x, w, n, k, bias, ids, x_div, rows_out, blocks_y, m, max_m, scale=None,
            block=None) -> torch.Tensor | None:
    r, nt = tile(n, k // (8 if block is None else 16), blocks_y, w.device)
    assert block is None or block[0] % r == 0, (block, r)  # a block's rows share their scale row
    failed = x.dtype if block is None else "fp8"
    try:
        kern = _kernel(x.dtype, ids is not None, r, nt, max_m, w.device, block)
    except RuntimeError as e:
        log.warning("the CUDA C GEMV is unavailable here for %s weights, using cuBLAS / Triton: %s", failed, e)
        _failed.add(failed)
        return None
    y = torch.empty((rows_out, n), dtype=x.dtype, device=x.device)
    if rows_out:
        kern.launch((-(-n // r), blocks_y, 1), nt, w, x, y, w if bias is None else bias, y if ids is None else ids,
                    n, k, m, x_div, x.stride(0), y.stride(0), int(bias is not None), w if scale is None else scale,
                    0 if scale is None else scale.stride(0))
    return y


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] . w [N, K]^T (+ bias [N]) in x's dtype, float32 sums, any M (``MAX_ROWS`` rows a block row);
    None where NVRTC cannot build the kernel (the caller falls back)."""
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and usable(x, w), (x.shape, w.shape)
    assert bias is None or (bias.dtype == x.dtype and bias.is_contiguous() and bias.shape == (n,))
    max_m = min(MAX_ROWS, 1 << (max(m, 1) - 1).bit_length())  # a kernel for 1, 2, 4 or 8 rows a block
    return _launch(x, w, n, k, bias, None, 1, m, -(-m // max_m), m, max_m)


def fp8_usable(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether ``fp8_linear`` can run: ``usable``'s conditions with 16 e4m3 values a piece, float32 scales and
    scale tiles a whole number of pieces wide and of (up to four) rows a block tall."""
    k = values.shape[-1]
    return (x.is_cuda and x.dtype in DTYPES and values.dtype == torch.float8_e4m3fn and "fp8" not in _failed
            and k % 16 == 0 and block[1] % 16 == 0 and block[0] % 4 == 0 and values.is_contiguous()
            and values.data_ptr() % 16 == 0 and scale.dtype == torch.float32 and scale.stride(1) == 1
            and x.stride(-1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 and runtime.available())


def fp8_linear(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] . (values [N, K] float8 e4m3 times each (br, bc) tile's float32 ``scale``)^T (+ bias) in x's
    dtype, any M; None where NVRTC cannot build the kernel (the caller falls back)."""
    m, k = x.shape
    n = values.shape[0]
    assert values.shape[1] == k and fp8_usable(x, values, scale, block), (x.shape, values.shape, block)
    assert bias is None or (bias.dtype == x.dtype and bias.is_contiguous() and bias.shape == (n,))
    max_m = min(MAX_ROWS, 1 << (max(m, 1) - 1).bit_length())
    return _launch(x, values, n, k, bias, None, 1, m, -(-m // max_m), m, max_m, scale, block)


def grouped(x: torch.Tensor, stacked: torch.Tensor, n: int, ids: torch.Tensor, x_div: int = 1) -> torch.Tensor | None:
    """[P, n]: row p = x[p // x_div] . stacked[ids[p] * n : (ids[p] + 1) * n]^T (``triton.moe.grouped_dense_gemv``'s
    product); None where NVRTC cannot build the kernel."""
    k = stacked.shape[1]
    ids = ids.reshape(-1).contiguous()
    assert ids.dtype == torch.int64 and usable(x, stacked) and stacked.shape[0] % n == 0
    return _launch(x, stacked, n, k, None, ids, x_div, ids.numel(), ids.numel(), 1, 1)
