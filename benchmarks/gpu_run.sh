#!/usr/bin/env bash
# One device call: the CUDA correctness suites (the Triton kernels for real, the CUDA paths against
# transformers), then the engine benchmarks on random weights of Llama-3.1-8B's shape: bf16 offline
# and through the HTTP server, GGUF Q4_K_M (a random-weight file written on the spot), a step
# profile, and transformers' eager baseline; last, the table h200.md. Results land in $OUT (or
# benchmarks/results/ when run by hand).
#   STAGES="tests bf16 serve gguf profile hf" (default: all)
#   DEADLINE=seconds: skip the stages that would start after it (a device call has a time limit)
#   PACK=1: leave one tarball (the device tool returns at most 8 files) plus h200.md in $OUT
#   SYNC=1: the bf16 stage also runs with --no-async-scheduling (h200-bf16-sync-*.json)
#   ENGINE_FLAGS: extra engine flags for the serve stage (its offline side and the server alike)
#   GGUF_KERNELS=0: the gguf stage skips the kernel table (GGUF_BENCH_ARGS: its arguments)
set -uo pipefail
DEST=${OUT:-benchmarks/results}
OUT=$DEST
[ "${PACK:-0}" = 1 ] && OUT=$DEST/res
STAGES=${STAGES:-"tests bf16 serve gguf profile hf"}
DEADLINE=${DEADLINE:-100000}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
PY=${PYTHON:-python3}
has() { [[ " $STAGES " == *" $1 "* ]] && (( SECONDS < DEADLINE - ${2:-60} )); }
bench() { timeout "${BENCH_TIMEOUT:-300}" $PY -m pocketllm.cli.main bench "$@" 2>&1 | tail -n 6; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
shape=(llama3-8b --load-format dummy --dtype bfloat16 --max-model-len 1024)
batch=(--max-num-seqs 64 --max-num-batched-tokens 8192 --input-len 512 --output-len 128)

if has tests; then
    # Two processes: a kernel fault poisons a CUDA context, and must not take the other suite with it.
    $PY -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_cuda.py tests/test_parity.py \
        tests/test_engine.py tests/test_sampling.py tests/test_kv_cache.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 4
    $PY -m pytest -q -p no:cacheprovider tests/test_triton_gguf.py tests/test_dummy_gguf.py \
        -k "not fits_sm90" 2>&1 | tee "$OUT/gpu-tests-gguf.log" | tail -n 4
fi
if has bf16; then
    bench latency "${shape[@]}" --input-len 512 --output-len 128 --batch-size 1 --num-iters 2 \
        --output-json "$OUT/h200-bf16-latency.json"
    bench throughput "${shape[@]}" "${batch[@]}" --num-prompts 64 --max-concurrency 16,64 --warmup 1 \
        --output-json "$OUT/h200-bf16-throughput.json"
    if [ "${SYNC:-0}" = 1 ]; then
        bench latency "${shape[@]}" --no-async-scheduling --input-len 512 --output-len 128 --batch-size 1 \
            --num-iters 2 --output-json "$OUT/h200-bf16-sync-latency.json"
        bench throughput "${shape[@]}" "${batch[@]}" --no-async-scheduling --num-prompts 64 --max-concurrency 16,64 \
            --warmup 1 --output-json "$OUT/h200-bf16-sync-throughput.json"
    fi
fi
if has serve 120; then
    # The same engine behind HTTP, and offline at the same concurrencies (1-8 on 16 prompts each, 64 on 64).
    engine=(${ENGINE_FLAGS:-})
    bench throughput "${shape[@]}" "${batch[@]}" "${engine[@]}" --num-prompts 16 --max-concurrency 1,2,4,8,64 --warmup 1 \
        --output-json "$OUT/h200-bf16-offline-for-serve.json"
    $PY -m pocketllm.cli.main serve "${shape[@]}" "${engine[@]}" --max-num-seqs 64 --max-num-batched-tokens 8192 \
        --port 8011 > /tmp/serve.log 2>&1 &
    server=$!
    for _ in $(seq 1 180); do curl -sf http://127.0.0.1:8011/health > /dev/null && break; sleep 1; done
    bench serve --base-url http://127.0.0.1:8011 --concurrency 1,2,4,8 --num-prompts 16 \
        --input-len 512 --output-len 128 --output-json "$OUT/h200-bf16-serve-1-8.json"
    bench serve --base-url http://127.0.0.1:8011 --concurrency 64 --num-prompts 64 \
        --input-len 512 --output-len 128 --output-json "$OUT/h200-bf16-serve-64.json"
    kill -TERM $server; wait $server
    tail -n 3 /tmp/serve.log
fi
if has gguf 120; then
    gguf=/tmp/llama3-8b-q4_k_m.gguf
    if [ "${GGUF_KERNELS:-1}" = 1 ]; then
        timeout 120 $PY benchmarks/bench_triton_gguf.py ${GGUF_BENCH_ARGS:-} 2>&1 \
            | tee "$OUT/h200-triton-gguf-kernels.txt" | tail -n 40
    fi
    if timeout 120 $PY -m pocketllm.cli.main dummy-gguf "$gguf" --shape llama3-8b --type Q4_K_M -q 2>&1 | tail -n 2; then
        stat -c %s "$gguf" > "$OUT/h200-q4km-file-size.txt"
        qshape=("$gguf" --dtype bfloat16 --max-model-len 1024)
        bench latency "${qshape[@]}" --input-len 512 --output-len 128 --batch-size 1 --num-iters 2 \
            --output-json "$OUT/h200-q4km-latency.json"
        bench throughput "${qshape[@]}" "${batch[@]}" --num-prompts 64 --max-concurrency 64 --warmup 1 \
            --output-json "$OUT/h200-q4km-throughput.json"
        if has profile; then
            timeout 120 $PY benchmarks/profile_gpu_step.py "$gguf" --batch 1,64 --steps 16 \
                --output-json "$OUT/h200-q4km-profile.json" 2>&1 | tail -n 30
        fi
    fi
fi
if has profile; then
    timeout 120 $PY benchmarks/profile_gpu_step.py llama3-8b --batch 1,64 --steps 16 \
        --output-json "$OUT/h200-bf16-profile.json" 2>&1 | tail -n 30
fi
if has hf; then
    timeout 300 $PY benchmarks/hf_baseline_gpu.py --output-json "$OUT/h200-transformers-baseline.json" 2>&1 | tail -n 3
fi
$PY benchmarks/gpu_table.py "$OUT" > /dev/null && echo "wrote $OUT/h200.md"
if [ "${PACK:-0}" = 1 ]; then
    cp "$OUT/h200.md" "$DEST/" 2>/dev/null
    tar -C "$OUT" -czf "$DEST/h200-results.tgz" . && rm -rf "$OUT"
fi
