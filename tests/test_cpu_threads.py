"""The CPU fast path gives the same bits at any thread count: its kernels give each thread whole
output rows, and split a query's context by its length alone. The exact path's decode attention is
torch's, whose sums follow the thread count: there the tokens are the same and the logprobs close.
The suite runs one thread a worker (conftest.py); this is where threads split the work."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from fixtures import default_model_gguf

from pocketllm import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    " * 20]


def outputs_at(llm: LLM, threads: int):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        params = SamplingParams(max_tokens=16, temperature=0, logprobs=5, prompt_logprobs=5)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs)
                for o in llm.generate(PROMPTS, params)]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
def test_one_thread_and_three_agree(exact):
    llm = LLM(str(default_model_gguf()), exact_kernels=exact, max_model_len=1024, num_kv_blocks=64,
              enable_prefix_caching=False)
    one, three = outputs_at(llm, 1), outputs_at(llm, 3)
    assert len(one[1][2]) > 100  # the long prompt's context is split among threads
    for (tokens1, lps1, plps1), (tokens3, lps3, plps3) in zip(one, three):
        assert tokens1 == tokens3
        for a, b in zip(lps1 + plps1[1:], lps3 + plps3[1:]):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].logprob == (pytest.approx(b[t].logprob, abs=1e-4) if exact else b[t].logprob)


@pytest.mark.parametrize("env, spins", [({}, "30000"), ({"GOMP_SPINCOUNT": "5"}, "5"),
                                        ({"OMP_WAIT_POLICY": "ACTIVE"}, None)])
def test_openmp_threads_spin_less_unless_the_user_says(env, spins):
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", "import pocketllm, os; print(os.environ.get('GOMP_SPINCOUNT'))"],
                         env={**base, **env}, capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(spins)
