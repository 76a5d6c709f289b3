"""Every environment variable the code reads is listed in pocketllm/envs.py and in the README."""
from __future__ import annotations

import re
from pathlib import Path

from pocketllm import envs

ROOT = Path(__file__).parents[1]


def test_every_variable_is_listed_and_documented():
    used = {m for p in (ROOT / "pocketllm").rglob("*.py") for m in re.findall(r"POCKETLLM_[A-Z0-9_]+", p.read_text())}
    assert used == set(envs.VARIABLES)
    readme = (ROOT / "README.md").read_text()
    for name in envs.VARIABLES:
        assert f"| `{name}` |" in readme, name


def test_reads_at_use(monkeypatch, tmp_path):
    monkeypatch.setenv("POCKETLLM_CACHE", str(tmp_path))
    assert envs.cache_root() == tmp_path
    monkeypatch.setenv("POCKETLLM_CACHE", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert envs.cache_root() == tmp_path / "xdg" / "pocketllm"
    monkeypatch.delenv("POCKETLLM_CPU_ISA", raising=False)
    assert envs.get("POCKETLLM_CPU_ISA") == "native" and not envs.flag("POCKETLLM_DISABLE_C_KERNELS")
