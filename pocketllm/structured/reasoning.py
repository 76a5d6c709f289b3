"""Reasoning in a model's output, named as vLLM's `--reasoning-parser`: qwen3 and deepseek_r1 both
write it as `<think>…</think>` before the answer."""
from __future__ import annotations

from pocketllm.errors import ConfigurationError
from pocketllm.structured.tool_parsers import hold_back


class ReasoningParser:
    start, end = "<think>", "</think>"

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

    def grammar_prefix(self, opened: bool | None) -> dict | None:
        """The `reasoning` entry of `structured_outputs`: the constraint applies after the block."""
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


REASONING_PARSERS = {"qwen3": False, "deepseek_r1": True}  # name -> implicit start


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ConfigurationError(f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}")
    return ReasoningParser(name, REASONING_PARSERS[name])
