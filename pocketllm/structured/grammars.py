"""A normalized `structured_outputs` dict -> an xgrammar `Grammar`."""
from __future__ import annotations

import json

import xgrammar as xgr

from pocketllm.structured.spec import kind_of
from pocketllm.structured.tool_parsers import get_tool_parser

# What each kind is called in error messages.
LABELS = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
          "grammar": "grammar", "structural_tag": "structural tag", "tool_calls": "tool parameters schema"}


def _json_schema(schema: dict) -> xgr.Grammar:
    # Compact JSON (", " and ": "), as templates render it: free whitespace lets a model pad forever.
    return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)


def _json_object(_) -> xgr.Grammar:
    return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)


def _choice(choices: list[str]) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))


def _tool_calls(value: dict) -> xgr.Grammar:
    """One call (or one or more when parallel) of the given tools, in the family's call syntax."""
    parser = get_tool_parser(value["format"])
    tags = []
    for tool in value["tools"]:
        begin, end = parser.call_delimiters(tool["name"])
        params = tool.get("parameters") or {"type": "object", "properties": {}}
        # Structural tags have no compact JSON mode: one whitespace at most between JSON tokens.
        tags.append({"type": "tag", "begin": begin, "end": end,
                     "content": {"type": "json_schema", "json_schema": params, "max_whitespace_cnt": 1}})
    calls = {"type": "tags_with_separator", "tags": tags, "separator": parser.separator,
             "at_least_one": True, "stop_after_first": not (value.get("parallel", True) and parser.parallel)}
    open_, close = parser.calls_delimiters
    elements = [calls]
    if open_:
        elements.insert(0, {"type": "const_string", "value": open_})
    if close:
        elements.append({"type": "const_string", "value": close})
    return xgr.Grammar.from_structural_tag({"type": "structural_tag",
                                            "format": {"type": "sequence", "elements": elements}})


_BUILDERS = {"json": _json_schema, "json_object": _json_object, "regex": xgr.Grammar.from_regex,
             "choice": _choice, "grammar": xgr.Grammar.from_ebnf, "structural_tag": xgr.Grammar.from_structural_tag,
             "tool_calls": _tool_calls}


def _after_reasoning(reasoning: dict, grammar: xgr.Grammar) -> xgr.Grammar:
    """Free text up to the reasoning end tag, then `grammar`. When the prompt did not open the
    block, the block is optional and starts with its start tag. Between them: `then` when given
    (harmony's answer header), else a little whitespace."""
    block = {"type": "tag", "begin": "" if reasoning["open"] else reasoning["start"],
             "content": {"type": "any_text"}, "end": reasoning["end"]}
    if not reasoning["open"]:
        block = {"type": "optional", "content": block}
    prefix = xgr.Grammar.from_structural_tag({"type": "structural_tag", "format": block})
    then = reasoning.get("then")
    if then == "":
        return xgr.Grammar.concat(prefix, grammar)
    gap = xgr.Grammar.from_regex(r"\s{0,4}") if then is None else xgr.Grammar.from_ebnf(f"root ::= {json.dumps(then)}")
    return xgr.Grammar.concat(prefix, gap, grammar)


def build(spec: dict) -> xgr.Grammar:
    kind = kind_of(spec)
    grammar = _BUILDERS[kind](spec[kind])
    if "reasoning" in spec:
        grammar = _after_reasoning(spec["reasoning"], grammar)
    return grammar
