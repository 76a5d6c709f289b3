"""Speculative decoding (n-gram prompt lookup) in the one engine: greedy tokens equal to
transformers' and to plain decoding for every family, through chunked prefill, preemption and
asynchronous scheduling; sampled tokens drawn from exactly the target distribution (a chi-square
test against transformers' probabilities); grammars, stops, logprobs, the prefix cache and the
metrics under speculation."""
from __future__ import annotations

import asyncio
import json
import random
import re

import jsonschema
import pytest
import torch
from conftest import prompts_of
from fixtures import default_model_gguf
from reference import hf_greedy
from test_parity import LENGTHS, NEW, run, tight_blocks
from test_quantize import tokenizer_files  # noqa: F401  (a fixture)

from pocketllm import LLM, SamplingParams
from pocketllm.config import EngineArgs, SpeculativeConfig
from pocketllm.errors import ConfigurationError
from pocketllm.speculative.ngram import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def draft_of(path) -> dict:
    return {"model": str(path), "num_speculative_tokens": 3}


# -- configuration ------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, words", [
    ({"model": "/nowhere/draft.gguf", "num_speculative_tokens": 4}, "the draft model '/nowhere/draft.gguf' does not exist"),
    ({"method": "draft_model", "num_speculative_tokens": 4}, 'a draft model needs "model"'),
    ("{not json", "not valid JSON"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram, draft_model"),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown keys ['k']"),
    ({"method": "ngram", "num_speculative_tokens": 2, "row_invariant": 1}, "row_invariant must be true or false"),
])
def test_bad_configs_fail_before_loading(raw, words):
    with pytest.raises(ConfigurationError) as e:
        EngineArgs(model=None, speculative_config=raw)
    assert words in str(e.value)


def test_config_from_the_command_line():
    import argparse

    from pocketllm.cli.args import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, '
                                                    '"prompt_lookup_max": 3}'])
    assert engine_args_from(ns).speculative == SpeculativeConfig("ngram", 4, 3, 3)  # vLLM: one bound sets both
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, '
                                                    '"row_invariant": true}'])
    assert engine_args_from(ns).speculative == SpeculativeConfig("ngram", 2, 5, 5, None, True)


def test_row_invariant_verification_is_refused_off_cuda(tiny_models):
    """A CUDA option (cuBLAS's kernel choice): asked for on the CPU, refused before any weight loads."""
    with pytest.raises(ConfigurationError, match="row_invariant is for CUDA devices"):
        LLM(str(tiny_models["llama"][1]), device="cpu", speculative_config={**NGRAM, "row_invariant": True})


def reference_lookup(tokens, k, lo, hi):
    """A plain-loop n-gram lookup: the longest suffix of length hi..lo found earlier (its latest
    occurrence), and the tokens after it."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_lookup_matches_a_plain_loop():
    """Fresh, and through one sequence's index kept as its tokens grow."""
    rng = random.Random(0)
    proposer = NgramProposer(4, 2, 4)
    found = 0
    for _ in range(100):
        tokens, index = [], proposer.new_index()
        for _ in range(rng.randrange(1, 10)):
            tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
            want = reference_lookup(tokens, 4, 2, 4)
            assert proposer.propose(tokens) == want, tokens
            assert proposer.propose(tokens, limit=1, index=index) == want[:1], tokens
            found += bool(want)
    assert found > 100


