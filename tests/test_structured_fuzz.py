"""Constrained outputs that can be trusted: length-bounded JSON strings hold only JSON characters
(xgrammar 0.2.9 lets raw control characters in and no escape), and a sampling fuzzer over a corpus of
schemas, tool calls, JSON objects and regexes on a byte-level BPE and a SentencePiece byte-fallback
vocabulary finds no invalid output; then the same through the engine with random-weight models."""
from __future__ import annotations

import asyncio
import json

import json_fuzz
import jsonschema
import openai
import pytest
import xgrammar as xgr
from fixtures import default_model_gguf, shared_path
from live_server import Server
from tiny_models import make_tiny_chat_model
from xgrammar.testing import _is_grammar_accept_string as accepts

from pocketllm import LLM, SamplingParams
from pocketllm.structured.backend import StructuredOutputs
from pocketllm.structured.grammars import build
from pocketllm.tokenizer.gguf_vocab import load_gguf_tokenizer

BOUNDED = {"type": "string", "minLength": 1, "maxLength": 3}
# JSON texts of strings, and whether they are 1 to 3 characters long once decoded (lone surrogates,
# which Python decodes but are no characters, are refused)
STRINGS = {'"abc"': True, '"a\\"b"': True, '"a\\nb"': True, '"\\\\"': True, '"a\\/"': True, '"\\u00e9"': True,
           '"é😀x"': True, '"\\ud83d\\ude00"': True, '"\\t\\r\\b"': True,
           '""': False, '"abcd"': False, '"a\nb"': False, '"a\x07b"': False, '"\x00"': False, '"a\\qb"': False,
           '"\\u00e9\\u00e9\\u00e9\\u00e9"': False, '"\\ud83d"': False, '"\\ude00"': False, '"\\u12"': False}


def test_xgrammar_still_lets_raw_control_characters_into_bounded_strings():
    """When this fails, the pinned xgrammar compiles length-bounded strings right (its issue #800):
    drop `json_strings_fixed` (pocketllm/structured/grammars.py) and this test."""
    raw = xgr.Grammar.from_json_schema(json.dumps(BOUNDED), any_whitespace=False, strict_mode=True)
    assert accepts(raw, '"a\x07b"') and not accepts(raw, '"a\\"b"')


