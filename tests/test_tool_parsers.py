"""Tool-call parsers on recorded outputs of each family, whole and streamed; their syntax agrees with
the forced-call grammar and with the chat templates that render calls."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures import default_model_gguf, shared_path

from pocketllm.structured.chat import ReplyParser, template_messages, tool_constraint
from pocketllm.structured.tool_parsers import ToolCall, get_tool_parser, infer_tool_parser
from pocketllm.tokenizer.chat_template import render_chat

WEATHER = '{"city": "Paris", "unit": "celsius"}'
DATA = Path(__file__).parent / "data"

# (family, model output, expected content, expected [(name, arguments)]); None: no calls expected.
RECORDED = [
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     None, [("get_weather", WEATHER)]),
    ("hermes", 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
     "Let me check both.\n", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "Europe/Paris"}')]),
    # Qwen 2.5 sometimes stops at EOS before the end tag.
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", "{}")]),
    ("hermes", '<tool_call>\n{"name": "search", "arguments": {"query": "café \\"crème\\"", "limit": 3}}\n'
               '</tool_call>', None, [("search", '{"query": "café \\"crème\\"", "limit": 3}')]),
    ("hermes", '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}\n</tool_call>',
     None, [("search", '{"query": "x"}')]),
    ("hermes", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    # malformed: unbalanced JSON, a name that is not a string, arguments that are not an object
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>', None, None),
    ("hermes", '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>', None, None),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>', None, None),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> and then <tool_call>oops', None, None),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     None, [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}', None,
     [("get_time", '{"tz": "UTC"}')]),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', None,
     [("a", "{}"), ("b", '{"x": 1}')]),
    ("llama3_json", "I can't call tools for that.", "I can't call tools for that.", []),
    ("llama3_json", '{"answer": 42}', None, None),
    ("llama3_json", '{"name": "a", "parameters": {"x": }', None, None),
    ("llama3_json", '{"name": "a", "parameters": {}} trailing words', None, None),
    ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}]', None,
     [("get_weather", WEATHER)]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "a", "arguments": {"x": [1, 2]}, "id": "abcDEF123"}, '
                '{"name": "b", "arguments": {}}]', "Sure. ", [("a", '{"x": [1, 2]}'), ("b", "{}")]),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}', None, None),
    ("mistral", "[TOOL_CALLS] not a list", None, None),
    ("mistral", "No tools needed.", "No tools needed.", []),
    # Qwen3-Coder's XML, as llama.cpp's tests/test-chat.cpp records it (a reply may leave out the
    # first <tool_call>); values are JSON where they read as JSON, else text
    ("qwen3_coder", "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n"
                    "</tool_call>", None, [("special_function", '{"arg1": 1}')]),
    ("qwen3_coder", "Let me call it.\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n"
                    "</tool_call>", "Let me call it.\n", [("special_function", '{"arg1": 1}')]),
    ("qwen3_coder", "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n"
                    "</tool_call>\n<tool_call>\n<function=special_function_with_opt>\n<parameter=arg1>\n1\n"
                    "</parameter>\n<parameter=arg2>\n2\n</parameter>\n</function>\n</tool_call>", None,
     [("special_function", '{"arg1": 1}'), ("special_function_with_opt", '{"arg1": 1, "arg2": 2}')]),
    ("qwen3_coder", '<tool_call>\n<function=python>\n<parameter=code>\ndef hello():\n    print("Hello, world!")\n\n'
                    "hello()\n</parameter>\n</function>\n</tool_call>", None,
     [("python", '{"code": "def hello():\\n    print(\\"Hello, world!\\")\\n\\nhello()"}')]),
    ("qwen3_coder", "<tool_call>\n<function=html>\n<parameter=markup>\n<html>\n <head>\n  <title>Hello!</title>\n"
                    " </head>\n</html>\n</parameter>\n</function>\n</tool_call>", None,
     [("html", '{"markup": "<html>\\n <head>\\n  <title>Hello!</title>\\n </head>\\n</html>"}')]),
    ("qwen3_coder", '<tool_call>\n<function=todo_list>\n<parameter=todos>\n[{"item": "Check stuff", "selected": false}]'
                    "\n</parameter>\n</function>\n</tool_call>", None,
     [("todo_list", '{"todos": [{"item": "Check stuff", "selected": false}]}')]),
    ("qwen3_coder", "Hello, world!\nWhat's up?", "Hello, world!\nWhat's up?", []),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1\n", None, None),  # stopped inside a value
    # DeepSeek: V3.1's form as llama.cpp records it, R1's as its template writes it
    ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"city": "XYZCITY"}'
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None, [("get_time", '{"city": "XYZCITY"}')]),
    ("deepseek_v3", 'CONTENT<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"city": "Paris"}'
                    '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "CONTENT",
     [("get_time", '{"city": "Paris"}'), ("get_weather", '{"city": "Paris"}')]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    f"{WEATHER}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
                    '```json\n{"tz": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None,
     [("get_weather", WEATHER), ("get_time", '{"tz": "UTC"}')]),
    ("deepseek_v3", "The weather is fine.", "The weather is fine.", []),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"city\": ", None, None),
]


@pytest.mark.parametrize("family, text, content, calls", RECORDED)
def test_recorded_outputs(family, text, content, calls):
    got_content, got = get_tool_parser(family).extract(text)
    if calls is None:  # malformed: nothing is lost, nothing is called
        assert (got_content, got) == (text, [])
        return
    assert [(c.name, c.arguments) for c in got] == calls
    assert got_content == content
    for c in got:
        assert isinstance(json.loads(c.arguments), dict)


def stream(parser: ReplyParser, text: str, step: int = 3) -> list[dict]:
    deltas = []
    for end in range(step, len(text), step):
        deltas += parser.deltas(text[:end], final=False)
    return deltas + parser.deltas(text, final=True)


def assemble(deltas: list[dict]) -> tuple[str, list[list[str]]]:
    content, calls = "", []
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] == len(calls) and tc["function"]["arguments"] == ""  # the name comes first
                calls.append([tc["function"]["name"], ""])
            calls[tc["index"]][1] += tc["function"].get("arguments", "")
    return content, calls


@pytest.mark.parametrize("family, text, content, calls", [r for r in RECORDED if r[3] is not None])
@pytest.mark.parametrize("step", [1, 4])
def test_streamed_deltas_add_up_to_the_whole(family, text, content, calls, step):
    parser = get_tool_parser(family)
    message, finish = ReplyParser(None, None, parser).message(text, "stop")
    got_content, got_calls = assemble(stream(ReplyParser(None, None, parser), text, step))
    assert (got_content or None) == message["content"] == content
    assert [tuple(c) for c in got_calls] == calls
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == calls
    assert finish == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize("family, text, content, calls", [r for r in RECORDED if r[3] is None])
def test_malformed_streams_do_not_crash(family, text, content, calls):
    got_content, got_calls = assemble(stream(ReplyParser(None, None, get_tool_parser(family)), text, 2))
    assert got_content or got_calls


def test_call_ids():
    hermes, mistral = get_tool_parser("hermes").new_call_id(), get_tool_parser("mistral").new_call_id()
    assert hermes.startswith("call_") and len(hermes) == 29
    assert len(mistral) == 9 and mistral.isalnum()  # Mistral's templates reject any other id


@pytest.mark.parametrize("template, family", [
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes"),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"),
    ("Qwen-Qwen3-0.6B.jinja", "hermes"),
    ("HuggingFaceTB-SmolLM3-3B.jinja", "hermes"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3_json"),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek_v3"),
    ("Qwen3-Coder.jinja", "qwen3_coder"),
    ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek_v3"),
])
def test_parser_inferred_from_template(template, family):
    assert infer_tool_parser(template_source(template)) == family


def template_source(name: str) -> str:
    local = DATA / name  # templates not in shared/fixtures (see tests/data/README.md)
    return local.read_text() if local.exists() else shared_path(f"fixtures/chat_templates/{name}").read_text()


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}}}]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [{"id": "abcDEF123", "type": "function", "function": {
        "name": "get_weather", "arguments": WEATHER}}]},
    {"role": "tool", "tool_call_id": "abcDEF123", "content": "22 degrees"},
]


@pytest.mark.parametrize("template, family", [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3_json"),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral"),
])
def test_templates_render_calls_in_the_parsers_syntax(template, family):
    """What a template writes for an assistant's call is what the parser reads back."""
    source = shared_path(f"fixtures/chat_templates/{template}").read_text()
    parser = get_tool_parser(family)
    messages = template_messages(HISTORY, TOOLS, source, parser)
    prompt = render_chat(source, messages, tools=TOOLS, bos_token="<s>", eos_token="</s>")
    rendered = parser.render([ToolCall("get_weather", WEATHER)])
    written = rendered[:-2] if family == "mistral" else rendered  # Mistral adds the id to the call object
    assert written in prompt
    assert "22 degrees" in prompt


