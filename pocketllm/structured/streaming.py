"""Text that is still streaming in: what of its end may not be shown yet."""
from __future__ import annotations


def hold_back(text: str, *tags: str) -> str:
    """`text` without the longest tail that may be the start of one of `tags` (the rest of the tag
    may come with the next tokens)."""
    k = max((k for tag in tags for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])),
            default=0)
    return text[:len(text) - k]
