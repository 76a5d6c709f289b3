"""`pocketllm serve` with no arguments serves the default model from the user's cache."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from fixtures import default_model_gguf
from openai import OpenAI

from pocketllm.pull import DEFAULT_MODEL


def test_serve_with_no_arguments_serves_the_default_model(tmp_path):
    # The cache as `pocketllm pull` leaves it (the pull itself is tested in test_pull.py).
    cached = tmp_path / "models" / DEFAULT_MODEL.name
    cached.parent.mkdir(parents=True)
    cached.symlink_to(default_model_gguf())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "POCKETLLM_CACHE": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "pocketllm.cli.main", "serve", "--port", str(port),
                             "--max-model-len", "1024"], env=env, cwd=Path(__file__).parents[1],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not become ready"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        model = client.models.list().data[0].id
        assert "SmolLM2" in model
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital city of France? Answer in one word."}],
            max_tokens=12, temperature=0)
        assert "Paris" in reply.choices[0].message.content
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
