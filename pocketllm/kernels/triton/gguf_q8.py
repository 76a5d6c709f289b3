"""GGUF matrix-vector products on 8-bit activations: llama.cpp's decode method, in Triton.

The float GEMV of ``gguf.py`` spends ~14 instructions a weight unpacking codes to floats and
multiplying them (measured: instruction-bound at ~1.1 TB/s on the H200, where the memory moves
4.3).  Here the activations are quantized first, to int8 in blocks of 32 with a float scale
(``xd``) and the scaled sum of the block (``xs = xd * sum(q)``: llama.cpp's ``block_q8_1``), and each
weight block's dot product runs on integers: ``dp4a`` multiplies four code bytes by four activation
bytes and adds, so a 32-bit word of nibbles costs a mask, a shift and two instructions for 8
weights.  Per sub-block the integer sum is scaled once in float.  Not exact: the activations'
rounding (relative ~2**-8 per block) is the price, as in llama.cpp; ``gguf_matmul`` uses this for
bfloat16 / float16 activations only, float32 keeps the exact kernels.

Covered (``Q8_TYPES``): every type of ``TRITON_GGUF_TYPES``.  The legacy types (Q5_0 / Q5_1's
fifth bits spread into the bytes by one multiply), the K types (Q3_K's codes - 4 as a dp4a of -4s
beside the codes'), IQ4_NL, IQ4_XS and MXFP4 (each nibble looked up as an int8 of the type's table
by byte permutes, llama.cpp's ``get_int_from_table_16``: MXFP4's table holds twice the E2M1 values),
the lattice types IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (grid words gathered from the type's table,
their bytes negated per sign bit as ``(g ^ m) + (m & 1)`` with ``m`` the sign bits expanded to byte
masks in registers, 0xFF where set) and IQ1_S / IQ1_M (grid bytes 0..2, minus 1 plus the delta
through a second dp4a of ones).

Under ``TRITON_INTERPRET=1`` (the CPU tests) ``dp4a`` is computed by shifts: inline PTX does not
run there.
"""
from __future__ import annotations

import gguf.quants as gq
import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from .gguf import (  # the type ids as constexprs, and helpers
    INTERPRET,
    IQ1_DELTA,
    IQ1_M,
    IQ1_S,
    IQ2_S,
    IQ2_XS,
    IQ2_XXS,
    IQ3_S,
    IQ3_XXS,
    IQ4_NL,
    IQ4_XS,
    KS,
    MXFP4,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    e8m0_half,
    f16,
    iq1_m_d,
    launch_plan,
    reduce_splits,
    u2f,
    u8,
    u16,
    u32,
    value_table,
)
from .int8_act import Int8Activations, quantize_activations

T = GGMLQuantizationType

_LO = tl.constexpr(0x0F0F0F0F)
_NEG32 = tl.constexpr(-0x1F1F1F20)  # 0xE0E0E0E0: four bytes of -32
_NEG4 = tl.constexpr(-0x03030304)  # 0xFCFCFCFC: four bytes of -4


@triton.jit
def _dp4a(a, b, c, EMU: tl.constexpr):
    """c + the dot product of the four signed bytes of ``a`` and ``b`` (int32 words)."""
    a, b = tl.broadcast(a, b)
    if EMU:
        for i in tl.static_range(4):
            c += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return c
    else:
        c = tl.zeros_like(a) + c
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _x(p, mask):
    return tl.load(p, mask=mask, other=0)


# One function per type: the block's contribution [R, B] for R rows by B blocks.  b / h: byte
# pointers to each block's body / header [R, B]; xw: int32 pointer to the activation words of each
# block [1, B]; xd, xs: float pointers to its 32-blocks' scale and scaled sum [1, B].

@triton.jit
def _q8_0(b, h, xw, xd, xs, mask, xm, EMU: tl.constexpr):
    t = tl.arange(0, 8)[None, None, :]
    q = tl.load(b.to(tl.pointer_type(tl.int32))[:, :, None] + t, mask=mask[:, :, None], other=0)
    s = tl.sum(_dp4a(q, _x(xw[:, :, None] + t, xm[:, :, None]), 0, EMU), axis=2)
    return f16(h, mask) * _x(xd, xm) * s.to(tl.float32)


@triton.jit
def _q4_0(b, h, xw, xd, xs, mask, xm, EMU: tl.constexpr):
    # 16 bytes: low nibbles are weights 0-15, high nibbles 16-31; codes - 8
    t = tl.arange(0, 4)[None, None, :]
    q = tl.load(b.to(tl.pointer_type(tl.int32))[:, :, None] + t, mask=mask[:, :, None], other=0)
    x3 = xw[:, :, None] + t
    s = _dp4a(q & _LO, _x(x3, xm[:, :, None]), 0, EMU)
    s = tl.sum(_dp4a((q >> 4) & _LO, _x(x3 + 4, xm[:, :, None]), s, EMU), axis=2)
    return f16(h, mask) * (_x(xd, xm) * s.to(tl.float32) - 8.0 * _x(xs, xm))


