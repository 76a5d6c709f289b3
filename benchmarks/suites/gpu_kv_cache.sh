#!/usr/bin/env bash
# The 8-bit KV cache on one GPU, in one call: Llama-3-8B's shape (random bf16 weights)
# serving 64 sequences of 8k-token prompts with the bf16 cache and the fp8 one (the same GPU memory
# budget: the fp8 cache holds about twice the tokens, so more of the 64 run at once), then the GPU tests of
# the 8-bit cache, loading memory and offloaded experts.
#   bash benchmarks/suites/gpu_kv_cache.sh OUT_DIR
set -u
out=${1:?OUT_DIR}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$out/gpu.txt"
git rev-parse HEAD > "$out/commit.txt" 2>/dev/null || true
for kv in auto fp8; do
    timeout ${BENCH_TIMEOUT:-200} python3 -m pocketllm.cli.main bench throughput llama3-8b --load-format dummy --dtype bfloat16 \
        --kv-cache-dtype $kv --max-model-len 8256 --input-len 8000 --output-len 64 --num-prompts 64 \
        --max-concurrency 64 --max-num-seqs 64 --warmup 0 ${KV_BENCH_FLAGS:-} --output-json "$out/llama3-8b-kv-$kv.json" \
        > "$out/llama3-8b-kv-$kv.txt" 2>&1
done
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/test_kv_cache_dtype.py tests/test_load_memory.py \
    tests/test_expert_offload.py -k "triton or cuda" -rfE > "$out/tests.txt" 2>&1
tail -n 5 "$out"/*.txt
