"""OpenAI's Responses API (`/v1/responses`) on the default model, driven with the official `openai` client:
the greedy answer chat gives, streamed with the documented events in order, `responses.parse` into a
pydantic model, function tools over two turns through `previous_response_id`, stored responses retrieved
and deleted, and OpenAI's errors."""
from __future__ import annotations

import json

import openai
import pytest
from fixtures import default_model_gguf
from live_server import in_process
from pydantic import BaseModel

from pocketllm import LLM
from pocketllm.server.api_server import create_app
from pocketllm.server.async_llm import AsyncLLM
from pocketllm.server.config import ServerConfig

NAME = "smol"
QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client():
    llm = LLM(str(default_model_gguf()), max_model_len=2048, kv_cache_memory=160 << 20, exact_kernels=True)
    with in_process(create_app(AsyncLLM(llm.engine), ServerConfig(model_name=NAME))) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    llm.engine.check_no_leaks()


def test_a_response_is_the_chat_completion_streamed_or_not(client):
    chat = client.chat.completions.create(model=NAME, temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])
    r = client.responses.create(model=NAME, input=QUESTION, instructions="Be brief.", temperature=0,
                                max_output_tokens=24)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    with client.responses.stream(model=NAME, input=QUESTION, instructions="Be brief.", temperature=0,
                                 max_output_tokens=24) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_response()
    assert final.output_text == r.output_text
    deltas = [i for i, e in enumerate(events) if e == "response.output_text.delta"]
    assert events[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                          "response.content_part.added", "response.output_text.delta"]
    assert events[deltas[-1] + 1:] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done",
                                       "response.completed" if r.status == "completed" else "response.incomplete"]


def test_parse_into_a_pydantic_model(client):
    class Capital(BaseModel):
        city: str
        country: str

    parsed = client.responses.parse(model=NAME, input=QUESTION, text_format=Capital, temperature=0,
                                    max_output_tokens=64)
    assert isinstance(parsed.output_parsed, Capital)
    assert Capital.model_validate_json(parsed.output_text) == parsed.output_parsed


def test_function_tools_over_two_turns_with_previous_response_id(client):
    first = client.responses.create(model=NAME, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                    max_output_tokens=48)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    with client.responses.stream(model=NAME, input="What is the weather in Paris?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                 max_output_tokens=48) as stream:
        events = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.delta" in events and "response.function_call_arguments.done" in events
    assert [(i.name, i.arguments) for i in streamed.output if i.type == "function_call"] == [(call.name,
                                                                                             call.arguments)]
    second = client.responses.create(model=NAME, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Sunny, 24 C"}], temperature=0, max_output_tokens=24)
    assert second.previous_response_id == first.id and second.output_text
    # the second turn's prompt held the first's question, call and result: more tokens than the result alone
    assert second.usage.input_tokens > first.usage.input_tokens


def test_stored_responses_are_retrieved_and_deleted(client):
    r = client.responses.create(model=NAME, input=QUESTION, temperature=0, max_output_tokens=8)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model=NAME, input=QUESTION, temperature=0, max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=NAME, input="Hi", previous_response_id="resp_unknown")


def test_bad_input_gets_openai_errors(client):
    with pytest.raises(openai.BadRequestError, match="only function tools"):
        client.responses.create(model=NAME, input=QUESTION, tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="not supported by this server"):
        client.responses.create(model=NAME, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/a.png"}]}])
    with pytest.raises(openai.BadRequestError, match="max_output_tokens"):
        client.responses.create(model=NAME, input=QUESTION, max_output_tokens=0)
    with pytest.raises(openai.BadRequestError, match="does not serve embeddings"):  # a clear 400, not a 404
        client.embeddings.create(model=NAME, input="hello")
