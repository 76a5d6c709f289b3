"""Loading with the defaults: max_model_len is what the KV cache holds when the model's context
does not fit, and one log line says what was loaded."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures import default_model_gguf

from pocketllm import LLM, ConfigurationError

# The default model has 8192 positions, 30 layers and 3 KV heads of 64: a block of 16 tokens of
# its float32 KV cache (keys and values) takes this many bytes.
PER_BLOCK = 2 * 30 * 16 * 3 * 64 * 4


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pocketllm"]


def test_default_max_model_len_is_what_the_kv_cache_holds(caplog):
    with caplog.at_level(logging.INFO, logger="pocketllm"):
        llm = LLM(str(default_model_gguf()), kv_cache_memory=64 * PER_BLOCK)
    engine = llm.engine
    assert engine.max_model_len == engine.scheduler.config.max_model_len == 64 * 16
    capped = [m for m in messages(caplog) if m.startswith("max_model_len")]
    assert capped == ["max_model_len 1024 (the model's context is 8192; the KV cache of 45.0 MiB holds 1024 "
                      "tokens; raise --kv-cache-memory or --num-kv-blocks for more)"]


def test_an_explicit_max_model_len_must_fit(caplog):
    path = str(default_model_gguf())
    with pytest.raises(ConfigurationError, match=r"the KV cache holds 64 blocks of 16 tokens, but one request "
                                                 r"of max_model_len=1040 tokens needs 65; raise"):
        LLM(path, num_kv_blocks=64, max_model_len=1040)
    # The same cache without max_model_len: what it holds.
    with caplog.at_level(logging.INFO, logger="pocketllm"):
        assert LLM(path, num_kv_blocks=64).engine.max_model_len == 1024
    assert any("the KV cache of 64 blocks holds 1024 tokens; raise --num-kv-blocks" in m for m in messages(caplog))


def test_without_chunked_prefill_a_prompt_must_fit_one_step(caplog):
    with caplog.at_level(logging.INFO, logger="pocketllm"):
        llm = LLM(str(default_model_gguf()), num_kv_blocks=256, enable_chunked_prefill=False,
                  max_num_batched_tokens=1000)
    assert llm.engine.max_model_len == 1000
    assert [m for m in messages(caplog) if m.startswith("max_model_len")] == [
        "max_model_len 1000 (the model's context is 8192; without chunked prefill a prompt must fit in one step "
        "of max_num_batched_tokens=1000; raise --max-num-batched-tokens for more)"]


def test_one_line_says_what_was_loaded(caplog):
    with caplog.at_level(logging.INFO, logger="pocketllm"):
        LLM(str(default_model_gguf()), num_kv_blocks=64, max_model_len=512)
    loaded = [m for m in messages(caplog) if m.startswith("Loaded")]
    assert len(loaded) == 1, messages(caplog)
    m = re.fullmatch(r"Loaded LlamaForCausalLM \(GGUF Q4_1, Q8_0 kept quantized; weights ([\d.]+) MiB\) on cpu "
                     r"in [\d.]+ s: 64 KV blocks of 16 tokens, context 512", loaded[0])
    assert m, loaded[0]
    assert 85 < float(m.group(1)) < 100  # the file is 93.8 MiB, nearly all of it weights


def _log_from_a_new_process(code: str, **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", f"import logging, pocketllm\n{code}"], capture_output=True,
                          text=True, env={**os.environ, **env}, cwd=Path(__file__).parents[1], check=True)
    return done.stderr


def test_pocketllm_logs_reach_the_terminal_once():
    log = "logging.getLogger('pocketllm').info"
    err = _log_from_a_new_process(f"{log}('before')\nlogging.basicConfig(level=logging.INFO)\n{log}('after')")
    assert err.count("before") == 1 and err.count("after") == 1, err
    assert _log_from_a_new_process(f"{log}('hidden')", POCKETLLM_CONFIGURE_LOGGING="0") == ""
