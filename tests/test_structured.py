"""Constrained decoding on the default model with the offline engine: every output of a JSON schema,
regex, choice or grammar request must match it, however little sense the tiny model makes."""
from __future__ import annotations

import json
import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from fixtures import default_model_gguf, shared_path
from live_server import in_process

from pocketllm import LLM, RequestError, SamplingParams
from pocketllm.server.api_server import create_app
from pocketllm.server.async_llm import AsyncLLM
from pocketllm.server.config import ServerConfig
from pocketllm.structured.backend import StructuredOutputs, tokenizer_info
from pocketllm.structured.spec import normalize
from pocketllm.tokenizer import get_tokenizer

SUBJECTS = ["a cat", "a city", "a book", "a car", "a chef", "a river", "a robot", "a song", "a tree"]

# Bounded values (short strings, small arrays, number ranges) so every output completes in MAX_TOKENS.
SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
    "nested_address": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 10}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "int_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                  "minItems": 1, "maxItems": 4},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]}},
        "required": ["color", "size"], "additionalProperties": False},
    "bounded_numbers": {"type": "object", "properties": {
        "celsius": {"type": "integer", "minimum": -40, "maximum": 50},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["celsius", "ratio"], "additionalProperties": False},
    "bool_and_null": {"type": "object", "properties": {
        "active": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 8}},
        "required": ["active", "note"], "additionalProperties": False},
    "object_array": {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9}, "tag": {"enum": ["new", "old"]}},
            "required": ["id", "tag"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
    "deep_nesting": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "profile": {"type": "object", "properties": {
            "nick": {"type": "string", "maxLength": 8}, "level": {"type": "integer", "minimum": 1, "maximum": 10}},
            "required": ["nick", "level"], "additionalProperties": False}},
        "required": ["profile"], "additionalProperties": False}}, "required": ["user"], "additionalProperties": False},
    "const_and_pattern": {"type": "object", "properties": {
        "kind": {"const": "event"}, "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["kind", "code"], "additionalProperties": False},
    "optional_fields": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 12}, "pages": {"type": "integer", "minimum": 1, "maximum": 999}},
        "required": ["title"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "enum": ["none", "all"]}]}},
        "required": ["value"], "additionalProperties": False},
    "top_level_enum": {"enum": ["yes", "no", "maybe"]},
}
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def llm():
    # the exact kernels: a preempted request's recomputed KV is then bit-identical to its decoded KV
    return LLM(str(default_model_gguf()), max_model_len=1024, kv_cache_memory=512 << 20, max_num_seqs=128,
               exact_kernels=True)


def chat_prompt(llm, text: str) -> dict:
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template([{"role": "system", "content": "Reply in JSON."},
                                        {"role": "user", "content": text}])
    return {"prompt_token_ids": tok.encode(rendered, add_special_tokens=False)}


def variants(task: str, constraint: dict, count: int, max_tokens: int = MAX_TOKENS):
    """`count` requests: greedy ones on different prompts, then seeded samples, then one request of
    three siblings. Short plain prompts keep the prefill small."""
    prompts, params = [], []
    for i in range(count):
        prompt = f"{task} about {SUBJECTS[i % len(SUBJECTS)]}:\n"
        if i < 3:
            params.append(SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint))
        else:
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                                         structured_outputs=constraint))
        prompts.append(prompt)
    # Three siblings in one request: each walks the grammar with its own matcher.
    prompts.append(prompts[-1])
    params.append(SamplingParams(n=3, temperature=0.8, seed=100, max_tokens=max_tokens,
                                 structured_outputs=constraint))
    return prompts, params


def texts_of(outs):
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", (c.finish_reason, c.text)
            yield c.text


def test_json_schemas_batched(llm, caplog):
    """12 schemas x 11 outputs (13 with the server's), in one batch that mixes them all."""
    prompts, params, owners = [], [], []
    for name, schema in SCHEMAS.items():
        p, sp = variants(f"JSON {name.replace('_', ' ')}", {"json": schema}, 8)
        prompts += p
        params += sp
        owners += [name] * len(p)
    with caplog.at_level(logging.ERROR, logger="pocketllm"):
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert not caplog.records  # no sampled token was ever rejected by its grammar
    counts = dict.fromkeys(SCHEMAS, 0)
    for name, out in zip(owners, outs):
        for text in texts_of([out]):
            jsonschema.validate(json.loads(text), SCHEMAS[name])
            counts[name] += 1
    assert counts == dict.fromkeys(SCHEMAS, 11)
    siblings = [out for out in outs if len(out.outputs) == 3]
    assert any(len({c.text for c in out.outputs}) > 1 for out in siblings)
    llm.engine.check_no_leaks()


REGEXES = [r"\d{3}-\d{4}", r"(yes|no)\.", r"[A-Z][a-z]{1,8} [A-Z][a-z]{1,8}", r"#[0-9a-f]{6}",
           r"\w{1,10}@\w{1,10}\.(com|org)"]
CHOICES = [["red", "green", "blue"], ["Paris", "London", "New York", "東京"],
           ["a\"quote", "back\\slash", "new\nline"]]


def test_regex_choice_grammar_and_json_object(llm):
    cases = []  # (constraint, check)
    for rx in REGEXES:
        cases.append(({"regex": rx}, lambda t, rx=rx: re.fullmatch(rx, t) is not None))
    for choices in CHOICES:
        cases.append(({"choice": choices}, lambda t, c=choices: t in c))
    ebnf = 'root ::= "(" item (", " item)* ")"\nitem ::= [a-z]+ | [0-9]+'
    cases.append(({"grammar": ebnf}, lambda t: re.fullmatch(r"\(([a-z]+|[0-9]+)(, ([a-z]+|[0-9]+))*\)", t)))
    prompts, params, checks = [], [], []
    for constraint, check in cases:
        p, sp = variants("Answer", constraint, 8, max_tokens=48)
        prompts += p
        params += sp
        checks += [check] * len(p)
    # Any object may be long: a few-shot prompt keeps the tiny model's short.
    shots = 'Q: a point\nA: {"x": 1, "y": 2}\nQ: a color\nA: {"name": "red"}\nQ: '
    for i, subject in enumerate(SUBJECTS[:4]):
        prompts.append(f"{shots}{subject}\nA: ")
        params.append(SamplingParams(temperature=0.5 * (i % 2), seed=i, max_tokens=48,
                                     structured_outputs={"json_object": True}))
        checks.append(lambda t: isinstance(json.loads(t), dict))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for check, out, sp in zip(checks, outs, params):
        for c in out.outputs:
            assert c.finish_reason == "stop" and check(c.text), (sp.structured_outputs, c.text)


def test_seeds_stop_strings_and_min_tokens(llm):
    schema = SCHEMAS["person"]
    prompt = chat_prompt(llm, "Describe a person")
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, structured_outputs={"json": schema})
    alone = llm.generate(prompt, seeded)[0].outputs[0]
    # The same seed in a different batch: the mask and the row's own generator give the same tokens.
    mixed = llm.generate([chat_prompt(llm, "Hello"), prompt, prompt],
                         [SamplingParams(max_tokens=5), seeded, SamplingParams(temperature=1.0, seed=8,
                                                                               max_tokens=MAX_TOKENS)])
    assert mixed[1].outputs[0].token_ids == alone.token_ids
    jsonschema.validate(json.loads(alone.text), schema)

    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=['", "'],
                                              structured_outputs={"json": schema}))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == '", "' and cut.text.startswith('{"name": "')
    # min_tokens cannot hold EOS back once the grammar is complete, and ignore_eos cannot run past it:
    # the request ends when its matcher takes the stop token.
    for extra in ({"min_tokens": 40}, {"ignore_eos": True}):
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **extra,
                                                  structured_outputs={"choice": ["yes", "no"]}))[0].outputs[0]
        assert out.finish_reason == "stop" and out.text in ("yes", "no")


