"""The OpenAI-compatible server on the default model, driven with the official `openai` client
(and httpx for what a client library would not send); `AsyncLLM` on a tiny model; `pocketllm chat`."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import prompts_of
from fixtures import default_model_gguf
from live_server import ENGINE_FLAGS, ROOT, Server, in_process

from pocketllm import LLM, SamplingParams
from pocketllm.config import EngineArgs
from pocketllm.engine.llm_engine import LLMEngine
from pocketllm.server.api_server import create_app
from pocketllm.server.async_llm import AsyncLLM, EngineClosedError, QueueFullError
from pocketllm.server.config import ServerConfig

ENGINE_KWARGS = dict(max_model_len=2048, kv_cache_memory=160 << 20, exact_kernels=True)  # as ENGINE_FLAGS
MAX_REQUEST_BYTES = 256 << 10
API_KEY = "sk-test-key"
ORIGIN = "http://example.com"
CHAT_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"

# Greedy token ids of the default model, recorded once with the offline engine exactly as the
# golden test runs it: pocketllm.LLM(default model, **ENGINE_KWARGS) and
# SamplingParams(temperature=0, max_tokens=12); the chat prompt rendered by the model's template.
GOLDEN_PROMPT = "The capital of France is"
GOLDEN_PROMPT_IDS = [504, 3575, 282, 4649, 314]
GOLDEN_COMPLETION_IDS = [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33]
GOLDEN_MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
GOLDEN_CHAT_IDS = [504, 2988, 288, 451, 8170, 4119, 1732, 314, 216, 36, 30, 2]  # ends with EOS


def start(*args: str, stdin: str = "") -> subprocess.Popen:
    with tempfile.TemporaryFile("w+") as f:  # the input is all there from the start, then EOF
        f.write(stdin)
        f.seek(0)
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdin=f, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def launched():
    """Everything that loads the model starts at once, so the loads overlap: the server, `pocketllm
    chat`, and (in a thread here) the offline engine, which the golden test compares with and
    which then serves the in-process small server."""
    model = str(default_model_gguf())
    main = Server("--max-request-bytes", str(MAX_REQUEST_BYTES), "--allowed-origins", ORIGIN,
                  "--max-queued-requests", "64", "--shutdown-timeout", "5")
    chat = start("-m", "pocketllm.cli.main", "chat", model, *ENGINE_FLAGS, "--max-tokens", "8",
                 "--temperature", "0", stdin="What is the capital of France?\n")
    with ThreadPoolExecutor(1) as pool:
        offline = pool.submit(LLM, model, max_num_seqs=1, **ENGINE_KWARGS)
        yield {"main": main, "chat": chat, "offline": offline}
    if chat.poll() is None:
        chat.kill()
        chat.communicate()
    code = main.stop()
    assert code == 0 or not main.ready, "SIGTERM must shut a running server down cleanly"


@pytest.fixture(scope="module")
def server(launched):
    return launched["main"].wait_ready()


@pytest.fixture(scope="module")
def offline_llm(launched) -> LLM:
    return launched["offline"].result()


@pytest.fixture(scope="module")
def small_server(offline_llm):
    """A server in a thread of this process on the offline engine: one running request at most
    (the engine's max_num_seqs), one waiting, an API key, its own chat template."""
    app = create_app(AsyncLLM(offline_llm.engine, max_queued_requests=1),
                     ServerConfig(model_name="tiny-smol", api_key=API_KEY, chat_template=CHAT_TEMPLATE))
    with in_process(app) as url:
        yield url
    offline_llm.engine.check_no_leaks()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def metric(url: str, name: str, headers: dict | None = None) -> float:
    text = httpx.get(f"{url}/metrics", headers=headers).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"pocketllm:{name}{{") or line.startswith(f"pocketllm:{name} "))


def wait_idle(url: str, headers: dict | None = None, timeout: float = 5.0) -> None:
    """The engine is back to no running request and no KV block in use."""
    deadline = time.monotonic() + timeout
    while True:
        running = metric(url, "num_requests_running", headers)
        usage = metric(url, "kv_cache_usage_perc", headers)
        if running == 0 and usage == 0:
            return
        assert time.monotonic() < deadline, f"still running={running} kv_usage={usage}"
        time.sleep(0.1)


