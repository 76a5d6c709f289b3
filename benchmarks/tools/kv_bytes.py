"""KV cache bytes per token of the named shapes (pocketllm.core.shapes), as the engine sizes its cache: each
runtime's KVShape and KV layout, in bfloat16 (and 8-bit where the runtime reads it); and how many 8k-token
sequences fit in a given cache budget. No weights are built.

    python benchmarks/tools/kv_bytes.py [--budget-gib 40] --output-json OUT.json
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess

import torch

from pocketllm.config import EngineArgs, ModelConfig
from pocketllm.core.shapes import SHAPES
from pocketllm.models.registry import select_runtime
from pocketllm.runner.model_runner import ModelRunner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-gib", type=float, default=40.0, help="KV cache memory to fill (GiB)")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--output-json", required=True)
    args = ap.parse_args()
    rows = {}
    for name, hp in SHAPES.items():
        cfg = ModelConfig.from_hf_dict(hp)
        sel = select_runtime(cfg, EngineArgs(model=name, load_format="dummy"), "cuda", "bfloat16")
        row = {"architecture": cfg.architecture, "kv_shape": vars(sel.model_class.kv_shape(cfg))}
        for kv in sorted(sel.capabilities.kv_cache_dtypes):
            per_block = ModelRunner.kv_bytes_per_block(sel.model_class.kv_shape(cfg), sel.kv_layout, 16,
                                                       torch.bfloat16, kv_cache_dtype=kv)
            per_token = per_block / 16
            row[kv] = {"bytes_per_token": per_token,
                       "sequences_at_context": int(args.budget_gib * 2**30 // (per_token * args.context))}
        rows[name] = row
        print(f"{name:18s} {row['auto']['bytes_per_token']:>10,.0f} B/token  "
              f"{row['auto']['sequences_at_context']:>5d} x {args.context} tokens in {args.budget_gib:g} GiB")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    json.dump({"what": "KV cache bytes per token (bfloat16 values; 8-bit caches with their scales) by shape",
               "machine": platform.node(), "commit": commit,
               "command": f"python benchmarks/tools/kv_bytes.py --budget-gib {args.budget_gib:g} --context "
                          f"{args.context} --output-json {args.output_json}",
               "shapes": rows}, open(args.output_json, "w"), indent=1)


if __name__ == "__main__":
    main()
