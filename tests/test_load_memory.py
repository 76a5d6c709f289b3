"""Loading a GGUF on the CPU holds its weights once: the peak resident memory while loading stays
near what the loaded model keeps. (Before, the file's mapped pages stayed resident beside their
repacked copies until loading ended: a 1.5B Q4_K_M file of 938 MiB peaked 1.25x its size above
the loaded model, benchmarks/results/cpu-load-memory.md.)"""
from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest
import torch
from fixtures import default_model_gguf
from gguf import GGUFReader

from pocketllm.config import EngineArgs
from pocketllm.gguf_file import GGUFFile
from pocketllm.layers.linear import Embedding, Linear
from pocketllm.loaders.dummy_gguf import write_dummy_gguf
from pocketllm.loaders.model_source import ModelSource
from pocketllm.runner.worker import Worker

# In a process of its own: VmHWM is the process's peak since it started.
SCRIPT = """
import sys
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
import torch
from pocketllm import LLM, SamplingParams
base = rss("VmRSS")
llm = LLM(sys.argv[1], kv_cache_memory=64 << 20, max_model_len=256)
# one token through every weight first: a kernel that reclaims idle clean pages (DAMON) may have dropped
# pages of weights read in place from the file; a step brings them back, as serving would
llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1))
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


def test_a_model_is_built_without_weight_memory():
    """Llama-3-70B's shape built for a real device: no dense weight has memory until its tensor loads
    (on CUDA an empty tensor is real memory: a 17.8 GiB IQ2_XXS file needed its 141 GB bf16 size for a
    moment), and the model counts its 70.6 billion parameters."""
    from pocketllm.config import ModelConfig
    from pocketllm.core.shapes import SHAPES
    from pocketllm.kernels.platform import KernelConfig, building_with
    from pocketllm.models.registry import select_runtime

    cfg = ModelConfig.from_hf_dict(SHAPES["llama3-70b"])
    runtime = select_runtime(cfg, EngineArgs.from_kwargs(model="llama3-70b", load_format="dummy"), "cpu", "bfloat16")
    with building_with(KernelConfig()):
        model = runtime.model_class(cfg, dtype=torch.bfloat16, device="cpu", max_model_len=256)
    layers = [m for m in model.modules() if isinstance(m, (Linear, Embedding))]
    assert len(layers) == 2 + 4 * cfg.num_layers  # embedding, head; qkv, o, gate_up, down a layer
    assert all(m.weight.is_meta and m.device.type == "cpu" for m in layers)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == 70.6


def test_loading_materializes_every_weight_once_where_it_belongs(tmp_path):
    """The same model built and loaded from a GGUF file on the CPU: the quantized layers never take a
    dense weight, the others hold theirs on the CPU, and nothing is left on the meta device."""
    path = write_dummy_gguf(tmp_path / "m.gguf", "smollm2-135m", "Q4_K_M").path
    args = EngineArgs.from_kwargs(model=str(path), device="cpu")
    worker = Worker(ModelSource.open(str(path), "auto"), args, torch.device("cpu"), "float32")
    model = worker.load(max_model_len=64)
    assert not [n for n, p in model.named_parameters() if p.device.type != "cpu"]
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.quantized is not None and m.weight is None for m in linears)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("qtype", ["Q4_K_M", "IQ2_XXS"])
def test_loading_on_cuda_peaks_at_the_weights(tmp_path, qtype):
    """Peak GPU memory while a GGUF model loads is at most its loaded weights + 5% (issue: models built
    without memory): measured with the CUDA allocator's own statistics."""
    path = write_dummy_gguf(tmp_path / "m.gguf", "qwen2.5-1.5b", qtype).path
    args = EngineArgs.from_kwargs(model=str(path), device="cuda")
    worker = Worker(ModelSource.open(str(path), "auto"), args, torch.device("cuda"), "bfloat16")
    planned = worker.planned_weight_bytes()  # from the header, before loading (which releases it)
    gc.collect()  # an earlier case's model, if still referenced somewhere, is not this one's base
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    worker.load(max_model_len=256)
    held = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= 1.05 * held, (peak, held)
    assert abs(held - planned) <= 0.05 * planned, (held, planned)


RESERVE = """
import sys
from pocketllm import LLM
llm = LLM(sys.argv[1], kv_cache_memory=256 << 20, reserve_kv_cache=sys.argv[2] == "1")
print(next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS")))
"""


def test_a_reserved_kv_cache_is_held_from_the_start():
    """`reserve_kv_cache` (on for `serve`): the CPU cache's 256 MiB are resident before any request, so
    a server's memory does not grow as blocks are first used; off, they are not."""
    from pocketllm.cli.main import build_parser

    path = default_model_gguf()
    rss = {}
    for flag in ("0", "1"):
        done = subprocess.run([sys.executable, "-c", RESERVE, str(path), flag], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        rss[flag] = int(done.stdout.split()[-1])
    assert rss["1"] - rss["0"] >= 0.95 * (256 << 20), rss
    for argv, reserved in ((["serve"], True), (["generate", "hi"], False), (["chat"], False)):
        assert build_parser(argv).parse_args(argv).reserve_kv_cache is reserved
