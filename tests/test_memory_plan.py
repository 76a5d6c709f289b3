"""The memory plan, made before any weight is read: what the weights, one request's KV cache and a step's
activations will take against what the device has; one log line, and a model that cannot fit refused
with the numbers and what would make it fit."""
from __future__ import annotations

import logging
import time

import pytest
from fixtures import default_model_gguf

from pocketllm import LLM
from pocketllm.engine import kv_plan
from pocketllm.errors import ConfigurationError


def test_a_model_that_cannot_fit_is_refused_before_its_weights(monkeypatch):
    """llama3-70b's shape with random weights: 263 GiB in float32 on the CPU. Refused at once (no
    weight made), in one line with the numbers and the flags that change them."""
    monkeypatch.setattr(kv_plan, "available_memory", lambda device, utilization: 64 << 30)
    t0 = time.perf_counter()
    with pytest.raises(ConfigurationError) as e:
        LLM("llama3-70b", load_format="dummy", max_model_len=4096)
    assert time.perf_counter() - t0 < 30
    msg = str(e.value)
    assert "\n" not in msg
    assert "llama3-70b does not fit on cpu: its weights take 262.8 GiB" in msg
    assert "but 64.0 GiB is available" in msg and "--max-model-len" in msg and "--dtype bfloat16" in msg


def test_qwen3_235b_a22bs_plan_counts_its_235_billion_parameters(monkeypatch):
    """The largest shape the plans are made for: 94 layers of 128 experts, 234.9 billion parameters
    (its model card says 235B), 437.6 GiB in bfloat16; refused before any weight, as it does not fit."""
    monkeypatch.setattr(kv_plan, "available_memory", lambda device, utilization: 64 << 30)
    with pytest.raises(ConfigurationError) as e:
        LLM("qwen3-235b-a22b", load_format="dummy", dtype="bfloat16", max_model_len=4096)
    params = 151936 * 4096 * 2 + 94 * (4096 * (64 + 4 + 4) * 128 + 64 * 128 * 4096 + 128 * 3 * 4096 * 1536
                                       + 128 * 4096)
    assert f"its weights take {params * 2 / 2**30:.1f} GiB" in str(e.value), (params, str(e.value))


@pytest.mark.parametrize("source", ["gguf", "safetensors"])
def test_the_plan_is_logged_and_close_to_what_loading_takes(source, tiny_models, caplog):
    path = default_model_gguf() if source == "gguf" else tiny_models["llama"][1]
    with caplog.at_level(logging.INFO, logger="pocketllm"):
        llm = LLM(str(path), max_model_len=256, num_kv_blocks=32)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan: weights"))
    assert "available on cpu" in line
    planned, held = llm.engine.planned_weight_bytes, llm.engine.weight_bytes
    # (the tiny random model's rotary tables, which the plan leaves to the activations, are 2% of its 0.7 MiB)
    assert abs(planned - held) <= (0.02 if source == "gguf" else 0.05) * held, (planned, held)


def test_a_gguf_file_on_the_cpu_that_cannot_fit_is_a_warning(monkeypatch, caplog):
    """A GGUF file may be read in place from its mapping (paging, slowly): the CPU warns and loads."""
    monkeypatch.setattr(kv_plan, "available_memory", lambda device, utilization: 16 << 20)
    with caplog.at_level(logging.WARNING, logger="pocketllm"):
        llm = LLM(str(default_model_gguf()), max_model_len=256, num_kv_blocks=32)
    assert any("does not fit on cpu" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert llm.generate({"prompt_token_ids": [1, 2, 3]})[0].outputs[0].token_ids


def test_a_step_too_large_for_the_memory_left_is_refused_with_its_bounds(monkeypatch):
    """The plan counts a step's activations (on the CPU, the torch attention's scores over the context too):
    llama3-8b's shape in bfloat16 (15 GiB) and a 4k context leave room in 24 GiB for the CPU's default
    256-token step, not for 16,384-token steps; the refusal names the step's bounds."""
    from pocketllm.config import ModelConfig
    from pocketllm.core.shapes import SHAPES

    cfg = ModelConfig.from_hf_dict(SHAPES["llama3-8b"])
    assert kv_plan.step_activation_bytes(cfg, 256, 64, 4, 4096) < 1 << 30
    assert kv_plan.step_activation_bytes(cfg, 16384, 64, 4, 4096) > 8 << 30
    monkeypatch.setattr(kv_plan, "available_memory", lambda device, utilization: 24 << 30)
    with pytest.raises(ConfigurationError) as e:
        LLM("llama3-8b", load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_batched_tokens=16384)
    msg = str(e.value)
    assert "a step's activations" in msg and "--max-num-batched-tokens (now 16384)" in msg and "--max-num-seqs" in msg
