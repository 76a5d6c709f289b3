"""GGUF block dequantization in torch, vectorised over all blocks.

Types whose weights are an affine map of small integers (Q4_0 Q4_1 Q5_0 Q5_1
Q8_0 Q2_K..Q6_K) are first split into ``Affine`` fields (integer codes plus
scales; ``linear.py`` stores these re-laid out) and then combined by
``affine_dequant``.  The other types (lookup tables and lattice grids) have a
``_xxx(blocks)`` taking ``uint8 [n_blocks, type_size]`` and returning
``float32 [n_blocks, block_size]``.  Either way the float arithmetic mirrors
``gguf.quants`` operation by operation (same operands, same order, float32),
so results are bit-identical to ``gguf.quants.dequantize``.  Lookup grids,
sign tables and value tables are taken from ``gguf.quants``, not copied.
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import gguf.quants as gq
import torch
from gguf import GGMLQuantizationType

from pocketllm.core.gguf_types import check_supported, row_nbytes

T = GGMLQuantizationType
QK_K = 256


# ---- field helpers -------------------------------------------------------

def f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian fp16 -> float32 [..., 1]."""
    return b.contiguous().view(torch.float16).float()


def u16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2k] -> int32 [..., k] little-endian uint16 values."""
    b = b.to(torch.int32)
    return b[..., 0::2] | (b[..., 1::2] << 8)


def u32(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4k] -> int64 [..., k] little-endian uint32 values."""
    b = b.to(torch.int64)
    return b[..., 0::4] | (b[..., 1::4] << 8) | (b[..., 2::4] << 16) | (b[..., 3::4] << 24)


def shifts(x: torch.Tensor, amounts: list[int], dim: int) -> torch.Tensor:
    """Stack ``x >> a`` for each shift ``a`` along a new axis ``dim``."""
    # one scalar shift per amount: far faster in torch than a broadcast tensor shift
    return torch.stack([x >> a for a in amounts], dim)


def bits(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., k] -> uint8 [..., 8k] of single bits, LSB first."""
    return (shifts(b, list(range(8)), -1) & 1).flatten(-2)


def nibbles(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., k] -> uint8 [..., 2, k]: low nibbles, then high nibbles."""
    return shifts(b, [0, 4], -2) & 0x0F


# ---- tables from gguf ----------------------------------------------------

@cache
def _grid(name: str) -> torch.Tensor:
    cls = getattr(gq, name)
    cls.init_grid()  # gguf builds the grid from its packed hex once
    return torch.from_numpy(cls.grid.reshape(cls.grid_shape).copy())


@cache
def _sign_table() -> torch.Tensor:
    """[128, 8] of +-1: ksigns[i] bit j set -> -1."""
    ks = torch.frombuffer(bytearray(gq.IQ2_XXS.ksigns), dtype=torch.uint8)
    b = bits(ks.view(128, 1))
    return torch.where(b == 0, 1.0, -1.0).to(torch.float32)


@cache
def _kvalues(name: str) -> torch.Tensor:
    return torch.tensor(getattr(gq, name).kvalues, dtype=torch.float32)


def _signs_from_bits(b: torch.Tensor) -> torch.Tensor:
    return torch.where(bits(b) == 0, 1.0, -1.0).to(torch.float32)


# ---- affine types: w = d*sc[sub] * code (+/-) dmin*mn[sub] -----------------

class Affine(NamedTuple):
    """Integer codes plus the scales that map them to weights, per block.

    ``w = dl * code + sign * off`` with ``dl = d * sc`` and ``off = dmin * mn``
    (``sc``/``mn`` None means 1; ``dmin`` None means no offset).  Every
    product is computed in float32 in the same order as ``gguf.quants``.
    """

    codes: torch.Tensor  # int16 [nb, block]; codes + bias fit in ``bits`` unsigned bits
    bits: int
    bias: int
    sub: int  # sub-block width sharing one (sc, mn)
    d: torch.Tensor  # float32 [nb, 1]
    sc: torch.Tensor | None  # int [nb, nsub]
    dmin: torch.Tensor | None  # float32 [nb, 1]
    mn: torch.Tensor | None  # int [nb, nsub]
    sign: int = 1  # k-quants subtract their mins


