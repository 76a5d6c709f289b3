"""Throughput of a JSON-schema-constrained batch against the same batch unconstrained.

    python benchmarks/suites/bench_structured.py [--rows 8] [--tokens 64] [--rounds 7] [--output-json PATH]

Both variants run the same prompts for the same number of tokens on the default model: the schema
asks for more array items than fit in --tokens, so every constrained row runs to max_tokens, and
the free rows ignore EOS. Rounds alternate the two variants, so other processes on a shared machine
slow both alike; the result is the median of the per-round ratios. The time spent building and
applying grammar masks is measured apart.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pocketllm.runner.sampler as sampler
from pocketllm import LLM, SamplingParams
from pocketllm.bench.report import environment

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = {"type": "array", "minItems": 1000, "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False}}
SUBJECTS = ["engineers", "painters", "sailors", "chefs", "pilots", "doctors", "farmers", "poets"]


def default_model() -> str:
    shared = ROOT.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if shared.is_file():
        return str(shared)
    from pocketllm.pull import pull_default_model

    return str(pull_default_model())


class MaskTimer:
    """Wraps the sampler's mask step to add up its time."""

    def __init__(self):
        self.seconds, self.calls, self._apply = 0.0, 0, sampler.apply_grammar_masks
        sampler.apply_grammar_masks = self

    def __call__(self, *args):
        t = time.perf_counter()
        self._apply(*args)
        self.seconds += time.perf_counter() - t
        self.calls += 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--model", default=None)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    llm = LLM(args.model or default_model(), max_model_len=1024, kv_cache_memory=160 << 20,
              max_num_seqs=args.rows, enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": f"List {SUBJECTS[i % len(SUBJECTS)]} as JSON."}]), add_special_tokens=False)}
        for i in range(args.rows)]
    free = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True,
                                 structured_outputs={"json": SCHEMA})
    timer = MaskTimer()

    def run(params) -> float:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == args.tokens for o in outs)
        return elapsed

    run(free), run(constrained)  # warm-up: first steps, xgrammar import, grammar compile
    timer.seconds = timer.calls = 0
    rounds = []
    for i in range(args.rounds):
        order = (free, constrained) if i % 2 == 0 else (constrained, free)
        times = {id(p): run(p) for p in order}
        f, c = times[id(free)], times[id(constrained)]
        rounds.append({"free_s": round(f, 3), "constrained_s": round(c, 3), "ratio": round(f / c, 3)})
        print(f"round {i}: free {f:.2f}s  constrained {c:.2f}s  throughput ratio {f / c:.3f}", flush=True)

    tokens = args.rows * args.tokens
    free_s = statistics.median(r["free_s"] for r in rounds)
    cons_s = statistics.median(r["constrained_s"] for r in rounds)
    result = environment()
    result["machine"]["xgrammar"] = version("xgrammar")
    result.update({
        "rows": args.rows, "tokens_per_row": args.tokens, "rounds": rounds,
        "free_tok_s": round(tokens / free_s, 1), "constrained_tok_s": round(tokens / cons_s, 1),
        "median_throughput_ratio": round(statistics.median(r["ratio"] for r in rounds), 3),
        "mask_ms_per_step": round(1e3 * timer.seconds / max(timer.calls, 1), 3),
        "mask_share_of_constrained_time": round(timer.seconds / sum(r["constrained_s"] for r in rounds), 4),
    })
    print(json.dumps(result, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
