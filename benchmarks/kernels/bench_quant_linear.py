"""Time GGUFLinear.forward against a dense float32 F.linear.

    python benchmarks/kernels/bench_quant_linear.py [--reps N] [--types Q4_0,Q8_0] [--threads N]

Weights are random GGUF blocks with realistic fp16 scales.  Each cell shows
the median and the best of >= N calls: the machine may be shared, and the
best time is the least disturbed by other processes.  Rows are the default
path (``auto``).
Uses torch's default thread count.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from pocketllm.quant.dequant import dequantize
from pocketllm.quant.linear import GGUFLinear

T = gguf.GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0, T.Q6_K]
SHAPES = [(576, 1536), (1536, 576), (576, 49152)]  # (in_features, out_features)
BATCHES = [1, 8]
# byte offsets of the fp16 scale fields in one block
SCALE_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q4_K: [0, 2], T.Q8_0: [0], T.Q6_K: [208]}


def random_weight(qtype, n, k, rng):
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n * k // bs, ts), dtype=np.uint8)
    for off in SCALE_FIELDS[qtype]:
        scale = rng.uniform(1e-3, 1e-2, blocks.shape[0]).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(n, -1))


def time_ms(fn, reps, min_time=0.25):
    """(median, best) wall time of ``fn`` in ms over >= reps calls."""
    fn()
    times, start = [], time.perf_counter()
    while len(times) < reps or (time.perf_counter() - start < min_time and len(times) < 20 * reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, min(times) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--types", default=",".join(t.name for t in TYPES))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, "
          f"cpu={torch.backends.cpu.get_cpu_capability()}, load avg {os.getloadavg()[0]:.2f}")
    head = (f"{'type':5} {'in->out':>10} {'B':>2} {'path':>9} | {'med ms':>7} {'best':>7} | "
            f"{'dense med':>9} {'best':>7} | {'x dense':>7} | {'MiB':>5} {'dense':>5}")
    print(head)
    print("-" * len(head))
    with torch.inference_mode():
        for qtype in (T[name] for name in args.types.split(",")):
            for k, n in SHAPES:
                if k % gguf.GGML_QUANT_SIZES[qtype][0]:
                    print(f"{qtype.name:5} {f'{k}->{n}':>10}    n/a: in_features % 256 != 0, "
                          "no such GGUF tensor")
                    continue
                raw = random_weight(qtype, n, k, rng)
                dense_w = dequantize(raw, qtype, (n, k))
                paths = ["auto"]
                layers = [GGUFLinear.from_gguf(raw, qtype, n, k, path=p) for p in paths]
                for b in BATCHES:
                    x = torch.randn(b, k)
                    d_med, d_best = time_ms(lambda: F.linear(x, dense_w), args.reps)
                    for layer in layers:
                        med, best = time_ms(lambda: layer(x), args.reps)
                        print(f"{qtype.name:5} {f'{k}->{n}':>10} {b:>2} {layer.path:>9} | "
                              f"{med:7.3f} {best:7.3f} | {d_med:9.3f} {d_best:7.3f} | "
                              f"{med / d_med:7.1f} | {layer.nbytes() / 2**20:5.1f} "
                              f"{dense_w.numel() * 4 / 2**20:5.0f}")
                del dense_w, layers
    print(f"load avg at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
