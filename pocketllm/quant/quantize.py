"""Quantize float32 weights into GGUF block encodings, bit-compatible with ggml's block layouts.

``quantize(w, qtype)`` takes ``float32 [rows, K]`` and returns ``uint8 [rows, row_bytes]``; any GGUF reader
(``gguf.quants.dequantize``, llama.cpp, `pocketllm.quant.dequant`) decodes the bytes.

Scales, mins and codes are chosen by search, following llama.cpp's ``ggml-quants.c``:

- ``_qx``  (``make_qx_quants``): symmetric codes; 19 candidate scales around ``-nmax/max``, each refit by
  weighted least squares, the best kept (Q4_0, Q5_0, Q6_K sub-blocks).
- ``_qkx`` (``make_qkx2_quants``): codes with an offset; candidate scales over ``[min, max]``, each with the
  weighted least-squares (scale, min) pair, the best kept (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K sub-blocks).
- ``_q3``  (``make_q3_quants``): symmetric codes refined one weight at a time (Q3_K sub-blocks).
- ``_qp``  (``make_qp_quants``): the 6-bit sub-block scales and mins of Q4_K/Q5_K, searched as well.
- Q8_0: absmax codes, then the least-squares scale for them where it lowers the error.
- ``_iq4`` (``quantize_row_iq4_nl_impl``): IQ4_NL / IQ4_XS codes index a fixed non-linear table of 16
  values; per block of 32, the least-squares scale of the best of 16 candidates (IQ4_XS then stores the
  block scales as 6-bit multiples of one fp16 super-block scale).

The K-quants use ggml's parameters and weights (Q2_K, Q3_K and Q6_K come out as llama-quantize's reference
code makes them, IQ4_NL and IQ4_XS as ggml's quantize_iq4_nl / quantize_iq4_xs without an importance
matrix); the 32-wide Q4_0/Q4_1/Q5_0/Q5_1 use the search ggml runs when given an importance matrix,
here with all-ones importance, where llama-quantize without one would take plain absmax / min-max scales.
Codes are recomputed for the stored (fp16-rounded) scales, except in IQ4_NL / IQ4_XS, which keep ggml's
float32 ones.

Everything is vectorised over all blocks of a chunk of rows (numpy, float32); Python loops run only over
candidate scales and over the positions inside one block, never over blocks. ``search=False`` gives the
plain min/max (absmax) encodings instead, for comparison.
"""
from __future__ import annotations

import gguf.quants
import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

T = GGMLQuantizationType
QK_K = 256
_EPS = 1e-15  # ggml's GROUP_MAX_EPS
_CHUNK = 1 << 17  # weights per vectorised step: keeps temporaries small and cache-friendly

QUANTIZED_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
                   T.IQ4_NL, T.IQ4_XS)
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
SUPPORTED = FLOAT_TYPES + QUANTIZED_TYPES


def block_size(qtype: GGMLQuantizationType) -> int:
    return GGML_QUANT_SIZES[T(qtype)][0]


def row_bytes(qtype: GGMLQuantizationType, k: int) -> int:
    bs, ts = GGML_QUANT_SIZES[T(qtype)]
    if k % bs:
        raise ValueError(f"{T(qtype).name} needs rows of a multiple of {bs} values, got {k}")
    return k // bs * ts


