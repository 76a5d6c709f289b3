"""`pocketllm serve` in a subprocess, for tests that talk to it over HTTP."""
from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fixtures import default_model_gguf

ROOT = Path(__file__).resolve().parents[1]
# A small context and KV cache keep memory low.
# The exact CPU kernels: the servers' token ids are pinned (and compared with the offline engine's).
ENGINE_FLAGS = ["--max-model-len", "2048", "--kv-cache-memory", str(160 << 20), "--exact-kernels"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`pocketllm serve MODEL` (the default model unless given) with ENGINE_FLAGS and `flags`."""

    def __init__(self, *flags: str, model: str | Path | None | bool = None, engine_flags: list[str] = ENGINE_FLAGS):
        """`model`: a path, None for the default model, False for none (the flags name the models)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log")
        self.ready = False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pocketllm.cli.main", "serve",
             *([] if model is False else [str(model or default_model_gguf())]), "--port",
             str(self.port), *engine_flags, *flags], cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 180) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    self.ready = True
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        pytest.fail(f"the server did not become ready in {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-5000:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)


@contextlib.contextmanager
def in_process(app):
    """`app` served by uvicorn in a thread of this process; yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


async def collect_chat_stream(stream) -> tuple[str, str, list[list[str]], str]:
    """Reasoning, content, [[name, arguments]] and finish reason of a streamed chat choice (the
    official client's chunks); a call's name must come before its arguments."""
    reasoning, content, calls, finish = "", "", [], None
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.id is not None:
                    assert tc.function.name and not tc.function.arguments  # the name comes first
                    calls.append([tc.function.name, ""])
                calls[tc.index][1] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish
