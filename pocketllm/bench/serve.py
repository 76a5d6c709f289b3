"""`pocketllm bench serve`: a client-side benchmark of a running server.

Streams completions of random prompts (fixed input and output lengths, EOS ignored) at
concurrency 1, 2, 4, ... up to --max-concurrency. TTFT and inter-token latency are measured
by the client from the SSE chunks; queue time comes from the server's
`pocketllm:request_queue_time_seconds` histogram, read from /metrics before and after each level.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pocketllm.bench.report import environment, percentile, print_table, write_json

_QUEUE_METRIC = "pocketllm:request_queue_time_seconds"
# Real token ids for the prompts come from tokenizing this, so any vocabulary works.
_SEED_TEXT = ("The quick brown fox jumps over the lazy dog while a curious cat watches from the window. "
              "Scientists measure the speed of light, engineers build bridges, and poets write about rivers, "
              "mountains, cities, music, history and the small details of ordinary mornings.")


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--model", default=None, help="model name (default: the server's first model)")
    parser.add_argument("--api-key", default=None, help="the server's API key, if it needs one")
    parser.add_argument("--max-concurrency", type=int, default=8, help="the sweep doubles up to this")
    parser.add_argument("--concurrency", default=None, help="comma list of levels instead of the doubling sweep")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default: 128)")
    parser.add_argument("--output-len", type=int, default=128,
                        help="generated tokens per request, EOS ignored (default: 128)")
    parser.add_argument("--seed", type=int, default=None,
                        help="prompt seed (default: a fresh one; a repeated prompt would hit the prefix cache)")
    parser.add_argument("--output-json", default=None, metavar="FILE",
                        help="also write the results, machine and commit to FILE")


def sweep(max_concurrency: int) -> list[int]:
    levels, c = [], 1
    while c < max_concurrency:
        levels.append(c)
        c *= 2
    return levels + [max_concurrency]


def histogram_buckets(metrics_text: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts (upper bound -> count), summed over label sets."""
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != name:
            continue
        for s in family.samples:
            if s.name == name + "_bucket":
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
    return buckets


def histogram_quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """The q-quantile of the observations between two scrapes, interpolated within buckets."""
    delta = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    if not delta or delta[-1][1] <= 0:
        return None
    rank = q * delta[-1][1]
    lower, below = 0.0, 0.0
    for le, count in delta:
        if count >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = le, count
    return lower


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    start = time.perf_counter()
    chunk_times, tokens = [], 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return {"error": f"HTTP {resp.status_code}: {resp.text[:200]}"}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"error": event["error"].get("message")}
            # Token ids, not text, mark a token's arrival: a model served without a tokenizer sends no text.
            if event.get("choices") and event["choices"][0].get("token_ids"):
                chunk_times.append(time.perf_counter())
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if not chunk_times:
        return {"error": "no tokens received"}
    return {"ttft": chunk_times[0] - start, "itl": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
            "e2e": time.perf_counter() - start, "tokens": tokens}


async def run_level(client: httpx.AsyncClient, model: str, prompts: list[list[int]], output_len: int,
                    concurrency: int) -> dict:
    gate = asyncio.Semaphore(concurrency)

    async def limited(p):
        async with gate:
            try:
                return await one_request(client, model, p, output_len)
            except httpx.HTTPError as e:
                return {"error": f"{type(e).__name__}: {e}"}

    before = histogram_buckets((await client.get("/metrics")).text, _QUEUE_METRIC)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(limited(p) for p in prompts))
    elapsed = time.perf_counter() - t0
    after = histogram_buckets((await client.get("/metrics")).text, _QUEUE_METRIC)
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    e2e = [r["e2e"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    queue_p99 = histogram_quantile(0.99, before, after)
    errors = [r["error"] for r in results if "error" in r]
    return {
        "concurrency": concurrency, "requests": len(ok), "errors": len(errors), "elapsed_s": elapsed,
        "output_tok_s": sum(r["tokens"] for r in ok) / elapsed,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
        "e2e_p50_ms": 1e3 * percentile(e2e, 50),
        "queue_p99_ms": None if queue_p99 is None else 1e3 * queue_p99,
        "first_error": errors[0] if errors else None,
    }


async def bench(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    levels = [int(c) for c in args.concurrency.split(",")] if args.concurrency else sweep(args.max_concurrency)
    # A connection per concurrent stream: a smaller pool would queue requests in the client.
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers, timeout=None,
                                 limits=httpx.Limits(max_connections=max(levels) + 2)) as client:
        models = (await client.get("/v1/models")).raise_for_status().json()["data"]
        model = args.model or models[0]["id"]
        tokenized = await client.post("/tokenize", json={"prompt": _SEED_TEXT, "add_special_tokens": False})
        # A model served without a tokenizer (random weights of a named shape) takes plain ids.
        pool = tokenized.json()["tokens"] if tokenized.status_code == 200 else list(range(1000, 10000))
        if args.seed is None:
            args.seed = random.SystemRandom().randrange(2 ** 32)
        rng = random.Random(args.seed)
        rows = []
        for concurrency in levels:
            prompts = [[rng.choice(pool) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
            rows.append(await run_level(client, model, prompts, args.output_len, concurrency))
    return {"model": model, "rows": rows}


def run(args: argparse.Namespace) -> int:
    try:
        result = asyncio.run(bench(args))
    except httpx.HTTPError as e:
        print(f"error: cannot benchmark {args.base_url}: {e}")
        return 1
    print_table(result["rows"], ["concurrency", "requests", "errors", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms",
                                 "itl_p50_ms", "itl_p99_ms", "queue_p99_ms"])
    write_json(args.output_json, {
        **environment(), "benchmark": "serve", "base_url": args.base_url, "model": result["model"],
        "input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts, "seed": args.seed,
        "results": result["rows"]})
    return 1 if any(r["errors"] for r in result["rows"]) else 0
