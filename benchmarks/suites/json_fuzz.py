"""The constrained-output fuzzer at length (tests/json_fuzz.py): every case of its corpus (JSON schemas,
a JSON object, regexes, tool calls in three formats) sampled at temperature 1.0 over many seeds on
SmolLM2's byte-level BPE and Llama's SentencePiece byte-fallback vocabularies; counts of valid, invalid
and unfinished outputs, and the invalid ones, as JSON.

    python benchmarks/suites/json_fuzz.py --seeds 310 --out benchmarks/results/json-fuzz-cpu.json
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import json_fuzz  # noqa: E402
from fixtures import default_model_gguf, shared_path  # noqa: E402

from pocketllm.structured.backend import StructuredOutputs  # noqa: E402
from pocketllm.tokenizer.gguf_vocab import load_gguf_tokenizer  # noqa: E402

VOCABS = {"gpt2_bpe (SmolLM2)": default_model_gguf, "llama_spm": lambda: shared_path(
    "fixtures/vocab/ggml-vocab-llama-spm.gguf")}


def _cpu() -> str:
    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")] if Path("/proc/cpuinfo").exists() else []
    return f"{names[0] if names else platform.machine()}, {len(names) or '?'} cores"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=310, help="outputs per case and vocabulary")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    start = time.time()
    result = {"command": " ".join(sys.argv), "machine": _cpu(),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip(), "cases": {}, "failures": []}
    total = Counter()
    for vocab, path in VOCABS.items():
        tok = load_gguf_tokenizer(path())
        structured = StructuredOutputs(tok, tok.vocab_size, {tok.eos_token_id})
        for name, spec, check in json_fuzz.cases():
            failures = []
            counts = json_fuzz.fuzz(structured, tok, spec, check, seeds=range(args.seeds), failures=failures)
            result["cases"][f"{vocab} / {name}"] = dict(counts)
            result["failures"] += [{"vocab": vocab, "case": name, "seed": seed, "text": text, "error": err}
                                   for _, seed, text, err in failures]
            total.update(counts)
            print(f"{vocab:20s} {name:40s} {dict(counts)}", flush=True)
    result["total"] = dict(total)
    result["seconds"] = round(time.time() - start)
    print(result["total"])
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
