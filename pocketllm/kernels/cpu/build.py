"""Builds the C kernels on first use with the system C compiler and loads them with ctypes.

Instruction-set flags are chosen from what this CPU reports (never -march=native, which can
select instructions a virtual machine does not allow). Builds are cached per source and flags.
Without a compiler the callers fall back to their pure-torch paths.

Loading a library runs its code, so a cached one is loaded only where no other user could have put
it there: the file, its directory and the cache's root must belong to this user (or root) and be
writable by nobody else. Otherwise, and where the cache cannot be written or its files cannot be
mapped (a read-only or noexec mount), the kernels are built in a private temporary directory.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import time
from functools import cache
from pathlib import Path

from pocketllm import envs

log = logging.getLogger("pocketllm")
_SOURCES = [Path(__file__).with_name(n) for n in ("gguf_gemm.c", "layer_ops.c", "llama_decode.c")]
_INCLUDED = sorted(Path(__file__).with_name("gguf_gemm").glob("*.h"))  # gguf_gemm.c's sections


def _cpu_info() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def _fast_pdep(info: dict[str, str]) -> bool:
    """Whether pdep / pext (BMI2) run in hardware: everywhere but on AMD's Zen 1 and Zen 2 (family 17h, and Hygon's
    18h), which microcode them at hundreds of cycles."""
    family = int(info.get("cpu family", "0") or 0)
    return not (info.get("vendor_id") in ("AuthenticAMD", "HygonGenuine") and family in (0x17, 0x18))


# Instruction-set levels, lowest first: each adds to the one before where the CPU has it.
ISA_LEVELS = ("none", "avx2", "avx2-bmi2", "avx2-vnni", "avx512")


def _arch_flags(isa: str = "native") -> list[str]:
    """Compiler flags for the highest level this CPU has, capped at ``isa`` (or the environment's
    POCKETLLM_CPU_ISA): ``native`` takes all it has."""
    cap = envs.get("POCKETLLM_CPU_ISA") if isa == "native" else isa
    if cap != "native" and cap not in ISA_LEVELS:
        raise ValueError(f"unknown instruction-set level {cap!r}; known: native, {', '.join(ISA_LEVELS)}")
    top = len(ISA_LEVELS) if cap == "native" else ISA_LEVELS.index(cap)
    info = _cpu_info()
    have = set(info.get("flags", "").split())
    flags = []
    if top >= 1 and {"avx2", "fma", "f16c"} <= have:
        flags += ["-mavx2", "-mfma", "-mf16c"]
        if top >= 2 and "bmi2" in have and _fast_pdep(info):  # the lattice types' grid indices by pdep / pext
            flags += ["-mbmi2"]
        if top >= 3 and "avx_vnni" in have:
            flags += ["-mavxvnni"]
        if top >= 4 and {"avx512f", "avx512vl", "avx512bw", "avx512dq"} <= have:
            flags += ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mprefer-vector-width=512"]
            if "avx512_vnni" in have:
                flags += ["-mavx512vnni"]
    return flags


def _cache_dir() -> Path:
    return envs.cache_root() / "kernels"


def _writable_by_others(path: Path) -> bool:
    """Whether another user than this one (or root) owns `path` or may write to it."""
    st = path.stat()
    return st.st_uid not in (os.getuid(), 0) or bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


class _BuildFailed(Exception):
    """The compiler refused the kernels (its error is the message)."""


def _build_into(directory: Path, cc: str, flags: list[str], name: str) -> Path:
    """The kernels built as ``directory/name`` (whole or not at all)."""
    # A first start waits for this (10-20 s on two cores): say so rather than pause silently.
    log.info("building the CPU kernels for this processor, once (cached in %s)", directory)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        out = Path(tmp) / name
        done = _build(cc, flags, out)
        if done.returncode != 0:
            raise _BuildFailed(done.stderr[-2000:])
        os.replace(out, directory / name)
    log.info("built the CPU kernels in %.1f s", time.perf_counter() - t0)
    return directory / name


def _load_cached(cc: str, flags: list[str], name: str) -> ctypes.CDLL | None:
    """The kernels from the cache (built into it first where they are not there yet), or None where
    the cache cannot be trusted or used: the caller then builds them privately."""
    kernels = _cache_dir()
    try:
        for d in (kernels.parent, kernels):  # new ones private from the start
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        log.warning("cannot create the CPU kernels' cache %s (%s): building them in a private temporary "
                    "directory", kernels, e)
        return None
    lib = kernels / name
    for path in (kernels.parent, kernels, *([lib] if lib.exists() else [])):
        if _writable_by_others(path):
            log.warning("%s belongs to or can be written by another user, so the CPU kernels cached there are not "
                        "loaded: building them in a private temporary directory. `chmod go-w` it (or point "
                        "POCKETLLM_CACHE elsewhere) to use the cache again", path)
            return None
    if not lib.exists():
        try:
            _build_into(kernels, cc, flags, name)
        except OSError as e:  # a read-only cache
            log.warning("cannot write the CPU kernels' cache %s (%s): building them in a private temporary "
                        "directory", kernels, e)
            return None
    try:
        return ctypes.CDLL(str(lib))
    except OSError as e:  # a cache mounted noexec, or a damaged file
        log.warning("cannot load the cached CPU kernels %s (%s): building them in a private temporary directory "
                    "(remove the file, or point POCKETLLM_CACHE at a disk that allows running code)", lib, e)
        return None


def _load_private(cc: str, flags: list[str], name: str) -> ctypes.CDLL | None:
    """The kernels built in a new directory only this user can enter, loaded, then the directory
    removed (the library stays mapped). None where the temporary directory is mounted noexec too."""
    tmp = Path(tempfile.mkdtemp(prefix="pocketllm-kernels-"))  # mode 0700
    try:
        lib = _build_into(tmp, cc, flags, name)
        try:
            return ctypes.CDLL(str(lib))
        except OSError as e:
            log.warning("cannot load the CPU kernels built in %s (%s), using the pure-torch paths; set TMPDIR to "
                        "a directory that allows running code", tmp, e)
            return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def compiler() -> str | None:
    """The C compiler the kernels are built with ($CC, else cc), None where there is none."""
    return shutil.which(os.environ.get("CC", "cc"))


def _build_flags(isa: str) -> list[str]:
    return ["-O3", "-fPIC", "-shared", "-fopenmp", *_arch_flags(isa)]


def _cache_name(cc: str, flags: list[str]) -> str:
    """The kernels' file name in the cache: one per source, compiler and flags."""
    sources = b"".join(f.read_bytes() for f in _SOURCES + _INCLUDED)
    key = hashlib.sha256(sources + " ".join([cc, *flags, *LTO]).encode()).hexdigest()[:16]
    return f"cpu_kernels-{key}.so"