def _q4_0(b):
    q = nibbles(b[:, 2:]).flatten(1).to(torch.int16) - 8
    return Affine(q, 4, 8, 32, f16(b[:, :2]), None, None, None)


def _q4_1(b):
    q = nibbles(b[:, 4:]).flatten(1).to(torch.int16)
    return Affine(q, 4, 0, 32, f16(b[:, :2]), None, f16(b[:, 2:4]), None)


def _q5(b, off):
    """Q5_0/Q5_1 5-bit values 0..31; ``off`` is where qh starts."""
    qh = bits(b[:, off:off + 4])
    ql = nibbles(b[:, off + 4:]).flatten(1)
    return (ql | (qh << 4)).to(torch.int16)


def _q5_0(b):
    return Affine(_q5(b, 2) - 16, 5, 16, 32, f16(b[:, :2]), None, None, None)


def _q5_1(b):
    return Affine(_q5(b, 4), 5, 0, 32, f16(b[:, :2]), None, f16(b[:, 2:4]), None)


def _q8_0(b):
    q = b[:, 2:].contiguous().view(torch.int8).to(torch.int16)
    return Affine(q, 8, 0, 32, f16(b[:, :2]), None, None, None)


def _q2_k(b):
    n = b.shape[0]
    sc, qs = b[:, :16], b[:, 16:80]
    q = (shifts(qs.reshape(n, 2, 32), [0, 2, 4, 6], 2) & 3).reshape(n, QK_K)
    return Affine(q.to(torch.int16), 2, 0, 16, f16(b[:, 80:82]), sc & 0xF,
                  f16(b[:, 82:84]), sc >> 4, -1)


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, sc = b[:, :32], b[:, 32:96], b[:, 96:108]
    lo = shifts(sc[:, :8], [0, 4], 1).reshape(n, 16) & 0xF
    hi = shifts(sc[:, 8:], [0, 2, 4, 6], 1).reshape(n, 16) & 3
    scale = (lo | (hi << 4)).to(torch.int8) - 32
    ql = (shifts(qs.reshape(n, 2, 32), [0, 2, 4, 6], 2) & 3).reshape(n, QK_K)
    qh = (shifts(hmask.reshape(n, 1, 32), list(range(8)), 2) & 1).reshape(n, QK_K)
    q = ql.to(torch.int16) - ((qh ^ 1) << 2).to(torch.int16)  # high bit clear means -4
    return Affine(q, 3, 4, 16, f16(b[:, 108:110]), scale, None, None)


def scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte Q4_K/Q5_K scales into 8 six-bit scales and mins."""
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scale = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return scale, mins


def _q4_k(b):
    sc, mn = scale_min_k4(b[:, 4:16])
    q = nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, QK_K)
    return Affine(q.to(torch.int16), 4, 0, 32, f16(b[:, :2]), sc, f16(b[:, 2:4]), mn, -1)


def _q5_k(b):
    n = b.shape[0]
    sc, mn = scale_min_k4(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:]
    ql = nibbles(qs.reshape(n, 4, 32)).reshape(n, QK_K)
    qh = (shifts(qh.reshape(n, 1, 32), list(range(8)), 2) & 1).reshape(n, QK_K)
    q = (ql | (qh << 4)).to(torch.int16)
    return Affine(q, 5, 0, 32, f16(b[:, :2]), sc, f16(b[:, 2:4]), mn, -1)


def _q6_k(b):
    n = b.shape[0]
    ql, qh, sc = b[:, :128], b[:, 128:192], b[:, 192:208]
    lo = nibbles(ql.reshape(n, 2, 64)).reshape(n, QK_K)
    hi = (shifts(qh.reshape(n, 2, 32), [0, 2, 4, 6], 2) & 3).reshape(n, QK_K)
    q = (lo | (hi << 4)).to(torch.int16) - 32
    return Affine(q, 6, 32, 16, f16(b[:, 208:210]), sc.contiguous().view(torch.int8), None, None)


_AFFINE_FNS = {
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
}


AFFINE_TYPES = frozenset(_AFFINE_FNS)


def affine_fields(qtype: GGMLQuantizationType, blocks: torch.Tensor) -> Affine:
    """Split ``uint8 [nb, type_size]`` blocks of an affine type into codes and scales."""
    return _AFFINE_FNS[qtype](blocks)


def affine_dequant(f: Affine) -> torch.Tensor:
    """float32 [nb, block] weights from ``Affine`` fields (gguf's operation order)."""
    nb = f.codes.shape[0]
    dl = f.d if f.sc is None else f.d * f.sc.float()
    w = dl.unsqueeze(-1) * f.codes.float().view(nb, -1, f.sub)
    if f.dmin is not None:
        off = (f.dmin if f.mn is None else f.dmin * f.mn.float()).unsqueeze(-1)
        w = w + off if f.sign > 0 else w - off
    return w.reshape(nb, -1)


# ---- lookup-table types ---------------------------------------------------

def _mxfp4(b):
    e = b[:, :1].to(torch.int32)
    # e8m0 exponent to float32 bits, halved (ggml_e8m0_to_fp32_half)
    d = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23).view(torch.float32)
    q = nibbles(b[:, 1:]).flatten(1)
    return d * _kvalues("MXFP4")[q.long()]


