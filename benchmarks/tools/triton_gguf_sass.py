"""Compile the Triton GGUF kernels for a GPU without one, and count what their inner loop executes.

    python benchmarks/tools/triton_gguf_sass.py                        # Q4_K Q6_K Q8_0: gemv (M=1), mma (M=16)
    python benchmarks/tools/triton_gguf_sass.py Q4_K gemv '{"BLOCK_N": 32}'   # a tile config
    python benchmarks/tools/triton_gguf_sass.py Q4_K,Q6_K gemv_q8      # the 8-bit-activation GEMV
    MOE=1 BLOCK_M=16 python benchmarks/tools/triton_gguf_sass.py Q4_K mma   # the tile kernel's MoE variant
    DUMP=1 python benchmarks/tools/triton_gguf_sass.py Q4_K gemv       # print the loop's SASS

Runs on any machine with the triton wheel (it ships ptxas and cuobjdump): the kernels are compiled
for sm_90 (H100/H200) with the specialisations a real launch gets (16-divisible pointers, strides,
row sizes), and the main loop (the longest backward branch) of the SASS is counted.  Instructions
per weight and thread is the figure to watch for the gemv regime, which is issue- and integer-bound
rather than memory-bound on Hopper: at 4 warp-instructions per clock per SM, 132 SMs and 1.98 GHz,
n instructions a weight run at most 33.5e12 / n weights/s (Q4_K at 4.8 TB/s needs 8.5e12).
Uses triton.compiler internals (ASTSource, GPUTarget): written against Triton 3.6-3.9.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import triton
from gguf import GGMLQuantizationType as T
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pocketllm.kernels.triton import gguf as kg

_TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_DIVISIBLE = ["x_ptr", "xq_ptr", "xd_ptr", "xs_ptr", "stride_xq", "stride_xd", "w_ptr", "lut_ptr", "y_ptr", "out_ptr",
              "row_bytes", "hdr_start", "stride_xm", "stride_ys", "stride_ym", "stride_on", "N"]


def compile_kernel(qtype, regime: str, block_m: int = 16, dtype: str = "bf16", cfg: dict | None = None, k: int = 4096):
    """(cubin, weights a thread decodes per loop step) of one kernel variant."""
    _, _, targs = kg.type_args(qtype, k)
    if regime == "gemv":
        fn, c = kg._gemv_kernel, dict(kg.GEMV_CONFIG, **(cfg or {}))
        extra = {"STAGES": c["num_stages"], "HAS_C": qtype in kg._OFFSET_TYPES, "GROUPED": False}
        opts = {"num_warps": c["num_warps"]}
    elif regime == "mma":
        fn, c = kg._mma().kernel, dict(kg.kernel_config("mma", qtype), **(cfg or {}))
        extra = {"WIDEN": False, "BLOCK_M": block_m, "BLOCK_K": c["BLOCK_K"], "STAGES": c["num_stages"],
                 "MOE": bool(os.environ.get("MOE")), "DENSE": False}
        targs = {"QT": int(qtype), "BPS": 256 // kg.block_size(qtype)}
        opts = {"num_warps": c["num_warps"]}
    elif regime == "gemv_q8":
        fn, c = kg._q8()._gemv_q8_kernel, dict(kg.kernel_config("gemv_q8", qtype), **(cfg or {}))
        extra = {"EMU": False, "GROUPED": False, "BS": targs["S"] * targs["SPB"]}
        targs = {"QT": int(qtype), "BB": targs["BB"], "HB": targs["HB"]}
        opts = {"num_warps": c["num_warps"]}
    else:
        fn, c = kg._dequant_kernel, dict(kg.DEQUANT_CONFIG, **(cfg or {}))
        extra, opts = {}, {"num_warps": c["num_warps"]}
    bpi = kg._blocks_per_step(qtype, c["BLOCK_K"])
    if regime == "mma":  # one step of 256 weights
        bpi = 256 // kg.block_size(qtype)
        consts = dict(**targs, BLOCK_N=c["BLOCK_N"], **extra)
    else:
        consts = dict(**targs, BLOCK_N=c["BLOCK_N"], BPI=bpi, **extra)
    ptrs = {"x_ptr": f"*{dtype}", "w_ptr": "*u8", "lut_ptr": "*i32" if qtype in kg._LATTICE else "*fp32",
            "y_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
            "xq_ptr": "*i8", "xd_ptr": "*fp32", "xs_ptr": "*fp32", "ids_ptr": "*i64", "pairs_ptr": "*i32",
            "experts_ptr": "*i32"}
    sig = {a: "constexpr" if a in consts else ptrs.get(a, "i32") for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in _DIVISIBLE if a in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=opts)
    per_thread = c["BLOCK_N"] * bpi * kg.block_size(qtype) / (32 * c["num_warps"])
    return compiled.asm["cubin"], per_thread


def loop_stats(cubin: bytes) -> tuple[int, list[str]]:
    """(registers, the instructions of the longest loop) of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        tool = os.path.join(_TOOLS, "cuobjdump")
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    instrs = [(int(m.group(1), 16), m.group(2)) for m in
              (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    loop: list[str] = []
    for addr, ins in instrs:
        m = re.search(r"BRA (0x[0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr:
            body = [x for a, x in instrs if int(m.group(1), 16) <= a <= addr]
            loop = max(loop, body, key=len)
    return int(re.search(r"REG:(\d+)", res).group(1)), loop


def main():
    types = [T[t] for t in (sys.argv[1] if len(sys.argv) > 1 else "Q4_K,Q6_K,Q8_0").split(",")]
    regimes = (sys.argv[2] if len(sys.argv) > 2 else "gemv,mma").split(",")
    cfg = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    for qtype in types:
        for regime in regimes:
            cubin, per_thread = compile_kernel(qtype, regime, block_m=int(os.environ.get("BLOCK_M", 16)), cfg=cfg)
            regs, loop = loop_stats(cubin)
            if os.environ.get("DUMP"):
                print("\n".join(loop))
            ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in loop)
            print(f"{qtype.name:6s} {regime:7s} regs {regs:3d}  loop {len(loop):4d} instr  "
                  f"{len(loop) / per_thread:5.1f} instr/weight/thread  {dict(ops.most_common(10))}", flush=True)


if __name__ == "__main__":
    main()
