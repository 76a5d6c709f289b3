"""GGUF products on tensor cores for a few to a few dozen activation rows (batched decode).

``y = x @ W.T`` as ``gguf.py`` computes it, with ``W`` in ``pack_gguf``'s layout (a row's block
bodies, then its block headers).  The gemv kernels decode each weight once per activation row;
the dequant regime writes and re-reads the whole matrix in bf16 (three times the traffic of the
GGUF bytes at 4 bits).  Here each program walks K in steps of 256 weights (one super-block, or
eight 32-weight blocks), taken ``BLOCK_K`` weights at a time: it decodes a tile of ``BLOCK_N``
weight rows straight into registers, in K's natural order, and multiplies it on the tensor cores
with its ``BLOCK_M`` activation rows, ``acc[n, m] += W_tile[n, :] @ x_tile.T``.  Each weight byte is
read once per ``BLOCK_M`` rows.  Measured on the H200 (``results/h200-triton-gguf-mma.txt``) it is
bound by decoding (450-550 GB/s of K-type bytes, the same at 16 rows as at 64), which is still
1.1-1.5x faster than dequantize + cuBLAS for Q4_K.

The same kernel multiplies mixture-of-experts layers (``MOE``, driven by ``moe.fused_moe``): its row
blocks are then one expert's (token, expert) pairs, gathered as activation rows, against that
expert's weight rows, so each selected expert is decoded once per block of its pairs; ``DENSE``
takes dense expert stacks (in the activations' dtype) the same way.

The tile decoders shape a step as [rows, groups, weights of a group] so that a group's scale is a
[rows, groups, 1] broadcast, and every index is a function of the group and the weight's place in
it: loads of 16 or 32 contiguous code bytes, one shift and mask per weight, one FMA.  The weights
are rounded to the activations' dtype (as the dequant regime rounds them); float32 activations
take IEEE products (a correctness path).
"""
from __future__ import annotations

import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from pocketllm.core.gguf_types import block_size
from pocketllm.kernels.triton.gguf import INTERPRET, MXFP4, Q4_K, Q6_K, Q8_0, e8m0_half, f16, fp4_x2, scale_min_k4, u2f, u8

T = GGMLQuantizationType

MMA_TYPES = frozenset({T.Q4_K, T.Q6_K, T.Q8_0, T.MXFP4})  # the types with a tile decoder


