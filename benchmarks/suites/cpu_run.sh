#!/usr/bin/env bash
# The CPU benchmarks the issues cite, in one go, on a quiet machine. Results: benchmarks/results/cpu-*.json
set -euo pipefail
cd "$(dirname "$0")/../.."
R=benchmarks/results
GGUF=${GGUF:-$(python -c "from pocketllm.pull import pull_default_model; print(pull_default_model())")}
pl() { python -m pocketllm.cli.main "$@"; }

# Engine core: a ~135M-parameter Llama shape (random fp32 weights), 1 vs 8 concurrent requests,
# then the per-step overhead (step time minus forward time) at 64 running requests.
pl bench throughput smollm2-135m --load-format dummy --dtype float32 --max-model-len 2048 \
    --input-len 128 --output-len 128 --num-prompts 8 --max-concurrency 1,8 --output-json $R/cpu-llama135m-fp32-throughput.json
pl bench throughput smollm2-135m --load-format dummy --dtype float32 --max-model-len 2048 --max-num-seqs 64 \
    --input-len 128 --output-len 32 --num-prompts 64 --max-concurrency 64 --output-json $R/cpu-llama135m-fp32-overhead64.json

# GGUF: the default model, the shape llama.cpp's llama-batched-bench was measured at (128 in / 128 out).
pl bench throughput "$GGUF" --max-model-len 2048 --input-len 128 --output-len 128 --num-prompts 8 \
    --max-concurrency 1,8 --output-json $R/cpu-smollm2-q4_1-throughput.json
python benchmarks/suites/memory_cpu.py "$GGUF" --output-json $R/cpu-smollm2-q4_1-memory.json

# Server: the same model through HTTP at 1, 2, 4, 8 streams, against the offline engine at the same concurrency.
pl bench throughput "$GGUF" --max-model-len 2048 --input-len 128 --output-len 64 --num-prompts 8 \
    --max-concurrency 1,2,4,8 --output-json $R/cpu-offline-for-serve.json
port=8123
pl serve "$GGUF" --max-model-len 2048 --port $port > /tmp/pocketllm-serve.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null' EXIT
for _ in $(seq 120); do curl -sf localhost:$port/health > /dev/null && break; sleep 1; done
pl bench serve --base-url http://127.0.0.1:$port --max-concurrency 8 --num-prompts 8 --input-len 128 \
    --output-len 64 --output-json $R/cpu-serve.json