def test_draft_length_proposes_drafts_while_they_pay_for_their_rows():
    """Steps timed at 10 ms + 2 ms a row: the fit finds the row's cost in tokens (2 ms at the
    engine's rate), and a request drafts as many as alpha**i stays above it (with the margin)."""
    from types import SimpleNamespace

    from pocketllm.speculative.draft_length import DraftLength

    dl = DraftLength(max_drafts=4, prior_cost=0.3)
    req = SimpleNamespace(draft_hits=0.0, draft_misses=0.0)
    assert dl.cost() == 0.3 and dl.limit(req, dl.cost()) == 4  # before a fit: 0.8**4 = 0.41 > 0.3 * 1.3
    for i in range(40):
        rows = 1 + i % 4
        dl.observe_step(rows, rows, 0.010 + 0.002 * rows)
    rate = sum(1 + i % 4 for i in range(40)) / sum(0.010 + 0.002 * (1 + i % 4) for i in range(40))
    assert dl.cost() == pytest.approx(0.002 * rate, rel=0.05)
    cheap = dl.cost() * DraftLength.MARGIN  # about 0.39 tokens a row
    for hits, misses in ((0, 0), (20, 0), (0, 20)):
        req = SimpleNamespace(draft_hits=float(hits), draft_misses=float(misses))
        alpha = (hits + 1) / (hits + misses + 1.25)
        want = sum(1 for i in range(1, 5) if alpha ** i > cheap)
        assert dl.limit(req, dl.cost()) == want
    counts = ((0., 0.), (20., 0.), (0., 20.))
    assert [dl.limit(SimpleNamespace(draft_hits=h, draft_misses=m), dl.cost()) for h, m in counts] == [3, 4, 0]
    for _ in range(200):  # all steps of one row: the fit has no spread and the prior comes back
        dl.observe_step(1, 1, 0.012)
    assert dl.cost() == 0.3


# -- greedy: the same tokens as transformers, every family ----------------------------------------
def test_greedy_tokens_match_transformers_under_speculation(tiny):
    model, path = tiny
    prompts = prompts_of(LENGTHS)
    expected = [hf_greedy(model, p, NEW) for p in prompts]
    got, _, llm = run(path, prompts, speculative_config=NGRAM)
    assert got == expected
    stats = llm.engine.speculator.stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    # drafts cut by a small token budget, chunked prompts beside them, steps scheduled ahead (a step
    # that looks for drafts reads the one before back first; one that found none lets a few overlap)
    chunked, _, llm = run(path, prompts, speculative_config=NGRAM, max_num_batched_tokens=8, async_scheduling=True)
    assert chunked == expected
    assert llm.engine.speculator.stats.num_accepted_tokens > 0
    tight, outs, llm = run(path, prompts, speculative_config=NGRAM, num_kv_blocks=tight_blocks(path),
                           max_model_len=128)
    assert tight == expected
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the small cache should force preemption"
    fast, _, _ = run(path, prompts, speculative_config=NGRAM, exact_kernels=False, device="cpu")
    assert fast == expected


def test_draft_model_greedy_tokens_match_transformers(tiny):
    """The model as its own draft (each layer's KV under the same block ids, in tensors of the
    draft's): the draft's argmax is the model's, so nearly every draft is kept; the tokens stay
    transformers' through chunked prefill, asynchronous scheduling and preemption (whose freed
    blocks take the draft's KV with them: it catches up again)."""
    model, path = tiny
    prompts = prompts_of(LENGTHS)
    expected = [hf_greedy(model, p, NEW) for p in prompts]
    got, _, llm = run(path, prompts, speculative_config=draft_of(path))
    assert got == expected
    assert llm.engine.speculator.stats.acceptance_rate > 0.9, llm.engine.speculator.stats
    chunked, _, _ = run(path, prompts, speculative_config=draft_of(path), max_num_batched_tokens=8,
                        async_scheduling=True)
    assert chunked == expected
    # eight requests in the smallest cache that holds one whole request: drafting takes blocks
    # ahead of the scheduler, which then admits fewer, so it takes more requests than the plain
    # tests' to make it preempt
    fits = LLM(str(path), dtype="float32", num_kv_blocks=tight_blocks(path), max_model_len=128)
    many = prompts_of([30] * 8, seed=2)
    tight, outs, _ = run(path, many, speculative_config=draft_of(path), max_model_len=128,
                         num_kv_blocks=fits.engine.kv_plan.blocks_per_request(128))
    assert tight == [hf_greedy(model, p, NEW) for p in many]
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the small cache should force preemption"


