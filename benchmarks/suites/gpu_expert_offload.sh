#!/usr/bin/env bash
# Qwen3-30B-A3B's shape (random Q4_K_M weights) with experts in host memory, PocketLLM against llama.cpp
# (--n-cpu-moe) on the same file in one call: all layers' experts on the CPU, and the first HALF layers'
# (what a ~10 GB card holds: the other half's experts stay resident); batch 1 (512 + 128 tokens) and 16
# sequences. Run after gpu_big_models.sh with FILES=qwen3-30b-a3b:Q4_K_M STAGES="write build peer" (the
# file and llama.cpp under /tmp, kept while the lease is warm).
#   OUT=dir bash benchmarks/suites/gpu_expert_offload.sh
set -uo pipefail
OUT=$(realpath -m "${OUT:-benchmarks/results}")
FILE=${FILE:-/tmp/gg/qwen3-30b-a3b-Q4_K_M.gguf}
BIN=${LLAMACPP_DIR:-/tmp/llama.cpp}/build/bin
LAYERS=${LAYERS:-48}
HALF=$(( LAYERS / 2 ))
PY=${PYTHON:-python3}
mkdir -p "$OUT"
for n in $LAYERS $HALF; do
    timeout 150 $PY -m pocketllm.cli.main bench latency "$FILE" --dtype bfloat16 --max-model-len 1024 \
        --cpu-offload-experts $n --input-len 512 --output-len 128 --batch-size 1 --num-iters 2 \
        --output-json "$OUT/pocketllm-offload$n-b1.json" 2>&1 | tail -n 2
    timeout 150 $PY -m pocketllm.cli.main bench throughput "$FILE" --dtype bfloat16 --max-model-len 1024 \
        --cpu-offload-experts $n --input-len 512 --output-len 128 --num-prompts 16 --max-concurrency 16 \
        --output-json "$OUT/pocketllm-offload$n-b16.json" 2>&1 | tail -n 2
    timeout 150 "$BIN/llama-bench" -m "$FILE" -p 512 -n 128 -fa 1 -ngl 99 -ncmoe $n -r 2 -o json \
        > "$OUT/llamacpp-ncmoe$n-b1.json" 2> "$OUT/llamacpp-ncmoe$n-b1.log"; tail -n 3 "$OUT/llamacpp-ncmoe$n-b1.log"
    timeout 150 "$BIN/llama-batched-bench" -m "$FILE" -c $(( 16 * 640 + 64 )) -b 2048 -ub 512 -npp 512 -ntg 128 \
        -npl 16 -fa on -ngl 99 --n-cpu-moe $n > "$OUT/llamacpp-ncmoe$n-b16.txt" 2>&1
    grep -E '^\|' "$OUT/llamacpp-ncmoe$n-b16.txt" | tail -n 1
done
