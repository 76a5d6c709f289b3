"""A normalized `structured_outputs` dict -> an xgrammar `Grammar`."""
from __future__ import annotations

import json
import re

import xgrammar as xgr

from pocketllm.structured.spec import kind_of
from pocketllm.structured.tool_parsers import get_tool_parser

# What each kind is called in error messages.
LABELS = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
          "grammar": "grammar", "structural_tag": "structural tag", "tool_calls": "tool parameters schema"}


# xgrammar 0.2.9 compiles a string with minLength / maxLength (and a bounded propertyNames) to
# `"\"" root_..._characters{min, max} "\""` with `root_..._characters ::= [^"\\\r\n]` (xgrammar issue
# #800): raw U+0000-U+001F get in, which RFC 8259 forbids, and no escape can be written. Such a string
# becomes a chain of rules, one per character written so far (S_j: j characters written), each
# character an unescaped code point but the control characters, `"`, `\` and the surrogates (xgrammar
# reads their 3-byte forms, which are no UTF-8, as one character), a short escape, or a
# \uXXXX escape (a surrogate pair counts once; a lone surrogate is not allowed). A chain, not a
# repetition of one rule: xgrammar computes the mask of `(a | b){0, n}` token by token at every step
# (tens of milliseconds and more for a 49k vocabulary) but precomputes each rule of a chain when it
# compiles it.
# Past MAX_CHAIN characters the compile time is not worth it: the bound stays xgrammar's repetition of
# one character class, without the control characters, and such a string has no escapes.
MAX_CHAIN = 128
_BOUNDED_CHAR_RULE = re.compile(r'^(\w+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_BOUNDED_STRING = re.compile(r'"\\"" (\w+)\{(\d+), (-?\d+)\} "\\""')
_UNESCAPED = r'[^\0-\x1f\"\\\uD800-\uDFFF]'
_SHORT_ESCAPE = r'"\\" [\"\\/bfnrt]'
_U_ESCAPE_RULES = r"""
pocketllm_u_escape ::= [0-9a-cA-Ce-fE-F] pocketllm_hex pocketllm_hex pocketllm_hex | [dD] [0-7] pocketllm_hex pocketllm_hex | [dD] [89abAB] pocketllm_hex pocketllm_hex "\\u" [dD] [c-fC-F] pocketllm_hex pocketllm_hex
pocketllm_hex ::= [0-9a-fA-F]
"""  # noqa: E501  (one rule: its alternatives on one line)


def _string_chain(name: str, lo: int, hi: int) -> list[str]:
    """Rules `name_sJ` (J characters written) of a string of lo to hi characters (hi -1: no bound)."""
    def char_then(rest: str) -> str:
        return f'{_UNESCAPED} {rest} | {_SHORT_ESCAPE} {rest} | "\\\\u" pocketllm_u_escape {rest}'

    rules = []
    for j in range(max(lo, hi) + 1):
        here, after = f"{name}_s{j}", f"{name}_s{j + 1}"
        alternatives = ['"\\""'] if j >= lo else []
        if hi < 0 and j == lo:  # no upper bound: from lo characters on, any number more
            alternatives.append(char_then(here))
        elif j < hi or hi < 0:
            alternatives.append(char_then(after))
        rules.append(f"{here} ::= " + " | ".join(alternatives))
    return rules


def json_strings_fixed(grammar: xgr.Grammar) -> xgr.Grammar:
    """`grammar` (from a JSON schema or a structural tag) with its length-bounded strings made of
    JSON characters (see above); the same grammar when it has none."""
    text = str(grammar)
    bounded = set(_BOUNDED_CHAR_RULE.findall(text))
    if not bounded:
        return grammar
    chains = {}

    def chain(m: re.Match) -> str:
        name, lo, hi = m.group(1), int(m.group(2)), int(m.group(3))
        if name not in bounded or max(lo, hi) > MAX_CHAIN:
            return m.group(0)
        key = f"pocketllm_{name}_{lo}_{hi}".replace("-", "m")
        chains.setdefault(key, _string_chain(key, lo, hi))
        return f'"\\"" {key}_s0'

    text = _BOUNDED_STRING.sub(chain, text)
    text = _BOUNDED_CHAR_RULE.sub(lambda m: f"{m.group(1)} ::= (({_UNESCAPED}))", text)
    rules = [rule for rules in chains.values() for rule in rules]
    return xgr.Grammar.from_ebnf(text + "\n" + "\n".join(rules) + _U_ESCAPE_RULES)


# xgrammar's "date" (and the date of "date-time") takes any day 01-31 of any month and the year 0000
# ("2023-11-31", which no date parser reads): days per month, 29 February in leap years only.
_YEAR = r"(\d{3}[1-9]|\d{2}[1-9]0|\d[1-9]00|[1-9]000)"
_LEAP = r"(\d\d(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (rf"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|(0[469]|11)-(0[1-9]|[12]\d|30)|02-(0[1-9]|1\d|2[0-8]))"
         rf"|{_LEAP}-02-29)")
_TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
_DATE_PATTERNS = {"date": f"^{_DATE}$", "date-time": f"^{_DATE}T{_TIME}$"}
_VALUES = frozenset({"const", "enum", "default", "examples"})  # JSON values, not schemas


# xgrammar ignores minLength/maxLength beside a pattern. A pattern that is one character class
# repeated (pydantic's constr(pattern=r"^[a-z]+$", max_length=8)) takes the bounds into its repetition.
_CLASS_RUN = re.compile(r"\^?(\[(?:[^\]\\]|\\.)+\]|\\[dwsDWS])([*+?]|\{(\d+)(,(\d*))?\})?\$?")
_RUNS = {None: (1, 1), "*": (0, None), "+": (1, None), "?": (0, 1)}


def _bounded_pattern(node: dict) -> dict:
    m = _CLASS_RUN.fullmatch(node["pattern"])
    if m is None:
        return node
    if m.group(3) is not None:  # {a}, {a,} or {a,b}
        lo = int(m.group(3))
        hi = lo if m.group(4) is None else int(m.group(5)) if m.group(5) else None
    else:
        lo, hi = _RUNS[m.group(2)]
    lo = max(lo, node.get("minLength", 0))
    his = [h for h in (hi, node.get("maxLength")) if h is not None]
    hi = min(his) if his else None
    if hi is not None and lo > hi:
        return node  # unsatisfiable: left to the compiler
    rest = {k: v for k, v in node.items() if k not in ("minLength", "maxLength")}
    return {**rest, "pattern": f"^{m.group(1)}{{{lo},{'' if hi is None else hi}}}$"}


def _fixed_schema(node):
    """`node` (a schema or part of one) with each `format: date / date-time` string without a pattern
    given the pattern of real dates, and length bounds moved into the patterns they apply to."""
    if isinstance(node, list):
        return [_fixed_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: v if k in _VALUES else _fixed_schema(v) for k, v in node.items()}
    if node.get("format") in _DATE_PATTERNS and "pattern" not in node:
        node["pattern"] = _DATE_PATTERNS[node.pop("format")]
    if isinstance(node.get("pattern"), str) and ("minLength" in node or "maxLength" in node):
        node = _bounded_pattern(node)
    return node


def _fixed_tag(node):
    """A structural tag with `_fixed_schema` applied to each of its schemas."""
    if isinstance(node, list):
        return [_fixed_tag(v) for v in node]
    if not isinstance(node, dict):
        return node
    return {k: _fixed_schema(v) if k == "json_schema" else _fixed_tag(v) for k, v in node.items()}


def _structural_tag(tag: dict) -> xgr.Grammar:
    return xgr.Grammar.from_structural_tag(_fixed_tag(tag))


def _json_schema(schema: dict) -> xgr.Grammar:
    # Compact JSON (", " and ": "), as templates render it: free whitespace lets a model pad forever.
    return xgr.Grammar.from_json_schema(json.dumps(_fixed_schema(schema)), any_whitespace=False, strict_mode=True)


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
        params = _fixed_schema(tool.get("parameters") or {"type": "object", "properties": {}})
        # Structural tags have no compact JSON mode: one whitespace at most between JSON tokens.
        tags.append({"type": "tag", "begin": begin, "end": end,
                     "content": {"type": "json_schema", "json_schema": params, "max_whitespace_cnt": 1,
                                 "style": parser.arguments_style}})
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
             "choice": _choice, "grammar": xgr.Grammar.from_ebnf, "structural_tag": _structural_tag,
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


_FROM_JSON_SCHEMAS = frozenset({"json", "structural_tag", "tool_calls"})  # (json_object bounds nothing)


def build(spec: dict) -> xgr.Grammar:
    kind = kind_of(spec)
    grammar = _BUILDERS[kind](spec[kind])
    if kind in _FROM_JSON_SCHEMAS:
        grammar = json_strings_fixed(grammar)
    if "reasoning" in spec:
        grammar = _after_reasoning(spec["reasoning"], grammar)
    return grammar
