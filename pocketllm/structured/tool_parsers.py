"""Tool calls in a model's output, per model family, named as vLLM's `--tool-call-parser`:

- hermes (Hermes, Qwen 2.5/3, ChatML models): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
- llama3_json (Llama 3.1+): the reply is `{"name": ..., "parameters": {...}}`, calls joined by "; "
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`
- openai (gpt-oss): a harmony message `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`

Each parser extracts calls from a finished text (malformed calls leave the whole text as content),
gives a streaming view of an unfinished one, and names the delimiters the forced-call grammar uses.
Arguments keep the JSON text the model wrote, so streamed fragments add up to the final string.
"""
from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass

from pocketllm.errors import ConfigurationError
from pocketllm.structured import harmony
from pocketllm.structured.streaming import hold_back

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


class ToolParser:
    name: str
    separator: str  # between calls
    calls_delimiters: tuple[str, str] = ("", "")  # around all the calls
    needs_special_tokens = False  # its markers are special tokens, dropped by default when decoding
    parallel = True  # whether one reply may hold several calls

    def call_delimiters(self, name: str) -> tuple[str, str]:
        """What comes before and after one call's arguments object."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output; a malformed call leaves all of it as content."""
        raise NotImplementedError

    def extract_partial(self, text: str) -> tuple[str, list[tuple[str | None, str]]]:
        """(content so far, [(name, arguments so far)]) of an unfinished output; both only grow."""
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

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
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

    def extract_partial(self, text: str) -> tuple[str, list[tuple[str | None, str]]]:
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

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        pos = self._start(text)
        found = None if pos is None else self._calls_in_sequence(text, pos, self.separator, "")
        if found is None or text[found[1]:].strip():
            return text, []
        return None, found[0]

    def extract_partial(self, text: str) -> tuple[str, list[tuple[str | None, str]]]:
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

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.MARKER)
        if at < 0:
            return text, []
        pos = _skip_ws(text, at + len(self.MARKER))
        found = self._calls_in_sequence(text, pos + 1, self.separator, "]") if text.startswith("[", pos) else None
        if found is None or text[found[1]:].strip():
            return text, []
        return _content(text[:at]), found[0]

    def extract_partial(self, text: str) -> tuple[str, list[tuple[str | None, str]]]:
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
    separator = harmony.CALL + harmony.START + "assistant"
    needs_special_tokens = True
    parallel = False

    def __init__(self, calls: bool = True):
        self.calls = calls  # False: calls are dropped (to tools the request did not offer)

    def call_delimiters(self, name: str) -> tuple[str, str]:
        return harmony.render_call(name, ""), ""

    def _parts(self, text: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
        reply = harmony.parse(text, final)
        return reply.content, reply.calls if self.calls else []

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = self._parts(text, True)
        return _content(content), [ToolCall(name, args) for name, args in calls]

    def extract_partial(self, text: str) -> tuple[str, list[tuple[str | None, str]]]:
        return self._parts(text, False)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, HarmonyToolParser)}


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
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return "llama3_json"
    if "<|im_start|>" in template:
        return "hermes"
    return None
