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
from pocketllm.core.gguf_types import SUPPORTED_TYPES
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.loaders.dummy_gguf import _FLOATS, _SCALE_FIELDS, write_dummy_gguf
from pocketllm.quant import mixes
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


def _weights(t) -> torch.Tensor:
    return dequantize(torch.from_numpy(np.array(t.data)), t.tensor_type, tuple(int(s) for s in reversed(t.shape)))


I_QUANT_FILE_TYPES = ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S",
                      "IQ3_M", "IQ4_NL", "IQ4_XS", "MXFP4_MOE"]


def test_every_type_the_engine_reads_can_be_written():
    assert set(_SCALE_FIELDS) | _FLOATS == SUPPORTED_TYPES


@pytest.mark.parametrize("file_type", I_QUANT_FILE_TYPES)
def test_i_quant_files_have_the_mix_and_sane_weights(file_type, tmp_path):
    """Every tensor in the type llama.cpp's mix gives it (MXFP4_MOE: --pure, or a dense model would be all
    Q8_0); random codes, grid indices and signs with the scales set give weights of the requested std and mean
    ~0, every block its own scale."""
    pure = file_type == "MXFP4_MOE"
    std = 0.03
    result = write_dummy_gguf(tmp_path / "d.gguf", LLAMA, file_type, std=std, pure=pure, seed=1)
    reader = GGUFReader(result.path)
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType[f"MOSTLY_{file_type}"]
    tensors = [(t.name, tuple(int(s) for s in reversed(t.shape))) for t in reader.tensors]
    want = mixes.tensor_types(tensors, file_type, n_layer=8, n_head=4, n_head_kv=2, pure=pure)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types == want
    main = mixes.parse_file_type(file_type)[2]
    assert types["blk.3.attn_q.weight"] == {"IQ3_XXS": T.IQ2_S, "IQ3_XS": T.IQ3_XXS}.get(file_type, main)
    for t in reader.tensors:
        if t.tensor_type in _FLOATS:
            continue
        w = _weights(t)
        assert torch.isfinite(w).all()
        assert abs(float(w.mean())) < 0.1 * std and 0.8 * std < float(w.std()) < 1.2 * std, t.name
        block_rms = w.reshape(-1, gguf.GGML_QUANT_SIZES[t.tensor_type][0]).square().mean(1).sqrt()
        assert float(block_rms.std() / block_rms.mean()) > 0.2, t.name  # per-block scales


@pytest.mark.parametrize("qtype", [T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL,
                                   T.IQ4_XS, T.MXFP4], ids=lambda t: t.name)
def test_engine_runs_every_type(qtype, tmp_path):
    """A one-layer model with every matrix in `qtype` (a --pure file of the file type whose main type it is)
    loads and generates, logits finite."""
    file_type = next(n for n, (_, t) in mixes.FILE_TYPES.items() if t == qtype)
    shape = dict(LLAMA, num_hidden_layers=1)
    path = write_dummy_gguf(tmp_path / "d.gguf", shape, file_type, pure=True).path
    assert {t.tensor_type for t in GGUFReader(path).tensors} == {qtype, T.F32}
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=8)
    with captured_logits(llm) as logits:
        out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}],
                           SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2
    assert all(torch.isfinite(t).all() for t in logits)


_MOE = {"Qwen3MoeForCausalLM": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                                    norm_topk_prob=True),
        "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2),
        "GptOssForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, attention_bias=True)}


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", *_MOE])
def test_engine_generates_from_a_dummy_file(arch, tmp_path):
    shape = dict(LLAMA, architectures=[arch], num_hidden_layers=2, **_MOE.get(arch, {}))
    if arch != "LlamaForCausalLM":
        shape.pop("rope_scaling")
        shape["tie_word_embeddings"] = arch == "Qwen2ForCausalLM"
    # gpt-oss as released: MXFP4 experts, Q8_0 for the rest
    path = write_dummy_gguf(tmp_path / "d.gguf", shape, "MXFP4_MOE" if "GptOss" in arch else "Q4_K_M").path
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=16)
    assert llm.engine.model_config.architecture == arch
    with captured_logits(llm) as logits:
        out = llm.generate([{"prompt_token_ids": p} for p in prompts_of([5, 12], vocab=300)],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    assert all(torch.isfinite(t).all() for t in logits)


def test_mixture_of_experts_shapes():
    """The named MoE shapes' tensors: a router and stacked [experts, rows, cols] expert matrices per
    layer, and the published parameter counts (Qwen3-30B-A3B 30.5B, Mixtral-8x7B 46.7B, gpt-oss-20b 20.9B)."""
    from pocketllm.core.shapes import SHAPES
    from pocketllm.loaders.dummy_gguf import _tensor_shapes

    for name, arch, billions in (("qwen3-30b-a3b", "qwen3moe", 30.5), ("mixtral-8x7b", "llama", 46.7),
                                 ("gpt-oss-20b", "gpt-oss", 20.9)):
        hp = SHAPES[name]
        shapes = dict(_tensor_shapes(arch, hp))
        e = hp.get("num_experts") or hp["num_local_experts"]
        inter = hp.get("moe_intermediate_size") or hp["intermediate_size"]
        assert shapes["blk.0.ffn_gate_inp.weight"] == (e, hp["hidden_size"])
        assert shapes["blk.0.ffn_gate_exps.weight"] == shapes["blk.0.ffn_up_exps.weight"] == (e, inter, hp["hidden_size"])
        assert shapes["blk.0.ffn_down_exps.weight"] == (e, hp["hidden_size"], inter)
        assert "blk.0.ffn_gate.weight" not in shapes
        assert round(sum(int(np.prod(s)) for s in shapes.values()) / 1e9, 1) == billions


def test_cli_writes_a_named_shape(tmp_path, capsys):
    from pocketllm.cli.main import main

    out = tmp_path / "smol.gguf"
    assert main(["dummy-gguf", str(out), "--shape", "smollm2-135m", "--type", "q8_0", "--quiet"]) == 0
    assert "random weights" in capsys.readouterr().out
    reader = GGUFReader(out)
    assert reader.fields["llama.block_count"].contents() == 30
    assert {t.tensor_type for t in reader.tensors} == {T.F32, T.Q8_0}
    # --layers: the shape's layers, fewer of them
    few = tmp_path / "smol-3.gguf"
    assert main(["dummy-gguf", str(few), "--shape", "smollm2-135m", "--type", "q8_0", "--layers", "3", "-q"]) == 0
    assert "3 layers" in capsys.readouterr().out
    short = GGUFReader(few)
    assert short.fields["llama.block_count"].contents() == 3
    tensors = {t.name: (tuple(t.shape), t.tensor_type) for t in reader.tensors}
    assert {t.name: (tuple(t.shape), t.tensor_type) for t in short.tensors} == {
        n: v for n, v in tensors.items() if not n.startswith("blk.") or int(n.split(".")[1]) < 3}


def test_refuses_what_it_cannot_write(tmp_path):
    with pytest.raises(UnsupportedFeatureError, match="gemma3"):
        write_dummy_gguf(tmp_path / "g.gguf", dict(LLAMA, architectures=["Gemma3ForCausalLM"]), "Q4_K_M")
    with pytest.raises(ValueError, match="unknown shape"):
        write_dummy_gguf(tmp_path / "x.gguf", "llama-9000")
