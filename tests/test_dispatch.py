"""The kernel tables of kernels/dispatch.py, row by row: each threshold's both sides. The kernels'
own results are checked elsewhere (test_triton_gguf, test_cuda_gguf on the GPU, test_quant_linear
and test_int8_kernels on the CPU), and there that the layers call what these tables say."""
import pytest
import torch
from gguf import GGMLQuantizationType as T

from pocketllm.kernels import dispatch as d

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
ALL = dict(q8=True, cuda_gemv=True, mmq=True, mmq_x16=True, aligned=True)  # everything built and fitting


def gpu(qtype, m, dtype, **facts):
    return d.gpu_gguf_kernel(qtype, m, dtype, **{**ALL, **facts})


def test_decode_rows_take_a_gemv():
    for m in (1, d.GEMV_MAX_M):
        assert gpu(T.Q4_K, m, BF16) == "cuda_gemv"
        assert gpu(T.Q4_K, m, FP16, cuda_gemv=False) == "gemv_q8"
        assert gpu(T.Q4_K, m, FP32) == "gemv"  # float32 activations: the exact kernel
        assert gpu(T.IQ1_S, m, BF16, q8=False, cuda_gemv=False) == "gemv"
    assert gpu(T.Q4_K, d.GEMV_MAX_M + 1, BF16) != "cuda_gemv"


def test_batched_rows_take_the_tiles_then_cublas():
    x16 = [m for m in range(d.GEMV_MAX_M + 1, 130) if gpu(T.Q4_K, m, BF16) == "mmq_x16"]
    assert (x16[0], x16[-1]) == (d.MMQ_X16_MIN_M, d.MMQ_X16_MAX_M)
    assert gpu(T.Q4_K, d.MMQ_X16_MIN_M, BF16, aligned=False) == "mmq"
    assert gpu(T.Q4_K, d.MMQ_X16_MIN_M, FP16) == "mmq"  # the variant is bf16's
    assert [gpu(T.Q4_K, m, FP16) for m in (d.MMQ_MAX_M, d.MMQ_MAX_M + 1)] == ["mmq", "mma"]
    assert gpu(T.IQ2_XXS, d.MMA_MAX_M, FP16) == "mmq"  # MMQ_WIDE_TYPES: up to MMA_MAX_M
    assert gpu(T.IQ2_XXS, d.MMA_MAX_M + 1, FP16) == "dequant"
    assert [gpu(T.Q4_K, m, BF16, mmq=False) for m in (3, d.MMA_MAX_M, d.MMA_MAX_M + 1)] == ["mma", "mma", "dequant"]
    assert gpu(T.Q6_K, 8, BF16, mmq=False) == "dequant"  # not in MMA_AUTO_TYPES
    assert gpu(T.Q4_K, 8, FP32) == "dequant"


def test_fp8_decode_rows_take_the_gemv_where_it_runs():
    for m in (1, d.FP8_GEMV_MAX_M):
        assert d.gpu_fp8_kernel(m, BF16, cuda_gemv=True) == "cuda_gemv"
        assert d.gpu_fp8_kernel(m, FP16, cuda_gemv=True) == "cuda_gemv"
        assert d.gpu_fp8_kernel(m, BF16, cuda_gemv=False) == "tiles"  # NVRTC absent, or operands it cannot take
        assert d.gpu_fp8_kernel(m, FP32, cuda_gemv=True) == "tiles"  # float32 activations: the exact tiles
    assert d.gpu_fp8_kernel(d.FP8_GEMV_MAX_M + 1, BF16, cuda_gemv=True) == "tiles"


@pytest.mark.parametrize("passes", [0, 1, 2])
def test_the_cpu_table(passes):
    small, large = d.EXACT_ROWS_MAX_WEIGHTS, d.EXACT_ROWS_MAX_WEIGHTS + 1
    few, many = d.C_GEMM_ROWS, d.C_GEMM_ROWS + 1
    if passes == 2:
        assert d.cpu_gguf_kernel(many, small, passes=2, interleaved=True) == "dequant"  # exact prompt rows
        assert d.cpu_gguf_kernel(many, large, passes=2, interleaved=True) == "gemm_x8"
    if passes:
        assert d.cpu_gguf_kernel(few, small, passes=passes, interleaved=True) == "gemm_x8"
        assert d.cpu_gguf_kernel(many, large, passes=passes, interleaved=False) == "gemm"
    else:
        assert d.cpu_gguf_kernel(few, large, passes=0, interleaved=False) == "gemm"
        assert d.cpu_gguf_kernel(many, large, passes=0, interleaved=False) == "dequant"


def test_two_passes_for_small_models():
    assert [d.int8_passes(h) for h in (576, d.TWO_PASS_MAX_HIDDEN, d.TWO_PASS_MAX_HIDDEN + 1, 4096)] == [2, 2, 1, 1]
