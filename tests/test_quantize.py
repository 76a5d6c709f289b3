"""`pocketllm quantize`: our block quantizers, the llama.cpp tensor-type mixes, and HF dir -> GGUF writing
(read back by gguf's reader and by our engine)."""
from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from conftest import prompts_of
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize
from reference import captured_logits, hf_greedy
from tiny_models import make_llama256

from pocketllm import LLM, SamplingParams
from pocketllm.loaders.gguf_loader import GGUFModelFile
from pocketllm.loaders.gguf_writer import gguf_name, permute_rows, write_gguf
from pocketllm.quant import mixes
from pocketllm.quant.quantize import quantize
from pocketllm.tokenizer.gguf_pre import PRE_TOKENIZERS

# Relative RMSE (rmse / rms) on N(0, 1) weights, [128, 1024]: a bound for our search, which must also beat
# plain min/max (absmax) scales. Measured (seed 0), ours / min-max:
#   Q8_0 0.00529 / 0.00536   Q6_K 0.0177 / 0.0188   Q5_1 0.0337 / 0.0379   Q5_K 0.0358 / 0.0382
#   Q5_0 0.0405 / 0.0427     Q4_1 0.0698 / 0.0782   Q4_K 0.0710 / 0.0783   Q4_0 0.0816 / 0.0859
#   Q3_K 0.151 / 0.155       Q2_K 0.297 / 0.328         IQ4_NL 0.0762 / 0.0800  IQ4_XS 0.0768 / 0.0801
# (Q8_0's floor is its step: amax/127/sqrt(12) ~ 0.0053 of the rms for gaussian blocks of 32.) For reference,
# llama.cpp's own llama-quantize (0.3.36, no imatrix) on N(0, 0.05) weights of a 4.9M-parameter model gave the
# same error as ours for Q2_K/Q3_K/Q6_K (same algorithms) and 0.4-12% more for the others.
ROUND_TRIP_BOUND = {
    T.Q8_0: 0.0056, T.Q6_K: 0.0185, T.Q5_1: 0.0355, T.Q5_K: 0.0375, T.Q5_0: 0.042,
    T.Q4_1: 0.073, T.Q4_K: 0.074, T.Q4_0: 0.085, T.Q3_K: 0.155, T.Q2_K: 0.31, T.IQ4_NL: 0.078, T.IQ4_XS: 0.079,
}


def rel_rmse(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


@pytest.fixture(scope="module")
def gaussian():
    return np.random.default_rng(0).standard_normal((128, 1024)).astype(np.float32)


@pytest.mark.parametrize("qtype", list(ROUND_TRIP_BOUND), ids=lambda t: t.name)
def test_round_trip_error(gaussian, qtype):
    data = quantize(gaussian, qtype)
    assert data.dtype == np.uint8 and data.shape == (128, 1024 // gguf.GGML_QUANT_SIZES[qtype][0]
                                                     * gguf.GGML_QUANT_SIZES[qtype][1])
    ours = rel_rmse(dequantize(data, qtype), gaussian)  # gguf's reference decoder reads our blocks
    naive = rel_rmse(dequantize(quantize(gaussian, qtype, search=False), qtype), gaussian)
    assert ours < ROUND_TRIP_BOUND[qtype]
    if qtype == T.Q8_0:
        assert ours <= naive  # only a least-squares refit of the scale to gain there
    else:
        assert ours < 0.98 * naive, (ours, naive)  # the search pays for itself


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0], ids=lambda t: t.name)
def test_min_max_baseline_is_llama_cpp_reference(gaussian, qtype):
    """search=False reproduces gguf-py's port of llama.cpp's reference quantizers (same layout, same values
    but for a few codes: ours are rounded against the stored fp16 scale and min, the reference's against
    their float32 values)."""
    ours = dequantize(quantize(gaussian, qtype, search=False), qtype)
    ref = dequantize(gguf.quants.quantize(gaussian, qtype), qtype)
    assert np.mean(ours == ref) > 0.99


@pytest.mark.parametrize("qtype", list(ROUND_TRIP_BOUND), ids=lambda t: t.name)
def test_engine_decoder_agrees_and_edge_cases(qtype):
    """Our torch decoder (the engine's) reads the same values as gguf's; zero, constant, tiny and
    one-sided blocks stay exact or finite."""
    from pocketllm.quant.dequant import dequantize as engine_dequantize

    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 512)).astype(np.float32) * np.array([1, 1e-3, 1e3, 1, 1, 1], np.float32)[:, None]
    w[3] = 0.0
    w[4] = 0.25
    w[5] = np.abs(w[5]) + 1.0  # all positive
    data = quantize(w, qtype)
    ref = dequantize(data, qtype)
    ours = engine_dequantize(torch.from_numpy(data), qtype, (6, 512)).numpy()
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=0)
    assert np.isfinite(ref).all()
    assert np.all(ref[3] == 0)
    assert rel_rmse(ref[[0, 1, 2, 5]], w[[0, 1, 2, 5]]) < ROUND_TRIP_BOUND[qtype] * 1.5
    np.testing.assert_allclose(ref[4], 0.25, rtol=0.02)