def test_a_draft_model_catches_up_after_its_drafts_were_dropped(tiny_models):
    """A step that runs without the drafts proposed for it (no room in the budget or the cache)
    whose token is the first draft: the draft model has that token's KV, and still drafts the next."""
    from pocketllm.engine.llm_engine import LLMEngine

    model, path = tiny_models["llama"]
    engine = LLMEngine(EngineArgs(model=str(path), dtype="float32", exact_kernels=True,
                                  speculative_config=draft_of(path)))
    prompt = prompts_of([20], seed=6)[0]
    engine.add_request("a", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()  # the prompt: the first token, and drafts for the next step
    req = engine.scheduler.requests["a"]
    assert req.spec_token_ids
    req.spec_token_ids = []
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].outputs[0].token_ids == hf_greedy(model, prompt, 12)
    assert engine.speculator.stats.num_accepted_tokens > 0
    engine.check_no_leaks()


def test_a_lower_bit_gguf_of_the_model_drafts_for_it(tiny_models, tokenizer_files, tmp_path):
    """The Q8_0 GGUF of the model (its tokenizer written into the file) drafting for the float32
    checkpoint: the same tokens as transformers, most drafts kept."""
    from test_quantize import with_tokenizer

    from pocketllm.loaders.gguf_writer import write_gguf

    model, path = tiny_models["llama"]
    src = with_tokenizer(path, tokenizer_files, tmp_path / "llama")
    draft = write_gguf(src, tmp_path / "llama.Q8_0.gguf", "Q8_0").path
    prompts = prompts_of(LENGTHS)
    got, _, llm = run(src, prompts, speculative_config=draft_of(draft))
    assert got == [hf_greedy(model, p, NEW) for p in prompts]
    assert llm.engine.speculator.stats.acceptance_rate > 0.5, llm.engine.speculator.stats
    # the memory plan counted the draft's weights too (within 10% here: in layers this small, the
    # bytes a layer holds beside its weights weigh more)
    planned, held = llm.engine.planned_weight_bytes, llm.engine.weight_bytes
    assert abs(planned - held) <= 0.1 * held, (planned, held)


def test_a_draft_model_must_share_the_vocabulary(tiny_models, tmp_path):
    import transformers

    _, path = tiny_models["llama"]
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ConfigurationError, match="has a vocabulary of 512 tokens, the model 384"):
        LLM(str(path), dtype="float32", speculative_config=draft_of(tmp_path))


def test_a_draft_model_must_share_the_tokenizer(tiny_models, tokenizer_files, tmp_path):
    """The same number of tokens, two of them swapped: refused, before either model's weights."""
    from test_quantize import with_tokenizer

    _, path = tiny_models["llama"]
    target = with_tokenizer(path, tokenizer_files, tmp_path / "target")
    draft = with_tokenizer(path, tokenizer_files, tmp_path / "draft")
    spec = json.loads((draft / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigurationError, match="has another tokenizer than the model"):
        LLM(str(target), dtype="float32", speculative_config=draft_of(draft))


def test_sampling_processors_see_the_drafts(tiny_models):
    """Penalties, logit bias and min_tokens at a draft's position count the drafts before it,
    as plain decoding counts the tokens it sampled: the same greedy tokens with and without."""
    _, path = tiny_models["llama"]
    prompts = prompts_of([6, 23, 40], seed=3)
    params = [SamplingParams(temperature=0, max_tokens=NEW, repetition_penalty=1.3, presence_penalty=0.4,
                             frequency_penalty=0.3),
              SamplingParams(temperature=0, max_tokens=NEW, logit_bias={7: 3.0, 11: 2.0}),
              SamplingParams(temperature=0, max_tokens=NEW, min_tokens=12, stop_token_ids=[5, 9])]
    outs = {}
    for spec in (None, NGRAM):
        llm = LLM(str(path), dtype="float32", exact_kernels=True, speculative_config=spec)
        outs[spec is None] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params)]
        llm.engine.check_no_leaks()
    assert outs[False] == outs[True]
    assert llm.engine.speculator.stats.num_accepted_tokens > 0


