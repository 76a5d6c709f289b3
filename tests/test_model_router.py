"""Several models behind one server (pocketllm.server.router): each answers by name through the OpenAI,
Anthropic and Ollama routes, loads on its first request (requests that come meanwhile wait for the one
load), is unloaded when idle past its keep_alive (its engine then freed), makes room by unloading the
least recently used idle model when it would not fit, and a burst across models gets no 5xx."""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
import weakref

import anthropic
import httpx
import ollama
import openai
import pytest
from live_server import in_process
from tiny_models import make_tiny_chat_model

from pocketllm.config import EngineArgs
from pocketllm.engine import kv_plan
from pocketllm.engine.llm_engine import LLMEngine
from pocketllm.server.config import ServerConfig, ServerState
from pocketllm.server.guard import RequestGuard
from pocketllm.server.router import ModelRouter, ModelSpec

QUESTION = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("router"))


def make_router(model, names=("a", "b", "c"), **kw) -> tuple[ModelRouter, list]:
    built = []

    def build(args: EngineArgs) -> LLMEngine:
        engine = LLMEngine(args)
        built.append((args.model, weakref.ref(engine)))
        return engine

    args = EngineArgs(model=str(model), device="cpu", max_model_len=256, num_kv_blocks=64, exact_kernels=True)
    specs = [ModelSpec(n, dataclasses.replace(args)) for n in names]
    cfg = ServerConfig(model_name=names[0])
    return ModelRouter(specs, cfg, ServerState(), build, **kw), built


def serve(router: ModelRouter):
    return in_process(RequestGuard(router, router.cfg, router.state))


def loaded(url: str) -> list[str]:
    return [m["name"] for m in httpx.get(f"{url}/api/ps").json()["models"]]


def test_each_model_answers_by_name_in_every_protocol_and_loads_once(tiny_chat):
    router, built = make_router(tiny_chat)
    with serve(router) as url:
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["a", "b", "c"]
        assert loaded(url) == []  # nothing loaded before a request names it
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        reply = oa.chat.completions.create(model="a", messages=QUESTION, max_tokens=4, temperature=0)
        assert reply.model == "a" and reply.choices[0].message.content is not None
        assert loaded(url) == ["a"]
        msg = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.create(
            model="b", max_tokens=4, messages=QUESTION)
        assert msg.model == "b" and msg.content[0].type == "text"
        assert ollama.Client(host=url).chat(model="a:latest", messages=QUESTION, options={"num_predict": 4}).done
        assert sorted(loaded(url)) == ["a", "b"] and len(built) == 2
        # requests to a model that is not loaded yet wait for its one load, all of them
        async def burst():
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json={
                    "model": "c", "prompt": "Hello", "max_tokens": 3}) for _ in range(6)))

        assert [r.status_code for r in asyncio.run(burst())] == [200] * 6 and len(built) == 3
        missing = httpx.post(f"{url}/v1/chat/completions", json={"model": "d", "messages": QUESTION})
        assert missing.status_code == 404 and "serves: a, b, c" in missing.json()["error"]["message"]
        gone = httpx.post(f"{url}/api/chat", json={"model": "d", "messages": QUESTION})
        assert gone.status_code == 404 and set(gone.json()) == {"error"}
        metrics = httpx.get(f"{url}/metrics").text
        for name in ("a", "b", "c"):
            assert f'pocketllm:num_requests_running{{model_name="{name}"}}' in metrics
        assert metrics.count("# TYPE pocketllm:num_requests_running ") == 1  # one family, a sample per model


def test_an_idle_model_is_unloaded_and_its_engine_freed(tiny_chat):
    router, built = make_router(tiny_chat, keep_alive=1.0)
    with serve(router) as url:
        client = ollama.Client(host=url)
        client.generate(model="a", prompt="Hi", options={"num_predict": 2}, keep_alive=0)  # unloaded after it
        client.generate(model="b", prompt="Hi", options={"num_predict": 2})  # the server's keep-alive: 1 s
        assert loaded(url) == ["b"]
        deadline = time.monotonic() + 10
        while loaded(url) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert loaded(url) == []
        while any(ref() is not None for _, ref in built) and time.monotonic() < deadline:  # (an unload ends after)
            gc.collect()
            time.sleep(0.1)
        assert all(ref() is None for _, ref in built)  # both engines (weights, KV cache) are gone
        assert client.generate(model="a", prompt="Hi", options={"num_predict": 2}).done  # and load again


