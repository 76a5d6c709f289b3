"""gpt-oss's harmony format: replies parsed into reasoning, content and tool calls (llama.cpp's
test-chat.cpp cases), whole and streamed at every character; conversations rendered by gpt-oss's
template; forced calls and constraints whose grammar writes harmony the parsers read back."""
from __future__ import annotations

import copy
import json
import re

import pytest
from test_tool_parsers import assemble as assemble_content
from tiny_harmony import TEMPLATE

from pocketllm.structured.chat import ReplyParser, template_messages, template_tools, tool_constraint
from pocketllm.structured.reasoning import get_reasoning_parser, infer_reasoning_parser
from pocketllm.structured.tool_parsers import ToolCall, get_tool_parser, infer_tool_parser
from pocketllm.tokenizer.chat_template import render_chat

THOUGHTS = "I'm\nthinking"
CONTENT = "Hello, world!\nWhat's up?"
CALL = ("special_function", '{"arg1": 1}')
EDIT_ARGS = '{"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {", "replaceAll": false}'

# (model output after the prompt's "<|start|>assistant", reasoning, content, calls): llama.cpp's
# tests/test-chat.cpp gpt-oss cases, with the outputs they expect.
CASES = [
    ("<|channel|>final<|message|>" + CONTENT, "", CONTENT, []),
    ("<|channel|>commentary<|message|>" + CONTENT, "", CONTENT, []),  # a preamble
    (f"<|channel|>analysis<|message|>{THOUGHTS}<|end|><|start|>assistant<|channel|>final<|message|>{CONTENT}",
     THOUGHTS, CONTENT, []),
    (f"<|channel|>analysis<|message|>{THOUGHTS}", THOUGHTS, "", []),  # stopped while reasoning
    # the recipient in the role header or in the channel header, with or without a constraint
    (' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', "", "", [CALL]),
    ('<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}', "", "", [CALL]),
    (' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{"arg1": 1}', "", "", [CALL]),
    ('<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}', "", "", [CALL]),
    (f"<|channel|>analysis<|message|>{THOUGHTS}<|end|>"
     '<|start|>assistant to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', THOUGHTS, "", [CALL]),
    ("<|channel|>analysis<|message|>Thinking about edit...<|end|><|start|>assistant<|channel|>commentary "
     f"to=functions.edit <|constrain|>json<|message|>{EDIT_ARGS}", "Thinking about edit...", "", [("edit", EDIT_ARGS)]),
    # a JSON answer under response_format
    ('<|channel|>analysis<|message|>I need to output the invoice details in JSON<|end|><|start|>assistant<|channel|>'
     'final <|constrain|>json<|message|>{"amount": 123.45, "date": "2025-12-03"}',
     "I need to output the invoice details in JSON", '{"amount": 123.45, "date": "2025-12-03"}', []),
    # calls to built-in tools the request cannot have offered: dropped
    ("<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant to=container.exec"
     "<|channel|>commentary<|message|>python3 -c 'print(\"hello\")'", "I will execute python to say hello", "", []),
    ("<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant<|channel|>commentary"
     " to=python <|constrain|>code<|message|>print(\"hello\")", "I will execute python to say hello", "", []),
    # a stray "<|channel|>commentary to=assistant" before a message
    (f"<|channel|>commentary to=assistant<|channel|>analysis<|message|>{THOUGHTS}<|end|><|start|>assistant"
     f"<|channel|>final<|message|>{CONTENT}", THOUGHTS, CONTENT, []),
    (f"<|channel|>analysis<|message|>{THOUGHTS}<|end|><|start|>assistant<|channel|>commentary to=assistant"
     f"<|channel|>final<|message|>{CONTENT}", THOUGHTS, CONTENT, []),
    # beyond llama.cpp's cases: the stop token kept (include_stop_str_in_output), two analysis messages and a
    # preamble before a call, a model that writes no markup, a reply cut inside a header
    (f"<|channel|>final<|message|>{CONTENT}<|return|>", "", CONTENT, []),
    ("<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|>"
     "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Zürich"}<|call|>',
     "One.\nTwo.", "Checking.", [("get_weather", '{"city": "Zürich"}')]),
    ("Just text, <b>no</b> markup <|", "", "Just text, <b>no</b> markup <|", []),
    ("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>fin", "Hm.", "", []),
]


def harmony_reply() -> ReplyParser:
    return ReplyParser(get_reasoning_parser("openai_gptoss"), None, get_tool_parser("openai"))


def assemble(deltas: list[dict]) -> tuple[str, str, list[list[str]]]:
    """Reasoning, content and [[name, arguments]] of a parser's streamed deltas."""
    assert all(len(d) == 1 for d in deltas)
    content, calls = assemble_content([d for d in deltas if "reasoning_content" not in d])
    return "".join(d.get("reasoning_content", "") for d in deltas), content, calls


