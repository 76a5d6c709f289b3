"""A model's name on the Hugging Face hub: `org/name`, an optional `@revision`, and for a repo of GGUF files
an optional quant tag (`org/name-GGUF:Q4_K_M`, llama.cpp's `-hf` syntax)."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:@(?P<revision>[\w./-]+?))?(?::(?P<quant>[\w.-]+))?$")


@dataclass(frozen=True)
class HubName:
    repo: str
    revision: str | None = None
    quant: str | None = None

    @classmethod
    def parse(cls, text: str) -> HubName | None:
        """The name `text` gives, or None for a local path (one that exists, or that looks like one)."""
        if os.path.exists(text) or text.startswith((".", "/", "~")) or text.endswith((".gguf", "/")):
            return None
        m = _NAME.match(text)
        return None if m is None else cls(m["repo"], m["revision"], m["quant"])

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "") + (f":{self.quant}" if self.quant else "")
