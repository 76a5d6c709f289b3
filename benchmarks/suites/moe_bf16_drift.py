"""How far bf16 moves a mixture of experts from float32: the tiny test models (tests/tiny_models.py),
last-position logits of the test prompts (tests/test_cuda.py's lengths) against transformers in
float32, for PocketLLM in bf16 on the CPU and for transformers itself in bf16. A near-tie of router
logits sends a token to another expert in bf16, a discrete jump that no closeness bound covers.

    python benchmarks/suites/moe_bf16_drift.py   # -> benchmarks/results/cpu-moe-bf16-drift.json
"""
from __future__ import annotations

import copy
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import prompts_of  # noqa: E402
from reference import captured_logits, hf_last_logits  # noqa: E402
from tiny_models import make_model  # noqa: E402

from pocketllm import LLM, SamplingParams  # noqa: E402
from pocketllm.bench.report import environment  # noqa: E402

LENGTHS = [1, 5, 17, 33, 48, 70]


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("qwen3_moe", "mixtral", "gpt_oss"):
            model, path = make_model(kind, Path(tmp))
            bf16 = copy.deepcopy(model).to(torch.bfloat16)
            llm = LLM(str(path), device="cpu", dtype="bfloat16")
            for p in prompts_of(LENGTHS):
                ref = hf_last_logits(model, p)
                with captured_logits(llm) as captured:
                    llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1))
                with torch.no_grad():
                    theirs = bf16(torch.tensor([p])).logits[0, -1].float()
                rows.append({"model": kind, "prompt_len": len(p), "bound_5pct": 0.05 * float(ref.abs().max()),
                             "pocketllm_bf16": float((captured[0][0] - ref).abs().max()),
                             "transformers_bf16": float((theirs - ref).abs().max())})
                print(json.dumps(rows[-1]), flush=True)
    out = ROOT / "benchmarks" / "results" / "cpu-moe-bf16-drift.json"
    out.write_text(json.dumps({**environment(), "command": "python benchmarks/suites/moe_bf16_drift.py", "rows": rows},
                              indent=1) + "\n")


if __name__ == "__main__":
    main()
