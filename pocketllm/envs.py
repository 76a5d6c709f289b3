"""Every environment variable PocketLLM reads: its default and what it does. Each is read when it
is used, not at import, so a value set later (by a test, by `os.environ` in a script) counts. The
README's table lists the same."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variable:
    default: str | None
    meaning: str


VARIABLES = {
    "POCKETLLM_API_KEY": Variable(None, "the server's API key, as --api-key (which other users see in `ps`)"),
    "POCKETLLM_CACHE": Variable(None, "where the default model and the compiled CPU kernels are kept "
                                      "(default: $XDG_CACHE_HOME/pocketllm, else ~/.cache/pocketllm)"),
    "POCKETLLM_CPU_ISA": Variable("native", "caps the CPU kernels' instruction sets: native, none, avx2, "
                                            "avx2-bmi2, avx2-vnni, avx512"),
    "POCKETLLM_DISABLE_C_KERNELS": Variable("0", "1: no C kernels on the CPU (torch's ops only)"),
    "POCKETLLM_DISABLE_CUDA_C": Variable("0", "1: the Triton GEMV for CUDA decode rows instead of the CUDA C one"),
    "POCKETLLM_CONFIGURE_LOGGING": Variable("1", "0: leave logging alone (no default handler on the `pocketllm` "
                                                 "logger)"),
    "POCKETLLM_COMMIT": Variable(None, "benchmarks: the commit a result records where the tree has no .git"),
}


def get(name: str) -> str | None:
    """The variable's value, or its default where it is unset (or set empty)."""
    return os.environ.get(name) or VARIABLES[name].default


def flag(name: str) -> bool:
    """Whether a 0/1 variable is on."""
    return get(name) == "1"


def cache_root() -> Path:
    """POCKETLLM_CACHE, else the user's cache directory's `pocketllm`."""
    return Path(get("POCKETLLM_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME")
                                                       or os.path.expanduser("~/.cache"), "pocketllm"))
