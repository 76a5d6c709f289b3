"""The CPU kernels' build (pocketllm/kernels/cpu/build.py): link-time optimized where the compiler can, plain
where it cannot."""
from __future__ import annotations

import ctypes
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
