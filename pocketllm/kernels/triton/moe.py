"""Mixture-of-experts products on the GPU: every (token, expert) pair of a step multiplied in one
launch, with no host sync, so a decode step with experts is captured in a CUDA graph.

An expert projection is held as a stack: the E experts' matrices of N rows, one after the other
(GGUF: ``pack_gguf`` rows, multiplied by ``gguf.gguf_grouped_gemv``; dense: [E * N, K] in the
model's dtype, by ``_grouped_dense_kernel`` here).  Row p of a product is
``x[p // x_div] @ W[ids[p]].T``: the gate/up projection reads token p // top_k's activations
(x_div = top_k), the down projection its own row (x_div = 1).

Each pair reads its expert's weights: at a few tokens a step that is what a grouped GEMM reads
too; at many tokens the same expert is read once per token that chose it.  From
``FUSED_MIN_TOKENS`` tokens a step the pairs are sorted by expert on the device (``align``, no
host sync) and ``fused_moe`` multiplies each expert's pairs as one tile of rows on the tensor cores
(``gguf_mma.kernel`` with ``MOE``): every selected expert's weights are read once a row block of
its pairs.  Prefill steps take it too, up to ``FUSED_MAX_PAIRS_PER_EXPERT``; past that, and for
encodings without a tile decoder past the graphs' largest batch, the layer sorts by expert on the
host (layers/moe.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from pocketllm.core.gguf_types import block_size

# The grouped dense GEMV's tile: the fastest of benchmarks/kernels/bench_grouped_dense.py on the H200 at
# Qwen3-30B-A3B's expert shapes (results/h200-grouped-dense-sweep.txt: 36.4 us against 48.3 for 8 x 512
# on 4 warps; bf16 batch-1 decode 281.6 against 249.1 tok/s)
DENSE_CONFIG = dict(BLOCK_N=32, BLOCK_K=256, num_warps=2)
# From this many tokens a step the expert-sorted tile kernel, below it the grouped GEMV: measured
# on the H200 at the Qwen3-30B-A3B shapes (results/h200-fused-moe-kernels.txt), GGUF experts
# broke even at 32 tokens and gained 1.2x at 64; dense ones gained from 16.
FUSED_MIN_TOKENS = {"gguf": 48, "dense": 16}
# Up to this many pairs per expert on average a step: past it (long prefills over few experts)
# dequantizing each expert once for a cuBLAS GEMM beats decoding its weights once per row block.
# Measured end to end: Qwen3-30B-A3B prefill (512 pairs an expert) 8.0x faster tiled, gpt-oss-20b
# (1,024) 0.72x.
FUSED_MAX_PAIRS_PER_EXPERT = 512
# Pairs a row block: the tensor cores' smallest tile side for decode steps (a few pairs an
# expert), larger for prefill, where an expert has many.
FUSED_BLOCK_M, FUSED_BLOCK_M_PREFILL, PREFILL_TOKENS = 16, 64, 64
MMQ_MAX_BLOCK_M = 32  # row blocks up to this many pairs take cuda/gguf_mmq.cu where it has the type (16 bits)
ONE_HOT_MAX = 1 << 22  # align: pairs x experts up to which ranks come from a running count, not a sort
FUSED_DENSE_CONFIG = dict(BLOCK_N=64, BLOCK_K=64, num_warps=4)
# GGUF experts: the tile the expert-sorted path was measured with (results/h200-fused-moe-kernels.txt),
# with the per-type tiles of gguf.MMA_TYPE_CONFIG; the dense products' later tile (gguf.MMA_CONFIG,
# swept with K splits, which this path has none of) was not timed on expert shapes.
FUSED_GGUF_CONFIG = dict(BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=1)


@triton.jit
def _grouped_dense_kernel(x_ptr, w_ptr, ids_ptr, y_ptr, N, K, x_div, stride_xm, stride_ym,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[m, n] = sum_k x[m // x_div, k] * W[ids[m] * N + n, k], float32 sums."""
    pid_n, m = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.load(ids_ptr + m).to(tl.int64) * N + n
    x_row = x_ptr + (m // x_div).to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * K + kk[None, :], mask=(n < N)[:, None] & (kk < K)[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(y_ptr + m * stride_ym + n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=n < N)


def grouped_dense_gemv(x: torch.Tensor, stacked: torch.Tensor, n: int, ids: torch.Tensor,
                       x_div: int = 1) -> torch.Tensor:
    """[P, n] in x's dtype: row p = ``x[p // x_div] @ stacked[ids[p] * n : (ids[p] + 1) * n].T``
    for a dense stack [E * n, K]; ``ids`` (P of them) not checked. On CUDA in bf16 / fp16 the CUDA C GEMV
    (``kernels/cuda/dense_gemv.cu``, which streams the weights faster), else the Triton kernel."""
    k = stacked.shape[1]
    assert stacked.shape[0] % n == 0 and x.shape[1] == k and stacked.is_contiguous(), (stacked.shape, n, x.shape)
    ids = ids.reshape(-1).contiguous()
    x = x.contiguous()
    if x.is_cuda:
        from pocketllm.kernels.cuda import dense_gemv

        out = dense_gemv.grouped(x, stacked, n, ids, x_div) if dense_gemv.usable(x, stacked) else None
        if out is not None:
            return out
    return grouped_dense_gemv_triton(x, stacked, n, ids, x_div)


def grouped_dense_gemv_triton(x: torch.Tensor, stacked: torch.Tensor, n: int, ids: torch.Tensor,
                               x_div: int = 1) -> torch.Tensor:
    """``grouped_dense_gemv``'s product on the Triton kernel (x contiguous)."""
    k = stacked.shape[1]
    ids = ids.reshape(-1).contiguous()
    out = torch.empty((ids.numel(), n), dtype=x.dtype, device=x.device)
    if ids.numel():
        cfg = DENSE_CONFIG
        _grouped_dense_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), ids.numel())](
            x, stacked, ids, out, n, k, x_div, x.stride(0), out.stride(0), BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"])
    return out


@triton.jit
def _top_k_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, stride_l, K: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, SOFTMAX_OF_TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                  HAS_BIAS: tl.constexpr):
    """Token t's k experts and their weights from its router logits (+ the router's bias, in float32),
    largest first (the lowest index first among equal ones): softmax over all experts then the top k
    (renormalized to sum to 1 when RENORMALIZE), or SOFTMAX_OF_TOP_K the top k logits then their softmax."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    v = tl.load(logits_ptr + t * stride_l + e, mask=e < E, other=-float("inf")).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(bias_ptr + e, mask=e < E, other=0.0).to(tl.float32)
    if not SOFTMAX_OF_TOP_K:
        p = tl.exp(v - tl.max(v, 0))
        v = p / tl.sum(p, 0)
    v = tl.where(v == v, v, -float("inf"))  # NaN (a broken row): still k experts in range, as torch.topk
    j = tl.arange(0, BLOCK_K)
    top, ids = tl.zeros((BLOCK_K,), dtype=tl.float32), tl.zeros((BLOCK_K,), dtype=tl.int32)
    for i in tl.static_range(K):
        best = tl.max(v, 0)
        pick = tl.min(tl.where((v == best) & (e < E), e, E - 1), 0)
        top, ids = tl.where(j == i, best, top), tl.where(j == i, pick, ids)
        v = tl.where(e == pick, -float("inf"), v)
    if SOFTMAX_OF_TOP_K:
        p = tl.where(j < K, tl.exp(top - tl.max(tl.where(j < K, top, -float("inf")), 0)), 0.0)
        top = p / tl.sum(p, 0)
    elif RENORMALIZE:
        top = top / tl.sum(tl.where(j < K, top, 0.0), 0)
    tl.store(w_ptr + t * K + j, top, mask=j < K)
    tl.store(ids_ptr + t * K + j, ids.to(tl.int64), mask=j < K)


def top_k_route(logits: torch.Tensor, k: int, renormalize: bool, softmax_of_top_k: bool,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]) from router logits [T, E] (+ ``bias`` [E],
    added in float32), one launch: what ``layers.moe.SparseMoE.route`` computes with torch's softmax and topk."""
    t, n = logits.shape
    assert bias is None or bias.shape == (n,), (bias.shape, n)
    w = torch.empty((t, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, k), dtype=torch.int64, device=logits.device)
    if t:
        _top_k_kernel[(t,)](logits, logits if bias is None else bias, w, ids, n, logits.stride(0), K=k,
                            BLOCK_K=triton.next_power_of_2(k), BLOCK_E=triton.next_power_of_2(n),
                            SOFTMAX_OF_TOP_K=softmax_of_top_k, RENORMALIZE=renormalize, HAS_BIAS=bias is not None,
                            num_warps=1)
    return w, ids