# -- the OpenAI API ------------------------------------------------------------------------------
def test_models_health_version(server, client, model):
    assert model == default_model_gguf().name
    assert client.models.retrieve(model).id == model
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_served_ids_equal_pinned_and_offline(server, model, offline_llm):
    tok = offline_llm.get_tokenizer()
    chat_ids = tok.encode(tok.apply_chat_template(GOLDEN_MESSAGES, add_generation_prompt=True),
                          add_special_tokens=False)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    offline, offline_chat = offline_llm.generate([GOLDEN_PROMPT, {"prompt_token_ids": chat_ids}], greedy)

    body = {"model": model, "temperature": 0, "max_tokens": 12, "return_token_ids": True}
    served = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": GOLDEN_PROMPT}, timeout=60).json()
    served_chat = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "messages": GOLDEN_MESSAGES},
                             timeout=60).json()
    choice, chat_choice = served["choices"][0], served_chat["choices"][0]
    assert choice["prompt_token_ids"] == offline.prompt_token_ids == GOLDEN_PROMPT_IDS
    assert choice["token_ids"] == offline.outputs[0].token_ids == GOLDEN_COMPLETION_IDS
    assert choice["text"] == offline.outputs[0].text
    assert chat_choice["prompt_token_ids"] == chat_ids
    assert chat_choice["token_ids"] == offline_chat.outputs[0].token_ids == GOLDEN_CHAT_IDS
    assert chat_choice["message"]["content"] == offline_chat.outputs[0].text
    assert chat_choice["finish_reason"] == "stop"

    # Streamed, each chunk carries its new ids (how clients time tokens of a model without a tokenizer).
    for path, extra, prompt_ids, ids in (("completions", {"prompt": GOLDEN_PROMPT}, GOLDEN_PROMPT_IDS,
                                          GOLDEN_COMPLETION_IDS),
                                         ("chat/completions", {"messages": GOLDEN_MESSAGES}, chat_ids, GOLDEN_CHAT_IDS)):
        with httpx.stream("POST", f"{server.url}/v1/{path}", json={**body, **extra, "stream": True},
                          timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        choices = [e["choices"][0] for e in events if e["choices"]]
        assert [c["prompt_token_ids"] for c in choices if "prompt_token_ids" in c] == [prompt_ids]
        assert [t for c in choices for t in c.get("token_ids", [])] == ids
        assert sum(bool(c.get("token_ids")) for c in choices) >= 2  # one chunk per step, not one at the end


def test_chat_completion(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=8, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == model
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0


def test_chat_content_parts_and_developer_role(client, model):
    plain = client.chat.completions.create(model=model, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}])
    parts = client.chat.completions.create(model=model, max_tokens=6, temperature=0, messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Name a color."}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_chat_stream_n2_with_usage(client, model):
    messages = [{"role": "user", "content": "Count to five."}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                                 n=2, stream=True, stream_options={"include_usage": True}))
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"
    firsts = {}
    text, finish = {0: "", 1: ""}, {}
    for c in chunks[:-1]:
        assert c.usage is None and len(c.choices) == 1
        ch = c.choices[0]
        firsts.setdefault(ch.index, ch.delta)
        text[ch.index] += ch.delta.content or ""
        if ch.finish_reason:
            assert ch.index not in finish and ch.delta.content is None
            finish[ch.index] = ch.finish_reason
    assert all(d.role == "assistant" and d.content == "" for d in firsts.values()) and len(firsts) == 2
    assert text[0] == text[1] == full.choices[0].message.content  # greedy: both choices equal
    assert finish == {0: full.choices[0].finish_reason, 1: full.choices[0].finish_reason}
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 2 * full.usage.completion_tokens
    assert usage.usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.usage.prompt_tokens_details.cached_tokens >= 0