@pytest.mark.parametrize("text, reasoning, content, calls", CASES)
def test_whole_replies(text, reasoning, content, calls):
    message, finish = harmony_reply().message(text, "stop")
    assert message["reasoning_content"] == (reasoning or None)
    assert message["content"] == (content or None)
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert got == calls
    assert finish == ("tool_calls" if calls else "stop")
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message.get("tool_calls", []))


@pytest.mark.parametrize("text, reasoning, content, calls", CASES)
def test_streamed_at_every_character(text, reasoning, content, calls):
    reply = harmony_reply()
    deltas = []
    for end in range(1, len(text)):
        deltas += reply.deltas(text[:end], final=False)
        assert "<|" not in "".join(d.get("content", "") for d in deltas) or "<|" in content
    deltas += reply.deltas(text, final=True)
    assert assemble(deltas) == (reasoning, content, [list(c) for c in calls])
    assert reply.called == bool(calls)


def test_without_tools_or_without_reasoning():
    """No tools offered: calls are dropped, never shown as markup. Harmony calls read without the
    reasoning parser: the analysis is dropped."""
    text = CASES[8][0]
    message, finish = ReplyParser(get_reasoning_parser("openai_gptoss"), None, None).message(text, "stop")
    assert (message["reasoning_content"], message["content"], finish) == (THOUGHTS, None, "stop")
    assert "tool_calls" not in message
    message, finish = ReplyParser(None, None, get_tool_parser("openai")).message(text, "stop")
    assert message["content"] is None and "reasoning_content" not in message
    assert message["tool_calls"][0]["function"] == {"name": CALL[0], "arguments": CALL[1]}


def test_parsers_chosen_for_gpt_oss():
    template = TEMPLATE.read_text()
    assert infer_tool_parser(template) == "openai" and infer_reasoning_parser(template) == "openai_gptoss"
    assert infer_reasoning_parser("{{ messages }}<|im_start|>assistant\n<think>\n") is None
    reasoning = get_reasoning_parser("openai_gptoss")
    assert reasoning.needs_special_tokens and get_tool_parser("openai").needs_special_tokens
    assert reasoning.prompt_state(render_chat(template, [{"role": "user", "content": "Hi"}])) is None


# --- rendering with gpt-oss's template

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "description": "A city"},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    # A call with a preamble and its reasoning (as this server returns them): the reasoning is kept.
    {"role": "assistant", "content": "Let me check.", "reasoning_content": "The user wants the weather.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    {"role": "assistant", "content": "It is 21 °C.", "reasoning_content": "Report it."},
    {"role": "user", "content": "Thanks!"},
]
# The harmony text of CONVERSATION (openai-harmony's format as gpt-oss's template writes it): the
# reasoning of the call's turn is shown (no final answer after it... until the next one, whose
# reasoning is dropped), the call goes to functions.get_weather, the result comes from it.
EXPECTED = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: DATE\n\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
    "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
    "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\nnamespace functions {\n\n"
    "// Get the weather\ntype get_weather = (_: {\n// A city\ncity: string,\nunit?: \"celsius\" | \"fahrenheit\",\n"
    "}) => any;\n\n} // namespace functions<|end|>"
    "<|start|>user<|message|>Weather in Zürich?<|end|>"
    '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Zürich"}<|call|>'
    '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"temperature\\": 21}"<|end|>'
    "<|start|>assistant<|channel|>final<|message|>It is 21 °C.<|end|>"
    "<|start|>user<|message|>Thanks!<|end|>"
    "<|start|>assistant"
)


def render_gpt_oss(messages, tools, **kwargs) -> tuple[str, str]:
    """(ours, transformers') rendering of the messages as the server prepares them."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    from pocketllm.tokenizer import Tokenizer

    template = TEMPLATE.read_text(encoding="utf-8")
    prepared = template_messages(copy.deepcopy(messages), tools, template, get_tool_parser("openai"))
    backend = Backend(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    ours = Tokenizer(backend, {}, chat_templates={"default": template})
    reference = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template)
    kwargs.setdefault("add_generation_prompt", True)
    return (ours.apply_chat_template(copy.deepcopy(prepared), tools=tools, **kwargs),
            reference.apply_chat_template(copy.deepcopy(prepared), tools=tools, tokenize=False, **kwargs))


def test_conversation_renders_as_harmony():
    ours, reference = render_gpt_oss(CONVERSATION, TOOLS)
    assert ours == reference
    assert re.sub(r"Current date: \d{4}-\d\d-\d\d", "Current date: DATE", ours) == EXPECTED
    # Without a later answer, the call's reasoning is shown: the model continues from it.
    ours, reference = render_gpt_oss(CONVERSATION[:4], TOOLS, reasoning_effort="high")
    assert ours == reference and "Reasoning: high" in ours
    assert ours.endswith("<|start|>user<|message|>Weather in Zürich?<|end|>"
                         "<|start|>assistant<|channel|>analysis<|message|>The user wants the weather.<|end|>"
                         '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                         '{"city": "Zürich"}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary'
                         '<|message|>"{\\"temperature\\": 21}"<|end|><|start|>assistant')


def test_tools_without_a_description_render():
    """gpt-oss's template writes every tool's description; OpenAI's API makes it optional."""
    tools, ask = [{"type": "function", "function": {"name": "get_time"}}], [{"role": "user", "content": "Time?"}]
    ours, reference = render_gpt_oss(ask, template_tools(tools, TEMPLATE.read_text()))
    assert ours == reference and "// \ntype get_time = () => any;" in ours
    with pytest.raises(Exception, match="description"):
        render_gpt_oss(ask, tools)


