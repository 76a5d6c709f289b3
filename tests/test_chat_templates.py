"""Chat templates render exactly what transformers' apply_chat_template(..., tokenize=False) renders."""

import copy
import time

import jinja2
import pytest
from fixtures import shared_names, shared_path
from tokenizers import Tokenizer as Backend
from tokenizers import models

from pocketllm.tokenizer import Tokenizer

TEMPLATES = shared_names("fixtures/chat_templates", "*.jinja")

# The special tokens each model's tokenizer passes to its template (transformers passes its special_tokens_map).
SPECIAL_TOKENS = {
    "meta-llama": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "NousResearch": {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"},
    "mistralai": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "deepseek-ai": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    "Qwen": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "HuggingFaceTB": {"eos_token": "<|im_end|>", "pad_token": "<|im_end|>"},
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Unit"},
                },
                "required": ["city"],
            },
        },
    }
]
TOOL_CALL = {
    "id": "call00001",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
}

CONVERSATIONS = {
    "system_user": [
        {"role": "system", "content": "You are a concise assistant. /no_think"},
        {"role": "user", "content": "What's the capital of France? «Quote» — 日本"},
    ],
    "user_only": [{"role": "user", "content": "Hello!\n  Indented line\n"}],
    "multi_turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Tell me a joke."},
        {
            "role": "assistant",
            "content": "<think>\nA pun.\n</think>\n\nI would tell a UDP joke, but you might not get it.",
        },
        {"role": "user", "content": "Another one"},
    ],
    "tool_call": [
        {"role": "system", "content": "You can look up the weather."},
        {"role": "user", "content": "What's the weather in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": '{"temperature": 21}'},
        {"role": "assistant", "content": "It is 21 °C in Zürich."},
        {"role": "user", "content": "Thanks!"},
    ],
    # OpenAI clients send "content": null next to tool calls; transformers drops keys whose value is None.
    "tool_call_null_content": [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": '{"temperature": 21}'},
    ],
}


def special_tokens_for(template_name: str) -> dict[str, str]:
    return next(tokens for org, tokens in SPECIAL_TOKENS.items() if template_name.startswith(org + "-"))


@pytest.fixture(scope="module")
def backend():
    return Backend(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))


def render_both(template_name, backend, messages, **kwargs):
    """(ours, transformers'): each the rendered text, or the error the template raised."""
    from transformers import PreTrainedTokenizerFast

    template = shared_path(f"fixtures/chat_templates/{template_name}").read_text(encoding="utf-8")
    special = special_tokens_for(template_name)
    kwargs.setdefault("add_generation_prompt", True)  # our default; transformers' is False
    ours = Tokenizer(backend, special, chat_templates={"default": template})
    reference = PreTrainedTokenizerFast(tokenizer_object=copy.deepcopy(backend), chat_template=template, **special)
    results = []
    for render in (
        lambda: ours.apply_chat_template(copy.deepcopy(messages), **kwargs),
        lambda: reference.apply_chat_template(copy.deepcopy(messages), tokenize=False, **kwargs),
    ):
        try:
            results.append(render())
        except Exception as error:  # templates fail with TemplateError, TypeError, ...: the same on both sides
            results.append(f"error {type(error).__name__}: {error}")
    return results


def test_fixtures_are_found():
    assert len(TEMPLATES) >= 7


@pytest.mark.parametrize("template_name", TEMPLATES)
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_like_transformers(template_name, conversation, add_generation_prompt, backend):
    tools = TOOLS if conversation.startswith("tool_call") else None
    ours, reference = render_both(
        template_name, backend, CONVERSATIONS[conversation], tools=tools, add_generation_prompt=add_generation_prompt
    )
    assert ours == reference


@pytest.mark.parametrize("template_name", TEMPLATES)
def test_tools_without_tool_messages(template_name, backend):
    ours, reference = render_both(template_name, backend, CONVERSATIONS["system_user"], tools=TOOLS)
    assert ours == reference


