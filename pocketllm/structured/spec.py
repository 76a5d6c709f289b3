"""The `structured_outputs` dict of `SamplingParams`, checked before any grammar is built.

Users name one constraint, as vLLM does: `json` (a JSON schema), `json_object`, `regex`, `choice`
(a list of strings), `grammar` (EBNF) or `structural_tag` (xgrammar's format). The server may
also set `tool_calls` (forced calls in a model family's syntax) and `reasoning` (free text up to
the end of the reasoning block comes before the constraint).
"""
from __future__ import annotations

import json

from pocketllm.errors import RequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag", "tool_calls")


def _bad(msg: str) -> RequestError:
    err = RequestError(f"structured_outputs: {msg}")
    err.param = "structured_outputs"
    return err


def _json_value(kind: str, value):
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _bad(f"'{kind}' is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise _bad(f"'{kind}' must be a JSON object")
    return value


def _check(kind: str, value):
    if kind in ("json", "structural_tag"):
        return _json_value(kind, value)
    if kind == "json_object":
        if value is not True:
            raise _bad("'json_object' must be true")
        return True
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise _bad(f"'{kind}' must be a non-empty string")
        return value
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise _bad("'choice' must be a non-empty list of strings")
        return list(value)
    if not (isinstance(value, dict) and isinstance(value.get("tools"), list) and value["tools"]):
        raise _bad("'tool_calls' must be {'format', 'tools': [...], 'parallel'}")
    return value


def normalize(spec: dict) -> dict:
    """`spec` with its one constraint checked (JSON given as text parsed) and null keys dropped."""
    if not isinstance(spec, dict):
        raise _bad(f"expected an object, got {type(spec).__name__}")
    spec = {k: v for k, v in spec.items() if v is not None}
    unknown = sorted(set(spec) - set(KINDS) - {"reasoning"})
    if unknown:
        raise _bad(f"unknown key(s) {unknown}; expected one of {list(KINDS)}")
    kinds = [k for k in KINDS if k in spec]
    if len(kinds) != 1:
        raise _bad(f"give exactly one of {list(KINDS)}, got {kinds or 'none'}")
    out = {kinds[0]: _check(kinds[0], spec[kinds[0]])}
    reasoning = spec.get("reasoning")
    if reasoning is not None:
        if not (isinstance(reasoning, dict) and {"start", "end", "open"} <= set(reasoning)):
            raise _bad("'reasoning' must be {'start', 'end', 'open'}")
        out["reasoning"] = reasoning
    return out


def kind_of(spec: dict) -> str:
    return next(k for k in KINDS if k in spec)


def cache_key(spec: dict) -> tuple[str, str]:
    """(kind, source). Key order is kept: a schema's property order shapes its grammar."""
    return kind_of(spec), json.dumps(spec, ensure_ascii=False)