def test_iq4_beats_q4_0(gaussian):
    """IQ4_NL spends Q4_0's 4.5 bits per weight on a non-linear table: at least as good on gaussian weights
    (and IQ4_XS, 4.25 bits, too)."""
    q4_0 = rel_rmse(dequantize(quantize(gaussian, T.Q4_0), T.Q4_0), gaussian)
    for qtype in (T.IQ4_NL, T.IQ4_XS):
        assert rel_rmse(dequantize(quantize(gaussian, qtype), qtype), gaussian) <= q4_0, qtype.name


# ggml's quantize_row_iq4_nl_impl transcribed line by line (float32 scalars, sequential sums), as
# quantize_iq4_nl / quantize_iq4_xs call it without an importance matrix: gguf-py has no quantizer for these.
_KVALUES = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]


def _best_index_int8(x):
    val = _KVALUES
    if x <= val[0]:
        return 0
    if x >= val[15]:
        return 15
    ml, mu = 0, 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < val[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if x - np.float32(val[mu - 1]) < np.float32(val[mu]) - x else mu


def _iq4_reference(x, super_block_size, ntry=7):
    f32 = np.float32
    x = [f32(v) for v in x]
    nb = super_block_size // 32
    L = [0] * super_block_size
    scales = [f32(0)] * nb
    max_scale = amax_scale = f32(0)
    for ib in range(nb):
        xb = x[32 * ib:32 * ib + 32]
        weight = [v * v for v in xb]
        amax = mx = f32(0)
        for v in xb:
            if abs(v) > amax:
                amax, mx = abs(v), v
        if amax < f32(1e-15):
            scales[ib] = f32(0)
            continue
        d = -mx / f32(_KVALUES[0])
        id_ = f32(1) / d
        sumqx = sumq2 = f32(0)
        for j in range(32):
            q = f32(_KVALUES[_best_index_int8(id_ * xb[j])])
            sumqx += weight[j] * q * xb[j]
            sumq2 += weight[j] * q * q
        d = sumqx / sumq2 if sumq2 > 0 else f32(0)
        best = d * sumqx
        for itry in range(-ntry, ntry + 1):
            id_ = f32(itry + _KVALUES[0]) / mx
            sumqx = sumq2 = f32(0)
            for j in range(32):
                q = f32(_KVALUES[_best_index_int8(id_ * xb[j])])
                sumqx += weight[j] * q * xb[j]
                sumq2 += weight[j] * q * q
            if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                d = sumqx / sumq2
                best = d * sumqx
        scales[ib] = d
        if abs(d) > amax_scale:
            amax_scale, max_scale = abs(d), d
    if nb > 1:
        d = -max_scale / f32(32)
        id_ = f32(1) / d if d else f32(0)
        scales_h, scales_l = 0, [0] * (nb // 2)
        for ib in range(nb):
            l = max(-32, min(31, int(np.rint(id_ * scales[ib]))))
            dl = d * f32(l)
            idl = f32(1) / dl if dl else f32(0)
            for j in range(32):
                L[32 * ib + j] = _best_index_int8(idl * x[32 * ib + j])
            l += 32
            scales_l[ib // 2] |= (l & 0xF) << (4 * (ib % 2))
            scales_h |= (l >> 4) << (2 * ib)
        head = np.float16(d).tobytes() + np.uint16(scales_h).tobytes() + bytes(scales_l)
    else:
        head = np.float16(scales[0]).tobytes()
        id_ = f32(1) / scales[0] if scales[0] else f32(0)
        for j in range(32):
            L[j] = _best_index_int8(id_ * x[j])
    return head + bytes(L[32 * i + j] | (L[32 * i + 16 + j] << 4) for i in range(nb) for j in range(16))


@pytest.mark.parametrize("qtype", [T.IQ4_NL, T.IQ4_XS], ids=lambda t: t.name)
def test_iq4_is_ggml_byte_for_byte(qtype):
    """Our vectorised IQ4_NL / IQ4_XS blocks are the C reference's, byte for byte: rows of many magnitudes, a
    zero row, a zero sub-block, a constant half, multiples of 1/4, tiny values."""
    with pytest.raises(NotImplementedError):  # when gguf-py gains these, compare with it as well
        gguf.quants.quantize(np.ones((1, 256), np.float32), qtype)
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((8, 512)) * np.exp(rng.uniform(-8, 8, (8, 1)))).astype(np.float32)
    w[0] = 0
    w[1, :256] *= 1e-3
    w[2, 32:64] = 0
    w[3, :256] = 0.25
    w[4] = np.round(w[4] * 4) / 4
    w[5, :40] = 1e-16
    sbs = gguf.GGML_QUANT_SIZES[qtype][0]
    want = b"".join(_iq4_reference(w.reshape(-1)[i:i + sbs], sbs) for i in range(0, w.size, sbs))
    assert quantize(w, qtype).tobytes() == want


# ---- file-type mixes -----------------------------------------------------------------------------------------

def _tensor_list(n_layer, hidden, ff, kv_dim, vocab, tied):
    out = [("token_embd.weight", (vocab, hidden)), ("output_norm.weight", (hidden,))]
    if not tied:
        out.append(("output.weight", (vocab, hidden)))
    for i in range(n_layer):
        out += [(f"blk.{i}.attn_q.weight", (hidden, hidden)), (f"blk.{i}.attn_k.weight", (kv_dim, hidden)),
                (f"blk.{i}.attn_v.weight", (kv_dim, hidden)), (f"blk.{i}.attn_output.weight", (hidden, hidden)),
                (f"blk.{i}.ffn_gate.weight", (ff, hidden)), (f"blk.{i}.ffn_up.weight", (ff, hidden)),
                (f"blk.{i}.ffn_down.weight", (hidden, ff)), (f"blk.{i}.attn_norm.weight", (hidden,)),
                (f"blk.{i}.ffn_norm.weight", (hidden,))]
    return out


def test_use_more_bits_layers():
    assert [i for i in range(8) if mixes.use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(30) if mixes.use_more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]


def test_mix_of_a_smollm2_shaped_model():
    """SmolLM2-135M (576-wide rows: not a multiple of 256) in Q4_K_M gets what llama-quantize gives it:
    166 Q5_0 (Q4_K's fallback), 16 Q4_K and 14 Q6_K ffn_down, 14 Q8_0 attn_v (Q6_K's fallback) + tied
    embeddings in Q8_0."""
    types = mixes.tensor_types(_tensor_list(30, 576, 1536, 192, 49152, tied=True), "Q4_K_M",
                               n_layer=30, n_head=9, n_head_kv=3)
    counts = {}
    for t in types.values():
        counts[t] = counts.get(t, 0) + 1
    assert counts == {T.Q5_0: 166, T.Q4_K: 16, T.Q6_K: 14, T.Q8_0: 15, T.F32: 61}
    assert types["token_embd.weight"] == T.Q8_0


def test_mix_fallbacks_and_simple_types():
    tensors = _tensor_list(2, 96, 160, 32, 384, tied=False)
    kw = {"n_layer": 2, "n_head": 3, "n_head_kv": 1}
    q6 = mixes.tensor_types(tensors, "Q6_K", **kw)
    assert {q6[n] for n, s in tensors if len(s) == 2} == {T.Q8_0}  # 96 and 160 % 256 != 0 -> Q8_0
    q5km = mixes.tensor_types(tensors, "Q5_K_M", **kw)
    assert q5km["blk.1.attn_q.weight"] == T.Q5_1 and q5km["blk.0.attn_v.weight"] == T.Q5_1
    assert q5km["blk.1.attn_v.weight"] == T.Q8_0  # use_more_bits(1, 2): Q6_K, whose fallback is Q8_0
    q40 = mixes.tensor_types(tensors, "Q4_0", **kw)
    assert q40["output.weight"] == T.Q8_0  # Q6_K for the output, falling back to Q8_0 for 96-wide rows
    assert q40["token_embd.weight"] == T.Q4_0 and q40["blk.0.ffn_down.weight"] == T.Q4_0
    assert all(t == T.F32 for n, t in q40.items() if n.endswith("norm.weight"))
    odd = mixes.tensor_types([("blk.0.attn_q.weight", (8, 40))], "Q4_K_M", **kw)
    assert odd["blk.0.attn_q.weight"] == T.F16  # no 32-wide block fits either
    f16 = mixes.tensor_types(tensors, "F16", **kw)
    assert f16["blk.0.attn_q.weight"] == T.F16 and f16["output_norm.weight"] == T.F32
    pure = mixes.tensor_types(_tensor_list(2, 256, 512, 128, 384, tied=False), "Q4_K", pure=True, **kw)
    assert {t for n, t in pure.items() if not n.endswith("norm.weight")} == {T.Q4_K}
    assert mixes.parse_file_type("q4_k")[0] == "Q4_K_M"
    with pytest.raises(ValueError, match="unknown quantization type"):
        mixes.parse_file_type("Q7_K")


def test_iquant_mixes():
    """llama_tensor_get_type for the i-quant file types (no importance matrix), 8 layers (ffn_down of layer
    0 is the first eighth), attn_v shared by 2 (n_gqa 2) or 4 heads (n_gqa 4)."""
    tensors = _tensor_list(8, 256, 512, 128, 384, tied=False)

    def mix(ft, n_head_kv=2, tensors=tensors):
        return mixes.tensor_types(tensors, ft, n_layer=8, n_head=4, n_head_kv=n_head_kv)

    def check(types, default, **want):
        """`want`: category -> type, or (layer 0's type, the other layers' type)."""
        for name, t in types.items():
            if name.endswith("norm.weight"):
                assert t == T.F32
                continue
            cat = mixes.category(name)
            w = want.get(cat, default)
            if isinstance(w, tuple):
                w = w[0] if name.startswith("blk.0.") else w[1]
            assert t == w, (name, t, w)

    for ft, main in (("IQ2_XXS", T.IQ2_XXS), ("IQ2_XS", T.IQ2_XS)):
        check(mix(ft), main, token_embd=T.Q2_K, output=T.Q5_K, attn_v=T.Q2_K, ffn_down=(T.Q2_K, main))
        assert mix(ft, n_head_kv=1)["blk.3.attn_v.weight"] == T.Q4_K  # n_gqa >= 4
    for ft, main in (("IQ1_S", T.IQ1_S), ("IQ1_M", T.IQ1_M)):
        check(mix(ft), main, token_embd=T.Q2_K, output=T.Q5_K, attn_v=T.Q2_K, ffn_down=(T.Q2_K, main),
              attn_output=T.IQ2_XXS)
    for ft, main in (("IQ2_S", T.IQ2_XS), ("IQ2_M", T.IQ2_S)):  # (llama.cpp's main types, sic)
        check(mix(ft), main, token_embd=T.IQ3_S, output=T.Q5_K, attn_v=T.IQ3_S, ffn_down=(T.IQ3_S, main),
              attn_output=T.IQ3_S)
    check(mix("IQ3_XXS"), T.IQ3_XXS, token_embd=T.IQ3_S, output=T.Q5_K, attn_q=T.IQ2_S, attn_k=T.IQ2_S,
          attn_v=T.IQ3_S, attn_output=T.IQ3_S, ffn_down=(T.Q4_K, T.Q3_K))
    assert mix("IQ3_XXS", n_head_kv=1)["blk.0.attn_v.weight"] == T.Q4_K
    check(mix("IQ3_S"), T.IQ3_S, output=T.Q6_K)
    assert mix("IQ3_S", n_head_kv=1)["blk.0.attn_v.weight"] == T.Q4_K
    check(mix("IQ3_M"), T.IQ3_S, output=T.Q6_K, attn_v=T.Q4_K, attn_output=T.Q4_K, ffn_down=(T.Q4_K, T.IQ3_S))
    xs = mix("IQ3_XS")  # the middle layers' ffn_gate / ffn_up in IQ3_XXS
    assert [xs[f"blk.{i}.ffn_up.weight"] for i in range(8)] == [T.IQ3_S] + [T.IQ3_XXS] * 6 + [T.IQ3_S]
    assert xs["blk.0.attn_q.weight"] == xs["blk.7.attn_k.weight"] == T.IQ3_XXS
    for ft, main in (("IQ4_NL", T.IQ4_NL), ("IQ4_XS", T.IQ4_XS)):
        check(mix(ft), main, output=T.Q6_K, ffn_down=(T.Q5_K, main))
        assert mix(ft, n_head_kv=1)["blk.5.attn_v.weight"] == T.Q5_K
    # tied embeddings are quantized as the output; MXFP4_MOE is MXFP4 for stacked experts only
    assert mix("IQ2_XXS", tensors=_tensor_list(8, 256, 512, 128, 384, tied=True))["token_embd.weight"] == T.Q5_K
    moe = mix("MXFP4_MOE", tensors=tensors + [("blk.0.ffn_down_exps.weight", (4, 256, 512))])
    assert moe.pop("blk.0.ffn_down_exps.weight") == T.MXFP4
    assert {t for n, t in moe.items() if not n.endswith("norm.weight")} == {T.Q8_0}
    pure = mixes.tensor_types(tensors, "MXFP4_MOE", n_layer=8, n_head=4, n_head_kv=2, pure=True)
    assert {t for n, t in pure.items() if not n.endswith("norm.weight")} == {T.MXFP4}


def test_iquant_mix_fallbacks():
    """SmolLM2-135M's 576-wide rows: the 256-wide i-quants fall back to IQ4_NL (1536-wide ffn_down rows
    keep them), the tied embeddings to Q8_0, the k-quant bumps to theirs."""
    tensors = _tensor_list(30, 576, 1536, 192, 49152, tied=True)
    kw = {"n_layer": 30, "n_head": 9, "n_head_kv": 3}
    xs = mixes.tensor_types(tensors, "IQ4_XS", **kw)
    assert xs["token_embd.weight"] == T.Q8_0 and xs["blk.0.attn_v.weight"] == T.IQ4_NL
    assert xs["blk.0.ffn_up.weight"] == T.IQ4_NL and xs["blk.29.ffn_down.weight"] == T.IQ4_XS
    assert xs["blk.2.ffn_down.weight"] == T.Q5_K and xs["blk.3.ffn_down.weight"] == T.IQ4_XS  # 30 // 8 = 3
    xxs = mixes.tensor_types(tensors, "IQ3_XXS", **kw)
    assert xxs["blk.0.attn_q.weight"] == T.IQ4_NL  # IQ2_S's fallback
    assert xxs["blk.5.ffn_down.weight"] == T.Q3_K and xxs["blk.5.ffn_gate.weight"] == T.IQ4_NL
    assert mixes.tensor_types(tensors, "IQ2_XXS", **kw)["blk.0.attn_v.weight"] == T.Q4_0  # Q2_K's
    odd = mixes.tensor_types([("blk.0.attn_q.weight", (8, 40))], "IQ1_M", **kw)
    assert odd["blk.0.attn_q.weight"] == T.F16


# ---- writing GGUF files --------------------------------------------------------------------------------------

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello world! 123 4567 89",
         "Quantization keeps the model small and fast.", "Ünïcödé text, emojis 🚀 and\ttabs\nand newlines."]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """A byte-level BPE trained on a few sentences (vocabulary below the models' 384), with a config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=380, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS * 10, trainer)
    root = tmp_path_factory.mktemp("tok")
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
         "chat_template": CHAT_TEMPLATE}))
    return root


def with_tokenizer(model_dir, tokenizer_files, dest):
    shutil.copytree(model_dir, dest)
    for f in tokenizer_files.iterdir():
        shutil.copy(f, dest / f.name)
    return dest


def hf_state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def q8_files(tiny_models, tokenizer_files, tmp_path_factory):
    root = tmp_path_factory.mktemp("q8")
    out = {}
    for kind in ("llama", "qwen2", "qwen3", "gemma3"):
        src = with_tokenizer(tiny_models[kind][1], tokenizer_files, root / kind)
        out[kind] = write_gguf(src, root / f"{kind}.Q8_0.gguf", "Q8_0")
    return out


def test_tokenizer_and_metadata_written(q8_files, tokenizer_files, tiny_models):
    from pocketllm.tokenizer import get_tokenizer

    result = q8_files["qwen2"]
    reader = GGUFReader(result.path)
    meta = {k: f.contents() for k, f in reader.fields.items() if k != "tokenizer.ggml.merges"}
    cfg = tiny_models["qwen2"][0].config
    assert meta["general.architecture"] == "qwen2" and meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert meta["general.quantization_version"] == gguf.GGML_QUANT_VERSION
    assert meta["qwen2.block_count"] == cfg.num_hidden_layers
    assert meta["qwen2.embedding_length"] == cfg.hidden_size
    assert meta["qwen2.feed_forward_length"] == cfg.intermediate_size
    assert meta["qwen2.attention.head_count"] == 6 and meta["qwen2.attention.head_count_kv"] == 1
    assert meta["qwen2.context_length"] == 512 and meta["qwen2.rope.freq_base"] == 10000.0
    assert meta["qwen2.vocab_size"] == 384 and len(meta["tokenizer.ggml.tokens"]) == 384
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"
    assert meta["tokenizer.ggml.eos_token_id"] == 2 and meta["tokenizer.ggml.padding_token_id"] == 0
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["tokenizer.chat_template"] == CHAT_TEMPLATE
    assert meta["tokenizer.ggml.token_type"][1] == gguf.TokenType.CONTROL
    assert meta["tokenizer.ggml.token_type"][-1] == gguf.TokenType.UNUSED  # padding up to vocab_size
    assert "output.weight" not in {t.name for t in reader.tensors}  # tied embeddings
    hf, ours = get_tokenizer(tokenizer_files), get_tokenizer(result.path)
    for text in TEXTS + ["<|im_start|>user\nhi there<|im_end|>"]:
        assert ours.encode(text) == hf.encode(text)
    q3 = {k: f.contents() for k, f in GGUFReader(q8_files["qwen3"].path).fields.items() if k.startswith("qwen3.")}
    assert q3["qwen3.attention.key_length"] == 32 and q3["qwen3.attention.value_length"] == 32


def test_file_tensors_are_valid_blocks_of_the_original_weights(q8_files, tiny_models):
    """Every tensor gguf's reader finds decodes (with gguf's decoder) to the original weight, moved as
    llama.cpp's converter moves it (Q/K permutation on llama); the bytes are exactly our quantizer's."""
    for kind, result in q8_files.items():
        model = tiny_models[kind][0]
        state = hf_state(model)
        hp = model.config
        expected = {}
        for hf, value in state.items():
            if hf == "lm_head.weight" and hp.tie_word_embeddings:
                continue
            name = gguf_name(hf, kind)
            if kind == "llama" and ".attn_q." in name:
                value = permute_rows(value, hp.num_attention_heads)
            elif kind == "llama" and ".attn_k." in name:
                value = permute_rows(value, hp.num_key_value_heads)
            elif kind == "gemma3" and name.endswith("norm.weight"):
                value = value + 1  # Gemma's norms are stored as 1 + w
            expected[name] = value
        reader = GGUFReader(result.path)
        names = {t.name for t in reader.tensors}
        assert names - {"rope_freqs.weight"} == set(expected)
        for t in reader.tensors:
            if t.name == "rope_freqs.weight":
                continue
            want = expected[t.name]
            got = dequantize(np.asarray(t.data), t.tensor_type).reshape(want.shape)
            if want.ndim == 1 or t.name.endswith("norm.weight"):
                assert t.tensor_type == T.F32
                np.testing.assert_array_equal(got, want)
            else:
                assert t.tensor_type == T.Q8_0
                assert rel_rmse(got, want) < 0.008, t.name
                np.testing.assert_array_equal(np.asarray(t.data).reshape(want.shape[0], -1), quantize(want, T.Q8_0))


@pytest.mark.parametrize("ftype", ["F32", "F16", "BF16"])
def test_float_file_loads_back_exactly(tiny_models, tmp_path, ftype):
    """The writer is the loader's exact inverse: names, Q/K permutation, rope_freqs, ties; the matrices
    rounded to the file's float type (numpy reads BF16 as bytes), vectors kept in F32."""
    model, src = tiny_models["llama"]
    path = write_gguf(src, tmp_path / f"llama.{ftype}.gguf", ftype).path
    file = GGUFModelFile(path)
    got = {n: t for n, t in file.iter_weights(torch.float32, "cpu")}
    state = model.state_dict()
    assert set(got) == set(state)
    stored = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[ftype]
    for n, t in got.items():
        want = state[n].to(stored if t.dim() > 1 else torch.float32).float()
        assert t.dtype == torch.float32 and torch.equal(t, want), n
    assert file.model_config().rope_scaling["rope_type"] == "freq_factors"


