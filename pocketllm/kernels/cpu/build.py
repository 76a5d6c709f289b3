"""Builds the C kernels on first use with the system C compiler and loads them with ctypes.

Instruction-set flags are chosen from what this CPU reports (never -march=native, which can
select instructions a virtual machine does not allow). Builds are cached per source and flags.
Without a compiler the callers fall back to their pure-torch paths.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger("pocketllm")
_SRC = Path(__file__).with_name("gguf_gemm.c")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _arch_flags() -> list[str]:
    have = _cpu_flags()
    flags = []
    if {"avx2", "fma", "f16c"} <= have:
        flags += ["-mavx2", "-mfma", "-mf16c"]
        if "avx_vnni" in have:
            flags += ["-mavxvnni"]
        if {"avx512f", "avx512vl", "avx512bw", "avx512dq"} <= have:
            flags += ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mprefer-vector-width=512"]
            if "avx512_vnni" in have:
                flags += ["-mavx512vnni"]
    return flags


def _cache_dir() -> Path:
    root = os.environ.get("POCKETLLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pocketllm")
    return Path(root) / "kernels"


@cache
def load_gguf_kernels() -> ctypes.CDLL | None:
    if os.environ.get("POCKETLLM_DISABLE_C_KERNELS") == "1":
        return None
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        log.warning("no C compiler found: GGUF matmuls use the slower pure-torch path")
        return None
    flags = ["-O3", "-fPIC", "-shared", "-fopenmp", *_arch_flags()]
    key = hashlib.sha256(_SRC.read_bytes() + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"gguf_gemm-{key}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            out = Path(tmp) / lib.name
            done = subprocess.run([cc, *flags, str(_SRC), "-o", str(out), "-lm"], capture_output=True, text=True)
            if done.returncode != 0:
                log.warning("building the GGUF C kernels failed, using the pure-torch path:\n%s", done.stderr[-2000:])
                return None
            os.replace(out, lib)
    dll = ctypes.CDLL(str(lib))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    dll.gguf_gemm.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    dll.gguf_dequant_rows.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, ptr, ctypes.c_int]
    dll.gguf_dequant_row_ptrs.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ctypes.c_int]
    dll.gguf_supported.argtypes = [ctypes.c_int]
    dll.gguf_gemm_int8.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    dll.gguf_int8_supported.argtypes = [ctypes.c_int]
    return dll
