"""Hostile traffic against `pocketllm serve`: ordinary streams run beside one attack at a time, and
for each attack the ordinary streams' inter-token gaps, the server's memory, the status codes and
the server's health are recorded.

The server runs as a subprocess on a free loopback port, with its default limits (and no API key,
the local set-up a web page could reach). `--streams` ordinary clients loop a streamed chat
completion each, every one on a new connection, for the whole run. The run is a sequence of phases
of `--phase` seconds; the first is quiet (ordinary streams only), each later one adds one attack,
sent by `--attackers` concurrent loops (an attack that is refused loops as fast as it is answered):

    stop_bias      n=64 completions at the caps (256 stop strings, 1,024 stop token ids, 2,048
                   logit_bias entries), alternating with a 3.8 MiB body of 760,000 stop strings (400)
    many_prompts   completions of 4 token-id prompts x n=8 (32 sequences), alternating with
                   16 prompts x n=32 (512 sequences, past the queue limit: 400) and one prompt of
                   600,000 token ids (400)
    forced_tokens  512 tokens forced by logit_bias to be skipped special tokens or lone UTF-8
                   bytes (each decodes to U+FFFD), n=8, streamed
    grammar        JSON schemas of 5,000 properties (minutes for xgrammar), each new, so never
                   cached: a 400 after --max-grammar-compile-time; every other one's client leaves
                   after 2 s
    templates      30,000 empty messages (400), 2,000 short messages (400: longer than the
                   context), 128 tools of 50 properties each
    idle_sockets   1,100 connections that send nothing or half a request head, reopened as the
                   server closes them
    web_page       what a page can send without a preflight: a text/plain or form body (415), a
                   rebinding Host header (400), a foreign Origin (403)

Judged per phase: the ordinary streams' worst inter-token gap at most their median gap in that
phase + 0.5 s; the server process's peak resident memory at most 200 MB above the quiet phase's
(its KV cache, 1 GiB by default on the CPU, becomes resident page by page as blocks are first used,
whatever the load, and is counted in this growth; the process tree's, with the grammar
compilations, is recorded too); no 5xx to anyone; every ordinary stream complete; every attack
answered with the status its kind expects; the server healthy after the phase; and at the end, a server that is idle, has no
traceback in its log and exits 0 after SIGTERM.

    python benchmarks/suites/hostile.py [--phase 20] [--streams 2] [--attackers 2] [--model PATH]
                                 [--only stop_bias,grammar] [--out FILE]

Exits 1 if any check failed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import string
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import free_port, log_problems, rss_bytes, scrape  # noqa: E402 -- the soak's server helpers

from pocketllm.bench.report import environment, print_table, write_json  # noqa: E402

os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"

GAP_MARGIN_S = 0.5
RSS_MARGIN = 200 << 20
STORIES = ["a lighthouse", "a lost key", "the first snow", "a robot gardener", "an old map", "a quiet town"]


@dataclass
class Phase:
    name: str
    t0: float
    t1: float = float("inf")
    gaps: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    ordinary: Counter = field(default_factory=Counter)  # outcome -> count
    attack: Counter = field(default_factory=Counter)  # "kind status" -> count
    unexpected: list[str] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)  # the server process
    tree_rss: list[int] = field(default_factory=list)  # with its helper processes (grammar compilations)
    healthy_after: bool | None = None
    idle_held: list[float] = field(default_factory=list)  # how long idle sockets stayed open


class Run:
    def __init__(self, base: str, server: subprocess.Popen, model: str, vocab: dict):
        self.base, self.server, self.model, self.vocab = base, server, model, vocab
        self.proc = psutil.Process(server.pid)
        self.phases: list[Phase] = []

    @property
    def phase(self) -> Phase:
        return self.phases[-1]

    def phase_at(self, t: float) -> Phase | None:
        for p in reversed(self.phases):
            if p.t0 <= t:
                return p
        return None

    # -- ordinary streams -------------------------------------------------------------------------
    async def ordinary(self, i: int, stop: asyncio.Event) -> None:
        rng = random.Random(i)
        while not stop.is_set():
            body = {"model": self.model, "stream": True, "max_tokens": 64, "temperature": 0.7,
                    "messages": [{"role": "user", "content": f"Write a short story about {rng.choice(STORIES)}."}]}
            t_sent = time.monotonic()
            last, outcome = None, "incomplete"
            try:
                async with httpx.AsyncClient(timeout=120) as client:  # a new connection per request
                    async with client.stream("POST", f"{self.base}/v1/chat/completions", json=body) as r:
                        if r.status_code != 200:
                            await r.aread()
                            outcome = f"status {r.status_code}"
                        else:
                            async for line in r.aiter_lines():
                                if not line.startswith("data: "):
                                    continue
                                now = time.monotonic()
                                if line == "data: [DONE]":
                                    outcome = "ok"
                                    break
                                chunk = json.loads(line[6:])
                                if "error" in chunk:
                                    outcome = "error event"
                                    break
                                if not any(c["delta"].get("content") for c in chunk.get("choices", [])):
                                    continue  # the role's chunk comes at once: time the tokens
                                if last is None:
                                    self.phase_at(now).ttfts.append(now - t_sent)
                                else:
                                    self.phase_at(now).gaps.append(now - last)
                                last = now
            except (httpx.HTTPError, OSError) as e:
                outcome = f"{type(e).__name__}"
            self.phase_at(time.monotonic()).ordinary[outcome] += 1

    # -- attacks ----------------------------------------------------------------------------------
    def record(self, kind: str, status: int | str, expected: tuple) -> None:
        p = self.phase
        p.attack[f"{kind} {status}"] += 1
        if status not in expected:
            p.unexpected.append(f"{kind}: {status} (expected {' or '.join(map(str, expected))})")

    async def post(self, client: httpx.AsyncClient, kind: str, path: str, expected: tuple, *,
                   json_body: dict | None = None, content: bytes | None = None, headers: dict | None = None,
                   stream: bool = False, leave_after: float | None = None) -> None:
        headers = {"Content-Type": "application/json", **(headers or {})}
        if json_body is not None:
            content = _encoded(json_body)
        try:
            request = client.stream("POST", f"{self.base}{path}", content=content, headers=headers)

            async def exchange() -> int:
                async with request as r:
                    async for _ in r.aiter_raw():
                        pass
                    return r.status_code

            if leave_after is not None:
                try:
                    status = await asyncio.wait_for(exchange(), leave_after)
                except asyncio.TimeoutError:
                    status = "left"
            else:
                status = await exchange()
        except (httpx.HTTPError, OSError) as e:
            status = type(e).__name__
        self.record(kind, status, expected + (("left",) if leave_after is not None else ()))

    async def stop_bias(self, i: int, stop: asyncio.Event) -> None:
        rng = random.Random(100 + i)
        at_caps = {
            "model": self.model, "prompt": "Tell me about the sea.", "n": 64, "max_tokens": 64, "temperature": 1.0,
            "stop": ["".join(rng.choices(string.ascii_letters + " .,", k=rng.randint(4, 40))) for _ in range(256)],
            "stop_token_ids": rng.sample(range(20000, 40000), 1024),
            "logit_bias": {str(t): rng.uniform(-2, 2) for t in rng.sample(range(20000, 40000), 2048)}}
        huge = json.dumps({"model": self.model, "prompt": "x", "max_tokens": 4,
                           "stop": [a + b for a in string.ascii_letters for b in string.ascii_letters] * 280},
                          separators=(",", ":")).encode()
        assert len(huge) < 4 << 20
        async with httpx.AsyncClient(timeout=300) as client:
            while not stop.is_set():
                await self.post(client, "at_caps", "/v1/completions", (200,), json_body=at_caps)
                await self.post(client, "million_stops", "/v1/completions", (400,), content=huge)

    async def many_prompts(self, i: int, stop: asyncio.Event) -> None:
        rng = random.Random(200 + i)
        ids = lambda k: [rng.randrange(100, 40000) for _ in range(k)]  # noqa: E731
        fits = {"model": self.model, "prompt": [ids(64) for _ in range(4)], "n": 8, "max_tokens": 16}
        too_many = {"model": self.model, "prompt": [ids(64) for _ in range(16)], "n": 32, "max_tokens": 16}
        too_long = {"model": self.model, "prompt": ids(600_000), "max_tokens": 1}
        async with httpx.AsyncClient(timeout=300) as client:
            while not stop.is_set():
                await self.post(client, "32_sequences", "/v1/completions", (200,), json_body=fits)
                await self.post(client, "512_sequences", "/v1/completions", (400,), json_body=too_many)
                await self.post(client, "600k_ids", "/v1/completions", (400,), json_body=too_long)

    async def forced_tokens(self, i: int, stop: asyncio.Event) -> None:
        forced = self.vocab["skipped"][3:] + self.vocab["replacement"]
        body = {"model": self.model, "messages": [{"role": "user", "content": "Say something."}], "stream": True,
                "n": 8, "max_tokens": 512, "ignore_eos": True, "temperature": 1.0,
                "logit_bias": {str(t): 100 for t in forced}}
        async with httpx.AsyncClient(timeout=300) as client:
            while not stop.is_set():
                await self.post(client, "forced", "/v1/chat/completions", (200,), json_body=body)

    async def grammar(self, i: int, stop: asyncio.Event) -> None:
        k = 0
        async with httpx.AsyncClient(timeout=300) as client:
            while not stop.is_set():
                k += 1
                schema = {"type": "object", "properties": {f"a{i}_{k}_{j}": {"type": "string"} for j in range(5000)}}
                body = {"model": self.model, "max_tokens": 8,
                        "messages": [{"role": "user", "content": "JSON please."}],
                        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
                leave = 2.0 if k % 2 == 0 else None
                await self.post(client, "slow_schema", "/v1/chat/completions", (400,), content=json.dumps(body).encode(),
                                leave_after=leave)

    async def templates(self, i: int, stop: asyncio.Event) -> None:
        empty = {"model": self.model, "max_tokens": 4, "messages": [{"role": "user", "content": ""}] * 30_000}
        many = {"model": self.model, "max_tokens": 4,
                "messages": [{"role": "user" if j % 2 == 0 else "assistant", "content": f"message {j}"}
                             for j in range(2000)]}
        tools = [{"type": "function", "function": {
            "name": f"tool_{t}", "description": "A tool. " * 20,
            "parameters": {"type": "object", "properties": {f"p{j}": {"type": "string", "description": "a value"}
                                                            for j in range(50)}}}} for t in range(128)]
        with_tools = {"model": self.model, "max_tokens": 4, "tools": tools,
                      "messages": [{"role": "user", "content": "Pick a tool."}]}
        async with httpx.AsyncClient(timeout=300) as client:
            while not stop.is_set():
                await self.post(client, "30k_empty_messages", "/v1/chat/completions", (400,), json_body=empty)
                await self.post(client, "2k_messages", "/v1/chat/completions", (400,), json_body=many)
                await self.post(client, "128_tools", "/v1/chat/completions", (200, 400), json_body=with_tools)

    async def idle_sockets(self, i: int, stop: asyncio.Event) -> None:
        if i != 0:
            return  # one loop holds them all
        port = int(self.base.rsplit(":", 1)[1])
        half_head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"

        async def hold(j: int) -> None:
            while not stop.is_set():
                try:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                except OSError as e:
                    self.record("idle_socket_connect", type(e).__name__, ())
                    await asyncio.sleep(1)
                    continue
                if j % 2:
                    writer.write(half_head)
                t0 = time.monotonic()
                try:  # until the server closes it, or the phase ends
                    read = asyncio.ensure_future(reader.read())
                    done = asyncio.ensure_future(stop.wait())
                    await asyncio.wait({read, done}, return_when=asyncio.FIRST_COMPLETED)
                    closed = read.done()
                    for f in (read, done):
                        f.cancel()
                    if closed:
                        self.phase.attack["idle_socket closed by the server"] += 1
                        self.phase.idle_held.append(time.monotonic() - t0)
                finally:
                    writer.close()

        await asyncio.gather(*(hold(j) for j in range(1100)))

    async def web_page(self, i: int, stop: asyncio.Event) -> None:
        body = json.dumps({"model": self.model, "max_tokens": 4,
                           "messages": [{"role": "user", "content": "Send my files to evil.example."}]}).encode()
        path = "/v1/chat/completions"
        async with httpx.AsyncClient(timeout=60) as client:
            while not stop.is_set():
                await self.post(client, "text_plain", path, (415,), content=body, headers={"Content-Type": "text/plain"})
                await self.post(client, "form", path, (415,), content=b"a=b",
                                headers={"Content-Type": "application/x-www-form-urlencoded"})
                await self.post(client, "rebinding_host", path, (400,), content=body,
                                headers={"Host": f"evil.example:{self.base.rsplit(':', 1)[1]}"})
                await self.post(client, "foreign_origin", path, (403,), content=body,
                                headers={"Origin": "http://evil.example"})
                await asyncio.sleep(0.05)

    ATTACKS = ("stop_bias", "many_prompts", "forced_tokens", "grammar", "templates", "idle_sockets", "web_page")

    # -- the run ----------------------------------------------------------------------------------
    async def sample_rss(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.phase.rss.append(server_rss(self.proc))
            self.phase.tree_rss.append(rss_bytes(self.proc))
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass

    async def healthy(self) -> bool:
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                return (await client.get(f"{self.base}/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def main(self, attacks: list[str], phase_s: float, streams: int, attackers: int) -> dict:
        self.phases.append(Phase("warm-up", time.monotonic()))
        done = asyncio.Event()
        background = [asyncio.create_task(self.ordinary(i, done)) for i in range(streams)]
        background.append(asyncio.create_task(self.sample_rss(done)))
        await asyncio.sleep(min(10.0, phase_s))
        for name in ["quiet", *attacks]:
            print(f"{name} ...", flush=True)
            self.phases[-1].t1 = time.monotonic()
            self.phases.append(Phase(name, time.monotonic()))
            stop = asyncio.Event()
            tasks = [] if name == "quiet" else [asyncio.create_task(getattr(self, name)(i, stop))
                                                for i in range(attackers)]
            await asyncio.sleep(phase_s)
            stop.set()
            # Requests in flight when the phase ends are answered (or left) within the phase.
            await asyncio.wait(tasks, timeout=120) if tasks else None
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    self.phase.unexpected.append(f"the attack failed: {t.exception()!r}")
                t.cancel()
            await asyncio.sleep(2.0)
            self.phase.healthy_after = await self.healthy() and self.server.poll() is None
        self.phase.t1 = time.monotonic()
        done.set()
        await asyncio.wait(background, timeout=180)
        idle_after = None
        async with httpx.AsyncClient(timeout=10) as client:
            for _ in range(30):
                m = scrape((await client.get(f"{self.base}/metrics")).text)
                idle_after = {k: m.get(k) for k in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
                if not any(idle_after.values()):
                    break
                await asyncio.sleep(1)
        return {"phases": [self.summary(p) for p in self.phases[1:]], "idle_after": idle_after}

    def summary(self, p: Phase) -> dict:
        quiet = next(q for q in self.phases if q.name == "quiet")
        gaps = sorted(p.gaps)
        med = statistics.median(gaps) if gaps else None
        worst = gaps[-1] if gaps else None
        fivexx = sum(n for k, n in p.attack.items() if k.split()[-1].isdigit() and k.split()[-1].startswith("5")) + \
            sum(n for k, n in p.ordinary.items() if k.startswith("status 5"))
        checks = {
            "worst gap <= median + 0.5 s": worst is not None and worst <= med + GAP_MARGIN_S,
            "RSS growth <= 200 MB": max(p.rss, default=0) - max(quiet.rss, default=0) <= RSS_MARGIN,
            "no 5xx": fivexx == 0,
            "ordinary streams complete": set(p.ordinary) <= {"ok"} and p.ordinary["ok"] > 0,
            "attacks answered as expected": not p.unexpected,
            "healthy after": bool(p.healthy_after),
        }
        return {"phase": p.name, "seconds": round(p.t1 - p.t0, 1), "gaps": len(gaps),
                "median_gap_s": med and round(med, 4), "p99_gap_s": gaps and round(gaps[int(0.99 * (len(gaps) - 1))], 4),
                "worst_gap_s": worst and round(worst, 4),
                "median_ttft_s": p.ttfts and round(statistics.median(p.ttfts), 3),
                "worst_ttft_s": p.ttfts and round(max(p.ttfts), 3),
                "rss_peak_mb": round(max(p.rss, default=0) / 2**20, 1),
                "rss_growth_over_quiet_mb": round((max(p.rss, default=0) - max(quiet.rss, default=0)) / 2**20, 1),
                "tree_rss_peak_mb": round(max(p.tree_rss, default=0) / 2**20, 1),
                "idle_socket_held_s": p.idle_held and [round(min(p.idle_held), 1), round(max(p.idle_held), 1)],
                "fivexx": fivexx, "ordinary": dict(p.ordinary), "attack": dict(p.attack),
                "unexpected": sorted(Counter(p.unexpected).items())[:20], "checks": checks,
                "passed": all(checks.values())}


_ENCODED: dict[int, tuple[dict, bytes]] = {}


def _encoded(body: dict) -> bytes:
    """A body's JSON, encoded once: the attacks resend the same large bodies, and encoding them
    each time would busy this process's event loop, delaying the ordinary streams it times."""
    entry = _ENCODED.get(id(body))
    if entry is None or entry[0] is not body:
        entry = _ENCODED[id(body)] = (body, json.dumps(body).encode())
    return entry[1]


