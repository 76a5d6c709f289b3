"""How the CPU fast path (8-bit activations) answers against the exact path, per GGUF file:
teacher-forced top-1 agreement and KL(exact || fast) over the same 4,095 tokens of real text as
`cpu_fast_path_accuracy.py`, and, on the default model, greedy chat answers to a dozen everyday
prompts (how many stop on their own, how many equal the exact path's word for word, whether
"What is the capital of France?" gets Paris). Variants: "exact"; 1, every layer on one 8-bit pass
over its activations and the output layer on two (the fast path before small models took two
everywhere); "default", what the engine chooses (`int8_passes`). With --llama-simple, llama.cpp's
greedy answers to the same prompts on the first file (`llama-simple`, its CPU build: it also
multiplies on 8-bit activations).

    python benchmarks/suites/cpu_fast_path_answers.py [--files A.gguf B.gguf ...] [--llama-simple BIN] \
        > benchmarks/results/cpu-fast-path-answers.json
"""
from __future__ import annotations

import argparse
import json
import subprocess

from cpu_fast_path_accuracy import default_model, real_text, teacher_forced

from pocketllm import LLM, SamplingParams
from pocketllm.bench.report import environment
from pocketllm.quant.linear import GGUFLinear

PROMPTS = [
    "What is the capital of France?", "How many days are there in a week?", "Give me three tips for better sleep.",
    "Translate 'good morning' into Spanish.", "What is 12 times 7?", "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?", "What is the boiling point of water in Celsius?", "Suggest a name for a pet cat.",
    "Explain what a noun is in one sentence.", "What color is the sky on a clear day?",
    "List the first five prime numbers."]
MAX_TOKENS = 128
VARIANTS = ["exact", 1, "default"]


def load(model: str, variant, **kw) -> LLM:
    llm = LLM(model, exact_kernels=variant == "exact", enable_prefix_caching=False, **kw)
    if isinstance(variant, int):  # every layer on `variant` passes (the output layer keeps its own)
        for name, m in llm.engine.runner.model.named_modules():
            if isinstance(m, GGUFLinear) and m.int8 and "embed" not in name and "lm_head" not in name:
                m.int8 = variant
    return llm


def passes(llm: LLM) -> dict[int, int]:
    """How many layers take each number of passes (0: exact)."""
    count: dict[int, int] = {}
    for m in llm.engine.runner.model.modules():
        if isinstance(m, GGUFLinear):
            count[m.int8] = count.get(m.int8, 0) + 1
    return dict(sorted(count.items()))


def answers(llm: LLM) -> list[dict]:
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
    return [{"text": o.outputs[0].text, "finish": o.outputs[0].finish_reason} for o in outs]


def llamacpp_answers(binary: str, model: str, tok) -> list[str]:
    out = []
    for p in PROMPTS:
        prompt = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        done = subprocess.run([binary, "-m", model, "-n", str(MAX_TOKENS), prompt], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0 and done.stdout.startswith(prompt), done.stderr[-2000:]
        out.append(done.stdout[len(prompt):].removesuffix("\n"))  # (it ends its output with a newline)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", nargs="*", default=None, help="GGUF files (default: the default model)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--llama-simple", default=None, help="llama.cpp's llama-simple, for its answers")
    args = ap.parse_args()
    files = args.files or [default_model()]
    rows = []
    for path in files:
        tok = LLM(path, max_model_len=64, num_kv_blocks=8).get_tokenizer()
        ids = tok.encode(real_text())[:args.tokens]
        kw = {"max_model_len": len(ids) + 16, "max_num_batched_tokens": len(ids)}
        exact_llm = load(path, "exact", **kw)
        exact = teacher_forced(exact_llm, ids)
        exact_answers = answers(exact_llm) if path == files[0] else None
        del exact_llm
        row = {"file": path, "tokens_scored": exact.shape[0], "variants": {}}
        for variant in VARIANTS:
            llm = load(path, variant, **kw)
            got = exact if variant == "exact" else teacher_forced(llm, ids)
            kl = (exact.exp() * (exact - got)).sum(-1)
            entry = {"layers_by_passes": passes(llm),
                     "top1_agreement": (exact.argmax(-1) == got.argmax(-1)).double().mean().item(),
                     "mean_kl_nats": kl.mean().item(), "p99_kl_nats": kl.quantile(0.99).item()}
            if exact_answers is not None:
                mine = exact_answers if variant == "exact" else answers(llm)
                entry.update({"stopped": sum(a["finish"] == "stop" for a in mine),
                              "equal_to_exact": sum(a["text"] == b["text"] for a, b in zip(mine, exact_answers)),
                              "france": mine[0]["text"], "france_stopped": mine[0]["finish"] == "stop",
                              "answers": mine})
            row["variants"][str(variant)] = entry
            del llm
        if exact_answers is not None and args.llama_simple:
            theirs = llamacpp_answers(args.llama_simple, path, tok)
            row["llama.cpp"] = {"equal_to_exact_up_to_eos": sum(t == a["text"] for t, a in zip(theirs, exact_answers)),
                                "france": theirs[0], "answers": theirs}
        rows.append(row)
    print(json.dumps({**environment(), "text": "README.md + Python's LICENSE.txt", "prompts": PROMPTS,
                      "max_tokens": MAX_TOKENS, "files": rows}, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
