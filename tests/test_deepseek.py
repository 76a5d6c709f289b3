"""DeepSeek-V2/V3's multi-head latent attention beyond the parity suites (which run both tiny configs
against transformers, greedy and logits, chunked and preempted): the absorbed form the runtime computes
equals attention over the decompressed keys and values; the cache keeps one latent head a token, in one
tensor; what the runtime does not support is refused before loading."""
from __future__ import annotations

import pytest
import torch

from pocketllm import LLM
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.models import deepseek


@pytest.fixture(scope="module")
def v3(tiny_models):
    model, path = tiny_models["deepseek_v3"]
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=16, exact_kernels=True)


def _causal(q, k, v, k_cache, v_cache, meta, scale, cpu_fused=False):
    """Attention of one sequence's queries over its own keys, causal (what the paged kernels compute)."""
    s = torch.einsum("thd,shd->hts", q, k.expand(-1, q.shape[1], -1)) * scale
    s = s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(s, dim=-1), v.expand(-1, q.shape[1], -1))


def test_absorbed_attention_equals_decompressed(v3, monkeypatch):
    """W_UK absorbed into the queries and W_UV applied after the attention give what keys
    [c @ W_UK[h]^T | k_pe] and values c @ W_UV[h]^T per head give (transformers' form)."""
    attn = v3.engine.runner.model.model.layers[1].self_attn
    monkeypatch.setattr(deepseek, "paged_attention", _causal)
    torch.manual_seed(0)
    t, h, nope, rope = 11, attn.num_heads, attn.nope, attn.rope
    x, positions = torch.randn(t, v3.engine.model_config.hidden_size), torch.arange(t)
    with torch.no_grad():
        got = attn(positions, x, None)
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(t, h, nope + rope)
        c, k_pe = attn.kv_a_proj_with_mqa(x).split([attn.rank, rope], dim=-1)
        pe = attn.rotary(positions, deepseek._deinterleave(torch.cat((q[..., nope:], k_pe.view(t, 1, rope)), 1)))
        kv = attn.kv_b_proj(attn.kv_a_layernorm(c.contiguous())).view(t, h, nope + attn.v_dim)
        keys = torch.cat((kv[..., :nope], pe[:, h:].expand(t, h, rope)), dim=-1)
        queries = torch.cat((q[..., :nope], pe[:, :h]), dim=-1)
        o = _causal(queries, keys, kv[..., nope:], None, None, None, attn.scale)
        want = attn.o_proj(o.reshape(t, -1))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), float((got - want).abs().max())


def test_the_cache_keeps_one_latent_head_a_token(v3):
    runner, raw = v3.engine.runner, v3.engine.model_config.raw
    width = raw["kv_lora_rank"] + raw["qk_rope_head_dim"]
    assert runner.k_caches is runner.v_caches  # one tensor read as keys and values
    assert all(k.shape[2:] == (1, width) for k in runner.k_caches)
    layers, bs = v3.engine.model_config.num_layers, v3.engine.block_size
    assert v3.engine.kv_plan.bytes_per_block == layers * bs * width * 4  # float32, K and V in one


@pytest.mark.parametrize("args, says", [
    (dict(kv_cache_dtype="int8"), "KV cache dtype 'int8'"),
    (dict(tensor_parallel_size=2), "tensor parallelism"),
])
def test_what_the_runtime_lacks_is_refused_before_loading(tiny_models, args, says):
    _, path = tiny_models["deepseek_v2"]
    with pytest.raises(UnsupportedFeatureError, match=says):
        LLM(str(path), device="cpu", dtype="float32", max_model_len=128, **args)


# llama.cpp's deepseek2 tensors of a dense layer and of a mixture-of-experts layer (its converter's names:
# kv_b_proj split in attn_k_b / attn_v_b, the score correction as exp_probs_b.bias, the shared experts' _shexp)
DENSE_LAYER = {"attn_norm.weight", "attn_kv_a_mqa.weight", "attn_kv_a_norm.weight", "attn_k_b.weight",
               "attn_v_b.weight", "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
               "ffn_down.weight"}
MOE_LAYER = DENSE_LAYER - {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"} | {
    "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
    "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"}
