"""No request and no mistake can hurt the server. Hostile and malformed requests get a 4xx with
an OpenAI error object while other streams go on; a bug inside a step fails only the requests it
touched; the event loop never stalls on a large input; waiting is bounded; SIGTERM drains; slow
clients time out. The servers run a one-layer model with the default model's real tokenizer and
chat template, so that every request is cheap."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import prompts_of
from live_server import ROOT, Server, free_port, in_process
from tiny_models import make_tiny_chat_model

from pocketllm import LLM, SamplingParams
from pocketllm.config import EngineArgs
from pocketllm.engine.llm_engine import LLMEngine
from pocketllm.errors import EngineDeadError, RequestError, RequestFailedError
from pocketllm.runner.sampler import Sampler
from pocketllm.server.api_server import create_app
from pocketllm.server.async_llm import AsyncLLM, EngineClosedError
from pocketllm.server.config import ServerConfig
from pocketllm.server.launcher import warn_if_exposed

MODEL = "tiny-chat"
TINY_FLAGS = ["--max-model-len", "2048", "--num-kv-blocks", "1024", "--served-model-name", MODEL]
# An operator's template with mistakes that only some messages reach (some would take all memory
# or run for ever outside the sandbox's bounds).
EVIL_TEMPLATE = """{%- macro again(n) %}{{ again(n) }}{% endmacro -%}
{%- macro double(s, n) %}{% if n %}{{ double(s ~ s, n - 1) }}{% else %}{{ s }}{% endif %}{% endmacro -%}
{%- for m in messages -%}
{%- if m.content == 'RANGE' %}{% for i in range(10**9) %}{% endfor %}{% endif -%}
{%- if m.content == 'LOOP' %}{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}{% endif -%}
{%- if m.content == 'REPEAT' %}{{ 'x' * 2**34 }}{% endif -%}
{%- if m.content == 'DOUBLE' %}{{ double('x', 64) }}{% endif -%}
{%- if m.content == 'RECURSE' %}{{ again(1) }}{% endif -%}
{%- if m.content == 'RAISE' %}{{ raise_exception('this template refuses') }}{% endif -%}
{%- if m.content == 'UNDEFINED' %}{{ m.nothing.deeper }}{% endif -%}
{%- if m.content == 'DIVIDE' %}{{ 1 // 0 }}{% endif -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def servers(tiny_chat, tmp_path_factory):
    """Every server of this module, started at once so that their loads overlap."""
    template = tmp_path_factory.mktemp("template") / "evil.jinja"
    template.write_text(EVIL_TEMPLATE)
    started = {
        "main": Server("--chat-template", str(template), "--max-queued-requests", "64",
                       "--max-grammar-compile-time", "3", model=tiny_chat, engine_flags=TINY_FLAGS),
        # 48 blocks of 16 tokens: a few long requests fill the cache and the rest wait
        "pressure": Server("--max-queue-time", "2", "--served-model-name", MODEL, model=tiny_chat,
                           engine_flags=["--max-model-len", "768", "--num-kv-blocks", "48"]),
        # a context long enough that the long request outlasts the shutdown timeout on any machine
        "drain": Server("--shutdown-timeout", "2", model=tiny_chat,
                        engine_flags=["--max-model-len", "4096", "--num-kv-blocks", "520", "--served-model-name", MODEL]),
        # a body gets 3 s, a request head 1 s: a head that came in time is not cut by the head's timeout
        "slow": Server("--request-body-timeout", "3", "--request-header-timeout", "1", "--max-connections", "8",
                       model=tiny_chat, engine_flags=TINY_FLAGS),
    }
    yield {name: s.wait_ready() for name, s in started.items()}
    for s in started.values():
        s.stop(timeout=30)


@pytest.fixture(scope="module")
def main(servers):
    return servers["main"]


def post(url: str, path: str, body, timeout: float = 60) -> httpx.Response:
    """`body` as JSON (NaN and Infinity written as the literals a careless client sends), or raw bytes."""
    content = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    return httpx.post(url + path, content=content, headers={"Content-Type": "application/json"}, timeout=timeout)


def assert_error(r: httpx.Response, status: int | None = None) -> dict:
    """A 4xx (or `status`) with an OpenAI error object, as JSON: nothing was streamed."""
    assert (r.status_code == status) if status else 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert "Traceback" not in err["message"]
    return err


def assert_serves(url: str) -> None:
    """The server is up and a normal request succeeds."""
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["text"]) > 0
    assert httpx.get(url + "/health").status_code == 200


# -- hostile requests ------------------------------------------------------------------------------
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 3}
NAN, INF = math.nan, math.inf
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _nested(depth: int):
    value = "x"
    for _ in range(depth):
        value = [value]
    return value


