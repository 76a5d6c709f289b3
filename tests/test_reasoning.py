"""Reasoning parsers on recorded outputs, whole and streamed, the prompt states real templates leave,
and the grammar that lets reasoning run free before the constraint."""
from __future__ import annotations

import pytest
from fixtures import default_model_gguf, shared_path

from pocketllm.structured.chat import ReplyParser
from pocketllm.structured.reasoning import get_reasoning_parser
from pocketllm.structured.tool_parsers import get_tool_parser
from pocketllm.tokenizer.chat_template import render_chat

# (parser, prompt state, output, reasoning, content)
RECORDED = [
    ("qwen3", None, "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
     "\nThe user greets me.\n", "Hello! How can I help?"),
    ("qwen3", True, "Two plus two is four.\n</think>\n\n4", "Two plus two is four.\n", "4"),
    ("qwen3", None, "Hello! No thinking here.", "", "Hello! No thinking here."),
    ("qwen3", None, "A stray </think> tag", "", "A stray </think> tag"),
    ("qwen3", False, "<think>\n\n</think>\n\nOK", "", "<think>\n\n</think>\n\nOK"),  # off: all content
    ("qwen3", None, "<think>\nStill thinking when max_tokens hit", "\nStill thinking when max_tokens hit", ""),
    ("deepseek_r1", True, "Okay, 3 + 5 = 8.\n</think>\n\nThe answer is 8.", "Okay, 3 + 5 = 8.\n",
     "The answer is 8."),
    ("deepseek_r1", None, "<think>\nHmm.\n</think>\nDone.", "\nHmm.\n", "Done."),
    ("deepseek_r1", None, "No start tag, but\n</think>\nthe answer.", "No start tag, but\n", "the answer."),
    ("deepseek_r1", True, "Endless reasoning", "Endless reasoning", ""),
]


@pytest.mark.parametrize("name, opened, text, reasoning, content", RECORDED)
def test_recorded_outputs(name, opened, text, reasoning, content):
    parser = get_reasoning_parser(name)
    assert parser.split(text, opened) == (reasoning, content)
    message, _ = ReplyParser(parser, opened, None).message(text, "stop")
    assert (message["reasoning_content"], message["content"]) == (reasoning or None, content or None)


@pytest.mark.parametrize("name, opened, text, reasoning, content", RECORDED)
@pytest.mark.parametrize("step", [1, 5])
def test_streamed_deltas_add_up_to_the_whole(name, opened, text, reasoning, content, step):
    reply = ReplyParser(get_reasoning_parser(name), opened, None)
    deltas = []
    for end in range(step, len(text), step):
        deltas += reply.deltas(text[:end], final=False)
    deltas += reply.deltas(text, final=True)
    assert all(len(d) == 1 and next(iter(d.values())) for d in deltas)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
    assert "".join(d.get("content", "") for d in deltas) == content
    # Reasoning comes first: no reasoning delta after the first content delta.
    kinds = [next(iter(d)) for d in deltas]
    assert kinds == sorted(kinds, key=lambda k: k == "content")


def test_reasoning_then_tool_calls():
    reply = ReplyParser(get_reasoning_parser("qwen3"), None, get_tool_parser("hermes"))
    text = '<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": "w", "arguments": {"c": 1}}\n</tool_call>'
    message, finish = reply.message(text, "stop")
    assert message["reasoning_content"] == "\nI need the weather.\n" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "w", "arguments": '{"c": 1}'}
    assert finish == "tool_calls"


def test_prompt_states_of_real_templates():
    qwen3 = shared_path("fixtures/chat_templates/Qwen-Qwen3-0.6B.jinja").read_text()
    r1 = shared_path("fixtures/chat_templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    messages = [{"role": "user", "content": "Hi"}]
    parser = get_reasoning_parser("qwen3")
    assert parser.prompt_state(render_chat(qwen3, messages)) is None  # the model opens the block itself
    assert parser.prompt_state(render_chat(qwen3, messages, enable_thinking=False)) is False
    r1_parser = get_reasoning_parser("deepseek_r1")
    assert r1_parser.prompt_state(render_chat(r1, messages, bos_token="", enable_thinking=True)) is True
    assert r1_parser.prompt_state(render_chat(r1, messages, bos_token="")) is False
    assert parser.grammar_prefix(False) is None
    assert parser.grammar_prefix(True) == {"start": "<think>", "end": "</think>", "open": True}


@pytest.fixture(scope="module")
def structured():
    from pocketllm.structured.backend import StructuredOutputs
    from pocketllm.tokenizer import get_tokenizer

    tok = get_tokenizer(default_model_gguf())
    return tok, StructuredOutputs(tok, tok.vocab_size, tok.eos_token_ids)


def allowed(matcher, tok, text: str) -> bool:
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    token = tok.encode(text, add_special_tokens=False)[0]
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def test_constraint_applies_after_reasoning(structured):
    import xgrammar as xgr

    from pocketllm.structured.spec import normalize

    tok, backend = structured
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    opened = xgr.GrammarMatcher(backend.compile(normalize(
        {"json": schema, "reasoning": {"start": "<think>", "end": "</think>", "open": True}})))
    assert allowed(opened, tok, "Hello") and allowed(opened, tok, "{")  # free text until the end tag
    assert opened.accept_string("Let me think: {not json} <b>.\n")
    assert opened.accept_string("</think>\n\n")
    assert allowed(opened, tok, "{") and not allowed(opened, tok, "Hello")  # now the constraint holds
    assert opened.accept_string('{"a": 1}') and opened.is_completed()

    optional = backend.compile(normalize({"json": schema,
                                          "reasoning": {"start": "<think>", "end": "</think>", "open": False}}))
    for text, ok in [('{"a": 1}', True), ('<think>\nhm\n</think>\n\n{"a": 2}', True), ("plain words", False)]:
        matcher = xgr.GrammarMatcher(optional)
        assert (matcher.accept_string(text) and matcher.is_completed()) == ok
