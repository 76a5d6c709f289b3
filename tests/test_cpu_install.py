"""A CPU-only install runs without triton (1 GB that xgrammar requires on Linux, and that only the
GPU's kernels and the tests use): the README's CPU set-up removes it."""
from __future__ import annotations

import subprocess
import sys

from fixtures import default_model_gguf

SCRIPT = """
import sys
sys.modules["triton"] = None  # any import of it fails
from pocketllm import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=256, kv_cache_memory=32 << 20)
schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
out = llm.generate("Name:", SamplingParams(max_tokens=24, temperature=0, structured_outputs={"json": schema}))
print(repr(out[0].outputs[0].text))
"""


def test_the_cpu_serves_without_triton():
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(default_model_gguf())], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().startswith("'{")
