"""Where the time goes when MoE experts run in host memory beside a GPU (`--cpu-offload-experts all`), at
several CPU thread counts. A Qwen3-30B-A3B-shaped Q4_K_M file of fewer layers is written first.

- `experts_alone`: one layer's host experts (SparseMoE._host_experts: one token's 8 experts, the CPU's
  one-call path) timed in a loop on the host, nothing else running: ms a call and the GB/s of expert
  weights it reads.
- `decode`: batch-1 greedy decode on the GPU with every layer's experts on the host: tok/s, and per
  token the ms inside the host experts and the ms of the rest of the offloaded layers' work (routing,
  the wait for the device, the copies).

    python benchmarks/tools/host_experts_profile.py --threads 1 4 8 16 --output-json FILE
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import gguf
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pocketllm import LLM, SamplingParams  # noqa: E402
from pocketllm.bench.report import environment  # noqa: E402
from pocketllm.core.shapes import SHAPES  # noqa: E402
from pocketllm.layers.moe import SparseMoE  # noqa: E402
from pocketllm.loaders.dummy_gguf import write_dummy_gguf  # noqa: E402


class Timers:
    """Wall time inside SparseMoE._host_experts and inside the offloaded layers' _experts."""

    def __init__(self):
        self.host = self.layer = 0.0
        host, layer = SparseMoE._host_experts, SparseMoE._experts

        def timed_host(moe, *a):
            t0 = time.perf_counter()
            try:
                return host(moe, *a)
            finally:
                self.host += time.perf_counter() - t0

        def timed_layer(moe, *a):
            if not moe.on_host:
                return layer(moe, *a)
            t0 = time.perf_counter()
            try:
                return layer(moe, *a)
            finally:
                self.layer += time.perf_counter() - t0

        SparseMoE._host_experts, SparseMoE._experts = timed_host, timed_layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--cprofile", action="store_true", help="profile the last thread count's decode (Python's "
                    "cProfile): its top functions by own time go in the JSON")
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args()
    path = Path(tempfile.mkdtemp()) / "moe.gguf"
    write_dummy_gguf(path, {**SHAPES["qwen3-30b-a3b"], "num_hidden_layers": a.layers}, a.type)
    timers = Timers()
    layer0 = [t for t in gguf.GGUFReader(path).tensors if t.name.startswith("blk.0.ffn_") and "_exps" in t.name]
    expert_bytes = sum(int(t.n_bytes) for t in layer0) // SHAPES["qwen3-30b-a3b"]["num_experts"] * \
        SHAPES["qwen3-30b-a3b"]["num_experts_per_tok"]
    result = {**environment(), "command": " ".join(sys.argv), "layers": a.layers, "type": a.type, "runs": []}
    cuda = torch.cuda.is_available()
    for threads in a.threads:
        llm = LLM(str(path), device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32",
                  max_model_len=512, max_num_seqs=4, num_threads=threads,
                  cpu_offload_experts="all" if cuda else None)
        moe = next(m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE))
        x = torch.randn(1, moe.gate.in_features)
        k, e = moe.top_k, len(moe.experts)
        weights = torch.full((1, k), 1.0 / k)
        for i in range(3):
            moe._host_experts(x, weights, torch.arange(k)[None])
        n, t0 = 64, time.perf_counter()
        for i in range(n):  # other experts each call: their weights come from memory, not the caches
            moe._host_experts(x, weights, (torch.arange(k)[None] + k * i) % e)
        alone = (time.perf_counter() - t0) / n
        run = {"threads": threads, "experts_alone_ms": alone * 1e3, "experts_alone_gb_s": expert_bytes / alone / 1e9,
               "expert_bytes_per_token_layer": expert_bytes}
        if cuda:
            params = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
            prompt = [{"prompt_token_ids": list(range(100, 132))}]
            llm.generate(prompt, params, use_tqdm=False)
            timers.host = timers.layer = 0.0
            profile = cProfile.Profile() if a.cprofile and threads == a.threads[-1] else None
            t0 = time.perf_counter()
            with profile or contextlib.nullcontext():
                llm.generate(prompt, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            if profile is not None:
                text = io.StringIO()
                pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(40)
                result["cprofile_tottime"] = text.getvalue().splitlines()
            run.update(decode_tok_s=a.tokens / wall, ms_per_token=wall / a.tokens * 1e3,
                       host_experts_ms_per_token=timers.host / a.tokens * 1e3,
                       offloaded_layers_other_ms_per_token=(timers.layer - timers.host) / a.tokens * 1e3)
        print(json.dumps(run), flush=True)
        result["runs"].append(run)
        del llm
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