@cache
def load_cpu_kernels(isa: str = "native") -> ctypes.CDLL | None:
    """The kernels built for this CPU (``isa`` caps the instruction set: see ISA_LEVELS), or None
    without a C compiler (or where the build fails: logged)."""
    if envs.flag("POCKETLLM_DISABLE_C_KERNELS"):
        return None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler found: the CPU kernels fall back to the slower pure-torch paths")
        return None
    flags = _build_flags(isa)
    name = _cache_name(cc, flags)
    try:
        dll = _load_cached(cc, flags, name) or _load_private(cc, flags, name)
    except (_BuildFailed, OSError) as e:
        log.warning("building the CPU kernels failed, using the pure-torch paths:\n%s", e)
        return None
    if dll is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    dll.gguf_gemm.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    dll.gguf_dequant_rows.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, ptr, ctypes.c_int]
    dll.gguf_dequant_row_ptrs.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ctypes.c_int]
    dll.gguf_supported.argtypes = [ctypes.c_int]
    dll.gguf_gemm_int8.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
    dll.gguf_heads_gemm_int8.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, i64, ptr, ctypes.c_int,
                                         ctypes.c_int]
    dll.gguf_int8_supported.argtypes = [ctypes.c_int]
    dll.gguf_x8_supported.argtypes = [ctypes.c_int]
    dll.gguf_repack_x8.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ctypes.c_int]
    dll.gguf_x8_nbytes.argtypes = [ctypes.c_int, i64, i64]
    dll.gguf_x8_nbytes.restype = i64
    dll.gguf_gemm_x8.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
    dll.gguf_dequant_rows_x8.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    f32 = ctypes.c_float
    dll.cpu_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, f32, ctypes.c_int]
    dll.cpu_rotary.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr]
    dll.cpu_gather_int8_blocks.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, ptr, ctypes.c_int]
    dll.cpu_write_kv.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr]
    dll.cpu_decode_attention.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr, i64, ptr, i64, f32,
                                         i64, f32, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
    dll.cpu_gated_act.argtypes = [ptr, i64, i64, ctypes.c_int, ptr, ctypes.c_int]
    dll.cpu_clamped_swiglu.argtypes = [ptr, i64, i64, f32, f32, ptr, ctypes.c_int]
    dll.llama_decode.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ctypes.c_int]
    dll.moe_decode_experts.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, ctypes.c_int, f32, f32, ptr, ctypes.c_int]
    tables = _lattice_tables()
    dll.gguf_set_lattice_tables.argtypes = [ctypes.c_char_p] * len(tables)
    dll.gguf_set_lattice_tables(*tables)
    return dll


# Link-time optimization hands the code generation to parallel jobs, one a core (GCC's -flto=auto, through
# make where there is one, else serially), over partitions small enough to share out evenly (the default's
# smallest left one job most of the work): the first build takes about half the time on two cores, less with
# more; the kernels compute the same bits at the same speed (benchmarks/results/cpu-kernel-build-lto.txt).
LTO = ["-flto=auto", "--param=lto-partitions=16", "--param=lto-min-partition=1000"]


def _build(cc: str, flags: list[str], out: Path, sources: list[Path] = _SOURCES) -> subprocess.CompletedProcess:
    """The kernels' shared library at ``out``; a compiler that cannot link-time optimize builds it plainly."""
    for extra in (LTO, []):
        done = subprocess.run([cc, *flags, *extra, *map(str, sources), "-o", str(out), "-lm"], capture_output=True,
                              text=True)
        if done.returncode == 0:
            break
    return done


def _lattice_tables() -> list[bytes]:
    """The lattice i-quants' grids (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S (IQ1_M's too); each
    entry's values as bytes, IQ1's as int8) and the 7-bit sign index table, from the gguf package's."""
    import gguf.quants as gq
    import numpy as np

    grids = []
    for cls in (gq.IQ2_XXS, gq.IQ2_XS, gq.IQ2_S, gq.IQ3_XXS, gq.IQ3_S, gq.IQ1_S):
        cls.init_grid()
        grids.append(cls.grid.reshape(cls.grid_shape).astype(np.int8 if cls is gq.IQ1_S else np.uint8).tobytes())
    return [*grids, bytes(gq.IQ2_XXS.ksigns)]
