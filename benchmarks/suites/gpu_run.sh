#!/usr/bin/env bash
# One device call: the CUDA correctness suites (the Triton kernels for real, the CUDA paths against
# transformers), then the engine benchmarks on random weights of Llama-3.1-8B's shape: bf16 offline
# and through the HTTP server, GGUF files (random weights, written on the spot) with llama.cpp
# measured on the same files, step profiles, and transformers' eager baseline; last, the table
# h200.md. Results land in $OUT (or benchmarks/results/ when run by hand).
#   STAGES="tests bf16 serve gguf peer spec profile hf" (default: all but prep)
#     prep: build llama.cpp (from PEERS) and write the GGUF files, nothing measured: a call of its
#           own, followed within the machine's warm period by one that measures (gguf peer ...)
#     gguf: PocketLLM on GGUF_FILES: batch 1, and 64 sequences for the files of BATCHED_SHAPES
#     peer: llama.cpp on the same files (built first when absent)
#   GGUF_FILES: shape:type pairs (default "llama3-8b:Q4_K_M llama3-8b:IQ2_XXS llama3-70b:IQ2_XXS")
#   BATCHED_SHAPES: shapes whose files also run 64 sequences (default "llama3-8b qwen3-30b-a3b gpt-oss-20b")
#   PEERS: a copy of ../shared/peers inside the checkout (default .peer; the device gets only the repo)
#   DEADLINE=seconds: skip the stages that would start after it (a device call has a time limit)
#   PACK=1: leave one tarball (the device tool returns at most 8 files) plus h200.md in $OUT
#   SYNC=1: the bf16 stage also runs with --no-async-scheduling (h200-bf16-sync-*.json)
#   ENGINE_FLAGS: extra engine flags for the serve stage (its offline side and the server alike)
#   GGUF_KERNELS=0: the gguf stage skips the kernel table (GGUF_BENCH_ARGS: its arguments)
set -uo pipefail
DEST=${OUT:-benchmarks/results}
OUT=$DEST
[ "${PACK:-0}" = 1 ] && OUT=$DEST/res
STAGES=${STAGES:-"tests bf16 serve gguf peer spec profile hf"}
GGUF_FILES=${GGUF_FILES:-"llama3-8b:Q4_K_M llama3-8b:IQ2_XXS llama3-70b:IQ2_XXS"}
PEERS=${PEERS:-.peer}
export LLAMACPP_DIR=${LLAMACPP_DIR:-/tmp/llama.cpp}
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
batched() { [[ " ${BATCHED_SHAPES:-llama3-8b qwen3-30b-a3b gpt-oss-20b} " == *" ${1%%:*} "* ]]; }
gguf_path() { echo "/tmp/${1%%:*}-${1##*:}.gguf"; }  # shape:type -> its file
gguf_tag() { local t=${1##*:}; echo "${1%%:*}-${t,,}"; }  # shape:type -> the results' name
write_gguf_files() {
    for f in $GGUF_FILES; do
        [ -f "$(gguf_path "$f")" ] || timeout 400 $PY -m pocketllm.cli.main dummy-gguf "$(gguf_path "$f")" \
            --shape "${f%%:*}" --type "${f##*:}" -q 2>&1 | tail -n 1
    done
}
build_peer() {
    [ -x "$LLAMACPP_DIR/build/bin/llama-batched-bench" ] || bash "$PEERS/llamacpp.sh" build cuda
}
if has prep; then
    build_peer > "$OUT/peer-build.log" 2>&1 &
    write_gguf_files
    wait
    tail -n 2 "$OUT/peer-build.log"
fi
if has gguf 120; then
    if [ "${GGUF_KERNELS:-1}" = 1 ]; then
        timeout 120 $PY benchmarks/kernels/bench_triton_gguf.py ${GGUF_BENCH_ARGS:-} 2>&1 \
            | tee "$OUT/h200-triton-gguf-kernels.txt" | tail -n 40
    fi
    write_gguf_files
    for f in $GGUF_FILES; do
        path=$(gguf_path "$f") tag=$(gguf_tag "$f")
        [ -f "$path" ] || continue
        qshape=("$path" --dtype bfloat16 --max-model-len 1024)
        bench latency "${qshape[@]}" --input-len 512 --output-len 128 --batch-size 1 --num-iters 2 \
            --output-json "$OUT/h200-gguf-$tag-latency.json"
        if batched "$f"; then
            bench throughput "${qshape[@]}" "${batch[@]}" --num-prompts 64 --max-concurrency 64 --warmup 1 \
                --output-json "$OUT/h200-gguf-$tag-throughput.json"
        fi
        if [ "${f%%:*}" = llama3-8b ]; then
            if has profile; then
                timeout 120 $PY benchmarks/tools/profile_gpu_step.py "$path" --batch 1,64 --steps 16 \
                    --output-json "$OUT/h200-gguf-$tag-profile.json" 2>&1 | tail -n 12
            fi
        fi
    done
fi
if has peer 120; then
    # The same files, llama.cpp (CUDA, sm_90a, flash attention, every layer on the GPU).
    if build_peer > "$OUT/peer-build.log" 2>&1; then
        write_gguf_files
        files=() batched=()
        for f in $GGUF_FILES; do
            files+=("$(gguf_path "$f")")
            batched "$f" && batched+=("$(gguf_path "$f")")
        done
        batched_list=$(IFS=,; echo "${batched[*]}")
        timeout 400 $PY benchmarks/suites/llamacpp.py "${files[@]}" --batched 64 --batched-files "$batched_list" \
            --output-json "$OUT/h200-llamacpp.json" 2>&1 | grep -v '^+'
    else
        tail -n 20 "$OUT/peer-build.log"
    fi
fi
if has spec 120; then
    # Speculative decoding, 8B shape in bf16: n-gram lookup with k = 4, and drafts that are always
    # right (--oracle); then which row counts cuBLAS computes alike.
    k4='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 3, "prompt_lookup_max": 6}'
    spec=(benchmarks/suites/spec_decode.py --model llama3-8b --load-format dummy --device cuda --dtype bfloat16 --oracle
          --max-tokens 128 --reps 1 --speculative-config "$k4")
    timeout "${SPEC_TIMEOUT:-300}" $PY "${spec[@]}" --concurrency "${SPEC_CONCURRENCY:-1,64}" \
        --out "$OUT/h200-spec-decode.json" 2>&1 | tail -n 24
    timeout 60 $PY benchmarks/kernels/cublas_row_invariance.py --out "$OUT/h200-cublas-row-invariance.json" 2>&1 | tail -n 6
fi
if has profile; then
    timeout 120 $PY benchmarks/tools/profile_gpu_step.py llama3-8b --batch 1,64 --steps 16 \
        --output-json "$OUT/h200-bf16-profile.json" 2>&1 | tail -n 30
fi
if has hf; then
    timeout 300 $PY benchmarks/suites/hf_baseline_gpu.py --output-json "$OUT/h200-transformers-baseline.json" 2>&1 | tail -n 3
fi
$PY benchmarks/tools/gpu_table.py "$OUT" > /dev/null && echo "wrote $OUT/h200.md"
if [ "${PACK:-0}" = 1 ]; then
    cp "$OUT/h200.md" "$DEST/" 2>/dev/null
    tar -C "$OUT" -czf "$DEST/h200-results.tgz" . && rm -rf "$OUT"
fi
