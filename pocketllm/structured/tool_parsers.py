"""Tool calls in a model's output, per model family, named as vLLM's `--tool-call-parser`:

- hermes (Hermes, Qwen 2.5/3, ChatML models): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
- llama3_json (Llama 3.1+): the reply is `{"name": ..., "parameters": {...}}`, calls joined by "; "
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`
- openai (gpt-oss): a harmony message `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`
- qwen3_coder (Qwen3-Coder, Qwen3.5): `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>...`
- deepseek_v3 (DeepSeek V3, R1, V3.1): `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```...`

With the request's tools given (`for_tools`), calls a model wrote as plain JSON are read in every
family but harmony (`JsonFallback`).

Each parser extracts calls from a finished text (malformed calls leave the whole text as content),
gives a streaming view of an unfinished one, and names the delimiters the forced-call grammar uses.
Arguments keep the JSON text the model wrote, so streamed fragments add up to the final string.
"""
from __future__ import annotations

import ast
import json
import re
import secrets
import string
from dataclasses import dataclass

import jsonschema

from pocketllm.errors import ConfigurationError
from pocketllm.structured import harmony
from pocketllm.structured.streaming import hold_back
from pocketllm.tokenizer import harmony_tokens

_DECODER = json.JSONDecoder()
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_WS = re.compile(r"\s*")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object


def _skip_ws(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()


def _decode(text: str, pos: int):
    """(value, end) of the complete JSON value at text[pos], or None."""
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


def _call_at(text: str, pos: int) -> tuple[ToolCall, int] | None:
    """The complete call object at text[pos] (after whitespace) and where it ends."""
    pos = _skip_ws(text, pos)
    done = _decode(text, pos)
    if done is None or not isinstance(done[0], dict) or not isinstance(done[0].get("name"), str):
        return None
    obj, end = done
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        inner = _decode(args, 0)
        if inner is None or not isinstance(inner[0], dict) or inner[1] != len(args):
            return None
        return ToolCall(obj["name"], args), end
    if not isinstance(args, dict):
        return None
    head = _HEAD.match(text, pos)
    value = _decode(text, head.end()) if head else None
    raw = text[head.end():value[1]] if value else json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], raw), end


def _partial_call(text: str, pos: int) -> tuple[str | None, str]:
    """A call object being written at text[pos]: its name once complete, and its arguments so far
    (only an object's text is streamed: until it closes, everything after its "{" belongs to it)."""
    done = _call_at(text, pos)
    if done is not None:
        return done[0].name, done[0].arguments
    head = _HEAD.match(text, _skip_ws(text, pos))
    name = _decode(head.group(1), 0) if head else None
    if name is None:
        return None, ""
    args = text[head.end():]
    if not args.startswith("{"):
        return name[0], ""
    value = _decode(args, 0)
    return name[0], args[:value[1]] if value else args


_CALL_KEYS = frozenset({"name", "arguments", "parameters", "type", "id"})
_FIRST_KEYS = ("name", "function", "type")  # what a call object opens with, as models write it
_CANDIDATE = re.compile(r"(?:^|(?<=\n))[ \t]*([\[{`])")  # JSON or a fence opening a line
_FENCE = re.compile(r"```[ \t]*(?:json)?[ \t]*\n", re.IGNORECASE)


def _partial_string(text: str, pos: int) -> tuple[str, bool, int] | None:
    """The JSON string starting at text[pos] as written so far: (raw body, closed, end)."""
    if not text.startswith('"', pos):
        return None
    i = pos + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return text[pos + 1:i], True, i + 1
        else:
            i += 1
    return text[pos + 1:], False, len(text)