def engine_run(path, prompts, max_tokens, **kw):
    kw = {"exact_kernels": True, **kw}  # compared with transformers
    llm = LLM(str(path), dtype="float32", max_model_len=128, num_kv_blocks=64, **kw)  # a small cache: quick to set up
    with captured_logits(llm) as captured:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], captured[0]


def dequantized_copy(model, path):
    """The transformers model with the weights the GGUF file holds (gguf's decoder, our loader's names)."""
    import copy

    from pocketllm.layers.linear import QuantizedTensor

    twin = copy.deepcopy(model)
    state = twin.state_dict()
    for name, t in GGUFModelFile(path).iter_weights(torch.float32, "cpu"):
        if isinstance(t, QuantizedTensor):
            t = torch.from_numpy(dequantize(t.data.numpy(), t.qtype)).reshape(t.shape)
        state[name].copy_(t)
    return twin


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma3"])
def test_q8_0_file_runs_close_to_transformers(q8_files, tiny_models, kind):
    """Our engine on the Q8_0 file, against transformers on (a) the weights the file holds and (b) the
    original float32 weights.

    (a) agrees to float32 rounding: loading is exact, all the difference is the weights' quantization.
    (b) Measured: last-position logits differ by 1.3-3.1% of their largest magnitude (Q8_0's ~0.5% weight
    error, through 2-3 layers of random weights scaled up to N(0, 0.08)). The tiny random models have
    near-ties (top-2 margins down to 0.01% of the largest logit): where our pick differs from transformers',
    transformers rates it within that error of its own; whole 16-token continuations matched on 3-4 of the
    6 prompts per model."""
    model = tiny_models[kind][0]
    path = q8_files[kind].path
    prompts = prompts_of([1, 5, 17, 33, 48, 70])
    tokens, logits = engine_run(path, prompts, 16)
    twin = dequantized_copy(model, path)
    for prompt, row, toks in zip(prompts, logits, tokens):
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0, -1]
            same_weights = twin(torch.tensor([prompt])).logits[0, -1]
        scale = float(ref.abs().max())
        assert float((row - same_weights).abs().max()) < 1e-5 * scale
        err = float((row - ref).abs().max())
        assert err < 0.05 * scale
        assert toks[0] == int(row.argmax())
        assert float(ref[toks[0]]) >= float(ref.max()) - 2 * err  # a different pick only at a near-tie
    expected = [hf_greedy(model, p, 16) for p in prompts]
    assert sum(t == e for t, e in zip(tokens, expected)) >= 3, (tokens, expected)