@triton.jit
def _q4_1(b, h, xw, xd, xs, mask, xm, EMU: tl.constexpr):
    # as Q4_0, codes 0..15; h: fp16 d, fp16 m (w = d * q + m)
    t = tl.arange(0, 4)[None, None, :]
    q = tl.load(b.to(tl.pointer_type(tl.int32))[:, :, None] + t, mask=mask[:, :, None], other=0)
    x3 = xw[:, :, None] + t
    s = _dp4a(q & _LO, _x(x3, xm[:, :, None]), 0, EMU)
    s = tl.sum(_dp4a((q >> 4) & _LO, _x(x3 + 4, xm[:, :, None]), s, EMU), axis=2)
    return f16(h, mask) * _x(xd, xm) * s.to(tl.float32) + f16(h + 2, mask) * _x(xs, xm)


@triton.jit
def _fifth_bits(bits):
    """Bits 0-3 of ``bits`` as bit 4 of bytes 0-3 (the copies of the nibble, shifted by 0 / 7 / 14
    / 21, never overlap)."""
    return (((bits & 15) * 0x00204081) & 0x01010101) << 4


@triton.jit
def _q5_01(b, h, xw, xd, xs, mask, xm, HAS_M: tl.constexpr, EMU: tl.constexpr):
    # Q5_0: h: fp16 d, then 32 bits of fifth bits (bit j for weight j; 2-aligned); w = d * (q - 16).
    # Q5_1 (HAS_M): h: fp16 d, fp16 m, the fifth bits; w = d * q + m.  Body as Q4_0's.
    t = tl.arange(0, 4)[None, None, :]
    q = tl.load(b.to(tl.pointer_type(tl.int32))[:, :, None] + t, mask=mask[:, :, None], other=0)
    hq = h + 4 if HAS_M else h + 2
    qh = (u16(hq, mask) | (u16(hq + 2, mask) << 16))[:, :, None]
    x3 = xw[:, :, None] + t
    s = _dp4a((q & _LO) | _fifth_bits(qh >> (4 * t)), _x(x3, xm[:, :, None]), 0, EMU)
    s = tl.sum(_dp4a(((q >> 4) & _LO) | _fifth_bits(qh >> (4 * t + 16)), _x(x3 + 4, xm[:, :, None]), s, EMU), axis=2)
    d = f16(h, mask)
    if HAS_M:
        return d * _x(xd, xm) * s.to(tl.float32) + f16(h + 2, mask) * _x(xs, xm)
    else:
        return d * (_x(xd, xm) * s.to(tl.float32) - 16.0 * _x(xs, xm))


@triton.jit
def _iq4_nl(b, h, xw, xd, xs, mask, xm, lut_ptr, EMU: tl.constexpr):
    # 16 bytes of 4-bit indices into IQ4_NL's table (low nibbles weights 0-15); h: fp16 d
    t = tl.arange(0, 4)[None, None, :]
    q = tl.load(b.to(tl.pointer_type(tl.int32))[:, :, None] + t, mask=mask[:, :, None], other=0)
    lo, hi = _table_bytes(q, lut_ptr, _IQ4_ASM, EMU)
    x3 = xw[:, :, None] + t
    s = tl.sum(_dp4a(hi, _x(x3 + 4, xm[:, :, None]), _dp4a(lo, _x(x3, xm[:, :, None]), 0, EMU), EMU), axis=2)
    return f16(h, mask) * _x(xd, xm) * s.to(tl.float32)


