"""A sampling fuzzer for constrained outputs: a grammar's tokens drawn at temperature 1.0 from random
logits (what a random-weight model gives), through the engine's own matcher and mask
(pocketllm.structured.backend), on a real vocabulary; every output that stops must parse with strict
`json.loads` and validate with `jsonschema`, every tool call's arguments too.

Random logits walk the corners a trained model rarely reaches (control characters, escapes, surrogate
pairs, empty and maximal strings and arrays). Half the seeds favour the tokens that close a value, so
that unbounded values end too. Used by tests/test_structured_fuzz.py and benchmarks/suites/json_fuzz.py."""
from __future__ import annotations

import functools
import json
import re
from collections import Counter

import jsonschema
import torch

from pocketllm.structured.backend import StructuredOutputs, apply_grammar_masks
from pocketllm.structured.spec import normalize
from pocketllm.structured.tool_parsers import get_tool_parser

_NAME = {"type": "string", "minLength": 1, "maxLength": 12}
# What pydantic (2.x) emits for common models: titles, Field(max_length=...), Optional as anyOf with
# null, enums through $defs, lists with bounds, a default.
PYDANTIC_USER = {
    "$defs": {"Role": {"enum": ["admin", "user", "guest"], "title": "Role", "type": "string"}},
    "properties": {
        "name": {"maxLength": 20, "minLength": 1, "title": "Name", "type": "string"},
        "email": {"anyOf": [{"maxLength": 40, "type": "string"}, {"type": "null"}], "title": "Email"},
        "role": {"$ref": "#/$defs/Role"},
        "tags": {"items": {"maxLength": 8, "type": "string"}, "maxItems": 3, "title": "Tags", "type": "array"},
        "score": {"default": 0.5, "maximum": 1.0, "minimum": 0.0, "title": "Score", "type": "number"}},
    "required": ["name", "email", "role", "tags"], "title": "User", "type": "object",
    "additionalProperties": False}

SCHEMAS = {
    "bounded_strings": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}},
        "required": ["name", "age", "tags"], "additionalProperties": False},
    "exact_lengths": {"type": "object", "properties": {
        "code": {"type": "string", "minLength": 4, "maxLength": 4}, "note": {"type": "string", "minLength": 0,
                                                                              "maxLength": 0}},
        "required": ["code", "note"], "additionalProperties": False},
    "min_length_only": {"type": "string", "minLength": 3},
    "property_names": {"type": "object", "propertyNames": {"maxLength": 4}, "maxProperties": 3,
                       "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}},
    "plain_strings": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
                      "required": ["a", "b"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": _NAME, "langs": {
            "type": "array", "minItems": 1, "maxItems": 2, "items": {"enum": ["en", "fr", "日本語"]}}},
            "required": ["name", "langs"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"v": {"anyOf": [
        {"type": "integer", "minimum": -5, "maximum": 5}, {"type": "string", "maxLength": 3}, {"type": "null"}]}},
        "required": ["v"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "i": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "x": {"type": "number", "minimum": -1.5, "maximum": 2.5}, "n": {"type": "number"}},
        "required": ["i", "x", "n"], "additionalProperties": False},
    "pattern_and_format": {"type": "object", "properties": {
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "day": {"type": "string", "format": "date"},
        "id": {"type": "string", "format": "uuid"}, "code": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}},
        "required": ["zip", "day", "id", "code"], "additionalProperties": False},
    "optional_and_const": {"type": "object", "properties": {
        "kind": {"const": "event"}, "title": {"type": "string", "maxLength": 6}, "n": {"type": "boolean"}},
        "required": ["kind"], "additionalProperties": False},
    "open_object": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["id"]},
    "pydantic_user": PYDANTIC_USER,
}

TOOLS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["C", "F"]}},
    "required": ["city"], "additionalProperties": False}},
    {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "minLength": 1, "maxLength": 24}, "limit": {"type": "integer", "minimum": 1,
                                                                              "maximum": 10}},
        "required": ["query"], "additionalProperties": False}}]
TOOL_SCHEMA = {t["name"]: t["parameters"] for t in TOOLS}

REGEXES = [r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)", r"-?\d{1,4}(\.\d{1,2})?", r"(yes|no|maybe)!?"]


def validator(schema: dict):
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def cases(tool_formats=("hermes", "llama3_json", "mistral")) -> list[tuple[str, dict, object]]:
    """(name, structured_outputs, check): check(text) raises when the text breaks its constraint."""
    out = []
    for name, schema in SCHEMAS.items():
        v = validator(schema)
        out.append((name, {"json": schema}, lambda text, v=v: v.validate(json.loads(text))))
    out.append(("json_object", {"json_object": True}, lambda text: _is_object(json.loads(text))))
    for pattern in REGEXES:
        out.append((f"regex {pattern}", {"regex": pattern}, lambda text, p=pattern: _fullmatch(p, text)))
    for fmt in tool_formats:
        spec = {"tool_calls": {"format": fmt, "tools": TOOLS, "parallel": True}}
        out.append((f"tool_calls {fmt}", spec, lambda text, f=fmt: check_tool_calls(f, text)))
    return out


def _is_object(value) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"not an object: {value!r}")


def _fullmatch(pattern: str, text: str) -> None:
    if not re.fullmatch(pattern, text):
        raise ValueError(f"{text!r} does not match {pattern!r}")


def check_tool_calls(fmt: str, text: str) -> None:
    _, calls = get_tool_parser(fmt).extract(text)
    if not calls:
        raise ValueError(f"no tool call found in {text!r}")
    for call in calls:
        validator(TOOL_SCHEMA[call.name]).validate(json.loads(call.arguments))


@functools.cache
def _closing_bias(tokenizer, vocab: int) -> torch.Tensor:
    """+4 on the tokens whose text closes a value: added on odd seeds, so that unbounded values end too."""
    closing = torch.zeros(vocab)
    for token, i in tokenizer._backend.get_vocab().items():
        if i < vocab and any(c in token for c in '"]}'):
            closing[i] = 4.0
    return closing


def fuzz(structured: StructuredOutputs, tokenizer, spec: dict, check, seeds, max_tokens: int = 96,
         failures: list | None = None) -> Counter:
    """Sample one output per seed; counts of "valid", "invalid" (the failures are appended to
    `failures`) and "unfinished" (max_tokens reached)."""
    compiled = structured.compile(normalize(spec))
    vocab = structured.vocab_size
    closing = _closing_bias(tokenizer, vocab)
    counts = Counter()
    stops = set(structured.stop_token_ids)
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        state = structured.new_state(compiled)
        tokens = []
        while len(tokens) < max_tokens and not state.is_terminated:
            logits = torch.randn(1, vocab, generator=g) * 2.0 + (closing if seed % 2 else 0.0)
            apply_grammar_masks(logits, [0], [state])
            # a sample of softmax(logits) by Gumbel-max (cheaper than torch.multinomial over a vocabulary)
            noise = -torch.log(-torch.log(torch.rand(1, vocab, generator=g).clamp_(1e-20, 1.0)))
            token = int((logits + noise).argmax())
            state.accept(token)
            tokens.append(token)
        if not state.is_terminated:
            counts["unfinished"] += 1
            continue
        text = tokenizer.decode([t for t in tokens if t not in stops], skip_special_tokens=False)
        try:
            check(text)
            counts["valid"] += 1
        except (ValueError, jsonschema.ValidationError) as e:
            counts["invalid"] += 1
            if failures is not None:
                failures.append((spec, seed, text, str(e).splitlines()[0]))
    return counts
