"""Rendering chat templates exactly as transformers' `apply_chat_template(..., tokenize=False)` does.

Templates come with model files, so they are untrusted code: they run in Jinja's immutable sandbox,
bounded in size and time (`render_limits`). Bounded: the output; every text the template builds
(repetition, concatenation, `%` and `format` widths, padding, joins, `tojson`, the text of a list
it prints), every list it builds by repetition or concatenation, integer powers, and the time it
runs (checked at every loop iteration, call, filter and operator, so nested loops end too; Jinja's
sandbox already bounds `range` to 100,000 items). What one built-in step makes from values within
the bounds (a sort, a `|list` of a long text) is not checked before it runs: it is at most a few
times the limit.
"""

import contextlib
import dataclasses
import functools
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime
from string import Formatter
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning may come under; templates read `reasoning_content` (gpt-oss ones read `thinking`).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateLimitError(SecurityError):
    """The template went past a bound of `render_limits`."""


class TemplateOutputTooLongError(TemplateLimitError):
    """The rendered text is longer than `render_limits`' max_chars."""


@dataclasses.dataclass(frozen=True)
class RenderLimits:
    max_chars: int = 16 << 20  # the output, each text the template builds, each list's items
    seconds: float = 5.0


_LIMITS: ContextVar[RenderLimits] = ContextVar("chat_template_limits", default=RenderLimits())


@contextlib.contextmanager
def render_limits(max_chars: int | None = None, seconds: float | None = None):
    """Bounds for the chat templates rendered in this context (a thread, or an asyncio task)."""
    current = _LIMITS.get()
    token = _LIMITS.set(RenderLimits(current.max_chars if max_chars is None else max_chars,
                                     current.seconds if seconds is None else seconds))
    try:
        yield
    finally:
        _LIMITS.reset(token)


MAX_INT_BITS = 1 << 16  # a power's result: far beyond any number a template prints
MAX_JSON_INDENT = 16


def _size(value: Any, limit: int, indent: int = 0, depth: int = 0) -> int:
    """About how many characters `value` takes as text (counted until past `limit`): strings
    count their length, containers their items plus some punctuation and indentation."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        items = [x for pair in value.items() for x in pair]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    else:
        return 8  # numbers, None, booleans (an int's text is bounded by Python's int_max_str_digits)
    if depth > 100:
        return limit + 1
    total = 2 + len(items) * (2 + indent * (depth + 1))
    for item in items:
        if total > limit:
            break
        total += _size(item, limit - total, indent, depth + 1)
    return total


class _Budget:
    """One render's bounds: its limits and deadline."""

    __slots__ = ("max_chars", "seconds", "deadline")

    def __init__(self, limits: RenderLimits, timed: bool = True):
        self.max_chars, self.seconds = limits.max_chars, limits.seconds
        self.deadline = time.monotonic() + limits.seconds if timed else math.inf

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the chat template ran for more than {self.seconds:g} s")

    def check(self, size: int, what: str = "a text") -> None:
        if size > self.max_chars:
            raise TemplateLimitError(f"the chat template built {what} of more than {self.max_chars} characters "
                                     "(or items), its limit")

    def checked(self, value: Any) -> Any:
        if isinstance(value, (str, list, tuple, dict, set, frozenset)):
            self.check(len(value))
        return value

    def check_text_of(self, value: Any, indent: int = 0) -> None:
        self.check(_size(value, self.max_chars, indent))

    def check_count(self, value: Any, what: str) -> None:
        """A width, count or repetition (a bool is not one)."""
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > self.max_chars:
            raise TemplateLimitError(f"the chat template asked for {what} of {value}, more than its limit of "
                                     f"{self.max_chars}")

    def check_counts(self, args: Sequence, kwargs: Mapping) -> None:
        for value in (*args, *kwargs.values()):
            self.check_count(value, "a size")

    def check_repeat(self, left: Any, right: Any) -> None:
        seq, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
            self.check(len(seq) * times, "a repetition")

    def check_power(self, base: Any, exponent: Any) -> None:
        if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
            if abs(base).bit_length() * exponent > MAX_INT_BITS:
                raise TemplateLimitError(f"the chat template asked for a power of more than {MAX_INT_BITS} bits")

    _FORMAT_WIDTHS = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*)(?:\.(\d*))?")

    def check_percent_format(self, text: str, values: Any) -> None:
        """`text % values`: its widths and precisions, and the values' text."""
        for width, precision in self._FORMAT_WIDTHS.findall(text):
            for number in (width, precision):
                if number:
                    self.check_count(int(number), "a width")
        if "*" in text:  # widths given as values
            self.check_counts(values if isinstance(values, tuple) else (values,), {})
        self.check(len(text) + _size(values, self.max_chars))

    def check_format_method(self, text: str, args: Sequence, kwargs: Mapping) -> None:
        """`text.format(...)`: the widths in its fields, and the values' text."""
        for _, _, spec, _ in _FORMATTER.parse(text):
            for number in re.findall(r"\d+", spec or ""):
                self.check_count(int(number), "a width")
            if "{" in (spec or ""):  # widths given as values
                self.check_counts(args, kwargs)
        self.check(len(text) + _size([args, kwargs], self.max_chars))


