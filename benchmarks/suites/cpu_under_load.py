"""Single-stream decode on a CPU that other programs also use: PocketLLM (fast and exact paths,
under OpenMP settings such as the spin count) and llama.cpp on the same GGUF file, idle and next
to one busy process per core.

Loads: `busy`, a Python loop per core (a program that computes and never syncs); `omp`, a process
per core running torch matmuls on all the cores' threads (another OpenMP program, whose threads
spin between its parallel regions as ours do). Each figure is llama-bench's or `pocketllm bench
latency`'s decode tok/s (tg64 after a 128-token prompt), measured while the load runs; the idle
row comes first and last, so drift shows.

    python benchmarks/suites/cpu_under_load.py --out benchmarks/results/cpu-under-load.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpu_vs_llamacpp import model_file
from llamacpp import bin_dir, llama_bench, run

from pocketllm import OPENMP_SPINS
from pocketllm.bench.report import environment

RESULTS = Path(__file__).resolve().parents[1] / "results"
LOADS = {
    "busy": "while True: pass",
    "omp": ("import torch\na = torch.randn(384, 384)\n"
            "while True:\n    a = torch.tanh(a @ a / 20)\n    b = torch.randn(4096).sum()"),
}


def pocketllm(path: Path, exact: bool, env: dict, reps: int) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        run([sys.executable, "-m", "pocketllm.cli.main", "bench", "latency", path, "--max-model-len", "1024",
             "--exact-kernels", str(exact).lower(), "--warmup", "1", "--input-len", "128", "--output-len", "64",
             "--num-iters", reps, "--output-json", f.name], env=env)
        return json.loads(Path(f.name).read_text())["results"][0]["decode_tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the default model)")
    ap.add_argument("--loads", nargs="*", default=["busy", "omp"], choices=sorted(LOADS))
    ap.add_argument("--envs", nargs="+", default=["default", "GOMP_SPINCOUNT=300000"],
                    help="PocketLLM's OpenMP settings: default (its own), or NAME=VALUE[,NAME=VALUE...] "
                         "(GOMP_SPINCOUNT=300000 is libgomp's default)")
    ap.add_argument("--paths", nargs="+", default=["fast", "exact"], choices=["fast", "exact"])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "cpu-under-load.json")
    args = ap.parse_args()
    path = args.model or model_file("Q4_1", Path(tempfile.gettempdir()), bin_dir())  # the default model
    cores = len(os.sched_getaffinity(0))
    have_peer = (bin_dir() / "llama-bench").exists()
    report = {**environment(), "model": path.name, "cores": cores,
              "rows": []}

    def measure(load: str) -> dict:
        row = {"load": load}
        if have_peer:
            row["llama.cpp"] = llama_bench(path, "0", 64, ngl=0, reps=args.reps, threads=cores)["tg"]
        for p in args.paths:
            for setting in args.envs:
                env = {} if setting == "default" else dict(kv.split("=", 1) for kv in setting.split(","))
                row[f"{p} {setting}"] = pocketllm(path, p == "exact", env, args.reps)
        print(json.dumps(row), file=sys.stderr, flush=True)
        return row

    for load in ["idle", *args.loads, "idle"]:
        procs = [] if load == "idle" else [
            subprocess.Popen([sys.executable, "-c", LOADS[load]], env={**os.environ, "OMP_NUM_THREADS": str(cores)})
            for _ in range(cores)]
        try:
            time.sleep(1 if procs else 0)
            report["rows"].append(measure(load))
        finally:
            for p in procs:
                p.kill()
                p.wait()
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report) + "\n")
    print(markdown(report))


def markdown(report: dict) -> str:
    columns = [k for k in report["rows"][0] if k != "load"]
    lines = [f"# Single-stream decode under CPU load ({report['model']})", "",
             f"{report['machine']['cpu']}, {report['cores']} cores, commit {report['commit']}"
             f"{' (dirty)' if report['dirty'] else ''}, {report['date']}. Decode tok/s (tg64); in brackets the "
             f"share of the first idle row's figure. Loads: one process per core (`busy`: a Python loop; `omp`: "
             f"torch matmuls on {report['cores']} threads). `default`: PocketLLM's own OpenMP settings "
             f"(GOMP_SPINCOUNT={OPENMP_SPINS}); libgomp's own spin count is 300000.", f"Command: `{report['command']}`", "",
             "| load | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    idle = report["rows"][0]
    for row in report["rows"]:
        lines.append(f"| {row['load']} | " + " | ".join(f"{row[c]:.1f} ({row[c] / idle[c]:.2f})" for c in columns)
                     + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