def test_completions_batch_echo_and_stream(client, model):
    r = client.completions.create(model=model, prompt=["Once upon a time", "The sky is"], max_tokens=5,
                                  temperature=0, n=2, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text
    assert r.usage.completion_tokens == 4 * 5
    echoed = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "Once upon a time" + r.choices[0].text
    stream = list(client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in stream) == r.choices[0].text
    assert [c.choices[0].finish_reason for c in stream][-1] == "length"
    ids = client.completions.create(model=model, prompt=[504, 3575, 282, 4649, 314], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 5


def test_stop_strings(client, model):
    base = dict(model=model, prompt="The capital of France is", max_tokens=12, temperature=0)
    free = client.completions.create(**base).choices[0].text
    assert "\n\n" in free
    cut = client.completions.create(**base, stop=["\n\n", "never-there"]).choices[0]
    assert cut.text == free[:free.index("\n\n")] and cut.finish_reason == "stop"
    kept = client.completions.create(**base, stop="\n\n", extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == free[:free.index("\n\n") + 2]
    streamed = client.completions.create(**base, stop="\n\n", stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.token == item.top_logprobs[0].token  # greedy picks the most likely
        assert bytes(item.bytes).decode() == item.token
    assert "".join(i.token for i in content).startswith(r.choices[0].message.content)
    c = client.completions.create(model=model, prompt="One, two,", max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(len(t) >= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == c.choices[0].text
    plain = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_echo_with_logprobs_scores_the_prompt(client, model, offline_llm):
    """Legacy completions with echo and logprobs (how evaluation harnesses score text): the
    prompt's tokens come first, the first without a logprob, then the completion's; the values are
    the offline engine's prompt logprobs, streamed or not."""
    prompt = "The capital of France is"
    ref = offline_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    ids, want = ref.prompt_token_ids, ref.prompt_logprobs
    c = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
    lp = c.choices[0].logprobs
    assert c.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + c.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    for k in range(1, len(ids)):
        assert abs(lp.token_logprobs[k] - want[k][ids[k]].logprob) < 1e-4
        assert len(lp.top_logprobs[k]) >= 2
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset == [sum(map(len, lp.tokens[:k])) for k in range(len(lp.tokens))]
    streamed = list(client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                              echo=True, stream=True))
    chunks = [ch.choices[0].logprobs for ch in streamed if ch.choices and ch.choices[0].logprobs]
    assert [t for x in chunks for t in x.tokens] == lp.tokens
    assert [t for x in chunks for t in x.token_logprobs] == lp.token_logprobs
    assert [t for x in chunks for t in x.text_offset] == lp.text_offset


def test_seed_reproducible(client, model):
    def sample(seed):
        return client.completions.create(model=model, prompt="My favourite animal is", max_tokens=12,
                                         temperature=1.0, seed=seed).choices[0].text
    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_cached_tokens_on_repeated_prompt(client, model):
    long_prompt = "Here is a story about a lighthouse keeper who counts ships. " * 12
    messages = [{"role": "user", "content": long_prompt}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0)
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens > 100
    assert second.usage.prompt_tokens_details.cached_tokens >= 96  # whole 16-token blocks
    assert second.choices[0].message.content == first.choices[0].message.content


def test_concurrent_streams(server, model):
    async def one(client, i):
        text, finish = "", None
        stream = await client.completions.create(model=model, prompt=f"Story number {i}:", max_tokens=8,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            else:
                tokens = chunk.usage.completion_tokens
        return text, finish, tokens

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(4)))

    results = asyncio.run(main())
    assert [(finish, tokens) for _, finish, tokens in results] == [("length", 8)] * 4
    assert all(text for text, _, _ in results)
    wait_idle(server.url)


def test_disconnect_frees_the_request(server, model):
    body = {"model": model, "prompt": "Tell me everything.", "max_tokens": 1500, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(events)
        assert metric(server.url, "num_requests_running") == 1
    wait_idle(server.url)
    # Not streaming: the client gives up waiting.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    wait_idle(server.url)


def test_tokenize_detokenize(server, model):
    t = httpx.post(f"{server.url}/tokenize", json={"model": model, "prompt": GOLDEN_PROMPT}).json()
    assert t["tokens"] == GOLDEN_PROMPT_IDS and t["count"] == 5 and t["max_model_len"] == 2048
    d = httpx.post(f"{server.url}/detokenize", json={"model": model, "tokens": GOLDEN_PROMPT_IDS}).json()
    assert d == {"prompt": GOLDEN_PROMPT}
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": GOLDEN_MESSAGES}).json()
    assert chat["count"] > 5



def test_bench_serve(server, tmp_path):
    from pocketllm.cli.main import main

    out = tmp_path / "bench.json"
    assert main(["bench", "serve", "--base-url", server.url, "--max-concurrency", "2", "--num-prompts", "2",
                 "--input-len", "8", "--output-len", "3", "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["concurrency"], r["requests"], r["errors"]) for r in rows] == [(1, 2, 0), (2, 2, 0)]
    assert all(r["output_tok_s"] > 0 and r["ttft_p99_ms"] > 0 and r["itl_p50_ms"] > 0
               and r["queue_p99_ms"] is not None for r in rows)

# -- errors --------------------------------------------------------------------------------------
def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in err["message"]
    return err


@pytest.mark.parametrize("body, param, code", [
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature", "invalid_type"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature", "decimal_above_max_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n", "integer_below_min_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"}, "max_tokens", "invalid_type"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ({"messages": []}, "messages", "empty_array"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "invalid_value"),
    ({}, "messages", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, "messages", "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}},
     "stream_options", "invalid_value"),
])
def test_chat_bad_requests(server, model, body, param, code):
    err = error_of(httpx.post(f"{server.url}/v1/chat/completions", json={"model": model, **body}), 400)
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code)


def test_other_errors(server, client, model):
    url = f"{server.url}/v1/completions"
    err = error_of(httpx.post(url, content=b'{"model": "x", "prompt": ', headers={"content-type": "application/json"}),
                   400)
    assert err["param"] is None and "JSON" in err["message"]
    error_of(httpx.post(url, json=[1, 2]), 400)
    assert error_of(httpx.post(url, json={"model": model, "prompt": [1, 10**9]}), 400)["param"] == "prompt"
    assert error_of(httpx.post(url, json={"model": model, "prompt": []}), 400)["param"] == "prompt"
    assert error_of(httpx.post(url, json={"model": model, "prompt": "x", "top_p": 0}), 400)["param"] == "top_p"
    missing = error_of(httpx.post(url, json={"model": "gpt-9", "prompt": "x"}), 404)
    assert missing["code"] == "model_not_found" and missing["param"] == "model"
    assert f"this server serves `{model}`" in missing["message"]  # what to ask for instead
    too_long = "word " * 3000
    assert error_of(httpx.post(url, json={"model": model, "prompt": too_long}), 400)["code"] == \
        "context_length_exceeded"
    assert error_of(httpx.post(url, json={"model": model, "prompt": "x" * MAX_REQUEST_BYTES}), 413)
    error_of(httpx.get(f"{server.url}/v1/nothing-here"), 404)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert e.value.body["param"] == "temperature"
    # Unknown fields are ignored, and the server is still serving after all of the above.
    ok = httpx.post(url, json={"model": model, "prompt": "Hi", "max_tokens": 2, "not_a_field": {"x": 1}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_cors(server):
    pre = httpx.options(f"{server.url}/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    simple = httpx.get(f"{server.url}/v1/models", headers={"Origin": ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in httpx.get(f"{server.url}/v1/models",
                                                          headers={"Origin": "http://evil.example"}).headers


# -- the small server: an API key, one running request, a queue of one ----------------------------
def test_api_key(small_server):
    url = small_server
    assert httpx.get(f"{url}/health").status_code == 200
    for path in ("/v1/models", "/metrics", "/version"):
        r = httpx.get(f"{url}{path}")
        assert error_of(r, 401)["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    error_of(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    ok = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0).models.list()
    assert [m.id for m in ok.data] == ["tiny-smol"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


def test_chat_template_override(small_server, offline_llm):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]
    ids = httpx.post(f"{small_server}/tokenize", json={"messages": messages}, headers=auth).json()["tokens"]
    assert offline_llm.get_tokenizer().decode(ids) == "[system] Be kind.\n[user] Hi\n[assistant]"


def test_full_queue_gets_503(small_server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny-smol", "prompt": "Go on and on.", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    url = f"{small_server}/v1/completions"
    with httpx.Client(headers=auth, timeout=60) as http:
        with http.stream("POST", url, json=body) as running:
            lines = running.iter_lines()  # kept: dropping the iterator would close the stream
            next(line for line in lines if line.startswith("data: "))  # it is running
            with http.stream("POST", url, json=body) as waiting:
                assert waiting.status_code == 200
                deadline = time.monotonic() + 5
                while metric(small_server, "num_requests_waiting", auth) != 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                rejected = http.post(url, json={**body, "stream": False})
                err = error_of(rejected, 503)
                assert rejected.headers["retry-after"] == "1" and err["type"] == "server_error"
    wait_idle(small_server, auth)
    metrics = httpx.get(f"{small_server}/metrics", headers=auth).text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_queue_time_seconds"):
        assert f"pocketllm:{name}_count" in metrics


# -- AsyncLLM on a tiny model ----------------------------------------------------------------------
@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def tiny_engine(tiny_models, request):
    """Both schedulings: asynchronous is the default on CUDA, where the server aborts requests whose
    step may still be in flight."""
    return LLMEngine(EngineArgs(model=str(tiny_models["qwen3"][1]), dtype="float32", max_num_seqs=1,
                                async_scheduling=request.param))


def test_async_llm_aborts_and_shuts_down(tiny_engine):
    prompt = {"prompt_token_ids": prompts_of([20], seed=1)[0]}
    short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)

    async def main():
        llm = AsyncLLM(tiny_engine, max_queued_requests=1)
        outs = [o async for o in llm.generate(prompt, short, "done")]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
        gen = llm.generate(prompt, long, "left")
        await anext(gen)
        await gen.aclose()  # the consumer goes away: the request is aborted
        running = llm.add_request("running", prompt, long)
        await anext(running)
        waiting = llm.add_request("waiting", prompt, long)
        with pytest.raises(QueueFullError):
            llm.add_request("third", prompt, long)
        await llm.shutdown(timeout=0)  # no time to finish: both are aborted
        for stream in (running, waiting):
            with pytest.raises(EngineClosedError):
                async for _ in stream:
                    pass
        with pytest.raises(EngineClosedError):
            llm.add_request("late", prompt, long)

        llm = AsyncLLM(tiny_engine)
        stream = llm.add_request("finishes", prompt, short)
        await llm.shutdown(timeout=30)  # enough time: the running request completes
        outs = [o async for o in stream]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"

    asyncio.run(main())
    tiny_engine.check_no_leaks()


def test_async_llm_admits_a_burst_in_one_step_and_coalesces_outputs(tiny_models):
    engine = LLMEngine(EngineArgs(model=str(tiny_models["qwen3"][1]), dtype="float32", max_num_seqs=4))
    step_sizes = []
    step = engine.step

    def recorded_step():
        outs = step()
        step_sizes.append(engine.last_step.num_seqs)
        return outs

    engine.step = recorded_step
    prompts = [{"prompt_token_ids": p} for p in prompts_of([20, 21, 22], seed=2)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def burst(llm: AsyncLLM, gap: float) -> None:
        step_sizes.clear()
        streams = []
        for i, prompt in enumerate(prompts):
            streams.append(llm.add_request(f"{gap}-{i}", prompt, params))
            await asyncio.sleep(gap)
        for s in streams:
            async for _ in s:
                pass

    async def main():
        # Requests arriving while the engine is idle, each within the admission gap of the last,
        # are scheduled together: none waits for another one's prefill step.
        llm = AsyncLLM(engine, admission_gap=0.5, admission_max_wait=5.0)
        await burst(llm, 0.05)
        assert step_sizes[0] == 3
        await llm.shutdown()
        # Without the gap the first request's prefill runs alone.
        llm = AsyncLLM(engine, admission_gap=0.0)
        await burst(llm, 0.05)
        assert step_sizes[0] == 1
        # A consumer that falls behind (here: an event loop blocked for a second) gets the newest
        # cumulative output, not a backlog of one per step.
        stream = llm.add_request("slow", prompts[0], params)
        time.sleep(1.0)
        outs = [o async for o in stream]
        assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].token_ids) == 8
        await llm.shutdown()

    asyncio.run(main())
    engine.check_no_leaks()


# -- pocketllm chat ------------------------------------------------------------------------------
def test_chat_command_answers_and_exits_on_eof(launched):
    chat = launched["chat"]  # given one line on stdin, then EOF
    out, err = chat.communicate(timeout=180)
    assert chat.returncode == 0, err[-3000:]
    reply = out.split("> ", 1)[1].split("> ")[0].strip()
    assert reply
