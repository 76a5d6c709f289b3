"""A gpt-oss GGUF through `pocketllm serve`, with no parser flags, driven with the official `openai`
client: its o200k vocabulary loads ("gpt-4o" pre-tokenizer), its chat template renders the request,
harmony parsers are chosen for it, and its replies come back as reasoning_content, content and
tool_calls, whole and streamed. The model (tests/tiny_harmony.py) writes a fixed harmony reply, or,
under a grammar, the same reasoning and then what the grammar forces (its headers often spelled in
single characters rather than harmony's tokens: the same text)."""
from __future__ import annotations

import asyncio
import json

import gguf
import jsonschema
import openai
import pytest
from live_server import Server, collect_chat_stream
from tiny_harmony import make_harmony_model

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_harmony_model(tmp_path_factory.mktemp("harmony"))
    assert gguf.GGUFReader(path).get_field("tokenizer.ggml.pre").contents() == "gpt-4o"
    server = Server("--served-model-name", "gpt-oss-tiny", model=path).wait_ready()
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def both(client, **request):
    """(the whole reply's choice, the streamed one's parts) of one request."""
    request.setdefault("max_tokens", 200)
    whole = client.chat.completions.create(model="gpt-oss-tiny", temperature=0, **request)

    async def streamed():
        async with openai.AsyncOpenAI(base_url=str(client.base_url), api_key="x", max_retries=0, timeout=60) as aclient:
            return await collect_chat_stream(await aclient.chat.completions.create(
                model="gpt-oss-tiny", temperature=0, stream=True, **request))

    return whole.choices[0], asyncio.run(streamed())


def test_reasoning_and_answer(client):
    choice, streamed = both(client, messages=ASK)
    assert (choice.message.reasoning_content, choice.message.content) == ("Need weather.", "Sunny!")
    assert choice.finish_reason == "stop" and not choice.message.tool_calls  # <|return|> ended it
    assert streamed == ("Need weather.", "Sunny!", [], "stop")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call(client, tool_choice):
    choice, (reasoning, content, calls, finish) = both(client, messages=ASK, tools=TOOLS, tool_choice=tool_choice)
    message = choice.message
    assert choice.finish_reason == finish == "tool_calls"
    assert message.reasoning_content == reasoning == "Need weather."
    assert message.content is None and content == ""
    [call] = message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert calls == [["get_weather", call.function.arguments]]


def test_tool_history_and_json_answer(client):
    """A conversation with the reply above sent back renders through gpt-oss's template; a JSON
    answer comes in the final message, after the reasoning."""
    first = client.chat.completions.create(model="gpt-oss-tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=200).choices[0].message
    history = ASK + [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"sky": "clear"}'}]
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": WEATHER}}
    choice, (reasoning, content, calls, finish) = both(client, messages=history, tools=TOOLS, response_format=fmt)
    assert choice.message.reasoning_content == reasoning == "Need weather."
    jsonschema.validate(json.loads(choice.message.content), WEATHER)
    assert content == choice.message.content and not calls and choice.finish_reason == finish == "stop"