QUERY = {"deepseek_v2": {"attn_q.weight"}, "deepseek_v3": {"attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight"}}


def _logits(path, prompts):
    from reference import captured_logits

    from pocketllm import SamplingParams

    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=48, exact_kernels=True)
    with captured_logits(llm) as logits:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return [o.outputs[0].token_ids[0] for o in outs], torch.cat(logits)


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_the_cpu_fast_path_attends_the_latent_cache_in_c(tiny_models, kind):
    """The CPU's fast path (exact_kernels off) writes the latent cache and attends decode rows with the C
    kernel (layer_ops, one latent head for all query heads): every step's logits within float32 rounding
    of the exact path's torch attention, over prompts of different lengths decoding together."""
    from conftest import prompts_of
    from reference import captured_logits

    from pocketllm import SamplingParams
    from pocketllm.kernels.cpu import layer_ops

    _, path = tiny_models[kind]
    prompts = [{"prompt_token_ids": p} for p in prompts_of([3, 17, 40])]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = {}
    for exact in (True, False):
        llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=48, exact_kernels=exact)
        assert llm.engine.runner.model.model.layers[0].self_attn.kernels.cpu_fused == (not exact)
        calls = []
        real = layer_ops.decode_attention
        with captured_logits(llm) as logits, pytest.MonkeyPatch.context() as mp:
            mp.setattr(layer_ops, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
            outs = llm.generate(prompts, params)
        assert bool(calls) == (not exact)
        runs[exact] = [o.outputs[0].token_ids for o in outs], torch.cat(logits)
    assert runs[True][0] == runs[False][0]
    assert torch.allclose(runs[True][1], runs[False][1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_gguf_round_trip(tiny_models, tmp_path, kind):
    """Our writer's deepseek2 file holds llama.cpp's tensors; F32 loads to the safetensors model's logits
    (the k_b / v_b halves joined back exactly), Q8_0 stays within the error its rounding makes."""
    import gguf
    from conftest import prompts_of

    from pocketllm.loaders.gguf_writer import write_gguf

    _, path = tiny_models[kind]
    prompts = prompts_of([3, 17, 40])
    tokens, want = _logits(path, prompts)
    f32 = write_gguf(path, tmp_path / "f32.gguf", "F32").path
    names = {t.name for t in gguf.GGUFReader(f32).tensors}
    layer = lambda i: {n.split(".", 2)[2] for n in names if n.startswith(f"blk.{i}.")}  # noqa: E731
    assert layer(0) == DENSE_LAYER | QUERY[kind]
    assert layer(1) == MOE_LAYER | QUERY[kind] | ({"exp_probs_b.bias"} if kind == "deepseek_v3" else set())
    got_tokens, got = _logits(f32, prompts)
    assert got_tokens == tokens and torch.allclose(got, want, atol=1e-5, rtol=0)
    q8_tokens, q8 = _logits(write_gguf(path, tmp_path / "q8.gguf", "Q8_0").path, prompts)
    assert float((q8 - want).abs().max()) < 0.05 * float(want.abs().max())


def test_a_checkpoint_with_its_next_token_layer_loads(tiny_models, tmp_path):
    """DeepSeek-V3's published checkpoints hold the next-token-prediction layer after the decoder layers (layer
    61 of 61); plain decoding leaves it unread and computes what the checkpoint without it computes."""
    import json
    import shutil

    from conftest import prompts_of
    from safetensors.torch import load_file, save_file

    from pocketllm import SamplingParams

    _, path = tiny_models["deepseek_v3"]
    copy = shutil.copytree(path, tmp_path / "v3-mtp")
    weights = load_file(copy / "model.safetensors")
    last = json.loads((copy / "config.json").read_text())["num_hidden_layers"]
    extra = {k.replace(f"layers.{last - 1}.", f"layers.{last}."): v.clone() for k, v in weights.items()
             if k.startswith(f"model.layers.{last - 1}.")}
    h = weights["model.norm.weight"].shape[0]
    extra.update({f"model.layers.{last}.{n}.weight": torch.ones(h) for n in ("enorm", "hnorm", "shared_head.norm")})
    extra[f"model.layers.{last}.eh_proj.weight"] = torch.zeros(h, 2 * h)
    save_file({**weights, **extra}, copy / "model.safetensors", metadata={"format": "pt"})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompts_of([5, 30])]
    runs = [LLM(str(p), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16).generate(prompts, params)
            for p in (path, copy)]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]


@pytest.mark.parametrize("which", ["v3", "v2"])
def test_a_deepseek2_gguf_continues_as_llama_cpp_does(tmp_path, which):
    """llama.cpp's greedy continuations of seeded deepseek2 files (tests/data/deepseek2_llamacpp.json): the
    format as llama.cpp reads it (tensor names and layouts, the MLA and routing keys, YaRN's log multiplier)
    gives PocketLLM the tokens llama.cpp generates. The files' byte-level stand-in vocabulary: ids below 256
    are their byte, 256 two spaces, the rest unused tokens that llama-simple prints as nothing."""
    import hashlib
    import json
    from pathlib import Path

    import gguf
    from deepseek2_file import NEW_TOKENS, PROMPTS, write_deepseek2

    from pocketllm import SamplingParams

    record = json.loads((Path(__file__).parent / "data" / "deepseek2_llamacpp.json").read_text())["files"][which]
    path = write_deepseek2(tmp_path / f"{which}.gguf", which)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == record["sha256"], \
        "not the file llama.cpp ran: run benchmarks/tools/record_deepseek2.sh again"
    tokens = gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].contents()
    assert tokens[256] == "\u0120\u0120" and all(t.startswith("[PAD") for t in tokens[257:])
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=16, exact_kernels=True)
    tok = llm.get_tokenizer()
    for prompt in PROMPTS:
        out = llm.generate([{"prompt_token_ids": tok.encode(prompt)}],
                           SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))[0].outputs[0]
        printed = b"".join(bytes([i]) if i < 256 else b"  " if i == 256 else b"" for i in out.token_ids)
        assert printed.hex() == record["continuations"][prompt], (prompt, out.token_ids)