@triton.jit
def _iq4_xs(b, h, xw, xd, xs, mask, xm, lut_ptr, EMU: tl.constexpr):
    # 8 sub-blocks of 32 as IQ4_NL's (16 bytes each); h: fp16 d, 16 bits of the scales' high 2 bits,
    # 4 bytes of their low 4 bits; sub-block j's scale d * (ls - 32)
    j = tl.arange(0, 8)[None, None, :, None]
    t = tl.arange(0, 4)[None, None, None, :]
    m4, xm4 = mask[:, :, None, None], xm[:, :, None, None]
    q = tl.load(b.to(tl.pointer_type(tl.int32))[:, :, None, None] + 4 * j + t, mask=m4, other=0)
    lo, hi = _table_bytes(q, lut_ptr, _IQ4_ASM, EMU)
    x4 = xw[:, :, None, None] + 8 * j + t
    s = tl.sum(_dp4a(hi, _x(x4 + 4, xm4), _dp4a(lo, _x(x4, xm4), 0, EMU), EMU), axis=3, keep_dims=True)
    h4 = h[:, :, None, None]
    sh = u16(h4 + 2, m4)
    ls = ((u8(h4 + 4 + j // 2, m4) >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)
    r = u2f(ls, 32.0) * _x(xd[:, :, None, None] + j, xm4) * s.to(tl.float32)
    return f16(h, mask) * tl.sum(tl.sum(r, axis=3), axis=2)


@triton.jit
def _q45_k(b, h, xw, xd, xs, mask, xm, HIGH: tl.constexpr, EMU: tl.constexpr):
    # Q4_K: 4 x 32 bytes, byte j of the p-th holds weight j of sub-block 2p (low nibble) and of
    # 2p + 1 (high).  Q5_K (HIGH): the same after 32 bytes of fifth bits, bit s of byte j for
    # weight j of sub-block s.  Header: fp16 d, fp16 dmin, 6-bit scales and mins.
    p = tl.arange(0, 4)[None, None, :, None]
    t = tl.arange(0, 8)[None, None, None, :]
    m4, xm4 = mask[:, :, None, None], xm[:, :, None, None]
    w4 = b.to(tl.pointer_type(tl.int32))[:, :, None, None]
    if HIGH:
        q = tl.load(w4 + 8 + 8 * p + t, mask=m4, other=0)
        qh = tl.load(w4 + t, mask=m4, other=0)
        vlo = (q & _LO) | (((qh >> (2 * p)) & 0x01010101) << 4)
        vhi = ((q >> 4) & _LO) | (((qh >> (2 * p + 1)) & 0x01010101) << 4)
    else:
        q = tl.load(w4 + 8 * p + t, mask=m4, other=0)
        vlo, vhi = q & _LO, (q >> 4) & _LO
    x4 = xw[:, :, None, None] + 16 * p + t
    lo = tl.sum(_dp4a(vlo, _x(x4, xm4), 0, EMU), axis=3, keep_dims=True).to(tl.float32)
    hi = tl.sum(_dp4a(vhi, _x(x4 + 8, xm4), 0, EMU), axis=3, keep_dims=True).to(tl.float32)
    h4 = h[:, :, None, None]
    dd, a, c, e = u32(h4, m4), u32(h4 + 4, m4), u32(h4 + 8, m4), u32(h4 + 12, m4)
    sc_lo, mn_lo = _scale_min_k4_words(a, c, e, 2 * p)
    sc_hi, mn_hi = _scale_min_k4_words(a, c, e, 2 * p + 1)
    xd4, xs4 = xd[:, :, None, None] + 2 * p, xs[:, :, None, None] + 2 * p
    r = (_lo_f16(dd) * (u2f(sc_lo) * _x(xd4, xm4) * lo + u2f(sc_hi) * _x(xd4 + 1, xm4) * hi)
         - _lo_f16(dd >> 16) * (u2f(mn_lo) * _x(xs4, xm4) + u2f(mn_hi) * _x(xs4 + 1, xm4)))
    return tl.sum(tl.sum(r, axis=3), axis=2)


@triton.jit
def _lo_f16(w):
    """The fp16 in the low half of int32 ``w``, as float32."""
    return (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scale_min_k4_words(a, c, e, j):
    """Q4_K / Q5_K: the 6-bit scale and min of sub-block ``j`` from the header's scale words (bytes
    0-3, 4-7, 8-11), as ``gguf.scale_min_k4`` reads them byte by byte."""
    sh = 8 * (j % 4)
    aj, cj, ej = (a >> sh) & 0xFF, (c >> sh) & 0xFF, (e >> sh) & 0xFF
    first = j < 4
    return (tl.where(first, aj & 63, (ej & 0xF) | ((aj >> 2) & 0x30)),
            tl.where(first, cj & 63, (ej >> 4) | ((cj >> 2) & 0x30)))


@triton.jit
def _q2_k(b, h, xw, xd, xs, mask, xm, EMU: tl.constexpr):
    # 16 sub-blocks of 16: sub-block s is 2-bit field s % 8 // 2 of 16 bytes at 32 * (s // 8) +
    # 16 * (s % 2); h: a byte of 4-bit scale | 4-bit min per sub-block, fp16 d, fp16 dmin
    sb = tl.arange(0, 16)[None, None, :, None]
    t = tl.arange(0, 4)[None, None, None, :]
    m4, xm4 = mask[:, :, None, None], xm[:, :, None, None]
    q = tl.load(b.to(tl.pointer_type(tl.int32))[:, :, None, None] + 8 * (sb // 8) + 4 * (sb % 2) + t,
                mask=m4, other=0)
    xj = _x(xw[:, :, None, None] + 4 * sb + t, xm4)
    isum = tl.sum(_dp4a((q >> (2 * (sb % 8 // 2))) & 0x03030303, xj, 0, EMU), axis=3, keep_dims=True)
    xsum = tl.sum(_dp4a(tl.zeros_like(xj) + 0x01010101, xj, 0, EMU), axis=3, keep_dims=True)
    h4 = h[:, :, None, None]
    sm = u8(h4 + sb, m4)
    xd4 = _x(xd[:, :, None, None] + sb // 2, xm4)
    r = (f16(h4 + 16, m4) * u2f(sm & 15) * xd4 * isum.to(tl.float32)
         - f16(h4 + 18, m4) * u2f(sm >> 4) * xd4 * xsum.to(tl.float32))
    return tl.sum(tl.sum(r, axis=3), axis=2)


@triton.jit
def _q3_k(b, h, xw, xd, xs, mask, xm, EMU: tl.constexpr):
    # group m of 32 (half m // 4 of 128): 2-bit field m % 4 of qs bytes 32 * (m // 4) + l and bit m
    # of hmask byte l (clear: -4), l = 0..31; sub-blocks of 16 (u // 4: the group's words 0-3 or
    # 4-7) s = 8 * (m // 4) + 2 * (m % 4) + u // 4 with 6-bit scales - 32 (low nibbles in bytes
    # 0-7, high 2 bits in bytes 8-11), fp16 d.  Body: hmask (32 bytes), qs (64).
    g = tl.arange(0, 8)[None, None, :, None, None]
    hs = tl.arange(0, 2)[None, None, None, :, None]
    u = 4 * hs + tl.arange(0, 4)[None, None, None, None, :]
    m5, xm5 = mask[:, :, None, None, None], xm[:, :, None, None, None]
    w5 = b.to(tl.pointer_type(tl.int32))[:, :, None, None, None]
    crumbs = (tl.load(w5 + 8 + 8 * (g // 4) + u, mask=m5, other=0) >> (2 * (g % 4))) & 0x03030303
    hbits = ((tl.load(w5 + u, mask=m5, other=0) >> g) & 0x01010101) << 2
    xj = _x(xw[:, :, None, None, None] + 8 * g + u, xm5)
    isum = tl.sum(_dp4a(crumbs | hbits, xj, _dp4a(tl.zeros_like(xj) + _NEG4, xj, 0, EMU), EMU), axis=4, keep_dims=True)
    h5 = h[:, :, None, None, None]
    sb = 8 * (g // 4) + 2 * (g % 4) + hs  # [1, 1, 8, 2, 1]
    lo = (u8(h5 + sb % 8, m5) >> (4 * (sb // 8))) & 15
    hi = (u8(h5 + 8 + sb % 4, m5) >> (2 * (sb // 4))) & 3
    r = tl.sum(isum * ((lo | (hi << 4)) - 32), axis=3, keep_dims=True).to(tl.float32)
    r = r * _x(xd[:, :, None, None, None] + g, xm5)
    return f16(h + 12, mask) * tl.sum(tl.sum(tl.sum(r, axis=4), axis=3), axis=2)


@triton.jit
def _q6_k(b, h, xw, xd, xs, mask, xm, EMU: tl.constexpr):
    # two halves of 128 weights: ql words A (weights l, l + 64 by nibble) and B (l + 32, l + 96),
    # qh words C (their 2 high bits); codes - 32 (a dp4a of -32s); int8 scales per 16 weights
    hh = tl.arange(0, 2)[None, None, :, None, None]
    g = tl.arange(0, 2)[None, None, None, :, None]
    u = 4 * g + tl.arange(0, 4)[None, None, None, None, :]
    m5, xm5 = mask[:, :, None, None, None], xm[:, :, None, None, None]
    w5 = b.to(tl.pointer_type(tl.int32))[:, :, None, None, None]
    qa = tl.load(w5 + 16 * hh + u, mask=m5, other=0)
    qb = tl.load(w5 + 16 * hh + 8 + u, mask=m5, other=0)
    qc = tl.load(w5 + 32 + 8 * hh + u, mask=m5, other=0)
    x5 = xw[:, :, None, None, None] + 32 * hh + u
    h5 = h[:, :, None, None, None]
    xd5 = xd[:, :, None, None, None] + 4 * hh
    d = f16(h5 + 16, m5)
    r = tl.zeros_like(d)
    for j in tl.static_range(4):
        if j == 0:
            v = (qa & _LO) | ((qc << 4) & 0x30303030)
        elif j == 1:
            v = (qb & _LO) | ((qc << 2) & 0x30303030)
        elif j == 2:
            v = ((qa >> 4) & _LO) | (qc & 0x30303030)
        else:
            v = ((qb >> 4) & _LO) | ((qc >> 2) & 0x30303030)
        xj = _x(x5 + 8 * j, xm5)
        s = tl.sum(_dp4a(v, xj, _dp4a(tl.zeros_like(xj) + _NEG32, xj, 0, EMU), EMU), axis=4, keep_dims=True)
        sc = u2f(u8(h5 + 8 * hh + g + 2 * j, m5) ^ 0x80, 128.0)
        r += sc * _x(xd5 + j, xm5) * s.to(tl.float32)
    return tl.sum(tl.sum(tl.sum(d * r, axis=4), axis=3), axis=2)


def _table_asm(words: tuple[int, int, int, int]) -> str:
    """PTX for ``_table_bytes`` with a table of 16 int8 values in four little-endian words."""
    w = [f"0x{v & 0xFFFFFFFF:08X}" for v in words]
    return f"""{{
            .reg .b32 tp0, tp1, tn0, tn1, m, s, p, n, r0, r1, m2, s2;
            mov.b32 tp0, {w[0]};
            mov.b32 tp1, {w[1]};
            mov.b32 tn0, {w[2]};
            mov.b32 tn1, {w[3]};
            and.b32 m, $2, 0x77777777;
            and.b32 s, $2, 0x88888888;
            shr.u32 s, s, 1;
            or.b32 s, s, 0x32103210;
            prmt.b32 p, tp0, tp1, m;
            prmt.b32 n, tn0, tn1, m;
            prmt.b32 r0, p, n, s;
            shr.u32 m2, m, 16;
            shr.u32 s2, s, 16;
            prmt.b32 p, tp0, tp1, m2;
            prmt.b32 n, tn0, tn1, m2;
            prmt.b32 r1, p, n, s2;
            prmt.b32 $0, r0, r1, 0x6420;
            prmt.b32 $1, r0, r1, 0x7531;
            }}"""


def _table_words(values) -> tuple[int, int, int, int]:
    b = bytes(int(v) & 0xFF for v in values)
    return tuple(int.from_bytes(b[4 * i:4 * i + 4], "little") for i in range(4))


# MXFP4: twice the E2M1 values, 0 1 2 3 4 6 8 12 and their negatives; IQ4_NL (and IQ4_XS): its 16 values
_MXFP4_ASM = tl.constexpr(_table_asm(_table_words([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12])))
_IQ4_ASM = tl.constexpr(_table_asm(_table_words(gq.IQ4_NL.kvalues)))


@triton.jit
def _table_bytes(q, lut_ptr, ASM: tl.constexpr, EMU: tl.constexpr):
    """The eight 4-bit codes of ``q`` (int32: a code per nibble) looked up in a table of 16 int8
    values: (the low nibbles' four bytes, the high nibbles' four), byte i of each from byte i of
    ``q``.  On the GPU four byte permutes pick by a code's low 3 bits from the table's first and
    last eight values, a fifth by its bit 3 (no selector sets bit 3, prmt's sign-replicate mode),
    two more put the bytes in order (llama.cpp's ``get_int_from_table_16``); under the
    interpreter the values come from ``lut_ptr`` (the float32 table of the type)."""
    if EMU:
        lo, hi = tl.zeros_like(q), tl.zeros_like(q)
        for i in tl.static_range(4):
            c_lo, c_hi = (q >> (8 * i)) & 15, (q >> (8 * i + 4)) & 15
            lo |= (tl.load(lut_ptr + c_lo).to(tl.int32) & 0xFF) << (8 * i)
            hi |= (tl.load(lut_ptr + c_hi).to(tl.int32) & 0xFF) << (8 * i)
        return lo, hi
    else:
        return tl.inline_asm_elementwise(ASM, "=r,=r,r", [q], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _mxfp4(b, h, xw, xd, xs, mask, xm, lut_ptr, EMU: tl.constexpr):
    # 16 bytes: weight j in the low nibble of byte j, 16 + j in the high one; h: the E8M0 exponent
    t = tl.arange(0, 4)[None, None, :]
    q = tl.load(b.to(tl.pointer_type(tl.int32))[:, :, None] + t, mask=mask[:, :, None], other=0)
    lo, hi = _table_bytes(q, lut_ptr, _MXFP4_ASM, EMU)
    x3 = xw[:, :, None] + t
    s = tl.sum(_dp4a(hi, _x(x3 + 4, xm[:, :, None]), _dp4a(lo, _x(x3, xm[:, :, None]), 0, EMU), EMU), axis=2)
    return e8m0_half(u8(h, mask)) * _x(xd, xm) * s.to(tl.float32)


@triton.jit
def _byte_masks(bits):
    """Four sign bits (bits 0-3 of ``bits``) as a word of byte masks: byte j 0xFF where bit j is set
    (the four copies of the nibble, shifted by 0 / 7 / 14 / 21, never overlap)."""
    return (((bits & 15) * 0x00204081) & 0x01010101) * 0xFF


@triton.jit
def _ksigns(s7, EMU: tl.constexpr):
    """llama.cpp's ``ksigns[s7]`` without the table: the 7 sign bits and their parity as bit 7 (a
    group has an even count of negatives).  A gather from the table cost as much as the grid's."""
    if EMU:
        p = s7 ^ (s7 >> 4)
        p ^= p >> 2
        p ^= p >> 1
    else:
        p = tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [s7], dtype=tl.int32, is_pure=True, pack=1)
    return s7 | ((p & 1) << 7)


@triton.jit
def _grid_words(lut_ptr, e):
    """The two grid words of 8-wide entries ``e``, gathered as one 64-bit load (the lattice kernels are
    bound by their gathers, not by the bytes)."""
    g = tl.load(lut_ptr.to(tl.pointer_type(tl.int64)) + (KS // 2) + e)
    return g.to(tl.int32), (g >> 32).to(tl.int32)


@triton.jit
def _entry_axes(xw, mask, xm):
    """The lattice kernels' tile [R, B, 8, 4] of a step: (group of 32 ``sg``, entry of 8 weights
    ``g8`` in it, the weight and activation masks broadcast to it, each entry's activation words)."""
    sg = tl.arange(0, 8)[None, None, :, None]
    g8 = tl.arange(0, 4)[None, None, None, :]
    return sg, g8, mask[:, :, None, None], xm[:, :, None, None], xw[:, :, None, None] + 8 * sg + 2 * g8


@triton.jit
def _signed_grid(grid, sgn, i):
    """Grid words' bytes negated where bits 4i .. 4i + 3 of the sign masks ``sgn`` are set."""
    msk = _byte_masks(sgn >> (4 * i))
    return (grid ^ msk) + (msk & 0x01010101)


@triton.jit
def _signed_dot(grid0, grid1, sgn, x4, xm4, EMU: tl.constexpr):
    """An entry's integer sum: its two grid words, signed by ``sgn``'s 8 bits, against its activations."""
    s = _dp4a(_signed_grid(grid0, sgn, 0), _x(x4, xm4), 0, EMU)
    return _dp4a(_signed_grid(grid1, sgn, 1), _x(x4 + 1, xm4), s, EMU)


@triton.jit
def _iq2_xxs(b, h, xw, xd, xs, mask, xm, lut_ptr, EMU: tl.constexpr):
    # per group of 32: a word of 4 grid indices (8 weights each), a word of 4 sign indices and the
    # scale.  One gather per 8 weights (the grid entry); the signs are computed in registers.
    sg, g8, m4, xm4, x4 = _entry_axes(xw, mask, xm)
    b4 = b[:, :, None, None] + 8 * sg
    e = (u32(b4, m4) >> (8 * g8)) & 0xFF
    aux = u32(b4 + 4, m4)
    grid0, grid1 = _grid_words(lut_ptr, e)
    s = _signed_dot(grid0, grid1, _ksigns((aux >> (7 * g8)) & 127, EMU), x4, xm4, EMU)
    s = tl.sum(s, axis=3, keep_dims=True).to(tl.float32)
    db = f16(h[:, :, None, None], m4) * (0.5 + u2f((aux >> 28) & 15)) * 0.25
    return tl.sum(tl.sum(db * _x(xd[:, :, None, None] + sg, xm4) * s, axis=3), axis=2)


@triton.jit
def _iq3_xxs(b, h, xw, xd, xs, mask, xm, lut_ptr, EMU: tl.constexpr):
    # per group of 32: 8 grid indices (bytes at 8 * group, 4 weights each), and a word at 64 + 4 *
    # group of 4 x 7-bit sign indices (ksigns) and a 4-bit scale; h: fp16 d
    sg, g8, m4, xm4, x4 = _entry_axes(xw, mask, xm)
    b4 = b[:, :, None, None]
    e = u16(b4 + 8 * sg + 2 * g8, m4)  # the 8 weights' two grid entries of 4
    aux = u32(b4 + 64 + 4 * sg, m4)
    sgn = _ksigns((aux >> (7 * g8)) & 127, EMU)
    s = _signed_dot(tl.load(lut_ptr + KS + (e & 0xFF)), tl.load(lut_ptr + KS + (e >> 8)), sgn, x4, xm4, EMU)
    s = tl.sum(s, axis=3, keep_dims=True).to(tl.float32)
    db = (0.5 + u2f((aux >> 28) & 15)) * 0.5
    return f16(h, mask) * tl.sum(tl.sum(db * _x(xd[:, :, None, None] + sg, xm4) * s, axis=3), axis=2)


@triton.jit
def _iq3_s(b, h, xw, xd, xs, mask, xm, lut_ptr, EMU: tl.constexpr):
    # per group of 32: 8 grid index lows (bytes at 8 * group), their high bits (byte 2 + group of
    # h), 4 sign masks (bytes 10 + 4 * group of h, one per 8 weights), a 4-bit scale (nibble of the
    # bytes at h + 42): d * (1 + 2 * scale)
    sg, g8, m4, xm4, x4 = _entry_axes(xw, mask, xm)
    h4 = h[:, :, None, None]
    e = u16(b[:, :, None, None] + 8 * sg + 2 * g8, m4)
    qh = u8(h4 + 2 + sg, m4) >> (2 * g8)
    sgn = u8(h4 + 10 + 4 * sg + g8, m4)
    grid0 = tl.load(lut_ptr + KS + ((e & 0xFF) | ((qh & 1) << 8)))
    grid1 = tl.load(lut_ptr + KS + ((e >> 8) | (((qh >> 1) & 1) << 8)))
    s = _signed_dot(grid0, grid1, sgn, x4, xm4, EMU)
    s = tl.sum(s, axis=3, keep_dims=True).to(tl.float32)
    sc = u2f(2 * ((u8(h4 + 42 + sg // 2, m4) >> (4 * (sg % 2))) & 15) + 1)
    return f16(h, mask) * tl.sum(tl.sum(sc * _x(xd[:, :, None, None] + sg, xm4) * s, axis=3), axis=2)


@triton.jit
def _iq2_xs_s(b, h, xw, xd, xs, mask, xm, lut_ptr, S: tl.constexpr, EMU: tl.constexpr):
    # entries of 8 weights, l = 4 * group + g8; a 4-bit scale per 16 weights: d * (0.5 + scale) / 4.
    # IQ2_XS (not S): a 16-bit word per entry at 2l, a 9-bit grid index and a 7-bit ksigns index; h:
    # fp16 d, 8 bytes of scales.  IQ2_S: index lows at byte l, sign masks at 32 + l; h: fp16 d, 8
    # bytes of 2-bit index highs (a crumb per entry), 8 bytes of scales.
    sg, g8, m4, xm4, x4 = _entry_axes(xw, mask, xm)
    b4, h4 = b[:, :, None, None], h[:, :, None, None]
    entry = 4 * sg + g8
    if S:
        idx = u8(b4 + entry, m4) | (((u8(h4 + 2 + entry // 4, m4) >> (2 * g8)) & 3) << 8)
        sgn = u8(b4 + 32 + entry, m4)
        sc = u8(h4 + 10 + sg, m4)
    else:
        q = u16(b4 + 2 * entry, m4)
        idx = q & 511
        sgn = _ksigns(q >> 9, EMU)
        sc = u8(h4 + 2 + sg, m4)
    grid0, grid1 = _grid_words(lut_ptr, idx)
    s = _signed_dot(grid0, grid1, sgn, x4, xm4, EMU)
    db = 0.5 + u2f((sc >> (4 * (g8 // 2))) & 15)  # the entry's 16 weights' scale
    r = tl.sum(db * s.to(tl.float32), axis=3, keep_dims=True) * _x(xd[:, :, None, None] + sg, xm4)
    return f16(h, mask) * 0.25 * tl.sum(tl.sum(r, axis=3), axis=2)


@triton.jit
def _iq1(b, h, xw, xd, xs, mask, xm, lut_ptr, M: tl.constexpr, EMU: tl.constexpr):
    # entries of 8 weights (l = 4 * group + g8): a grid index (a low byte at l, 3 high bits), its
    # delta's sign, a 3-bit scale: d * (2 * scale + 1) * (grid - 1 + delta), grid bytes 0..2.  IQ1_S:
    # h: fp16 d, per group a 16-bit word (the entries' high bits, the scale, the delta's sign).
    # IQ1_M (M): h: a nibble per entry (high bits, sign), 4 16-bit words of 3-bit scales (one per 16
    # weights) whose top nibbles hold the fp16 d.
    sg, g8, m4, xm4, x4 = _entry_axes(xw, mask, xm)
    b4, h4 = b[:, :, None, None], h[:, :, None, None]
    entry = 4 * sg + g8
    if M:
        hq = (u8(h4 + entry // 2, m4) >> (4 * (g8 % 2))) & 15
        idx = u8(b4 + entry, m4) | ((hq & 7) << 8)
        neg = (hq & 8) != 0
        sc = (u16(h4 + 16 + 2 * (sg // 2), m4) >> (3 * (2 * (sg % 2) + g8 // 2))) & 7
        d = iq1_m_d(h, mask)
    else:
        qh = u16(h4 + 2 + 2 * sg, m4)
        idx = u8(b4 + 4 * sg + g8, m4) | (((qh >> (3 * g8)) & 7) << 8)
        neg = (qh & 0x8000) != 0
        sc = (qh >> 12) & 7
        d = f16(h, mask)
    grid = _grid_words(lut_ptr, idx)
    sgrid, sx = tl.zeros_like(idx), tl.zeros_like(idx)
    for i in tl.static_range(2):
        xi = _x(x4 + i, xm4)
        sgrid = _dp4a(grid[i], xi, sgrid, EMU)
        sx = _dp4a(tl.zeros_like(xi) + 0x01010101, xi, sx, EMU)
    shift = tl.where(neg, -IQ1_DELTA - 1.0, IQ1_DELTA - 1.0)  # grid - 1 + delta
    r = u2f(2 * sc + 1) * (sgrid.to(tl.float32) + shift * sx.to(tl.float32))
    return d * tl.sum(tl.sum(tl.sum(r, axis=3, keep_dims=True) * _x(xd[:, :, None, None] + sg, xm4), axis=3), axis=2)


@triton.jit
def _gemv_q8_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, lut_ptr, y_ptr, ids_ptr, N, row_bytes, hdr_start, n_blocks,
                    blocks_per_split, x_div, stride_xq, stride_xd, stride_ys, stride_ym,
                    QT: tl.constexpr, BS: tl.constexpr, BB: tl.constexpr, HB: tl.constexpr,
                    BLOCK_N: tl.constexpr, BPI: tl.constexpr, EMU: tl.constexpr, GROUPED: tl.constexpr):
    """y[split, m, n] = this split's part of sum_k x[m, k] * W[n, k], float32; x as int8 words
    ``xq`` with ``xd`` / ``xs`` per 32; BPI blocks of BS weights a step.  GROUPED: as
    ``gguf._gemv_kernel`` (matrix ids[m] of a stack, activation row m // x_div)."""
    pid_n, m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows, x_m = n.to(tl.int64), m  # the weight rows and the activation row of this program
    if GROUPED:
        rows += tl.load(ids_ptr + m).to(tl.int64) * N
        x_m = m // x_div
    row = w_ptr + (rows * row_bytes)[:, None]
    b0 = pid_s * blocks_per_split
    b_end = tl.minimum(b0 + blocks_per_split, n_blocks)
    xq_row = xq_ptr.to(tl.pointer_type(tl.int32)) + x_m.to(tl.int64) * stride_xq
    xd_row, xs_row = xd_ptr + x_m * stride_xd, xs_ptr + x_m * stride_xd
    acc = tl.zeros((BLOCK_N, BPI), dtype=tl.float32)
    for bs in range(b0, b_end, BPI):
        blk = (bs + tl.arange(0, BPI))[None, :]
        xm = blk < b_end
        mask = (n < N)[:, None] & xm
        b, h = row + blk * BB, row + hdr_start + blk * HB
        xw, xd, xs = xq_row + blk * (BS // 4), xd_row + blk * (BS // 32), xs_row + blk * (BS // 32)
        if QT == Q4_K:
            acc += _q45_k(b, h, xw, xd, xs, mask, xm, False, EMU)
        elif QT == Q6_K:
            acc += _q6_k(b, h, xw, xd, xs, mask, xm, EMU)
        elif QT == Q5_K:
            acc += _q45_k(b, h, xw, xd, xs, mask, xm, True, EMU)
        elif QT == Q2_K:
            acc += _q2_k(b, h, xw, xd, xs, mask, xm, EMU)
        elif QT == Q8_0:
            acc += _q8_0(b, h, xw, xd, xs, mask, xm, EMU)
        elif QT == Q4_0:
            acc += _q4_0(b, h, xw, xd, xs, mask, xm, EMU)
        elif QT == MXFP4:
            acc += _mxfp4(b, h, xw, xd, xs, mask, xm, lut_ptr, EMU)
        elif QT == IQ3_XXS:
            acc += _iq3_xxs(b, h, xw, xd, xs, mask, xm, lut_ptr, EMU)
        elif QT == IQ3_S:
            acc += _iq3_s(b, h, xw, xd, xs, mask, xm, lut_ptr, EMU)
        elif QT == IQ2_XS:
            acc += _iq2_xs_s(b, h, xw, xd, xs, mask, xm, lut_ptr, False, EMU)
        elif QT == IQ2_S:
            acc += _iq2_xs_s(b, h, xw, xd, xs, mask, xm, lut_ptr, True, EMU)
        elif QT == IQ1_S:
            acc += _iq1(b, h, xw, xd, xs, mask, xm, lut_ptr, False, EMU)
        elif QT == IQ1_M:
            acc += _iq1(b, h, xw, xd, xs, mask, xm, lut_ptr, True, EMU)
        elif QT == Q3_K:
            acc += _q3_k(b, h, xw, xd, xs, mask, xm, EMU)
        elif QT == Q4_1:
            acc += _q4_1(b, h, xw, xd, xs, mask, xm, EMU)
        elif QT == Q5_0:
            acc += _q5_01(b, h, xw, xd, xs, mask, xm, False, EMU)
        elif QT == Q5_1:
            acc += _q5_01(b, h, xw, xd, xs, mask, xm, True, EMU)
        elif QT == IQ4_NL:
            acc += _iq4_nl(b, h, xw, xd, xs, mask, xm, lut_ptr, EMU)
        elif QT == IQ4_XS:
            acc += _iq4_xs(b, h, xw, xd, xs, mask, xm, lut_ptr, EMU)
        else:
            tl.static_assert(QT == IQ2_XXS, "type without an int8 kernel")
            acc += _iq2_xxs(b, h, xw, xd, xs, mask, xm, lut_ptr, EMU)
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + pid_s * stride_ys + m * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n < N)


# The "auto" regime runs these on 8-bit activations (every type).  IQ3_S's Triton kernel had been slower than its
# exact float GEMV (14336x4096 44.1 against 40.8 us: results/h200-triton-gguf-q8-more-types.txt); its CUDA C kernel,
# which runs on CUDA devices, is 2.3-2.6x faster than either (results/h200-cuda-gemv-lattice-signs.txt).
Q8_TYPES: frozenset[GGMLQuantizationType] = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K,
                                                        T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.IQ2_XXS, T.IQ2_XS,
                                                        T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M,
                                                        T.MXFP4})
# Tiles as gguf.GEMV_CONFIG (BLOCK_N rows, BLOCK_K weights a row a step); per-type overrides.  The
# fastest of `bench_triton_gguf.py --sweep --sweep-regimes gemv_q8` on the H200 over the 8B shapes
# (results/h200-triton-gguf-q8-sweep.txt): longer steps than the float kernel's, more bytes in
# flight (the default before, 2 rows x 1024, read Q4_K at 1.2 TB/s, this at 1.6).
GEMV_Q8_CONFIG = dict(BLOCK_N=4, BLOCK_K=2048, num_warps=2, PROGRAMS_PER_SM=8)
GEMV_Q8_TYPE_CONFIG: dict[GGMLQuantizationType, dict] = {
    T.Q6_K: dict(BLOCK_N=8, num_warps=8, PROGRAMS_PER_SM=2),
    T.Q8_0: dict(BLOCK_N=1),
}
def gemv_q8(x: torch.Tensor, packed: torch.Tensor, qtype: GGMLQuantizationType, k: int,
            split_k: int | None = None, *, ids: torch.Tensor | None = None, n: int | None = None,
            x_div: int = 1, x8: Int8Activations | None = None) -> torch.Tensor:
    """``x @ W.T`` through 8-bit activations for ``W`` packed by ``gguf.pack_gguf`` (a type of
    ``Q8_TYPES``); x [M, k] contiguous, the result [M, N] in x's dtype.  With ``ids`` (int64 [P]):
    ``packed`` is a stack of matrices of ``n`` rows and the result [P, n] as ``gguf_grouped_gemv``.
    ``x8``: x already in 8 bits (``int8_act``: its producer wrote it), else x is quantized here.
    (``gguf.gguf_matmul`` picks the CUDA C kernel of the same product where it runs.)"""
    xq, xd, xs = quantize_activations(x) if x8 is None else x8
    if ids is None:
        m, n = x.shape[0], packed.shape[0]
    else:
        m = ids.numel()
    plan = launch_plan("gemv_q8", qtype, k, x, m, n, split_k)
    block_n, out, targs = plan.cfg["BLOCK_N"], plan.out, plan.targs
    _gemv_q8_kernel[(triton.cdiv(n, block_n), m, out.shape[0])](
        xq, xd, xs, packed, value_table(x.device, qtype), out, out if ids is None else ids, n, packed.shape[1],
        plan.hdr_start, plan.n_blocks, plan.per_split, x_div, xq.stride(0) // 4, xd.stride(0), out.stride(0),
        out.stride(1), QT=int(qtype), BS=targs["S"] * targs["SPB"], BB=targs["BB"], HB=targs["HB"],
        BLOCK_N=block_n, BPI=plan.bpi, EMU=INTERPRET, GROUPED=ids is not None, num_warps=plan.cfg["num_warps"])
    return reduce_splits(out, x.dtype)

