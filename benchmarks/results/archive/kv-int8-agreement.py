"""The int8 KV cache against the float one on a text of one's choosing: the default model teacher-forced over
its first 2,048 tokens (top-1 agreement, mean KL), then 128 and 256 greedy steps over the int8 cache after its
first 1,024 tokens, against the float cache's top-1 choice after the same prefix, as
tests/test_kv_cache_dtype.py measures on the README. From the repository root:

    python benchmarks/results/archive/kv-int8-agreement.py TEXT_FILE
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, "tests")
import test_kv_cache_dtype as t  # noqa: E402
from fixtures import default_model_gguf  # noqa: E402

from pocketllm import LLM, SamplingParams  # noqa: E402

model = str(default_model_gguf())
llms = {kv: LLM(model, kv_cache_dtype=kv, max_model_len=2400, enable_prefix_caching=False) for kv in ("auto", "int8")}
ids = llms["auto"].get_tokenizer().encode(Path(sys.argv[1]).read_text())
print("tokens", len(ids))
ids = ids[:2048]
logp = {kv: t._log_probs(llm, ids) for kv, llm in llms.items()}
print("teacher-forced top-1", float((logp["auto"].argmax(-1) == logp["int8"].argmax(-1)).double().mean()))
print("KL", float((logp["auto"].exp() * (logp["auto"] - logp["int8"])).sum(-1).mean()))
prompt = ids[:1024]
for n in (128, 256):
    out = llms["int8"].generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=n, temperature=0,
                                                                             ignore_eos=True), use_tqdm=False)
    gen = list(out[0].outputs[0].token_ids)
    top = t._log_probs(llms["auto"], prompt + gen)[len(prompt) - 1:].argmax(-1)
    print("decode", n, float((top == torch.tensor(gen)).double().mean()))
