"""Speculative decoding (n-gram prompt lookup) against plain decoding, one stream or several, on the
same engine settings in the same process: copying workloads (the reply repeats its prompt with an
edit) and ordinary chat prompts, greedy. `same_tokens` says whether both produced the same tokens
(on the CPU they must, and for one stream on CUDA; at 64 sequences bf16 steps of other row counts
compute other bits, unless the speculative config sets "row_invariant", which --oracle needs there:
the random weights' near-tied logits turn on those bits); the figure is output tokens per second over
the whole request, after a warm-up run of each prompt in each engine (so both find the prompt in their
prefix cache: the figures are decoding's), the best of --reps runs of each, the two engines' runs
alternated.

    python benchmarks/suites/spec_decode.py --out benchmarks/results/cpu-spec-decode.json
    python benchmarks/suites/spec_decode.py --model llama3-8b --load-format dummy --device cuda --concurrency 1,64 \\
        --oracle --out benchmarks/results/h200-spec-decode.json
    python benchmarks/suites/spec_decode.py --model llama3-8b --load-format dummy --device cuda --dtype bfloat16 \
        --concurrency 64 --oracle --reps 1 --max-tokens 128 --speculative-config '{"method": "ngram", \
        "num_speculative_tokens": 4, "prompt_lookup_min": 3, "prompt_lookup_max": 6, "row_invariant": true}'
    python benchmarks/suites/spec_decode.py --model DIR --load-format dummy --device cuda --dtype bfloat16 --oracle \
        --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'   # DIR: a DeepSeek-V3 config.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pocketllm import LLM, SamplingParams  # noqa: E402
from pocketllm.bench.report import environment  # noqa: E402

PARAGRAPH = ("The Rhine is one of the major European rivers. It begins in the Swiss canton of Graubünden in "
             "the southeastern Swiss Alps. It forms part of the Swiss-Liechtenstein, Swiss-Austrian, "
             "Swiss-German and then the Franco-German border, then flows through the German Rhineland and the "
             "Netherlands and eventually empties into the North Sea. It drains an area of about 185,000 square "
             "kilometres and is about 1,230 kilometres long. The largest city on the river is Cologne, Germany, "
             "with a population of more than 1,050,000 people.")


# The class the recorded runs asked to rewrite (the n-gram proposer as it stood at b4aafce), fixed here.
CLASS = """class NgramProposer:
    def __init__(self, num_tokens: int, min_n: int, max_n: int):
        assert 1 <= min_n <= max_n and num_tokens >= 1
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n

    def propose(self, token_ids: list[int], limit: int | None = None, index: NgramIndex | None = None) -> list[int]:
        \"\"\"Up to min(num_tokens, limit) draft tokens to follow `token_ids` ([] when nothing matches).
        `index` is the sequence's own (kept between calls as its tokens grow); without one, a
        fresh index is built.\"\"\"
        k = self.num_tokens if limit is None else min(self.num_tokens, limit)
        if k <= 0:
            return []
        if index is None:
            index = self.new_index()
        index.extend(token_ids)
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            start = index.tables[n].get(tuple(token_ids[-n:]))
            if start is not None:
                return token_ids[start:start + k]
        return []

    def new_index(self) -> NgramIndex:
        return NgramIndex(range(self.min_n, self.max_n + 1))
