"""The GGUF GEMV on 8-bit activations in CUDA C (``gguf_gemv.cu``): what ``triton/gguf_q8.py``'s
``gemv_q8`` runs for the types listed here on a CUDA device, the Triton kernel for the others."""
from __future__ import annotations

import logging
import re
from functools import cache
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from ..triton.gguf import num_sms, type_args, value_table
from . import runtime

log = logging.getLogger("pocketllm")
T = GGMLQuantizationType
SOURCE = Path(__file__).with_name("gguf_gemv.cu")
# type -> the decoder's name in the source (its geometry is the source's <NAME>_BODY / _HDR / _PIECES,
# and <NAME>_LUT, where it has one, the words of its table staged in shared memory)
DECODERS = {t: t.name.lower() for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
                                         T.IQ4_NL, T.IQ4_XS, T.MXFP4, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S,
                                         T.IQ1_S, T.IQ1_M)}
CUDA_GEMV_TYPES: frozenset[GGMLQuantizationType] = frozenset(DECODERS)
# R weight rows a block of NT threads; W: blocks an SM, each taking tiles of R rows in turn, or 0: a block a
# tile.  The fastest over the 8B shapes on the H200 (benchmarks/kernels/bench_cuda_gemv.py, weights read from memory; by
# the sums over the shapes printed there): 2 x 64 for the types without a table (results/h200-cuda-gemv-k-types.txt,
# -more-types.txt) but Q8_0 (4 x 128); 4 x 128 with 4 blocks an SM for the lattice types, whose grids are staged
# in shared memory once a block (results/h200-cuda-gemv-lattice.txt).  More rows a block share the activations'
# loads but leave fewer blocks than SMs x resident blocks for the small matrices.
CONFIG = dict(R=2, NT=64, W=0)
TYPE_CONFIG: dict[GGMLQuantizationType, dict] = {
    T.Q8_0: dict(R=4, NT=128),
    **{t: dict(R=4, NT=128, W=4) for t in (T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M)}}
_OUT = {torch.bfloat16: ("u16", 1), torch.float16: ("u16", 0), torch.float32: ("float", 0)}  # C type, bf16 rounding


@cache
def source() -> str:
    return SOURCE.read_text()


@cache
def geometry(qtype: GGMLQuantizationType) -> dict[str, int]:
    """The decoder's BLOCK / BODY / HDR / PIECES / LUT as the source defines them (LUT 0 where absent)."""
    name = DECODERS[qtype].upper()
    found = {f: re.search(rf"#define {name}_{f} (\d+)", source()) for f in ("BLOCK", "BODY", "HDR", "PIECES", "LUT")}
    return {f: int(m.group(1)) if m else 0 for f, m in found.items()}


@cache
def config(qtype: GGMLQuantizationType) -> dict:
    return {**CONFIG, **TYPE_CONFIG.get(qtype, {})}


_failed: set[GGMLQuantizationType] = set()  # types whose kernel NVRTC could not build here


def usable(qtype: GGMLQuantizationType, device: torch.device) -> bool:
    return qtype in CUDA_GEMV_TYPES and qtype not in _failed and device.type == "cuda" and runtime.available()


@cache  # the defines and compile key once per variant, not every call (a failed build raises: not cached)
def _kernel(qtype: GGMLQuantizationType, dtype: torch.dtype, grouped: bool, device: torch.device, r: int, nt: int):
    dec = DECODERS[qtype]
    out_t, bf16 = _OUT[dtype]
    name = f"gemv_{dec}_r{r}_t{nt}_{str(dtype).split('.')[-1]}{'_grouped' if grouped else ''}"
    up = dec.upper()
    defines = dict(KERNEL=name, TYPE=dec, ACT=f"Act{up}", RAW=f"Raw{up}", BODY=f"{up}_BODY",
                   HDR=f"{up}_HDR", PIECES=f"{up}_PIECES", LUT=geometry(qtype)["LUT"], R=r, NT=nt, OUT_T=out_t,
                   OUT_BF16=bf16, GROUPED=int(grouped))
    return runtime.kernel(source(), name, defines, device)


def gemv(xq: torch.Tensor, xd: torch.Tensor, xs: torch.Tensor, packed: torch.Tensor, qtype: GGMLQuantizationType,
         k: int, n: int, rows: int, dtype: torch.dtype, *, ids: torch.Tensor | None = None,
         x_div: int = 1, r: int | None = None, nt: int | None = None, w: int | None = None) -> torch.Tensor | None:
    """y [rows, n] of ``dtype``: row m is x[m] . W[j] (x in 8 bits: ``xq``, ``xd``, ``xs`` as
    ``int8_act``); with ``ids``, x[m // x_div] . W_ids[m][j] for a stack of matrices of n rows.
    None where NVRTC cannot build the kernel on this machine (logged once; the caller falls back)."""
    g = geometry(qtype)
    assert k % g["BLOCK"] == 0 and xq.stride(0) % 16 == 0 and xq.data_ptr() % 16 == 0, "misaligned activations"
    cfg = config(qtype)
    r, nt, w = r or cfg["R"], nt or cfg["NT"], cfg["W"] if w is None else w
    try:
        kern = _kernel(qtype, dtype, ids is not None, packed.device, r, nt)
    except RuntimeError as e:
        log.warning("the CUDA C GEMV for %s is unavailable here, using the Triton one: %s", qtype.name, e)
        _failed.add(qtype)
        return None
    y = torch.empty((rows, n), dtype=dtype, device=packed.device)
    tiles = (n + r - 1) // r
    blocks = min(tiles, w * num_sms(packed.device)) if w else tiles
    kern.launch((blocks, rows, 1), nt, packed, xq, xd, xs, y, y if ids is None else ids, value_table(packed.device, qtype),
                n, packed.shape[1], type_args(qtype, k)[1], k // g["BLOCK"], x_div, xq.stride(0), xd.stride(0),
                y.stride(0))
    return y
