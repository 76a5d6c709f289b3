"""Peak GPU memory while a model loads, against what the loaded model holds and what the memory plan
said before loading (the CUDA allocator's own statistics; the KV cache is not part of it):

    python benchmarks/tools/load_peak.py MODEL [--dtype bfloat16] [--output-json OUT.json]

Runs on the tree it is imported from (PYTHONPATH), so that a tree before a change can be measured on
the same file; a load that runs out of memory is recorded as such, with the peak it reached.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    import pocketllm
    from pocketllm.config import EngineArgs
    from pocketllm.loaders.model_source import ModelSource
    from pocketllm.runner.worker import Worker

    device = torch.device("cuda")
    engine_args = EngineArgs.from_kwargs(model=args.model, device="cuda", dtype=args.dtype)
    worker = Worker(ModelSource.open(args.model, "auto"), engine_args, device, args.dtype)
    planned = worker.planned_weight_bytes()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    error = None
    try:
        worker.load(args.max_model_len)
    except torch.OutOfMemoryError as e:
        error = f"OutOfMemoryError: {str(e).splitlines()[0]}"
    seconds = time.perf_counter() - t0
    held = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    gib = 1 << 30
    out = {"model": Path(args.model).name, "file_bytes": Path(args.model).stat().st_size,
           "pocketllm": str(Path(pocketllm.__file__).parent), "gpu": torch.cuda.get_device_name(),
           "total_gpu_gib": round(torch.cuda.get_device_properties(0).total_memory / gib, 2),
           "planned_weights_gib": round(planned / gib, 3),
           "held_after_load_gib": None if error else round(held / gib, 3),
           "peak_during_load_gib": round(peak / gib, 3),
           "peak_over_held": None if error else round(peak / held, 4), "load_s": round(seconds, 1), "error": error}
    print(json.dumps(out, indent=1))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main())