_FORMATTER = Formatter()
_RENDER: ContextVar[_Budget | None] = ContextVar("chat_template_render", default=None)


def _budget() -> _Budget:
    # Outside a render (the compiler folding constants), only sizes are bounded.
    return _RENDER.get() or _Budget(_LIMITS.get(), timed=False)


def _check_join(budget: _Budget, sep: str, items: list) -> None:
    budget.check(_size(items, budget.max_chars) + len(sep) * len(items), "a joined text")


def _check_replace(budget: _Budget, s: Any, old: Any, new: Any, count: Any = -1) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        found = len(s) + 1 if not old else s.count(old)
        if isinstance(count, int) and count >= 0:
            found = min(found, count)
        budget.check(len(s) + found * max(0, len(new) - len(old)), "a replaced text")


def _check_str_method(budget: _Budget, s: str, name: str, args: tuple, kwargs: dict) -> None:
    budget.check_counts(args, kwargs)
    if name == "replace":
        _check_replace(budget, s, *args, **kwargs)
    elif name == "expandtabs":
        size = (args or list(kwargs.values()) or [8])[0]
        if isinstance(size, int):
            budget.check(len(s) + s.count("\t") * size, "an expanded text")


# Filters whose result may be much larger than their input, with a check of it before they run:
# f(budget, value, *args, **kwargs).
def _filter_join(budget, value, d="", attribute=None):
    if isinstance(value, (list, tuple)):
        _check_join(budget, d if isinstance(d, str) else "", list(value))


def _filter_indent(budget, s, width=4, first=False, blank=False):
    if isinstance(s, str):
        per_line = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        budget.check(len(s) + (s.count("\n") + 1) * per_line, "an indented text")


