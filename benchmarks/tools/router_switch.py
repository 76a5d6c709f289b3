"""What serving several models costs (pocketllm.server.router), on the default model: the time to first token
of a cold model (its load included) and of a warm one, the time to unload it, and the process's resident
memory with it loaded and after the unload. Two names for the one file, served in process on the CPU.
    python benchmarks/tools/router_switch.py [--rounds 3] [--output-json FILE]"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import statistics
import subprocess
import threading
import time
from pathlib import Path

import httpx
import uvicorn


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


async def ttft(client: httpx.AsyncClient, model: str) -> float:
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json={"model": model, "prompt": "The capital of France is",
                                                                "max_tokens": 8, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t0
    raise RuntimeError("no token came")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    from pocketllm.cli.serve import load_engine, tune_malloc
    from pocketllm.config import EngineArgs
    from pocketllm.pull import pull_default_model
    from pocketllm.server.config import ServerConfig, ServerState
    from pocketllm.server.guard import RequestGuard
    from pocketllm.server.router import ModelRouter, ModelSpec

    tune_malloc()  # as `pocketllm serve` starts
    model = str(pull_default_model())
    engine = EngineArgs(model=model, max_model_len=2048, kv_cache_memory=160 << 20)
    router = ModelRouter([ModelSpec("a", engine), ModelSpec("b", engine)], ServerConfig(model_name="a"),
                         ServerState(), load_engine, keep_alive=-1)
    server = uvicorn.Server(uvicorn.Config(RequestGuard(router, router.cfg, router.state), host="127.0.0.1",
                                           port=8391, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    rows = []
    base = rss()

    async def measure():
        async with httpx.AsyncClient(base_url="http://127.0.0.1:8391", timeout=300) as client:
            for _ in range(args.rounds):
                cold = await ttft(client, "a")
                loaded = rss()
                warm = statistics.median([await ttft(client, "a") for _ in range(3)])
                t0 = time.perf_counter()
                fut = asyncio.run_coroutine_threadsafe(router._unload(router.slots["a"]), server_loop[0])
                await asyncio.wrap_future(fut)
                unload = time.perf_counter() - t0
                gc.collect()
                rows.append({"cold_ttft_s": cold, "warm_ttft_s": warm, "unload_s": unload,
                             "rss_loaded_mb": loaded / 2**20, "rss_after_unload_mb": rss() / 2**20})

    server_loop = [None]

    async def grab():
        server_loop[0] = asyncio.get_running_loop()
    # the server's loop: the router's unload runs there
    fut = asyncio.run_coroutine_threadsafe(grab(), _loop_of(server))
    fut.result()
    asyncio.run(measure())
    server.should_exit = True
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"command": f"python benchmarks/tools/router_switch.py --rounds {args.rounds}", "commit": commit,
           "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
           "model": Path(model).name, "rss_before_first_load_mb": base / 2**20, "medians": med, "rounds": rows,
           "switch_s": med["unload_s"] + med["cold_ttft_s"] - med["warm_ttft_s"]}
    print(json.dumps(out, indent=1))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(out, indent=1) + "\n")


def _loop_of(server: uvicorn.Server) -> asyncio.AbstractEventLoop:
    """The event loop uvicorn's thread runs (its servers' sockets are served by it)."""
    while not getattr(server, "servers", None):
        time.sleep(0.05)
    return server.servers[0].get_loop()


if __name__ == "__main__":
    main()
