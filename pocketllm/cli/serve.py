"""`pocketllm serve [MODEL]`: the OpenAI-compatible API server."""
from __future__ import annotations

import argparse
import gc
import logging
import sys
import threading
import time
from pathlib import Path

from pocketllm.cli.args import add_engine_args, engine_args_from
from pocketllm.engine.llm_engine import LLMEngine
from pocketllm.structured.reasoning import REASONING_PARSERS
from pocketllm.structured.tool_parsers import TOOL_PARSERS


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    parser.add_argument("--allowed-origins", default=None,
                        help="comma-separated origins allowed by CORS, e.g. http://localhost:3000 or *")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="Jinja chat template to use instead of the model's")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients use (default: the model file or directory name)")
    parser.add_argument("--max-queued-requests", type=int, default=None,
                        help="requests allowed to wait for the engine; more get 503 (default: no limit)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds running requests get to finish on SIGTERM/SIGINT")
    parser.add_argument("--max-request-bytes", type=int, default=4 << 20, help="largest request body accepted")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="how the model writes tool calls (default: inferred from the chat template)")
    parser.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                        help="split <think>...</think> reasoning into reasoning_content")


def load_engine(args: argparse.Namespace) -> LLMEngine:
    """Build the engine, showing how long loading takes so far (on a terminal)."""
    engine_args = engine_args_from(args)
    if engine_args.model is None:
        from pocketllm.pull import pull_default_model
        engine_args.model = str(pull_default_model())  # shows its own download progress
    name = Path(engine_args.model).name
    done = threading.Event()

    def show() -> None:
        t0 = time.monotonic()
        while not done.wait(0.25):
            print(f"\rLoading {name} ... {time.monotonic() - t0:.1f}s", end="", file=sys.stderr, flush=True)
        print(f"\rLoading {name} ... done in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)

    shower = threading.Thread(target=show, daemon=True)
    if sys.stderr.isatty():
        shower.start()
    else:
        print(f"Loading {name} ...", file=sys.stderr, flush=True)
    # Loading builds a few hundred thousand long-lived objects (the vocabulary); collecting while
    # they are built walks them again and again (~1 s of full collections for the default model).
    gc.disable()
    try:
        return LLMEngine(engine_args)
    finally:
        gc.enable()
        done.set()
        if shower.is_alive():
            shower.join()


def run(args: argparse.Namespace) -> int:
    from pocketllm.server.api_server import ServerConfig, serve
    from pocketllm.server.async_llm import AsyncLLM

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    chat_template = None
    if args.chat_template:
        try:
            chat_template = Path(args.chat_template).read_text()
        except OSError as e:
            print(f"error: cannot read the chat template {args.chat_template}: {e}", file=sys.stderr)
            return 2
    try:
        llm = AsyncLLM(lambda: load_engine(args), max_queued_requests=args.max_queued_requests)
    except Exception as e:  # noqa: BLE001  (a bad configuration: say what, exit non-zero)
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = llm.engine
    # Everything loaded so far lives as long as the server: keep it out of the collector's way, or a
    # full collection stalls every thread (the engine's too) for ~0.15 s now and then (vLLM freezes its heap too).
    gc.collect()
    gc.freeze()
    cfg = ServerConfig(
        model_name=args.served_model_name or Path(engine.args.model).name,
        api_key=args.api_key,
        allowed_origins=[o.strip() for o in (args.allowed_origins or "").split(",") if o.strip()],
        chat_template=chat_template, max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser)
    host = "localhost" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{host}:{args.port}/v1"

    def announce() -> None:
        print(f"Serving {cfg.model_name} at {url}  (Ctrl+C to stop)", flush=True)

    return 0 if serve(llm, cfg, args.host, args.port, on_started=announce) else 1
