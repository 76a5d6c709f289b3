"""transformers' eager bf16 `generate` on random weights of Llama-3.1-8B's shape: the baseline
the GPU table compares against (batch 1 and 64, 512 prompt tokens, 128 new tokens)."""
from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

from pocketllm.bench.report import environment
from pocketllm.core.shapes import SHAPES


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--output-json")
    args = ap.parse_args()
    cfg = transformers.LlamaConfig(**{k: v for k, v in SHAPES["llama3-8b"].items() if k != "architectures"})
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    results = []
    for b in (int(x) for x in args.batches.split(",")):
        ids = torch.randint(1000, cfg.vocab_size, (b, args.input_len), device="cuda")
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, **kw)  # warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=args.output_len, min_new_tokens=args.output_len, **kw)
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        new = (out.shape[1] - args.input_len) * b
        results.append({"batch": b, "elapsed_s": elapsed, "output_tok_s": new / elapsed})
        print(f"transformers {transformers.__version__} batch {b}: {new / elapsed:.1f} tok/s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({**environment(), "baseline": "transformers eager bf16 generate", "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
