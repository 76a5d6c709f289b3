"""Rendering chat templates exactly as transformers' `apply_chat_template(..., tokenize=False)` does.

Templates come with model files, so they are untrusted code: they run in Jinja's immutable sandbox.
"""

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning may come under; templates read `reasoning_content` (gpt-oss ones read `thinking`).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own filter escapes HTML characters and sorts keys; templates are written against this one.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


_ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = _strftime_now


@functools.lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


def _normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    # transformers drops None values (APIs send `content: null` with tool calls; templates test `is defined`)
    # and copies the reasoning to every name templates read it under.
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    /,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **variables: Any,
) -> str:
    """`variables` are the model's special tokens (`bos_token`, ...) and any template options (`enable_thinking`,
    `documents`); they cannot replace the messages, tools or add_generation_prompt."""
    return compile_template(template).render({
        "documents": None,
        **variables,
        "messages": [_normalize_message(m) for m in messages],
        "tools": tools,
        "add_generation_prompt": add_generation_prompt,
    })