def quantize(w: np.ndarray, qtype: GGMLQuantizationType, *, search: bool = True) -> np.ndarray:
    """``float32 [rows, K]`` (or 1-D ``[K]``) -> ``uint8 [rows, row_bytes]`` in ``qtype``'s GGUF block layout.
    F32/F16/BF16 return the raw little-endian bytes. ``search=False``: plain min/max scales (a baseline)."""
    qtype = T(qtype)
    w = np.asarray(w, dtype=np.float32)
    if w.ndim == 1:
        w = w[None]
    if w.ndim != 2:
        raise ValueError(f"quantize expects a 2-D [rows, K] array, got shape {w.shape}")
    rows, k = w.shape
    if qtype == T.F32:
        return np.ascontiguousarray(w).view(np.uint8).reshape(rows, k * 4)
    if qtype == T.F16:
        return w.astype(np.float16).view(np.uint8).reshape(rows, k * 2)
    if qtype == T.BF16:
        return _to_bf16(w).view(np.uint8).reshape(rows, k * 2)
    if qtype not in _QUANTIZERS:
        names = ", ".join(t.name for t in SUPPORTED)
        raise ValueError(f"cannot quantize to {qtype.name}; supported: {names}")
    bs = GGML_QUANT_SIZES[qtype][0]
    nbytes = row_bytes(qtype, k)
    if not np.isfinite(w).all():
        raise ValueError("cannot quantize a tensor with NaN or infinite values")
    out = np.empty((rows, nbytes), dtype=np.uint8)
    fn = _QUANTIZERS[qtype]
    step = max(1, _CHUNK // k)
    for r in range(0, rows, step):
        blocks = w[r:r + step].reshape(-1, bs)
        out[r:r + step] = fn(blocks, search).reshape(-1, nbytes)
    return out


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Bytes from `quantize` back to float32 ``[rows, K]``, with gguf's reference decoder."""
    return gguf.quants.dequantize(np.asarray(data, dtype=np.uint8), T(qtype))


def _to_bf16(w: np.ndarray) -> np.ndarray:
    bits = w.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even, as gguf/ggml do
    nan = np.isnan(w)
    rounded[nan] = (bits[nan] >> 16) | 64
    return rounded.astype(np.uint16)


# ---- shared helpers --------------------------------------------------------------------------------------
# The searches work on "column" arrays [n, B]: one (sub-)block per column, so that per-block scalars [B]
# broadcast along the long axis and per-block sums are sums of n contiguous rows (fast in numpy).

def _cols(x: np.ndarray, n: int) -> np.ndarray:
    """[..., K] -> [n, K*.../n]: consecutive runs of n values as columns."""
    return np.ascontiguousarray(x.reshape(-1, n).T)


def _f16(x: np.ndarray) -> np.ndarray:
    """float32 -> the float16 value ggml stores, as float32."""
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16).reshape(-1, 1).view(np.uint8)


