"""llama.cpp, the peer, on the GGUF files PocketLLM is measured on: `llama-bench` (one stream:
prefill of a prompt, then decode) and `llama-batched-bench` (B sequences at once), parsed into
tok/s. The CPU comparison (cpu_vs_llamacpp.py) imports these; run as a script it measures GPU
files for benchmarks/suites/gpu_run.sh's peer stage (every layer on the GPU, flash attention), writing
one JSON of figures per file with the file's size and tensor bytes (the GPU-memory yardstick):

    python benchmarks/suites/llamacpp.py --output-json OUT.json FILE.gguf [FILE.gguf ...] \
        [--batched 64 --batched-files FILE.gguf,...]

llama.cpp is built from ../shared/peers/llamacpp.sh into $LLAMACPP_DIR (default /tmp/llama.cpp).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf


def bin_dir() -> Path:
    return Path(os.environ.get("LLAMACPP_DIR", "/tmp/llama.cpp")) / "build" / "bin"


def run(cmd: list, env: dict | None = None) -> str:
    print("+", " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    done = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def tensor_bytes(path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def llama_bench(path, prompts: str, gen: int, ngl: int, reps: int, threads: int | None = None) -> dict:
    """tok/s from llama-bench (flash attention on): ``pp<N>`` for each prompt length, ``tg`` for
    ``gen`` generated tokens."""
    cmd = [bin_dir() / "llama-bench", "-m", path, "-p", prompts, "-n", gen, "-fa", "1", "-ngl", ngl,
           "-r", reps, "-o", "json"] + (["-t", threads] if threads else [])
    out = {}
    for r in json.loads(run(cmd)):
        out["tg" if r["n_gen"] else f"pp{r['n_prompt']}"] = r["avg_ts"]
    return out


def batched_bench(path, prompt: int, gen: int, sequences: int, ngl: int, threads: int | None = None) -> dict:
    """``sequences`` prompts of ``prompt`` tokens, then ``gen`` tokens each, at once
    (llama-batched-bench, flash attention): prefill and decode tok/s."""
    cmd = [bin_dir() / "llama-batched-bench", "-m", path, "-c", sequences * (prompt + gen) + 64, "-b", "2048",
           "-ub", "512", "-npp", prompt, "-ntg", gen, "-npl", sequences, "-fa", "on", "-ngl", ngl]
    for line in run(cmd + (["-t", threads] if threads else [])).splitlines():
        # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0] == str(prompt) and cells[2] == str(sequences):
            return {"prefill_tok_s": float(cells[5]), "decode_tok_s": float(cells[7])}
    raise RuntimeError(f"no {sequences}-sequence row in llama-batched-bench's output")


def main() -> None:
    from pocketllm.bench.report import environment

    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batched", type=int, default=0, help="also this many sequences at once")
    ap.add_argument("--batched-files", default="", help="comma-separated: only these files batched (default all)")
    ap.add_argument("--output-json", required=True)
    args = ap.parse_args()
    batched = set(args.batched_files.split(",")) if args.batched_files else set(args.files)
    files = {}
    for path in args.files:
        one = llama_bench(path, "512", 128, ngl=99, reps=args.reps)
        entry = {"file_bytes": Path(path).stat().st_size, "tensor_bytes": tensor_bytes(path),
                 "batch1": {"prefill_tok_s": one["pp512"], "decode_tok_s": one["tg"]}}
        if args.batched and path in batched:
            entry[f"batch{args.batched}"] = batched_bench(path, 512, 128, args.batched, ngl=99)
        files[Path(path).name] = entry
        print(Path(path).name, json.dumps(entry), flush=True)
        Path(args.output_json).write_text(json.dumps(  # after each file: a cut-off run keeps what it measured
            {**environment(), "peer": "llama.cpp", "command": " ".join(sys.argv), "files": files}, indent=1))


if __name__ == "__main__":
    main()
