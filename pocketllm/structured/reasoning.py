"""Reasoning in a model's output, named as vLLM's `--reasoning-parser`: qwen3 and deepseek_r1 both
write it as `<think>…</think>` before the answer; openai_gptoss (gpt-oss) as harmony analysis messages."""
from __future__ import annotations

from collections.abc import Callable

from pocketllm.errors import ConfigurationError
from pocketllm.structured import harmony
from pocketllm.structured.streaming import hold_back
from pocketllm.structured.tool_parsers import HarmonyToolParser, ToolParser
from pocketllm.tokenizer import harmony_tokens


class ReasoningParser:
    start, end = "<think>", "</think>"
    needs_special_tokens = False  # its markers are special tokens, dropped by default when decoding

    def __init__(self, name: str, implicit_start: bool):
        self.name = name
        # DeepSeek-R1 may reason without writing the start tag: its output is reasoning until the end tag.
        self.implicit_start = implicit_start

    def prompt_state(self, prompt: str) -> bool | None:
        """True: the prompt opened the block, so the output starts inside it; False: the prompt
        closed it (reasoning turned off); None: the model decides."""
        start, end = prompt.rfind(self.start), prompt.rfind(self.end)
        if start > end:
            return True
        if end >= 0 and prompt.rstrip().endswith(self.end):
            return False
        return None

    def content_parser(self) -> ToolParser | None:
        """What reads the content out of the rest of the reply when the request has no tools."""
        return None

    def grammar_prefix(self, opened: bool | None, calls: bool = False) -> dict | None:
        """The `reasoning` entry of `structured_outputs`: the constraint (forced tool `calls` or
        another) applies after the block."""
        if opened is False:
            return None
        return {"start": self.start, "end": self.end, "open": bool(opened)}

    def split(self, text: str, opened: bool | None, final: bool = True) -> tuple[str, str]:
        """(reasoning, content). Unfinished (`final=False`), a tail that may be a tag is held back,
        so that both parts only grow as text comes."""
        if opened is False:
            return "", text
        lead = text.lstrip()
        if lead.startswith(self.start):
            in_block, body = True, lead[len(self.start):]
        elif not final and not opened and self.start.startswith(lead):
            return "", ""  # the start tag may be on its way
        else:
            in_block, body = bool(opened) or self.implicit_start, text
        if not in_block:
            return "", text
        at = body.find(self.end)
        if at < 0:
            return (body if final else hold_back(body, self.end)), ""
        return body[:at], body[at + len(self.end):].lstrip()


class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss: reasoning is the analysis messages; the rest of the reply stays in harmony."""

    needs_special_tokens = True

    def __init__(self):
        super().__init__("openai_gptoss", False)

    def prompt_state(self, prompt: str) -> bool | None:
        return None  # each reply may or may not start with an analysis message

    def content_parser(self) -> ToolParser:
        return HarmonyToolParser(calls=False)

    def grammar_prefix(self, opened: bool | None, calls: bool = False) -> dict:
        # One analysis message may come first; then the answer's header, unless the constraint is
        # forced calls, whose grammar writes their own headers.
        h = harmony_tokens
        return {"start": f"{h.CHANNEL}analysis{h.MESSAGE}", "end": f"{h.END}{h.START}assistant",
                "open": False, "then": "" if calls else f"{harmony_tokens.CHANNEL}final{harmony_tokens.MESSAGE}"}

    def split(self, text: str, opened: bool | None, final: bool = True) -> tuple[str, str]:
        # the whole reply goes on: its content parser reads no analysis message into content or calls
        return harmony.parse(text, final).reasoning, text


REASONING_PARSERS: dict[str, Callable[[], ReasoningParser]] = {
    "qwen3": lambda: ReasoningParser("qwen3", False),
    "deepseek_r1": lambda: ReasoningParser("deepseek_r1", True),
    "openai_gptoss": HarmonyReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ConfigurationError(f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]()


def infer_reasoning_parser(template: str | None) -> str | None:
    """Only harmony's reasoning is found from the template alone: other families' templates show
    whether a model may think, not whether it does."""
    return "openai_gptoss" if template and harmony.is_harmony_template(template) else None