class JsonFallback:
    """Calls a model wrote as plain JSON instead of its template's syntax (llama-server's generic
    parser reads them the same way): a reply that is, or ends with, call objects
    `{"name": ..., "arguments" | "parameters": {...}}` (or OpenAI's `{"type": "function", "function":
    {...}}`, or a list of them), bare or each in a ```json fence opening a line. Every name must be one
    of the request's tools and its arguments must validate against the tool's parameters; anything
    else, a tool merely named in the text included, stays text."""

    def __init__(self, schemas: dict[str, dict | None]):
        self.schemas = schemas  # each tool's parameters, by name
        self._validators: dict[str, object] = {}

    def _valid(self, name: str, args: dict) -> bool:
        schema = self.schemas[name]
        if not schema:
            return True
        if name not in self._validators:
            try:
                cls = jsonschema.validators.validator_for(schema)
                cls.check_schema(schema)
                self._validators[name] = cls(schema)
            except jsonschema.SchemaError:
                self._validators[name] = None
        validator = self._validators[name]
        return validator is not None and validator.is_valid(args)

    def _call(self, obj) -> ToolCall | None:
        if isinstance(obj, dict) and isinstance(obj.get("function"), dict) and obj.get("type", "function") == "function":
            obj = obj["function"]
        if not isinstance(obj, dict) or set(obj) - _CALL_KEYS or obj.get("name") not in self.schemas:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # arguments written as JSON text
            inner = _decode(args, 0)
            args = inner[0] if inner is not None and inner[1] == len(args) else None
        if not isinstance(args, dict) or not self._valid(obj["name"], args):
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))

    def _calls(self, values: list) -> list[ToolCall] | None:
        calls = [self._call(v) for value in values for v in (value if isinstance(value, list) else [value])]
        return calls if calls and None not in calls else None

    @staticmethod
    def _values(text: str, pos: int) -> tuple[list, int]:
        """The complete JSON values from `pos` on, apart by whitespace, "," or ";", and where they stop."""
        values = []
        while (done := _decode(text, pos := _skip_ws(text, pos))) is not None:
            values.append(done[0])
            pos = _skip_ws(text, done[1])
            if text.startswith((",", ";"), pos):
                pos += 1
        return values, pos

    def _calls_to_end(self, text: str, pos: int) -> list[ToolCall] | None:
        """The calls text[pos:] consists of, or None."""
        calls = []
        while (pos := _skip_ws(text, pos)) < len(text):
            fence = _FENCE.match(text, pos)
            end = text.find("```", fence.end()) if fence else -1
            end = len(text) if end < 0 else end  # (a model may stop before the closing fence)
            start = fence.end() if fence else pos
            if not self._may_open_call(text[:end], start):
                return None
            values, stop = self._values(text[:end], start)
            found = self._calls(values)
            if found is None or stop != end:
                return None
            calls += found
            pos = end + 3 if fence else end
        return calls or None

    def _may_open_call(self, text: str, pos: int) -> bool:
        """Whether the JSON text at text[pos], complete or not, may be a call: its first key and the
        name tell (a cheap look at its head before anything is decoded)."""
        pos = _skip_ws(text, pos)
        if text.startswith("[", pos):
            pos = _skip_ws(text, pos + 1)
        if pos == len(text):
            return True
        if text[pos] != "{":
            return False
        pos = _skip_ws(text, pos + 1)
        if pos == len(text):
            return True
        key = _partial_string(text, pos)
        if key is None:
            return False
        if not key[1]:
            return any(k.startswith(key[0]) for k in _FIRST_KEYS)
        if key[0] != "name":
            return key[0] in _FIRST_KEYS
        pos = _skip_ws(text, key[2])
        if pos < len(text) and text[pos] != ":":
            return False
        pos = _skip_ws(text, pos + 1)
        name = _partial_string(text, pos) if pos < len(text) else ("", False, pos)
        if name is None:
            return False
        return name[0] in self.schemas if name[1] else any(n.startswith(name[0]) for n in self.schemas)

    def _may_become_calls(self, text: str, pos: int) -> bool:
        """Whether text[pos:], still being written, may turn out to be calls to the end."""
        while (pos := _skip_ws(text, pos)) < len(text):
            if text[pos] == "`":
                fence = _FENCE.match(text, pos)
                if fence is None:  # an opening fence being written: ``` and "json" at most
                    head = text[pos:]
                    return "```".startswith(head) or (head.startswith("```") and "\n" not in head
                                                      and "json".startswith(head[3:].strip().lower()))
                end = text.find("```", fence.end())
                body = text[:end] if end >= 0 else text
                if not self._may_open_call(body, fence.end()):
                    return False
                values, stop = self._values(body, fence.end())
                if values and self._calls(values) is None:
                    return False
                if end < 0:  # the body, or its closing fence, is being written
                    return "```".startswith(text[stop:]) or self._may_open_call(text, stop)
                if stop != end:
                    return False
                pos = end + 3
                continue
            if not self._may_open_call(text, pos):
                return False
            values, stop = self._values(text, pos)
            if values and self._calls(values) is None:
                return False
            if stop == len(text) or text.startswith("`", stop) and stop > pos:
                pos = stop
                continue
            return self._may_open_call(text, stop)
        return True

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]] | None:
        """(content, calls) when `text` is or ends with calls, else None."""
        for m in _CANDIDATE.finditer(text):
            calls = self._calls_to_end(text, m.start(1))
            if calls:
                return _content(text[:m.start(1)]), calls
        return None

    def hold(self, text: str, shown: int = 0) -> str:
        """`text` without the tail that may still become calls. `shown`: how much of it was shown
        already; nothing before it can become a call any more (what may not become a call cannot
        later), so the search starts there and a stream costs linear time."""
        for m in _CANDIDATE.finditer(text, shown):
            if self._may_become_calls(text, m.start(1)):
                return text[:m.start(1)]
        return text