def _dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Column-wise sum of a*b."""
    return np.einsum("ij,ij->j", a, b)


def _safe_div(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    nz = b != 0
    return np.where(nz, a / np.where(nz, b, 1), 0).astype(np.float32)


def _inv(d: np.ndarray) -> np.ndarray:
    return _safe_div(1, d)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """Per column, the value of largest magnitude with its sign (ggml's ``max`` in make_qx_quants)."""
    idx = np.abs(x).argmax(axis=0)
    return x[idx, np.arange(x.shape[1])]


def _rint_clip(v: np.ndarray, lo: float, hi: float) -> np.ndarray:
    np.rint(v, out=v)
    return np.clip(v, lo, hi, out=v)


def _codes(x: np.ndarray, d: np.ndarray, lo: int, hi: int, offset: np.ndarray | None = None) -> np.ndarray:
    """Best codes for fixed (stored) scales: clip(rint((x + offset) / d)), columns of x."""
    v = x + offset if offset is not None else x.copy()
    v *= _inv(d)
    return _rint_clip(v, lo, hi)


# ---- scale searches (ggml-quants.c) ------------------------------------------------------------------------

def _qx(x: np.ndarray, nmax: int, w: np.ndarray | None, search: bool = True) -> np.ndarray:
    """make_qx_quants: the scale per column of x [n, B] for codes in [-nmax, nmax-1]; weights w (None: x^2).
    Candidates -(nmax + 0.1 i)/max, i in -9..9, each refit by weighted least squares; best kept."""
    mx = _signed_absmax(x)
    zero = np.abs(mx) < _EPS
    mx = np.where(zero, 1, mx).astype(np.float32)
    if not search:
        return np.where(zero, 0, mx / -nmax).astype(np.float32)
    if w is None:
        w = x * x
    wx = w * x
    scale = best = None
    for i in [0] + [i for i in range(-9, 10) if i]:
        inv = (-(nmax + 0.1 * i) / mx).astype(np.float32)
        l = _rint_clip(x * inv, -nmax, nmax - 1)
        slx = _dot(wx, l)
        sl2 = _dot(w * l, l)
        s = _safe_div(slx, sl2)
        if scale is None:
            scale, best = s, s * slx
            continue
        better = (sl2 > 0) & (slx * slx > best * sl2)
        scale = np.where(better, s, scale)
        best = np.where(better, s * slx, best)
    return np.where(zero, 0, scale).astype(np.float32)


def _qkx(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
         use_mad: bool = False, search: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """make_qkx2_quants: per column of x [n, B], (scale, m >= 0) for x ~ scale * L - m, L in [0, nmax].
    Candidates (nmax + rmin + rdelta i)/(max - min), each with its weighted least-squares (scale, min); as in
    ggml, a better candidate's min becomes the origin of the following candidates."""
    mn = np.minimum(x.min(axis=0), 0).astype(np.float32)
    mx = x.max(axis=0)
    flat = mx <= mn
    if not search:
        return np.where(flat, 0, (mx - mn) / nmax).astype(np.float32), -mn
    sw = w.sum(axis=0)
    wx = w * x
    sx = wx.sum(axis=0)
    sx2 = _dot(wx, x)

    def error(s, m, l, sl, sl2, sxl):  # weighted error of x ~ s*l + m
        if use_mad:
            return _dot(w, np.abs(l * s + m - x))
        return sx2 + s * s * sl2 + m * m * sw - 2 * s * sxl - 2 * m * sx + 2 * s * m * sl

    def codes(scale_num, mn):
        rng = np.where(flat, 1, mx - mn).astype(np.float32)
        inv = (scale_num / rng).astype(np.float32)
        l = _rint_clip((x - mn) * inv, 0, nmax)
        wl = w * l
        return inv, l, wl.sum(axis=0), _dot(wl, l), _dot(wx, l)

    inv, l, sl, sl2, sxl = codes(nmax, mn)
    scale = 1 / inv
    best_err = error(scale, mn, l, sl, sl2, sxl)
    for i in range(nstep + 1):
        _, l, sl, sl2, sxl = codes(rmin + rdelta * i + nmax, mn)
        det = sw * sl2 - sl * sl
        s = _safe_div(sw * sxl - sx * sl, det)
        m = _safe_div(sl2 * sx - sl * sxl, det)
        pos = m > 0
        s = np.where(pos, _safe_div(sxl, sl2), s)
        m = np.where(pos, 0, m)
        err = error(s, m, l, sl, sl2, sxl)
        better = (det > 0) & (err < best_err)
        best_err = np.where(better, err, best_err)
        scale = np.where(better, s, scale)
        mn = np.where(better, m, mn).astype(np.float32)
    return np.where(flat, 0, scale).astype(np.float32), (-mn).astype(np.float32)


def _refine(x, w, L, lo, hi, need_sl2):
    """The coordinate descent of make_q3_quants / make_qp_quants: move one code at a time to where the
    least-squares scale of the others puts it, keeping each move that lowers the weighted error.
    Columns of x, w, L [n, B]; returns the least-squares scale of the final codes."""
    sumlx = _dot(w * x, L)
    suml2 = _dot(w * L, L)
    for _ in range(5):
        changed = False
        for i in range(x.shape[0]):
            xi, wi, li = x[i], w[i], L[i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            ok = (slx > 0) & (sl2 > 0) if need_sl2 else slx > 0
            new = np.clip(np.rint(xi * _safe_div(sl2, slx)), lo, hi)
            ok &= new != li
            slx = slx + wi * xi * new
            sl2 = sl2 + wi * new * new
            ok &= (sl2 > 0) & (slx * slx * suml2 > sumlx * sumlx * sl2)
            if ok.any():
                L[i] = np.where(ok, new, li)
                sumlx = np.where(ok, slx, sumlx)
                suml2 = np.where(ok, sl2, suml2)
                changed = True
        if not changed:
            break
    return _safe_div(sumlx, suml2)


def _q3(x: np.ndarray, nmax: int, search: bool = True) -> np.ndarray:
    """make_q3_quants(do_rmse): the scale per column of x [n, B] for codes in [-nmax, nmax-1]."""
    mx = _signed_absmax(x)
    zero = np.abs(mx) < _EPS
    mx = np.where(zero, 1, mx).astype(np.float32)
    if not search:
        return np.where(zero, 0, mx / -nmax).astype(np.float32)
    L = _rint_clip(x * (-nmax / mx), -nmax, nmax - 1)
    return np.where(zero, 0, _refine(x, x * x, L, -nmax, nmax - 1, need_sl2=False)).astype(np.float32)


def _qp(x: np.ndarray, nmax: int, w: np.ndarray | None, search: bool = True):
    """make_qp_quants: non-negative columns x [n, S] -> (scale [S], codes [n, S] in [0, nmax])."""
    mx = x.max(axis=0)
    zero = mx < _EPS
    mx = np.where(zero, 1, mx).astype(np.float32)
    inv = (nmax / mx).astype(np.float32)
    if search:
        best = _dot(w, (x - np.rint(x * inv) / inv) ** 2)
        for i in [i for i in range(-4, 5) if i]:
            inv_i = ((0.1 * i + nmax) / mx).astype(np.float32)
            mse = _dot(w, (x - np.minimum(np.rint(x * inv_i), nmax) / inv_i) ** 2)
            better = mse < best
            best = np.where(better, mse, best)
            inv = np.where(better, inv_i, inv)
    L = _rint_clip(x * inv, 0, nmax)
    if not search:
        return np.where(zero, 0, 1 / inv).astype(np.float32), L
    scale = _refine(x, w, L, 0, nmax, need_sl2=True)
    return np.where(zero, 0, scale).astype(np.float32), np.where(zero, 0, L)


def _legacy_weights(x: np.ndarray) -> np.ndarray:
    """Importance weights of the 32-wide types without an imatrix: sqrt(sigma2 + x^2), what ggml uses when
    quant_weights are all ones (sigma2 here: the block's own mean square)."""
    x2 = x * x
    return np.sqrt(x2.mean(axis=0) + x2)


def _k_weights(x: np.ndarray) -> np.ndarray:
    """ggml's Q4_K/Q5_K weights without an imatrix: rms of the sub-block + |x|."""
    return np.sqrt((x * x).mean(axis=0)) + np.abs(x)


# ---- bit packing (row layout: [B, ...] bytes per block) -----------------------------------------------------

def _u8(a) -> np.ndarray:
    return np.asarray(a).astype(np.uint8)


def _rows(L: np.ndarray, b: int) -> np.ndarray:
    """Column-layout codes back to uint8 [b, block]."""
    return np.ascontiguousarray(_u8(L).T).reshape(b, -1)


def _nibbles(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return _u8(lo) | (_u8(hi) << 4)


def _crumbs(L: np.ndarray) -> np.ndarray:
    """2-bit codes [B, 256] -> [B, 64]: byte l of each 128 half holds codes l, l+32, l+64, l+96."""
    q = L.reshape(L.shape[0], 2, 4, 32) & 3
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(L.shape[0], 64)


def _bits_to_bytes(bits: np.ndarray) -> np.ndarray:
    """bits [B, 8, m] (bit k of byte j at [:, k, j]) -> bytes [B, m]."""
    out = np.zeros((bits.shape[0], bits.shape[2]), dtype=np.uint8)
    for k in range(8):
        out |= bits[:, k] << k
    return out


def _pack_q5_high(L: np.ndarray) -> np.ndarray:
    """Fifth bits of 32 codes [B, 32] -> 4 bytes of a little-endian uint32 (bit j = code j)."""
    hb = (L >> 4) & 1
    return _bits_to_bytes(np.ascontiguousarray(hb.reshape(L.shape[0], 4, 8).transpose(0, 2, 1)))


def _pack_k4_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [B, 8] -> ggml's 12-byte Q4_K/Q5_K layout."""
    ls, lm = _u8(ls), _u8(lm)
    a = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    b = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    c = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return np.concatenate([a, b, c], axis=1)


# ---- 32-wide types (blocks arrive as rows [B, 32]) ----------------------------------------------------------

def _q8_0(blocks: np.ndarray, search: bool) -> np.ndarray:
    x = _cols(blocks, 32)
    d = np.abs(x).max(axis=0) / 127
    L = _codes(x, d, -127, 127)
    if search:  # least-squares refit of the scale for these codes, kept where it lowers the error
        d_ls = _safe_div(_dot(x, L), _dot(L, L))
        def err(s):
            return _dot(x - _f16(s) * L, x - _f16(s) * L)

        d = np.where(err(d_ls) < err(d), d_ls, d)
    return np.concatenate([_f16_bytes(d), _rows(L.astype(np.int8).view(np.uint8), len(d))], axis=1)


def _sym_32(blocks, search, nmax):
    """Q4_0 (nmax 8) / Q5_0 (nmax 16): the scale and codes 0..2*nmax-1 (around nmax)."""
    x = _cols(blocks, 32)
    d = _qx(x, nmax, _legacy_weights(x), search)  # search=False: llama.cpp's reference, max -> -nmax
    L = _codes(x, _f16(d), -nmax, nmax - 1) + nmax
    return d, _rows(L, len(d))


def _q4_0(blocks, search):
    d, L = _sym_32(blocks, search, 8)
    return np.concatenate([_f16_bytes(d), _nibbles(L[:, :16], L[:, 16:])], axis=1)


def _q5_0(blocks, search):
    d, L = _sym_32(blocks, search, 16)
    return np.concatenate([_f16_bytes(d), _pack_q5_high(L), _nibbles(L[:, :16] & 15, L[:, 16:] & 15)], axis=1)


def _asym_32(blocks, search, nmax):
    """Q4_1 / Q5_1: x ~ d * L + m, m the block's (searched) minimum."""
    x = _cols(blocks, 32)
    if search:
        d, neg_m = _qkx(x, _legacy_weights(x), nmax, -0.9, 0.05, 36)  # ggml's parameters for these types
        m = -neg_m
    else:  # llama.cpp's reference: min and max
        m = x.min(axis=0)
        d = ((x.max(axis=0) - m) / nmax).astype(np.float32)
    m16 = _f16(m)
    L = _codes(x, _f16(d), 0, nmax, offset=-m16)
    return d, m, _rows(L, len(d))


def _q4_1(blocks, search):
    d, m, L = _asym_32(blocks, search, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(m), _nibbles(L[:, :16], L[:, 16:])], axis=1)


def _q5_1(blocks, search):
    d, m, L = _asym_32(blocks, search, 31)
    return np.concatenate([_f16_bytes(d), _f16_bytes(m), _pack_q5_high(L),
                           _nibbles(L[:, :16] & 15, L[:, 16:] & 15)], axis=1)


# ---- K-quants (256-wide super-blocks, rows [B, 256]) --------------------------------------------------------

def _sub_codes(x, d, sc, dmin, mn, nmax):
    """Codes of column sub-blocks x [sub, B*nsub] for stored super-block scales d, dmin [B] and
    sub-block scales/mins sc, mn [B, nsub] (x ~ d*sc*L - dmin*mn)."""
    ds = (_f16(d)[:, None] * sc).reshape(-1)
    ms = (_f16(dmin)[:, None] * mn).reshape(-1).astype(np.float32)
    return _codes(x, ds, 0, nmax, offset=ms)


def _q45_k(blocks, search, nmax, rmin, rdelta, nstep):
    b = blocks.shape[0]
    x = _cols(blocks, 32)  # [32, B*8]
    w = _k_weights(x)
    scales, mins = _qkx(x, w, nmax, rmin, rdelta, nstep, search=search)
    # The 6-bit scales and mins are chosen by search too (make_qp_quants), weighted by each
    # sub-block's total weight, as ggml's quantize_row_q4_K_impl does.
    sw = w.sum(axis=0).reshape(b, 8).T
    d, ls = _qp(scales.reshape(b, 8).T.copy(), 63, sw, search)
    dmin, lm = _qp(mins.reshape(b, 8).T.copy(), 63, sw, search)
    ls, lm = ls.T, lm.T
    L = _rows(_sub_codes(x, d, ls, dmin, lm, nmax), b)
    return d, dmin, ls, lm, L


def _q4_k(blocks, search):
    d, dmin, ls, lm, L = _q45_k(blocks, search, 15, -1.0, 0.1, 20)
    q = L.reshape(-1, 4, 2, 32)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k4_scales(ls, lm),
                           _nibbles(q[:, :, 0], q[:, :, 1]).reshape(-1, 128)], axis=1)


def _q5_k(blocks, search):
    d, dmin, ls, lm, L = _q45_k(blocks, search, 31, -0.5, 0.1, 15)
    b = L.shape[0]
    qh = _bits_to_bytes((L >> 4).reshape(b, 8, 32) & 1)
    q = (L & 0xF).reshape(b, 4, 2, 32)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k4_scales(ls, lm), qh,
                           _nibbles(q[:, :, 0], q[:, :, 1]).reshape(b, 128)], axis=1)


