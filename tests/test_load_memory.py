"""Loading a GGUF on the CPU holds its weights once: the peak resident memory while loading stays
near what the loaded model keeps. (Before, the file's mapped pages stayed resident beside their
repacked copies until loading ended: a 1.5B Q4_K_M file of 938 MiB peaked 1.25x its size above
the loaded model, benchmarks/results/cpu-load-memory.md.)"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
from fixtures import default_model_gguf
from gguf import GGUFReader

from pocketllm.gguf_file import GGUFFile
from pocketllm.loaders.dummy_gguf import write_dummy_gguf

# In a process of its own: VmHWM is the process's peak since it started.
SCRIPT = """
import sys
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
import torch
from pocketllm import LLM
base = rss("VmRSS")
llm = LLM(sys.argv[1], kv_cache_memory=64 << 20, max_model_len=256)
print(rss("VmRSS") - base, rss("VmHWM") - base)
"""


def test_loading_holds_the_weights_once(tmp_path):
    path = write_dummy_gguf(tmp_path / "m.gguf", "qwen2.5-1.5b", "Q4_K_M").path
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    after, peak = map(int, done.stdout.split()[-2:])
    size = path.stat().st_size
    assert after >= 0.9 * size  # the weights are in memory (kept in blocks, repacked)
    assert peak - after <= 0.6 * size, (after, peak, size)


def test_the_fast_reader_reads_what_gguf_reads():
    path = default_model_gguf()
    ours, theirs = GGUFFile(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data)
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(mine.parts, field.parts, strict=True))
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors, strict=True))
