"""Structured outputs, tool calls and reasoning through `pocketllm serve` on the default model,
driven with the official `openai` client."""
from __future__ import annotations

import asyncio
import json
import tempfile

import httpx
import jsonschema
import openai
import pytest
from live_server import Server, collect_chat_stream
from test_server import error_of
from test_structured import SCHEMAS

# ChatML that shows the reasoning of earlier turns and opens a <think> block for the reply, unless
# enable_thinking is false (then it writes an empty, closed one), as Qwen3's template does.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}}, "required": ["tz"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time",
                                           "parameters": CLOCK}}]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def servers():
    with tempfile.NamedTemporaryFile("w", suffix=".jinja") as template:
        template.write(THINKING_TEMPLATE)
        template.flush()
        # Both load at once; the first has tool calls, the second reasoning.
        tools = Server("--served-model-name", "m", "--tool-call-parser", "hermes")
        thinking = Server("--served-model-name", "m", "--reasoning-parser", "qwen3", "--chat-template", template.name)
        yield tools.wait_ready(), thinking.wait_ready()
        assert tools.stop() == 0 and thinking.stop() == 0


def clients(server):
    return (openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120),
            openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120))


@pytest.fixture(scope="module")
def tools_server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def client(tools_server):
    return clients(tools_server)[0]


async def collect_stream(stream) -> tuple[str, list[list[str]], str]:
    """Content, [[name, arguments]] and finish reason of a streamed chat choice."""
    _, content, calls, finish = await collect_chat_stream(stream)
    return content, calls, finish


def test_json_schemas_streamed_and_not(tools_server):
    """Each schema twice more (13 with the offline tests): response_format, not streamed, and
    vLLM's structured_outputs, streamed; all requests at once, so the engine batches them."""
    _, aclient = clients(tools_server)

    async def one(name, schema, stream):
        messages = [{"role": "user", "content": f"Give me JSON for {name.replace('_', ' ')}."}]
        common = dict(model="m", messages=messages, max_tokens=96, temperature=1.0, seed=len(name))
        if not stream:
            r = await aclient.chat.completions.create(
                **common, response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
            return r.choices[0].message.content, r.choices[0].finish_reason
        content, calls, finish = await collect_stream(await aclient.chat.completions.create(
            **common, stream=True, extra_body={"structured_outputs": {"json": schema}}))
        assert not calls
        return content, finish

    async def main():
        async with aclient:
            jobs = [one(name, schema, stream) for name, schema in SCHEMAS.items() for stream in (False, True)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    for (name, schema), pair in zip(SCHEMAS.items(), zip(results[::2], results[1::2])):
        for text, finish in pair:
            assert finish == "stop", (name, text)
            jsonschema.validate(json.loads(text), schema)


def test_completions_regex_choice_and_json_object(client):
    r = client.completions.create(model="m", prompt="My phone number is", max_tokens=20, temperature=0.8, n=3,
                                  seed=1, extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert all(c.finish_reason == "stop" and len(c.text) == 8 and c.text[3] == "-" for c in r.choices)
    stream = client.completions.create(model="m", prompt="The best color is", max_tokens=10, stream=True,
                                       extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert "".join(c.choices[0].text for c in stream) in ("red", "green", "blue")
    shots = 'Q: a point\nA: {"x": 1, "y": 2}\nQ: a color\nA: {"name": "red"}\nQ: a city\nA: '
    r = client.completions.create(model="m", prompt=shots, max_tokens=40, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)


def check_calls(calls, names=None):
    assert calls
    for name, arguments in calls:
        assert names is None or name in names
        jsonschema.validate(json.loads(arguments), SCHEMA_OF[name])


def test_named_and_required_tool_choice(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, n in ((named, 2), ("required", 2)):
        # One call a choice: with parallel calls a random model may write calls until max_tokens.
        r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice, n=n,
                                           max_tokens=128, temperature=1.0, seed=3, parallel_tool_calls=False)
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
            check_calls(calls, ["get_time"] if choice is named else None)
            assert all(t.id.startswith("call_") and t.type == "function" for t in c.message.tool_calls)
    single = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=128, temperature=0)
    assert len(single.choices[0].message.tool_calls) == 1


def test_streamed_tool_calls(tools_server):
    _, aclient = clients(tools_server)

    async def one(i, choice):
        return await collect_stream(await aclient.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=128, temperature=0.7, seed=i,
            stream=True))

    async def main():
        async with aclient:
            return await asyncio.gather(one(0, "required"),
                                        one(1, {"type": "function", "function": {"name": "get_weather"}}))

    for content, calls, finish in asyncio.run(main()):
        assert finish == "tool_calls" and content == ""
        check_calls(calls)
    assert calls[0][0] == "get_weather" and len(calls) == 1


def test_auto_tool_choice_and_tool_history(client):
    """Free text may or may not call; whatever it does is parsed, and a conversation with calls and
    results renders through the (tool-less) template."""
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 25 C"}]
    for messages in (ASK, history):
        r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=24, temperature=0)
        c = r.choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls"
            check_calls([(t.function.name, t.function.arguments) for t in c.message.tool_calls])
        else:
            assert c.finish_reason in ("stop", "length") and c.message.content
    none = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8,
                                          temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_calls_written_as_json_are_calls(tools_server):
    """tool_choice auto, a Hermes template: a reply written as a fenced JSON call (as Qwen2.5-Coder
    writes them) is a call, streamed or not; one that only names a tool, or calls it with arguments
    its schema rejects, is content. A `choice` constraint makes the model write each reply."""
    client, aclient = clients(tools_server)
    call = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
    # (reply, content when it calls, or None when it is text)
    replies = [(f"```json\n{call}\n```", ""), (f"Calling it.\n{call}", "Calling it.\n"),
               ("I could call get_weather for Paris.", None),
               ('```json\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 9}}\n```', None)]

    async def streamed(text):
        return await collect_stream(await aclient.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, max_tokens=96, temperature=0, stream=True,
            extra_body={"structured_outputs": {"choice": [text]}}))

    async def main():
        async with aclient:
            return await asyncio.gather(*(streamed(text) for text, _ in replies))

    for (text, called_content), (content, calls, finish) in zip(replies, asyncio.run(main())):
        r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=96, temperature=0,
                                           extra_body={"structured_outputs": {"choice": [text]}})
        message = r.choices[0].message
        whole = [(t.function.name, t.function.arguments) for t in message.tool_calls or []]
        assert [tuple(c) for c in calls] == whole
        if called_content is not None:
            assert r.choices[0].finish_reason == finish == "tool_calls"
            assert [(n, json.loads(a)) for n, a in whole] == [("get_weather", {"city": "Paris", "days": 3})]
            assert (message.content or "") == content == called_content
        else:
            assert r.choices[0].finish_reason == finish == "stop" and message.content == content == text


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectt"}}}},
     "response_format", 'invalid JSON schema: Unsupported type "objectt"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"structured_outputs": {"regex": "(["}}, "structured_outputs", "invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs", "invalid grammar"),
    ({"structured_outputs": {"choice": "red"}}, "structured_outputs", "'choice' must be a non-empty list"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "not both"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when 'tools'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nothing"}}}],
      "tool_choice": "required"}, "tools", "invalid tool parameters schema"),
])
def test_bad_constraints_are_400s(tools_server, body, param, words):
    r = httpx.post(f"{tools_server.url}/v1/chat/completions", json={"model": "m", "messages": ASK, **body})
    err = error_of(r, 400)
    assert err["param"] == param and words in err["message"]
    assert httpx.get(f"{tools_server.url}/health").status_code == 200