@triton.jit
def _weighted_sum_kernel(y_ptr, w_ptr, out_ptr, bias_ptr, ids_ptr, n, stride_y, stride_o, stride_b,
                         K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """out[t] = sum_j w[t, j] * (y[t * K + j] (+ bias[ids[t, j]])), float32 sums in j's order."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(K):
        y = tl.load(y_ptr + (t * K + j) * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias_ptr + tl.load(ids_ptr + t * K + j) * stride_b + cols, mask=ok, other=0.0).to(tl.float32)
        acc += tl.load(w_ptr + t * K + j) * y
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def weighted_sum(y: torch.Tensor, weights: torch.Tensor, bias: torch.Tensor | None = None,
                 ids: torch.Tensor | None = None) -> torch.Tensor:
    """[T, N] in y's dtype: token t's k expert outputs (rows t * k .. t * k + k - 1 of ``y``, each
    plus row ids[t, j] of ``bias`` [E, N] if given) summed with its float32 ``weights`` [T, k], one launch."""
    t, k = weights.shape
    n = y.shape[1]
    assert y.shape[0] == t * k and y.stride(1) == 1, (y.shape, weights.shape)
    assert bias is None or (bias.shape[1] == n and bias.stride(1) == 1 and ids is not None and ids.numel() == t * k)
    out = torch.empty((t, n), dtype=y.dtype, device=y.device)
    block = min(triton.next_power_of_2(n), 1024)
    if t:
        _weighted_sum_kernel[(t, triton.cdiv(n, block))](
            y, weights.contiguous(), out, y if bias is None else bias, y if ids is None else ids.contiguous(), n,
            y.stride(0), out.stride(0), 0 if bias is None else bias.stride(0), K=k, BLOCK=block,
            HAS_BIAS=bias is not None)
    return out


class Routing(NamedTuple):
    """The (token, expert) pairs of a step sorted by expert for ``fused_moe``: ``pairs`` int32
    [blocks * block_m] (each expert's pairs from a row block's start, padded with P),
    ``experts`` int32 [blocks] (a row block's expert, -1 past the last), P the number of pairs."""
    pairs: torch.Tensor
    experts: torch.Tensor
    num_pairs: int
    block_m: int


def align(ids: torch.Tensor, num_experts: int, block_m: int | None = None) -> Routing:
    """Sort the pairs ``ids`` ([T, k]: the experts of token t) by expert into row blocks of
    ``block_m`` (by default as T says), on the device with shapes fixed by T, k and E alone
    (capturable in a CUDA graph)."""
    if block_m is None:
        block_m = FUSED_BLOCK_M if ids.shape[0] <= PREFILL_TOKENS else FUSED_BLOCK_M_PREFILL
    flat = ids.reshape(-1)
    p = flat.numel()
    blocks = triton.cdiv(p, block_m) + min(num_experts, p)  # each expert wastes less than a block
    if p * num_experts <= ONE_HOT_MAX:  # a pair's rank among its expert's: a cumulative count, no sort
        order = torch.arange(p, device=flat.device)
        seen = torch.cumsum(torch.arange(num_experts, device=flat.device)[:, None] == flat, 1, dtype=torch.int32)
        counts, rank, expert = seen[:, -1].long(), seen[flat, order].long() - 1, flat
    else:
        counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        order = torch.argsort(flat, stable=True)
        expert = flat[order]
        rank = torch.arange(p, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pairs = torch.full((blocks * block_m,), p, dtype=torch.int32, device=flat.device)
    pairs.scatter_(0, (pad_end - padded)[expert] + rank, order.to(torch.int32))
    starts = torch.arange(blocks, device=flat.device) * block_m
    experts = torch.searchsorted(pad_end, starts, right=True).to(torch.int32)
    return Routing(pairs, torch.where(experts < num_experts, experts, -1).to(torch.int32), p, block_m)


def fused_moe(x: torch.Tensor, stacked: torch.Tensor, qtype: GGMLQuantizationType | None, k: int, n: int,
              routing: Routing, x_div: int = 1) -> torch.Tensor:
    """[P, n] in x's dtype: row p = ``x[p // x_div] @ W_e.T`` for pair p's expert e, every expert's
    pairs one tile of rows.  ``stacked``: the experts' ``pack_gguf`` rows for ``qtype`` (a type of
    ``gguf_mma.MMA_TYPES``), or for None a dense [E * n, k] stack in x's dtype.  On CUDA, 16-bit
    activations in row blocks of up to MMQ_MAX_BLOCK_M pairs take the integer tensor-core kernel
    (``cuda/gguf_mmq.cu``, 8-bit activations) where it has the type."""
    from pocketllm.kernels.triton import gguf as kg
    from pocketllm.kernels.triton import gguf_mma

    x = x.contiguous()
    if qtype is not None and x.dtype != torch.float32 and routing.block_m <= MMQ_MAX_BLOCK_M:
        from pocketllm.kernels.cuda import gguf_mmq
        from pocketllm.kernels.triton.int8_act import attached, quantize_activations

        if gguf_mmq.usable(qtype, x.device, k):  # the integer tensor-core kernel, for its types
            x8 = attached(x) or quantize_activations(x)
            return gguf_mmq.moe(*x8, stacked, qtype, k, n, routing, x_div, x.dtype)
    out = torch.empty((routing.num_pairs, n), dtype=x.dtype, device=x.device)
    blocks = routing.experts.numel()
    if qtype is None:
        assert stacked.dtype == x.dtype and stacked.shape[1] == k, (stacked.dtype, x.dtype, stacked.shape, k)
        cfg, row_bytes, hdr_start, n_blocks, consts = FUSED_DENSE_CONFIG, k, 0, 0, dict(QT=0, BPS=1)
    else:
        cfg = {**FUSED_GGUF_CONFIG, **kg.MMA_TYPE_CONFIG.get(qtype, {})}
        n_blocks, hdr_start, _ = kg.type_args(qtype, k)
        row_bytes, consts = stacked.shape[1], dict(QT=int(qtype), BPS=256 // block_size(qtype))
    gguf_mma.kernel[(triton.cdiv(n, cfg["BLOCK_N"]), 1, blocks)](
        x, stacked, out, routing.pairs, routing.experts, routing.num_pairs, n, row_bytes, hdr_start, n_blocks,
        n_blocks, x_div, x.stride(0), 0, out.stride(0), **consts, BLOCK_M=routing.block_m, BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], STAGES=cfg.get("num_stages", 1), WIDEN=kg.INTERPRET, MOE=True,
        DENSE=qtype is None, num_warps=cfg["num_warps"])
    return out