def _filter_wordwrap(budget, s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    if isinstance(s, str) and isinstance(wrapstring, str):
        budget.check(len(s) * (1 + len(wrapstring)), "a wrapped text")


def _filter_format(budget, value, *args, **kwargs):
    if isinstance(value, str):
        budget.check_percent_format(value, kwargs or args)


def _filter_text_of(budget, value, *args, **kwargs):
    budget.check_text_of(value)


_FILTER_CHECKS = {"join": _filter_join, "indent": _filter_indent, "wordwrap": _filter_wordwrap,
                  "format": _filter_format, "replace": _check_replace, "string": _filter_text_of,
                  "pprint": _filter_text_of, "xmlattr": _filter_text_of, "urlencode": _filter_text_of,
                  "sum": _filter_text_of}
# Filters whose integer arguments are widths or counts of what they make.
_SIZE_ARGUMENTS = frozenset({"center", "indent", "wordwrap", "truncate", "batch", "slice"})


def _bounded_filter(name: str, f):
    """`f` with its counts checked, a check of its result's size before it runs where it can be
    much larger than its input, and its result's length checked after."""
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # the context or environment comes first
    before = _FILTER_CHECKS.get(name)
    sizes = name in _SIZE_ARGUMENTS

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        budget = _budget()
        budget.tick()
        if sizes:
            budget.check_counts(args[skip + 1:], kwargs)
        if before is not None and len(args) > skip:
            before(budget, *args[skip:], **kwargs)
        return budget.checked(f(*args, **kwargs))

    return bounded


class _OutputBuffer(list):
    """The output of a macro or block, checked as it grows."""

    __slots__ = ("size", "budget")

    def __init__(self):
        super().__init__()
        self.size, self.budget = 0, _budget()

    def append(self, piece: str) -> None:
        self.size += len(piece)
        self.budget.check(self.size)
        super().append(piece)

    def extend(self, pieces) -> None:
        for piece in pieces:
            self.append(piece)


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code, with a time check in every loop iteration, a size check of every `~`, and
    output buffers that check their size."""

    def buffer(self, frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.output_buffer()")

    def visit_For(self, node: nodes.For, frame) -> None:
        tick = nodes.ExprStmt(nodes.Call(nodes.EnvironmentAttribute("loop_tick"), [], [], None, None),
                              lineno=node.lineno)
        tick.set_environment(self.environment)
        node = nodes.For(node.target, node.iter, [tick, *node.body], node.else_, node.test, node.recursive,
                         lineno=node.lineno)
        node.set_environment(self.environment)
        super().visit_For(node, frame)

    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        self.write("environment.checked_text(")
        super().visit_Concat(node, frame)
        self.write(")")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox within `render_limits`."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "%", "**"})

    def __init__(self, **options):
        super().__init__(finalize=self._finalize_output, **options)
        self.globals.pop("lipsum", None)  # n paragraphs of text, n unbounded; no chat template uses it

    def bound_filters(self) -> None:
        """Wrap every filter (call once all are registered)."""
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}

    output_buffer = _OutputBuffer

    @staticmethod
    def loop_tick() -> None:
        """Called at each loop iteration (through `call`, which checks the time)."""

    @staticmethod
    def checked_text(text: str) -> str:
        return _budget().checked(text)

    def concat(self, pieces) -> str:  # joins every buffer: a macro's or block's output
        pieces = pieces if isinstance(pieces, list) else list(pieces)
        _budget().check(sum(map(len, pieces)))
        return "".join(pieces)

    @staticmethod
    def _finalize_output(value: Any) -> Any:
        if not isinstance(value, str):  # printed as its text: a list of many long strings is long
            _budget().check_text_of(value)
        return value

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.tick()
        if operator == "*":
            budget.check_repeat(left, right)
        elif operator == "**":
            budget.check_power(left, right)
        elif operator == "%" and isinstance(left, str):
            budget.check_percent_format(left, right)
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            budget.check(len(left) + len(right))
        return budget.checked(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  (the sandbox's own signature)
        budget = _budget()
        budget.tick()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):  # a str method
            name = getattr(__obj, "__name__", "")
            if name == "join" and args:
                args = (list(args[0]), *args[1:])  # counted before the join
                _check_join(budget, owner, args[0])
            else:
                _check_str_method(budget, owner, name, args, kwargs)
        return budget.checked(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any):
        fmt = super().wrap_str_format(value)
        if fmt is None:
            return None
        text = value.__self__

        @functools.wraps(fmt)
        def bounded(*args, **kwargs):
            budget = _budget()
            budget.check_format_method(text, args, kwargs)
            return budget.checked(fmt(*args, **kwargs))

        return bounded


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own filter escapes HTML characters and sorts keys; templates are written against this one.
    if isinstance(indent, int) and indent > MAX_JSON_INDENT:
        raise TemplateLimitError(f"the chat template asked for a JSON indent of {indent}, more than "
                                 f"{MAX_JSON_INDENT}")
    spaces = len(indent) if isinstance(indent, str) else indent or 0
    _budget().check_text_of(value, spaces)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


_ENV = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
_ENV.filters["tojson"] = _tojson
_ENV.bound_filters()
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
    `documents`); they cannot replace the messages, tools or add_generation_prompt. Bounded by
    `render_limits` (TemplateLimitError past them)."""
    compiled = compile_template(template)
    budget = _Budget(_LIMITS.get())
    token = _RENDER.set(budget)
    try:
        pieces, size = [], 0
        for piece in compiled.generate({
            "documents": None,
            **variables,
            "messages": [_normalize_message(m) for m in messages],
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }):
            size += len(piece)
            if size > budget.max_chars:
                raise TemplateOutputTooLongError(f"the chat template's output passed {budget.max_chars} characters, "
                                                 "its limit")
            pieces.append(piece)
        return "".join(pieces)
    finally:
        _RENDER.reset(token)