@pytest.mark.parametrize(
    "template_name",
    ["Qwen-Qwen3-0.6B.jinja", "HuggingFaceTB-SmolLM3-3B.jinja", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"],
)
@pytest.mark.parametrize("enable_thinking", [True, False])
def test_template_options(template_name, enable_thinking, backend):
    ours, reference = render_both(template_name, backend, CONVERSATIONS["multi_turn"], enable_thinking=enable_thinking)
    assert ours == reference


def test_llama31_date_and_builtin_tools(backend):
    ours, reference = render_both(
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        backend,
        CONVERSATIONS["user_only"],
        date_string="01 Jan 2025",
        builtin_tools=["brave_search", "wolfram_alpha"],
    )
    assert ours == reference
    assert "Today Date: 01 Jan 2025" in ours


def test_most_renders_succeed(backend):
    # Comparing errors is right where a template rejects a conversation (Llama 3.1 allows one tool call, Mistral
    # wants alternating roles), but most conversations must render, or the comparisons above prove little.
    rendered = [
        render_both(name, backend, messages, tools=TOOLS if conv.startswith("tool") else None)[0]
        for name in TEMPLATES
        for conv, messages in CONVERSATIONS.items()
    ]
    failed = [text for text in rendered if text.startswith("error ")]
    assert len(failed) <= len(rendered) // 5, failed


def test_template_helpers():
    from pocketllm.tokenizer.chat_template import render_chat

    template = (
        "{{ messages[0].content | tojson }}|{{ {'b': 1, 'a': [1, 2]} | tojson(indent=2, sort_keys=true) }}|"
        "{{ strftime_now('%Y') | length }}|{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m.role }}{% endfor %}"
    )
    messages = [{"role": "user", "content": '<é & "q">'}, {"role": "assistant", "content": "x"}]
    assert render_chat(template, messages) == '"<é & \\"q\\">"|{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}|4|user'
    with pytest.raises(jinja2.TemplateError, match="no system"):
        render_chat("{{ raise_exception('no system') }}", messages)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat("{{ messages.append(1) }}", messages)


# Templates that would take all memory or run for ever: each is refused before it allocates, or
# when its time is up.
HOSTILE_TEMPLATES = {
    "repetition": "{{ 'x' * 2**34 }}",
    "list repetition": "{{ ([0] * 2**34) | length }}",
    "power": "{{ 2 ** (2 ** 40) }}",
    "doubling with ~": "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s }}{% endif %}{% endmacro %}"
                       "{{ d('x', 64) }}",
    "doubling in a namespace": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                               "{% endfor %}{{ ns.s }}",
    "doubling without a loop": "{% set s = 'x' %}" + "{% set s = s ~ s %}" * 64 + "{{ s }}",
    "padding filter": "{{ 'x' | center(2**34) }}",
    "padding method": "{{ 'x'.ljust(2**34) }}",
    "format width": "{{ '{:>17179869184}'.format(1) }}",
    "percent width": "{{ '%17179869184d' % 1 }}",
    "star width": "{{ '%*d' % (2**34, 1) }}",
    "join of references": "{% set s = 'x' * 1000000 %}{{ ([s] * 1000000) | join }}",
    "text of a list": "{% set s = 'x' * 1000000 %}{{ [s] * 1000000 }}",
    "tojson of references": "{% set s = 'x' * 1000000 %}{{ ([s] * 1000000) | tojson }}",
    "replace": "{% set s = 'x' * 1000000 %}{{ s.replace('x', s) }}",
    "indent": "{{ ('a\\n' * 1000000) | indent(1000000) }}",
    "output": "{% for i in range(100000) %}{% for j in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% endfor %}",
    "macro output": "{% macro m() %}{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}"
                    "{% endfor %}{% endmacro %}{{ m() }}",
    "block output": "{% set b %}{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% endset %}{{ b }}",
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "recursion": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "lipsum": "{{ lipsum(10**9) }}",
}


@pytest.mark.parametrize("source", HOSTILE_TEMPLATES.values(), ids=HOSTILE_TEMPLATES.keys())
def test_the_sandbox_bounds_size_and_time(source):
    from pocketllm.tokenizer.chat_template import render_chat, render_limits

    start = time.monotonic()
    with render_limits(max_chars=4 << 20, seconds=1.0), pytest.raises(jinja2.TemplateError):
        render_chat(source, [{"role": "user", "content": "Hi"}])
    assert time.monotonic() - start < 10  # the time limit and a wide margin for a busy machine


def test_the_sandbox_allows_what_fits():
    from pocketllm.tokenizer.chat_template import TemplateOutputTooLongError, render_chat, render_limits

    source = ("{{ 'ab' * 3 }}|{{ ([1] * 2) | length }}|{{ 2 ** 10 }}|{{ '%3d' % 7 }}|{{ '{:>4}'.format('x') }}|"
              "{{ 'x' | center(5) }}|{{ ['a', 'b'] | join('-') }}|{{ 'a' ~ 'b' + 'c' }}|"
              "{{ [1, [2]] | tojson(indent=1) }}|{% for m in messages %}{{ m.content }}{% endfor %}")
    expected = 'ababab|2|1024|  7|   x|  x  |a-b|abc|[\n 1,\n [\n  2\n ]\n]|Hi'
    assert render_chat(source, [{"role": "user", "content": "Hi"}]) == expected
    with render_limits(max_chars=len(expected)):
        assert render_chat(source, [{"role": "user", "content": "Hi"}]) == expected
    with render_limits(max_chars=len(expected) - 1), pytest.raises(TemplateOutputTooLongError):
        render_chat(source, [{"role": "user", "content": "Hi"}])