def test_prefix_cache_hit_keeps_constraint(llm):
    prompt = chat_prompt(llm, "Describe a person in detail. " * 8)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs={"json": SCHEMAS["enums"]})
    first, second = llm.generate([prompt], params)[0], llm.generate([prompt], params)[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    jsonschema.validate(json.loads(second.outputs[0].text), SCHEMAS["enums"])


def test_preempted_request_keeps_its_matcher(llm, caplog):
    """Preempted mid-output, a request recomputes its KV from prompt and output tokens; the matcher
    must not see those tokens again (it would reject them), and greedy output must not change."""
    from pocketllm.core.scheduler_output import SchedulerOutput

    engine, schema = llm.engine, SCHEMAS["object_array"]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs={"json": schema})
    expected = llm.generate("List the items of a cat:\n", params)[0].outputs[0]
    rid = engine.add_request(None, "List the items of a cat:\n", params)
    req = engine.scheduler.requests[rid]
    outs = []
    with caplog.at_level(logging.ERROR, logger="pocketllm"):
        while engine.has_unfinished_requests():
            outs += engine.step()
            if req.num_output_tokens in (6, 12) and req.status.name == "RUNNING":
                engine.scheduler.running.remove(req)  # as the scheduler preempts its victims
                engine.scheduler._preempt(req, SchedulerOutput())
    assert not caplog.records
    assert req.num_preemptions == 2
    assert outs[-1].outputs[0].token_ids == expected.token_ids and expected.finish_reason == "stop"
    jsonschema.validate(json.loads(outs[-1].outputs[0].text), schema)
    engine.check_no_leaks()


@pytest.mark.parametrize("constraint, words", [
    ({"json": {"type": "objectt"}}, 'invalid JSON schema: Unsupported type "objectt"'),
    ({"json": "{not json"}, "'json' is not valid JSON"),
    ({"regex": "([a-z]"}, "invalid regex"),
    ({"grammar": 'root ::= "a" | b'}, 'invalid grammar: EBNF parser error at line 1, column 16: Rule "b" is not'),
    ({"choice": []}, "'choice' must be a non-empty list of strings"),
    ({"regex": "a", "choice": ["a"]}, "give exactly one of"),
    ({"jsn": {}}, "unknown key(s) ['jsn']"),
])
def test_invalid_constraints_fail_before_queueing(llm, constraint, words):
    with pytest.raises(RequestError) as e:
        llm.generate("Hi", SamplingParams(max_tokens=4, structured_outputs=constraint))
    assert words in str(e.value)
    assert not llm.engine.has_unfinished_requests()


def test_unconstrained_batches_never_touch_grammars(llm, monkeypatch):
    import pocketllm.runner.sampler as sampler

    def fail(*args):
        raise AssertionError("an unconstrained batch built a grammar mask")

    monkeypatch.setattr(sampler, "apply_grammar_masks", fail)
    out = llm.generate(["Hello", "Bye"], SamplingParams(temperature=0, max_tokens=4))
    assert all(o.outputs[0].token_ids for o in out)


