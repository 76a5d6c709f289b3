#!/usr/bin/env bash
# The int8 KV cache against the float32 one on the CPU (2 threads): the default model, one sequence with a
# 4,000-token prompt and 128 generated tokens, the two runs back to back; one JSON of both.
#   bash benchmarks/suites/cpu_kv_cache.sh > benchmarks/results/cpu-kv-cache-speed.json
set -eu
model=${MODEL:-$(dirname "$0")/../../../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf}
tmp=$(mktemp -d)
for kv in auto int8; do
    python -m pocketllm.cli.main bench latency "$model" --kv-cache-dtype $kv --input-len 4000 --output-len 128 \
        --max-model-len 4200 --num-iters 3 --num-threads 2 --output-json "$tmp/$kv.json" >&2
done
python - "$tmp" <<'PY'
import json, sys
runs = {kv: json.load(open(f"{sys.argv[1]}/{kv}.json")) for kv in ("auto", "int8")}
row = {kv: r["results"][0] for kv, r in runs.items()}
print(json.dumps({"command": "bash benchmarks/suites/cpu_kv_cache.sh", "runs": runs,
                  "int8_over_float": {k: row["int8"][k] / row["auto"][k] for k in ("decode_tok_s", "prefill_tok_s")},
                  "goal": {"decode_tok_s": "int8 >= 1.15x float at 4k context (issue 44)"}}, indent=1))
PY
rm -rf "$tmp"
