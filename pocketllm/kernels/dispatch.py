"""Which kernel multiplies activations x [M, K] by a GGUF weight (or a block-scaled FP8 one): a pure
decision per platform and weight format, each a table a reader sees at once (the GPU's GGUF table here,
the GPU's FP8 table and the CPU's below, with why each threshold is where it is).

`gpu_gguf_kernel` is the whole choice of `kernels.triton.gguf.gguf_matmul`'s "auto" (and of the
grouped GEMV of mixture-of-experts layers, whose pairs are decode rows). The first row that
matches wins; "16-bit" is bf16 or fp16 activations (float32 activations keep the exact kernels):

| rows M       | activations | types and what must hold                        | kernel    | in                |
| ------------ | ----------- | ----------------------------------------------- | --------- | ----------------- |
| <= 2         | 16-bit      | `Q8_TYPES` with a CUDA C decoder; NVRTC built   | cuda_gemv | cuda/gguf_gemv    |
| <= 2         | 16-bit      | `Q8_TYPES`                                      | gemv_q8   | triton/gguf_q8    |
| <= 2         | any         | every Triton type (float32 sums)                | gemv      | triton/gguf       |
| 17 .. 64     | bf16        | MMQ types with a bf16 form; NVRTC; x aligned    | mmq_x16   | cuda/gguf_mmq     |
| 3 .. 32 (64 for `MMQ_WIDE_TYPES`) | 16-bit | `MMQ_TYPES`, K whole tiles; NVRTC | mmq     | cuda/gguf_mmq     |
| 3 .. 64      | 16-bit      | `MMA_AUTO_TYPES`                                | mma       | triton/gguf_mma   |
| otherwise    |             |                                                 | dequant   | dequantize, cuBLAS |

The GEMVs (cuda_gemv, gemv_q8) and mmq take 8-bit activations (llama.cpp's q8_1); mma and mmq_x16
tensor-core tiles; dequant decodes the weight into a scratch buffer for cuBLAS.

Why each threshold is where it is (all measured on the H200 at Llama-3.1-8B's shapes; the records
under benchmarks/results/ and docs/performance/gpu-kernels.md give the runs):
- GEMV_MAX_M = 2: past two rows the GEMVs, which read the weight once per row, lose to tiles that
  read it once per 16-64 rows (h200-triton-gguf-sweep.txt).
- MMQ_MAX_M = 32: the integer tiles took 0.34-0.88x the best other kernel's time at 4-32 rows for
  every type, but up to 1.45x at 64 (h200-cuda-mmq-rows.txt); IQ2_XXS (MMQ_WIDE_TYPES) still won
  at 64 against dequantize + cuBLAS.
- MMQ_X16_MIN_M .. MMQ_X16_MAX_M = 17 .. 64: the bf16 variant took 0.78-0.88x the integer form's
  time at 32 rows and 0.69-0.96x the best other at 64, but Q6_K's 1.11-1.23x at 16 (h200-cuda-mmq-x16.txt).
- MMA_MAX_M = 64 and MMA_AUTO_TYPES = {Q4_K}: Q4_K's tiles beat dequantize + cuBLAS at every shape
  from 3 to 64 rows; Q6_K and Q8_0 won some shapes and lost others (h200-triton-gguf-mma.txt).
"""
from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

T = GGMLQuantizationType

GEMV_MAX_M = 2
MMQ_MAX_M = 32
MMQ_WIDE_TYPES = frozenset({T.IQ2_XXS})
MMQ_X16_MIN_M = 17
MMQ_X16_MAX_M = 64
MMA_MAX_M = 64
MMA_AUTO_TYPES = frozenset({T.Q4_K})

KERNELS = ("cuda_gemv", "gemv_q8", "gemv", "mmq_x16", "mmq", "mma", "dequant")


def gpu_gguf_kernel(qtype: GGMLQuantizationType, m: int, dtype: torch.dtype, *, q8: bool, cuda_gemv: bool,
                    mmq: bool, mmq_x16: bool, aligned: bool) -> str:
    """The table above. What the platform can run comes in as facts: `q8` (the type has an 8-bit
    activation GEMV), `cuda_gemv` / `mmq` (NVRTC built the type's CUDA C kernel; for mmq, K is
    whole tiles), `mmq_x16` (the type has the bf16 variant), `aligned` (x's data is 16-byte aligned)."""
    half = dtype in (torch.bfloat16, torch.float16)
    if m <= GEMV_MAX_M:
        if half and q8:
            return "cuda_gemv" if cuda_gemv else "gemv_q8"
        return "gemv"
    if dtype == torch.bfloat16 and MMQ_X16_MIN_M <= m <= MMQ_X16_MAX_M and mmq and mmq_x16 and aligned:
        return "mmq_x16"
    if half and mmq and m <= (MMA_MAX_M if qtype in MMQ_WIDE_TYPES else MMQ_MAX_M):
        return "mmq"
    if half and m <= MMA_MAX_M and qtype in MMA_AUTO_TYPES:
        return "mma"
    return "dequant"


