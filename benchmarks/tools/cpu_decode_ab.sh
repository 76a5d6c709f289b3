#!/bin/bash
# One-stream decode on 2 CPU threads: llama.cpp, a tree before and a tree after, alternated round by round on
# one GGUF file (each tree's package imported through PYTHONPATH), so that the VM's drift falls on all three.
# usage: FILE=model.gguf cpu_decode_ab.sh BEFORE_TREE AFTER_TREE OUTDIR [ROUNDS]
# (FILE defaults to the DeepSeek-V2-Lite Q4_K_M file cpu_vs_llamacpp.py writes; llama.cpp from
# build_llamacpp_cpu.sh in $LLAMACPP_DIR, default /tmp/llama.cpp)
set -u
F=${FILE:-/tmp/pocketllm-cpu-bench/deepseek-v2-lite-Q4_K_M.gguf}
BIN=${LLAMACPP_DIR:-/tmp/llama.cpp}/build/bin
B=$1; A=$2; O=$3; R=${4:-3}
mkdir -p "$O"
for i in $(seq 1 "$R"); do
  "$BIN"/llama-bench -m "$F" -p 128 -n 64 -fa 1 -ngl 0 -r 2 -o json -t 2 > "$O/llamacpp-$i.json" 2>/dev/null
  for t in "$B" "$A"; do
    n=$(basename "$t")
    (cd /tmp && PYTHONPATH=$t python -m pocketllm.cli.main bench latency "$F" --max-model-len 1024 --exact-kernels false \
      --warmup 1 --input-len 128 --output-len 64 --num-iters 2 --num-threads 2 --output-json "$O/$n-$i.json" > /dev/null 2>&1)
  done
  python - "$O" "$i" "$B" "$A" <<'PY'
import json, sys
from pathlib import Path
o, i, b, a = sys.argv[1:]
ll = [r for r in json.load(open(f"{o}/llamacpp-{i}.json")) if r["n_gen"] > 0][0]["avg_ts"]
row = [f"round {i}: llama.cpp {ll:.1f}"]
for t in (b, a):
    d = json.load(open(f"{o}/{Path(t).name}-{i}.json"))["results"][0]["decode_tok_s"]
    row.append(f"{Path(t).name} {d:.1f} ({d / ll:.2f}x)")
print("; ".join(row), flush=True)
PY
done