# -- sampling: the target's distribution, exactly -------------------------------------------------
def _small_vocab_model(root):
    import transformers

    config = transformers.LlamaConfig(vocab_size=10, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.4, tie_word_embeddings=False,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(root, safe_serialization=True)
    return model


def _exact_distribution(model, prompt, new, temperature, top_k, repetition_penalty):
    """P(output = sequence) for every sequence of `new` tokens, from transformers' logits with
    its own logits processors (repetition penalty over prompt and output, temperature, top-k)."""
    from transformers import RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper

    procs = [RepetitionPenaltyLogitsProcessor(repetition_penalty), TemperatureLogitsWarper(temperature),
             TopKLogitsWarper(top_k)]
    vocab = model.config.vocab_size
    probs = {(): 1.0}
    for _ in range(new):
        seqs = list(probs)
        ids = torch.tensor([prompt + list(s) for s in seqs])
        with torch.no_grad():
            scores = model(ids).logits[:, -1].float()
        for proc in procs:
            scores = proc(ids, scores)
        p = torch.softmax(scores, -1)
        probs = {s + (t,): probs[s] * float(p[i, t]) for i, s in enumerate(seqs) for t in range(vocab)}
    return probs


def _chi_square_p(counts: dict, expected: dict, n: int) -> float:
    """Pearson's goodness of fit; bins expected fewer than 5 times pooled into one."""
    small = [k for k in expected if expected[k] * n < 5]
    obs = [counts.get(k, 0) for k in expected if k not in small] + [sum(counts.get(k, 0) for k in small)]
    exp = [expected[k] * n for k in expected if k not in small] + [sum(expected[k] for k in small) * n]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return float(torch.special.gammaincc(torch.tensor((len(exp) - 1) / 2), torch.tensor(stat / 2)))


@pytest.mark.parametrize("temperature, top_k, repetition_penalty, method",
                         [(1.0, 0, 1.0, "ngram"), (0.8, 6, 1.4, "ngram"), (1.0, 0, 1.0, "draft_model")])
def test_speculative_sampling_draws_from_the_target_distribution(tmp_path, temperature, top_k, repetition_penalty,
                                                                 method):
    """Thousands of 4-token samples from a 10-token vocabulary, with drafts at every step
    (1-grams always match; the prompt is the model's greedy path, so drafts are often right): the
    output tokens at each position, and the pairs of them, follow transformers' exact
    probabilities; a slightly different distribution is told apart."""
    model = _small_vocab_model(tmp_path)
    prompt = [3, 1, 4] + hf_greedy(model, [3, 1, 4], 10)
    new, n = 4, 6000
    exact = _exact_distribution(model, prompt, new, temperature, top_k or 10, repetition_penalty)
    spec = (draft_of(tmp_path) if method == "draft_model" else  # the model's argmax as its drafts
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    llm = LLM(str(tmp_path), dtype="float32", exact_kernels=True, max_num_seqs=256, seed=11, speculative_config=spec)
    llm.engine.speculator.draft_length.limit = lambda req, cost: 3  # drafts at every step, whatever 256 rows cost here
    params = SamplingParams(temperature=temperature, top_k=top_k, repetition_penalty=repetition_penalty,
                            max_tokens=new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params)
    samples = [tuple(o.outputs[0].token_ids) for o in outs]
    stats = llm.engine.speculator.stats
    assert stats.num_drafts > n and stats.accepted_per_pos[0] > n // 10 and stats.accepted_per_pos[1] > 0, stats

    def marginal(dist_or_samples, positions, weights=None):
        out: dict = {}
        for seq in dist_or_samples:
            key = tuple(seq[i] for i in positions)
            out[key] = out.get(key, 0) + (1 if weights is None else weights[seq])
        return out

    for positions in ((1,), (2,), (3,), (1, 2), (2, 3)):
        p = _chi_square_p(marginal(samples, positions), marginal(exact, positions, exact), n)
        assert p > 1e-3, (positions, p)
    # the test's power: the same samples against the distribution at a 15% higher temperature
    hotter = _exact_distribution(model, prompt, new, temperature * 1.15, top_k or 10, repetition_penalty)
    assert _chi_square_p(marginal(samples, (1, 2)), marginal(hotter, (1, 2), hotter), n) < 1e-3


# -- the default model: a copying workload --------------------------------------------------------
COPY_TASK = ("Repeat the following text exactly, word for word, but write 'Paris' instead of 'Rome':\n\n"
             "Rome is the capital city of Italy. It is also the capital of the Lazio region, the centre of "
             "the Metropolitan City of Rome, and a special comune named Comune di Roma Capitale. With "
             "2,860,009 residents in 1,285 km2, Rome is the country's most populated comune and the third "
             "most populous city in the European Union by population within city limits.")


@pytest.fixture(scope="module")
def default_llms():
    # The three prompts prefill in the first step of both engines: the CPU fast path's bits depend on
    # how a prompt is cut into chunks (its multi-row kernels), and drafts would move the cuts.
    kwargs = dict(max_model_len=1024, kv_cache_memory=256 << 20, max_num_batched_tokens=1024)
    return LLM(str(default_model_gguf()), **kwargs), LLM(str(default_model_gguf()), speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}, **kwargs)


def _copy_prompt(llm):
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": COPY_TASK}])
    return {"prompt_token_ids": tok.encode(text, add_special_tokens=False)}


def test_default_model_copies_with_the_same_tokens_and_logprobs(default_llms):
    """The CPU fast path (8-bit activations, C kernels) is batch-invariant, so a draft's row computes
    the bits a plain decode step would: the same tokens and logprobs, stopped at the same place."""
    plain, spec = default_llms
    prompt = _copy_prompt(plain)
    params = [SamplingParams(temperature=0, max_tokens=96, logprobs=2),
              SamplingParams(temperature=0, max_tokens=37),
              SamplingParams(temperature=0, max_tokens=96, stop=["population"])]
    want = plain.generate([prompt] * 3, params)
    got = spec.generate([prompt] * 3, params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text and g.outputs[0].finish_reason == w.outputs[0].finish_reason
    assert len(got[1].outputs[0].token_ids) == 37
    assert got[2].outputs[0].finish_reason == "stop" and "population" not in got[2].outputs[0].text
    for lw, lg in zip(want[0].outputs[0].logprobs, got[0].outputs[0].logprobs):
        assert lw.keys() == lg.keys()
        assert all(abs(lw[t].logprob - lg[t].logprob) < 1e-5 for t in lw)
    stats = spec.engine.speculator.stats
    assert stats.acceptance_rate > 0.5, stats  # the reply copies its prompt
    spec.engine.check_no_leaks()


def test_prefix_cache_holds_accepted_tokens_only(default_llms):
    """A request whose prompt is an earlier request's prompt and reply hits the blocks that
    speculation wrote; had a rejected draft's KV been registered, its tokens would differ."""
    plain, spec = default_llms
    prompt = _copy_prompt(plain)["prompt_token_ids"]
    first = spec.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=80))[0]
    follow = {"prompt_token_ids": prompt + first.outputs[0].token_ids}
    params = SamplingParams(temperature=0, max_tokens=24)
    got = spec.generate(follow, params)[0]
    assert got.num_cached_tokens >= len(follow["prompt_token_ids"]) - 16
    fresh = LLM(str(default_model_gguf()), max_model_len=1024, kv_cache_memory=64 << 20,
                enable_prefix_caching=False)
    assert got.outputs[0].token_ids == fresh.generate(follow, params)[0].outputs[0].token_ids
    spec.engine.check_no_leaks()


