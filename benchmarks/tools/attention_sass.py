"""Compile the paged-attention kernel's decode variant for sm_90 without a GPU, with and without runs of a
request's rows (CHAINS), and print what differs: registers, the tensor-core instruction, instructions.

    python benchmarks/tools/attention_sass.py

The decode tile of the 8B shape (4 query heads a KV head, head_dim 128, KV blocks of 16, keys unsplit).
A row's bits are the same in a run only if both variants issue the same mma instruction on the same tile.
Uses triton.compiler internals (ASTSource, GPUTarget), as triton_gguf_sass.py.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pocketllm.kernels.triton import attention as ka

_TOOL = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
_PTRS = {"q_ptr": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16", "out_ptr": "*bf16", "part_acc": "*fp32",
         "part_ml": "*fp32", "block_tables": "*i32", "seq_lens": "*i32", "query_start_loc": "*i32",
         "sinks": "*fp32", "chain_pos": "*i32", "scale": "fp32", "softcap": "fp32"}


def compile_decode(chains: bool, window: bool, sinks: bool) -> tuple[int, set[str], int]:
    """(registers, mma instructions, SASS instructions) of one variant."""
    fn = ka._paged_attention_kernel
    consts = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, KV_BLOCK=16, TILE_N=32, BLOCK_Q=4, BLOCK_M=16,
                  USE_SOFTCAP=False, USE_WINDOW=window, USE_SINKS=sinks, PRECISION="tf32", NUM_SPLITS=1,
                  CHAINS=chains)
    sig = {a: "constexpr" if a in consts else _PTRS.get(a, "i32") for a in fn.arg_names}
    cubin = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4}).asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_TOOL, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_TOOL, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    instrs = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)
    return (int(re.search(r"REG:(\d+)", res).group(1)), {m for i in instrs for m in re.findall(r"HMMA\S*", i)},
            sum(not i.strip().startswith("NOP") for i in instrs))


def main():
    for window, sinks in ((False, False), (True, True)):
        for chains in (False, True):
            regs, mma, n = compile_decode(chains, window, sinks)
            print(f"window/sinks {window!s:5s} runs {chains!s:5s}: {regs} registers, {sorted(mma)}, "
                  f"{n} instructions", flush=True)


if __name__ == "__main__":
    main()
