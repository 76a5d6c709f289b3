"""A bounded soak test of `pocketllm serve`: a mixed workload from a few concurrent clients for a
fixed time, checking that every request gets the answer it should and that the server neither grows
nor slows down over the run.

The server runs as a subprocess on a free loopback port. After it is healthy, one request of each
kind warms it up; then `--clients` clients (the official `openai` client, AsyncOpenAI, against
127.0.0.1 only) loop until the deadline, each picking its next request with a seeded RNG from:

    chat                   chat completion
    chat_stream            streamed chat completion (some with usage)
    completion             legacy completion
    completion_stream      streamed legacy completion
    echo_logprobs          legacy completion with echo and logprobs (some streamed)
    cancel                 a stream closed by the client after k chunks
    json_schema            chat with response_format json_schema (a small schema)
    choice                 structured_outputs {"choice": [...]} (chat or completion, some streamed)
    tools                  chat with tools and tool_choice "required" (some streamed)
    n2                     n=2 (chat or completion)
    bad                    a malformed request that must get a 4xx

Counted as errors: any 5xx, connection error or timeout, any other unexpected status (a 4xx for a
request that should succeed, a 2xx for a bad one), a stream that ends without `[DONE]` or carries an
error event, a reply of the wrong shape (a finished structured output that does not parse or does
not match its schema or choices, n=2 without two choices, echo without the prompt, ...), a server
that is not idle (requests running or waiting, KV blocks in use) shortly after the load stops, a
traceback in the server's log, and a server exit code other than 0 after SIGTERM. A structured
output cut off by max_tokens is counted as "truncated", not as an error.

Measured: the server's resident memory (its process tree) after the warm-up, every
`--sample-interval` seconds and at the end; per request kind, the median end-to-end latency (and
TTFT for streams) of the requests started in the first and in the last fifth of the run, and their
ratio. The machine may be shared: the CPU time other processes used in those two windows is
recorded next to the drift. With prefix caching, the KV cache's pages become resident as blocks are
first used, so early RSS growth is mostly the cache filling; the growth over the second half of the
run is the better leak signal.

    python benchmarks/suites/soak.py [--duration 600] [--clients 6] [--seed 0] [--model PATH]
                              [--server-args "--max-model-len 2048"] [--out FILE]

Exits 1 if there was any error.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import psutil
from prometheus_client.parser import text_string_to_metric_families

from pocketllm.bench.report import environment, print_table, write_json

# Loopback only: no proxy from the environment may see these requests.
os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"

WEIGHTS = {"chat": 3, "chat_stream": 3, "completion": 2, "completion_stream": 2, "echo_logprobs": 1.5,
           "cancel": 2, "json_schema": 1.5, "choice": 1.5, "tools": 1.5, "n2": 1.5, "bad": 2}

CHAT_PROMPTS = ["Say hello to {name}.", "Name a color.", "Count to {n}.", "What is {a}+{b}?",
                "Write one sentence about {thing}.", "Give a short fact about the number {n}.",
                "Describe {thing} in five words."]
COMPLETION_PROMPTS = ["Once upon a time in {city},", "The capital of France is", "Story number {n}:",
                      "My favourite animal is", "One, two,", "A recipe for {thing}:", "{name} walked into"]
WORDS = {"name": ["Ana", "Bo", "Chen", "Dara", "Eli"], "thing": ["rivers", "bread", "the moon", "bicycles", "tea"],
         "city": ["Paris", "Lima", "Oslo", "Cairo", "Kyoto"]}

SCHEMAS = [
    {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 100}},
     "required": ["answer"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
]
CHOICES = [["yes", "no", "maybe"], ["red", "green", "blue"], ["cat", "dog"]]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}}, "required": ["tz"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time",
                                           "parameters": CLOCK}}]
TOOL_SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
TOOL_ASKS = ["What is the weather in {city} for the next {d} days?", "What time is it in UTC?",
             "Will it rain in {city} tomorrow?"]
HI = [{"role": "user", "content": "hi"}]


def fill(rng: random.Random, template: str) -> str:
    return template.format(name=rng.choice(WORDS["name"]), thing=rng.choice(WORDS["thing"]),
                           city=rng.choice(WORDS["city"]), n=rng.randrange(2, 1000), a=rng.randrange(10),
                           b=rng.randrange(10), d=rng.randrange(1, 8))


# -- one request ------------------------------------------------------------------------------
@dataclass
class Spec:
    """What to send and what must come back."""
    kind: str
    endpoint: str  # "chat" | "completions"
    body: dict
    stream: bool = False
    expect_4xx: bool = False
    cancel_after: int | None = None  # close the stream after this many chunks
    check: dict = field(default_factory=dict)  # what the reply must satisfy


@dataclass
class Result:
    kind: str
    outcome: str  # ok | truncated | cancelled | finished_before_cancel | rejected_4xx | an error's reason
    error: bool
    start: float  # seconds since the load began (negative: warm-up)
    e2e: float
    ttft: float | None = None
    status: int | None = None
    detail: str | None = None
    spec: Spec | None = None


def sampling(rng: random.Random) -> dict:
    t = rng.choice([0.0, 0.0, 0.7, 1.0])
    return {"temperature": t, **({"seed": rng.randrange(1 << 31)} if t else {})}


def chat_messages(rng: random.Random) -> list[dict]:
    return [{"role": "user", "content": fill(rng, rng.choice(CHAT_PROMPTS))}]


def build(kind: str, rng: random.Random, model: str, max_model_len: int | None) -> Spec:
    if kind == "chat":
        return Spec(kind, "chat", {"model": model, "messages": chat_messages(rng),
                                   "max_tokens": rng.randint(8, 32), **sampling(rng)}, check={"text": True})
    if kind == "chat_stream":
        usage = rng.random() < 0.5
        body = {"model": model, "messages": chat_messages(rng), "max_tokens": rng.randint(8, 32), **sampling(rng)}
        if usage:
            body["stream_options"] = {"include_usage": True}
        return Spec(kind, "chat", body, stream=True, check={"text": True, "usage": usage})
    if kind in ("completion", "completion_stream"):
        return Spec(kind, "completions", {"model": model, "prompt": fill(rng, rng.choice(COMPLETION_PROMPTS)),
                                          "max_tokens": rng.randint(8, 32), **sampling(rng)},
                    stream=kind == "completion_stream", check={"text": True})
    if kind == "echo_logprobs":
        prompt = fill(rng, rng.choice(COMPLETION_PROMPTS))
        return Spec(kind, "completions", {"model": model, "prompt": prompt, "max_tokens": rng.randint(4, 16),
                                          "echo": True, "logprobs": rng.randint(1, 3), **sampling(rng)},
                    stream=rng.random() < 0.5, check={"echo": prompt})
    if kind == "cancel":
        k = rng.randint(1, 5)
        if rng.random() < 0.5:
            spec = Spec(kind, "chat", {"model": model, "messages": chat_messages(rng), "max_tokens": 32,
                                       "extra_body": {"ignore_eos": True}, **sampling(rng)})
        else:
            spec = Spec(kind, "completions", {"model": model, "prompt": fill(rng, rng.choice(COMPLETION_PROMPTS)),
                                              "max_tokens": 32, "extra_body": {"ignore_eos": True}, **sampling(rng)})
        spec.stream, spec.cancel_after = True, k
        return spec
    if kind == "json_schema":
        i = rng.randrange(len(SCHEMAS))
        ask = ["What is {a}+{b}? Answer in JSON.", "Pick a color and say if it is ok, in JSON."][i]
        return Spec(kind, "chat", {
            "model": model, "messages": [{"role": "user", "content": fill(rng, ask)}], "max_tokens": 32,
            "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i]}},
            **sampling(rng)}, stream=rng.random() < 0.3, check={"schema": SCHEMAS[i]})
    if kind == "choice":
        options = rng.choice(CHOICES)
        extra = {"extra_body": {"structured_outputs": {"choice": options}}}
        stream = rng.random() < 0.4
        if rng.random() < 0.5:
            return Spec(kind, "chat", {"model": model, "messages": [{"role": "user", "content": (
                f"Answer with one of {', '.join(options)}: {fill(rng, rng.choice(CHAT_PROMPTS))}")}],
                "max_tokens": 8, **extra, **sampling(rng)}, stream=stream, check={"choice": options})
        return Spec(kind, "completions", {"model": model, "prompt": f"The answer ({'/'.join(options)}) is",
                                          "max_tokens": 8, **extra, **sampling(rng)},
                    stream=stream, check={"choice": options})
    if kind == "tools":
        return Spec(kind, "chat", {"model": model, "messages": [{"role": "user", "content": fill(
            rng, rng.choice(TOOL_ASKS))}], "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 64, **sampling(rng)}, stream=rng.random() < 0.3, check={"tools": True})
    if kind == "n2":
        common = {"model": model, "n": 2, "max_tokens": rng.randint(8, 16), "temperature": rng.choice([0.0, 0.8])}
        if rng.random() < 0.5:
            return Spec(kind, "chat", {**common, "messages": chat_messages(rng)}, check={"n": 2, "text": True})
        return Spec(kind, "completions", {**common, "prompt": fill(rng, rng.choice(COMPLETION_PROMPTS))},
                    check={"n": 2, "text": True})
    if kind == "bad":
        return bad_request(rng, model, max_model_len)
    raise ValueError(kind)


def bad_request(rng: random.Random, model: str, max_model_len: int | None) -> Spec:
    chat = {"model": model, "messages": HI, "max_tokens": 8}
    comp = {"model": model, "prompt": "Hi", "max_tokens": 8}
    cases = [
        ("chat", {**chat, "temperature": 5}),
        ("chat", {**chat, "max_tokens": -1}),
        ("chat", {**chat, "model": "no-such-model"}),
        ("completions", {**comp, "model": "no-such-model"}),
        ("chat", {**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objectt"}}}}),
        ("chat", {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
        ("chat", {**chat, "n": 0}),
        ("chat", {**chat, "messages": []}),
        ("chat", {**chat, "top_logprobs": 2}),
        ("chat", {**chat, "tool_choice": "required"}),
        ("chat", {**chat, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
        ("chat", {**chat, "extra_body": {"structured_outputs": {"choice": "red"}}}),
        ("chat", {**chat, "extra_body": {"structured_outputs": {"regex": "(["}}}),
        ("completions", {**comp, "top_p": 0}),
        ("completions", {**comp, "presence_penalty": 3}),
        ("completions", {**comp, "logprobs": 6}),
        ("completions", {**comp, "prompt": []}),
        ("completions", {**comp, "prompt": [1, 10 ** 9]}),
        ("completions", {**comp, "logit_bias": {"abc": 1}}),
    ]
    if max_model_len is not None and max_model_len <= 1 << 16:
        # Longer than the context (each " word" is at least one token): refused before any compute.
        cases.append(("completions", {**comp, "prompt": "word " * (max_model_len + 16)}))
    endpoint, body = rng.choice(cases)
    # Half of them streamed: the rejection must come before the stream starts.
    return Spec("bad", endpoint, body, stream=rng.random() < 0.5, expect_4xx=True)


class BadReply(Exception):
    pass


def absorb(acc: dict, obj: dict) -> None:
    """Fold a response or a stream chunk into acc: per choice index its text, tool calls, finish
    reason and legacy logprobs; and the usage."""
    if obj.get("usage"):
        acc["usage"] = obj["usage"]
    for pos, ch in enumerate(obj.get("choices") or []):
        c = acc["choices"].setdefault(ch.get("index", pos), {"text": "", "calls": [], "finish": None,
                                                             "lp_tokens": [], "lp_values": []})
        part = ch.get("delta") or ch.get("message") or {}
        c["text"] += part.get("content") or ch.get("text") or ""
        for i, tc in enumerate(part.get("tool_calls") or []):
            i = tc.get("index", i)
            while len(c["calls"]) <= i:
                c["calls"].append(["", ""])
            fn = tc.get("function") or {}
            c["calls"][i][0] += fn.get("name") or ""
            c["calls"][i][1] += fn.get("arguments") or ""
        lp = ch.get("logprobs")
        if isinstance(lp, dict) and lp.get("tokens") is not None:
            c["lp_tokens"] += lp["tokens"]
            c["lp_values"] += lp["token_logprobs"]
        if ch.get("finish_reason"):
            if c["finish"] is not None:
                raise BadReply(f"choice {ch.get('index', pos)} finished twice")
            c["finish"] = ch["finish_reason"]


def has_output(obj: dict) -> bool:
    for ch in obj.get("choices") or []:
        d = ch.get("delta") or {}
        if d.get("content") or d.get("tool_calls") or ch.get("text"):
            return True
    return False


def judge(spec: Spec, acc: dict) -> str:
    """The outcome of a finished reply, or BadReply."""
    chk, body = spec.check, spec.body
    choices = acc["choices"]
    n = chk.get("n", 1)
    if sorted(choices) != list(range(n)):
        raise BadReply(f"choice indices {sorted(choices)}, wanted {n}")
    if chk.get("usage") and not acc.get("usage"):
        raise BadReply("no usage chunk")
    outcome = "ok"
    for i, c in choices.items():
        finish = c["finish"]
        if finish not in ("stop", "length", "tool_calls"):
            raise BadReply(f"choice {i}: finish_reason {finish!r}")
        if chk.get("tools"):
            if finish == "length":
                outcome = "truncated"
                continue
            if finish != "tool_calls" or not c["calls"]:
                raise BadReply(f"choice {i}: tool_choice required but finish {finish!r}, calls {c['calls']}")
            for name, args in c["calls"]:
                if name not in TOOL_SCHEMA:
                    raise BadReply(f"unknown tool {name!r}")
                try:
                    jsonschema.validate(json.loads(args), TOOL_SCHEMA[name])
                except (ValueError, jsonschema.ValidationError) as e:
                    raise BadReply(f"tool {name} arguments {args!r}: {str(e).splitlines()[0]}") from None
            continue
        if finish == "tool_calls":
            raise BadReply(f"choice {i}: tool_calls without tools")
        text = c["text"]
        if "schema" in chk:
            if finish == "length":
                outcome = "truncated"
                continue
            try:
                jsonschema.validate(json.loads(text), chk["schema"])
            except (ValueError, jsonschema.ValidationError) as e:
                raise BadReply(f"choice {i}: {text!r} does not match the schema: {str(e).splitlines()[0]}") from None
        if "choice" in chk:
            if finish == "length":
                outcome = "truncated"
                continue
            if text not in chk["choice"]:
                raise BadReply(f"choice {i}: {text!r} is not one of {chk['choice']}")
        if "echo" in chk:
            if not text.startswith(chk["echo"]):
                raise BadReply(f"echo: {text!r} does not start with the prompt")
            tokens = c["lp_tokens"]
            if finish == "stop" and "".join(tokens[:-1]) == text:  # the stop token has a logprob, no text
                tokens = tokens[:-1]
            if "".join(tokens) != text or len(c["lp_values"]) != len(c["lp_tokens"]):
                raise BadReply(f"echo: logprob tokens {c['lp_tokens']!r} do not spell the text {text!r}")
            if not c["lp_values"] or c["lp_values"][0] is not None:
                raise BadReply("echo: the first prompt token must have no logprob")
        if chk.get("text") and not text and finish == "length":
            raise BadReply(f"choice {i}: empty text with finish_reason length")
    usage = acc.get("usage")
    if usage and body.get("max_tokens") and usage["completion_tokens"] > n * body["max_tokens"]:
        raise BadReply(f"usage {usage['completion_tokens']} completion tokens > {n} x max_tokens")
    return outcome


def summary_of(spec: Spec) -> dict:
    """The request as sent, for the failure log (long prompts shortened)."""
    body = {k: (v[:80] + f"... ({len(v)} chars)" if isinstance(v, str) and len(v) > 120 else v)
            for k, v in spec.body.items()}
    return {"endpoint": f"/v1/{'chat/completions' if spec.endpoint == 'chat' else 'completions'}",
            "stream": spec.stream, "cancel_after": spec.cancel_after, "body": body}


async def send(client: openai.AsyncOpenAI, spec: Spec, t_zero: float | None, timeout: float) -> Result:
    """One request and its outcome; t_zero is when the load began (None: a warm-up request)."""
    api = client.chat.completions if spec.endpoint == "chat" else client.completions
    t0 = time.monotonic()
    res = Result(spec.kind, "ok", False, -1.0 if t_zero is None else t0 - t_zero, 0.0, spec=spec)

    async def run() -> None:
        acc: dict[str, Any] = {"choices": {}}
        if not spec.stream:
            reply = await api.create(**spec.body)
            res.status = 200
            if spec.expect_4xx:
                res.outcome, res.error, res.detail = "accepted_bad_request", True, str(reply.model_dump())[:500]
                return
            absorb(acc, reply.model_dump())
            res.outcome = judge(spec, acc)
            return
        async with api.with_streaming_response.create(**spec.body, stream=True) as raw:
            res.status = raw.status_code
            if spec.expect_4xx:
                res.outcome, res.error = "accepted_bad_request", True
                res.detail = (await raw.text())[:500]
                return
            done, chunks, after_done = False, 0, 0
            async for line in raw.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue
                if done:
                    after_done += 1
                event = json.loads(data)
                if "error" in event:
                    raise BadReply(f"error event: {json.dumps(event)[:500]}")
                chunks += 1
                if res.ttft is None and has_output(event):
                    res.ttft = time.monotonic() - t0
                absorb(acc, event)
                if spec.cancel_after is not None and chunks >= spec.cancel_after:
                    res.outcome = "cancelled"
                    return  # leaving the block closes the connection mid-stream
            if after_done:
                raise BadReply(f"{after_done} events after [DONE]")
            if not done:
                raise BadReply(f"the stream ended without [DONE] after {chunks} chunks")
            outcome = judge(spec, acc)
            res.outcome = "finished_before_cancel" if spec.cancel_after is not None else outcome

    try:
        await asyncio.wait_for(run(), timeout + 10)
    except BadReply as e:
        res.outcome, res.error, res.detail = "bad_reply", True, str(e)
    except openai.APIStatusError as e:
        res.status = e.status_code
        res.detail = (e.response.text if e.response is not None else str(e))[:1000]
        if spec.expect_4xx and 400 <= e.status_code < 500:
            res.outcome = "rejected_4xx"
        else:
            res.error = True
            res.outcome = ("5xx" if e.status_code >= 500 else
                           "4xx_for_good_request" if 400 <= e.status_code < 500 else "unexpected_status")
    except (openai.APITimeoutError, asyncio.TimeoutError):
        res.outcome, res.error, res.detail = "timeout", True, f"no reply in {timeout} s"
    except openai.APIConnectionError as e:
        res.outcome, res.error, res.detail = "connection_error", True, f"{e!r}: {e.__cause__!r}"
    except Exception as e:  # noqa: BLE001 -- a reply the client could not parse, or anything else unexpected
        res.outcome, res.error, res.detail = "client_exception", True, f"{type(e).__name__}: {e}"[:1000]
    res.e2e = time.monotonic() - t0
    return res


# -- the server -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return []


def rss_bytes(proc: psutil.Process) -> int:
    total = 0
    for p in tree(proc):
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def machine_busy_seconds() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def scrape(text: str) -> dict:
    """The request counters and engine gauges of a /metrics page."""
    out: dict[str, Any] = {"success": {}}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "pocketllm:request_success_total":
                reason = s.labels.get("finished_reason", "?")
                out["success"][reason] = out["success"].get(reason, 0) + s.value
            elif s.name in ("pocketllm:num_requests_running", "pocketllm:num_requests_waiting",
                            "pocketllm:kv_cache_usage_perc", "pocketllm:prompt_tokens_total",
                            "pocketllm:generation_tokens_total"):
                key = s.name.split(":", 1)[1]
                out[key] = out.get(key, 0) + s.value
    return out


def log_problems(path: str) -> dict:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return {"tracebacks": 0, "error_lines": []}
    lines = text.splitlines()
    errors = [l for l in lines if re.match(r"(ERROR|CRITICAL)\b", l)]
    tracebacks = [i for i, l in enumerate(lines) if l.startswith("Traceback (most recent call last)")]
    return {"tracebacks": len(tracebacks), "error_lines": errors[:20],
            "first_traceback": "\n".join(lines[tracebacks[0]:tracebacks[0] + 60]) if tracebacks else None,
            "tail": "\n".join(lines[-40:])}


# -- the run ----------------------------------------------------------------------------------
def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def drift(results: list[Result], elapsed: float, samples: list[dict]) -> dict:
    first, last = elapsed / 5, elapsed * 4 / 5
    out: dict[str, Any] = {"window_s": round(first, 1)}
    for kind in WEIGHTS:
        rs = [r for r in results if r.kind == kind and not r.error and r.start >= 0]
        a = [r for r in rs if r.start < first]
        b = [r for r in rs if r.start >= last]
        row: dict[str, Any] = {"n_first": len(a), "n_last": len(b)}
        for name, get in (("e2e", lambda r: r.e2e), ("ttft", lambda r: r.ttft)):
            xa = [get(r) for r in a if get(r) is not None]
            xb = [get(r) for r in b if get(r) is not None]
            if not xa and not xb:
                continue
            ma, mb = median(xa), median(xb)
            row[f"{name}_first_ms"] = None if ma is None else round(1e3 * ma, 1)
            row[f"{name}_last_ms"] = None if mb is None else round(1e3 * mb, 1)
            row[f"{name}_ratio"] = round(mb / ma, 3) if ma and mb else None
        out[kind] = row

    # CPU time of processes other than the server and this client in the two windows.
    def foreign(t0: float, t1: float) -> float | None:
        inside = [s for s in samples if t0 - 1e-6 <= s["t"] <= t1 + 1e-6]
        if len(inside) < 2:
            return None
        s0, s1 = inside[0], inside[-1]
        own = (s1["server_cpu_s"] - s0["server_cpu_s"]) + (s1["client_cpu_s"] - s0["client_cpu_s"])
        wall = s1["t"] - s0["t"]
        return round(max(0.0, s1["busy_s"] - s0["busy_s"] - own) / wall, 3) if wall > 0 else None

    out["foreign_cpu_cores_first"] = foreign(0, first)
    out["foreign_cpu_cores_last"] = foreign(last, float("inf"))  # up to the sample taken at the end
    return out


async def soak(args: argparse.Namespace, base: str, server: subprocess.Popen, headers: dict) -> dict:
    proc = psutil.Process(server.pid)
    me = psutil.Process()
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=args.api_key or "unused", max_retries=0,
                                timeout=args.request_timeout)
    http = httpx.AsyncClient(base_url=base, headers=headers, timeout=30)
    try:
        model = (await client.models.list()).data[0].id
        tokenized = await http.post("/tokenize", json={"model": model, "prompt": "x"})
        max_model_len = tokenized.json().get("max_model_len") if tokenized.status_code == 200 else None
        results: list[Result] = []

        # Warm-up: one request of each kind, one after the other (compiles grammars, fills caches).
        rng = random.Random(f"{args.seed}:warmup")
        t_warm = time.monotonic()
        for kind in WEIGHTS:
            results.append(await send(client, build(kind, rng, model, max_model_len), None, args.request_timeout))
        warmup_s = time.monotonic() - t_warm

        metrics_before = scrape((await http.get("/metrics")).text)
        samples: list[dict] = []
        t_zero = time.monotonic()
        deadline = t_zero + args.duration
        stop = asyncio.Event()
        crashed: list[str] = []

        async def sample() -> None:
            s = {"t": round(time.monotonic() - t_zero, 2), "rss_mb": round(rss_bytes(proc) / 2 ** 20, 1),
                 "server_cpu_s": cpu_seconds(tree(proc)), "client_cpu_s": cpu_seconds([me]),
                 "busy_s": machine_busy_seconds(), "requests_done": sum(r.start >= 0 for r in results)}
            try:
                h0 = time.monotonic()
                s["health_status"] = (await http.get("/health", timeout=10)).status_code
                s["health_ms"] = round(1e3 * (time.monotonic() - h0), 1)
            except httpx.HTTPError as e:
                s["health_status"], s["health_error"] = None, repr(e)
            samples.append(s)

        async def sampler() -> None:
            await sample()
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), args.sample_interval)
                except asyncio.TimeoutError:
                    pass
                if server.poll() is not None:
                    crashed.append(f"the server exited with {server.returncode} during the run")
                    stop.set()
                    return
                if not stop.is_set():
                    await sample()

        async def worker(i: int) -> None:
            rng = random.Random(f"{args.seed}:{i}")
            kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
            while time.monotonic() < deadline and not stop.is_set():
                spec = build(rng.choices(kinds, weights)[0], rng, model, max_model_len)
                results.append(await send(client, spec, t_zero, args.request_timeout))

        sampling_task = asyncio.create_task(sampler())
        await asyncio.gather(*(worker(i) for i in range(args.clients)))
        elapsed = time.monotonic() - t_zero
        stop.set()
        await sampling_task
        if not crashed:
            await sample()  # the end, before waiting for idle

        # After the load: nothing running or waiting, no KV block in use.
        idle, metrics_after, t_idle = False, {}, time.monotonic()
        while not crashed and time.monotonic() - t_idle < 30:
            try:
                metrics_after = scrape((await http.get("/metrics")).text)
            except httpx.HTTPError:
                break
            if (metrics_after.get("num_requests_running", 1) == 0 and metrics_after.get("num_requests_waiting", 1) == 0
                    and metrics_after.get("kv_cache_usage_perc", 1) == 0):
                idle = True
                break
            await asyncio.sleep(0.5)
        return {"model": model, "max_model_len": max_model_len, "results": results, "samples": samples,
                "elapsed": elapsed, "warmup_s": warmup_s, "metrics_before": metrics_before,
                "metrics_after": metrics_after, "idle": idle, "idle_wait_s": time.monotonic() - t_idle,
                "crashed": crashed}
    finally:
        await http.aclose()
        await client.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600, help="seconds of load after the warm-up")
    ap.add_argument("--clients", type=int, default=6, help="concurrent clients")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="model path (default: the default model, pulled on first use)")
    ap.add_argument("--server-args", default="", help="extra flags for `pocketllm serve`, e.g. '--max-model-len 2048'")
    ap.add_argument("--request-timeout", type=float, default=120)
    ap.add_argument("--sample-interval", type=float, default=10, help="seconds between RSS samples")
    ap.add_argument("--start-timeout", type=float, default=300, help="seconds the server gets to become healthy")
    ap.add_argument("--server-log", default=None, help="where the server's output goes (default: a temporary file)")
    ap.add_argument("--out", default=None, help="JSON result file")
    args = ap.parse_args()

    from pocketllm.pull import pull_default_model

    model_path = args.model or str(pull_default_model())
    server_flags = shlex.split(args.server_args)
    args.api_key = None
    for i, flag in enumerate(server_flags):
        if flag == "--api-key" and i + 1 < len(server_flags):
            args.api_key = server_flags[i + 1]
        elif flag.startswith("--api-key="):
            args.api_key = flag.split("=", 1)[1]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.server_log:
        log_path = args.server_log
    else:
        fd, log_path = tempfile.mkstemp(prefix="pocketllm-soak-", suffix=".log")
        os.close(fd)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pocketllm.cli.main", "serve", model_path, "--host", "127.0.0.1", "--port", str(port),
           *server_flags]
    print(f"starting: {shlex.join(cmd)}\nserver log: {log_path}", flush=True)
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    t_start = time.monotonic()
    run: dict | None = None
    failure: str | None = None
    exit_code: int | None = None
    stopped = False  # whether the server was still running at the end, and was sent SIGTERM
    try:
        while True:
            if server.poll() is not None:
                failure = f"the server exited with {server.returncode} before it was healthy"
                break
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t_start > args.start_timeout:
                failure = f"the server was not healthy after {args.start_timeout} s"
                break
            time.sleep(0.5)
        startup_s = time.monotonic() - t_start
        if failure is None:
            print(f"healthy after {startup_s:.1f} s; warming up, then {args.clients} clients for {args.duration:.0f} s",
                  flush=True)
            try:
                run = asyncio.run(soak(args, base, server, headers))
            except Exception as e:  # noqa: BLE001 -- reported with the rest, after the server is stopped
                failure = f"the soak stopped early: {type(e).__name__}: {e}"
    finally:
        if server.poll() is None:
            stopped = True
            server.send_signal(signal.SIGTERM)
            try:
                exit_code = server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
                failure = (failure + "; " if failure else "") + "the server did not exit within 120 s of SIGTERM"
        else:
            exit_code = server.returncode
    return report(args, model_path, log_path, startup_s, run, failure, exit_code, stopped)


def report(args, model_path: str, log_path: str, startup_s: float, run: dict | None, failure: str | None,
           exit_code: int | None, stopped: bool) -> int:
    problems = log_problems(log_path)
    errors: Counter = Counter()
    if failure:
        errors[failure] += 1
    how = "after SIGTERM" if stopped else "(it had exited on its own)"
    if exit_code != 0:
        errors[f"server exit code {exit_code} {how}"] += 1
    if problems["tracebacks"]:
        errors["tracebacks in the server log"] += problems["tracebacks"]
    payload: dict[str, Any] = {**environment(), "command": shlex.join(["python", "benchmarks/suites/soak.py", *sys.argv[1:]]),
                               "benchmark": "soak", "model": model_path, "server_args": args.server_args,
                               "duration_s": args.duration, "clients": args.clients, "seed": args.seed,
                               "weights": WEIGHTS, "startup_s": round(startup_s, 1), "server_log": log_path}
    rows = []
    if run is not None:
        results: list[Result] = run["results"]
        load = [r for r in results if r.start >= 0]
        for r in results:
            if r.error:
                errors[f"{r.kind}: {r.outcome}"] += 1
        errors.update(run["crashed"])
        if not run["idle"] and not run["crashed"]:
            errors["not idle 30 s after the load"] += 1
        by_kind: dict[str, Counter] = defaultdict(Counter)
        for r in load:
            by_kind[r.kind][r.outcome] += 1
        warm = Counter(f"{r.kind}:{r.outcome}" for r in results if r.start < 0)
        samples = run["samples"]
        rss = [s["rss_mb"] for s in samples]
        mid = [s for s in samples if s["t"] >= run["elapsed"] / 2]
        rss_info = {"start_mb": rss[0] if rss else None, "end_mb": rss[-1] if rss else None,
                    "max_mb": max(rss) if rss else None,
                    "growth_mb": round(rss[-1] - rss[0], 1) if rss else None,
                    "growth_second_half_mb": round(mid[-1]["rss_mb"] - mid[0]["rss_mb"], 1) if len(mid) > 1 else None}
        ma, mb = run["metrics_before"], run["metrics_after"]
        cancels = sum(r.outcome == "cancelled" for r in load)
        finished = [r for r in load if not r.error and r.kind != "bad" and r.outcome != "cancelled"]
        metrics = {"success_during_load": {k: v - ma.get("success", {}).get(k, 0)
                                           for k, v in mb.get("success", {}).items()},
                   "success_total": mb.get("success"), "cancelled_by_client": cancels,
                   "finished_by_client": {"requests": len(finished),
                                          "choices": sum(r.spec.check.get("n", 1) for r in finished)},
                   "end_state": {k: mb.get(k) for k in ("num_requests_running", "num_requests_waiting",
                                                        "kv_cache_usage_perc")},
                   "idle": run["idle"], "idle_wait_s": round(run["idle_wait_s"], 1)}
        failures = [{"kind": r.kind, "t": round(r.start, 2), "outcome": r.outcome, "status": r.status,
                     "e2e_s": round(r.e2e, 2), "detail": r.detail, "request": summary_of(r.spec)}
                    for r in results if r.error][:50]
        lat = drift(results, run["elapsed"], samples)
        for kind in WEIGHTS:
            c = by_kind.get(kind, Counter())
            d = lat.get(kind, {})
            rows.append({"kind": kind, "requests": sum(c.values()),
                         "errors": sum(r.error for r in load if r.kind == kind),
                         "outcomes": " ".join(f"{k}={v}" for k, v in sorted(c.items())),
                         **{k: d.get(k) for k in ("e2e_first_ms", "e2e_last_ms", "e2e_ratio", "ttft_ratio")}})
        payload.update({
            "served_model": run["model"], "max_model_len": run["max_model_len"],
            "warmup_s": round(run["warmup_s"], 1), "load_s": round(run["elapsed"], 1),
            "requests": {"total": len(load), "per_s": round(len(load) / run["elapsed"], 2) if run["elapsed"] else None,
                         "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())}, "warmup": dict(warm)},
            "rss": rss_info, "latency_drift": lat, "metrics": metrics, "samples": samples, "failures": failures})
    payload["server"] = {"exit_code": exit_code, "stopped_by_sigterm": stopped, "log_tracebacks": problems["tracebacks"],
                         "log_error_lines": problems["error_lines"],
                         "first_traceback": problems.get("first_traceback"),
                         "log_tail": problems.get("tail") if errors else None}
    payload["errors"] = {"count": sum(errors.values()), "by_reason": dict(errors)}
    payload["passed"] = not errors

    print()
    if rows:
        print_table(rows, ["kind", "requests", "errors", "e2e_first_ms", "e2e_last_ms", "e2e_ratio", "ttft_ratio",
                           "outcomes"])
        p = payload
        print(f"\n{p['requests']['total']} requests in {p['load_s']} s ({p['requests']['per_s']}/s) from "
              f"{args.clients} clients, after a {p['warmup_s']} s warm-up; warm-up outcomes: {p['requests']['warmup']}")
        r = p["rss"]
        print(f"server RSS: start {r['start_mb']} MB, end {r['end_mb']} MB, max {r['max_mb']} MB, growth "
              f"{r['growth_mb']} MB (second half {r['growth_second_half_mb']} MB), {len(p['samples'])} samples")
        lat = p["latency_drift"]
        print(f"other processes' CPU (cores): first fifth {lat['foreign_cpu_cores_first']}, "
              f"last fifth {lat['foreign_cpu_cores_last']}")
        m = p["metrics"]
        print(f"/metrics: finished during the load {m['success_during_load']}; the clients saw "
              f"{m['finished_by_client']['requests']} requests ({m['finished_by_client']['choices']} choices) "
              f"finish and cancelled {m['cancelled_by_client']}; end state {m['end_state']}, idle={m['idle']}")
        for f in p["failures"][:5]:
            print(f"failure: {json.dumps(f)[:600]}")
    print(f"server exit code {how}: {exit_code}; tracebacks in its log: {problems['tracebacks']}")
    print(f"errors: {payload['errors']['count']} {dict(errors) if errors else ''}".rstrip())
    write_json(args.out, payload)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