def test_rendered_call_is_read_back():
    """The call the template writes into the history is a call the parser reads."""
    ours, _ = render_gpt_oss(CONVERSATION[:3], TOOLS)
    start = ours.index("<|start|>assistant to=")
    written = ours[start + len("<|start|>assistant"):ours.index("<|call|>")]
    _, calls = get_tool_parser("openai").extract(written)
    assert calls == [ToolCall("get_weather", '{"city": "Zürich"}')]


# --- grammars: forced calls and constraints in harmony


@pytest.fixture(scope="module")
def o200k(tmp_path_factory):
    from tiny_harmony import reference_tokenizer, write_gguf_vocab

    from pocketllm.structured.backend import StructuredOutputs
    from pocketllm.tokenizer import get_tokenizer

    tok = get_tokenizer(write_gguf_vocab(reference_tokenizer(), tmp_path_factory.mktemp("o200k") / "o200k.gguf"))
    return tok, StructuredOutputs(tok, tok.vocab_size, tok.eos_token_ids)


def matcher_of(structured, spec: dict):
    import xgrammar as xgr

    from pocketllm.structured.spec import normalize

    return xgr.GrammarMatcher(structured.compile(normalize(spec)))


def completes(structured, spec: dict, text: str) -> bool:
    matcher = matcher_of(structured, spec)
    return matcher.accept_string(text) and matcher.is_completed()


def test_forced_calls_are_harmony_the_parser_reads(o200k):
    import xgrammar as xgr

    tok, structured = o200k
    parser, reasoning = get_tool_parser("openai"), get_reasoning_parser("openai_gptoss")
    tools = TOOLS + [{"type": "function", "function": {"name": "get_time"}}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        spec = {**tool_constraint(tools, choice, True, parser), "reasoning": reasoning.grammar_prefix(None, calls=True)}
        call = parser.render([ToolCall("get_weather", '{"city": "Oslo", "unit": "celsius"}')])
        thought = "<|channel|>analysis<|message|>The user asks about Oslo.<|end|><|start|>assistant"
        for text in (call, thought + call):
            assert completes(structured, spec, text), text
            message, finish = harmony_reply().message(text, "stop")
            assert finish == "tool_calls"
            assert message["tool_calls"][0]["function"] == {"name": "get_weather",
                                                           "arguments": '{"city": "Oslo", "unit": "celsius"}'}
        # One call a reply (<|call|> stops it); a call's arguments follow its schema.
        assert not completes(structured, spec, call + parser.separator + call)
        assert not completes(structured, spec, parser.render([ToolCall("get_weather", '{"unit": "celsius"}')]))
        assert not completes(structured, spec, "<|channel|>final<|message|>It is sunny.")
    named = {**tool_constraint(tools, {"type": "function", "function": {"name": "get_time"}}, True, parser),
             "reasoning": reasoning.grammar_prefix(None, calls=True)}
    assert not completes(structured, named, call)
    assert completes(structured, named, parser.render([ToolCall("get_time", "{}")]))
    # Token by token: the message markup is written with harmony's own tokens.
    matcher = matcher_of(structured, named)
    bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    channel = tok.encode("<|channel|>", add_special_tokens=False)
    assert len(channel) == 1 and (int(bitmask[0, channel[0] // 32]) >> (channel[0] % 32)) & 1


def test_constraint_applies_to_the_final_message(o200k):
    _, structured = o200k
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = {"json": schema, "reasoning": get_reasoning_parser("openai_gptoss").grammar_prefix(None)}
    for text, ok in [('<|channel|>final<|message|>{"a": 1}', True),
                     ('<|channel|>analysis<|message|>Any {text}.<|end|><|start|>assistant<|channel|>final'
                      '<|message|>{"a": 2}', True),
                     ('{"a": 1}', False), ("<|channel|>final<|message|>plain words", False)]:
        assert completes(structured, spec, text) == ok, text
        if ok:
            message, _ = harmony_reply().message(text, "stop")
            assert json.loads(message["content"])["a"] in (1, 2)
