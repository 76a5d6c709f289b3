"""PocketLLM's CPU GGUF matmul against llama.cpp's own dot-product kernels (ggml-cpu's ``vec_dot`` for the
type, on activations it quantized with its ``from_float``), one thread each, on the same weights: the
kernels alone, without either engine's graph, threads or other layers, so that a file's decode gap can
be put on its matmuls or elsewhere. PocketLLM's kernel is the one decode runs: the interleaved eight-row
layout (``x8``) for the types that have it (the output layer's too), else the row kernel. Weights are a GGUF
file's tensors (or random blocks); the two are
timed alternately, median over rounds of each one's best call, and their outputs compared.

    python benchmarks/kernels/cpu_kernels_vs_ggml.py --file model.IQ1_M.gguf --tensors blk.0.ffn_gate.weight,blk.0.ffn_down.weight

llama.cpp's libggml-cpu is taken from $LLAMACPP_DIR/build/bin (``../shared/peers/llamacpp.sh build cpu``).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from pocketllm.bench.report import environment
from pocketllm.kernels.cpu import gguf_ops

_SHIM = r"""
#include <stddef.h>
typedef void (*vec_dot_t)(int, float *, size_t, const void *, size_t, const void *, size_t, int);
void rows_dot(vec_dot_t f, int k, int n, const char *w, size_t row_bytes, const void *y, float *out) {
    for (int r = 0; r < n; r++) f(k, out + r, 0, w + (size_t)r * row_bytes, 0, y, 0, 1);
}
"""


class Traits(ctypes.Structure):  # ggml-cpu.h's struct ggml_type_traits_cpu
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


def ggml_cpu() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    bin_dir = Path(os.environ.get("LLAMACPP_DIR", "/tmp/llama.cpp")) / "build" / "bin"
    ggml = ctypes.CDLL(str(bin_dir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    ggml.ggml_cpu_init()
    ggml.ggml_get_type_traits_cpu.restype = ctypes.POINTER(Traits)
    d = Path(tempfile.mkdtemp())
    (d / "shim.c").write_text(_SHIM)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", str(d / "shim.c"), "-o", str(d / "shim.so")], check=True)
    return ggml, ctypes.CDLL(str(d / "shim.so"))


def best_of(fn, calls: int) -> float:
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", required=True)
    ap.add_argument("--tensors", required=True, help="comma-separated tensor names")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    env = environment()
    print(f"# {env['machine']['cpu']}, {env['date']}, commit {env.get('commit')}, 1 thread; {args.file}")
    ggml, shim = ggml_cpu()
    reader = gguf.GGUFReader(args.file)
    by_name = {t.name: t for t in reader.tensors}
    for name in args.tensors.split(","):
        t = by_name[name]
        qtype = t.tensor_type
        k, n = (int(v) for v in t.shape[:2])
        raw = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).reshape(n, -1))
        row_bytes = raw.shape[1]
        rows = gguf_ops.row_pointers([raw])
        x = torch.randn(1, k)
        tr = ggml.ggml_get_type_traits_cpu(int(qtype)).contents
        yt = tr.vec_dot_type
        y_bytes = gguf.quants.quant_shape_to_byte_shape((k,), gguf.GGMLQuantizationType(yt))[0]
        y = ctypes.create_string_buffer(y_bytes)
        from_float = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(
            ggml.ggml_get_type_traits_cpu(yt).contents.from_float)  # the activations' type's quantizer
        out_g = torch.empty(n)

        def theirs():
            from_float(x.data_ptr(), ctypes.addressof(y), k)
            shim.rows_dot(ctypes.c_void_p(tr.vec_dot), k, n, ctypes.c_void_p(raw.data_ptr()),
                          ctypes.c_size_t(row_bytes), y, ctypes.c_void_p(out_g.data_ptr()))

        packed = gguf_ops.repack_x8(rows, qtype, k)  # the interleaved layout where decode loads it (None: none)

        def ours():
            if packed is not None:
                return gguf_ops.gemm_x8(x, packed, n, qtype)
            return gguf_ops.gemm(x, rows, qtype, int8=1)

        theirs()
        ref = out_g.clone()
        mine = ours()[0]
        rel = float((mine - ref).abs().max() / ref.abs().max())
        times = {"pocketllm": [], "llama.cpp": []}
        for _ in range(args.rounds):
            times["pocketllm"].append(best_of(ours, args.calls))
            times["llama.cpp"].append(best_of(theirs, args.calls))
        med = {w: sorted(v)[len(v) // 2] for w, v in times.items()}
        x8 = " (x8)" if packed is not None else ""
        print(f"{name} {qtype.name} {n}x{k}{x8}: PocketLLM {med['pocketllm']:.3f} ms, llama.cpp {med['llama.cpp']:.3f} ms"
              f" -> {med['llama.cpp'] / med['pocketllm']:.2f}x; outputs differ by {rel:.1e} of the largest; rounds "
              + " ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(times["pocketllm"], times["llama.cpp"])), flush=True)


if __name__ == "__main__":
    main()