def test_grammars_hold_under_speculation(default_llms, monkeypatch):
    """Drafts a grammar rejects are cut when proposed, each draft row is masked by the grammar
    after the drafts before it, and the matcher takes only accepted tokens: valid outputs, the
    same as without speculation."""
    plain, spec = default_llms
    # Six rows of the default model can cost more than drafts would win on a slower CPU, and the
    # draft-length rule then proposes none (it times the steps): here every found draft is proposed.
    monkeypatch.setattr(spec.engine.speculator.draft_length, "limit", lambda req, cost: 4)
    tok = plain.get_tokenizer()
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "people": {"type": "array", "maxItems": 4,
                                                          "items": {"type": "integer", "minimum": 0, "maximum": 9999999}}},
              "required": ["city", "people"], "additionalProperties": False}
    cases = [({"json": schema}, lambda t: jsonschema.validate(json.loads(t), schema) is None),
             ({"regex": r"(Rome|Paris) is the capital of [A-Z][a-z]+\."},
              lambda t: re.fullmatch(r"(Rome|Paris) is the capital of [A-Z][a-z]+\.", t)),
             ({"choice": ["Rome is the capital city of Italy", "Paris is the capital city of Italy"]},
              lambda t: t.endswith("capital city of Italy"))]
    prompts, params, checks = [], [], []
    for constraint, check in cases:
        for extra in ("", " Reply in JSON with the city and its residents."):
            text = tok.apply_chat_template([{"role": "user", "content": COPY_TASK + extra}])
            prompts.append({"prompt_token_ids": tok.encode(text, add_special_tokens=False)})
            params.append(SamplingParams(temperature=0, max_tokens=64, structured_outputs=constraint))
            checks.append(check)
    want = plain.generate(prompts, params)
    before = spec.engine.speculator.stats.num_draft_tokens
    got = spec.generate(prompts, params)
    assert spec.engine.speculator.stats.num_draft_tokens > before
    for w, g, check in zip(want, got, checks):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == "stop" and check(g.outputs[0].text), g.outputs[0].text
    spec.engine.check_no_leaks()