def _iq4_nl(b):
    d = f16(b[:, :2])
    q = nibbles(b[:, 2:]).flatten(1)
    return d * _kvalues("IQ4_NL")[q.long()]


def _iq4_xs(b):
    n = b.shape[0]
    d = f16(b[:, :2])
    sh = u16(b[:, 2:4])  # [n, 1]
    lo = shifts(b[:, 4:8], [0, 4], 2).reshape(n, 8) & 0xF
    hi = (shifts(sh, [2 * i for i in range(8)], 2).reshape(n, 8) & 3).to(torch.uint8)
    scale = ((lo | (hi << 4)).to(torch.int8) - 32).float()
    dl = (d * scale).view(n, 8, 1)
    q = nibbles(b[:, 8:].reshape(n, 8, 16)).reshape(n, 8, 32)
    return (dl * _kvalues("IQ4_NL")[q.long()]).reshape(n, QK_K)


# ---- i-quants with lattice grids ----------------------------------------

def _half_scales(d, sc4):
    """IQ2_XS/IQ2_S: d * (0.5 + s) * 0.25 for the 4-bit scales in ``sc4`` bytes."""
    s = shifts(sc4, [0, 4], 2).flatten(1) & 0xF
    return d * (0.5 + s.float()) * 0.25


def _iq2_xxs(b):
    n = b.shape[0]
    d = f16(b[:, :2])
    qs = b[:, 2:].reshape(n, 8, 8)
    aux = u32(qs[:, :, 4:]).view(n, 8)  # 4 x 7-bit sign indices + 4-bit scale
    db = (d * (0.5 + (aux >> 28).float()) * 0.25).view(n, 8, 1, 1)
    signs = _sign_table()[(shifts(aux, [0, 7, 14, 21], 2) & 0x7F)]  # [n, 8, 4, 8]
    grid = _grid("IQ2_XXS")[qs[:, :, :4].long()]  # [n, 8, 4, 8]
    return (db * grid * signs).reshape(n, QK_K)