@pytest.mark.parametrize("spec, wrap", [
    ({"json": BOUNDED}, "%s"),
    ({"json": {"type": "object", "properties": {"s": BOUNDED}, "required": ["s"], "additionalProperties": False}},
     '{"s": %s}'),
    ({"json": {"type": "object", "propertyNames": BOUNDED, "additionalProperties": {"type": "integer"}}},
     "{%s: 1}"),
    ({"structural_tag": {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<a>", "end": "</a>", "content": {"type": "json_schema", "json_schema": BOUNDED}}}},
     "<a>%s</a>"),
    ({"tool_calls": {"format": "hermes", "tools": [  # the second tool's rules get other names
        {"name": "g", "parameters": {"type": "object", "properties": {"t": {"type": "string", "maxLength": 2}}}},
        {"name": "f", "parameters": {"type": "object", "properties": {"s": BOUNDED}, "required": ["s"]}}]}},
     '<tool_call>\n{"name": "f", "arguments": {"s": %s}}\n</tool_call>'),
], ids=["string", "property", "property_names", "structural_tag", "tool_call"])
def test_bounded_strings_are_made_of_json_characters(spec, wrap):
    grammar = build(spec)
    for text, ok in STRINGS.items():
        assert accepts(grammar, wrap % text) == ok, text


VOCABS = ["gpt2_bpe", "llama_spm"]


def vocab_path(name: str):
    """SmolLM2's byte-level BPE, or Llama's SentencePiece with byte fallback."""
    return default_model_gguf() if name == "gpt2_bpe" else shared_path("fixtures/vocab/ggml-vocab-llama-spm.gguf")


@pytest.fixture(scope="module", params=VOCABS)
def vocab(request):
    """(tokenizer, StructuredOutputs) of a real vocabulary."""
    tok = load_gguf_tokenizer(vocab_path(request.param))
    return tok, StructuredOutputs(tok, tok.vocab_size, {tok.eos_token_id})


def test_a_quote_and_a_newline_go_through_a_bounded_string(vocab):
    """`{"s": "a\\"b\\nc"}` written through the grammar: at each step the allowed token that writes the
    most of what remains (in the bytes xgrammar reads for each token), then a stop token."""
    import torch

    tok, structured = vocab
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}, "required": ["s"]}
    state = structured.new_state(structured.compile({"json": schema}))
    pieces = structured.tokenizer_info().decoded_vocab
    rest = json.dumps({"s": 'a"b\nc'}).encode()
    bitmask = torch.zeros(1, (structured.vocab_size + 31) // 32, dtype=torch.int32)
    while rest:
        state.fill_bitmask(bitmask, 0)
        allowed = [i for i in range(structured.vocab_size) if bitmask[0, i // 32] >> (i % 32) & 1]
        best = max((i for i in allowed if pieces[i] and rest.startswith(pieces[i])), key=lambda i: len(pieces[i]))
        state.accept(best)
        rest = rest[len(pieces[best]):]
    state.accept(tok.eos_token_id)
    assert state.is_terminated and not state.rejected


def test_fuzzer_finds_no_invalid_output(vocab):
    """12 schemas, a JSON object, 3 regexes, 3 tool-call formats: 16 samples each at temperature 1.0."""
    tok, structured = vocab
    failures = []
    for name, spec, check in json_fuzz.cases():
        counts = json_fuzz.fuzz(structured, tok, spec, check, seeds=range(16), failures=failures)
        assert counts["valid"] >= 4, (name, counts)  # enough of them end
    assert not failures, failures[:5]


# The reproduction: strings with maxLength at temperature 1.0 (raw control characters came out).
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
@pytest.fixture(scope="module", params=VOCABS)
def tiny_chat(request, tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp(request.param), vocab_path(request.param))


def test_random_weights_at_temperature_one_give_valid_json(tiny_chat):
    """40 seeds of a random-weight model, each output stops and validates."""
    llm = LLM(str(tiny_chat), max_model_len=1024, kv_cache_memory=64 << 20)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=600, structured_outputs={"json": PERSON})
              for seed in range(40)]
    outs = llm.generate(["Describe a person in JSON:"] * 40, params, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
    llm.engine.check_no_leaks()


def test_length_bounds_beside_a_pattern():
    """xgrammar drops minLength/maxLength beside a pattern; a one-class pattern (what pydantic's
    constr(pattern=..., max_length=...) usually writes) keeps them. Others are left to xgrammar."""
    import warnings

    cases = [({"pattern": "^[a-z]+$", "minLength": 2, "maxLength": 3}, ["ab", "abc"], ["a", "abcd", "ab1"]),
             ({"pattern": r"\d{2,}", "maxLength": 4}, ["12", "1234"], ["1", "12345", "1a"]),
             ({"pattern": "^[A-Z][a-z]*$", "maxLength": 2}, ["Ab", "Abcdef"], ["ab"])]
    # (the last is not one class: its bound is lost, and the case notices when xgrammar keeps it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for schema, good, bad in cases:
            grammar = build({"json": {"type": "string", **schema}})
            for text in good:
                assert accepts(grammar, json.dumps(text)), (schema, text)
            for text in bad:
                assert not accepts(grammar, json.dumps(text)), (schema, text)


LOOKUP = {"name": "lookup", "parameters": {"type": "object", "properties": {
    "query": {"type": "string", "maxLength": 20}, "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["query", "limit"], "additionalProperties": False}}


def test_live_server_streams_valid_json_and_tool_calls_under_speculation(tmp_path_factory):
    """The server with n-gram speculative decoding, a random-weight model at temperature 1.0:
    streamed schema-constrained choices (n=3) and required tool calls (n=2, streamed and not)
    all stop, parse and validate."""
    model = make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    server = Server("--served-model-name", "m", "--tool-call-parser", "hermes", "--speculative-config",
                    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}', model=model,
                    engine_flags=["--max-model-len", "1024", "--kv-cache-memory", str(64 << 20)]).wait_ready()
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=600)
    messages = [{"role": "user", "content": "A person, as JSON: name, age, tags."}]
    tools = [{"type": "function", "function": LOOKUP}]

    async def streamed(seed: int, n: int, **kw) -> list[tuple[str, list, str]]:
        choices: dict[int, list] = {}
        async for chunk in await client.chat.completions.create(
                model="m", messages=messages, n=n, temperature=1.0, seed=seed, max_tokens=600, stream=True, **kw):
            for c in chunk.choices:
                content, calls, finish = choices.setdefault(c.index, ["", [], None])
                choices[c.index][0] += c.delta.content or ""
                for tc in c.delta.tool_calls or []:
                    if tc.id is not None:
                        calls.append([tc.function.name, ""])
                    calls[tc.index][1] += tc.function.arguments or ""
                choices[c.index][2] = c.finish_reason or finish
        return [tuple(choices[i]) for i in sorted(choices)]

    async def main():
        async with client:
            fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
            json_jobs = [streamed(seed, 3, response_format=fmt) for seed in range(4)]
            # One call a choice: with parallel calls a random model may write calls until max_tokens.
            call_jobs = [streamed(100 + seed, 2, tools=tools, tool_choice="required", parallel_tool_calls=False)
                         for seed in range(2)]
            plain = client.chat.completions.create(model="m", messages=messages, n=2, temperature=1.0, seed=200,
                                                   max_tokens=600, tools=tools, tool_choice="required",
                                                   parallel_tool_calls=False)
            return await asyncio.gather(asyncio.gather(*json_jobs), asyncio.gather(*call_jobs), plain)

    try:
        json_streams, call_streams, plain = asyncio.run(main())
        for content, calls, finish in [c for s in json_streams for c in s]:
            assert finish == "stop" and not calls, (finish, content)
            jsonschema.validate(json.loads(content), PERSON)
        calls = [(call, finish) for s in call_streams for _, cs, finish in s for call in cs]
        calls += [([tc.function.name, tc.function.arguments], c.finish_reason) for c in plain.choices
                  for tc in c.message.tool_calls]
        assert len(calls) == 6, calls
        for (name, arguments), finish in calls:
            assert name == "lookup" and finish == "tool_calls", (name, finish, arguments)
            jsonschema.validate(json.loads(arguments), LOOKUP["parameters"])
    finally:
        assert server.stop() == 0


def test_dates_are_real_dates():
    """`format: date` and the date of `date-time`: a day the month has (29 February in leap years),
    a year from 0001, as `datetime` reads them; a `const` object that looks like a schema stays itself."""
    import datetime
    import random

    date = build({"json": {"type": "string", "format": "date"}})
    stamp = build({"json": {"type": "string", "format": "date-time"}})
    rng = random.Random(0)
    for _ in range(400):
        text = f"{rng.randrange(0, 2500):04d}-{rng.randrange(0, 14):02d}-{rng.randrange(0, 33):02d}"
        try:
            datetime.date.fromisoformat(text)
            real = True
        except ValueError:
            real = False
        assert accepts(date, f'"{text}"') == real, text
        assert accepts(stamp, f'"{text}T23:59:59Z"') == real, text
    for text, real in (("2024-02-29", True), ("2000-02-29", True), ("1900-02-29", False), ("2023-11-31", False)):
        assert accepts(date, f'"{text}"') == real, text
    const = build({"json": {"const": {"format": "date"}}})
    assert accepts(const, '{"format":"date"}')  # (xgrammar writes a const compact)
    # a structural tag's schemas too
    day = {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]}
    tag = build({"structural_tag": {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<d>", "end": "</d>", "content": {"type": "json_schema", "json_schema": day}}}})
    assert accepts(tag, '<d>{"day": "2024-02-29"}</d>') and not accepts(tag, '<d>{"day": "2023-02-29"}</d>')
