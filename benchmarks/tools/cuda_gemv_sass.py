"""Compile the CUDA C GEMV (pocketllm/kernels/cuda/gguf_gemv.cu) for sm_90 without a GPU and count its
SASS instructions and registers, per type and tile.

    python benchmarks/tools/cuda_gemv_sass.py --nvrtc PATH/libnvrtc.so.13 [--source FILE.cu] IQ2_XXS,IQ2_XS 4x128

NVRTC comes from the `nvidia-cuda-nvrtc` wheel (pip download it and unzip: no GPU or toolkit needed),
cuobjdump from the triton wheel.  The defines are gguf_gemv.py's, for bf16 output; --source compiles
another version of the file (an older commit's, from git show) to compare.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from gguf import GGMLQuantizationType as T

from pocketllm.kernels.cuda import gguf_gemv as cg

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def cubin(nv: ctypes.CDLL, src: str, defines: dict) -> bytes:
    prog = ctypes.c_void_p()
    assert nv.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"g.cu", 0, None, None) == 0
    opts = ["--gpu-architecture=sm_90", "--std=c++17"] + [f"-D{k}={v}" for k, v in defines.items()]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    res = nv.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    if res != 0:
        nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nv.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(log.value.decode())
    nv.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    out = ctypes.create_string_buffer(size.value)
    nv.nvrtcGetCUBIN(prog, out)
    return out.raw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("types")
    ap.add_argument("tile", help="RxNT")
    ap.add_argument("--nvrtc", required=True)
    ap.add_argument("--source", default=str(cg.SOURCE))
    args = ap.parse_args()
    nv = ctypes.CDLL(args.nvrtc)
    src = open(args.source).read()
    r, nt = map(int, args.tile.split("x"))
    for name in args.types.split(","):
        dec = cg.DECODERS[T[name]]
        up = dec.upper()
        lut = re.search(rf"#define {up}_LUT (\d+)", src)
        defines = dict(KERNEL="k", TYPE=dec, ACT=f"Act{up}", RAW=f"Raw{up}", BODY=f"{up}_BODY", HDR=f"{up}_HDR",
                       PIECES=f"{up}_PIECES", LUT=lut.group(1) if lut else 0, R=r, NT=nt, OUT_T="u16", OUT_BF16=1,
                       GROUPED=0)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin(nv, src, defines))
            f.flush()
            res = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
            sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
        ins = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
        ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", ln.split("*/", 1)[1].strip()).split()[0] for ln in ins)
        regs = re.search(r"REG:(\d+)", res).group(1)
        print(f"{name:8s} {args.tile:7s} {len(ins):5d} instructions, {regs} registers | "
              + " ".join(f"{o}:{c}" for o, c in ops.most_common(8)), flush=True)


if __name__ == "__main__":
    main()