class ToolParser:
    name: str
    separator: str  # between calls
    calls_delimiters: tuple[str, str] = ("", "")  # around all the calls
    needs_special_tokens = False  # its markers are special tokens, dropped by default when decoding
    parallel = True  # whether one reply may hold several calls
    arguments_style = "json"  # how the forced-call grammar writes arguments (xgrammar's JSON schema styles)
    json_fallback = True  # whether calls written as plain JSON count (see JsonFallback)
    schemas: dict[str, dict | None] = {}  # the request's tools' parameters, by name (see for_tools)
    fallback: JsonFallback | None = None

    def call_delimiters(self, name: str) -> tuple[str, str]:
        """What comes before and after one call's arguments object."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output; a malformed call leaves all of it as content.
        With the request's tools known, calls written as plain JSON are found too (`JsonFallback`)."""
        content, calls = self._extract(text)
        if not calls and self.fallback is not None and content:
            found = self.fallback.extract(content)
            if found is not None:
                return found
        return content, calls

    def extract_partial(self, text: str, shown: int = 0) -> tuple[str, list[tuple[str | None, str]]]:
        """(content so far, [(name, arguments so far)]) of an unfinished output; both only grow. Text
        that may still become a call written as JSON is held back until it is known (`shown`: how
        much content the caller showed already)."""
        content, calls = self._extract_partial(text)
        if not calls and self.fallback is not None:
            content = self.fallback.hold(content, shown)
        return content, calls

    def for_tools(self, tools: list[dict]) -> ToolParser:
        """This parser, reading calls of the request's `tools` also where they are written as JSON."""
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") for t in tools}
        if self.json_fallback:
            self.fallback = JsonFallback(self.schemas)
        return self

    def _extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def _extract_partial(self, text: str) -> tuple[str, list[tuple[str | None, str]]]:
        raise NotImplementedError

    def render(self, calls: list[ToolCall]) -> str:
        """Calls as the model writes them (for templates that cannot render tool calls)."""
        open_, close = self.calls_delimiters
        parts = [begin + c.arguments + end for c in calls for begin, end in [self.call_delimiters(c.name)]]
        return open_ + self.separator.join(parts) + close

    def new_call_id(self) -> str:
        return "call_" + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(24))

    @staticmethod
    def _calls_in_sequence(text: str, pos: int, sep: str, close: str) -> tuple[list[ToolCall], int] | None:
        """Complete calls separated by `sep`, up to `close` (or the end when `close` is empty)."""
        calls = []
        while True:
            found = _call_at(text, pos)
            if found is None:
                return None
            calls.append(found[0])
            pos = _skip_ws(text, found[1])
            if text.startswith(sep.strip(), pos):
                pos += len(sep.strip())
                continue
            if close:
                if not text.startswith(close, pos):
                    return None
                pos += len(close)
            return calls, pos

    @staticmethod
    def _partial_sequence(text: str, pos: int, sep: str) -> list[tuple[str | None, str]]:
        calls = []
        while True:
            name, args = _partial_call(text, pos)
            if name is None:
                return calls
            calls.append((name, args))
            done = _call_at(text, pos)
            if done is None:
                return calls
            pos = _skip_ws(text, done[1])
            if not text.startswith(sep.strip(), pos):
                return calls
            pos += len(sep.strip())


def _content(text: str) -> str | None:
    return text if text.strip() else None


