#!/usr/bin/env bash
# DeepSeek-V2-Lite's shape (16B, 2.4B active; random Q4_K_M weights) on one GPU beside llama.cpp on the same
# file, in one lease (the DeepSeek issue's goals: batch-1 decode >= 1.2x llama.cpp, 64 sequences of 512 + 128
# >= 1.5x), then the tiny DeepSeek configs' CUDA tests; with STAGES containing "mtp", the next-token-prediction
# draft's one-stream speedup with always-right drafts (the issue's >= 1.8x) on a DeepSeek-V3 stand-in: V3's
# layer shapes and depth (61 layers and the MTP layer, FP8 projections, random weights), 8 routed experts a
# layer instead of 256 (a token reads 8 either way, so a decode step reads what V3's does); two engines of
# about 57 GiB each (the memory plan's figure): an H200.
#   OUT=dir bash benchmarks/suites/gpu_deepseek.sh
#   GGUF_DIR (default /tmp/gg), LLAMACPP_DIR (default /tmp/llama.cpp, built from .peer/llamacpp.sh),
#   STAGES (default "v2-lite": the file against llama.cpp, then the tests; "mtp": the above)
set -uo pipefail
OUT=$(realpath -m "${OUT:-benchmarks/results}")
GGUF_DIR=$(realpath -m "${GGUF_DIR:-/tmp/gg}")
export LLAMACPP_DIR=$(realpath -m "${LLAMACPP_DIR:-/tmp/llama.cpp}")
FILE=$GGUF_DIR/deepseek-v2-lite-Q4_K_M.gguf
PY=${PYTHON:-python3}
STAGES=${STAGES:-v2-lite}
mkdir -p "$OUT" "$GGUF_DIR"
if [[ " $STAGES " == *" mtp "* ]]; then
    $PY - "$GGUF_DIR/v3-mtp" <<'EOF'
import json, pathlib, sys
from pocketllm.core.shapes import SHAPES
out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
cfg = dict(SHAPES["deepseek-v3"], n_routed_experts=8, n_group=1, topk_group=1, num_nextn_predict_layers=1,
           model_type="deepseek_v3", quantization_config=SHAPES["llama3-8b-fp8"]["quantization_config"])
(out / "config.json").write_text(json.dumps(cfg))
EOF
    timeout 540 $PY benchmarks/suites/spec_decode.py --model "$GGUF_DIR/v3-mtp" --load-format dummy --device cuda \
        --dtype bfloat16 --workloads chat --concurrency 1 --max-tokens 128 --oracle --num-kv-blocks 2048 \
        --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}' --out "$OUT/mtp-v3.json" 2>&1 | tail -n 6
fi
[[ " $STAGES " == *" v2-lite "* ]] || exit 0
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
