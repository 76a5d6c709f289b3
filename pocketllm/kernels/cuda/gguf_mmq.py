"""GGUF products of several activation rows on tensor cores (``gguf_mmq.cu``), the weights decoded tile by
tile to int8 codes in shared memory: ``mmq`` / ``moe`` take the activations in 8 bits (``int8_act``, integer
products), ``mmq_x16`` in bf16 as they are (the codes turned into bf16 weights, bf16 products)."""
from __future__ import annotations

import math
import re
from functools import cache
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from ..triton.gguf import num_sms, type_args, value_table
from ..triton.split_sum import sum_splits
from . import gguf_gemv, runtime

T = GGMLQuantizationType
SOURCE = Path(__file__).with_name("gguf_mmq.cu")
MMQ_TYPES: frozenset[GGMLQuantizationType] = frozenset({  # with a ``<type>_tile``
    T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4, T.IQ2_XXS})
_K32 = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL, T.MXFP4})  # blocks of 32: K a multiple of 32
BN = 64  # weight rows a block (gguf_mmq.cu)
KB = 256  # weights a step
WAVES = 2  # K is split until the blocks fill this many programs an SM


@cache
def source() -> str:
    return gguf_gemv.source() + SOURCE.read_text()


@cache
def define(qtype: GGMLQuantizationType, key: str) -> int | None:
    """The number the type's tile decoder defines as ``<TYPE>_<key>`` (None: it defines none)."""
    found = re.search(rf"#define {gguf_gemv.DECODERS[qtype].upper()}_{key} (\d+)", source())
    return None if found is None else int(found.group(1))


def group(qtype: GGMLQuantizationType) -> int:
    """Weights a scale (32 or 16): the decoder's ``<TYPE>_G``."""
    return define(qtype, "G")


def x16_ok(qtype: GGMLQuantizationType) -> bool:
    """Whether the bf16 variant takes the type: its decoder defines ``<TYPE>_BIAS`` (7-bit codes)."""
    return qtype in MMQ_TYPES and define(qtype, "BIAS") is not None


def k_ok(qtype: GGMLQuantizationType, k: int) -> bool:
    return k % (32 if qtype in _K32 else KB) == 0


def usable(qtype: GGMLQuantizationType, device: torch.device, k: int = KB) -> bool:
    return qtype in MMQ_TYPES and k_ok(qtype, k) and device.type == "cuda" and runtime.available()


def splits_for(tiles: int, n_steps: int, device: torch.device) -> int:
    return max(1, min(n_steps, math.ceil(WAVES * num_sms(device) / tiles)))


def block_m(m: int) -> int:
    """Activation rows a block: 16, 32 or 64."""
    return min(64, max(16, 1 << (m - 1).bit_length()))


def x16_block_m(m: int, n: int, device: torch.device) -> int:
    """The bf16 variant's rows a block: ``block_m``, but 32 where blocks of 64 would not fill the GPU once
    (results/h200-cuda-mmq-x16.txt, 64 rows: 6144 weight rows 0.91x the time with 32, 28672 1.22x)."""
    bm = block_m(m)
    return 32 if bm == 64 and math.ceil(n / BN) * math.ceil(m / 64) < num_sms(device) else bm


def shared_bytes(qtype: GGMLQuantizationType, bm: int, x16: bool = False) -> int:
    """gguf_mmq.cu's dynamic shared memory: the weight tile, two activation buffers (int8 codes and their
    scales, or bf16 rows of KB + 32)."""
    ld = KB + group(qtype)  # (rows padded by a group: gguf_mmq.cu's MMQ_PAD)
    tile = BN * ld + 2 * BN * 16 * 4
    return tile + (2 * bm * (KB + 32) * 2 if x16 else 2 * bm * ld + 2 * 8 * bm * 4)


def mmq(xq: torch.Tensor, xd: torch.Tensor, xs: torch.Tensor, packed: torch.Tensor, qtype: GGMLQuantizationType,
        k: int, n: int, m: int, dtype: torch.dtype, splits: int | None = None, bm: int | None = None) -> torch.Tensor:
    """y [m, n] of ``dtype`` = x . W^T for x in 8 bits (``xq``, ``xd``, ``xs`` as ``int8_act``) and W packed by
    ``pack_gguf``; K split over ``splits`` programs (default: enough to fill the GPU), added in order after;
    ``bm`` activation rows a block (default ``block_m(m)``)."""
    assert qtype in MMQ_TYPES and k_ok(qtype, k) and xq.stride(0) % 16 == 0 and xq.data_ptr() % 16 == 0
    return _rows(qtype, bm or block_m(m), False, packed, xq, xd, xs, k, n, m, splits, dtype)


