#!/usr/bin/env bash
# DeepSeek-V2-Lite's shape (16B, 2.4B active; random Q4_K_M weights) on one GPU beside llama.cpp on the same
# file, in one lease (the DeepSeek issue's goals: batch-1 decode >= 1.2x llama.cpp, 64 sequences of 512 + 128
# >= 1.5x), then the tiny DeepSeek configs' CUDA tests.
#   OUT=dir bash benchmarks/suites/gpu_deepseek.sh
#   GGUF_DIR (default /tmp/gg), LLAMACPP_DIR (default /tmp/llama.cpp, built from .peer/llamacpp.sh)
set -uo pipefail
OUT=$(realpath -m "${OUT:-benchmarks/results}")
GGUF_DIR=$(realpath -m "${GGUF_DIR:-/tmp/gg}")
export LLAMACPP_DIR=$(realpath -m "${LLAMACPP_DIR:-/tmp/llama.cpp}")
FILE=$GGUF_DIR/deepseek-v2-lite-Q4_K_M.gguf
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$GGUF_DIR"
[ -x "$LLAMACPP_DIR/build/bin/llama-bench" ] || { bash .peer/llamacpp.sh build cuda > "$OUT/llamacpp-build.log" 2>&1 & }
[ -f "$FILE" ] || $PY -m pocketllm.cli.main dummy-gguf "$FILE" --shape deepseek-v2-lite --type Q4_K_M -q | tail -n 1
timeout 300 $PY -m pocketllm.cli.main bench latency "$FILE" --dtype bfloat16 --max-model-len 1024 --input-len 512 \
    --output-len 128 --batch-size 1 --num-iters 2 --output-json "$OUT/pocketllm-v2-lite-b1.json" 2>&1 | tail -n 2
timeout 300 $PY -m pocketllm.cli.main bench throughput "$FILE" --dtype bfloat16 --max-model-len 1024 \
    --max-num-seqs 64 --input-len 512 --output-len 128 --num-prompts 64 --max-concurrency 64 --warmup 1 \
    --output-json "$OUT/pocketllm-v2-lite-b64.json" 2>&1 | tail -n 2
wait
$PY benchmarks/suites/llamacpp.py --output-json "$OUT/llamacpp-v2-lite.json" "$FILE" --batched 64 \
    --batched-files "$FILE" 2>&1 | tail -n 4
timeout 200 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_deepseek.py -k deepseek -rfE \
    > "$OUT/deepseek-tests.txt" 2>&1; tail -n 3 "$OUT/deepseek-tests.txt"