@triton.jit
def _tile_q4_k(row, blk, g0: tl.constexpr, G: tl.constexpr, hdr_start, mask):
    """Groups g0 .. g0 + G - 1 of Q4_K super-block ``blk`` of the rows at ``row`` [R, 1, 1]:
    [R, G, 32] float32 (group, weight).  Body: 128 bytes, groups 2c and 2c + 1 in the low and high
    nibbles of bytes 32c .. 32c + 31.  Header: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins."""
    g = g0 + tl.arange(0, G)[None, :, None]
    j = tl.arange(0, 32)[None, None, :]
    q = (u8(row + blk * 128 + (g // 2) * 32 + j, mask) >> (4 * (g % 2))) & 15
    h = row + hdr_start + blk * 16
    sc, mn = scale_min_k4(h + 4, g, mask)
    return u2f(q) * (f16(h, mask) * u2f(sc)) - f16(h + 2, mask) * u2f(mn)


@triton.jit
def _tile_q6_k(row, blk, g0: tl.constexpr, G: tl.constexpr, hdr_start, mask):
    """Groups g0 .. g0 + G - 1 of Q6_K super-block ``blk``: [R, G, 16] float32.  Group
    8h + 2q + l1 holds weights 128h + 32q + 16l1 + l0: low nibble (q // 2) of byte
    64h + 32(q % 2) + 16l1 + l0 of ql, bits 2q of byte 32h + 16l1 + l0 of qh.  Body: ql (128
    bytes), qh (64); header: 16 int8 scales, fp16 d."""
    g = g0 + tl.arange(0, G)[None, :, None]
    l0 = tl.arange(0, 16)[None, None, :]
    h, q, l1 = g // 8, (g // 2) % 4, g % 2
    body = row + blk * 192 + 16 * l1 + l0
    lo = (u8(body + 64 * h + 32 * (q % 2), mask) >> (4 * (q // 2))) & 15
    hi = (u8(body + 128 + 32 * h, mask) >> (2 * q)) & 3
    hd = row + hdr_start + blk * 18
    sc = u2f(u8(hd + g, mask) ^ 0x80, 128.0)
    return u2f(lo | (hi << 4), 32.0) * (f16(hd + 16, mask) * sc)


@triton.jit
def _tile_q8_0(row, blk, G: tl.constexpr, hdr_start, mask):
    """Q8_0 blocks ``blk`` .. ``blk`` + G - 1 (``mask`` [R, G, 1] drops those past the split): [R, G, 32]."""
    b = blk + tl.arange(0, G)[None, :, None]
    j = tl.arange(0, 32)[None, None, :]
    q = u8(row + b * 32 + j, mask) ^ 0x80
    return u2f(q, 128.0) * f16(row + hdr_start + b * 2, mask)


@triton.jit
def _tile_mxfp4(row, blk, G: tl.constexpr, hdr_start, mask):
    """MXFP4 blocks ``blk`` .. ``blk`` + G - 1: [R, G, 2, 16], a block's low then high nibbles.
    Body: 16 bytes, weight j in the low nibble of byte j, 16 + j in the high one, an FP4 (E2M1)
    code: sign in bit 3, twice the magnitude 0 1 2 3 4 6 8 12; header: an E8M0 exponent, its scale
    halved (ggml_e8m0_to_fp32_half)."""
    b = blk + tl.arange(0, G)[None, :, None, None]
    half = tl.arange(0, 2)[None, None, :, None]
    row, mask = row[:, :, :, None], mask[:, :, :, None]
    q = (u8(row + b * 16 + tl.arange(0, 16)[None, None, None, :], mask) >> (4 * half)) & 15
    v = u2f(fp4_x2(q))  # twice the magnitude
    v = (v.to(tl.int32, bitcast=True) | ((q & 8) << 28)).to(tl.float32, bitcast=True)  # the sign bit
    return v * e8m0_half(u8(row + hdr_start + b, mask))


@triton.jit
def _gguf(x_ptr, w_ptr, w_rows, n, x_rows, m_ok, N, row_bytes, hdr_start, n_blocks, blocks_per_split, pid_s,
          stride_xm, QT: tl.constexpr, BPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_K: tl.constexpr, STAGES: tl.constexpr, WIDEN: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] of split ``pid_s``: GGUF weight rows ``w_rows`` decoded a tile at a time."""
    row = w_ptr + (w_rows * row_bytes)[:, None, None]
    mask_n = (n < N)[:, None, None]
    kk = tl.arange(0, BLOCK_K)
    b0 = pid_s * blocks_per_split
    b_end = tl.minimum(b0 + blocks_per_split, n_blocks)
    k_end = b_end * (256 // BPS)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for bs in tl.range(b0, b_end, BPS, num_stages=STAGES):
        for part in tl.static_range(256 // BLOCK_K):
            if QT == Q4_K:
                w = _tile_q4_k(row, bs, part * (BLOCK_K // 32), BLOCK_K // 32, hdr_start, mask_n)
            elif QT == Q6_K:
                w = _tile_q6_k(row, bs, part * (BLOCK_K // 16), BLOCK_K // 16, hdr_start, mask_n)
            else:  # 32-weight blocks: a step's last blocks may lie past the split's end
                blk = bs + part * (BLOCK_K // 32)
                mask_b = mask_n & (blk + tl.arange(0, BLOCK_K // 32)[None, :, None] < b_end)
                if QT == MXFP4:
                    w = _tile_mxfp4(row, blk, BLOCK_K // 32, hdr_start, mask_b)
                else:
                    tl.static_assert(QT == Q8_0, "type without a tile decoder")
                    w = _tile_q8_0(row, blk, BLOCK_K // 32, hdr_start, mask_b)
            w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(x_ptr.dtype.element_ty)
            k = bs * (256 // BPS) + part * BLOCK_K + kk
            xt = tl.load(x_ptr + x_rows[None, :] * stride_xm + k[:, None], mask=m_ok[None, :] & (k[:, None] < k_end),
                         other=0.0)
            acc = _dot(acc, w, xt, WIDEN)
    return acc


@triton.jit
def _dense(x_ptr, w_ptr, w_rows, n, x_rows, m_ok, N, K, stride_xm, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_K: tl.constexpr, WIDEN: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] for dense weight rows ``w_rows`` of K elements in x's dtype."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    w_row = w_ptr.to(x_ptr.dtype) + w_rows[:, None] * K
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_row + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        xt = tl.load(x_ptr + x_rows[None, :] * stride_xm + k[:, None], mask=m_ok[None, :] & (k[:, None] < K),
                     other=0.0)
        acc = _dot(acc, w, xt, WIDEN)
    return acc


@triton.jit
def _dot(acc, w, xt, WIDEN: tl.constexpr):
    if WIDEN:  # the interpreter's tl.dot reads bfloat16 as integers: same values in float32
        w, xt = w.to(tl.float32), xt.to(tl.float32)
    if w.dtype == tl.float32:
        return acc + tl.dot(w, xt, input_precision="ieee")
    return acc + tl.dot(w, xt)


@triton.jit
def kernel(x_ptr, w_ptr, y_ptr, pairs_ptr, experts_ptr, M, N, row_bytes, hdr_start, n_blocks, blocks_per_split,
           x_div, stride_xm, stride_ys, stride_ym,
           QT: tl.constexpr, BPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, STAGES: tl.constexpr, WIDEN: tl.constexpr, MOE: tl.constexpr,
           DENSE: tl.constexpr):
    """y[split, m, n] = this split's part of sum_k x[m, k] * W[n, k]: a step is BPS blocks (256
    weights), taken BLOCK_K weights at a time.  MOE: the M rows are (token, expert) pairs and W a
    stack of expert matrices of N rows; row block ``pid_m`` holds the pairs
    ``pairs[pid_m * BLOCK_M ...]`` (``M`` where padding) of expert ``experts[pid_m]`` (-1: none),
    pair p reading activation row p // x_div.  DENSE: W is [E * N, K] in x's dtype (K = row_bytes)."""
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    w_rows, x_rows = n.to(tl.int64), m.to(tl.int64)
    if MOE:
        e = tl.load(experts_ptr + pid_m)
        if e < 0:  # a row block past the last expert's
            return
        m = tl.load(pairs_ptr + m)
        w_rows += e.to(tl.int64) * N
        x_rows = (m // x_div).to(tl.int64)  # a long prefill's pairs x features can pass 2**31
    if DENSE:
        acc = _dense(x_ptr, w_ptr, w_rows, n, x_rows, m < M, N, row_bytes, stride_xm, BLOCK_N, BLOCK_M, BLOCK_K, WIDEN)
    else:
        acc = _gguf(x_ptr, w_ptr, w_rows, n, x_rows, m < M, N, row_bytes, hdr_start, n_blocks, blocks_per_split, pid_s,
                    stride_xm, QT, BPS, BLOCK_N, BLOCK_M, BLOCK_K, STAGES, WIDEN)
    ptrs = y_ptr + pid_s * stride_ys + m.to(tl.int64)[None, :] * stride_ym + n[:, None]
    tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=(m[None, :] < M) & (n[:, None] < N))


def launch(x, packed, qtype, plan, block_m: int) -> None:
    """Run ``kernel`` for ``gguf.py``'s plan (its BLOCK_N, splits and output)."""
    m, n = x.shape[0], packed.shape[0]
    block_n, out = plan.cfg["BLOCK_N"], plan.out
    kernel[(triton.cdiv(n, block_n), out.shape[0], triton.cdiv(m, block_m))](
        x, packed, out, out, out, m, n, packed.shape[1], plan.hdr_start, plan.n_blocks, plan.per_split, 1,
        x.stride(0), out.stride(0), out.stride(1), QT=int(qtype), BPS=256 // block_size(qtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=plan.cfg["BLOCK_K"], STAGES=plan.cfg["num_stages"],
        WIDEN=INTERPRET, MOE=False, DENSE=False, num_warps=plan.cfg["num_warps"])
