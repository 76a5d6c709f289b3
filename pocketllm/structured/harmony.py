"""gpt-oss's reply format (OpenAI's harmony): a reply is a series of messages,

    [<|start|>assistant][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ [<|constrain|>]TYPE]<|message|>BODY

each ended by <|end|> (another message follows), <|call|> (a tool call: the reply ends) or <|return|>
(the reply ends). The prompt ends with the first message's `<|start|>assistant`. The analysis channel
holds reasoning; final, and commentary without a recipient (a preamble), hold what the user sees;
a message to `functions.NAME` is a call of that tool. <|call|> and <|return|> are stop tokens, so
a finished reply usually lacks them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from pocketllm.structured.streaming import hold_back
from pocketllm.tokenizer.harmony_tokens import CALL, CHANNEL, END, MESSAGE, RETURN, START

_ENDS = (END, CALL, RETURN)
_FUNCTIONS = "functions."
# The header's fields; a recipient may come before the channel or after it.
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"(\w*)")
_HEADER_STARTS = (START, CHANNEL, " to=")


@dataclass
class Reply:
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments so far)


def _first(text: str, markers: tuple[str, ...], pos: int) -> tuple[int, str]:
    """(where, which) of the first of `markers` in text[pos:]; (-1, "") if none."""
    found = [(at, m) for m in markers if (at := text.find(m, pos)) >= 0]
    return min(found) if found else (-1, "")


def parse(text: str, final: bool) -> Reply:
    """A reply's reasoning, content and tool calls. Unfinished (`final=False`), a tail that may be
    markup is held back, so that every part only grows as text comes. Text outside any message
    (a model that writes no markup) is content; a message to another recipient (a built-in tool
    the request cannot have offered) is dropped."""
    reply, reasoning, content = Reply(), [], []
    pos = 0
    while pos < len(text):
        rest = text[pos:]
        if not rest.startswith(_HEADER_STARTS):
            if not final and any(h.startswith(rest) for h in _HEADER_STARTS):
                break  # a header may be on its way
            at, _ = _first(text, (START, CHANNEL), pos)
            body = text[pos:at if at >= 0 else len(text)]
            if at < 0 and not final:
                body = hold_back(body, START, CHANNEL)
            content.append(body)
            if at < 0:
                break
            pos = at
            continue
        head_end = text.find(MESSAGE, pos)
        if head_end < 0:
            break  # an unfinished header: nothing of its message yet
        header = text[pos:head_end]
        channels = _CHANNEL.findall(header)
        recipients = [r for r in _RECIPIENT.findall(header) if r != "assistant"]
        start = head_end + len(MESSAGE)
        at, marker = _first(text, _ENDS, start)
        body = text[start:at if at >= 0 else len(text)]
        if at < 0 and not final:
            body = hold_back(body, *_ENDS)
        if recipients and recipients[-1].startswith(_FUNCTIONS):
            reply.calls.append((recipients[-1][len(_FUNCTIONS):], body.strip()))
        elif not recipients and channels and channels[-1] == "analysis":
            reasoning.append(body)
        elif not recipients:
            content.append(body)
        if at < 0:
            break
        pos = at + len(marker)
    reply.reasoning, reply.content = "\n".join(reasoning), "\n".join(content)
    return reply


def is_harmony_template(template: str) -> bool:
    return CHANNEL in template and f"{START}assistant" in template


def render_call(name: str, arguments: str) -> str:
    """A call as gpt-oss writes it (after the prompt's `<|start|>assistant`)."""
    return f"{CHANNEL}commentary to={_FUNCTIONS}{name} <|constrain|>json{MESSAGE}{arguments}"
