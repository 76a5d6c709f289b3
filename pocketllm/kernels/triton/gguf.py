"""GGUF matrix products on NVIDIA GPUs: ``y = x @ W.T`` with ``W`` kept in its GGUF blocks.

``W`` is a GGUF weight, ``uint8 [N, row_bytes]`` (row n = output feature n, its K inputs as
consecutive GGUF blocks).  ``pack_gguf`` re-lays each row once, at load: its blocks' bodies (the
codes) first, then their headers (the fp16 scales and sub-scales) - the same bytes, the same size.
Every body is a multiple of 16 bytes, so code loads are 16-byte vectors for every type (in file
order, Q8_0's 34-byte and Q6_K's 210-byte blocks allow 2-byte loads only).
``pocketllm/quant/dequant.py`` is the reference for every format; TRITON_GGUF_TYPES lists the
covered types (every quantized type: the legacy, K, IQ4 and MXFP4 types, and the IQ1/IQ2/IQ3 lattice types).

One small ``@triton.jit`` helper per type family (``_q4_k``, ``_q6_k``, ``_q8_0``, ...) decodes
chunks of 16 consecutive weights of a tile of rows, as ``(v, a, c)``: codes as floats ``v``
[rows, chunks, 4, 4] and the chunk's scale ``a`` and offset ``c``, weights ``v * a + c`` with
dequant.py's products.  A chunk's codes are four int32 words of the body, split by shifts; codes
become floats by the exponent trick (``u2f``: Hopper converts integers at an eighth of its FMA
rate).  The kernels walk K a step of whole blocks at a time, so which group and bits a lane
reads is fixed: all shift amounts are hoisted out of the loop.

The regimes (``gguf_matmul``'s ``auto`` picks one by the table of ``kernels/dispatch.py``):

* ``"gemv"`` (decode rows): one program per activation row and tile of ``BLOCK_N`` weight rows; per
  chunk ``a * sum(v * x) + c * sum(x)``, sums inside a thread, scales out of the inner product,
  float32.  When there are fewer tiles than SMs, K is split over programs (``split_k``) and the
  partial sums added after (deterministic).
* ``"gemv_q8"`` (decode rows of bfloat16 / float16 activations, for ``gguf_q8.Q8_TYPES``): the
  same shape of work on 8-bit activations and integer dot products (``gguf_q8.py``), llama.cpp's
  method: a few instructions per weight instead of ~14; not exact (the activations' rounding).
  ``"cuda_gemv"`` is the CUDA C kernel of the same product (``cuda/gguf_gemv.py``).
* ``"mma"``: a tensor-core tile kernel (``gguf_mma.py``) that decodes each weight tile once per 64
  rows into registers, in K's natural order, straight into ``tl.dot``.
* ``"mmq"`` / ``"mmq_x16"``: the integer tensor-core tiles of ``cuda/gguf_mmq.cu`` and their bf16 form.
* ``"dequant"`` (batched decode and prefill otherwise): the weight is decoded to x's dtype into one
  reusable scratch buffer (at most ``SCRATCH_ELEMS`` weights, a slice of rows at a time) and
  multiplied by cuBLAS.  Decoding costs a read of the GGUF bytes and a write and read of the dense
  slice; the scratch buffer's size does not depend on M, so the CUDA-graph warm-up (largest batch
  first, eager) allocates it before any capture.

Tile shapes are module constants (``GEMV_CONFIG``, ``DEQUANT_CONFIG``, ``MMA_CONFIG``), the fastest
of ``benchmarks/kernels/bench_triton_gguf.py --sweep`` on the H200; ``--regimes`` times the regimes' crossovers.
``benchmarks/tools/triton_gguf_sass.py`` counts what a kernel's inner loop executes (sm_90, without a GPU).

Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (how the CPU tests check them);
the interpreter's ``tl.dot`` mishandles bfloat16, so there the dot kernel widens both operands
to float32 after rounding the weights to the activation dtype (same values, same products).
"""
from __future__ import annotations

import os
from functools import cache
from typing import NamedTuple

import gguf.quants as gq
import numpy as np
import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from pocketllm.core.gguf_types import block_size, row_nbytes, type_size
from pocketllm.kernels import dispatch

T = GGMLQuantizationType

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# type ids as the kernels see them (globals a kernel reads must be constexpr)
Q4_0 = tl.constexpr(int(T.Q4_0))
Q4_1 = tl.constexpr(int(T.Q4_1))
Q5_0 = tl.constexpr(int(T.Q5_0))
Q5_1 = tl.constexpr(int(T.Q5_1))
Q8_0 = tl.constexpr(int(T.Q8_0))
Q2_K = tl.constexpr(int(T.Q2_K))
Q3_K = tl.constexpr(int(T.Q3_K))
Q4_K = tl.constexpr(int(T.Q4_K))
Q5_K = tl.constexpr(int(T.Q5_K))
Q6_K = tl.constexpr(int(T.Q6_K))
IQ4_NL = tl.constexpr(int(T.IQ4_NL))
IQ4_XS = tl.constexpr(int(T.IQ4_XS))
MXFP4 = tl.constexpr(int(T.MXFP4))
IQ2_XXS = tl.constexpr(int(T.IQ2_XXS))
IQ2_XS = tl.constexpr(int(T.IQ2_XS))
IQ2_S = tl.constexpr(int(T.IQ2_S))
IQ3_XXS = tl.constexpr(int(T.IQ3_XXS))
IQ3_S = tl.constexpr(int(T.IQ3_S))
IQ1_S = tl.constexpr(int(T.IQ1_S))
IQ1_M = tl.constexpr(int(T.IQ1_M))
_FP4_X2 = tl.constexpr(0xC8643210 - (1 << 32))  # nibble i: twice E2M1 magnitude i (an int32)
KS = tl.constexpr(128)  # lattice tables (value_table): where the grid's int32 words start
IQ1_DELTA = tl.constexpr(float(gq.IQ1_S.delta))


# ---- field loads ------------------------------------------------------------------------------
# A step's weights are handled in chunks of 16 consecutive weights, shaped [R, H, 4, 4] (row,
# chunk, word, byte lane): whatever the type, each bit plane of a chunk's codes (8-bit codes,
# nibbles, 2-bit crumbs or high bits) is one bit field of 16 contiguous bytes of its block's body,
# loaded as four int32 words and split by shifts: 16-byte loads, a shift and a mask per code.

