"""Ollama's API on the default model, driven with the official `ollama` client: `chat` and `generate`
(streamed as NDJSON and not) give the greedy answer `/v1/chat/completions` gives, `options` reach the
sampler, `format` constrains, `list`, `show` and `ps` describe the model, and errors are Ollama's
`{"error": ...}` objects."""
from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import openai
import pytest
from fixtures import default_model_gguf
from live_server import in_process

from pocketllm import LLM
from pocketllm.server.api_server import create_app
from pocketllm.server.async_llm import AsyncLLM
from pocketllm.server.config import ServerConfig

NAME = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 24}


@pytest.fixture(scope="module")
def url():
    llm = LLM(str(default_model_gguf()), max_model_len=2048, kv_cache_memory=160 << 20, exact_kernels=True)
    with in_process(create_app(AsyncLLM(llm.engine), ServerConfig(model_name=NAME))) as base:
        yield base
    llm.engine.check_no_leaks()


@pytest.fixture(scope="module")
def client(url):
    return ollama.Client(host=url, timeout=120)


def test_chat_is_the_chat_completion_streamed_or_not(client, url):
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).chat.completions.create(
        model=NAME, messages=QUESTION, temperature=0, max_tokens=24)
    reply = client.chat(model=f"{NAME}:latest", messages=QUESTION, options=GREEDY)
    assert reply.message.role == "assistant" and reply.message.content == chat.choices[0].message.content
    assert reply.done and reply.done_reason == {"stop": "stop", "length": "length"}[chat.choices[0].finish_reason]
    assert reply.prompt_eval_count == chat.usage.prompt_tokens and reply.eval_count == chat.usage.completion_tokens
    assert reply.total_duration >= reply.prompt_eval_duration > 0
    parts = list(client.chat(model=NAME, messages=QUESTION, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].eval_count == reply.eval_count
    assert "".join(p.message.content for p in parts) == reply.message.content
    raw = httpx.post(f"{url}/api/chat", json={"model": NAME, "messages": QUESTION, "options": GREEDY})
    assert raw.headers["content-type"].startswith("application/x-ndjson")  # streamed by default, as Ollama
    assert [json.loads(line)["done"] for line in raw.text.splitlines()][-1] is True


def test_generate_applies_the_template_unless_raw(client, url):
    chat = client.chat(model=NAME, messages=[{"role": "system", "content": "Be brief."}, *QUESTION], options=GREEDY)
    generated = client.generate(model=NAME, prompt=QUESTION[0]["content"], system="Be brief.", options=GREEDY)
    assert generated.response == chat.message.content
    streamed = list(client.generate(model=NAME, prompt=QUESTION[0]["content"], system="Be brief.", options=GREEDY,
                                    stream=True))
    assert "".join(p.response for p in streamed) == generated.response
    raw = client.generate(model=NAME, prompt="The capital of France is", raw=True, options={**GREEDY, "num_predict": 6})
    done = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).completions.create(
        model=NAME, prompt="The capital of France is", temperature=0, max_tokens=6)
    assert raw.response == done.choices[0].text and raw.done_reason == "length" and raw.eval_count == 6


def test_options_and_format_reach_the_sampler(client):
    cut = client.chat(model=NAME, messages=QUESTION, options={"temperature": 0, "num_predict": 3})
    assert cut.done_reason == "length" and cut.eval_count == 3
    full = client.chat(model=NAME, messages=QUESTION, options=GREEDY).message.content
    word = full.split()[1]
    stopped = client.chat(model=NAME, messages=QUESTION, options={**GREEDY, "stop": [word]})
    assert word not in stopped.message.content and full.startswith(stopped.message.content)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    shaped = client.chat(model=NAME, messages=QUESTION, format=schema, options={"temperature": 0, "num_predict": 40})
    jsonschema.validate(json.loads(shaped.message.content), schema)
    as_json = client.chat(model=NAME, messages=QUESTION, format="json", options={"temperature": 0, "num_predict": 40})
    assert isinstance(json.loads(as_json.message.content), dict)


def test_list_show_and_ps_describe_the_served_model(client):
    (model,) = client.list().models
    assert model.model == NAME and model.size == default_model_gguf().stat().st_size
    assert model.details.format == "gguf" and model.details.quantization_level == "Q4_1"
    assert model.details.parameter_size == "135M"
    shown = client.show(NAME)
    assert "completion" in shown.capabilities and shown.modelinfo["general.architecture"] == "LlamaForCausalLM"
    assert "{%" in shown.template  # the model's chat template
    (running,) = client.ps().models
    assert running.model == NAME and running.size_vram == 0  # on the CPU
    assert client.chat(model=NAME, messages=[]).done_reason == "load"  # Ollama's "load the model" call


def test_errors_are_ollamas(client, url):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3:8b", messages=QUESTION)
    assert e.value.status_code == 404 and "does not exist" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=NAME, messages=QUESTION, options={"temperature": -1})
    assert e.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=NAME, input="hello")
    assert e.value.status_code == 400 and "does not support embeddings" in e.value.error
    for body in (b"{not json", b"[1]", json.dumps({"model": NAME, "messages": "hi"}).encode()):
        r = httpx.post(f"{url}/api/chat", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and set(r.json()) == {"error"}, r.text
    assert httpx.get(f"{url}/api/version").json()["version"]


def test_tool_calls_arrive_whole_with_their_arguments_as_objects(url):
    """A forced call (OpenAI's tool_choice, which Ollama's API lacks): the reply's tool_calls hold the name and
    the arguments as an object fitting the schema; streamed, the call comes whole in one line before the last."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
    body = {"model": NAME, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [weather],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "options": {"temperature": 0, "num_predict": 48}}
    reply = httpx.post(f"{url}/api/chat", json={**body, "stream": False}, timeout=120).json()
    (call,) = reply["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(call["function"]["arguments"], weather["function"]["parameters"])
    lines = [json.loads(line) for line in httpx.post(f"{url}/api/chat", json=body, timeout=120).text.splitlines()]
    calls = [line["message"]["tool_calls"] for line in lines if line["message"].get("tool_calls")]
    assert calls == [[call]] and lines[-1]["done"]
    second = ollama.Client(host=url, timeout=120).chat(model=NAME, options=GREEDY, messages=[
        *body["messages"], {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "Sunny, 24 C", "tool_name": "get_weather"}])
    assert second.message.content