class HermesToolParser(ToolParser):
    name = "hermes"
    separator = "\n"
    START, END = "<tool_call>", "</tool_call>"

    def call_delimiters(self, name: str) -> tuple[str, str]:
        return f'{self.START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ', f"}}\n{self.END}"

    def _extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        first = text.find(self.START)
        if first < 0:
            return text, []
        calls, pos = [], first
        while pos >= 0:
            found = _call_at(text, pos + len(self.START))
            if found is None:
                return text, []
            end = _skip_ws(text, found[1])
            if text.startswith(self.END, end):
                end += len(self.END)
            elif end != len(text):  # only the last call may miss its end tag (the model stopped)
                return text, []
            calls.append(found[0])
            pos = text.find(self.START, end)
        # As vLLM: the content is what comes before the calls (text between and after them is dropped).
        return _content(text[:first]), calls

    def _extract_partial(self, text: str) -> tuple[str, list[tuple[str | None, str]]]:
        first = text.find(self.START)
        if first < 0:
            return hold_back(text, self.START), []
        calls, pos = [], first
        while text.startswith(self.START, pos):
            body = pos + len(self.START)
            close = text.find(self.END, body)
            name, args = _partial_call(text[:close] if close >= 0 else text, body)
            if name is None or close < 0:
                return text[:first], calls + ([(name, args)] if name is not None else [])
            calls.append((name, args))
            pos = _skip_ws(text, close + len(self.END))
        return text[:first], calls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    separator = "; "
    PYTHON_TAG = "<|python_tag|>"  # a special token: usually dropped from the text already

    def call_delimiters(self, name: str) -> tuple[str, str]:
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": ', "}"

    def _start(self, text: str) -> int | None:
        pos = _skip_ws(text, 0)
        if text.startswith(self.PYTHON_TAG, pos):
            pos = _skip_ws(text, pos + len(self.PYTHON_TAG))
        return pos if text.startswith("{", pos) else None

    def _extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        pos = self._start(text)
        found = None if pos is None else self._calls_in_sequence(text, pos, self.separator, "")
        if found is None or text[found[1]:].strip():
            return text, []
        return None, found[0]

    def _extract_partial(self, text: str) -> tuple[str, list[tuple[str | None, str]]]:
        stripped = text.lstrip()
        if not stripped or self.PYTHON_TAG.startswith(stripped):
            return "", []
        pos = self._start(text)
        if pos is None:
            return text, []
        return "", self._partial_sequence(text, pos, self.separator)


class MistralToolParser(ToolParser):
    name = "mistral"
    separator = ", "
    MARKER = "[TOOL_CALLS]"
    calls_delimiters = (MARKER + "[", "]")
    needs_special_tokens = True

    def call_delimiters(self, name: str) -> tuple[str, str]:
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ', "}"

    def new_call_id(self) -> str:
        # Mistral's templates require ids of exactly nine letters and digits.
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def _extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.MARKER)
        if at < 0:
            return text, []
        pos = _skip_ws(text, at + len(self.MARKER))
        found = self._calls_in_sequence(text, pos + 1, self.separator, "]") if text.startswith("[", pos) else None
        if found is None or text[found[1]:].strip():
            return text, []
        return _content(text[:at]), found[0]

    def _extract_partial(self, text: str) -> tuple[str, list[tuple[str | None, str]]]:
        at = text.find(self.MARKER)
        if at < 0:
            return hold_back(text, self.MARKER), []
        pos = _skip_ws(text, at + len(self.MARKER))
        if not text.startswith("[", pos):
            return text[:at], []
        return text[:at], self._partial_sequence(text, pos + 1, self.separator)