# -- reasoning ----------------------------------------------------------------------------------
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 100}},
          "required": ["answer"], "additionalProperties": False}
# One earlier exchange shows the tiny model how a reasoned reply looks.
SHOWN = [{"role": "user", "content": "What is 2+2?"},
         {"role": "assistant", "reasoning_content": "The user asks 2+2. That is 4.\n", "content": '{"answer": 4}'},
         {"role": "user", "content": "What is 3+5?"}]


def test_reasoning_split_and_constrained_after_it(servers):
    client, aclient = clients(servers[1])
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    r = client.chat.completions.create(model="m", messages=SHOWN, max_tokens=80, temperature=0, response_format=fmt)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert message.reasoning_content and "</think>" not in message.reasoning_content
    jsonschema.validate(json.loads(message.content), ANSWER)

    async def streamed():
        reasoning, content = "", ""
        async with aclient:
            async for chunk in await aclient.chat.completions.create(
                    model="m", messages=SHOWN, max_tokens=80, temperature=0, response_format=fmt, stream=True):
                delta = chunk.choices[0].delta
                reasoning += getattr(delta, "reasoning_content", None) or ""
                content += delta.content or ""
        return reasoning, content

    assert asyncio.run(streamed()) == (message.reasoning_content, message.content)
    # Thinking turned off: the template closes the block, the whole reply is content and constrained.
    off = client.chat.completions.create(model="m", messages=SHOWN, max_tokens=40, temperature=0, response_format=fmt,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.reasoning_content is None
    jsonschema.validate(json.loads(off.choices[0].message.content), ANSWER)