# -- metrics ---------------------------------------------------------------------------------------
def test_metrics_count_drafts_and_acceptance(tiny_models):
    from test_metrics import MODEL, Metrics

    from pocketllm.engine.llm_engine import LLMEngine
    from pocketllm.server.async_llm import AsyncLLM
    from pocketllm.server.metrics import ServerMetrics

    _, path = tiny_models["llama"]
    engine = LLMEngine(EngineArgs(model=str(path), dtype="float32", speculative_config=NGRAM))
    prompts = prompts_of([5, 30], seed=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def main():
        llm = AsyncLLM(engine)
        metrics = ServerMetrics(llm, MODEL)
        for i, p in enumerate(prompts):
            async for _ in llm.generate({"prompt_token_ids": p}, params, f"r{i}"):
                pass
        await llm.shutdown()
        return Metrics(metrics.render().decode())

    m = asyncio.run(main())
    engine.check_no_leaks()
    s = engine.speculator.stats
    assert s.num_accepted_tokens > 0
    assert m("spec_decode_num_drafts_total", model_name=MODEL) == s.num_drafts
    assert m("spec_decode_num_draft_tokens_total", model_name=MODEL) == s.num_draft_tokens
    assert m("spec_decode_num_accepted_tokens_total", model_name=MODEL) == s.num_accepted_tokens
    per_pos = [m("spec_decode_num_accepted_tokens_per_pos_total", model_name=MODEL, position=str(i)) for i in range(3)]
    # a draft is accepted only after the ones before it
    assert sum(per_pos) == s.num_accepted_tokens and per_pos == sorted(per_pos, reverse=True)
    assert s.num_drafts <= s.num_draft_tokens <= 3 * s.num_drafts