def test_compiled_grammars_lru_by_source(llm):
    structured = StructuredOutputs(llm.get_tokenizer(), llm.engine.model_config.vocab_size,
                                   llm.engine.eos_token_ids, cache_size=2)
    a, b, c = (normalize({"regex": rx}) for rx in ("a+", "b+", "c+"))
    first = structured.compile(a)
    assert structured.compile(normalize({"regex": "a+"})) is first  # same (kind, source): cached
    structured.compile(b)
    structured.compile(a)  # a is now the most recent: c evicts b
    structured.compile(c)
    assert structured.compile(a) is first
    assert list(structured._cache) == [("regex", json.dumps(c)), ("regex", json.dumps(a))]
    # A schema's property order is part of its source: it shapes the grammar.
    ab = {"json": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
    ba = {"json": {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}}
    assert structured.compile(normalize(ab)) is not structured.compile(normalize(ba))


def test_compiled_grammars_are_bounded_by_bytes(llm):
    """Our cache holds at most its byte budget (least recent grammars go first; one larger than the
    budget is not kept), and xgrammar's compiler keeps nothing of its own."""
    engine = llm.engine
    regexes = [f"[a-z]{{{n}}}" for n in range(1, 21)]
    one = StructuredOutputs(llm.get_tokenizer(), engine.model_config.vocab_size, engine.eos_token_ids)
    sizes = [one.compile(normalize({"regex": rx})).memory_size_bytes for rx in regexes]
    budget = 3 * max(sizes)
    structured = StructuredOutputs(llm.get_tokenizer(), engine.model_config.vocab_size, engine.eos_token_ids,
                                   cache_bytes=budget)
    for rx in regexes:
        compiled = structured.compile(normalize({"regex": rx}))
        assert structured.cached_bytes == sum(g.memory_size_bytes for g in structured._cache.values()) <= budget
        assert structured.cached(normalize({"regex": rx})) is compiled  # the newest one is always kept
    assert 3 <= len(structured._cache) < len(regexes)
    assert structured._compiler.get_cache_size_bytes() == 0
    huge = StructuredOutputs(llm.get_tokenizer(), engine.model_config.vocab_size, engine.eos_token_ids,
                             cache_bytes=sizes[0] - 1)
    assert huge.compile(normalize({"regex": regexes[0]})) is not None and not huge._cache and huge.cached_bytes == 0


def test_the_engine_thread_never_compiles_the_servers_grammars(llm, monkeypatch):
    """With room for one grammar in the cache, concurrent requests evict each other's grammars
    before the engine adds them: the server hands each request its grammar, so the engine thread
    compiles none (and every output still matches its schema)."""
    engine = llm.engine
    monkeypatch.setattr(engine, "structured", StructuredOutputs(llm.get_tokenizer(), engine.model_config.vocab_size,
                                                                engine.eos_token_ids, cache_size=1))
    threads = []
    compile_ = StructuredOutputs.compile

    def recording(self, spec):
        threads.append(threading.current_thread().name)
        return compile_(self, spec)

    monkeypatch.setattr(StructuredOutputs, "compile", recording)
    schemas = [SCHEMAS[name] for name in ("person", "int_array", "enums", "bounded_numbers")] * 2
    with in_process(create_app(AsyncLLM(llm.engine), ServerConfig(model_name="m"))) as url:
        def ask(i: int) -> httpx.Response:
            return httpx.post(f"{url}/v1/completions", timeout=300, json={
                "model": "m", "prompt": f"Give JSON about {SUBJECTS[i]}:\n", "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "structured_outputs": {"json": schemas[i]}})

        with ThreadPoolExecutor(len(schemas)) as pool:
            replies = list(pool.map(ask, range(len(schemas))))
    for schema, r in zip(schemas, replies):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["text"]), schema)
    assert "pocketllm-engine" not in threads, threads
    assert len(llm.engine.structured._cache) <= 1


def test_tokenizer_info_matches_model_and_vocab_kind(llm):
    import xgrammar as xgr

    engine = llm.engine
    info = tokenizer_info(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    assert info.vocab_size == engine.model_config.vocab_size == 49152
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL
    assert sorted(info.stop_token_ids) == sorted(engine.eos_token_ids)
    assert info.decoded_vocab[engine.tokenizer.encode(" hello", add_special_tokens=False)[0]] == b" hello"
    assert 1 in info.special_token_ids  # <|im_start|>: dropped from decoded text, so never generated

    spm = get_tokenizer(shared_path("fixtures/vocab/ggml-vocab-llama-spm.gguf"))
    info = tokenizer_info(spm, spm.vocab_size, spm.eos_token_ids)
    assert info.vocab_type == xgr.VocabType.BYTE_FALLBACK and info.add_prefix_space
    newline = spm.encode("\n", add_special_tokens=False)[-1]
    assert info.decoded_vocab[newline] == b"\n"
    assert info.decoded_vocab[spm.encode(" hello", add_special_tokens=False)[-1]] == b" hello"


def test_drafts_stop_short_of_the_token_that_ends_the_grammar(llm):
    """A draft that would end the grammar (its stop token) is cut with the drafts after it: the row after
    a draft is sampled under the grammar as the drafts leave it, and an ended grammar allows no token
    (a live server's speculative request with a grammar failed with a 500 that way)."""
    tok = llm.get_tokenizer()
    structured = StructuredOutputs(tok, llm.engine.model_config.vocab_size, llm.engine.eos_token_ids)
    state = structured.new_state(structured.compile(normalize({"regex": "ab"})))
    ids = tok.encode("ab", add_special_tokens=False)
    eos = min(llm.engine.eos_token_ids)
    assert state.valid_prefix(ids + [eos, ids[0]]) == len(ids)  # not the stop token, not what follows
    assert state.valid_prefix(ids) == len(ids) and not state.is_terminated  # the matcher is left as it was
    for t in ids + [eos]:
        state.accept(t)
    assert state.is_terminated and not state.rejected
