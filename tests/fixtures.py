"""Reference files the tests read: from shared/ next to the repository, else from where shared/ got them.

shared/fixtures comes from the llama-cpp-python 0.3.36 source distribution (see shared/fixtures/README.md);
without shared/, `shared_path` downloads that archive once (checking its sha256) and extracts the files
shared/fixtures holds.
"""

import functools
import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"
CACHE = Path(os.environ.get("POCKETLLM_TEST_CACHE", Path.home() / ".cache" / "pocketllm-tests"))

_SDIST = "llama_cpp_python-0.3.36.tar.gz"
_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# shared/ folder -> folder inside the archive
_SDIST_FOLDERS = {
    "fixtures/vocab": "llama_cpp_python-0.3.36/vendor/llama.cpp/models",
    "fixtures/chat_templates": "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates",
}
# What shared/fixtures holds, for listing and fetching when shared/ is absent.
_VOCABS = ("gpt-2", "llama-bpe", "llama-spm", "qwen2")
_SHARED_LISTING = {
    "fixtures/vocab": [f"ggml-vocab-{name}.gguf{suffix}" for name in _VOCABS for suffix in ("", ".inp", ".out")],
    "fixtures/chat_templates": [
        "HuggingFaceTB-SmolLM3-3B.jinja",
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
        "Qwen-Qwen2.5-7B-Instruct.jinja",
        "Qwen-Qwen3-0.6B.jinja",
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    ],
}


def shared_names(folder: str, pattern: str) -> list[str]:
    """Names of the files in shared/`folder` that match `pattern` (e.g. "fixtures/vocab", "*.gguf")."""
    if (SHARED / folder).is_dir():
        return sorted(p.name for p in (SHARED / folder).glob(pattern))
    return sorted(name for name in _SHARED_LISTING[folder] if Path(name).match(pattern))


def shared_path(relpath: str) -> Path:
    """shared/`relpath` (e.g. "fixtures/vocab/ggml-vocab-gpt-2.gguf"), fetched when shared/ lacks it."""
    if (SHARED / relpath).is_file():
        return SHARED / relpath
    if not (CACHE / relpath).is_file():
        _extract_listed_files()
    return CACHE / relpath


def _extract_listed_files() -> None:
    # In one pass: finding a member in a .tar.gz decompresses the archive up to it.
    wanted = {
        f"{_SDIST_FOLDERS[folder]}/{name}": CACHE / folder / name
        for folder, names in _SHARED_LISTING.items()
        for name in names
    }
    with tarfile.open(_sdist()) as archive:
        for member in archive:
            if member.name in wanted:
                wanted[member.name].parent.mkdir(parents=True, exist_ok=True)
                wanted[member.name].write_bytes(archive.extractfile(member).read())


def _sdist() -> Path:
    path = CACHE / _SDIST
    if not path.is_file():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "llama-cpp-python==0.3.36",
             "-d", str(CACHE)],
            check=True,
        )  # fmt: skip
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != _SDIST_SHA256:
        path.unlink()
        raise RuntimeError(f"{_SDIST} has sha256 {digest}, expected {_SDIST_SHA256}")
    return path


def default_model_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF: shared/'s copy, else the one the package pulls."""
    path = SHARED / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if path.is_file():
        return path
    from pocketllm.pull import pull_default_model

    return Path(pull_default_model())


@functools.cache
def smollm2_reference():
    """transformers' tokenizer for `default_model_gguf()`, built once per test run (it takes seconds).
    Shared between tests: do not modify it."""
    from transformers import AutoTokenizer

    path = default_model_gguf()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
