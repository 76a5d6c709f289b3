"""The paged attention kernel's tile shapes on one GPU: decode of many sequences at a long context and one
long prefill, with a 16-bit cache and an 8-bit one (fp8, a scale per token and head), for each candidate of
`tile_config` (keys per loop step, warps, pipeline stages). Prints the kernel's time and the bytes of cache it
reads per second; writes them as JSON.

    python benchmarks/tools/attention_tiles.py --output-json OUT.json [--seqs 64 --context 8192]
"""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import subprocess

import torch
from triton.testing import do_bench

from pocketllm.core.kv_dtype import quant_of, quantize
from pocketllm.kernels.triton import attention as attn

HQ, HKV, D, BS = 32, 8, 128, 16  # Llama-3-8B's attention


def caches(blocks: int, quant: bool):
    k = torch.randn(blocks, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    if not quant:
        return k, v, None, None
    q8 = quant_of(torch.float8_e4m3fn)
    (kq, ks), (vq, vs) = quantize(k, q8), quantize(v, q8)
    return kq, vq, ks.contiguous(), vs.contiguous()


def step(seqs: int, context: int, query_len: int, quant: bool):
    per_seq = -(-context // BS)
    k, v, ks, vs = caches(seqs * per_seq, quant)
    tables = torch.randperm(seqs * per_seq, device="cuda", dtype=torch.int32).view(seqs, per_seq)
    lens = torch.full((seqs,), context, dtype=torch.int32, device="cuda")
    starts = torch.arange(seqs + 1, dtype=torch.int32, device="cuda") * query_len
    q = torch.randn(seqs * query_len, HQ, D, device="cuda", dtype=torch.bfloat16)
    cache_bytes = 2 * seqs * context * HKV * D * k.element_size() + (0 if ks is None else 2 * seqs * context * HKV * 4)
    return (lambda: attn.paged_attention(q, k, v, tables, lens, starts, query_len, D ** -0.5,
                                         k_scale=ks, v_scale=vs)), cache_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--prefill", type=int, default=4096, help="one prompt of this many tokens, whole")
    ap.add_argument("--output-json", required=True)
    args = ap.parse_args()
    default = attn.tile_config
    candidates = [dict(TILE_N=n, num_warps=w, num_stages=s)
                  for n, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))]
    rows = []
    for kind, quant in itertools.product(("decode", "prefill"), (False, True)):
        fn, nbytes = (step(args.seqs, args.context, 1, quant) if kind == "decode"
                      else step(1, args.prefill, args.prefill, quant))
        for cand in [None] + candidates:
            attn.tile_config = default if cand is None else (lambda *a, c=cand: c)
            try:
                ms = do_bench(fn, warmup=10, rep=50)
            except Exception as e:  # a shape the compiler cannot fit (shared memory)
                print(kind, quant, cand, type(e).__name__)
                continue
            rows.append({"kind": kind, "cache": "fp8" if quant else "bf16", "config": cand or "default", "ms": ms,
                         "cache_GBps": nbytes / ms / 1e6})
            print(f"{kind:8s} {'fp8' if quant else 'bf16':5s} {str(cand or 'default'):60s} {ms:8.3f} ms "
                  f"{nbytes / ms / 1e6:8.0f} GB/s")
        attn.tile_config = default
    groups = sorted({(r["kind"], r["cache"]) for r in rows})
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    json.dump({"machine": torch.cuda.get_device_name(), "host": platform.node(), "commit": commit,
               "command": "python benchmarks/tools/attention_tiles.py " + " ".join(
                   f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "output_json"),
               "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "block_size": BS, **vars(args)},
               "rows": rows, "fastest": {f"{k}-{c}": min((r for r in rows if (r["kind"], r["cache"]) == (k, c)),
                                                         key=lambda r: r["ms"]) for k, c in groups}},
              open(args.output_json, "w"), indent=1)


if __name__ == "__main__":
    main()
