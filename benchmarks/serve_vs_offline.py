"""Server vs offline engine, interleaved: the same prompts at the same concurrency, alternating which
side runs first, several rounds, so that the machine's drift hits both sides alike.

    python benchmarks/serve_vs_offline.py [MODEL] --output-json benchmarks/results/cpu-serve-vs-offline.json
"""
from __future__ import annotations

import argparse
import asyncio
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    from pocketllm.bench.offline import run_batch
    from pocketllm.bench.report import environment, print_table, write_json
    from pocketllm.bench.serve import run_level
    from pocketllm.config import EngineArgs
    from pocketllm.engine.llm_engine import LLMEngine
    from pocketllm.pull import pull_default_model

    model = args.model or str(pull_default_model())
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "pocketllm.cli.main", "serve", model, "--port", str(port),
                               "--max-model-len", str(args.max_model_len)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        engine = LLMEngine(EngineArgs(model=model, max_model_len=args.max_model_len))
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, "the server did not start"
            time.sleep(0.5)
        served = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]

        async def served_level(prompts, c):
            async with httpx.AsyncClient(base_url=base, timeout=None) as client:
                return await run_level(client, served, prompts, args.output_len, c)

        rng = random.Random(0)
        rounds = []
        for r in range(args.rounds):
            for c in (int(x) for x in args.concurrency.split(",")):
                # Fresh prompts for each (round, c): neither side gets prefix-cache hits from earlier runs.
                prompts = [[rng.randrange(1000, 40000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
                sides = {}
                for side in (("offline", "server") if r % 2 == 0 else ("server", "offline")):
                    if side == "offline":
                        sides[side] = run_batch(engine, prompts, args.output_len, c)["output_tok_s"]
                    else:
                        level = asyncio.run(served_level(prompts, c))
                        assert level["errors"] == 0, level["first_error"]
                        sides[side] = level["output_tok_s"]
                rounds.append({"round": r, "concurrency": c, **sides, "ratio": sides["server"] / sides["offline"]})
                print(rounds[-1], flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)

    summary = []
    for c in sorted({x["concurrency"] for x in rounds}):
        rows = [x for x in rounds if x["concurrency"] == c]
        summary.append({"concurrency": c, "offline_tok_s": statistics.median(x["offline"] for x in rows),
                         "server_tok_s": statistics.median(x["server"] for x in rows),
                         "median_ratio": statistics.median(x["ratio"] for x in rows),
                         "ratios": [round(x["ratio"], 3) for x in rows]})
    print_table(summary, ["concurrency", "offline_tok_s", "server_tok_s", "median_ratio"])
    write_json(args.output_json, {**environment(), "model": model, "input_len": args.input_len,
                                  "output_len": args.output_len, "rounds": rounds, "summary": summary})


if __name__ == "__main__":
    main()