# ---- the GPU: a block-scaled FP8 projection (quant.fp8.Fp8Linear, kernels.triton.fp8.fp8_matmul) ----
#
# | rows M            | activations | what must hold                                | kernel    | in                    |
# | ----------------- | ----------- | --------------------------------------------- | --------- | --------------------- |
# | <= FP8_GEMV_MAX_M | 16-bit      | NVRTC built; K and the scale tiles whole pieces | cuda_gemv | cuda/dense_gemv FP8=1 |
# | otherwise         |             |                                               | tiles     | triton/fp8            |
#
# - FP8_GEMV_MAX_M = 2: at one row the GEMV streams the weights 1.1-1.9x faster than the tiles, at two
#   the four products of a Llama-3-8B layer take about as long on either, from four the GEMV, whose
#   float work per weight grows with the rows, loses (results/h100-fp8.md, docs/performance/fp8.md).
FP8_GEMV_MAX_M = 2


def gpu_fp8_kernel(m: int, dtype: torch.dtype, *, cuda_gemv: bool) -> str:
    """The FP8 table above; `cuda_gemv`: the CUDA C GEMV can run these operands (``dense_gemv.fp8_usable``)."""
    if m <= FP8_GEMV_MAX_M and dtype in (torch.bfloat16, torch.float16) and cuda_gemv:
        return "cuda_gemv"
    return "tiles"


# ---- the CPU: a GGUF layer on the C kernels (quant.linear.GGUFLinear, path "c") ------------------
#
# | 8-bit passes | rows             | matrix                          | kernel                              |
# | ------------ | ---------------- | ------------------------------- | ----------------------------------- |
# | 2            | > C_GEMM_ROWS    | <= EXACT_ROWS_MAX_WEIGHTS       | dequant: exact rows of W, then BLAS |
# | 1 or 2       | any              | interleaved at load (repack_x8) | gemm_x8                             |
# | 0, 1 or 2    | <= C_GEMM_ROWS, or any with passes | row pointers  | gemm (integer dots with passes)     |
# | 0            | > C_GEMM_ROWS    |                                 | dequant                             |
#
# - C_GEMM_ROWS = 16: past it, dequantizing row slices once for BLAS beats the fused float kernel,
#   which reads each block once per row (CPU records, docs/performance/cpu-kernels.md).
# - TWO_PASS_MAX_HIDDEN = 1024: one 8-bit pass moves a logit by about 1% of its scale; a small
#   model's top logits are often closer than that, and greedy answers drift into loops the exact
#   path does not take. Up to this hidden size every layer takes a second pass over the first's
#   rounding error (results/cpu-fast-path-answers.json).
# - EXACT_ROWS_MAX_WEIGHTS = 2**22: on two passes, a prompt's rows on a matrix this small go through
#   the exact product instead: the default model prefills 128 tokens at 326 tok/s on two passes and
#   591 exactly (results/README.md). Larger matrices keep the passes: not measured there.
C_GEMM_ROWS = 16
TWO_PASS_MAX_HIDDEN = 1024
EXACT_ROWS_MAX_WEIGHTS = 1 << 22


def int8_passes(hidden_size: int) -> int:
    """8-bit passes over the activations on the CPU fast path, for a model of this hidden size."""
    return 2 if hidden_size <= TWO_PASS_MAX_HIDDEN else 1


def cpu_gguf_kernel(rows: int, weights: int, *, passes: int, interleaved: bool) -> str:
    """The CPU table above for `rows` activation rows on a matrix of `weights` weights."""
    if passes == 2 and rows > C_GEMM_ROWS and weights <= EXACT_ROWS_MAX_WEIGHTS:
        return "dequant"
    if interleaved:
        return "gemm_x8"
    if passes or rows <= C_GEMM_ROWS:
        return "gemm"
    return "dequant"