TYPED = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"},
    "zip": {"type": "string"}}}}}]


@pytest.mark.parametrize("template, family, start, end", [
    ("Qwen3-Coder.jinja", "qwen3_coder", "<tool_call>", "</tool_call>"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek_v3", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
    ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek_v3", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
])
def test_calls_as_templates_write_them_read_back(template, family, start, end):
    """A call rendered by the family's own template (what its models are trained to write) parses
    back to the same name and arguments, typed by the tool's schema where the format is text."""
    source = template_source(template)
    args = {"city": "Paris", "days": 3, "hourly": True, "zip": "75001"}
    # (content "": DeepSeek-R1's template fails on a call without content, under transformers too)
    history = [HISTORY[0], {"role": "assistant", "content": "", "tool_calls": [{
        "id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
        HISTORY[2]]
    parser = get_tool_parser(family).for_tools(TYPED)
    prompt = render_chat(source, template_messages(history, TYPED, source, parser), tools=TYPED,
                         bos_token="<s>", eos_token="</s>")
    written = prompt[prompt.rindex(start):prompt.rindex(end) + len(end)]  # (after the system prompt's example)
    content, calls = parser.extract(written)
    assert content is None and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == args


@pytest.fixture(scope="module")
def tok():
    from pocketllm.tokenizer import get_tokenizer

    return get_tokenizer(default_model_gguf())


def test_templates_without_tool_support_get_them_written_in(tok):
    """The default model's ChatML template knows no tools: the list goes in the system message,
    calls and results are written as Hermes text."""
    parser = get_tool_parser(infer_tool_parser(tok.chat_template))
    assert parser.name == "hermes"
    messages = template_messages(HISTORY, TOOLS, tok.chat_template, parser)
    prompt = tok.apply_chat_template(messages, tools=TOOLS)
    assert prompt.startswith("<|im_start|>system\n# Tools")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in prompt
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\n22 degrees\n</tool_response><|im_end|>" in prompt


@pytest.fixture(scope="module")
def structured(tok):
    from pocketllm.structured.backend import StructuredOutputs

    return StructuredOutputs(tok, tok.vocab_size, tok.eos_token_ids)


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral", "qwen3_coder", "deepseek_v3"])
@pytest.mark.parametrize("parallel", [False, True])
def test_forced_call_grammar_accepts_the_parsers_syntax(structured, family, parallel):
    import xgrammar as xgr

    from pocketllm.structured.spec import normalize

    parser = get_tool_parser(family)
    tools = TOOLS + [{"type": "function", "function": {"name": "get_time"}}]
    spec = normalize(tool_constraint(tools, "required", parallel, parser))
    compiled = structured.compile(spec)
    one = parser.render([ToolCall("get_weather", '{"city": "Oslo"}')])
    two = parser.render([ToolCall("get_weather", '{"city": "Oslo", "unit": "celsius"}'), ToolCall("get_time", "{}")])
    for text, ok in [(one, True), (two, parallel)]:
        matcher = xgr.GrammarMatcher(compiled)
        assert (matcher.accept_string(text) and matcher.is_completed()) == ok, text
    bad = parser.render([ToolCall("get_weather", '{"unit": "celsius"}')])  # "city" is required
    assert not xgr.GrammarMatcher(compiled).accept_string(bad)
    named = normalize(tool_constraint(tools, {"type": "function", "function": {"name": "get_time"}}, True, parser))
    matcher = xgr.GrammarMatcher(structured.compile(named))
    assert not matcher.accept_string(one)
    assert parser.extract(one)[1] == [ToolCall("get_weather", '{"city": "Oslo"}')]


FENCED = f'```json\n{{"name": "get_weather", "arguments": {WEATHER}}}\n```'
# (model output, expected content, expected [(name, arguments)]) with the tools TOOLS + get_time
FALLBACK = [
    # Qwen2.5-Coder-1.5B-Instruct's reply to a weather question with tool_choice auto
    (FENCED, None, [("get_weather", WEATHER)]),
    ("I'll check the weather.\n" + FENCED + "\n", "I'll check the weather.\n", [("get_weather", WEATHER)]),
    (f'```\n{{"name": "get_weather", "parameters": {WEATHER}}}\n```', None, [("get_weather", WEATHER)]),
    (f'{{"name": "get_weather", "arguments": {WEATHER}}}', None, [("get_weather", WEATHER)]),
    ('[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]', None,
     [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
    (FENCED + '\n```json\n{"name": "get_time", "arguments": {}}\n```', None,
     [("get_weather", WEATHER), ("get_time", "{}")]),
    ('{"type": "function", "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}}', None,
     [("get_weather", '{"city": "Oslo"}')]),
    (FENCED[:-3], None, [("get_weather", WEATHER)]),  # stopped before the closing fence
    # text, however close to a call
    ('I would call get_weather with {"city": "Paris"}.', 'I would call get_weather with {"city": "Paris"}.', []),
    ('```json\n{"name": "get_forecast", "arguments": {"city": "Paris"}}\n```', None, []),
    ('```json\n{"name": "get_weather", "arguments": {"unit": "celsius"}}\n```', None, []),  # "city" is required
    (FENCED + "\nThen I will tell you.", None, []),
    ('```json\n{"name": "get_weather", "description": "Weather", "parameters": {"city": "Paris"}}\n```', None, []),
    ('```python\nprint(get_weather("Paris"))\n```', None, []),
    ('{"city": "Paris", "unit": "celsius"}', None, []),
]


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral", "qwen3_coder", "deepseek_v3"])
@pytest.mark.parametrize("text, content, calls", FALLBACK)
def test_calls_written_as_json_are_found(family, text, content, calls):
    """With tool_choice auto, a call written as (fenced) JSON instead of the family's syntax is a
    call when it names one of the request's tools with valid arguments, whole and streamed; the
    stream never shows its text as content."""
    tools = TOOLS + [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    content = text if content is None and not calls else content
    message, finish = ReplyParser(None, None, get_tool_parser(family).for_tools(tools)).message(text, "stop")
    assert message["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == calls
    assert finish == ("tool_calls" if calls else "stop")
    for step in (1, 5):
        deltas = stream(ReplyParser(None, None, get_tool_parser(family).for_tools(tools)), text, step)
        got_content, got_calls = assemble(deltas)
        assert (got_content or None) == content and [tuple(c) for c in got_calls] == calls


def test_code_blocks_that_are_not_calls_stream_as_they_come():
    parser = ReplyParser(None, None, get_tool_parser("hermes").for_tools(TOOLS))
    text = 'Here:\n```python\nprint(get_weather("Paris"))\n```\nand {"city": "Paris"}\n{"name": "Paris"}'
    early = "".join(d.get("content", "") for end in range(1, len(text)) for d in parser.deltas(text[:end], False))
    assert early == text[:-1]


def test_holding_back_costs_linear_time_over_a_stream(monkeypatch):
    """Text already shown is never looked at again: over a streamed reply of pretty-printed JSON
    (hundreds of lines that open with "{"), each line is weighed as a call a bounded number of times."""
    from pocketllm.structured.tool_parsers import JsonFallback

    looked = []
    original = JsonFallback._may_become_calls
    monkeypatch.setattr(JsonFallback, "_may_become_calls", lambda self, text, pos: looked.append(pos) or
                        original(self, text, pos))
    doc = json.dumps({"items": [{"a": i, "b": [1, {"c": "x"}]} for i in range(200)]}, indent=2)
    parser = ReplyParser(None, None, get_tool_parser("hermes").for_tools(TOOLS))
    content, calls = assemble(stream(parser, doc, 4))
    assert content == doc and not calls
    lines = sum(line.lstrip().startswith(("{", "[")) for line in doc.splitlines())
    assert len(looked) <= 2 * lines, (len(looked), lines)