# ---- tokenizer formats, against llama.cpp's vocabulary fixtures ---------------------------------------------

def test_pre_tokenizer_name_by_hash():
    """GPT-2's vocabulary (llama.cpp's fixture, as a tokenizer.json) is recognised by the converter's hash of
    its check text."""
    from fixtures import shared_path

    from pocketllm.loaders.gguf_writer import pre_tokenizer_name
    from pocketllm.tokenizer.gguf_vocab import tokenizer_from_gguf

    backend = tokenizer_from_gguf(GGUFReader(shared_path("fixtures/vocab/ggml-vocab-gpt-2.gguf")))._backend
    assert pre_tokenizer_name(json.loads(backend.to_str()), backend) == "gpt-2"


def _split(regex):
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}


@pytest.mark.parametrize("pre, ignore_merges, expected", [
    ({"type": "Sequence", "pretokenizers": [_split(PRE_TOKENIZERS["llama-bpe"].regexes[0]), _BYTE_LEVEL]}, True,
     "llama-bpe"),
    ({"type": "Sequence", "pretokenizers": [_split(PRE_TOKENIZERS["llama-bpe"].regexes[0]), _BYTE_LEVEL]}, False,
     "dbrx"),
    ({"type": "Sequence", "pretokenizers": [_split(PRE_TOKENIZERS["qwen2"].regexes[0]), _BYTE_LEVEL]}, False,
     "qwen2"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                            {**_BYTE_LEVEL, "use_regex": True}]}, False, "starcoder"),  # SmolLM's
    ({**_BYTE_LEVEL, "use_regex": True}, False, "gpt-2"),
    ({"type": "Metaspace", "replacement": "\u2581"}, False, "default"),
], ids=["llama3", "llama3-merges", "qwen2", "smollm", "gpt2", "unknown"])
def test_pre_tokenizer_name_by_regex(pre, ignore_merges, expected):
    """Without a known hash, the name whose regexes (and whole-word rule) equal the tokenizer.json's."""
    from pocketllm.loaders.gguf_writer import pre_tokenizer_name

    found = pre_tokenizer_name({"pre_tokenizer": pre, "model": {"ignore_merges": ignore_merges}}, None)
    assert PRE_TOKENIZERS[found] == PRE_TOKENIZERS[expected]


