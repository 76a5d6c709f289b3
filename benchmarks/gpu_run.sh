#!/usr/bin/env bash
# One device call: the CUDA correctness suite, then bf16 engine benchmarks on random weights of
# Llama-3.1-8B's shape. Results land in $OUT (or benchmarks/results/ when run by hand).
set -uo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
$PY -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_parity.py tests/test_engine.py \
    tests/test_sampling.py tests/test_kv_cache.py 2>&1 | tee "$OUT/gpu-tests.log"
bench() { timeout "${BENCH_TIMEOUT:-240}" $PY -m pocketllm.cli.main bench "$@" 2>&1 | tail -n 6; }
bench latency llama3-8b --load-format dummy --dtype bfloat16 --max-model-len 1024 \
    --input-len 512 --output-len 128 --batch-size 1 --num-iters 1 --output-json "$OUT/h200-bf16-latency.json"
bench throughput llama3-8b --load-format dummy --dtype bfloat16 --max-model-len 1024 --max-num-seqs 64 \
    --input-len 512 --output-len 128 --num-prompts 64 --max-concurrency 16,64 --warmup 0 \
    --output-json "$OUT/h200-bf16-throughput.json"