def _q2_k(blocks, search):
    b = blocks.shape[0]
    x = _cols(blocks, 16)  # [16, B*16]
    scales, mins = _qkx(x, np.abs(x), 3, -0.5, 0.1, 15, use_mad=True, search=search)
    scales, mins = scales.reshape(b, 16), mins.reshape(b, 16)
    max_scale, max_min = scales.max(axis=1), mins.max(axis=1)
    ls = np.clip(np.rint(_safe_div(15, max_scale)[:, None] * scales), 0, 15)
    lm = np.clip(np.rint(_safe_div(15, max_min)[:, None] * mins), 0, 15)
    d, dmin = (max_scale / 15).astype(np.float32), (max_min / 15).astype(np.float32)
    L = _rows(_sub_codes(x, d, ls, dmin, lm, 3), b)
    return np.concatenate([_u8(ls) | (_u8(lm) << 4), _crumbs(L), _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def _q3_k(blocks, search):
    b = blocks.shape[0]
    x = _cols(blocks, 16)  # [16, B*16]
    scales = _q3(x, 4, search).reshape(b, 16)
    max_scale = _signed_absmax(scales.T)
    inv = _safe_div(-32, max_scale)
    l6 = np.clip(np.rint(inv[:, None] * scales), -32, 31)
    d = _inv(inv)
    L = _rows(_codes(x, (_f16(d)[:, None] * l6).reshape(-1), -4, 3) + 4, b)
    hmask = _bits_to_bytes((L >> 2).reshape(b, 8, 32) & 1)
    l6 = _u8(l6 + 32)
    lo, hi = l6 & 0xF, (l6 >> 4).reshape(b, 4, 4)
    scales12 = np.concatenate([lo[:, :8] | (lo[:, 8:] << 4),
                               hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)], axis=1)
    return np.concatenate([hmask, _crumbs(L), scales12, _f16_bytes(d)], axis=1)


def _q6_k(blocks, search):
    b = blocks.shape[0]
    x = _cols(blocks, 16)  # [16, B*16]
    scales = _qx(x, 32, None, search).reshape(b, 16)  # weights x^2: ggml's rmse_type 1
    max_scale = _signed_absmax(scales.T)
    nz = np.abs(max_scale) >= _EPS
    inv = np.where(nz, _safe_div(-128, max_scale), 0).astype(np.float32)
    l8 = np.minimum(np.rint(inv[:, None] * scales), 127)
    d = _inv(inv)
    q = (_rows(_codes(x, (_f16(d)[:, None] * l8).reshape(-1), -32, 31) + 32, b)).reshape(b, 2, 4, 32)
    lo, hi = q & 0xF, q >> 4
    ql = np.stack([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2).reshape(b, 128)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(b, 64)
    return np.concatenate([ql, qh, l8.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


# ---- IQ4_NL / IQ4_XS: codes index kvalues_iq4nl ---------------------------------------------------------------

_IQ4_VALUES = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)
# best_index_int8 (the nearest table value, the upper one on a tie) by a lookup on floor(2v): the midpoints
# between table values are multiples of 1/2, and ggml's comparison of the two distances is exact in float32
_IQ4_LO, _IQ4_HI = int(_IQ4_VALUES[0] + _IQ4_VALUES[1]) - 1, int(_IQ4_VALUES[-2] + _IQ4_VALUES[-1])
_IQ4_INDEX = np.searchsorted(_IQ4_VALUES[1:] + _IQ4_VALUES[:-1], np.arange(_IQ4_LO, _IQ4_HI + 1), side="right")
_IQ4_NEAREST = _IQ4_VALUES[_IQ4_INDEX]


def _iq4_lookup(v: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``table`` (_IQ4_INDEX: codes, _IQ4_NEAREST: their values) at the table value nearest to each v."""
    k = np.floor(v * 2)
    np.clip(k, _IQ4_LO, _IQ4_HI, out=k)
    return table[k.astype(np.intp) - _IQ4_LO]


def _iq4_fit(x: np.ndarray, w: np.ndarray, inv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted sums (q.x, q.q) per column for the codes of x [32, N] at inverse scale inv [N]. Summed over
    axis 0 of C-ordered arrays numpy adds row after row: ggml's order, so the same float32 sums."""
    q = _iq4_lookup(x * inv, _IQ4_NEAREST)
    wq = w * q
    return (wq * x).sum(axis=0), (wq * q).sum(axis=0)


def _iq4_scales(x: np.ndarray, search: bool) -> np.ndarray:
    """quantize_row_iq4_nl_impl's scale per column of x [32, N] (ntry 7; weights x^2, ggml's without an
    importance matrix): the least-squares scale for the codes at scale max/127, then for those at each inverse
    scale (i - 127)/max, i in -7..7 (the largest weight onto about the table's -127 end), the best kept."""
    mx = _signed_absmax(x)
    zero = np.abs(mx) < _EPS
    mx = np.where(zero, 1, mx).astype(np.float32)
    v0 = _IQ4_VALUES[0]
    if not search:  # absmax: the largest weight onto -127
        return np.where(zero, 0, mx / v0).astype(np.float32)
    w = x * x
    sumqx, sumq2 = _iq4_fit(x, w, _inv(-mx / v0))
    d = _safe_div(sumqx, sumq2)
    best = d * sumqx
    for itry in range(-7, 8):
        sumqx, sumq2 = _iq4_fit(x, w, (np.float32(itry) + v0) / mx)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = np.where(better, _safe_div(sumqx, sumq2), d)
        best = np.where(better, d * sumqx, best)
    return np.where(zero, 0, d).astype(np.float32)


def _iq4_codes(x: np.ndarray, d: np.ndarray, b: int) -> np.ndarray:
    """Codes of columns x [32, N] for float32 scales d [N] (not fp16-rounded, as ggml), as rows
    [b, 16 * N / b] of packed nibbles: byte j of a block of 32 holds codes j and j + 16."""
    L = _rows(_iq4_lookup(x * _inv(d), _IQ4_INDEX), b).reshape(b, -1, 2, 16)
    return _nibbles(L[:, :, 0], L[:, :, 1]).reshape(b, -1)


def _iq4_nl(blocks, search):
    x = _cols(blocks, 32)
    d = _iq4_scales(x, search)
    return np.concatenate([_f16_bytes(d), _iq4_codes(x, d, len(d))], axis=1)


def _iq4_xs(blocks, search):
    b = blocks.shape[0]
    x = _cols(blocks, 32)  # [32, B*8]
    scales = _iq4_scales(x, search).reshape(b, 8)
    d = -_signed_absmax(scales.T) / np.float32(32)  # (-0.0 for an all-zero block, as in ggml)
    l = np.clip(np.rint(_inv(d)[:, None] * scales), -32, 31)
    L = _iq4_codes(x, (d[:, None] * l).reshape(-1).astype(np.float32), b)
    l = _u8(l + 32)
    scales_h = np.zeros(b, dtype=np.uint16)
    for ib in range(8):
        scales_h |= (l[:, ib] >> 4).astype(np.uint16) << (2 * ib)
    return np.concatenate([_f16_bytes(d), scales_h.reshape(-1, 1).view(np.uint8),
                           (l[:, 0::2] & 0xF) | ((l[:, 1::2] & 0xF) << 4), L], axis=1)


_QUANTIZERS = {
    T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1,
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
    T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs,
}