"""


def workloads() -> dict[str, list[str]]:
    return {
        "copy": [
            "Rewrite this Python class, renaming the method `propose` to `draft` and changing nothing else. "
            "Reply with the code only.\n\n" + CLASS,
            "Quote the following paragraph exactly, but write 'Danube' instead of 'Rhine':\n\n" + PARAGRAPH,
            "Repeat this list, adding the word 'fresh' before each item:\n\n- apples\n- bread and butter\n"
            "- three bottles of milk\n- a kilogram of rice\n- green tea\n- tomatoes\n- olive oil\n- cheese",
        ],
        "chat": [
            "Write a short poem about the sea.",
            "Explain how a bicycle works to a ten-year-old.",
            "Give me three tips for learning a new language.",
            "What are the main differences between a cat and a dog as pets?",
        ],
    }


class Oracle:
    """Drafts the plain run's own continuation: always right, the ceiling of a copying workload on a
    model that copies (random weights do not copy their prompt, so n-gram lookup has little to find).
    The proposer it stands in for still drafts, its drafts replaced: its cost (a next-token-prediction
    layer's chained passes, say) stays in the figure."""

    def __init__(self, prompt_len: int, continuation: list[int], proposer):
        self.prompt_len, self.continuation, self.proposer = prompt_len, continuation, proposer

    def propose_for(self, wanted: list) -> list[list[int]]:
        self.proposer.propose_for(wanted)
        return [self.continuation[req.num_tokens - self.prompt_len:][:limit] for req, limit in wanted]


class DraftTimer:
    """Times a draft model's drafting; every step drafts its k tokens (random weights disagree with
    the model, so the draft length rule would otherwise stop drafting)."""

    def __init__(self, engine, k: int):
        self.engine, self.drafter = engine, engine.speculator.proposer
        engine.speculator.draft_length.limit = lambda req, cost: k
        engine.speculator.proposer = self
        self.reset()

    def reset(self) -> None:
        self.seconds, self.tokens, self.calls = 0.0, 0, 0

    def propose_for(self, wanted: list) -> list[list[int]]:
        import torch

        t0 = time.perf_counter()
        drafts = self.drafter.propose_for(wanted)
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t0
        self.tokens += sum(map(len, drafts))
        self.calls += 1
        return drafts


def run(llm: LLM, prompts: list, params: SamplingParams, concurrency: int, reps: int) -> tuple[float, list]:
    """Best-of-`reps` tokens/s for the prompts run `concurrency` at a time (copies of each prompt)."""
    best, outs = 0.0, None
    batch = [p for p in prompts for _ in range(concurrency)]
    for _ in range(reps):
        t0 = time.perf_counter()
        got = llm.generate(batch, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in got)
        best, outs = max(best, tokens / dt), got
    return best, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model path or (with --load-format dummy) shape; default: the default model")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 8, '
                                                    '"prompt_lookup_min": 3, "prompt_lookup_max": 6}')
    ap.add_argument("--concurrency", default="1", help="comma list: streams run together")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="KV blocks of each engine (CUDA: three engines share the GPU with --draft-model)")
    ap.add_argument("--oracle", action="store_true",
                    help="also time drafts that are always right (the plain run's continuation)")
    ap.add_argument("--draft-model", default=None,
                    help="also time a draft model's drafting (a path, or a shape with --load-format dummy), "
                         "every step drafting num_speculative_tokens: its cost per drafted token")
    ap.add_argument("--workloads", default="copy,chat", help="comma list of the workloads run (copy, chat)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    engine = dict(model=args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                  max_model_len=2048, num_threads=args.threads, num_kv_blocks=args.num_kv_blocks)
    if args.device == "cpu":
        engine["kv_cache_memory"] = 512 << 20
    plain = LLM(**engine)
    spec = LLM(**engine, speculative_config=args.speculative_config)
    drafting = None
    if args.draft_model:
        k = json.loads(args.speculative_config)["num_speculative_tokens"]
        drafting = LLM(**engine, speculative_config={"model": args.draft_model, "num_speculative_tokens": k})
        timed = DraftTimer(drafting.engine, k)
    tok = plain.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows = []
    chosen = {name: texts for name, texts in workloads().items() if name in args.workloads.split(",")}
    for name, texts in chosen.items():
        if tok is not None and tok.chat_template:
            prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]),
                                                       add_special_tokens=False)} for t in texts]
        else:  # a shape without a tokenizer: the prompt text's bytes as token ids
            prompts = [{"prompt_token_ids": list(t.encode())} for t in texts]
        for conc in map(int, args.concurrency.split(",")):
            for i, prompt in enumerate(prompts):
                for llm in (plain, spec):  # warm-up: the prompt in both prefix caches, graphs captured
                    run(llm, [prompt], params, conc, 1)
                base = fast = 0.0
                before = spec.engine.speculator.stats.copy()
                for _ in range(args.reps):  # alternated: the machine's drift reaches both engines alike
                    (b, want), (f, got) = run(plain, [prompt], params, conc, 1), run(spec, [prompt], params, conc, 1)
                    base, fast = max(base, b), max(fast, f)
                after = spec.engine.speculator.stats.copy()
                drafted = after.num_draft_tokens - before.num_draft_tokens
                accepted = after.num_accepted_tokens - before.num_accepted_tokens
                oracle = None
                if args.oracle:
                    # The plain run's continuation, then (where low precision makes speculation's rows
                    # compute other bits than plain decoding's, as bf16 on a GPU does) the oracle run's
                    # own output until it repeats: drafts that are all right.
                    proposer, continuation = spec.engine.speculator.proposer, want[0]
                    for _ in range(3):
                        spec.engine.speculator.proposer = Oracle(len(prompt["prompt_token_ids"]), continuation, proposer)
                        run(spec, [prompt], params, conc, 1)
                        s0 = spec.engine.speculator.stats.copy()
                        oracle, got_oracle = run(spec, [prompt], params, conc, args.reps)
                        s1 = spec.engine.speculator.stats.copy()
                        if got_oracle[0] == continuation:
                            break
                        continuation = got_oracle[0]
                    spec.engine.speculator.proposer = proposer
                draft_cost = {}
                if drafting is not None:
                    run(drafting, [prompt], params, conc, 1)
                    timed.reset()
                    drafted_tok_s, _ = run(drafting, [prompt], params, conc, args.reps)
                    draft_cost = {"draft_ms_per_drafted_token": round(1e3 * timed.seconds / max(1, timed.tokens), 4),
                                  "draft_ms_per_step": round(1e3 * timed.seconds / max(1, timed.calls), 3),
                                  "plain_ms_per_step": round(1e3 * conc / base, 3),
                                  "draft_model_tok_s": round(drafted_tok_s, 1)}
                rows.append({"workload": name, "prompt": i, "concurrency": conc,
                             "prompt_tokens": len(prompt["prompt_token_ids"]),
                             "output_tokens": len(want[0]), "plain_tok_s": round(base, 1),
                             "spec_tok_s": round(fast, 1), "speedup": round(fast / base, 3),
                             "acceptance": round(accepted / drafted, 3) if drafted else None,
                             "accepted_per_step": round(accepted / max(1, after.num_drafts - before.num_drafts), 2),
                             "same_tokens": got == want,
                             **({"oracle_tok_s": round(oracle, 1), "oracle_speedup": round(oracle / base, 3),
                                 "oracle_all_right": got_oracle[0] == continuation,
                                 "oracle_drafts_per_step": round((s1.num_draft_tokens - s0.num_draft_tokens)
                                                                 / max(1, s1.num_drafts - s0.num_drafts), 2),
                                 "oracle_acceptance": round((s1.num_accepted_tokens - s0.num_accepted_tokens)
                                                            / max(1, s1.num_draft_tokens - s0.num_draft_tokens), 3)}
                                if oracle else {}), **draft_cost})
                print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for name in chosen:
        for conc in map(int, args.concurrency.split(",")):
            sel = [r for r in rows if r["workload"] == name and r["concurrency"] == conc]
            summary[f"{name}@{conc}"] = {"min_speedup": min(r["speedup"] for r in sel),
                                         "mean_speedup": round(sum(r["speedup"] for r in sel) / len(sel), 3)}
    print(json.dumps(summary, indent=1))
    if args.out:
        payload = {**environment(), "engine": engine,
                   "speculative_config": json.loads(args.speculative_config), "summary": summary, "rows": rows}
        Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
