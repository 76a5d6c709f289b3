"""PocketLLM against llama.cpp on the CPU, side by side on the same GGUF files, back to back:
single-stream decode (llama-bench tg64), prefill of 128 and 512 tokens (pp128, pp512) and 8
concurrent sequences (llama-batched-bench, 128 prompt + 128 generated tokens each).

Files: the default model (SmolLM2-135M-Instruct Q4_1, real weights) and random-weight files of a
Qwen2.5-1.5B's shape (`pocketllm dummy-gguf`, every type: llama-quantize would want an importance
matrix for the low-bit i-quants), written once into --workdir. llama.cpp is built from ../shared/peers into $LLAMACPP_DIR (default
/tmp/llama.cpp) unless it is there already.

    python benchmarks/suites/cpu_vs_llamacpp.py [--types Q4_1 Q4_K_M ...] [--paths fast exact]
        # -> benchmarks/results/cpu-vs-llamacpp.json and .md
    python benchmarks/suites/cpu_vs_llamacpp.py --shape gpt-oss-20b --types MXFP4_MOE --figures tg \
        --out benchmarks/results/cpu-moe-vs-llamacpp.json    # the MoE issue's CPU figure (~13 GB, mmapped)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from llamacpp import batched_bench, bin_dir, llama_bench, run, tensor_bytes

from pocketllm.bench.report import environment

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT.parent / "shared" / "peers"
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_TYPES = ["Q4_1", "Q4_K_M", "Q4_0", "Q8_0", "Q5_K_M", "Q6_K", "IQ4_XS"]
SHAPE = "qwen2.5-1.5b"  # the random-weight files' default shape (--shape)
FIGURES = ("tg", "pp128", "pp512", "batch8")
# goals of the CPU-kernels issue: PocketLLM / llama.cpp
GOALS = {"tg": 1.0, "pp128": 1.0, "pp512": 1.5, "batch8": 1.5}


def cpu_isa() -> str:
    """The widest vector instructions this CPU has, which both engines build for."""
    from pocketllm.kernels.cpu.build import _cpu_info

    return "AVX-512" if "avx512f" in _cpu_info().get("flags", "").split() else "AVX2"


def llamacpp_bin(threads: int) -> Path:
    if not (bin_dir() / "llama-bench").exists() or not (bin_dir() / "llama-batched-bench").exists():
        if cpu_isa() == "AVX-512":
            run(["bash", PEERS / "llamacpp.sh", "build", "cpu"], env={"THREADS": str(threads)})
        else:  # llamacpp.sh names AVX-512 explicitly (a native build can pick AMX, which these VMs trap)
            src = bin_dir().parents[1]
            if not src.exists():
                run(["tar", "-xzf", PEERS / "llamacpp-src.tgz", "-C", src.parent])
            run(["cmake", "-S", src, "-B", src / "build", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_SERVER=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON",
                 "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=OFF"])
            run(["cmake", "--build", src / "build", f"-j{threads}", "--target", "llama-bench", "llama-batched-bench"])
    return bin_dir()


def model_file(qtype: str, workdir: Path, bin_dir: Path, shape: str = SHAPE) -> Path:
    """The file of a type: the default model for Q4_1, else a random-weight file of SHAPE."""
    if qtype == "Q4_1":
        shared = ROOT.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if shared.is_file():
            return shared
        from pocketllm.pull import pull_default_model
        return Path(pull_default_model())
    from pocketllm.loaders.dummy_gguf import write_dummy_gguf

    out = workdir / f"{shape}-{qtype}.gguf"
    if not out.exists():
        write_dummy_gguf(out, shape, qtype)
    return out


def llamacpp(path: Path, threads: int, reps: int, figures=FIGURES) -> dict:
    prompts = ",".join(p for p in ("128", "512") if f"pp{p}" in figures) or "0"
    out = llama_bench(path, prompts, 64, ngl=0, reps=reps, threads=threads)
    if "batch8" in figures:
        out["batch8"] = batched_bench(path, 128, 128, 8, ngl=0, threads=threads)["decode_tok_s"]
    return out


def pocketllm(path: Path, exact: bool, reps: int, figures=FIGURES) -> dict:
    def bench(kind: str, *extra) -> dict:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            run([sys.executable, "-m", "pocketllm.cli.main", "bench", kind, path, "--max-model-len", "1024",
                 "--exact-kernels", str(exact).lower(), "--warmup", "1", "--output-json", f.name, *extra])
            return json.loads(Path(f.name).read_text())

    short = bench("latency", "--input-len", "128", "--output-len", "64", "--num-iters", reps)
    r = short["results"][0]
    step_ms = 1e3 / r["decode_tok_s"]
    out = {"tg": r["decode_tok_s"], "pp128": r["prefill_tok_s"], "weight_bytes": short["weight_bytes"],
           "step_overhead_share": r["overhead_ms_p50_at_max"] / step_ms}
    if "pp512" in figures:
        long = bench("latency", "--input-len", "512", "--output-len", "2", "--num-iters", reps)
        out["pp512"] = long["results"][0]["prefill_tok_s"]
    if "batch8" in figures:
        batch = bench("throughput", "--input-len", "128", "--output-len", "128", "--num-prompts", "8",
                      "--max-concurrency", "8")
        out["batch8"] = batch["results"][0]["decode_tok_s"]
    return {k: v for k, v in out.items() if k in figures or k in ("weight_bytes", "step_overhead_share")}


def markdown(report: dict) -> str:
    lines = ["# PocketLLM vs llama.cpp on the CPU, same files, back to back",
             "",
             f"{report['machine']['cpu']}, {report['threads']} threads, commit {report['commit']}"
             f"{' (dirty)' if report['dirty'] else ''}, {report['date']}. llama.cpp built from ../shared/peers "
             f"({report.get('isa', 'AVX-512')}). tok/s; ratio = PocketLLM / llama.cpp; goal in brackets.",
             f"Command: `{report['command']}`", ""]
    for path_name in report["paths"]:
        figures = report.get("figures", FIGURES)
        titles = {"tg": "decode, 1 stream", "pp128": "prefill 128", "pp512": "prefill 512", "batch8": "8 sequences"}
        heads = " | ".join(f"{titles[k]} [>={GOALS[k]}x]" for k in figures)
        lines += [f"## PocketLLM {path_name} path", "", "| file | " + heads + " | weights / file |",
                  "|---|" + "---|" * (len(figures) + 1)]
        for row in report["files"]:
            ours, peer = row[path_name], row["llama.cpp"]
            cells = []
            for key in figures:
                ratio = ours[key] / peer[key]
                mark = "" if ratio >= GOALS[key] else " (miss)"
                cells.append(f"{ours[key]:.1f} vs {peer[key]:.1f} ({ratio:.2f}x){mark}")
            lines.append(f"| {row['name']} | " + " | ".join(cells) +
                         f" | {ours['weight_bytes'] / row['tensor_bytes']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+", default=DEFAULT_TYPES)
    ap.add_argument("--paths", nargs="+", default=["fast"], choices=["fast", "exact"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--shape", default=SHAPE, help="the random-weight files' shape (pocketllm dummy-gguf --shape)")
    ap.add_argument("--figures", default=",".join(FIGURES), help=f"which of {','.join(FIGURES)} to measure")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "pocketllm-cpu-bench")
    ap.add_argument("--out", type=Path, default=RESULTS / "cpu-vs-llamacpp.json")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    bins = llamacpp_bin(args.threads)
    figures = tuple(f for f in FIGURES if f in args.figures.split(","))
    report = {**environment(), "threads": args.threads, "isa": cpu_isa(),
              "paths": args.paths, "figures": figures, "files": []}
    for qtype in args.types:
        path = model_file(qtype, args.workdir, bins, args.shape)
        name = "SmolLM2-135M-Instruct Q4_1 (real)" if qtype == "Q4_1" else f"{args.shape} {qtype} (random weights)"
        row = {"name": name, "type": qtype, "file": str(path), "tensor_bytes": tensor_bytes(path)}
        t0 = time.perf_counter()
        row["llama.cpp"] = llamacpp(path, args.threads, args.reps, figures)
        for p in args.paths:  # right after llama.cpp on the same file
            row[p] = pocketllm(path, p == "exact", args.reps, figures)
        print(json.dumps(row), f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        report["files"].append(row)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(report) + "\n")
    print(markdown(report))


if __name__ == "__main__":
    main()
