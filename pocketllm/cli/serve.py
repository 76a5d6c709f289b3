"""`pocketllm serve [MODEL]`: the OpenAI-compatible API server."""
from __future__ import annotations

import argparse
import ctypes
import errno
import gc
import logging
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pocketllm import envs
from pocketllm.cli.args import add_engine_args, engine_args_from
from pocketllm.config import EngineArgs
from pocketllm.errors import ConfigurationError
from pocketllm.structured.reasoning import REASONING_PARSERS
from pocketllm.structured.tool_parsers import TOOL_PARSERS

if TYPE_CHECKING:  # the engine imports torch: only when a command runs it
    from pocketllm.engine.llm_engine import LLMEngine


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    add_engine_args(parser)
    parser.set_defaults(reserve_kv_cache=True)  # a service's memory is known from its start
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health; a flag is "
                             "visible to other users in `ps`: prefer --api-key-file or the POCKETLLM_API_KEY "
                             "environment variable")
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help="read the API key from the first line of FILE (instead of --api-key)")
    parser.add_argument("--allowed-origins", default=None,
                        help="comma-separated origins allowed by CORS, e.g. http://localhost:3000 or *")
    parser.add_argument("--allowed-hosts", default=None,
                        help="comma-separated Host names served without an API key besides localhost, IP "
                             "addresses and --host, e.g. myserver.lan (* allows any; guards against DNS rebinding)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="Jinja chat template to use instead of the model's")
    parser.add_argument("--model", dest="models", action="append", default=None, metavar="[NAME=]MODEL",
                        help="serve this model too (repeatable): a path or a hub name, called NAME by requests "
                             "(default: its own name); each loads on its first request")
    parser.add_argument("--models-dir", default=None, metavar="DIR",
                        help="serve every model in DIR (each .gguf file, each folder with a config.json), by its "
                             "file or folder name, as --model would")
    parser.add_argument("--keep-alive", type=float, default=300.0, metavar="SECONDS",
                        help="with --model: seconds a model stays loaded after its last request; a request's own "
                             "keep_alive (Ollama's) wins (default: 300; -1: for good)")
    parser.add_argument("--preload", action="store_true",
                        help="with --model: load every model at start instead of on its first request")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients use (default: the model file or directory name)")
    parser.add_argument("--max-queued-requests", type=int, default=256,
                        help="sequences allowed to wait for the engine, a request counting n x its prompts; more "
                             "get 503, and a request asking for more alone gets 400 (default: 256)")
    parser.add_argument("--max-stop-strings", type=int, default=256,
                        help="most stop strings a request may give (default: 256)")
    parser.add_argument("--max-stop-token-ids", type=int, default=1024,
                        help="most stop_token_ids a request may give (default: 1024)")
    parser.add_argument("--max-logit-bias", type=int, default=2048,
                        help="most logit_bias entries a request may give (default: 2048)")
    parser.add_argument("--max-messages", type=int, default=2048,
                        help="most messages a chat request may give (default: 2048, as OpenAI's API)")
    parser.add_argument("--max-tools", type=int, default=128,
                        help="most tools a chat request may give (default: 128, as OpenAI's API)")
    parser.add_argument("--max-grammar-compile-time", type=float, default=10.0, metavar="SECONDS",
                        help="a request's grammar (JSON schema, regex, tools...) that takes longer to compile gets "
                             "400 and its compilation is stopped (default: 10)")
    parser.add_argument("--default-max-tokens", type=int, default=2048, metavar="N",
                        help="the most tokens a reply gets when its request sets no max_tokens, so that a model "
                             "that loops stops (default: 2048; 0: up to the end of the context)")
    parser.add_argument("--max-queue-time", type=float, default=60.0, metavar="SECONDS",
                        help="a request that waited this long without starting gets 503 with Retry-After "
                             "(default: 60)")
    parser.add_argument("--request-body-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="seconds a client has to send its request body (then 408; default: 30)")
    parser.add_argument("--request-header-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="seconds a connection has to send a complete request head, then it is closed "
                             "(default: 10)")
    parser.add_argument("--max-connections", type=int, default=1024,
                        help="concurrent requests; more get 503, idle connections do not count and /health "
                             "and /metrics are always answered (default: 1024)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds running requests get to finish on SIGTERM/SIGINT (default: 30)")
    parser.add_argument("--max-request-bytes", type=int, default=4 << 20,
                        help="largest request body accepted, in bytes (default: 4 MiB)")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="how the model writes tool calls (default: inferred from the chat template)")
    parser.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                        help="split the reasoning (<think>...</think>; gpt-oss's analysis messages) into "
                             "reasoning_content (default: openai_gptoss for gpt-oss's chat template, else none)")


