"""Requests per second through the chat path of the HTTP API with a model that costs almost nothing (one
layer, 32 wide, the default model's tokenizer and template): what the server does around the engine
(parsing, validation, the template, tokenizing, the reply), for A/B runs of two trees.
    PYTHONPATH=TREE python benchmarks/tools/chat_path_rate.py [--requests 300] [--concurrency 8]
Prints one JSON line."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    import pocketllm

    tree = Path(pocketllm.__file__).resolve().parents[1]
    sys.path.insert(0, str(tree / "tests"))
    import httpx
    from tiny_models import make_tiny_chat_model

    from pocketllm import LLM
    from pocketllm.server.api_server import create_app
    from pocketllm.server.async_llm import AsyncLLM
    from pocketllm.server.config import ServerConfig

    model = make_tiny_chat_model(Path(tempfile.mkdtemp()))
    llm = LLM(str(model), device="cpu", max_model_len=512, num_kv_blocks=1024)
    app = create_app(AsyncLLM(llm.engine), ServerConfig(model_name="tiny"))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def run() -> float:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=60) as client:
            async def one() -> None:
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text

            await asyncio.gather(*(one() for _ in range(16)))  # warm-up
            queue = list(range(args.requests))

            async def worker() -> None:
                while queue:
                    queue.pop()
                    await one()

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            return time.perf_counter() - t0

    elapsed = asyncio.run(run())
    print(json.dumps({"tree": str(tree), "requests": args.requests, "concurrency": args.concurrency,
                      "seconds": elapsed, "requests_per_s": args.requests / elapsed}))


if __name__ == "__main__":
    main()
