"""The CUDA C dense GEMV (pocketllm/kernels/cuda/dense_gemv.cu) against float64 products of the same bf16 /
fp16 values: every row to the output's rounding, each row's bits the same at any row count, and a mixture of
experts' pairs each on its own expert's rows."""
from __future__ import annotations

import pytest
import torch

from pocketllm.kernels.cuda import dense_gemv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Float32 sums of K products against float64: within an output rounding step and a K-dependent sliver."""
    ulp = 2.0 ** -7 if got.dtype == torch.bfloat16 else 2.0 ** -10
    err = (got.double() - want).abs()
    assert bool((err <= ulp * want.abs() + 1e-3).all()), float((err - ulp * want.abs()).max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", [(5120, 2048), (2048, 4096), (128, 2048), (131, 2056), (7, 64), (1001, 768)])
def test_rows_against_float64_and_alike_at_any_row_count(dtype, n, k):
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", generator=g).to(dtype)
    x = torch.randn(8, k, device="cuda", generator=g).to(dtype)
    bias = torch.randn(n, device="cuda", generator=g).to(dtype)
    want = x.double() @ w.double().T
    alone = [dense_gemv.linear(x[i:i + 1], w) for i in range(8)]
    for i, y in enumerate(alone):
        assert y.dtype == dtype and y.shape == (1, n)
        _close(y[0], want[i])
    for m in range(2, 9):
        y = dense_gemv.linear(x[:m], w)
        for i in range(m):
            assert torch.equal(y[i], alone[i][0]), (m, i)  # a row's bits whatever the rows beside it
    _close(dense_gemv.linear(x[:3], w, bias), want[:3] + bias.double())


@pytest.mark.parametrize("x_div", [1, 4])
def test_grouped_pairs_take_their_experts_rows(x_div):
    """Pair p: x[p // x_div] times expert ids[p]'s rows (the gate/up of 4 tokens' top-4 experts, or the down
    projection of each pair's own row), as Triton's grouped GEMV and float64 compute it."""
    from pocketllm.kernels.triton.moe import grouped_dense_gemv_triton

    experts, n, k, pairs = 16, 768, 2048, 16
    g = torch.Generator(device="cuda").manual_seed(x_div)
    stacked = torch.randn(experts * n, k, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.randint(0, experts, (pairs,), device="cuda", generator=g)
    x = torch.randn(pairs // x_div, k, device="cuda", generator=g).to(torch.bfloat16)
    got = dense_gemv.grouped(x, stacked, n, ids, x_div)
    want = torch.stack([x[p // x_div].double() @ stacked[int(e) * n:(int(e) + 1) * n].double().T
                        for p, e in enumerate(ids.tolist())])
    _close(got, want)
    torch.testing.assert_close(got, grouped_dense_gemv_triton(x, stacked, n, ids, x_div), atol=1e-2, rtol=2 ** -7)