def _iq2_xs(b):
    n = b.shape[0]
    d = f16(b[:, :2])
    qs = u16(b[:, 2:66])  # [n, 32]: 9-bit grid index, 7-bit sign index
    db = _half_scales(d, b[:, 66:74]).view(n, 16, 1, 1)
    signs = _sign_table()[qs >> 9].view(n, 16, 2, 8)
    grid = _grid("IQ2_XS")[qs & 511].view(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq2_s(b):
    n = b.shape[0]
    d = f16(b[:, :2])
    qs, sb, qh = b[:, 2:34], b[:, 34:66], b[:, 66:74]
    db = _half_scales(d, b[:, 74:82]).view(n, 16, 1, 1)
    signs = _signs_from_bits(sb).view(n, 16, 2, 8)
    hi = (shifts(qh, [0, 2, 4, 6], 2) & 3).reshape(n, 32).long()
    grid = _grid("IQ2_S")[qs.long() | (hi << 8)].view(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq3_xxs(b):
    n = b.shape[0]
    d = f16(b[:, :2])
    qs = b[:, 2:66]
    aux = u32(b[:, 66:98])  # [n, 8]
    db = (d * (0.5 + (aux >> 28).float()) * 0.5).view(n, 8, 1, 1)
    signs = _sign_table()[(shifts(aux, [0, 7, 14, 21], 2) & 0x7F)]  # [n, 8, 4, 8]
    grid = _grid("IQ3_XXS")[qs.long()].view(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


def _iq3_s(b):
    n = b.shape[0]
    d = f16(b[:, :2])
    qs, qh, sb, sc = b[:, 2:66], b[:, 66:74], b[:, 74:106], b[:, 106:110]
    s = shifts(sc, [0, 4], 2).reshape(n, 8) & 0xF
    db = (d * (1 + 2 * s).float()).view(n, 8, 1, 1)
    signs = _signs_from_bits(sb).view(n, 8, 4, 8)
    idx = qs.long() | (bits(qh).long() << 8)
    grid = _grid("IQ3_S")[idx].view(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


_IQ1_DELTA = float(gq.IQ1_S.delta)


def _iq1_s(b):
    n = b.shape[0]
    d = f16(b[:, :2])
    qs, qh = b[:, 2:34], u16(b[:, 34:50])  # qh: [n, 8]
    dl = (d * (2 * ((qh >> 12) & 7) + 1).float()).view(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, _IQ1_DELTA, -_IQ1_DELTA).float().view(n, 8, 1, 1)
    hi = (shifts(qh, [0, 3, 6, 9], 2) & 7).reshape(n, 32)
    grid = _grid("IQ1_S")[qs.long() | (hi.long() << 8)].view(n, 8, 4, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


def _iq1_m(b):
    n = b.shape[0]
    qs, qh, sc = b[:, :32], b[:, 32:48], u16(b[:, 48:56])  # sc: [n, 4]
    # the fp16 super-scale is spread over the top nibbles of the 4 scale words
    dbits = ((sc & 0xF000) >> torch.tensor([12, 8, 4, 0], dtype=torch.int32)).sum(1, keepdim=True)
    d = f16(torch.cat([dbits & 0xFF, dbits >> 8], dim=1).to(torch.uint8))
    s = shifts(sc, [0, 3, 6, 9], 2).reshape(n, 16) & 7
    dl = (d * (2 * s + 1).float()).view(n, 8, 2, 1, 1)
    h = shifts(qh, [0, 4], 2).reshape(n, 32)
    delta = torch.where((h & 0x08) == 0, _IQ1_DELTA, -_IQ1_DELTA).float().view(n, 8, 2, 2, 1)
    grid = _grid("IQ1_M")[qs.long() | ((h & 7).long() << 8)].view(n, 8, 2, 2, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)


_BLOCK_FNS = {
    **{t: (lambda b, fn=fn: affine_dequant(fn(b))) for t, fn in _AFFINE_FNS.items()},
    T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs, T.IQ2_XXS: _iq2_xxs, T.IQ2_XS: _iq2_xs,
    T.IQ2_S: _iq2_s, T.IQ3_XXS: _iq3_xxs, T.IQ3_S: _iq3_s, T.IQ1_S: _iq1_s,
    T.IQ1_M: _iq1_m, T.MXFP4: _mxfp4,
}



def dequantize_blocks(blocks: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """``uint8 [n_blocks, type_size]`` of a quantized type -> ``float32 [n_blocks, block_size]``."""
    return _BLOCK_FNS[qtype](blocks)


_FLOAT_VIEWS = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}


def as_bytes(data: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of ``data`` (F16/F32 tensors from GGUFReader are accepted too)."""
    data = data.contiguous().reshape(-1)
    return data if data.dtype == torch.uint8 else data.view(torch.uint8)


def dequantize(
    data: torch.Tensor,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize raw GGUF tensor bytes to a dense tensor of logical ``shape`` (torch order)."""
    qtype = check_supported(qtype)
    shape = tuple(int(s) for s in shape)
    n_rows = 1
    for s in shape[:-1]:
        n_rows *= s
    raw = as_bytes(data)
    want = n_rows * row_nbytes(qtype, shape[-1]) if shape else 0
    if raw.numel() != want:
        raise ValueError(
            f"{qtype.name} tensor of shape {shape} needs {want} bytes, got {raw.numel()}"
        )
    if qtype in _FLOAT_VIEWS:
        out = raw.view(_FLOAT_VIEWS[qtype]).to(torch.float32)
    else:
        ts = gq.GGML_QUANT_SIZES[qtype][1]
        out = dequantize_blocks(raw.view(-1, ts), qtype)
    return out.reshape(shape).to(dtype)
