"""Engine behaviour: prefix caching, stops, errors, capabilities."""
from __future__ import annotations

import json
import shutil

import pytest
from conftest import prompts_of

from pocketllm import LLM, SamplingParams
from pocketllm.config import EngineArgs
from pocketllm.errors import ConfigurationError, RequestError, UnsupportedFeatureError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen3"][1]), dtype="float32")


def test_prefix_cache_reports_block_aligned_hits_and_same_tokens(llm):
    base = prompts_of([53], seed=3)[0]
    first = llm.generate({"prompt_token_ids": base}, GREEDY)[0]
    assert first.num_cached_tokens == 0
    second = llm.generate({"prompt_token_ids": base}, GREEDY)[0]
    assert second.num_cached_tokens == 48  # 3 full blocks of 16; the 53rd token is recomputed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    # A different suffix after a shared 40-token prefix: 2 full blocks hit.
    other = base[:40] + prompts_of([9], seed=4)[0]
    third = llm.generate({"prompt_token_ids": other}, GREEDY)[0]
    assert third.num_cached_tokens == 32
    llm.engine.check_no_leaks()


def test_prefix_cached_result_equals_uncached(tiny_models):
    path = str(tiny_models["qwen3"][1])
    prompts = [{"prompt_token_ids": p} for p in prompts_of([35, 35], seed=8)]
    shared = prompts_of([33], seed=6)[0]
    prompts = [{"prompt_token_ids": shared + p["prompt_token_ids"]} for p in prompts]
    cached = LLM(path, dtype="float32").generate(prompts, GREEDY)
    plain = LLM(path, dtype="float32", enable_prefix_caching=False).generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in plain]
    assert plain[1].num_cached_tokens == 0


def test_stop_token_ids_and_max_tokens(llm):
    prompt = {"prompt_token_ids": prompts_of([10], seed=2)[0]}
    free = llm.generate(prompt, GREEDY)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == free.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at],
                                               min_tokens=12))[0].outputs[0]
    assert len(held.token_ids) == 12


def test_prompt_longer_than_max_model_len_is_rejected(tiny_models):
    small = LLM(str(tiny_models["llama"][1]), dtype="float32", max_model_len=32)
    with pytest.raises(RequestError, match="max_model_len"):
        small.generate({"prompt_token_ids": [1] * 33}, GREEDY)
    out = small.generate({"prompt_token_ids": [1] * 30}, SamplingParams(temperature=0, max_tokens=10))[0]
    assert len(out.outputs[0].token_ids) == 2 and out.outputs[0].finish_reason == "length"
    small.engine.check_no_leaks()


def test_unknown_architecture_lists_the_supported_ones(tiny_models, tmp_path):
    src = tiny_models["llama"][1]
    dst = tmp_path / "mystery"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["MysteryForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedFeatureError) as e:
        LLM(str(dst))
    msg = str(e.value)
    assert "MysteryForCausalLM" in msg
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_unsupported_rope_scaling_fails_before_weights_load(tiny_models, tmp_path):
    dst = tmp_path / "longrope"
    dst.mkdir()
    cfg = json.loads((tiny_models["llama"][1] / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "longrope", "factor": 4.0}
    (dst / "config.json").write_text(json.dumps(cfg))  # no weights at all: selection must fail first
    with pytest.raises(UnsupportedFeatureError,
                       match="longrope.*supported: default, freq_factors, linear, llama3, yarn"):
        LLM(str(dst))


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(block_size=12), "block_size"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(dtype="float8"), "dtype"),
    (dict(device="tpu"), "device"),
    (dict(model="/nonexistent/model"), "does not exist"),
    (dict(nonsense=1), "unknown engine argument"),
])
def test_bad_engine_args_raise_configuration_error(kwargs, fragment):
    with pytest.raises(ConfigurationError, match=fragment):
        EngineArgs.from_kwargs(**kwargs)


def test_kv_cache_too_small_for_max_model_len(tiny_models):
    with pytest.raises(ConfigurationError, match="num_kv_blocks"):
        LLM(str(tiny_models["llama"][1]), num_kv_blocks=2, max_model_len=64)


def test_many_requests_leave_no_leaks(tiny_models):
    llm = LLM(str(tiny_models["qwen2"][1]), dtype="float32", num_kv_blocks=20, max_model_len=128,
              max_num_seqs=6, max_num_batched_tokens=40)
    prompts = [{"prompt_token_ids": p} for p in prompts_of([3, 60, 17, 90, 8, 33, 25, 70, 5, 44], seed=12)]
    params = [SamplingParams(temperature=t, max_tokens=m, seed=i, ignore_eos=True)
              for i, (t, m) in enumerate(zip([0, 1, 0.7, 0, 1, 0, 0.5, 0, 1, 0], [5, 30, 12, 20, 1, 9, 30, 16, 4, 25]))]
    outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    llm.engine.check_no_leaks()


def test_capabilities_refuse_what_a_platform_does_not_declare(tiny_models):
    from pocketllm.config import ModelConfig
    from pocketllm.models.registry import select_runtime

    cfg = ModelConfig.from_hf_dir(tiny_models["llama"][1])
    args = EngineArgs()
    assert select_runtime(cfg, args, "cpu", "float32", {"Q4_1", "Q8_0"}).model_class.__name__ == "LlamaForCausalLM"
    # every GGUF type loads on CUDA, kept quantized
    assert select_runtime(cfg, args, "cuda", "bfloat16", {"Q4_K", "Q6_K", "IQ2_XS"}).model_class is not None
    with pytest.raises(UnsupportedFeatureError, match="runtime does not support quantization type 'TQ1_0'"):
        select_runtime(cfg, args, "cuda", "bfloat16", {"TQ1_0"})
    with pytest.raises(UnsupportedFeatureError, match="cpu platform does not support dtype 'float16'"):
        select_runtime(cfg, args, "cpu", "float16")


def test_dummy_weights_build_a_named_shape_without_files():
    llm = LLM("smollm2-135m", load_format="dummy", dtype="float32", max_model_len=256, num_kv_blocks=64)
    cfg = llm.engine.model_config
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ConfigurationError, match="does not exist"):
        EngineArgs(model="smollm2-135m")  # a shape name is only a model with load_format="dummy"
