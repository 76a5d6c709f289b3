"""The CPU kernels' build (pocketllm/kernels/cpu/build.py): link-time optimized where the compiler can, plain
where it cannot; a cached library is loaded only where no other user could have put it, and a cache
that cannot be used gives a private build."""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import stat
import subprocess

import pytest

from pocketllm.kernels.cpu import build

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="needs a C compiler")


def _library(tmp_path):
    src = tmp_path / "answer.c"
    src.write_text("int answer(void) { return 42; }\n")
    return src, tmp_path / "answer.so"


def test_the_build_takes_link_time_optimization_where_the_compiler_does(tmp_path):
    src, out = _library(tmp_path)
    version = subprocess.run([build.compiler(), "--version"], capture_output=True, text=True).stdout
    if "Free Software Foundation" not in version:
        pytest.skip("the LTO flags are GCC's")
    done = build._build(build.compiler(), ["-O2", "-fPIC", "-shared"], out, [src])
    assert done.returncode == 0, done.stderr
    assert all(flag in done.args for flag in build.LTO)
    assert ctypes.CDLL(str(out)).answer() == 42


def test_a_compiler_that_refuses_the_lto_flags_builds_plainly(tmp_path, monkeypatch):
    src, out = _library(tmp_path)
    monkeypatch.setattr(build, "LTO", ["-fno-such-option-anywhere"])
    done = build._build(build.compiler(), ["-O2", "-fPIC", "-shared"], out, [src])
    assert done.returncode == 0, done.stderr
    assert "-fno-such-option-anywhere" not in done.args
    assert ctypes.CDLL(str(out)).answer() == 42


# -- the cache: a library loaded from it runs its code ---------------------------------------------
@pytest.fixture
def built_once(monkeypatch):
    """Builds copy the kernels this process loaded (built by `_build`, as the tests above check)
    instead of compiling them again: these tests are about where a library is built and loaded from."""
    built = build.load_cpu_kernels()._name

    def copy(cc, flags, out, sources=None):
        shutil.copyfile(built, out)
        return subprocess.CompletedProcess([cc, *flags, "-o", str(out)], 0, "", "")

    monkeypatch.setattr(build, "_build", copy)


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch, built_once):
    """POCKETLLM_CACHE in `tmp_path` and a fresh `load_cpu_kernels`: (the kernels' cache directory,
    the file name the kernels are cached under there)."""
    monkeypatch.setenv("POCKETLLM_CACHE", str(tmp_path / "cache"))
    build.load_cpu_kernels.cache_clear()
    try:
        yield tmp_path / "cache" / "kernels", build._cache_name(build.compiler(), build._build_flags("native"))
    finally:
        build.load_cpu_kernels.cache_clear()


def _plant(path, source: str) -> bytes:
    """A shared library compiled from `source` at `path`; its bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    src = path.with_suffix(".c")
    src.write_text(source)
    done = subprocess.run([build.compiler(), "-shared", "-fPIC", str(src), "-o", str(path)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    src.unlink()
    return path.read_bytes()


def _fresh_build(dll) -> bool:
    """The library is the kernels, and not from the cache."""
    return dll is not None and hasattr(dll, "gguf_gemm") and "/cache/" not in dll._name


def test_a_cached_library_that_others_can_write_is_not_loaded(kernel_cache, caplog):
    """Another library planted under the kernels' name in the cache: where another user can write
    to its directory or to the file, the kernels are built privately and loaded instead, and the
    planted file is left as it was; the same file where only its owner can write is loaded (it
    could only be theirs)."""
    kernels, name = kernel_cache
    lib = kernels / name
    planted = _plant(lib, "int planted_marker(void) { return 7; }\n")
    for path, mode in ((kernels, 0o777), (lib, 0o666)):
        os.chmod(path, mode)
        build.load_cpu_kernels.cache_clear()
        dll = build.load_cpu_kernels()
        assert _fresh_build(dll) and not hasattr(dll, "planted_marker")
        assert f"{path} belongs to or can be written by another user" in caplog.text
        assert lib.read_bytes() == planted
        os.chmod(path, 0o755)
    build.load_cpu_kernels.cache_clear()
    with pytest.raises(AttributeError, match="gguf_gemm"):  # the planted library, loaded: it has no kernels
        build.load_cpu_kernels()


def test_a_cache_that_cannot_be_created_builds_privately(tmp_path, monkeypatch, caplog, built_once):
    """POCKETLLM_CACHE under a regular file (unwritable even to root, whom no chmod stops): working
    kernels from a private build, not a failed load."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("POCKETLLM_CACHE", str(tmp_path / "file" / "cache"))
    build.load_cpu_kernels.cache_clear()
    try:
        assert _fresh_build(build.load_cpu_kernels())
        assert "cannot create the CPU kernels' cache" in caplog.text
    finally:
        build.load_cpu_kernels.cache_clear()


def test_a_cached_library_that_cannot_be_mapped_builds_privately(kernel_cache, caplog):
    """A cached file the loader refuses (as every file on a noexec mount, or a damaged one): working
    kernels from a private build, not a failed load."""
    kernels, name = kernel_cache
    kernels.mkdir(parents=True)
    (kernels / name).write_bytes(b"\x7fELF, but not really")
    assert _fresh_build(build.load_cpu_kernels())
    assert "cannot load the cached CPU kernels" in caplog.text


def test_the_kernels_are_cached_in_new_private_directories(kernel_cache, caplog):
    kernels, name = kernel_cache
    with caplog.at_level(logging.INFO, logger="pocketllm"):
        dll = build.load_cpu_kernels()
    # a first start says why it waits
    assert "building the CPU kernels for this processor, once" in caplog.text and "built the CPU kernels in" in caplog.text
    assert dll._name == str(kernels / name) and hasattr(dll, "gguf_gemm")
    assert stat.S_IMODE(kernels.stat().st_mode) == 0o700
    assert stat.S_IMODE(kernels.parent.stat().st_mode) == 0o700