# Sampling fields, each invalid value sent to both endpoints, streamed and not.
_BAD_SAMPLING = {
    "temperature": ["hot", -1, 2.5, NAN, INF, -INF, True, [], {}],
    "top_p": [-0.1, 1.5, 0, NAN, "x"],
    "top_k": [-2, 1.5, "5", -(2**70)],
    "min_p": [-1, 2, NAN],
    "repetition_penalty": [0, -1, NAN, INF, 1e6],
    "presence_penalty": [3, NAN],
    "frequency_penalty": [-3, -INF],
    "max_tokens": [0, -5, 1.5, "10", 10**30, 2**63],
    "n": [0, 129, -1, 1.5],
    "seed": [2**64, -(2**63) - 1, 1.5, "1", 10**40],
    "stop": [5, [1, 2], [["a"]], {"a": 1}],
    "stop_token_ids": [[-1], [-100000], [10**9], ["a"], 5, [2**64]],
    "logit_bias": [{"abc": 1}, {"1": 1000}, {"1": NAN}, {"-5": 1}, {"99999999": 1}, [1, 2], {"1": "x"}],
    "min_tokens": [-1, 10**6, "1"],
    "stream_options": [{"include_usage": True}],  # without stream
    "response_format": [{"type": "xml"}, {"type": "json_schema"},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": "not an object"}},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                            "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}],
    "structured_outputs": [{"regex": "(unclosed"}, {"regex": ""}, {"grammar": "root ::= "},
                           {"grammar": "garbage ((("}, {"choice": []}, {"choice": [1, 2]}, {"json": "{not json"},
                           {"tool_calls": {"format": "hermes", "tools": [{"x": 1}], "parallel": True}},
                           {"reasoning": {"start": "<think>", "end": "</think>", "open": True}},
                           {"json": SCHEMA, "regex": "a"}, "string", {"unknown": 1}, {}],
    "model": ["nope", 5, None],
}
_BAD_CHAT = {
    "messages": [[], "string", [{"role": "robot", "content": "x"}], [{"role": "user", "content": 5}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                 [{"content": "no role"}], [{"role": "user", "content": _nested(64)}],
                 [{"role": "user", "content": "RANGE"}], [{"role": "user", "content": "RECURSE"}],
                 [{"role": "user", "content": "RAISE"}], [{"role": "user", "content": "UNDEFINED"}],
                 [{"role": "user", "content": "DIVIDE"}], [{"role": "user", "content": "x" * 1_000_000}],
                 [{"role": "user", "content": "y" * 200_000}]],
    "chat_template_kwargs": [{"messages": 1}, {"tools": 1}, {"add_generation_prompt": 1}, "x"],
    "logprobs": ["yes", 1],
    "top_logprobs": [21, -1, 5],  # 5: without logprobs
    "tools": ["x", [{"type": "function", "function": {"name": "bad name!"}}], [{"type": "other"}]],
    "tool_choice": ["required", {"type": "function", "function": {"name": "f"}}, {"type": "function"}, "sometimes"],
    "max_completion_tokens": [0, -1],
}
_BAD_COMPLETION = {
    "prompt": ["", [], [[]], [-1], [10**9], [1.5], [[1, -2]], {"a": 1}, None, [2**64], "x" * 4_000_000,
               "y" * 200_000, ["ok", 5]],
    "logprobs": [6, -1, True],
    "echo": ["yes"],
}
_BAD_BODIES = [b"", b"not json", b"[]", b"null", b"5", b'"text"', b"\xff\xfe\x00garbage", b"{" * 100_000,
               b"[" * 5000 + b"]" * 5000, b'{"model": "tiny-chat", "prompt": "Hi", "temperature": 1e999999}',
               b'{"model": "tiny-chat", "prompt": "\\ud800 lone"}', b'{"model": "tiny-chat", "prompt": "Hi",',
               b'{"model": "tiny-chat", "prompt": "Hi", "max_tokens": 1' + b"0" * 5000 + b"}"]


def _bad_cases() -> list:
    cases = []
    for field, values in _BAD_SAMPLING.items():
        for i, v in enumerate(values):
            for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
                body = {**base, field: v} if v is not None or field != "model" else {
                    k: x for k, x in base.items() if k != "model"}
                cases.append(pytest.param(path, {**body, "stream": bool(i % 2)}, id=f"{path}:{field}[{i}]"))
    for path, base, table in (("/v1/chat/completions", CHAT, _BAD_CHAT),
                              ("/v1/completions", COMPLETION, _BAD_COMPLETION)):
        for field, values in table.items():
            for i, v in enumerate(values):
                cases.append(pytest.param(path, {**base, field: v, "stream": bool(i % 2)}, id=f"{path}:{field}[{i}]"))
    for i, raw in enumerate(_BAD_BODIES):
        cases.append(pytest.param("/v1/completions", raw, id=f"body[{i}]"))
        cases.append(pytest.param("/v1/chat/completions", raw, id=f"chat-body[{i}]"))
    cases += [pytest.param("/tokenize", b, id=f"tokenize[{i}]") for i, b in enumerate([
        {"prompt": "x", "messages": CHAT["messages"]}, {}, {"prompt": 5}, {"prompt": "z" * 4_000_000},
        {"messages": [{"role": "user", "content": "RECURSE"}]}, {"model": "nope", "prompt": "x"}])]
    cases += [pytest.param("/detokenize", b, id=f"detokenize[{i}]") for i, b in enumerate([
        {"tokens": [-1]}, {"tokens": [10**20]}, {"tokens": "x"}, {"tokens": [1.5]}, {}])]
    return cases


BAD_CASES = _bad_cases()


def test_the_hostile_suite_is_large():
    assert len(BAD_CASES) >= 150, len(BAD_CASES)


@pytest.mark.parametrize("path, body", BAD_CASES)
def test_hostile_request_gets_a_4xx_and_the_server_goes_on(main, path, body):
    assert_error(post(main.url, path, body))
    assert_serves(main.url)


# Odd but valid: served normally.
ODD_CASES = [
    {**COMPLETION, "top_k": 100000, "temperature": 1},  # beyond the vocabulary: every token stays
    {**COMPLETION, "top_k": -1},
    {**COMPLETION, "unknown_field": {"deep": [1, 2]}},
    {**COMPLETION, "seed": 2**63 - 1, "n": 2, "temperature": 1},
    {**COMPLETION, "seed": -(2**63)},
    {**COMPLETION, "prompt": "héllo \u2028 \U0001F600 \x00 ok"},
    {**COMPLETION, "logit_bias": {"12": -100, "13": 100}},
    {**CHAT, "chat_template_kwargs": {"documents": [{"title": "t", "text": "x"}], "template": 1, "self": 2}},
    {**CHAT, "messages": [{"role": "user", "content": None}]},
]


@pytest.mark.parametrize("body", ODD_CASES, ids=range(len(ODD_CASES)))
def test_odd_but_valid_requests_are_served(main, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = post(main.url, path, body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"]


def test_bad_requests_leave_running_streams_alone(main):
    """The requests that used to kill the engine, sent while three streams run: the streams end
    normally and the server serves on."""
    client = openai.OpenAI(base_url=f"{main.url}/v1", api_key="none", max_retries=0)

    def stream() -> tuple[str | None, int]:
        chunks = list(client.completions.create(model=MODEL, prompt="Count on", max_tokens=300, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        return chunks[-2].choices[0].finish_reason, chunks[-1].usage.completion_tokens

    with ThreadPoolExecutor(3) as pool:
        running = [pool.submit(stream) for _ in range(3)]
        time.sleep(0.2)
        for body in ({**COMPLETION, "top_k": 100000, "temperature": 1, "max_tokens": 2},
                     {**COMPLETION, "min_tokens": 1, "stop_token_ids": [-100000]},
                     {**COMPLETION, "min_tokens": 1, "stop_token_ids": [10**6]},
                     {**COMPLETION, "logit_bias": {"99999999": 5}},
                     {**COMPLETION, "prompt": [-1], "echo": True, "logprobs": 1}):
            r = post(main.url, "/v1/completions", body)
            assert r.status_code < 500, r.text
        assert [f.result() for f in running] == [("length", 300)] * 3
    assert_serves(main.url)


def test_operator_template_errors_are_400s(main):
    for content in ("RANGE", "RECURSE", "RAISE", "UNDEFINED", "DIVIDE", "REPEAT", "DOUBLE"):
        err = assert_error(post(main.url, "/v1/chat/completions",
                                {**CHAT, "messages": [{"role": "user", "content": content}]}), 400)
        assert "chat template" in err["message"] and err["param"] == "messages"


def test_tokenize_renders_tools_as_the_chat_request_does(main):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools = post(main.url, "/tokenize", {"messages": messages, "tools": tools}).json()["count"]
    without = post(main.url, "/tokenize", {"messages": messages}).json()["count"]
    chat = post(main.url, "/v1/chat/completions", {**CHAT, "messages": messages, "tools": tools,
                                                   "tool_choice": "none", "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == with_tools > without


def test_openapi_declares_the_request_bodies(main):
    schema = httpx.get(main.url + "/openapi.json").json()
    for path, field in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt"),
                        ("/tokenize", "messages"), ("/detokenize", "tokens")):
        body = schema["paths"][path]["post"]["requestBody"]
        ref = body["content"]["application/json"]["schema"]["$ref"]
        model = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
        assert field in model["properties"], (path, model)
    seed = schema["components"]["schemas"]["CompletionRequest"]["properties"]["seed"]
    assert {"maximum": 2**63 - 1, "minimum": -(2**63)}.items() <= seed["anyOf"][0].items()


# -- the event loop ------------------------------------------------------------------------------
def test_a_huge_prompt_does_not_stall_other_streams(main):
    """While 4 MB prompts are refused (and a 200 KB one is tokenized and refused), another stream's
    largest inter-token gap stays within 0.5 s of its median."""
    stamps: list[float] = []

    def stream() -> None:
        with httpx.stream("POST", main.url + "/v1/completions", timeout=120, json={
                **COMPLETION, "prompt": "Go", "max_tokens": 1500, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.monotonic())

    runner = threading.Thread(target=stream)
    runner.start()
    while len(stamps) < 20:
        time.sleep(0.01)
    for body in ({**COMPLETION, "prompt": "x" * 4_000_000}, {**CHAT, "messages": [{"role": "user", "content": "x" * 4_000_000}]},
                 {**COMPLETION, "prompt": "hello world " * 17_000}, {**COMPLETION, "prompt": "x" * 4_000_000}):
        r = post(main.url, "/v1/chat/completions" if "messages" in body else "/v1/completions", body)
        assert assert_error(r, 400)["code"] == "context_length_exceeded"
    runner.join()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert len(gaps) > 100
    assert max(gaps) < statistics.median(gaps) + 0.5, (max(gaps), statistics.median(gaps))


def stream_gaps_during(url: str, work) -> list[float]:
    """Inter-token gaps of streams run one after another while `work()` runs."""
    gaps: list[float] = []
    done = threading.Event()

    def streams() -> None:
        while not done.is_set():
            last = None
            with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                    **COMPLETION, "prompt": "Go", "max_tokens": 1500, "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        now = time.monotonic()
                        if last is not None:
                            gaps.append(now - last)
                        last = now

    runner = threading.Thread(target=streams)
    runner.start()
    try:
        while len(gaps) < 20 and runner.is_alive():
            time.sleep(0.01)
        work()
    finally:
        done.set()
        runner.join()
    return gaps


def test_thousands_of_empty_messages_are_refused_before_rendering(main):
    """30,000 empty messages (0.9 MB) pass the message cap; 2,000 are rendered, and refused by the
    special tokens they render to, without tokenizing them. Both quickly, and another stream's
    largest inter-token gap stays within 0.5 s of its median."""
    def work() -> None:
        for _ in range(3):
            start = time.monotonic()
            err = assert_error(post(main.url, "/v1/chat/completions",
                                    {**CHAT, "messages": [{"role": "user", "content": ""}] * 30_000}), 400)
            assert "--max-messages" in err["message"] and err["param"] == "messages", err
            err = assert_error(post(main.url, "/v1/chat/completions",
                                    {**CHAT, "messages": [{"role": "user", "content": ""}] * 2_000}), 400)
            assert err["code"] == "context_length_exceeded" and "special tokens" in err["message"], err
            assert time.monotonic() - start < 10

    gaps = stream_gaps_during(main.url, work)
    assert len(gaps) > 100
    assert max(gaps) < statistics.median(gaps) + 0.5, (max(gaps), statistics.median(gaps))


def test_too_many_tools_is_a_400(main):
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    err = assert_error(post(main.url, "/v1/chat/completions", {**CHAT, "tools": tools}), 400)
    assert "--max-tools" in err["message"] and err["param"] == "tools", err
    r = post(main.url, "/v1/chat/completions", {**CHAT, "tools": tools[:128], "tool_choice": "none"})
    assert r.status_code == 200 or assert_error(r, 400)["code"] == "context_length_exceeded", r.text  # not the cap
    assert_serves(main.url)


def test_a_template_that_loops_for_ever_is_stopped_and_streams_go_on(main):
    """Nested loops of 10^10 empty iterations: a 400 once the render's time is up (5 s), rendered
    off the event loop meanwhile, so another stream goes on."""
    def work() -> None:
        start = time.monotonic()
        err = assert_error(post(main.url, "/v1/chat/completions",
                                {**CHAT, "messages": [{"role": "user", "content": "LOOP"}]}), 400)
        assert "chat template" in err["message"] and "ran for more than" in err["message"], err
        assert time.monotonic() - start < 30

    gaps = stream_gaps_during(main.url, work)
    assert len(gaps) > 100
    assert max(gaps) < statistics.median(gaps) + 0.5, (max(gaps), statistics.median(gaps))
    assert_serves(main.url)


# -- grammars that take too long ------------------------------------------------------------------
# A schema of 5,000 string properties (100 KB) takes xgrammar more than five minutes to compile.
SLOW_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}


def child_pids(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def compiling(server_pid: int) -> list[int]:
    """The grammar compilations running for a server: the children of its helper process."""
    helpers = []
    for pid in child_pids(server_pid):
        with contextlib.suppress(OSError):
            if b"pocketllm.structured.worker" in open(f"/proc/{pid}/cmdline", "rb").read():
                helpers.append(pid)
    return [child for helper in helpers for child in child_pids(helper)]


def wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_grammar_past_the_time_limit_is_a_400_and_is_stopped(main):
    """--max-grammar-compile-time 3: a 400 soon after 3 s, nothing left compiling, and the next
    constrained request is served."""
    warm = post(main.url, "/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "[ab]+"}})
    assert warm.status_code == 200, warm.text
    start = time.monotonic()
    err = assert_error(post(main.url, "/v1/completions", {**COMPLETION, "structured_outputs": {"json": SLOW_SCHEMA}},
                            timeout=120), 400)
    assert "--max-grammar-compile-time" in err["message"] and err["param"] == "structured_outputs", err
    assert time.monotonic() - start < 3 + 10
    assert wait_for(lambda: not compiling(main.proc.pid), 10)
    r = post(main.url, "/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "[cd]+"}})
    assert r.status_code == 200 and set(r.json()["choices"][0]["text"]) <= {"c", "d"}, r.text
    assert_serves(main.url)


def test_a_grammar_is_stopped_when_its_clients_leave(tiny_chat):
    """The time limit is far (120 s): three requests of one grammar share one compilation (the
    server could run two at once), and it ends within seconds of the last client leaving."""
    engine = LLMEngine(EngineArgs(model=str(tiny_chat), max_model_len=512, num_kv_blocks=64))
    cfg = ServerConfig(model_name=MODEL, max_grammar_compile_time=120)
    with in_process(create_app(AsyncLLM(engine), cfg)) as url, ThreadPoolExecutor(3) as pool:
        assert post(url, "/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "[ab]+"}}).status_code == 200
        leaving = [pool.submit(post, url, "/v1/completions",
                               {**COMPLETION, "seed": i, "structured_outputs": {"json": SLOW_SCHEMA}}, timeout=4)
                   for i in range(3)]
        assert wait_for(lambda: compiling(os.getpid()), 10), "the grammar is not compiled in a child process"
        most = 0
        while not all(f.done() for f in leaving):
            most = max(most, len(compiling(os.getpid())))
            time.sleep(0.05)
        assert most == 1, most
        for f in leaving:
            with pytest.raises(httpx.TimeoutException):
                f.result()
        assert wait_for(lambda: not compiling(os.getpid()), 15)
        assert post(url, "/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "[cd]+"}}).status_code == 200


# -- bounded waiting -------------------------------------------------------------------------------
def test_waiting_is_bounded_under_kv_pressure(servers):
    """13 streams of ~300-token prompts and 400 tokens out on a 48-block cache (one request nearly
    fills it: the queue outlasts 2 s on any machine) with
    --max-queue-time 2: each either runs to the end or, if it could not start within 2 s, gets an
    error event and [DONE] by then; nobody waits in silence."""
    url = servers["pressure"].url
    long_prompt = " ".join(["word"] * 300)

    def stream(i: int) -> tuple[str, float]:
        start, first, events = time.monotonic(), None, []
        with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                **COMPLETION, "prompt": f"{i} {long_prompt}", "max_tokens": 400, "ignore_eos": True,
                "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    first = first or time.monotonic() - start
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        if "error" in last:
            assert last["error"]["type"] == "server_error" and "queue" in last["error"]["message"]
            assert len(events) == 2  # no token came before the error
            return "timed out", first
        assert last["choices"][0]["finish_reason"] == "length"
        return "done", first

    with ThreadPoolExecutor(13) as pool:
        results = list(pool.map(stream, range(13)))
    kinds = [k for k, _ in results]
    assert "done" in kinds and "timed out" in kinds, results
    assert all(first < 2 + 3 for kind, first in results if kind == "timed out"), results
    # Non-streamed: a 503 with Retry-After.
    with ThreadPoolExecutor(13) as pool:
        responses = list(pool.map(lambda i: post(url, "/v1/completions", {
            **COMPLETION, "prompt": f"{i} {long_prompt}", "max_tokens": 400, "ignore_eos": True}, timeout=120),
            range(13)))
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses and 503 in statuses, statuses
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) > 0 and "queue" in assert_error(r, 503)["message"]
    metrics = httpx.get(url + "/metrics").text
    assert 'pocketllm:num_requests_running{model_name="tiny-chat"} 0.0' in metrics
    assert 'pocketllm:kv_cache_usage_perc{model_name="tiny-chat"} 0.0' in metrics


# -- slow clients ------------------------------------------------------------------------------------
def read_to_eof(s: socket.socket, timeout: float = 30) -> bytes:
    """What the server sends until it closes the connection."""
    s.settimeout(timeout)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def test_a_body_that_never_comes_times_out(servers):
    server = servers["slow"]
    socks = []
    for _ in range(6):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\"")
        socks.append(s)
    t0 = time.monotonic()
    for s in socks:
        data = read_to_eof(s, timeout=10)  # the server answers, then closes the connection
        assert data.startswith(b"HTTP/1.1 408"), data[:100]
        assert b"request_timeout" in data
        s.close()
    assert time.monotonic() - t0 < 3 + 5
    assert_serves(server.url)


def test_requests_in_flight_are_bounded_and_health_still_answers(servers):
    server = servers["slow"]
    # 8 requests (--max-connections) held open by their late bodies: the next request gets a 503,
    # /health and /metrics are still answered.
    holders = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(8)]
    try:
        for s in holders:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 10\r\n\r\n")
        time.sleep(0.5)
        r = httpx.get(server.url + "/v1/models", timeout=10)
        assert "--max-connections" in assert_error(r, 503)["message"] and r.headers["retry-after"] == "1"
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200
    finally:
        for s in holders:
            s.close()
    time.sleep(0.3)
    assert_serves(server.url)


def test_silent_connections_are_closed_and_lock_no_one_out(servers):
    """More connections than --max-connections that never send a request head (or send half of
    one) do not keep requests or /health out, and the server closes them after
    --request-header-timeout (1 s); so it does a connection idle after its response."""
    server = servers["slow"]
    silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(12)]
    half = socket.create_connection(("127.0.0.1", server.port))
    half.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # no blank line: the head never ends
    kept_alive = socket.create_connection(("127.0.0.1", server.port))
    kept_alive.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    try:
        assert_serves(server.url)
        for s in [*silent, half]:
            assert read_to_eof(s) == b""  # closed by the server, not by the 30 s timeout here
        assert read_to_eof(kept_alive).startswith(b"HTTP/1.1 200")
        assert_serves(server.url)
    finally:
        for s in [*silent, half, kept_alive]:
            s.close()


def test_a_head_that_came_in_time_is_not_cut(servers):
    """The head's timeout stops once the head is complete: a body sent after it (within the body's
    own timeout) is served."""
    server = servers["slow"]
    body = json.dumps(COMPLETION).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
        time.sleep(2)  # past --request-header-timeout (1 s), within --request-body-timeout (3 s)
        s.sendall(body)
        assert read_to_eof(s).startswith(b"HTTP/1.1 200")


# -- web pages ---------------------------------------------------------------------------------------
# Without an API key, a page the user opens must not drive the server: no body it can POST without
# a CORS preflight is taken, no domain name of its own (DNS rebinding) is answered, no cross-site
# POST is served.
def prompt_tokens(url: str) -> float:
    """Prompt tokens the engine has taken so far."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics").text.splitlines()
               if line.startswith("pocketllm:prompt_tokens_total{"))


@pytest.fixture(scope="module")
def open_to_one_site(tiny_models):
    """In this process, without an API key: the Host evil.example allowed, and every origin."""
    cfg = ServerConfig(model_name=MODEL, allowed_hosts=["evil.example"], allowed_origins=["*"])
    with in_process(create_app(AsyncLLM(tiny_engine(tiny_models)), cfg)) as url:
        yield url


@pytest.fixture(scope="module")
def keyed(tiny_models):
    """In this process, with an API key."""
    with in_process(create_app(AsyncLLM(tiny_engine(tiny_models)), ServerConfig(model_name=MODEL,
                                                                                api_key="sk-test"))) as url:
        yield url


@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "Application/X-WWW-Form-Urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_bodies_a_page_posts_without_a_preflight_get_415(main, content_type):
    before = prompt_tokens(main.url)
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT), ("/tokenize", {"prompt": "x"})):
        r = httpx.post(main.url + path, content=json.dumps(body).encode(), headers={"Content-Type": content_type})
        err = assert_error(r, 415)
        assert err["code"] == "unsupported_media_type" and "Content-Type: application/json" in err["message"]
    assert prompt_tokens(main.url) == before  # the engine never saw them
    assert_serves(main.url)


def test_json_without_a_content_type_is_served(main):
    r = httpx.post(main.url + "/v1/completions", content=json.dumps(COMPLETION).encode())
    assert "content-type" not in r.request.headers and r.status_code == 200, r.text


def test_a_domain_name_of_its_own_is_refused_without_an_api_key(main):
    port = main.port
    for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.nip.io:{port}"):
        err = assert_error(httpx.get(main.url + "/v1/models", headers={"Host": host}), 400)
        assert err["code"] == "invalid_host" and "--allowed-hosts" in err["message"], err
    assert_error(httpx.post(main.url + "/v1/completions", json=COMPLETION, headers={"Host": "evil.example"}), 400)
    # localhost and IP addresses (the machine's LAN address too) are no rebound names
    for host in (f"localhost:{port}", "LOCALHOST", f"127.0.0.1:{port}", f"[::1]:{port}", "192.168.1.20:8000", "[fe80::1]"):
        assert httpx.get(main.url + "/v1/models", headers={"Host": host}).status_code == 200, host
    assert httpx.get(main.url + "/health", headers={"Host": "evil.example"}).status_code == 200


def test_a_cross_site_post_is_refused_without_an_api_key(main):
    """A page's fetch() of a Blob without a type has no Content-Type and no preflight: its Origin
    gives it away."""
    before = prompt_tokens(main.url)
    for origin in ("http://evil.example", "null", f"http://localhost:{main.port}"):
        r = httpx.post(main.url + "/v1/completions", content=json.dumps(COMPLETION).encode(), headers={"Origin": origin})
        err = assert_error(r, 403)
        assert err["code"] == "origin_not_allowed" and "--allowed-origins" in err["message"]
    assert prompt_tokens(main.url) == before
    # the server's own pages (/docs) post from its own origin
    assert httpx.post(main.url + "/v1/completions", json=COMPLETION, headers={"Origin": main.url}).status_code == 200
    assert httpx.get(main.url + "/v1/models", headers={"Origin": "http://evil.example"}).status_code == 200


def test_allowed_hosts_and_every_origin(open_to_one_site):
    url = open_to_one_site
    assert httpx.get(url + "/v1/models", headers={"Host": "evil.example"}).status_code == 200
    assert_error(httpx.get(url + "/v1/models", headers={"Host": "other.example"}), 400)
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2},
                   headers={"Origin": "http://evil.example"})
    assert r.status_code == 200, r.text
    # "*" comes without credentials: no site may send the user's cookies and read the reply
    simple = httpx.get(url + "/v1/models", headers={"Origin": "http://evil.example", "Cookie": "session=1"})
    preflight = httpx.options(url + "/v1/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    for r in (simple, preflight):
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "http://evil.example")
        assert "access-control-allow-credentials" not in r.headers, r.headers


def test_an_api_key_lifts_the_host_and_origin_checks(keyed):
    auth = {"Authorization": "Bearer sk-test"}
    assert httpx.get(keyed + "/v1/models", headers={"Host": "evil.example", **auth}).status_code == 200
    r = httpx.post(keyed + "/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2},
                   headers={"Origin": "http://evil.example", **auth})
    assert r.status_code == 200, r.text
    assert_error(httpx.get(keyed + "/v1/models", headers={"Host": "evil.example"}), 401)


def test_listening_beyond_loopback_without_a_key_warns(caplog):
    for host, key, warns in (("0.0.0.0", None, True), ("::", None, True), ("192.168.1.5", None, True),
                             ("myserver.lan", None, True), ("0.0.0.0", "sk-test", False), ("127.0.0.1", None, False),
                             ("localhost", None, False), ("::1", None, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pocketllm"):
            warn_if_exposed(host, ServerConfig(model_name=MODEL, api_key=key))
        assert ("without an API key" in caplog.text) == warns, (host, key, caplog.text)


# -- drain -------------------------------------------------------------------------------------------
def test_sigterm_drains(servers):
    """In-flight requests finish (or, past --shutdown-timeout, end with an error event and [DONE]),
    new requests and /health get 503 with Retry-After meanwhile, and the process exits 0."""
    server = servers["drain"]
    url = server.url
    events: dict[str, list[str]] = {"short": [], "long": []}
    started = threading.Barrier(3)

    def stream(name: str, max_tokens: int) -> None:
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                **COMPLETION, "prompt": name, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events[name].append(line[6:])
                    break
            started.wait()
            events[name] += [line[6:] for line in lines if line.startswith("data: ")]

    threads = [threading.Thread(target=stream, args=("short", 20)),
               threading.Thread(target=stream, args=("long", 4000))]
    for t in threads:
        t.start()
    started.wait()
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=10)
    assert_error(r, 503)
    assert int(r.headers["retry-after"]) > 0
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    for t in threads:
        t.join(timeout=30)
    assert server.proc.wait(timeout=30) == 0
    assert time.monotonic() - t0 < 2 + 8
    short, long = events["short"], events["long"]
    assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "[DONE]" and json.loads(long[-2])["error"]["type"] == "server_error"


# -- a dead engine exits ---------------------------------------------------------------------------
FAULTY_SERVER = """
import sys
from pocketllm.cli.main import main
from pocketllm.runner.model_runner import ModelRunner

def launch(self, *args, **kwargs):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")

ModelRunner.launch = launch  # what a device fault looks like to the engine
sys.exit(main(sys.argv[1:]))
"""


def test_a_device_fault_makes_the_server_exit_non_zero(tiny_chat):
    """An error the engine cannot recover from ends the process (non-zero, for a supervisor to
    restart it) instead of leaving a server that answers 503 forever."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", FAULTY_SERVER, "serve", str(tiny_chat), "--port", str(port),
                             *TINY_FLAGS], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        r = post(f"http://127.0.0.1:{port}", "/v1/completions", COMPLETION)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert proc.wait(timeout=30) == 1
        assert "illegal memory access" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- a bug inside a step ---------------------------------------------------------------------------
# Faults are injected where a bug would raise (the sampler, the runner's launch); the engine's
# isolation of them is what is tested.
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def tiny_engine(tiny_models, **kwargs) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(tiny_models["llama"][1]), dtype="float32", num_kv_blocks=64, **kwargs))


def run_all(engine: LLMEngine, requests: dict) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def token_ids(out) -> list[int]:
    assert out.error is None, out.error
    return out.outputs[0].token_ids


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_request_that_breaks_sampling_fails_alone(tiny_models, monkeypatch, async_scheduling):
    mark = 7  # a logit_bias key the injected sampler bug reacts to
    apply = Sampler._apply_bias_and_bans

    def buggy(logits, reqs, vocab):
        if any(mark in r.params.logit_bias for r in reqs):
            raise RuntimeError("a sampler bug")
        return apply(logits, reqs, vocab)

    a, b, bad = prompts_of([5, 9, 7])
    reference = run_all(tiny_engine(tiny_models), {"a": (a, GREEDY), "b": (b, GREEDY)})
    monkeypatch.setattr(Sampler, "_apply_bias_and_bans", staticmethod(buggy))
    engine = tiny_engine(tiny_models, async_scheduling=async_scheduling)
    out = run_all(engine, {"a": (a, GREEDY), "bad": (bad, SamplingParams(max_tokens=8, logit_bias={mark: 1.0})),
                           "b": (b, GREEDY)})
    assert "a sampler bug" in out["bad"].error and out["bad"].outputs[0].finish_reason == "abort"
    assert token_ids(out["a"]) == token_ids(reference["a"]) and token_ids(out["b"]) == token_ids(reference["b"])
    engine.check_no_leaks()


def test_a_failing_step_fails_only_its_requests(tiny_models):
    """max_num_seqs=1: "b" waits while "a" is prefilled; that step raises. "a" fails, "b" runs,
    and the prefix cache does not hand a's unwritten blocks to the same prompt sent again."""
    a, b = prompts_of([40, 9])  # a: two full blocks of 16 tokens, registered when scheduled
    reference = run_all(tiny_engine(tiny_models), {"a": (a, GREEDY), "b": (b, GREEDY)})
    engine = tiny_engine(tiny_models, max_num_seqs=1)
    launch, calls = engine.runner.launch, []

    def faulty(sched, prev=None):
        calls.append(sched)
        if len(calls) == 1:
            raise RuntimeError("a kernel bug")
        return launch(sched, prev)

    engine.runner.launch = faulty
    out = run_all(engine, {"a": (a, GREEDY), "b": (b, GREEDY)})
    assert "a kernel bug" in out["a"].error and out["a"].outputs[0].token_ids == []
    assert token_ids(out["b"]) == token_ids(reference["b"])
    engine.check_no_leaks()
    again = run_all(engine, {"a2": (a, GREEDY)})
    assert token_ids(again["a2"]) == token_ids(reference["a"])
    engine.check_no_leaks()


def test_failing_every_step_kills_the_engine_and_tells_its_clients(tiny_models):
    engine = tiny_engine(tiny_models, max_num_seqs=1)

    def broken(sched, prev=None):
        raise RuntimeError("a persistent bug")

    engine.runner.launch = broken
    died = threading.Event()

    async def main():
        llm = AsyncLLM(engine, on_fatal=lambda e: died.set())
        streams = [llm.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY) for i, p in enumerate(prompts_of([5] * 5))]
        errors = []
        for stream in streams:
            with pytest.raises((RequestFailedError, EngineClosedError)) as e:
                async for _ in stream:
                    pass
            errors.append(type(e.value))
        await asyncio.to_thread(died.wait, 30)
        # Each failed step failed its request; the third in a row killed the engine and closed the rest.
        assert errors == [RequestFailedError] * (LLMEngine.MAX_FAILED_STEPS - 1) + [EngineClosedError] * 3
        assert not llm.is_running and isinstance(llm.error, EngineDeadError)
        with pytest.raises(EngineClosedError):
            llm.add_request("late", {"prompt_token_ids": [1, 2]}, GREEDY)

    asyncio.run(main())


def test_offline_generate_checks_requests_before_running(tiny_models):
    """What used to fail inside a step offline: a top_k beyond the vocabulary samples over the whole
    vocabulary; out-of-range stop ids are a RequestError before anything is queued."""
    llm = LLM(str(tiny_models["llama"][1]), dtype="float32", num_kv_blocks=64)
    prompt = {"prompt_token_ids": prompts_of([5])[0]}
    seeded = dict(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    whole = llm.generate(prompt, SamplingParams(**seeded, top_k=0))[0].outputs[0].token_ids
    assert llm.generate(prompt, SamplingParams(**seeded, top_k=100_000))[0].outputs[0].token_ids == whole
    for bad in (dict(stop_token_ids=[10**6], min_tokens=1), dict(logit_bias={-3: 1.0})):
        with pytest.raises(RequestError, match="out of range"):
            llm.generate([prompt, prompt], SamplingParams(max_tokens=4, **bad))
        assert not llm.engine.has_unfinished_requests()
    with pytest.raises(RequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-100000])
    llm.engine.check_no_leaks()


def test_a_reply_without_max_tokens_is_bounded_by_the_server_default(tmp_path):
    """A chat request without max_tokens stops at --default-max-tokens with finish_reason "length",
    streamed or not, instead of running to the end of the context."""
    cfg = ServerConfig(model_name=MODEL, default_max_tokens=7)
    engine = LLMEngine(EngineArgs(model=str(make_tiny_chat_model(tmp_path)), dtype="float32", num_kv_blocks=64))
    with in_process(create_app(AsyncLLM(engine), cfg)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        ask = {"model": MODEL, "messages": CHAT["messages"], "extra_body": {"ignore_eos": True}}
        r = client.chat.completions.create(**ask)
        assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
        chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 7
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        longer = client.chat.completions.create(**ask, max_tokens=12)  # what a request asks for wins
        assert longer.usage.completion_tokens == 12


def test_a_base_model_says_where_its_prompts_go(tmp_path, caplog):
    """A model without a chat template: a warning at start-up, and chat requests get a 400 that
    names /v1/completions and --chat-template; completions work."""
    model = make_tiny_chat_model(tmp_path)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    engine = LLMEngine(EngineArgs(model=str(model), dtype="float32", num_kv_blocks=64))
    with caplog.at_level(logging.WARNING, logger="pocketllm"):
        app = create_app(AsyncLLM(engine), ServerConfig(model_name=MODEL))
    assert "has no chat template" in caplog.text and "/v1/completions" in caplog.text
    with in_process(app) as url:
        err = assert_error(httpx.post(url + "/v1/chat/completions", json=CHAT), 400)
        assert err["param"] == "messages" and "/v1/completions" in err["message"]
        assert "--chat-template" in err["message"]
        assert httpx.post(url + "/v1/completions", json=COMPLETION).status_code == 200
