#!/usr/bin/env bash
# FP8 checkpoints on the GPU (the DeepSeek issue's FP8 figure): the Llama-3-8B shape as a block-scaled FP8
# release (`llama3-8b-fp8`, random FP8 values) against its bf16 shape, `--load-format dummy`, decode of one
# stream and of 64 (512 prompt + 128 generated tokens), alternated in one call; first the FP8 tests and the
# kernels against cuBLAS (benchmarks/kernels/bench_fp8.py with the GEMV's tile sweep).
#   OUT=dir benchmarks/suites/gpu_fp8.sh
#   (results: $OUT/fp8-<shape>-b<batch>.json, fp8-kernels.json and .log, fp8-tests.log)
set -uo pipefail
OUT=${OUT:-benchmarks/results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
$PY -m pytest -q tests/test_fp8.py tests/test_dispatch.py -k "cuda or fp8" -p no:cacheprovider 2>&1 | tail -n 5 | tee "$OUT/fp8-tests.log"
timeout 240 $PY benchmarks/kernels/bench_fp8.py --sweep --output-json "$OUT/fp8-kernels.json" > "$OUT/fp8-kernels.log" 2>&1
for b in 1 64; do
    for shape in llama3-8b llama3-8b-fp8; do
        $PY -m pocketllm.cli.main bench latency "$shape" --load-format dummy --dtype bfloat16 --max-model-len 1024 \
            --input-len 512 --output-len 128 --batch-size "$b" --num-iters 2 --output-json "$OUT/fp8-$shape-b$b.json" \
            2>&1 | grep -i -E "decode|error" | tail -n 2
    done
done