def test_a_model_that_would_not_fit_unloads_the_least_recently_used(tiny_chat, monkeypatch):
    router, built = make_router(tiny_chat)
    room = {}

    def available(device, utilization):  # room for about one model: what the loaded ones hold is taken
        held = sum(s.llm.engine.weight_bytes for s in router.slots.values() if s.loaded)
        return room["one"] - held

    with serve(router) as url:
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        oa.completions.create(model="a", prompt="Hi", max_tokens=2)
        e = router.slots["a"].llm.engine
        plan = e.kv_plan  # what one model needs, as the plan counts it, and half a model more
        room["one"] = (e.weight_bytes + plan.activation_bytes + plan.blocks_per_request(e.max_model_len)
                       * plan.bytes_per_block + e.weight_bytes // 2)
        monkeypatch.setattr(kv_plan, "available_memory", available)
        oa.completions.create(model="b", prompt="Hi", max_tokens=2)
        oa.completions.create(model="c", prompt="Hi", max_tokens=2)
        assert loaded(url) == ["c"]  # a, then b, made room
        assert oa.completions.create(model="a", prompt="Hi", max_tokens=2).choices


def test_a_burst_across_models_gets_no_server_error(tiny_chat):
    router, _ = make_router(tiny_chat)
    with serve(router) as url:
        async def burst():
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                calls = []
                for i in range(18):
                    model = "abc"[i % 3]
                    if i % 2:
                        calls.append(client.post("/v1/chat/completions", json={
                            "model": model, "messages": QUESTION, "max_tokens": 3, "stream": True}))
                    else:
                        calls.append(client.post("/api/generate", json={"model": model, "prompt": "Hi",
                                                                       "options": {"num_predict": 3}}))
                return await asyncio.gather(*calls)

        assert [r.status_code for r in asyncio.run(burst())] == [200] * 18


def test_pocketllm_serve_with_several_models(tiny_chat):
    from live_server import Server

    s = Server("--model", f"second={tiny_chat}", "--keep-alive", "-1", model=tiny_chat,
               engine_flags=["--max-model-len", "256", "--num-kv-blocks", "64"]).wait_ready()
    try:
        assert [m["id"] for m in httpx.get(f"{s.url}/v1/models").json()["data"]] == ["tiny-chat", "second"]
        oa = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
        for name in ("second", "tiny-chat"):
            assert oa.chat.completions.create(model=name, messages=QUESTION, max_tokens=3).model == name
        assert sorted(loaded(s.url)) == ["second", "tiny-chat"]
    finally:
        assert s.stop() == 0
    assert "Traceback" not in s.output()


def test_ollama_pull_fetches_a_model_from_the_hub_and_serves_it(tiny_chat, tmp_path, monkeypatch):
    from fake_hub import FakeHub
    from huggingface_hub import constants

    fake = FakeHub()
    fake.add("test/tiny-chat", {p.name: p.read_bytes() for p in tiny_chat.iterdir() if p.is_file()})
    router, built = make_router(tiny_chat, names=("a",))
    router.base_args = router.slots["a"].spec.engine_args
    with in_process(fake.app()) as hub_url, serve(router) as url:
        monkeypatch.setenv("HF_ENDPOINT", hub_url)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        client = ollama.Client(host=url)
        statuses = [p.status for p in client.pull("test/tiny-chat", stream=True)]
        assert statuses[-1] == "success"
        assert "test/tiny-chat" in [m.model for m in client.list().models]
        reply = client.chat(model="test/tiny-chat", messages=QUESTION, options={"num_predict": 3})
        assert reply.done and len(built) == 1
        with pytest.raises(ollama.ResponseError, match="must name a Hugging Face repo"):
            client.pull("not a name")


def test_serve_models_dir(tiny_chat, tmp_path):
    import shutil

    from live_server import Server

    for name in ("one", "two"):
        shutil.copytree(tiny_chat, tmp_path / name)
    (tmp_path / "notes.txt").write_text("not a model")
    s = Server("--models-dir", str(tmp_path), model=False,
               engine_flags=["--max-model-len", "256", "--num-kv-blocks", "64"]).wait_ready()
    try:
        assert [m["id"] for m in httpx.get(f"{s.url}/v1/models").json()["data"]] == ["one", "two"]
        reply = httpx.post(f"{s.url}/v1/completions", json={"model": "two", "prompt": "Hi", "max_tokens": 2})
        assert reply.status_code == 200 and reply.json()["model"] == "two"
        bad = httpx.post(f"{s.url}/api/pull", json={"model": "x"})
        assert bad.status_code == 400 and "must name a Hugging Face repo" in bad.json()["error"]
    finally:
        assert s.stop() == 0


def test_a_request_waits_for_a_load_no_longer_than_the_queue_allows(tiny_chat):
    router, _ = make_router(tiny_chat, names=("a",), load_timeout=0.2)
    slow = router.build

    def build(args):
        time.sleep(1.0)  # a load longer than a request may wait
        return slow(args)

    router.build = build
    with serve(router) as url:
        first = httpx.post(f"{url}/v1/completions", json={"model": "a", "prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert first.status_code == 503 and first.headers["retry-after"] == "5"
        assert "still loading after 0.2 s" in first.json()["error"]["message"]
        time.sleep(1.5)  # the load went on meanwhile
        again = httpx.post(f"{url}/v1/completions", json={"model": "a", "prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert again.status_code == 200
