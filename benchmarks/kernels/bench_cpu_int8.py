"""GGUF matmuls on the CPU: the exact C kernels against the fast path (integer dot products over
8-bit activations; per row, and with eight rows interleaved where the build has that layout for the
type), at the default model's shapes and a 1.5B model's, batch 1, 8 and 64, 2 threads.

    python benchmarks/kernels/bench_cpu_int8.py [TYPE ...] > benchmarks/results/cpu-int8-kernels.txt
"""
from __future__ import annotations

import sys
import time

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from pocketllm.bench.report import environment
from pocketllm.kernels.cpu import gguf_ops
from pocketllm.quant.quantize import quantize


def ms(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def random_weights(rng: np.random.Generator, qtype: T, n: int, k: int) -> torch.Tensor:
    """GGUF rows [n, row bytes]: quantized gaussian weights, or for the types this package does not
    quantize (IQ4), random codes under small fp16 scales."""
    try:
        q = quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype, search=False)
        return torch.from_numpy(q).view(torch.uint8).reshape(n, -1).contiguous()
    except ValueError:
        bs, ts = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (n * k // bs, ts), dtype=np.uint8)
        blocks[:, :2] = np.full((len(blocks), 1), 0.001, np.float16).view(np.uint8)
        return torch.from_numpy(blocks).reshape(n, -1)


def main() -> None:
    torch.set_num_threads(2)
    env = environment()
    dirty = " (dirty)" if env["dirty"] else ""
    print(f"# commit {env['commit']}{dirty}, {env['machine']['cpu']}, {env['date']}; 2 threads; mean of repeated calls")
    print("type   N      K     B   exact ms  int8 ms  x8 ms  fast/exact  fast weight GB/s")
    rng = np.random.default_rng(0)
    types = [T[name] for name in sys.argv[1:]] or [T.Q4_0, T.Q4_1, T.Q8_0, T.IQ4_NL, T.Q4_K, T.Q5_K, T.Q6_K,
                                                    T.IQ4_XS]
    for qtype in types:
        # default model: QKV, head; a 1.5B model: gate/up, down, head
        shapes = ((1536, 576), (49152, 576)) if gguf.GGML_QUANT_SIZES[qtype][0] == 32 else ()
        for n, k in shapes + ((17920, 1536), (1536, 8960), (151936, 1536)):
            raw = random_weights(rng, qtype, n, k)
            rows = gguf_ops.row_pointers([raw])
            packed = gguf_ops.repack_x8(rows, qtype, k)
            for b in (1, 8, 64):
                x = torch.randn(b, k)
                reps = 10 if n * b > 10**6 else 50
                exact = ms(lambda: gguf_ops.gemm(x, rows, qtype), reps)
                int8 = ms(lambda: gguf_ops.gemm(x, rows, qtype, int8=True), reps)
                x8 = ms(lambda: gguf_ops.gemm_x8(x, packed, n, qtype), reps) if packed is not None else None
                fast = min(int8, x8 or int8)
                print(f"{qtype.name:6} {n:<6} {k:<5} {b:<3} {exact:8.3f} {int8:8.3f} "
                      f"{'-' if x8 is None else f'{x8:.3f}':>6} {exact / fast:8.2f}x {raw.numel() / fast / 1e6:12.1f}")


if __name__ == "__main__":
    main()
