"""Time GGUFLinear.forward against a dense float32 F.linear.

    python benchmarks/bench_quant_linear.py [--reps N]

Weights are random GGUF blocks with small, realistic fp16 scales.  Each cell
is the median over repeated calls (the machine is shared, medians are less
noisy than means).  Uses torch's default thread count.
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from pocketllm.quant.dequant import dequantize
from pocketllm.quant.linear import INT4_TYPES, GGUFLinear

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


def median_ms(fn, reps, min_time=0.3):
    fn()
    times, start = [], time.perf_counter()
    while len(times) < reps or (time.perf_counter() - start < min_time and len(times) < 10 * reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, "
          f"cpu={torch.backends.cpu.get_cpu_capability()}")
    head = f"{'type':6} {'in->out':>11} {'B':>2} {'path':>9} {'ms':>8} {'dense ms':>8} {'x dense':>7} {'MiB':>6}"
    print(head)
    print("-" * len(head))
    with torch.inference_mode():
        for qtype in TYPES:
            for k, n in SHAPES:
                raw = random_weight(qtype, n, k, rng)
                dense_w = dequantize(raw, qtype, (n, k))
                paths = ["scratch"] + (["int4", "int4_bf16"] if qtype in INT4_TYPES else [])
                layers = {p: GGUFLinear.from_gguf(raw, qtype, n, k, path=p) for p in paths}
                for b in BATCHES:
                    x = torch.randn(b, k)
                    t_dense = median_ms(lambda: F.linear(x, dense_w), args.reps)
                    for p, layer in layers.items():
                        t = median_ms(lambda: layer(x), args.reps)
                        print(f"{qtype.name:6} {f'{k}->{n}':>11} {b:>2} {p:>9} {t:8.3f} "
                              f"{t_dense:8.3f} {t / t_dense:7.1f} {layer.nbytes() / 2**20:6.1f}")
                del dense_w, layers


if __name__ == "__main__":
    main()
