#!/usr/bin/env bash
# LoRA adapters on the GPU (the LoRA issue's figures): the Llama-3-8B shape as bf16 (`--load-format dummy`)
# and as a Q4_K_M file (`pocketllm dummy-gguf`), 8 adapters of rank 16 on every projection; 64 requests
# spread over them and one stream, each beside the base model alone in the same process.
#   OUT=dir benchmarks/suites/gpu_lora.sh      (results: $OUT/lora-<base>.json, the test log)
set -uo pipefail
OUT=${OUT:-benchmarks/results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
Q4=${GGUF_DIR:-/tmp}/llama3-8b-Q4_K_M.gguf
[ -f "$Q4" ] || $PY -m pocketllm.cli.main dummy-gguf "$Q4" --shape llama3-8b --type Q4_K_M -q &
$PY -m pytest -q tests/test_lora.py -k cuda -p no:cacheprovider 2>&1 | tail -n 5 | tee "$OUT/lora-tests.log"
$PY benchmarks/suites/lora.py --model llama3-8b --load-format dummy --device cuda --dtype bfloat16 \
    --adapters 8 --requests 64 1 --reps 2 --out "$OUT/lora-bf16.json" 2>&1 | grep requests
wait
$PY benchmarks/suites/lora.py --model "$Q4" --device cuda --dtype bfloat16 \
    --adapters 8 --requests 64 1 --reps 2 --out "$OUT/lora-q4_k_m.json" 2>&1 | grep requests
