"""LoRA adapters' cost: 8 concurrent requests over two adapters against the same 8 requests on the base
model alone, in one process, alternated run by run (output tok/s over the batch, its prompts in the prefix
cache after a warm-up of each), and the base model's requests on the engine that runs adapters.

The adapters are random (rank 16, alpha 32) on every projection the model has (q, k, v, o, gate, up,
down), written as PEFT directories in a temporary folder, for the default model or any other.

    python benchmarks/suites/lora.py --threads 2 --reps 5 --out benchmarks/results/cpu-lora/run.json
    python benchmarks/suites/lora.py --model llama3-8b --load-format dummy --device cuda --dtype bfloat16 \\
        --adapters 8 --requests 64 1 --out benchmarks/results/h100-lora.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pocketllm import LLM, LoRARequest, SamplingParams  # noqa: E402
from pocketllm.bench.report import environment  # noqa: E402


def write_adapter(path: Path, llm: LLM, rank: int, seed: int) -> None:
    """A PEFT directory for `llm`'s model: A and B random on every projection adapters may target."""
    from safetensors.torch import save_file

    from pocketllm.loaders.lora_adapter import TARGETS, lora_layers

    model = llm.engine.runner.model
    unpacked = {(fused, part): name for name, (fused, part) in model.packed_modules.items()}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for ours, layer in lora_layers(model).items():
        parent, _, leaf = ours.rpartition(".")
        for part, out in enumerate(layer.out_sizes):
            name = unpacked.get((leaf, part), leaf)
            key = f"base_model.model.{parent}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, layer.in_features, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                          "target_modules": list(TARGETS), "bias": "none"}))


def decode_rate(llm: LLM, prompts: list[list[int]], params: SamplingParams, loras) -> float:
    """Output tokens a second over the batch (its prompts are in the prefix cache after the warm-up)."""
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--adapters", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--requests", type=int, nargs="+", default=[8], help="concurrent requests; several: each in turn")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    most = max(a.requests)
    common = dict(device=a.device, dtype=a.dtype, load_format=a.load_format, num_threads=a.threads,
                  max_model_len=a.input_len + a.output_len + 16, max_num_seqs=most)
    if a.device == "cuda":  # two engines on one card: each a cache for its requests, not the card's memory
        # (three sets of prompts stay cached: the base model's, the adapters', the base rows on the LoRA engine)
        common["num_kv_blocks"] = 3 * most * (-(-common["max_model_len"] // 16) + 1)
    base = LLM(a.model, **common)
    tmp = Path(tempfile.mkdtemp())
    for i in range(a.adapters):
        write_adapter(tmp / f"adapter{i}", base, a.rank, i)
    lora = LLM(a.model, **common, enable_lora=True, max_loras=a.adapters, max_lora_rank=a.rank,
               lora_modules=[f"adapter{i}={tmp / f'adapter{i}'}" for i in range(a.adapters)])
    vocab = base.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    result = {**environment(), "command": " ".join(sys.argv), "adapters": a.adapters, "rank": a.rank,
              "input_len": a.input_len, "output_len": a.output_len, "by_requests": {}}
    for n in a.requests:
        prompts = [[(7 + 13 * i + 31 * j) % (vocab - 10) + 5 for j in range(a.input_len)] for i in range(n)]
        loras = [LoRARequest(f"adapter{i % a.adapters}") for i in range(n)]
        runs = {"base": [], "lora": [], "lora_engine_base_rows": []}
        cases = [("base", base, None), ("lora", lora, loras), ("lora_engine_base_rows", lora, None)]
        for _, llm, lr in cases:  # warm-up (and the prefix cache holds every prompt from here on)
            decode_rate(llm, prompts, params, lr)
        for _ in range(a.reps):
            for name, llm, lr in cases:
                runs[name].append(decode_rate(llm, prompts, params, lr))
        best = {k: max(v) for k, v in runs.items()}
        result["by_requests"][n] = {"runs": runs, "best_decode_tok_s": best, "lora_over_base": best["lora"] / best["base"],
                                    "lora_engine_base_rows_over_base": best["lora_engine_base_rows"] / best["base"]}
        print(n, "requests:", json.dumps(result["by_requests"][n]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
