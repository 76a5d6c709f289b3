"""Fuzzing the server from its own OpenAPI schema (schemathesis): valid and invalid bodies for
every route, about two minutes in all. No 5xx, every 4xx an error object of the route's protocol (OpenAI's,
Anthropic's under /v1/messages, Ollama's under /api/), every stream closed by [DONE] (message_stop, a done
line), and the server still serving at the end."""
from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from live_server import Server
from schemathesis import GenerationMode
from tiny_models import make_tiny_chat_model

MODEL = "tiny-chat"
# Examples per route and mode: ~35 s on 2 cores with the one-layer model.
EXAMPLES = {"/v1/chat/completions": 50, "/v1/completions": 40, "/tokenize": 30, "/detokenize": 20,
            "/v1/messages": 25, "/v1/messages/count_tokens": 15, "/v1/responses": 20, "/api/chat": 20,
            "/api/generate": 20, "/api/show": 5,  # (the other protocols share chat's validation and engine path)
            # a generation model's embedding routes: each protocol's 400 (test_embeddings.py serves vectors)
            "/v1/embeddings": 10, "/api/embed": 5, "/api/embeddings": 5, "/api/pull": 3,
            # LoRA adapters' routes on a server without them: its 400 (test_lora.py loads and unloads)
            "/v1/load_lora_adapter": 5, "/v1/unload_lora_adapter": 5}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    # A short context bounds every generation (and n x tokens), so that valid requests stay cheap.
    s = Server("--served-model-name", MODEL, model=model,
               engine_flags=["--max-model-len", "96", "--num-kv-blocks", "2048"]).wait_ready()
    yield s
    assert s.stop() == 0
    assert "Traceback" not in s.output()


def check(status: int, text: str, path: str, body) -> None:
    assert status < 500, (path, body, status, text[:500])
    anthropic = path.startswith("/v1/messages")
    if path.startswith("/api/"):  # Ollama's: {"error": ...}; replies NDJSON (streamed by default), done at the end
        if status >= 400:
            assert set(json.loads(text)) == {"error"}, text[:300]
        elif path not in ("/api/show", "/api/embed", "/api/embeddings"):
            assert json.loads(text.strip().splitlines()[-1])["done"] is True, (body, text[-300:])
    elif status >= 400 and anthropic:  # Anthropic's shape
        reply = json.loads(text)
        assert reply["type"] == "error" and set(reply["error"]) == {"type", "message"}, reply
    elif status >= 400:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
    elif isinstance(body, dict) and body.get("stream") is True:
        end = "event: message_stop" if anthropic else "event: response." if path == "/v1/responses" else "data: [DONE]"
        assert end in text.rstrip().rsplit("\n\n", 1)[-1], (body, text[-300:])


def send(server: Server, case) -> tuple[int, str]:
    if isinstance(case.body, dict) and case.body.get("stream") is True:
        # read to the end (schemathesis stops reading event streams after a few events)
        r = httpx.post(server.url + case.path, json=case.body, timeout=60)
        return r.status_code, r.text
    r = case.call(base_url=server.url, timeout=60)
    return r.status_code, r.text


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_fuzz_from_the_openapi_schema(server, mode):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = {op.path: op for op in (r.ok() for r in schema.get_all_operations()) if op.method == "post"}
    assert set(operations) == set(EXAMPLES)
    for path, examples in EXAMPLES.items():
        @given(case=operations[path].as_strategy(generation_mode=mode))
        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL  # past the model check, into the engine
            check(*send(server, case), path, case.body)

        fuzz()
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert json.loads(httpx.get(f"{server.url}/v1/models").text)["data"][0]["id"] == MODEL