def comma_list(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def read_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ConfigurationError(f"cannot read the chat template {path}: {e.strerror or e}") from None


def api_key_of(args: argparse.Namespace) -> str | None:
    """--api-key, else the first line of --api-key-file, else $POCKETLLM_API_KEY."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ConfigurationError("give the API key once: --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except OSError as e:
            raise ConfigurationError(f"cannot read the API key file {args.api_key_file}: {e.strerror or e}") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ConfigurationError(f"the API key file {args.api_key_file} has no key on its first line")
        return key
    return args.api_key or envs.get("POCKETLLM_API_KEY") or None


def check_port(host: str, port: int) -> None:
    """Fail before the model loads when the server could not listen: bind as uvicorn will."""
    if not 1 <= port <= 65535:
        raise ConfigurationError(f"--port must be in 1..65535; got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ConfigurationError(f"port {port} is in use on {host}; stop what uses it or pick another "
                                     "with --port") from None
        raise ConfigurationError(f"cannot listen on {host} port {port}: {e.strerror or e}") from None


def check_limits(args: argparse.Namespace) -> None:
    if not args.request_header_timeout > 0:
        raise ConfigurationError(f"--request-header-timeout must be a positive number of seconds; got "
                                 f"{args.request_header_timeout}")
    if args.max_connections < 1:
        raise ConfigurationError(f"--max-connections must be at least 1; got {args.max_connections}")
    if not args.max_grammar_compile_time > 0:
        raise ConfigurationError(f"--max-grammar-compile-time must be a positive number of seconds; got "
                                 f"{args.max_grammar_compile_time}")
    if args.default_max_tokens < 0:
        raise ConfigurationError(f"--default-max-tokens must be 0 (no bound) or more; got {args.default_max_tokens}")


def load_engine(engine_args: EngineArgs) -> LLMEngine:
    """Build the engine, showing how long loading takes so far (on a terminal)."""
    if engine_args.model is None:
        from pocketllm.pull import pull_default_model
        engine_args.model = str(pull_default_model())  # shows its own download progress
    name = Path(engine_args.model).name
    done = threading.Event()
    lock = threading.Lock()

    def show() -> None:
        t0 = time.monotonic()
        while not done.wait(0.25):
            with lock:
                print(f"\rLoading {name} ... {time.monotonic() - t0:.1f}s", end="", file=sys.stderr, flush=True)
        print(f"\rLoading {name} ... done in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)

    # A log line while the counter shows: first handler, the counter's line is cleared (and the
    # counter waits); last handler, the counter may draw again, below the log line.
    class Clear(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lock.acquire()
            print("\r\x1b[K", end="", file=sys.stderr, flush=True)

    class Release(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lock.release()

    logger = logging.getLogger("pocketllm")
    clear, release = Clear(), Release()
    shower = threading.Thread(target=show, daemon=True)
    if sys.stderr.isatty():
        logger.handlers.insert(0, clear)
        logger.addHandler(release)
        shower.start()
    else:
        print(f"Loading {name} ...", file=sys.stderr, flush=True)
    # Loading builds a few hundred thousand long-lived objects (the vocabulary); collecting while
    # they are built walks them again and again (~1 s of full collections for the default model).
    gc.disable()
    try:
        from pocketllm.engine.llm_engine import LLMEngine

        return LLMEngine(engine_args)
    finally:
        gc.enable()
        logger.removeHandler(clear)
        logger.removeHandler(release)
        done.set()
        if shower.is_alive():
            shower.join()


def tune_malloc() -> None:
    """A server's memory should not grow with the traffic it has seen. glibc's defaults let it:
    - threads that allocate at once get arenas of their own (up to 8 a core), and memory freed in
      one serves only its threads, so each arena keeps its high-water mark: two arenas (set before
      any thread starts; the setting Python servers commonly take);
    - its threshold for serving an allocation from mmap (returned to the system when freed) rises to
      the largest block freed so far, up to 32 MiB, after which a step's large passing tensors and
      request bodies are carved from the heap among long-lived objects, and the heap cannot shrink:
      a fixed 8 MiB (a step's logits over 64 rows are past it; the CPU kernels' weight tiles are not).
    In the hostile traffic benchmark's phase of many-choice requests beside huge refused bodies, the
    server's memory grew 300-412 MB over the quiet phase with glibc's defaults and 48-67 MB with a fixed
    threshold; the arenas took the grammar and template phases from 225-298 MB to 123-145 MB
    (benchmarks/results/cpu-hostile-traffic.md)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-8, 2)  # M_ARENA_MAX
        libc.mallopt(-3, 8 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        pass


def run(args: argparse.Namespace) -> int:
    from pocketllm.server.async_llm import AsyncLLM
    from pocketllm.server.launcher import serve

    tune_malloc()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # Every setting is checked before the model loads: a mistake costs no loading time.
    chat_template = read_chat_template(args.chat_template)
    api_key = api_key_of(args)
    engine_args = engine_args_from(args)
    check_port(args.host, args.port)
    check_limits(args)
    llm_options = dict(max_queued_requests=args.max_queued_requests, max_queue_time=args.max_queue_time)
    if args.models or args.models_dir:
        return serve_several(args, engine_args, llm_options, chat_template, api_key)
    llm = AsyncLLM(lambda: load_engine(engine_args), **llm_options)
    engine = llm.engine
    # Everything loaded so far lives as long as the server: keep it out of the collector's way, or a
    # full collection stalls every thread (the engine's too) for ~0.15 s now and then (vLLM freezes its heap too).
    gc.collect()
    gc.freeze()
    cfg = server_config(args, args.served_model_name or engine.model_name or Path(engine.args.model).name,
                        api_key, chat_template)
    return serve(llm, cfg, args.host, args.port, on_started=announcement(args, [cfg.model_name]))


def announcement(args: argparse.Namespace, names: list[str]):
    """The line printed once the server listens."""
    host = "localhost" if args.host in ("0.0.0.0", "::") else args.host

    def announce() -> None:
        print(f"Serving {', '.join(names)} at http://{host}:{args.port}/v1  (Ctrl+C to stop)", flush=True)

    return announce


def model_specs(args: argparse.Namespace, engine_args: EngineArgs) -> list:
    """The models of --model (and MODEL, first, when given): [NAME=]MODEL each, with the engine flags."""
    import dataclasses

    from pocketllm.core.hub_name import HubName
    from pocketllm.server.router import ModelSpec

    specs = []
    found = []
    if args.models_dir is not None:
        root = Path(args.models_dir)
        if not root.is_dir():
            raise ConfigurationError(f"--models-dir {root} is not a folder")
        found = [str(p) for p in sorted(root.iterdir()) if _is_model(p)]
        if not found:
            raise ConfigurationError(f"--models-dir {root} holds no .gguf file and no folder with a config.json")
    for text in ([args.model] if args.model else []) + (args.models or []) + found:
        name, _, model = text.rpartition("=")
        name = name or str(HubName.parse(model) or Path(model).name)
        specs.append(ModelSpec(name, dataclasses.replace(engine_args, model=model)))  # (checked as it is built)
    return specs


def _is_model(path: Path) -> bool:
    """A .gguf file (a split model's first part only) or a folder with a config.json."""
    from pocketllm.gguf_file import split_name

    split = split_name(path.name)
    return (path.suffix == ".gguf" and (split is None or split[1] == 1)) or (path / "config.json").is_file()


def serve_several(args: argparse.Namespace, engine_args: EngineArgs, llm_options: dict, chat_template: str | None,
                  api_key: str | None) -> int:
    import asyncio

    from pocketllm.server.launcher import serve
    from pocketllm.server.router import ModelRouter

    specs = model_specs(args, engine_args)
    cfg = server_config(args, specs[0].name, api_key, chat_template)
    # a request waits for its model's load as long as it would wait in the queue (--max-queue-time)
    router = ModelRouter(specs, cfg, None, load_engine, keep_alive=args.keep_alive, llm_options=llm_options,
                         base_args=engine_args, load_timeout=args.max_queue_time)
    if args.preload:
        asyncio.run(router.preload())
    return serve(router, cfg, args.host, args.port, on_started=announcement(args, [s.name for s in specs]))


def server_config(args: argparse.Namespace, model_name: str, api_key: str | None, chat_template: str | None):
    from pocketllm.server.config import ServerConfig

    return ServerConfig(
        model_name=model_name,
        api_key=api_key,
        allowed_origins=comma_list(args.allowed_origins), allowed_hosts=comma_list(args.allowed_hosts),
        chat_template=chat_template, max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, body_timeout=args.request_body_timeout,
        max_connections=args.max_connections, header_timeout=args.request_header_timeout,
        max_stop_strings=args.max_stop_strings, max_stop_token_ids=args.max_stop_token_ids,
        max_logit_bias=args.max_logit_bias, max_messages=args.max_messages, max_tools=args.max_tools,
        max_grammar_compile_time=args.max_grammar_compile_time, default_max_tokens=args.default_max_tokens)