@triton.jit
def u8(p, mask):
    """The byte at ``p`` as int32 (0 where masked off)."""
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _half_byte(p, i, mask):
    """4-bit field ``i`` of the bytes at ``p`` (low nibble first), as int32."""
    return (u8(p + i // 2, mask) >> (4 * (i % 2))) & 15


@triton.jit
def f16(p, mask):
    """The little-endian fp16 at byte pointer ``p`` as float32 (headers keep fp16 fields 2-aligned)."""
    return tl.load(p.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _bits(p, shift, nbits: tl.constexpr, mask):
    """Bits ``shift .. shift + nbits`` of the 16 bytes at ``p`` [R, H, 1, 1] (4-aligned), byte
    ``4 * w + lane`` -> element [R, H, w, lane]."""
    w = tl.arange(0, 4)[None, None, :, None]
    lane = tl.arange(0, 4)[None, None, None, :]
    words = tl.load((p + 4 * w).to(tl.pointer_type(tl.int32)), mask=mask, other=0)
    return (words >> (8 * lane + shift)) & ((1 << nbits) - 1)


@triton.jit
def u2f(u, bias: tl.constexpr = 0.0):
    """int32 ``0 <= u < 2**23`` to float32 ``u - bias``, exactly: ``u`` as the mantissa of 2**23,
    minus 2**23 + bias (one FADD; Hopper converts integers at 16 per clock per SM, FADDs at 128)."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)


@triton.jit
def _nibbles(p, j0, mask):
    """A chunk of a 32-weight group in 16 bytes of nibbles (Q4_0 Q4_1 Q5_0 Q5_1 IQ4_NL MXFP4,
    IQ4_XS sub-blocks): weights 0-15 are the bytes' low nibbles, 16-31 their high nibbles."""
    return _bits(p, 4 * (j0 // 16), 4, mask)


@triton.jit
def _q5_high(p, j0, mask):
    """Q5_0 / Q5_1: bit j of the little-endian 32-bit field at ``p`` (2-aligned), for the
    chunk's weights j = j0 + 4 * w + lane."""
    w = tl.arange(0, 4)[None, None, :, None]
    lane = tl.arange(0, 4)[None, None, None, :]
    qh = tl.load(p.to(tl.pointer_type(tl.uint16)), mask=mask, other=0).to(tl.int32)
    qh = qh | (tl.load((p + 2).to(tl.pointer_type(tl.uint16)), mask=mask, other=0).to(tl.int32) << 16)
    return (qh >> (j0 + 4 * w + lane)) & 1


@triton.jit
def _table(lut_ptr, q):
    """Value table lookup (IQ4_NL / IQ4_XS / MXFP4): a 16-entry float32 table, cached in L1."""
    return tl.load(lut_ptr + q)


# ---- one helper per type family ---------------------------------------------------------------
# b: the block's body (its codes) [R, H, 1, 1], h: its header (scales), s: the chunk's group in
# its block [1, H, 1, 1], j0: the chunk's first weight in that group.  Each returns (v [R, H, 4, 4],
# a [R, H, 1, 1], c [R, H, 1, 1] or 0.0): weights w = v * a + c, the products in the order of
# dequant.py (a = d * sub-scale, c = -dmin * sub-min).  Offsets are those of ``_LAYOUT``.

@triton.jit
def _q8_0(b, h, s, j0, mask):
    # h: fp16 d | b: 32 int8 codes (flipping the sign bit makes them offset-128 bytes)
    return u2f(_bits(b + j0, 0, 8, mask) ^ 0x80, 128.0), f16(h, mask), 0.0


@triton.jit
def _q4_0(b, h, s, j0, mask):
    # h: fp16 d | b: 16 bytes of nibbles
    return u2f(_nibbles(b, j0, mask), 8.0), f16(h, mask), 0.0


@triton.jit
def _q4_1(b, h, s, j0, mask):
    # h: fp16 d, fp16 m | b: 16 bytes of nibbles
    return u2f(_nibbles(b, j0, mask)), f16(h, mask), f16(h + 2, mask)


@triton.jit
def _q5_0(b, h, s, j0, mask):
    # h: fp16 d, 32 high bits | b: 16 bytes of nibbles
    q = _nibbles(b, j0, mask) | (_q5_high(h + 2, j0, mask) << 4)
    return u2f(q, 16.0), f16(h, mask), 0.0


@triton.jit
def _q5_1(b, h, s, j0, mask):
    # h: fp16 d, fp16 m, 32 high bits | b: 16 bytes of nibbles
    q = _nibbles(b, j0, mask) | (_q5_high(h + 4, j0, mask) << 4)
    return u2f(q), f16(h, mask), f16(h + 2, mask)


@triton.jit
def _iq4_nl(b, h, s, j0, mask, lut_ptr):
    # h: fp16 d | b: 16 bytes of nibbles indexing the value table
    return _table(lut_ptr, _nibbles(b, j0, mask)), f16(h, mask), 0.0


@triton.jit
def fp4_x2(c):
    """Twice the E2M1 magnitude of FP4 codes ``c`` (int32; the sign bit 3 ignored): 0 1 2 3 4 6 8 12."""
    return ((tl.zeros_like(c) + _FP4_X2) >> ((c & 7) * 4)) & 15


@triton.jit
def e8m0_half(e):
    """Half the E8M0 scale of exponent byte ``e`` (int32) as float32: ggml_e8m0_to_fp32_half (the
    value tables hold twice the E2M1 values)."""
    return tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4(b, h, s, j0, mask, lut_ptr):
    # h: e8m0 exponent | b: 16 bytes of nibbles indexing the value table
    return _table(lut_ptr, _nibbles(b, j0, mask)), e8m0_half(u8(h, mask)), 0.0


@triton.jit
def scale_min_k4(p, s, mask):
    """Q4_K / Q5_K: the 6-bit scale and min of sub-block s from the 12 bytes at ``p``."""
    t = s % 4
    a, c, e = u8(p + t, mask), u8(p + 4 + t, mask), u8(p + 8 + t, mask)
    first = s < 4
    sc = tl.where(first, a & 63, (e & 0xF) | ((a >> 2) & 0x30))
    mn = tl.where(first, c & 63, (e >> 4) | ((c >> 2) & 0x30))
    return sc, mn


@triton.jit
def _q4_k(b, h, s, j0, mask):
    # h: fp16 d, fp16 dmin, 12 bytes of scales/mins | b: 128 bytes, sub-blocks 2i, 2i+1 share 32
    sc, mn = scale_min_k4(h + 4, s, mask)
    q = _bits(b + 32 * (s // 2) + j0, 4 * (s % 2), 4, mask)
    return u2f(q), f16(h, mask) * u2f(sc), -(f16(h + 2, mask) * u2f(mn))


@triton.jit
def _q5_k(b, h, s, j0, mask):
    # as Q4_K; b: 32 bytes of high bits (bit s of byte j), then the 128 bytes of nibbles
    sc, mn = scale_min_k4(h + 4, s, mask)
    q = _bits(b + 32 + 32 * (s // 2) + j0, 4 * (s % 2), 4, mask) | (_bits(b + j0, s, 1, mask) << 4)
    return u2f(q), f16(h, mask) * u2f(sc), -(f16(h + 2, mask) * u2f(mn))


@triton.jit
def _q6_k(b, h, s, j0, mask):
    # h: 16 int8 scales, fp16 d | b: 128 bytes of low nibbles, 64 of 2-bit highs; two halves of 128
    half, t = s // 8, s % 8
    lo = _bits(b + 64 * half + 16 * (t % 4) + j0, 4 * (t // 4), 4, mask)
    hi = _bits(b + 128 + 32 * half + 16 * (t % 2) + j0, 2 * (t // 2), 2, mask)
    sc = u2f(u8(h + s, mask) ^ 0x80, 128.0)
    return u2f(lo | (hi << 4), 32.0), f16(h + 16, mask) * sc, 0.0


@triton.jit
def _crumbs(p, s, j0, mask):
    """2-bit codes of Q2_K / Q3_K (64 bytes at ``p``): two halves of 128 weights, each four 2-bit
    planes of 32 bytes."""
    t = s % 8
    return _bits(p + 32 * (s // 8) + 16 * (t % 2) + j0, 2 * (t // 2), 2, mask)


@triton.jit
def _q2_k(b, h, s, j0, mask):
    # h: 16 bytes of 4-bit scale | 4-bit min, fp16 d, fp16 dmin | b: 64 bytes of 2-bit codes
    m = u8(h + s, mask)
    a = f16(h + 16, mask) * u2f(m & 0xF)
    return u2f(_crumbs(b, s, j0, mask)), a, -(f16(h + 18, mask) * u2f(m >> 4))


@triton.jit
def _q3_k(b, h, s, j0, mask):
    # h: 12 bytes of 6-bit scales (8 bytes of low nibbles, 4 of 2-bit highs), fp16 d
    # b: 32 bytes of high bits (bit s // 2 of byte 16 * (s % 2) + j; clear means -4), 64 of 2-bit codes
    lo = (u8(h + s % 8, mask) >> (4 * (s // 8))) & 0xF
    hi = (u8(h + 8 + s % 4, mask) >> (2 * (s // 4))) & 3
    q = _crumbs(b + 32, s, j0, mask) | (_bits(b + 16 * (s % 2) + j0, s // 2, 1, mask) << 2)
    return u2f(q, 4.0), f16(h + 12, mask) * u2f(lo | (hi << 4), 32.0), 0.0


@triton.jit
def _iq4_xs(b, h, s, j0, mask, lut_ptr):
    # h: fp16 d, 16-bit word of 2-bit scale highs, 4 bytes of 4-bit scale lows | b: 8 x 16 bytes
    hi = (u8(h + 2 + s // 4, mask) >> (2 * (s % 4))) & 3
    lo = _half_byte(h + 4, s, mask)
    a = f16(h, mask) * u2f(lo | (hi << 4), 32.0)
    return _table(lut_ptr, _nibbles(b + 16 * s, j0, mask)), a, 0.0


# ---- the lattice types (IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S) --------------------------
# A grid entry expands one index into 8 (IQ1, IQ2) or 4 (IQ3) weights: the table (``value_table``)
# holds the grid's bytes as int32 words after llama.cpp's 128 sign masks (``ksigns``: a 7-bit index
# plus its parity bit).  In a chunk [R, H, 4, 4] the 8-weight groups are word pairs (w // 2), and
# weight (w % 2) * 4 + lane of its group is byte ``lane`` of word w.  Weights: v = +-grid (IQ2, IQ3)
# or grid + delta (IQ1), a = the group's scale, as dequant.py multiplies them.

@triton.jit
def _lanes():
    return tl.arange(0, 4)[None, None, :, None], tl.arange(0, 4)[None, None, None, :]


@triton.jit
def u16(p, mask):
    """The little-endian uint16 at byte pointer ``p`` (2-aligned) as int32."""
    return tl.load(p.to(tl.pointer_type(tl.uint16)), mask=mask, other=0).to(tl.int32)


@triton.jit
def u32(p, mask):
    """The little-endian 32-bit word at byte pointer ``p`` (4-aligned), as int32."""
    return tl.load(p.to(tl.pointer_type(tl.int32)), mask=mask, other=0)


@triton.jit
def _grid8(lut_ptr, e, w, lane):
    """Grid bytes of 8-wide entries ``e`` [R, H, 4, 1] (one per word pair) as int32 [R, H, 4, 4]."""
    return (tl.load(lut_ptr + KS + 2 * e + w % 2) >> (8 * lane)) & 0xFF


@triton.jit
def _grid4(lut_ptr, e, lane):
    """Grid bytes of 4-wide entries ``e`` [R, H, 4, 1] (one per word) as int32 [R, H, 4, 4]."""
    return (tl.load(lut_ptr + KS + e) >> (8 * lane)) & 0xFF


@triton.jit
def _signed(g, masks, w, lane):
    """Grid bytes ``g`` as floats, negated where the group's sign mask [R, H, 4, 1] has their bit."""
    v = u2f(g)
    return tl.where(((masks >> ((w % 2) * 4 + lane)) & 1) != 0, -v, v)


@triton.jit
def _iq2_xxs(b, h, s, j0, mask, lut_ptr):
    # h: fp16 d | b: per group of 32, 4 grid indices (bytes), then a word of 4 x 7-bit sign indices
    # and a 4-bit scale
    w, lane = _lanes()
    g8 = j0 // 8 + w // 2
    aux = u32(b + 8 * s + 4, mask)
    signs = tl.load(lut_ptr + ((aux >> (7 * g8)) & 127))
    a = f16(h, mask) * (0.5 + u2f((aux >> 28) & 15)) * 0.25
    return _signed(_grid8(lut_ptr, u8(b + 8 * s + g8, mask), w, lane), signs, w, lane), a, 0.0


@triton.jit
def _iq2_xs(b, h, s, j0, mask, lut_ptr):
    # h: fp16 d, 8 bytes of 4-bit scales | b: 16-bit words of a 9-bit grid index, 7-bit sign index
    w, lane = _lanes()
    q = u16(b + 4 * s + 2 * (w // 2), mask)
    sc = _half_byte(h + 2, s, mask)
    a = f16(h, mask) * (0.5 + u2f(sc)) * 0.25
    return _signed(_grid8(lut_ptr, q & 511, w, lane), tl.load(lut_ptr + (q >> 9)), w, lane), a, 0.0


@triton.jit
def _iq2_s(b, h, s, j0, mask, lut_ptr):
    # h: fp16 d, 8 bytes of 2-bit grid index highs, 8 bytes of 4-bit scales | b: 32 bytes of grid
    # index lows, then 32 sign masks (one an entry)
    w, lane = _lanes()
    e = 2 * s + w // 2
    idx = u8(b + e, mask) | (((u8(h + 2 + e // 4, mask) >> (2 * (e % 4))) & 3) << 8)
    sc = _half_byte(h + 10, s, mask)
    a = f16(h, mask) * (0.5 + u2f(sc)) * 0.25
    return _signed(_grid8(lut_ptr, idx, w, lane), u8(b + 32 + e, mask), w, lane), a, 0.0


@triton.jit
def _iq3_xxs(b, h, s, j0, mask, lut_ptr):
    # h: fp16 d | b: 64 grid indices (4 weights each), then per group of 32 a word of 4 x 7-bit sign
    # indices and a 4-bit scale
    w, lane = _lanes()
    aux = u32(b + 64 + 4 * s, mask)
    signs = tl.load(lut_ptr + ((aux >> (7 * (j0 // 8 + w // 2))) & 127))
    a = f16(h, mask) * (0.5 + u2f((aux >> 28) & 15)) * 0.5
    return _signed(_grid4(lut_ptr, u8(b + 8 * s + j0 // 4 + w, mask), lane), signs, w, lane), a, 0.0


@triton.jit
def _iq3_s(b, h, s, j0, mask, lut_ptr):
    # h: fp16 d, 8 bytes of grid index high bits, 32 sign masks (one per 8 weights), 4 bytes of
    # 4-bit scales | b: 64 bytes of grid index lows
    w, lane = _lanes()
    e = j0 // 4 + w  # entry in the group
    idx = u8(b + 8 * s + e, mask) | (((u8(h + 2 + s, mask) >> e) & 1) << 8)
    signs = u8(h + 10 + 4 * s + j0 // 8 + w // 2, mask)
    a = f16(h, mask) * u2f(2 * _half_byte(h + 42, s, mask) + 1)
    return _signed(_grid4(lut_ptr, idx, lane), signs, w, lane), a, 0.0


@triton.jit
def _iq1_s(b, h, s, j0, mask, lut_ptr):
    # h: fp16 d, per group of 32 a 16-bit word: 4 x 3 grid index high bits, a 3-bit scale, the sign
    # of the group's delta | b: 32 bytes of grid index lows.  Grid bytes hold values + 1.
    w, lane = _lanes()
    g8 = j0 // 8 + w // 2
    qh = u16(h + 2 + 2 * s, mask)
    idx = u8(b + 4 * s + g8, mask) | (((qh >> (3 * g8)) & 7) << 8)
    delta = tl.where((qh & 0x8000) != 0, -IQ1_DELTA, IQ1_DELTA)
    a = f16(h, mask) * u2f(2 * ((qh >> 12) & 7) + 1)
    return u2f(_grid8(lut_ptr, idx, w, lane), 1.0) + delta, a, 0.0


@triton.jit
def iq1_m_d(h, mask):
    """IQ1_M's fp16 d, as float32: the top nibbles of the four 16-bit scale words at ``h + 16``."""
    dbits = ((u16(h + 16, mask) >> 12) | ((u16(h + 18, mask) >> 8) & 0xF0)
             | ((u16(h + 20, mask) >> 4) & 0xF00) | (u16(h + 22, mask) & 0xF000))
    return dbits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _iq1_m(b, h, s, j0, mask, lut_ptr):
    # h: 16 bytes of a nibble per grid entry (3 index high bits, the sign of its delta), 4 16-bit
    # words of 3-bit scales whose top nibbles hold the fp16 d | b: 32 bytes of grid index lows
    w, lane = _lanes()
    e = 2 * s + w // 2
    hq = _half_byte(h, e, mask)
    idx = u8(b + e, mask) | ((hq & 7) << 8)
    delta = tl.where((hq & 8) != 0, -IQ1_DELTA, IQ1_DELTA)
    a = iq1_m_d(h, mask) * u2f(2 * ((u16(h + 16 + 2 * (s // 4), mask) >> (3 * (s % 4))) & 7) + 1)
    return u2f(_grid8(lut_ptr, idx, w, lane), 1.0) + delta, a, 0.0


@triton.jit
def _decode(QT: tl.constexpr, BB: tl.constexpr, HB: tl.constexpr, w_ptr, row_off, hdr_start,
            blk, s, j0, mask, lut_ptr):
    """(v, a, c), weights ``v * a + c`` [R, H, 4, 4]: the chunks at weight ``j0`` of group ``s``
    of block ``blk`` (each [1, H, 1, 1]) of the packed rows at byte offsets ``row_off``
    [R, 1, 1, 1].  A packed row holds its blocks' bodies (BB bytes each) from 0 and their headers
    (HB bytes each) from ``hdr_start``."""
    row = w_ptr + row_off
    b = row + blk * BB
    h = row + hdr_start + blk * HB
    if QT == Q4_K:
        out = _q4_k(b, h, s, j0, mask)
    elif QT == Q6_K:
        out = _q6_k(b, h, s, j0, mask)
    elif QT == Q5_K:
        out = _q5_k(b, h, s, j0, mask)
    elif QT == Q8_0:
        out = _q8_0(b, h, s, j0, mask)
    elif QT == Q4_0:
        out = _q4_0(b, h, s, j0, mask)
    elif QT == Q4_1:
        out = _q4_1(b, h, s, j0, mask)
    elif QT == Q5_0:
        out = _q5_0(b, h, s, j0, mask)
    elif QT == Q5_1:
        out = _q5_1(b, h, s, j0, mask)
    elif QT == Q2_K:
        out = _q2_k(b, h, s, j0, mask)
    elif QT == Q3_K:
        out = _q3_k(b, h, s, j0, mask)
    elif QT == IQ4_XS:
        out = _iq4_xs(b, h, s, j0, mask, lut_ptr)
    elif QT == IQ4_NL:
        out = _iq4_nl(b, h, s, j0, mask, lut_ptr)
    elif QT == IQ2_XXS:
        out = _iq2_xxs(b, h, s, j0, mask, lut_ptr)
    elif QT == IQ2_XS:
        out = _iq2_xs(b, h, s, j0, mask, lut_ptr)
    elif QT == IQ2_S:
        out = _iq2_s(b, h, s, j0, mask, lut_ptr)
    elif QT == IQ3_XXS:
        out = _iq3_xxs(b, h, s, j0, mask, lut_ptr)
    elif QT == IQ3_S:
        out = _iq3_s(b, h, s, j0, mask, lut_ptr)
    elif QT == IQ1_S:
        out = _iq1_s(b, h, s, j0, mask, lut_ptr)
    elif QT == IQ1_M:
        out = _iq1_m(b, h, s, j0, mask, lut_ptr)
    else:
        tl.static_assert(QT == MXFP4, "type without a Triton decoder")
        out = _mxfp4(b, h, s, j0, mask, lut_ptr)
    return out


# ---- kernels ----------------------------------------------------------------------------------
# Programs walk K a step of BPI blocks at a time; a split (a program axis) covers
# ``blocks_per_split`` blocks.  A chunk's group and lanes depend only on the chunk, not on the
# step, so the compiler hoists every shift amount out of the loop.

@triton.jit
def _chunks(S: tl.constexpr, SPB: tl.constexpr, BPI: tl.constexpr):
    """The H chunks of a step (chunk c: weights 16c .. 16c + 15 of the step): its block's offset
    in the step, its group s in that block, its first weight j0 in the group ([1, H, 1, 1] each),
    and the offsets of its weights in the step ([1, H, 4, 4])."""
    c = tl.arange(0, BPI * SPB * (S // 16))[None, :, None, None]
    g = c // (S // 16)
    k = c * 16 + 4 * tl.arange(0, 4)[None, None, :, None] + tl.arange(0, 4)[None, None, None, :]
    return g // SPB, g % SPB, (c % (S // 16)) * 16, k


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, lut_ptr, y_ptr, ids_ptr, N, row_bytes, hdr_start, n_blocks, blocks_per_split,
                 x_div, stride_xm, stride_ys, stride_ym,
                 QT: tl.constexpr, S: tl.constexpr, SPB: tl.constexpr, BB: tl.constexpr, HB: tl.constexpr,
                 HAS_C: tl.constexpr, BLOCK_N: tl.constexpr, BPI: tl.constexpr, STAGES: tl.constexpr,
                 GROUPED: tl.constexpr):
    """y[split, m, n] = this split's part of sum_k x[m, k] * W[n, k], float32, one activation row
    per program (axis 1).  Per chunk a * sum(v * x) + c * sum(x): scales stay out of the inner
    product, and a chunk's sums stay inside a thread.  GROUPED (mixture-of-experts): W is a stack
    of matrices of N rows, row m of the output uses matrix ids[m] and activation row m // x_div."""
    pid_n, m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # tiles on axis 0: up to 2**31
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows, x_m = n.to(tl.int64), m  # the weight rows and the activation row of this program
    if GROUPED:
        rows += tl.load(ids_ptr + m).to(tl.int64) * N
        x_m = m // x_div
    row_off = (rows * row_bytes)[:, None, None, None]
    mask_n = (n < N)[:, None, None, None]
    blk_off, s, j0, k = _chunks(S, SPB, BPI)
    b0 = pid_s * blocks_per_split
    b_end = tl.minimum(b0 + blocks_per_split, n_blocks)
    x_row = x_ptr + x_m.to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BPI * SPB * (S // 16), 1, 1), dtype=tl.float32)
    for bs in tl.range(b0, b_end, BPI, num_stages=STAGES):
        blk = bs + blk_off
        ok = blk < b_end
        v, a, off = _decode(QT, BB, HB, w_ptr, row_off, hdr_start, blk, s, j0, mask_n & ok, lut_ptr)
        x = tl.load(x_row + bs * (SPB * S) + k, mask=ok, other=0.0).to(tl.float32)  # [1, H, 4, 4]
        acc += a * tl.sum(tl.sum(v * x, axis=3, keep_dims=True), axis=2, keep_dims=True)
        if HAS_C:
            acc += off * tl.sum(tl.sum(x, axis=3, keep_dims=True), axis=2, keep_dims=True)
    y = tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)
    tl.store(y_ptr + pid_s * stride_ys + m * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _dequant_kernel(w_ptr, lut_ptr, out_ptr, ids_ptr, N, row_bytes, hdr_start, n_blocks, stride_on,
                    QT: tl.constexpr, S: tl.constexpr, SPB: tl.constexpr, BB: tl.constexpr, HB: tl.constexpr,
                    BLOCK_N: tl.constexpr, BPI: tl.constexpr, GATHER: tl.constexpr):
    """out[i, k] = W[i, k] (GATHER: W[ids[i], k], an embedding lookup) in out's dtype, i < N."""
    i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if GATHER:
        n = tl.load(ids_ptr + i, mask=i < N, other=0)
    else:
        n = i
    row_off = (n.to(tl.int64) * row_bytes)[:, None, None, None]
    blk_off, s, j0, k = _chunks(S, SPB, BPI)
    bs = tl.program_id(1) * BPI
    blk = bs + blk_off
    mask = (i < N)[:, None, None, None] & (blk < n_blocks)
    v, a, off = _decode(QT, BB, HB, w_ptr, row_off, hdr_start, blk, s, j0, mask, lut_ptr)
    ptrs = out_ptr + (i.to(tl.int64) * stride_on)[:, None, None, None] + bs * (SPB * S) + k
    tl.store(ptrs, (v * a + off).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, y_ptr, splits, numel, BLOCK: tl.constexpr):
    """y = sum over splits of part[split] (float32, in split order: deterministic), in y's dtype."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for sp in range(0, splits):
        acc += tl.load(part_ptr + sp * numel + i, mask=mask, other=0.0)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=mask)


# ---- host side --------------------------------------------------------------------------------

# type -> (S: weights per group sharing a scale, body start, body bytes) in one GGUF block; the
# body is the codes (a multiple of 16 bytes), the header is every other byte of the block, in order
_LAYOUT = {
    T.Q8_0: (32, 2, 32), T.Q4_0: (32, 2, 16), T.Q4_1: (32, 4, 16), T.Q5_0: (32, 6, 16),
    T.Q5_1: (32, 8, 16), T.IQ4_NL: (32, 2, 16), T.MXFP4: (32, 1, 16),
    T.Q2_K: (16, 16, 64), T.Q3_K: (16, 0, 96), T.Q4_K: (32, 16, 128), T.Q5_K: (32, 16, 160),
    T.Q6_K: (16, 0, 192), T.IQ4_XS: (32, 8, 128),
    T.IQ2_XXS: (32, 2, 64), T.IQ2_XS: (16, 2, 64), T.IQ2_S: (16, 2, 64), T.IQ3_XXS: (32, 2, 96),
    T.IQ3_S: (32, 2, 64), T.IQ1_S: (32, 2, 32), T.IQ1_M: (16, 0, 32),
}
TRITON_GGUF_TYPES: frozenset[GGMLQuantizationType] = frozenset(_LAYOUT)

SCRATCH_ELEMS = 1 << 26  # dequant regime: weights decoded at once (128 MiB in bf16)
_PACK_ROWS = 4096  # rows re-laid out at once by pack_gguf
ROW_ALIGN = 16  # packed rows are padded to a multiple of this many bytes (16-byte vector loads)

# Tile shapes: BLOCK_N output rows by BLOCK_K weights per step (rounded up to a whole GGUF block),
# the fastest of `benchmarks/kernels/bench_triton_gguf.py --sweep` on the H200 (results/h200-triton-gguf-sweep.txt:
# Q4_K and Q6_K at 4096x4096 and 14336x4096): few rows and long steps, no software pipelining (each
# thread keeps several 16-byte loads in flight itself). PROGRAMS_PER_SM: how many programs of the
# kernel an SM holds at once (by registers: 65536 / (32 * num_warps * registers), a little under);
# K is split over programs (_split_k) when there are too few row tiles to fill every SM.
# *_TYPE_CONFIG: per-type overrides (kernel_config merges them).  Shared memory (<= 227 KiB) and
# spills of every type x kernel x dtype are checked for sm_90 by tests/test_triton_gguf.py.
GEMV_CONFIG = dict(BLOCK_N=2, BLOCK_K=1024, num_warps=2, num_stages=1, PROGRAMS_PER_SM=8)
DEQUANT_CONFIG = dict(BLOCK_N=1, BLOCK_K=1024, num_warps=4)
# (mma, Q4_K: over M = 16, 32, 64 and the three 8B shapes, results/h200-triton-gguf-mma-programs-per-sm*.txt,
# twice the K splits of one program an SM took 11% less time in all than 128 x 128 on 8 warps; parts of
# 256 weights were 0.5% faster still, but spill at 64 rows on sm_90)
MMA_CONFIG = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1, PROGRAMS_PER_SM=2)  # BLOCK_M: 16..64
GEMV_TYPE_CONFIG: dict[GGMLQuantizationType, dict] = {  # the wider codes: one row (Q6_K measured)
    t: dict(BLOCK_N=1) for t in (T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4)}
DEQUANT_TYPE_CONFIG: dict[GGMLQuantizationType, dict] = {}
# MXFP4 (not swept): Q8_0's tile in parts of 128, which keeps 64 activation rows in registers
# without spilling on sm_90 (the H200 figures of results/h200-fused-moe-kernels-gpt-oss.txt were
# taken with parts of 256: the same instructions a weight, more registers).
MMA_TYPE_CONFIG: dict[GGMLQuantizationType, dict] = {T.Q8_0: dict(BLOCK_N=64, BLOCK_K=256, num_warps=4),
                                                      T.MXFP4: dict(BLOCK_N=64, BLOCK_K=128, num_warps=4)}
WAVE_EFFICIENCY = 0.9  # _split_k: the fewest splits whose programs fill their waves this well
SPLIT_MAX = 32  # at most this many K splits


def kernel_config(regime: str, qtype: GGMLQuantizationType) -> dict:
    """The tile config a regime's kernel uses for ``qtype`` (module defaults + per-type overrides)."""
    if regime == "gemv_q8":
        base, per_type = _q8().GEMV_Q8_CONFIG, _q8().GEMV_Q8_TYPE_CONFIG
    else:
        base, per_type = {"gemv": (GEMV_CONFIG, GEMV_TYPE_CONFIG),
                          "dequant": (DEQUANT_CONFIG, DEQUANT_TYPE_CONFIG), "mma": (MMA_CONFIG, MMA_TYPE_CONFIG)}[regime]
    return {**base, **per_type.get(T(qtype), {})}


_TABLES = {T.IQ4_NL: "IQ4_NL", T.IQ4_XS: "IQ4_NL", T.MXFP4: "MXFP4"}


_LATTICE = {T.IQ2_XXS: 0, T.IQ2_XS: 0, T.IQ2_S: 0, T.IQ3_XXS: 0, T.IQ3_S: 0, T.IQ1_S: 1, T.IQ1_M: 1}  # byte bias


@cache
def value_table(device: torch.device, qtype: GGMLQuantizationType) -> torch.Tensor:
    """The type's table on ``device``: the value table (float32 [16]) of IQ4_NL / IQ4_XS / MXFP4;
    for a lattice type int32 [128 + grid words]: llama.cpp's 128 sign masks (``ksigns``), then the
    grid's bytes (plus ``_LATTICE``'s bias: IQ1's values -1..1 as 0..2) as words; else a placeholder."""
    if qtype in _LATTICE:
        cls = getattr(gq, qtype.name)
        cls.init_grid()
        grid = (np.asarray(cls.grid).reshape(cls.grid_shape) + _LATTICE[qtype]).astype(np.uint8)
        words = np.frombuffer(grid.tobytes(), dtype="<i4")
        ks = np.frombuffer(bytes(gq.IQ2_XXS.ksigns), dtype=np.uint8)
        return torch.from_numpy(np.concatenate([ks.astype(np.int32), words]).astype(np.int32)).to(device)
    name = _TABLES.get(qtype)
    values = getattr(gq, name).kvalues if name else [0.0] * 16
    return torch.tensor(values, dtype=torch.float32, device=device)


@cache
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few programs, so split-K still gets exercised


def packed_row_nbytes(qtype: GGMLQuantizationType, k: int) -> int:
    """Bytes of a packed row of ``k`` weights: the GGUF row, padded to a multiple of ROW_ALIGN."""
    return triton.cdiv(row_nbytes(qtype, k), ROW_ALIGN) * ROW_ALIGN


def _check(qweight: torch.Tensor, qtype, k: int, packed: bool = False) -> GGMLQuantizationType:
    qtype = T(qtype)
    if qtype not in TRITON_GGUF_TYPES:
        names = ", ".join(sorted(t.name for t in TRITON_GGUF_TYPES))
        raise ValueError(f"no Triton GGUF kernel for {qtype.name}; covered: {names}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or not qweight.is_contiguous():
        raise ValueError("qweight must be a contiguous uint8 [N, row_bytes] tensor")
    want = packed_row_nbytes(qtype, k) if packed else row_nbytes(qtype, k)
    if qweight.shape[1] != want:
        raise ValueError(f"{qtype.name} {'packed ' if packed else ''}rows of {k} weights take {want} bytes, "
                         f"got {qweight.shape[1]}")
    return qtype


def pack_gguf(qweight: torch.Tensor, qtype: GGMLQuantizationType, k: int,
              device: torch.device | str | None = None) -> torch.Tensor:
    """Re-lay GGUF rows (uint8 [N, row_bytes]) for the kernels, on ``device`` (default: where
    ``qweight`` is): each row becomes its blocks' bodies (codes), then their headers (scales), the
    same bytes, then zeros up to a multiple of ROW_ALIGN = 16 bytes (uint8 [N, packed_row_nbytes];
    no padding when the GGUF row already is one, as in every real model shape).  Bodies are
    multiples of 16 bytes and rows start 16-byte aligned, so every body and the header region start
    16-byte aligned and every code load is a 16-byte load whatever the block size (Q8_0's 34, Q6_K's
    210), and the row size passed to the kernels is divisible by 16 (as Triton assumes, specialising)."""
    qtype = _check(qweight, qtype, k)
    _, b0, nbody = _LAYOUT[qtype]
    n, rb = qweight.shape
    nb, ts = k // block_size(qtype), type_size(qtype)
    prb = packed_row_nbytes(qtype, k)
    out = torch.empty((n, prb), dtype=torch.uint8, device=qweight.device if device is None else device)
    out[:, rb:] = 0
    value_table(out.device, qtype), num_sms(out.device)  # now: not first during a CUDA graph capture
    for r0 in range(0, n, _PACK_ROWS):
        r1 = min(n, r0 + _PACK_ROWS)
        blocks = qweight[r0:r1].to(out.device).view(r1 - r0, nb, ts)
        out[r0:r1, :nb * nbody] = blocks[:, :, b0:b0 + nbody].reshape(r1 - r0, -1)
        out[r0:r1, nb * nbody:rb] = torch.cat([blocks[:, :, :b0], blocks[:, :, b0 + nbody:]], 2).reshape(r1 - r0, -1)
    return out


def type_args(qtype: GGMLQuantizationType, k: int) -> tuple[int, int, dict]:
    """(blocks per row, header start in a packed row, the kernels' type constexprs)."""
    s, _, nbody = _LAYOUT[qtype]
    nb = k // block_size(qtype)
    return nb, nb * nbody, dict(QT=int(qtype), S=s, SPB=block_size(qtype) // s, BB=nbody,
                                HB=type_size(qtype) - nbody)


_OFFSET_TYPES = frozenset({T.Q4_1, T.Q5_1, T.Q2_K, T.Q4_K, T.Q5_K})  # w = v * a + c with c != 0


def _blocks_per_step(qtype: GGMLQuantizationType, block_k: int) -> int:
    return triton.next_power_of_2(max(1, block_k // block_size(qtype)))


def _split_k(n_tiles: int, n_blocks: int, bpi: int, device: torch.device, programs_per_sm: int) -> int:
    """K splits for ``n_tiles`` tiles of ``n_blocks`` blocks (steps of ``bpi``).  A kernel is only
    as fast as its last wave: with P programs and ``slots = programs_per_sm * SMs`` of them
    resident at once: with no more tiles than slots, the most splits (at most one per step) that
    still fit one wave (every program resident from the start, none left for a slow tail); with
    more, the fewest splits whose waves are at least WAVE_EFFICIENCY full on average
    (P / (slots * ceil(P / slots))), else the fullest.  Splitting costs a float32 partial sum per split and output
    element, added in
    split order by a second kernel (deterministic)."""
    if n_tiles >= num_sms(device):
        # Measured on the H200 (benchmarks/results/h200-triton-gguf-kernels.txt at ea7eee4, split sweep): once
        # every SM has a tile, more splits only cost (Q4_K 4096x4096: 1 split 32.1 us, 2: 34.7 us).
        return 1
    slots = max(1, programs_per_sm * num_sms(device))
    n_steps = triton.cdiv(n_blocks, bpi)
    best, best_eff = 1, 0.0
    for s in range(1, min(n_steps, SPLIT_MAX) + 1):
        p = n_tiles * triton.cdiv(n_blocks, _blocks_per_split(n_blocks, bpi, s))
        if n_tiles <= slots:  # one wave: as many programs as fit
            if p <= slots:
                best = s
            continue
        eff = p / (slots * triton.cdiv(p, slots))
        if eff >= WAVE_EFFICIENCY:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


def _blocks_per_split(n_blocks: int, bpi: int, splits: int) -> int:
    """Blocks of K per split: whole steps of ``bpi`` blocks where a split has at least one step,
    else whole blocks (the one step of a split is then partly masked off)."""
    per = triton.cdiv(n_blocks, max(1, min(splits, n_blocks)))
    return triton.cdiv(per, bpi) * bpi if per >= bpi else per


def _sum_splits(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """part float32 [splits, m, n] summed over splits, in order, into [m, n] of ``dtype`` (one kernel)."""
    splits, m, n = part.shape
    y = torch.empty((m, n), dtype=dtype, device=part.device)
    block = 1024
    _sum_splits_kernel[(triton.cdiv(m * n, block),)](part, y, splits, m * n, BLOCK=block, num_warps=4)
    return y


class _Plan(NamedTuple):
    n_blocks: int  # GGUF blocks of a row
    hdr_start: int
    targs: dict  # the type's constexpr arguments
    cfg: dict  # the tuned kernel configuration
    bpi: int  # blocks per inner step
    per_split: int  # blocks per split of K
    out: torch.Tensor  # [splits, rows, n]: x's dtype for one split, float32 partial sums for several


def launch_plan(regime: str, qtype: GGMLQuantizationType, k: int, x: torch.Tensor, rows: int, n: int,
          split_k: int | None, block_m: int | None = None) -> _Plan:
    """What a GGUF product's launch needs: the type's arguments, the kernel's configuration and the
    split of K for its output tiles (n / BLOCK_N times the rows, or rows / block_m of a tiled kernel)."""
    n_blocks, hdr_start, targs = type_args(qtype, k)
    cfg = kernel_config(regime, qtype)
    bpi = _blocks_per_step(qtype, 256 if regime == "mma" else cfg["BLOCK_K"])  # mma: steps of 256, parts of BLOCK_K
    if split_k is None:
        tiles = triton.cdiv(n, cfg["BLOCK_N"]) * (rows if block_m is None else triton.cdiv(rows, block_m))
        split_k = _split_k(tiles, n_blocks, bpi, x.device, cfg["PROGRAMS_PER_SM"])
    per_split = _blocks_per_split(n_blocks, bpi, split_k)
    splits = triton.cdiv(n_blocks, per_split)
    out = torch.empty((splits, rows, n), dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
    return _Plan(n_blocks, hdr_start, targs, cfg, bpi, per_split, out)


def reduce_splits(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A plan's output [splits, rows, n] as [rows, n] of ``dtype``."""
    return out[0] if out.shape[0] == 1 else _sum_splits(out, dtype)


def _q8():
    from pocketllm.kernels.triton import gguf_q8  # imports this module's helpers

    return gguf_q8


def _mma():
    from pocketllm.kernels.triton import gguf_mma  # imports this module's helpers

    return gguf_mma


def _mmq():
    from pocketllm.kernels.cuda import gguf_mmq  # imports this module's helpers

    return gguf_mmq


def gguf_matmul(x: torch.Tensor, qweight: torch.Tensor, qtype: GGMLQuantizationType, k: int, *,
                packed: bool = False, regime: str = "auto", split_k: int | None = None,
                x8=None) -> torch.Tensor:
    """``x @ W.T`` for ``x`` [M, k] (bf16 / fp16 / fp32) and ``W`` the GGUF weight ``qweight``
    (uint8 [N, row_bytes] of type ``qtype``, rows of ``k`` weights); [M, N] in x's dtype.

    ``packed``: ``qweight`` came from ``pack_gguf`` (do that once at load: without it, every
    call re-lays the weight out).  ``regime``: ``"auto"`` (``kernels/dispatch.py``'s table) or one of
    its kernels: ``"gemv"``, ``"gemv_q8"`` (8-bit activations, ``gguf_q8.py``; not exact), ``"cuda_gemv"``
    (the same in CUDA C, ``cuda/gguf_gemv.py``), ``"mma"``, ``"mmq"`` (8-bit activations on integer tensor
    cores, ``cuda/gguf_mmq.cu``; not exact), ``"mmq_x16"`` (its bf16 variant: bf16 activations, weights
    rounded to bf16; not exact) or ``"dequant"``.  ``split_k``: K splits of the gemv/mma/mmq kernels
    (None: enough programs to fill the GPU, see ``_split_k``).  ``x8``: x's 8-bit form
    (``int8_act.Int8Activations``) where its producer wrote one, for the kernels on 8-bit activations."""
    qtype = _check(qweight, qtype, k, packed)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        x = x.float()
    x = x.contiguous()
    if not packed:
        qweight = pack_gguf(qweight, qtype, k)
    m, n = x.shape[0], qweight.shape[0]
    if regime == "auto":
        regime = _auto(qtype, m, x, k)
    if regime not in dispatch.KERNELS:
        raise ValueError(f"regime must be auto or one of {', '.join(dispatch.KERNELS)}; got {regime!r}")
    if regime == "mma" and qtype not in _mma().MMA_TYPES:
        raise ValueError(f"no tensor-core tile kernel for {qtype.name}")
    if m == 0 or n == 0:
        return x.new_zeros(m, n)
    if regime == "dequant":
        return _dequant_matmul(x, qweight, qtype, k)
    if regime in ("gemv_q8", "cuda_gemv"):
        return _gemv_q8(regime, x, qweight, qtype, k, n, m, split_k, x8)
    if regime == "mmq":  # the integer tensor-core kernel of cuda/gguf_mmq.cu
        xq, xd, xs = _q8().quantize_activations(x) if x8 is None else x8
        return _mmq().mmq(xq, xd, xs, qweight, qtype, k, n, m, x.dtype, split_k)
    if regime == "mmq_x16":  # its bf16 variant
        return _mmq().mmq_x16(x.bfloat16(), qweight, qtype, k, n, split_k).to(x.dtype)
    if regime == "gemv":
        return _gemv(x, qweight, qtype, k, n, m, split_k)
    block_m = min(max(triton.next_power_of_2(m), 16), 64)
    plan = launch_plan(regime, qtype, k, x, m, n, split_k, block_m)
    _mma().launch(x, qweight, qtype, plan, block_m)
    return reduce_splits(plan.out, x.dtype)


def _auto(qtype: GGMLQuantizationType, m: int, x: torch.Tensor, k: int) -> str:
    """dispatch.gpu_gguf_kernel with what this device can run."""
    from pocketllm.kernels.cuda import gguf_gemv as cuda_gemv

    few = m <= dispatch.GEMV_MAX_M  # (decode rows: only the GEMVs' facts matter)
    mmq = not few and _mmq().usable(qtype, x.device, k)
    return dispatch.gpu_gguf_kernel(qtype, m, x.dtype, q8=qtype in _q8().Q8_TYPES,
                                    cuda_gemv=few and cuda_gemv.usable(qtype, x.device), mmq=mmq,
                                    mmq_x16=mmq and _mmq().x16_ok(qtype), aligned=x.data_ptr() % 16 == 0)


def _gemv_q8(kernel: str, x: torch.Tensor, packed: torch.Tensor, qtype: GGMLQuantizationType, k: int, n: int,
             rows: int, split_k: int | None = None, x8=None, ids: torch.Tensor | None = None,
             x_div: int = 1) -> torch.Tensor:
    """The GEMV on 8-bit activations: the CUDA C kernel (``"cuda_gemv"``; split_k does not apply), or
    Triton's (``"gemv_q8"``, also where the CUDA C one does not take the shape)."""
    if kernel == "cuda_gemv":
        from pocketllm.kernels.cuda import gguf_gemv as cuda_gemv

        xq, xd, xs = _q8().quantize_activations(x) if x8 is None else x8
        y = cuda_gemv.gemv(xq, xd, xs, packed, qtype, k, n, rows, x.dtype, ids=ids, x_div=x_div)
        if y is not None:
            return y
    return _q8().gemv_q8(x, packed, qtype, k, split_k, ids=ids, n=n, x_div=x_div, x8=x8)


def _gemv(x: torch.Tensor, packed: torch.Tensor, qtype: GGMLQuantizationType, k: int, n: int, rows: int,
          split_k: int | None = None, ids: torch.Tensor | None = None, x_div: int = 1) -> torch.Tensor:
    """The float GEMV's launch for ``rows`` output rows of ``n``: x's rows, or with ``ids`` the
    pairs of ``gguf_grouped_gemv`` (x row p // x_div times matrix ids[p] of the stack)."""
    plan = launch_plan("gemv", qtype, k, x, rows, n, split_k)
    block_n, out = plan.cfg["BLOCK_N"], plan.out
    _gemv_kernel[(triton.cdiv(n, block_n), rows, out.shape[0])](
        x, packed, value_table(x.device, qtype), out, out if ids is None else ids, n, packed.shape[1],
        plan.hdr_start, plan.n_blocks, plan.per_split, x_div, x.stride(0), out.stride(0), out.stride(1),
        **plan.targs, HAS_C=qtype in _OFFSET_TYPES, BLOCK_N=block_n, BPI=plan.bpi, STAGES=plan.cfg["num_stages"],
        GROUPED=ids is not None, num_warps=plan.cfg["num_warps"])
    return reduce_splits(out, x.dtype)


def gguf_grouped_gemv(x: torch.Tensor, stacked: torch.Tensor, qtype: GGMLQuantizationType, k: int, n: int,
                      ids: torch.Tensor, x_div: int = 1, x8=None) -> torch.Tensor:
    """Mixture-of-experts products: ``stacked`` holds E packed GGUF matrices of ``n`` rows
    (``pack_gguf`` of [E * n, k]); row p of the result [P, n] is ``x[p // x_div] @ W[ids[p]].T`` for
    the P = ``ids.numel()`` ids.  One launch, no host sync (CUDA-graph capturable), the GEMV's
    tiles; bf16 / fp16 activations of an int8-kernel type go through 8-bit activations as the
    dense ``auto`` regime does (``x8`` as for ``gguf_matmul``).  ``ids`` are not checked (in [0, E))."""
    qtype = _check(stacked, qtype, k, packed=True)
    if stacked.shape[0] % n or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"stacked [{stacked.shape[0]}, *] is not whole matrices of {n} rows, or x is not [*, {k}]")
    ids = ids.reshape(-1).contiguous()
    p = ids.numel()
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        x = x.float()
    x = x.contiguous()
    if p == 0:
        return x.new_zeros(0, n)
    kernel = _auto(qtype, 1, x, k)  # the pairs are decode rows: one of the GEMVs
    if kernel == "gemv":
        return _gemv(x, stacked, qtype, k, n, p, ids=ids, x_div=x_div)
    return _gemv_q8(kernel, x, stacked, qtype, k, n, p, x8=x8, ids=ids, x_div=x_div)


def gguf_dequantize(qweight: torch.Tensor, qtype: GGMLQuantizationType, k: int,
                    dtype: torch.dtype = torch.float32, *, packed: bool = False,
                    out: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The GGUF weight ``qweight`` (uint8 [N, row_bytes]; ``packed`` as for ``gguf_matmul``)
    decoded to ``dtype`` [N, k], into ``out`` if given (a row-contiguous [N, k] tensor); with
    ``rows`` (integer ids, any shape, each in [0, N): not checked, no host sync) only those rows,
    [*rows.shape, k] (an embedding lookup)."""
    qtype = _check(qweight, qtype, k, packed)
    if not packed:
        qweight = pack_gguf(qweight, qtype, k)
    ids = None if rows is None else rows.reshape(-1).to(qweight.device)
    n = qweight.shape[0] if ids is None else ids.numel()
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    if out.shape != (n, k) or out.stride(1) != 1:
        raise ValueError(f"out must be a row-contiguous [{n}, {k}] tensor")
    n_blocks, hdr_start, targs = type_args(qtype, k)
    cfg = kernel_config("dequant", qtype)
    bpi = _blocks_per_step(qtype, cfg["BLOCK_K"])
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(n_blocks, bpi))
    if n:
        _dequant_kernel[grid](qweight, value_table(qweight.device, qtype), out, out if ids is None else ids, n,
                              qweight.shape[1], hdr_start, n_blocks, out.stride(0), **targs, BLOCK_N=cfg["BLOCK_N"],
                              BPI=bpi, GATHER=ids is not None, num_warps=cfg["num_warps"])
    return out if rows is None else out.view(*rows.shape, k)


_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _scratch_buffer(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """One dense buffer per device and dtype, grown on demand and reused by every layer."""
    buf = _scratch.get((device, dtype))
    if buf is None or buf.numel() < numel:
        _scratch.pop((device, dtype), None)  # free the old one before allocating the larger
        buf = _scratch[(device, dtype)] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def _dequant_matmul(x: torch.Tensor, packed: torch.Tensor, qtype: GGMLQuantizationType, k: int) -> torch.Tensor:
    """x @ W.T, W decoded into the scratch buffer a slice of rows at a time."""
    n = packed.shape[0]
    step = max(1, min(n, SCRATCH_ELEMS // k))
    buf = _scratch_buffer(x.device, x.dtype, step * k)
    if step >= n:
        return x @ gguf_dequantize(packed, qtype, k, packed=True, out=buf.view(n, k)).T
    y = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        w = gguf_dequantize(packed[r0:r1], qtype, k, packed=True, out=buf[:(r1 - r0) * k].view(r1 - r0, k))
        y[:, r0:r1] = x @ w.T
    return y