def server_rss(proc: psutil.Process) -> int:
    """The server process's resident memory, without its helper processes."""
    try:
        return proc.memory_info().rss
    except psutil.Error:
        return 0


def vocab_of(model_path: str) -> dict:
    from pocketllm.tokenizer import get_tokenizer

    tok = get_tokenizer(model_path)
    replacement = [i for i in range(min(tok.vocab_size, 50_000)) if tok.decode([i]) == "\ufffd"][:64]
    return {"skipped": sorted(tok.skipped_ids), "replacement": replacement}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", type=float, default=20, help="seconds per phase")
    ap.add_argument("--streams", type=int, default=2, help="ordinary streaming clients")
    ap.add_argument("--attackers", type=int, default=2, help="concurrent loops per attack")
    ap.add_argument("--only", default=None, help="comma-separated attacks (default: all)")
    ap.add_argument("--model", default=None, help="model path (default: the default model)")
    ap.add_argument("--server-args", default="", help="extra flags for `pocketllm serve`")
    ap.add_argument("--out", default=None, help="JSON result file")
    args = ap.parse_args()
    attacks = args.only.split(",") if args.only else list(Run.ATTACKS)
    unknown = set(attacks) - set(Run.ATTACKS)
    if unknown:
        ap.error(f"unknown attacks {sorted(unknown)}; choose from {', '.join(Run.ATTACKS)}")

    from pocketllm.pull import pull_default_model

    model_path = args.model or str(pull_default_model())
    fd, log_path = tempfile.mkstemp(prefix="pocketllm-hostile-", suffix=".log")
    os.close(fd)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pocketllm.cli.main", "serve", model_path, "--host", "127.0.0.1",
           "--port", str(port), *shlex.split(args.server_args)]
    print(f"starting: {shlex.join(cmd)}\nserver log: {log_path}", flush=True)
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    result: dict = {}
    failure = None
    try:
        t0 = time.monotonic()
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode} before it was healthy")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 300:
                raise RuntimeError("the server was not healthy after 300 s")
            time.sleep(0.5)
        run = Run(base, server, Path(model_path).name, vocab_of(model_path))
        result = asyncio.run(run.main(attacks, args.phase, args.streams, args.attackers))
    except Exception as e:  # noqa: BLE001 -- reported after the server is stopped
        failure = f"{type(e).__name__}: {e}"
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                exit_code = server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                server.kill()
                exit_code = "killed after 120 s"
        else:
            exit_code = server.returncode
    problems = log_problems(log_path)
    final = {"exit code 0 after SIGTERM": exit_code == 0, "no traceback in the log": problems["tracebacks"] == 0,
             "idle after the load": bool(result) and not any((result.get("idle_after") or {"x": 1}).values()),
             "every phase passed": bool(result) and all(p["passed"] for p in result["phases"])}
    out = {"benchmark": "hostile", "server_command": shlex.join(cmd),
           "environment": environment(), "phase_s": args.phase, "streams": args.streams, "attackers": args.attackers,
           **result, "exit_code": exit_code, "log": {k: problems.get(k) for k in ("tracebacks", "error_lines",
                                                                                 "first_traceback")},
           "failure": failure, "checks": final, "passed": failure is None and all(final.values())}
    rows = [{**p, "streams": sum(p["ordinary"].values()),
             "result": "pass" if p["passed"] else "FAIL: " + ", ".join(k for k, v in p["checks"].items() if not v)}
            for p in result.get("phases", [])]
    print_table(rows, ["phase", "median_gap_s", "worst_gap_s", "median_ttft_s", "rss_peak_mb",
                       "rss_growth_over_quiet_mb", "fivexx", "streams", "result"])
    for p in result.get("phases", []):
        print(f"  {p['phase']}: {p['attack']}" + (f"  unexpected: {p['unexpected']}" if p["unexpected"] else ""))
    print("checks:", final, "| failure:", failure)
    if args.out:
        write_json(args.out, out)
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
