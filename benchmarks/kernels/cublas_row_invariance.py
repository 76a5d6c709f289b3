"""Which row counts make torch's bf16 ``F.linear`` (cuBLAS) compute the same bits for a row.

For each of Llama-3.1-8B's projection shapes, ``x[:m] @ W.T`` for many ``m``; rows 0-3 of each
result are compared bit for bit with every other ``m``'s, and the ``m`` that agree are printed as
classes.  Row counts of one class give a row the same output whatever else shares its step: what
speculative verification in bf16 needs (a request's last token and its drafts as rows of one step,
computed as plain decoding computes its one row).

    python benchmarks/kernels/cublas_row_invariance.py --out benchmarks/results/h200-cublas-row-invariance.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pocketllm.bench.report import environment  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
MS = list(range(1, 17)) + [24, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512]
ROWS = 4  # rows compared (the smallest m compared has at least this many, or all of its own)


def classes(w: torch.Tensor, x: torch.Tensor) -> list[list[int]]:
    """The row counts grouped by the bits they give rows 0 .. ROWS - 1 (each m's own rows only)."""
    out = {m: F.linear(x[:m], w)[:ROWS].clone() for m in MS}
    groups: list[list[int]] = []
    for m in MS:
        for g in groups:
            if all(torch.equal(out[m][:min(m, o)], out[o][:min(m, o)]) for o in g):
                g.append(m)
                break
        else:
            groups.append([m])
    return groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    result = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(max(MS), k, device="cuda", dtype=torch.bfloat16)
        result[name] = classes(w, x)
        print(f"{name:8s} {n}x{k}: " + "  ".join(f"[{g[0]}..{g[-1]}]" if g == list(range(g[0], g[-1] + 1))
                                                 else str(g) for g in result[name]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({**environment(), "rows_compared": ROWS, "classes": result}, indent=1))


if __name__ == "__main__":
    main()
