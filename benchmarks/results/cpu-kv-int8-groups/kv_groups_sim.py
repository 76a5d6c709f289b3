"""Simulated 8-bit KV formats on the exact CPU path: k and v quantized-dequantized (int8, amax / 127, round
to nearest) with one scale per group of G values of a head, written into a float cache; the default model
teacher-forced over the same text as tests/test_kv_cache_dtype.py (README + licence, 2,048 tokens): top-1
agreement and mean KL against the plain float cache."""
import sys

import torch

sys.path.insert(0, "tests")
import test_kv_cache_dtype as t
from fixtures import default_model_gguf

from pocketllm import LLM
from pocketllm.layers import attention

real = attention.write_kv
def fake(g_k, g_v):
    def q(x, g):
        if g is None:
            return x
        sh = x.shape
        xg = x.float().reshape(*sh[:-1], sh[-1] // g, g)
        s = xg.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127.0
        return (torch.round(xg / s).clamp(-127, 127) * s).reshape(sh).to(x.dtype)
    def w(k_cache, v_cache, k, v, slots, k_scale=None, v_scale=None):
        return real(k_cache, v_cache, q(k, g_k), q(v, g_v), slots)
    return w

llm = LLM(str(default_model_gguf()), max_model_len=2400, enable_prefix_caching=False, exact_kernels=True)
ids = t._real_text_ids(llm, 2048)
base = t._log_probs(llm, ids)
for g_k, g_v in ((64, 64), (32, 64), (16, 64), (16, 16), (8, 8)):
    attention.write_kv = fake(g_k, g_v)
    lp = t._log_probs(llm, ids)
    attention.write_kv = real
    top = float((base.argmax(-1) == lp.argmax(-1)).double().mean())
    kl = float((base.exp() * (base - lp)).sum(-1).mean())
    print(f"K groups of {g_k}, V groups of {g_v}: top-1 {top:.4f}, mean KL {kl:.2e}", flush=True)