def mmq_x16(x: torch.Tensor, packed: torch.Tensor, qtype: GGMLQuantizationType, k: int, n: int,
            splits: int | None = None, bm: int | None = None) -> torch.Tensor:
    """y [m, n] bf16 = x . W^T for x bf16 [m, k] as it is (the bf16 variant); ``splits``, ``bm`` as ``mmq``."""
    m = x.shape[0]
    assert x16_ok(qtype) and k_ok(qtype, k) and x.dtype == torch.bfloat16 and x.stride(1) == 1
    assert x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 and m * x.stride(0) < 2 ** 32  # 16-byte pieces,
    # 32-bit offsets
    return _rows(qtype, bm or x16_block_m(m, n, packed.device), True, packed, x, x, x, k, n, m, splits, x.dtype)


def _rows(qtype, bm, x16, packed, xq, xd, xs, k, n, m, splits, dtype) -> torch.Tensor:
    """The [m, n] product of ``mmq`` / ``mmq_x16`` in ``dtype``: blocks of ``bm`` rows, K split ``splits`` ways
    (None: enough programs to fill the GPU), the splits' float32 sums added in order."""
    assert bm in (16, 32, 64)
    tiles = math.ceil(n / BN) * math.ceil(m / bm)
    s = splits or splits_for(tiles, -(-k // KB), packed.device)
    part = torch.empty((s, m, n), dtype=torch.float32, device=packed.device)
    _launch(qtype, bm, False, x16, (math.ceil(n / BN), math.ceil(m / bm), s), packed, xq, xd, xs, part, k, n, m,
            packed, packed, 1)  # (no pairs, experts)
    return sum_splits(part, dtype)


def moe(xq: torch.Tensor, xd: torch.Tensor, xs: torch.Tensor, stacked: torch.Tensor, qtype: GGMLQuantizationType,
        k: int, n: int, routing, x_div: int, dtype: torch.dtype) -> torch.Tensor:
    """[P, n] of ``dtype``: row p = x[p // x_div] . W_e^T for pair p's expert e (``routing`` as
    ``triton.moe.align`` makes it, row blocks of 16 or 32 pairs), x in 8 bits, ``stacked`` the experts'
    ``pack_gguf`` rows (expert e's n rows from e * n on)."""
    assert qtype in MMQ_TYPES and k_ok(qtype, k) and routing.block_m in (16, 32) and xq.stride(0) % 16 == 0
    out = torch.empty((routing.num_pairs, n), dtype=torch.float32, device=stacked.device)
    _launch(qtype, routing.block_m, True, False, (math.ceil(n / BN), routing.experts.numel(), 1), stacked, xq, xd,
            xs, out, k, n, routing.num_pairs, routing.pairs, routing.experts, x_div)
    return out.to(dtype)


def _launch(qtype, bm, moe_rows, x16, grid, packed, xq, xd, xs, out, k, n, m, pairs, experts, x_div):
    dec = gguf_gemv.DECODERS[qtype]
    up = dec.upper()
    name = f"mmq_{dec}_{bm}" + ("_moe" if moe_rows else "") + ("_x16" if x16 else "")
    defines = dict(KERNEL=name, MMQ=dec, MMQ_UNITS=f"{up}_UNITS", MMQ_G=group(qtype), MMQ_MIN=f"{up}_MIN",
                   MMQ_BM=bm, MMQ_PAD=group(qtype), MMQ_MOE=int(moe_rows), MMQ_K32=int(qtype in _K32),
                   MMQ_X16=int(x16), **(dict(MMQ_BIAS=f"{up}_BIAS") if x16 else {}))
    kern = runtime.kernel(source(), name, defines, packed.device)
    kern.launch(grid, 128, packed, xq, xd, xs, out, value_table(packed.device, qtype), n, m, packed.shape[1],
                type_args(qtype, k)[1], -(-k // KB), xq.stride(0), xd.stride(0), pairs, experts, x_div, k // 32,
                shared=shared_bytes(qtype, bm, x16))