def test_an_older_gguf_with_one_kv_b_tensor_loads(tiny_models, tmp_path, monkeypatch):
    """Files from llama.cpp's converter before it split kv_b_proj hold it whole (attn_kv_b, here Q8_0): the
    loader dequantizes it, and the model computes within that rounding of the safetensors one."""
    from conftest import prompts_of

    from pocketllm.loaders import gguf_writer

    def whole(path, hf, hp):
        layer = hf.split(".")[2]
        shape = (hp["num_attention_heads"] * (hp["qk_nope_head_dim"] + hp["v_head_dim"]), hp["kv_lora_rank"])
        return [gguf_writer._Tensor(f"blk.{layer}.attn_kv_b.weight", shape, lambda: gguf_writer._read_tensor(path, hf))]

    monkeypatch.setattr(gguf_writer, "_kv_b_halves", whole)
    _, path = tiny_models["deepseek_v3"]
    prompts = prompts_of([3, 17, 40])
    _, want = _logits(path, prompts)
    old = gguf_writer.write_gguf(path, tmp_path / "old.gguf", "Q8_0", pure=True)
    assert old.tensor_types["blk.0.attn_kv_b.weight"].name == "Q8_0"
    _, got = _logits(old.path, prompts)
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())


# -- the next-token-prediction layer as a draft (speculative method "mtp") --------------------------
MTP_LAYER = ("enorm", "hnorm", "shared_head.norm")


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """A tiny V3 checkpoint with its next-token-prediction layer (random), and transformers' modules over
    the same weights: a four-layer V3 whose last decoder layer is the checkpoint's layer 3, saved with
    num_hidden_layers 3 (transformers' V3 runs only that many) and the layer's own tensors added."""
    import json

    from safetensors.torch import load_file, save_file
    from tiny_models import make_model

    model, path = make_model("deepseek_v3", tmp_path_factory.mktemp("mtp"), num_hidden_layers=4)
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=3, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    model.config.num_hidden_layers = 3
    weights = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(11)
    h = config["hidden_size"]
    layer = {f"{n}.weight": 1 + 0.1 * torch.randn(h, generator=g) for n in MTP_LAYER}
    layer["eh_proj.weight"] = 0.08 * torch.randn(h, 2 * h, generator=g)
    copies = {"embed_tokens.weight": weights["model.embed_tokens.weight"].clone(), "shared_head.head.weight":
              weights["lm_head.weight"].clone()}  # (what DeepSeek's checkpoints hold: the model's own, not read)
    save_file({**weights, **{f"model.layers.3.{n}": t for n, t in {**layer, **copies}.items()}},
              path / "model.safetensors", metadata={"format": "pt"})
    return model, path, layer


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_mtp_drafts(model, layer, tokens: list[int], k: int) -> list[int]:
    """k chained drafts after `tokens`, with transformers' decoder layer: at position i the layer reads
    eh_proj([enorm(embed(token i + 1)) | hnorm(h_i)]), h_i the model's final hidden state, or past the
    known tokens its own output at the position before; a draft is the argmax of the model's head
    after shared_head.norm."""
    from transformers.masking_utils import create_causal_mask

    m = model.model
    with torch.no_grad():
        hidden = m(torch.tensor([tokens])).last_hidden_state[0]
        inputs, prev, drafts = list(tokens[1:]), hidden[:-1], []
        for _ in range(k):
            x = torch.cat((_rms(m.embed_tokens(torch.tensor(inputs)), layer["enorm.weight"]),
                           _rms(prev, layer["hnorm.weight"])), -1) @ layer["eh_proj.weight"].T
            pos = torch.arange(len(inputs))[None]
            mask = create_causal_mask(config=model.config, inputs_embeds=x[None], attention_mask=None, cache=None,
                                      position_ids=pos)
            out = m.layers[3](x[None], attention_mask=mask, position_ids=pos,
                              position_embeddings=m.rotary_emb(x[None], pos))[0]
            drafts.append(int(model.lm_head(_rms(out[-1], layer["shared_head.norm.weight"])).argmax()))
            inputs.append(drafts[-1])
            prev = torch.cat((prev, out[-1:]))
    return drafts


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_mtp_drafts_are_the_next_token_layer_over_the_models_hidden_states(mtp_checkpoint, device):
    """Every proposal (two drafts a step, chunked prompts of three lengths beside each other, then a prompt
    that adopts another's cached blocks and the layer's KV in them, less the last matching block, whose
    first token that KV read) is what transformers' modules compute over the same tokens, and the tokens
    are the model's own greedy tokens."""
    from conftest import prompts_of
    from reference import hf_greedy

    from pocketllm import SamplingParams

    model, path, layer = mtp_checkpoint
    llm = LLM(str(path), device=device, dtype="float32", max_model_len=96, num_kv_blocks=48, block_size=8,
              max_num_batched_tokens=16, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    engine = llm.engine
    engine.speculator.draft_length.limit = lambda req, cost: 2  # every step drafts two
    proposer, proposed = engine.speculator.proposer, []
    propose = proposer.propose_for

    def recorded(wanted):
        drafts = propose(wanted)
        proposed.extend((list(req.all_token_ids), d) for (req, _), d in zip(wanted, drafts))
        return drafts

    proposer.propose_for = recorded
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = prompts_of([5, 30, 19])
    later = prompts[1][:24] + [7, 8, 9]  # 3 of the 30-token prompt's blocks match; the last one is computed
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    outs += llm.generate({"prompt_token_ids": later}, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(model, p, 10) for p in prompts + [later]]
    assert outs[-1].num_cached_tokens == 16
    assert len(proposed) >= 20 and all(len(d) == 2 for _, d in proposed)
    for tokens, drafts in proposed:
        assert drafts == reference_mtp_drafts(model, layer, tokens, 2), tokens


def test_mtp_is_refused_where_there_is_no_next_token_layer(tiny_models, tmp_path):
    """V2 has none; a V3 checkpoint may declare none, or declare one and not hold it: refused before any
    weight is read."""
    import json
    import shutil

    from pocketllm.errors import ConfigurationError

    spec = {"method": "mtp"}
    with pytest.raises(UnsupportedFeatureError, match="mtp is for DeepSeek-V3"):
        LLM(str(tiny_models["llama"][1]), device="cpu", speculative_config=spec)
    with pytest.raises(UnsupportedFeatureError, match="mtp is for DeepSeek-V3"):
        LLM(str(tiny_models["deepseek_v2"][1]), device="cpu", speculative_config=spec)
    path = tiny_models["deepseek_v3"][1]
    with pytest.raises(ConfigurationError, match=r"holds no tensor of its next-token-prediction layer \(model\.layers\.3"):
        LLM(str(path), device="cpu", speculative_config=spec)  # (transformers' config says 1; the file has none)
    none = shutil.copytree(path, tmp_path / "none")
    config = json.loads((none / "config.json").read_text())
    (none / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(UnsupportedFeatureError, match="num_nextn_predict_layers is 0"):
        LLM(str(none), device="cpu", speculative_config=spec)


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_a_quantized_file_on_the_fast_path(tmp_path, kind):
    """A deepseek2 GGUF file in Q8_0 on the CPU's fast path. Its attn_k_b and attn_v_b multiply decode rows as
    they are (QuantizedHeads: 8-bit activations, this small model's two passes): every step's logits stay
    close to the same engine's through kv_b_proj's dense halves, tokens equal. A lone sequence's shared experts
    run in its routed experts' one C call (DecodeExperts), added last as the module path adds them: the same bits.
    (The module path: test_llama_decode.py runs these files' decode steps in one call.)"""
    import gguf
    from conftest import prompts_of
    from reference import captured_logits
    from tiny_models import make_model

    from pocketllm import SamplingParams
    from pocketllm.kernels.cpu import gguf_ops
    from pocketllm.kernels.cpu.llama_decode import DecodeExperts
    from pocketllm.loaders.gguf_writer import write_gguf

    if not gguf_ops.supports_int8(gguf.GGMLQuantizationType.Q8_0):
        pytest.skip("the quantized heads take the 8-bit kernels, which this CPU lacks (no AVX2)")
    _, path = make_model(kind, tmp_path, kv_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32)
    file = write_gguf(path, tmp_path / "q8.gguf", "Q8_0").path
    types = {t.name.split(".", 2)[2]: t.tensor_type for t in gguf.GGUFReader(file).tensors if t.name.startswith("blk.0.")}
    assert types["attn_k_b.weight"] == types["attn_v_b.weight"] == gguf.GGMLQuantizationType.Q8_0
    prompts = [{"prompt_token_ids": p} for p in prompts_of([3, 17, 40])]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    build, heads_gemm = DecodeExperts.build.__func__, gguf_ops.heads_gemm
    runs = {}
    for run in ("as they are", "dense heads", "shared apart"):
        calls = {"heads": 0, "shared": 0}

        def counted_build(cls, experts, shared=None):
            calls["shared"] += shared is not None
            return build(cls, experts, None if run == "shared apart" else shared)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gguf_ops, "heads_gemm", lambda *a, **k: calls.update(heads=calls["heads"] + 1) or heads_gemm(*a, **k))
            mp.setattr(DecodeExperts, "build", classmethod(counted_build))
            if run == "dense heads":
                mp.setattr(deepseek.QuantizedHeads, "kept", lambda self, rows: False)
            llm = LLM(str(file), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=48, exact_kernels=False)
            model = llm.engine.runner.model
            assert all(p is not None for p in model.model.layers[0].self_attn.heads.parts)
            model._cpu_decoder = False  # the modules (the one-call decode step: test_llama_decode.py)
            with captured_logits(llm) as logits:
                outs = llm.generate(prompts, params) + llm.generate(prompts[1:2], params)  # (then one row a step)
        assert bool(calls["heads"]) == (run != "dense heads") and calls["shared"] == 2  # (its two MoE layers)
        runs[run] = [o.outputs[0].token_ids for o in outs], torch.cat(logits)
    assert runs["as they are"][0] == runs["dense heads"][0]
    # (1.4e-4 and 1.8e-4 of logits up to 2.3 here; one 8-bit pass would move them by 1.8e-2)
    assert float((runs["as they are"][1] - runs["dense heads"][1]).abs().max()) < 1e-3
    assert runs["shared apart"][0] == runs["as they are"][0]
    assert torch.equal(runs["shared apart"][1], runs["as they are"][1])
