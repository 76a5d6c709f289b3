"""`pocketllm dummy-gguf`: random-weight GGUF files of a model shape, in a quantized mix."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import prompts_of
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from reference import captured_logits

from pocketllm import LLM, SamplingParams
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.loaders.dummy_gguf import write_dummy_gguf
from pocketllm.quant.dequant import dequantize

LLAMA = dict(architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=8,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
             rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64})


def test_q4_k_m_file_has_the_mix_and_sane_weights(tmp_path):
    result = write_dummy_gguf(tmp_path / "d.gguf", LLAMA, "Q4_K_M", std=0.02)
    reader = GGUFReader(result.path)
    types = {t.name: t.tensor_type for t in reader.tensors}
    more = {0, 3, 6, 7}  # llama.cpp's use_more_bits(i, 8): Q6_K attn_v and ffn_down there
    assert types["token_embd.weight"] == T.Q4_K and types["output.weight"] == T.Q6_K
    assert types["rope_freqs.weight"] == T.F32
    for i in range(8):
        assert types[f"blk.{i}.attn_q.weight"] == types[f"blk.{i}.ffn_up.weight"] == T.Q4_K
        assert types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.ffn_down.weight"] == (T.Q6_K if i in more else T.Q4_K)
        assert types[f"blk.{i}.attn_norm.weight"] == T.F32
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M
    for t in reader.tensors:
        if t.tensor_type in (T.Q4_K, T.Q6_K):
            w = dequantize(torch.from_numpy(np.array(t.data)), t.tensor_type, tuple(int(s) for s in reversed(t.shape)))
            assert torch.isfinite(w).all()
            assert abs(float(w.mean())) < 0.002 and 0.015 < float(w.std()) < 0.027, t.name
        elif t.name.endswith("norm.weight"):
            assert np.all(np.asarray(t.data) == 1.0)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_engine_generates_from_a_dummy_file(arch, tmp_path):
    shape = dict(LLAMA, architectures=[arch], num_hidden_layers=2)
    if arch != "LlamaForCausalLM":
        shape.pop("rope_scaling")
        shape["tie_word_embeddings"] = arch == "Qwen2ForCausalLM"
    path = write_dummy_gguf(tmp_path / "d.gguf", shape, "Q4_K_M").path
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=16)
    assert llm.engine.model_config.architecture == arch
    with captured_logits(llm) as logits:
        out = llm.generate([{"prompt_token_ids": p} for p in prompts_of([5, 12], vocab=300)],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    assert all(torch.isfinite(t).all() for t in logits)


def test_cli_writes_a_named_shape(tmp_path, capsys):
    from pocketllm.cli.main import main

    out = tmp_path / "smol.gguf"
    assert main(["dummy-gguf", str(out), "--shape", "smollm2-135m", "--type", "q8_0", "--quiet"]) == 0
    assert "random weights" in capsys.readouterr().out
    reader = GGUFReader(out)
    assert reader.fields["llama.block_count"].contents() == 30
    assert {t.tensor_type for t in reader.tensors} == {T.F32, T.Q8_0}


def test_refuses_what_it_cannot_write(tmp_path):
    with pytest.raises(UnsupportedFeatureError, match="gemma3"):
        write_dummy_gguf(tmp_path / "g.gguf", dict(LLAMA, architectures=["Gemma3ForCausalLM"]), "Q4_K_M")
    with pytest.raises(ValueError, match="unknown shape"):
        write_dummy_gguf(tmp_path / "x.gguf", "llama-9000")