class HarmonyToolParser(ToolParser):
    """gpt-oss: each message to `functions.NAME` is a call; final messages and preambles are the
    content, analysis messages are skipped (the reasoning parser reads them). A call ends the reply
    (<|call|> is a stop token), so there is one at most. Arguments are kept as written, even when
    cut short: harmony has no markup to fall back to as content."""

    name = "openai"
    separator = harmony_tokens.CALL + harmony_tokens.START + "assistant"
    needs_special_tokens = True
    parallel = False
    json_fallback = False  # harmony has no free text in which a call could hide

    def __init__(self, calls: bool = True):
        self.calls = calls  # False: calls are dropped (to tools the request did not offer)

    def call_delimiters(self, name: str) -> tuple[str, str]:
        return harmony.render_call(name, ""), ""

    def _parts(self, text: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
        reply = harmony.parse(text, final)
        return reply.content, reply.calls if self.calls else []

    def _extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = self._parts(text, True)
        return _content(content), [ToolCall(name, args) for name, args in calls]

    def _extract_partial(self, text: str) -> tuple[str, list[tuple[str | None, str]]]:
        return self._parts(text, False)


class Qwen3CoderToolParser(ToolParser):
    """Qwen3-Coder (and Qwen3.5): a call is XML, one element per argument, each value as raw text.

        <tool_call>
        <function=NAME>
        <parameter=KEY>
        VALUE
        </parameter>
        </function>
        </tool_call>

    A value is a string where the tool's schema says so, else JSON where it reads as JSON (numbers,
    booleans, objects, arrays), else a Python literal (the template writes values with Jinja's
    `string`: True, {'a': 1}), else a string. A JSON call object inside <tool_call> is read too."""

    name = "qwen3_coder"
    separator = "\n"
    arguments_style = "qwen_xml"
    START, END, FUNCTION = "<tool_call>", "</tool_call>", "<function="
    _FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
    _PARAM = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
    _FUNCTION_END = re.compile(r"\s*</function>")

    def call_delimiters(self, name: str) -> tuple[str, str]:
        return f"{self.START}\n<function={name}>\n", f"\n</function>\n{self.END}"

    def render(self, calls: list[ToolCall]) -> str:
        def value(v):
            return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        return self.separator.join(
            begin + "\n".join(f"<parameter={k}>\n{value(v)}\n</parameter>" for k, v in json.loads(c.arguments).items())
            + end for c in calls for begin, end in [self.call_delimiters(c.name)])

    def _value(self, function: str, key: str, raw: str):
        prop = ((self.schemas.get(function) or {}).get("properties") or {}).get(key)
        kind = prop.get("type") if isinstance(prop, dict) else None
        if kind == "string" or (isinstance(kind, list) and "string" in kind):
            return raw
        done = _decode(raw, 0)
        if done is not None and done[1] == len(raw):
            return done[0]
        try:  # the template writes values with Jinja's `string`: Python's True, {'a': 1}
            value = ast.literal_eval(raw)
            json.dumps(value, allow_nan=False)  # sets, tuples' keys, NaN: not JSON
            return value
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return raw

    def _call(self, text: str, pos: int) -> tuple[str | None, str, int | None]:
        """The call whose body starts at text[pos]: (name, arguments as JSON text so far, where it
        ends or None while open). Arguments grow a whole parameter at a time."""
        if _skip_ws(text, pos) < len(text) and text[_skip_ws(text, pos)] == "{":  # JSON inside the tags
            found = _call_at(text, pos)
            if found is not None:
                return found[0].name, found[0].arguments, found[1]
            return _partial_call(text, pos) + (None,)
        m = self._FUNCTION.match(text, pos)
        if m is None:
            return None, "", None
        name, pos, pairs = m.group(1).strip(), m.end(), []
        while (p := self._PARAM.match(text, pos)) is not None:
            pairs.append(f"{json.dumps(p.group(1).strip(), ensure_ascii=False)}: "
                         f"{json.dumps(self._value(name, p.group(1).strip(), p.group(2)), ensure_ascii=False)}")
            pos = p.end()
        args = "{" + ", ".join(pairs)
        end = self._FUNCTION_END.match(text, pos)
        return name, args + ("}" if end else ""), end.end() if end else None

    def _next(self, text: str, pos: int) -> int:
        """Where the next call starts: its <tool_call>, which some replies leave out before <function=."""
        found = [i for i in (text.find(self.START, pos), text.find(self.FUNCTION, pos)) if i >= 0]
        return min(found, default=-1)

    def _body(self, text: str, pos: int) -> int:
        pos = _skip_ws(text, pos)
        return pos + len(self.START) if text.startswith(self.START, pos) else pos

    def _extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        first = self._next(text, 0)
        if first < 0:
            return text, []
        calls, pos = [], first
        while pos >= 0:
            name, args, end = self._call(text, self._body(text, pos))
            if name is None or end is None:
                return text, []
            end = _skip_ws(text, end)
            if text.startswith(self.END, end):
                end += len(self.END)
            elif end != len(text):
                return text, []
            calls.append(ToolCall(name, args))
            pos = self._next(text, end)
        return _content(text[:first]), calls

    def _extract_partial(self, text: str) -> tuple[str, list[tuple[str | None, str]]]:
        first = self._next(text, 0)
        if first < 0:
            return hold_back(text, self.START, self.FUNCTION), []
        calls, pos = [], first
        while pos >= 0:
            name, args, end = self._call(text, self._body(text, pos))
            if name is None:
                break
            calls.append((name, args))
            if end is None:
                break
            pos = self._next(text, end)
        return text[:first], calls


class DeepSeekToolParser(ToolParser):
    """DeepSeek V3, R1 and their distills; V3.1's shorter form is read too:

        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>
        \\n<｜tool▁call▁begin｜>...<｜tool▁calls▁end｜>
        V3.1: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>"""

    name = "deepseek_v3"
    separator = "\n"
    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    calls_delimiters = (CALLS_BEGIN, CALLS_END)
    needs_special_tokens = True
    _FENCE_END = re.compile(r"\s*(?:```)?\s*")

    def call_delimiters(self, name: str) -> tuple[str, str]:
        return f"{self.CALL_BEGIN}function{self.SEP}{name}\n```json\n", f"\n```{self.CALL_END}"

    def _head(self, text: str, pos: int) -> tuple[str, int] | None:
        """(name, where its arguments start) of the call at text[pos] (after <｜tool▁call▁begin｜>)."""
        sep = text.find(self.SEP, pos)
        if sep < 0:
            return None
        head, pos = text[pos:sep].strip(), sep + len(self.SEP)
        if head != "function":  # V3.1
            return head, pos
        line = text.find("\n", pos)
        if line < 0:
            return None
        fence = _FENCE.match(text, line + 1)
        return text[pos:line].strip(), fence.end() if fence else line + 1

    def _extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        first = text.find(self.CALLS_BEGIN)
        if first < 0:
            return text, []
        calls, pos = [], _skip_ws(text, first + len(self.CALLS_BEGIN))
        while text.startswith(self.CALL_BEGIN, pos):
            head = self._head(text, pos + len(self.CALL_BEGIN))
            value = _decode(text, _skip_ws(text, head[1])) if head else None
            if value is None or not isinstance(value[0], dict):
                return text, []
            start = _skip_ws(text, head[1])
            calls.append(ToolCall(head[0], text[start:value[1]]))
            pos = self._FENCE_END.match(text, value[1]).end()
            if not text.startswith(self.CALL_END, pos):
                return text, []
            pos = _skip_ws(text, pos + len(self.CALL_END))
        if text.startswith(self.CALLS_END, pos):
            pos += len(self.CALLS_END)
        if not calls or text[pos:].strip():
            return text, []
        return _content(text[:first]), calls

    def _extract_partial(self, text: str) -> tuple[str, list[tuple[str | None, str]]]:
        first = text.find(self.CALLS_BEGIN)
        if first < 0:
            return hold_back(text, self.CALLS_BEGIN), []
        calls, pos = [], _skip_ws(text, first + len(self.CALLS_BEGIN))
        while text.startswith(self.CALL_BEGIN, pos):
            head = self._head(text, pos + len(self.CALL_BEGIN))
            if head is None:
                break
            start = _skip_ws(text, head[1])
            value = _decode(text, start)
            calls.append((head[0], text[start:value[1]] if value else text[start:] if text.startswith("{", start) else ""))
            if value is None:
                break
            pos = self._FENCE_END.match(text, value[1]).end()
            if not text.startswith(self.CALL_END, pos):
                break
            pos = _skip_ws(text, pos + len(self.CALL_END))
        return text[:first], calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesToolParser, Llama3JsonToolParser, MistralToolParser, HarmonyToolParser, Qwen3CoderToolParser,
    DeepSeekToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ConfigurationError(f"unknown tool-call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}") from None


def infer_tool_parser(template: str | None) -> str | None:
    """The family whose call syntax a chat template uses. ChatML templates without tool support
    get Hermes' syntax: it is the ChatML convention (Qwen, Hermes, SmolLM3)."""
    if not template:
        return None
    if harmony.is_harmony_template(template):
        return "openai"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "tool▁calls▁begin" in template:
        return "deepseek_v3"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return "llama3_json"
    if "<|im_start|>" in template:
        return "hermes"
    return None
