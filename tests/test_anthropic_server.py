"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) on the default model, driven with
the official `anthropic` client: the same greedy answer as `/v1/chat/completions` (the `openai` client)
for the same conversation, the documented event order when streamed, tools over two turns, stop
reasons, the `x-api-key` header, and Anthropic's error shape for bad input."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from fixtures import default_model_gguf
from live_server import in_process
from test_structured_server import THINKING_TEMPLATE

from pocketllm import LLM
from pocketllm.server.api_server import create_app
from pocketllm.server.async_llm import AsyncLLM
from pocketllm.server.config import ServerConfig

API_KEY = "sk-ant-test"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
T0 = {"temperature": 0}  # greedy (the client's 2.x methods no longer name the sampling fields)


@pytest.fixture(scope="module")
def url():
    llm = LLM(str(default_model_gguf()), max_model_len=2048, kv_cache_memory=160 << 20, exact_kernels=True)
    app = create_app(AsyncLLM(llm.engine), ServerConfig(model_name="smol", api_key=API_KEY))
    with in_process(app) as base:
        yield base
    llm.engine.check_no_leaks()


@pytest.fixture(scope="module")
def client(url):
    return anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=120)


def test_a_message_is_the_chat_completion_of_the_same_conversation(client, url):
    reply = client.messages.create(model="smol", max_tokens=24, extra_body=T0, messages=QUESTION,
                                   system="Answer in one sentence.")
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0).chat.completions.create(
        model="smol", max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "Answer in one sentence."}, *QUESTION])
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert [b.type for b in reply.content] == ["text"]
    assert reply.content[0].text == chat.choices[0].message.content
    assert reply.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    counted = client.messages.count_tokens(model="smol", messages=QUESTION, system="Answer in one sentence.")
    assert counted.input_tokens == reply.usage.input_tokens


def test_a_streamed_message_sends_the_documented_events_in_order(client):
    whole = client.messages.create(model="smol", max_tokens=16, extra_body=T0, messages=QUESTION)
    with client.messages.stream(model="smol", max_tokens=16, extra_body=T0, messages=QUESTION) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text", "input_json")]  # (the helper's own events)
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences_and_max_tokens_are_the_stop_reasons(client):
    first = client.messages.create(model="smol", max_tokens=24, extra_body=T0, messages=QUESTION)
    word = first.content[0].text.split()[2]
    stopped = client.messages.create(model="smol", max_tokens=24, extra_body=T0, messages=QUESTION,
                                     stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text
    cut = client.messages.create(model="smol", max_tokens=2, extra_body=T0, messages=QUESTION)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


def test_tools_over_two_turns(client):
    """A forced call (tool_choice tool) is a tool_use block whose input fits the schema, streamed as
    input_json deltas the client assembles; the tool's result in the next turn gets a text answer."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.messages.create(model="smol", max_tokens=64, extra_body=T0, messages=ask, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert reply.stop_reason == "tool_use"
    (call,) = [b for b in reply.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input["city"], str)
    with client.messages.stream(model="smol", max_tokens=64, extra_body=T0, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert "input_json" in kinds
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(call.name, call.input)]
    second = client.messages.create(
        model="smol", max_tokens=24, extra_body=T0, tools=[WEATHER],
        messages=[*ask, {"role": "assistant", "content": reply.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                "content": "Sunny, 24 C"}]}],
        tool_choice={"type": "none"})
    assert second.stop_reason in ("end_turn", "max_tokens") and second.content[0].type == "text"
    assert second.content[0].text


def test_output_config_format_holds_the_reply_to_a_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    reply = client.messages.create(model="smol", max_tokens=40, extra_body=T0, messages=QUESTION,
                                   output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(reply.content[0].text), schema)


def test_bad_input_gets_anthropics_error_shape(client, url):
    with pytest.raises(anthropic.BadRequestError) as e:  # max_tokens is required
        client.post("/v1/messages", body={"model": "smol", "messages": QUESTION}, cast_to=httpx.Response)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="'image' blocks are not supported"):
        client.messages.create(model="smol", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-other", max_tokens=8, messages=QUESTION)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="smol", max_tokens=8, messages=QUESTION)
    assert e.value.body["error"]["type"] == "authentication_error"
    raw = httpx.post(f"{url}/v1/messages", content=b"{not json", headers={"x-api-key": API_KEY,
                                                                          "content-type": "application/json"})
    assert raw.status_code == 400 and json.loads(raw.text)["type"] == "error"
    # (the OpenAI routes keep OpenAI's shape)
    raw = httpx.post(f"{url}/v1/chat/completions", content=b"{not json",
                     headers={"authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    assert raw.status_code == 400 and "error" in json.loads(raw.text) and "type" not in json.loads(raw.text)


def test_reasoning_models_answer_with_thinking_blocks():
    """With a reasoning parser, the reply's reasoning is a `thinking` block (thinking_delta events when
    streamed), its earlier turns' thinking blocks go back to the template, and thinking disabled leaves none."""
    llm = LLM(str(default_model_gguf()), max_model_len=1024, kv_cache_memory=64 << 20, exact_kernels=True)
    app = create_app(AsyncLLM(llm.engine), ServerConfig(model_name="smol", reasoning_parser="qwen3",
                                                        chat_template=THINKING_TEMPLATE))
    shown = [{"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "The user asks 2+2. That is 4.\n",
                                                "signature": ""}, {"type": "text", "text": "4"}]},
             {"role": "user", "content": "What is 3+5?"}]
    with in_process(app) as base:
        client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=120)
        reply = client.messages.create(model="smol", max_tokens=48, extra_body=T0, messages=shown)
        assert reply.content[0].type == "thinking" and reply.content[0].thinking
        assert "</think>" not in reply.content[0].thinking
        with client.messages.stream(model="smol", max_tokens=48, extra_body=T0, messages=shown) as stream:
            kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
            streamed = stream.get_final_message()
        assert ("content_block_delta", "thinking_delta") in kinds
        assert [b.model_dump(exclude={"signature"}) for b in streamed.content] == \
            [b.model_dump(exclude={"signature"}) for b in reply.content]
        off = client.messages.create(model="smol", max_tokens=16, extra_body=T0, messages=shown,
                                     thinking={"type": "disabled"})
        assert [b.type for b in off.content] == ["text"]
    llm.engine.check_no_leaks()
