"""Tools and reasoning around a chat request: the messages a template gets, the constraint that
forces tool calls, and a reply split into reasoning, content and tool calls, whole or as deltas."""
from __future__ import annotations

import json
import re

from pocketllm.structured import harmony
from pocketllm.structured.reasoning import ReasoningParser
from pocketllm.structured.tool_parsers import ToolCall, ToolParser
from pocketllm.tokenizer.chat_template import REASONING_FIELDS

_TOOLS_PROMPT = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                 "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
                 "</tools>\n\nFor each function call, return a json object with function name and arguments:\n"
                 "{example}")


def _arguments_text(call: dict) -> str:
    args = call["function"]["arguments"]
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _arguments_value(call: dict) -> dict:
    # Templates write arguments with `tojson`: they expect the object, not OpenAI's JSON text.
    try:
        args = json.loads(call["function"]["arguments"])
    except (TypeError, ValueError):
        return call
    return {**call, "function": {**call["function"], "arguments": args}}


def template_messages(messages: list[dict], tools: list[dict] | None, template: str,
                      parser: ToolParser) -> list[dict]:
    """Messages ready for `template`. Templates that know tool calls get the arguments as objects;
    for the others, calls are written in `parser`'s syntax, tool results as `<tool_response>`
    user turns, and the tool list goes in the system message, as Qwen's templates do it."""
    native = "tool_calls" in template
    harmony_template = harmony.is_harmony_template(template)
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            if native:
                m = {**m, "tool_calls": [_arguments_value(c) for c in m["tool_calls"]]}
                if harmony_template and any(m.get(k) for k in REASONING_FIELDS):
                    # gpt-oss's template refuses a call with both a preamble and reasoning: the
                    # reasoning wins, as in llama.cpp
                    m = {k: v for k, v in m.items() if k != "content"}
            else:
                calls = parser.render([ToolCall(c["function"]["name"], _arguments_text(c)) for c in m["tool_calls"]])
                m = {"role": "assistant", "content": "\n".join(filter(None, [m.get("content"), calls]))}
        elif m.get("role") == "tool" and not native:
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if tools and not re.search(r"\btools\b", template):
        prompt = _TOOLS_PROMPT.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools),
            example=parser.render([ToolCall("<function-name>", "<args-json-object>")]))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def template_tools(tools: list[dict] | None, template: str) -> list[dict] | None:
    """The tools as `template` takes them: gpt-oss's writes each tool's description, which requests
    may leave out (an empty one is given)."""
    if not tools or not harmony.is_harmony_template(template):
        return tools
    return [{**t, "function": {"description": "", **t["function"]}} for t in tools]


def tool_constraint(tools: list[dict], tool_choice, parallel: bool, parser: ToolParser) -> dict | None:
    """`structured_outputs` forcing calls: any of the tools for "required", the named one otherwise."""
    functions = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        functions = [f for f in functions if f["name"] == tool_choice["function"]["name"]]
        parallel = False
    elif tool_choice != "required":
        return None
    return {"tool_calls": {"format": parser.name, "parallel": parallel,
                           "tools": [{"name": f["name"], "parameters": f.get("parameters")} for f in functions]}}


class ReplyParser:
    """One choice's text -> reasoning, content and tool calls; for streams, what is new since the
    last call. Either parser may be None."""

    def __init__(self, reasoning: ReasoningParser | None, opened: bool | None, tools: ToolParser | None):
        if tools is None and reasoning is not None:
            tools = reasoning.content_parser()
        self.reasoning, self.opened, self.tools = reasoning, opened, tools
        self._sent_reasoning = self._sent_content = 0
        self._calls: list[list] = []  # [id, length of the arguments sent] per streamed call

    @property
    def called(self) -> bool:
        return bool(self._calls)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        return self.reasoning.split(text, self.opened, final) if self.reasoning else ("", text)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole reply as a chat message, and its finish reason ("tool_calls" when it called)."""
        reasoning, content = self._split(text, True)
        calls = []
        if self.tools is not None:
            content, calls = self.tools.extract(content)
        msg = {"role": "assistant", "content": content or None, "refusal": None}
        if self.reasoning is not None:
            msg["reasoning_content"] = reasoning or None
        if calls:
            msg["tool_calls"] = [{"id": self.tools.new_call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return msg, finish_reason

    def deltas(self, text: str, final: bool) -> list[dict]:
        """Stream deltas for the text so far: reasoning, content, then each call's name first and
        its argument fragments after."""
        reasoning, content = self._split(text, final)
        calls: list[tuple[str | None, str]] = []
        if self.tools is not None:
            if final and not self._calls:  # nothing streamed as a call yet: the whole-text rules apply
                content, done = self.tools.extract(content)
                content, calls = content or "", [(c.name, c.arguments) for c in done]
            else:
                content, calls = self.tools.extract_partial(content, self._sent_content)
        out = []
        if len(reasoning) > self._sent_reasoning:
            out.append({"reasoning_content": reasoning[self._sent_reasoning:]})
            self._sent_reasoning = len(reasoning)
        if len(content) > self._sent_content:
            out.append({"content": content[self._sent_content:]})
            self._sent_content = len(content)
        for i, (name, args) in enumerate(calls):
            if i == len(self._calls):
                self._calls.append([self.tools.new_call_id(), 0])
                out.append({"tool_calls": [{"index": i, "id": self._calls[i][0], "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
            if len(args) > self._calls[i][1]:
                out.append({"tool_calls": [{"index": i, "function": {"arguments": args[self._calls[i][1]:]}}]})
                self._calls[i][1] = len(args)
        return out