def _sentencepiece_model(tokens, scores, types) -> bytes:
    """A SentencePiece ModelProto (protobuf) holding the pieces, as tokenizer.model files do."""
    def varint(n):
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)

    def field(num, wire, payload):
        head = varint(num << 3 | wire)
        return head + (varint(len(payload)) + payload if wire == 2 else payload)

    out = bytearray()
    for t, s, k in zip(tokens, scores, types):
        piece = field(1, 2, t.encode()) + field(2, 5, np.float32(s).tobytes()) + field(3, 0, varint(int(k)))
        out += field(1, 2, piece)
    out += field(3, 2, field(3, 0, varint(1)))  # NormalizerSpec.add_dummy_prefix
    return bytes(out)


def test_sentencepiece_vocabulary(tmp_path):
    """tokenizer.model (read without the sentencepiece package) -> the llama-style GGUF vocabulary of
    llama.cpp's own SPM fixture: same tokens, scores and types, so any reader tokenizes alike."""
    from fixtures import shared_path

    from pocketllm.loaders.gguf_writer import add_tokenizer

    fixture = shared_path("fixtures/vocab/ggml-vocab-llama-spm.gguf")
    ref = {k: f.contents() for k, f in GGUFReader(fixture).fields.items() if k.startswith("tokenizer.ggml.")}
    tokens, scores, types = ref["tokenizer.ggml.tokens"], ref["tokenizer.ggml.scores"], ref["tokenizer.ggml.token_type"]
    (tmp_path / "tokenizer.model").write_bytes(_sentencepiece_model(tokens, scores, types))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    w = gguf.GGUFWriter(tmp_path / "vocab.gguf", "llama")
    assert "SentencePiece" in add_tokenizer(w, tmp_path, len(tokens), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    got = {k: f.contents() for k, f in GGUFReader(tmp_path / "vocab.gguf").fields.items()}
    assert got["tokenizer.ggml.model"] == "llama" and got["tokenizer.ggml.tokens"] == tokens
    assert got["tokenizer.ggml.token_type"] == types
    np.testing.assert_array_equal(np.float32(got["tokenizer.ggml.scores"]), np.float32(scores))
    assert got["tokenizer.ggml.bos_token_id"] == 1 and got["tokenizer.ggml.eos_token_id"] == 2
    assert got["tokenizer.ggml.pre"] == "default"


# ---- a model whose rows fit the k-quants, in Q4_K_M --------------------------------------------------------

@pytest.fixture(scope="module")
def k_model(tmp_path_factory):
    """A llama-arch model with 256-multiple rows and 8 layers (so the mixes' layer rules show), no tokenizer."""
    return make_llama256(tmp_path_factory.mktemp("kq"), num_layers=8)


def test_q4_k_m_file_has_the_mix_types(k_model, tmp_path):
    from pocketllm.cli.main import main

    model, src = k_model
    out = tmp_path / "llama256.Q4_K_M.gguf"
    assert main(["quantize", str(src), str(out), "--type", "q4_k_m", "--quiet"]) == 0
    reader = GGUFReader(out)
    types = {t.name: t.tensor_type for t in reader.tensors}
    more = {0, 3, 6, 7}  # use_more_bits(i, 8)
    expected = {"token_embd.weight": T.Q4_K, "output.weight": T.Q6_K, "output_norm.weight": T.F32}
    for i in range(8):
        expected.update({f"blk.{i}.{n}.weight": T.Q4_K for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")})
        expected.update({f"blk.{i}.{n}.weight": T.Q6_K if i in more else T.Q4_K for n in ("attn_v", "ffn_down")})
        expected.update({f"blk.{i}.{n}.weight": T.F32 for n in ("attn_norm", "ffn_norm")})
    assert types == expected
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"  # the stand-in vocabulary
    # every tensor decodes close to its weight
    state = hf_state(model)
    file = GGUFModelFile(out)
    for t in reader.tensors:
        hf = file.hf_name(t.name)
        want = state[hf]
        if t.name.endswith(("attn_q.weight", "attn_k.weight")):
            want = permute_rows(want, 4 if "attn_q" in t.name else 2)
        got = dequantize(np.asarray(t.data), t.tensor_type).reshape(want.shape)
        assert rel_rmse(got, want) < {T.Q4_K: 0.08, T.Q6_K: 0.02, T.F32: 1e-7}[t.tensor_type], t.name
    # and the engine runs it: exactly the weights the file holds (the Q4_K/Q6_K blocks decode as gguf decodes
    # them); against the float32 original, 8 layers of random weights amplify Q4_K's ~7% weight error to
    # 23-30% of the largest logit (measured; llama.cpp itself reads this file within 2-3% of our logits).
    prompts = prompts_of([4, 20])
    _, logits = engine_run(out, prompts, 4)
    twin = dequantized_copy(model, out)
    for prompt, row in zip(prompts, logits):
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0, -1]
            same_weights = twin(torch.tensor([prompt])).logits[0, -1]
        scale = float(ref.abs().max())
        assert float((row - same_weights).abs().max()) < 1e-5 * scale
        assert float((row - ref).abs().max()) < 0.5 * scale


@pytest.mark.parametrize("ftype", ["IQ4_XS", "IQ4_NL"])
def test_iq4_file_round_trip(k_model, tmp_path, ftype):
    """`pocketllm quantize --type IQ4_XS` (IQ4_NL): llama.cpp's mix, every tensor close to its weight, and the
    engine runs exactly the weights the file holds."""
    from pocketllm.cli.main import main

    model, src = k_model
    out = tmp_path / f"llama256.{ftype}.gguf"
    assert main(["quantize", str(src), str(out), "--type", ftype.lower(), "--quiet"]) == 0
    reader = GGUFReader(out)
    types = {t.name: t.tensor_type for t in reader.tensors}
    main_type = T[ftype]
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType[f"MOSTLY_{ftype}"]
    assert types["token_embd.weight"] == main_type and types["output.weight"] == T.Q6_K
    assert types["blk.0.ffn_down.weight"] == T.Q5_K  # the first eighth of the layers, without an imatrix
    assert {types[f"blk.{i}.{n}.weight"] for i in range(1, 8) for n in ("attn_q", "attn_v", "ffn_down")} == {main_type}
    state = hf_state(model)
    file = GGUFModelFile(out)
    for t in reader.tensors:
        want = state[file.hf_name(t.name)]
        if t.name.endswith(("attn_q.weight", "attn_k.weight")):
            want = permute_rows(want, 4 if "attn_q" in t.name else 2)
        got = dequantize(np.asarray(t.data), t.tensor_type).reshape(want.shape)
        assert rel_rmse(got, want) < {main_type: 0.08, T.Q5_K: 0.04, T.Q6_K: 0.02, T.F32: 1e-7}[t.tensor_type], t.name
    prompts = prompts_of([4, 20])
    tokens, logits = engine_run(out, prompts, 4)
    assert [len(t) for t in tokens] == [4, 4]
    twin = dequantized_copy(model, out)
    for prompt, row in zip(prompts, logits):
        with torch.no_grad():
            same_weights = twin(torch.tensor([prompt])).logits[0, -1]
        assert float((row - same_weights).abs().max()) < 1e-5 * float(same_weights.abs().max())


def test_quantize_refuses_types_it_cannot_write(k_model, tmp_path):
    from pocketllm.errors import UnsupportedFeatureError

    with pytest.raises(UnsupportedFeatureError, match="IQ2_XXS.*cannot quantize"):
        write_gguf(k_model[1], tmp_path / "x.gguf", "IQ2_XXS")
    assert not (tmp_path / "x.gguf").exists()


def test_q5_k_m_and_tied_embeddings_mix():
    tensors = _tensor_list(8, 256, 512, 128, 384, tied=True)
    types = mixes.tensor_types(tensors, "Q5_K_M", n_layer=8, n_head=4, n_head_kv=2)
    assert types["token_embd.weight"] == T.Q6_K  # tied: quantized as the output
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(8)] == [
        T.Q6_K if i in (0, 3, 6, 7) else T.Q5_K for i in range(8)]
    assert types["blk.1.ffn_down.weight"] == T.Q5_K and types["blk.7.ffn_down.weight"] == T.Q6_K
    assert types["blk.2.ffn_up.weight"] == T.Q5_K
    ks = mixes.tensor_types(tensors, "Q4_K_S", n_layer=8, n_head=4, n_head_kv=2)
    assert [ks[f"blk.{i}.attn_v.weight"] for i in range(8)] == [T.Q5_K] * 4 + [T.Q4_K] * 4
    assert ks["blk.0.ffn_down.weight"] == T.Q5_K and ks["blk.1.ffn_down.weight"] == T.Q4_K


# ---- Gemma 3 (last: its runtime is new) ----------------------------------------------------------------------

def test_gemma3_file(tiny_models, tmp_path):
    model, src = tiny_models["gemma3"]
    path = write_gguf(src, tmp_path / "gemma3.Q8_0.gguf", "Q8_0").path
    reader = GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("gemma3.")}
    cfg = model.config
    assert meta["gemma3.attention.sliding_window"] == cfg.sliding_window
    assert meta["gemma3.attention.key_length"] == cfg.head_dim
    assert meta["gemma3.rope.freq_base"] == cfg.rope_parameters["full_attention"]["rope_theta"]
    assert meta["gemma3.rope.freq_base_swa"] == cfg.rope_parameters["sliding_attention"]["rope_theta"]
    # this config's layers are not llama.cpp's default (every 6th global): the pattern is spelled out
    assert meta["gemma3.attention.sliding_window_pattern"] == [t == "sliding_attention" for t in cfg.layer_types]
    assert "output.weight" not in {t.name for t in reader.tensors}
    state = hf_state(model)
    file = GGUFModelFile(path)
    for t in reader.tensors:
        hf = file.hf_name(t.name)
        got = dequantize(np.asarray(t.data), t.tensor_type).reshape(state[hf].shape)
        if t.name.endswith("norm.weight"):
            np.testing.assert_allclose(got, state[hf] + 1, rtol=0, atol=1e-6)  # stored as 1 + w
        else:
            assert rel_rmse(got, state[hf]) < 0.008
    loaded = dict(file.iter_weights(torch.float32, "cpu"))
    torch.testing.assert_close(loaded["model.norm.weight"], torch.from_numpy(state["model.norm.weight"]),
                               rtol=0, atol=1e-6)
