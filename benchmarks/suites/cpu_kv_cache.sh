#!/usr/bin/env bash
# The int8 KV cache against the float32 one on the CPU (2 threads): the default model, one sequence with a
# 4,000-token prompt and 128 generated tokens; the two alternated for ROUNDS rounds (default 3: this 2-core
# VM's speed wanders from minute to minute), medians compared; one JSON of every run.
#   bash benchmarks/suites/cpu_kv_cache.sh > benchmarks/results/cpu-kv-cache-speed.json
set -eu
model=${MODEL:-$(dirname "$0")/../../../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf}
tmp=$(mktemp -d)
for round in $(seq "${ROUNDS:-3}"); do
    for kv in auto int8; do
        python -m pocketllm.cli.main bench latency "$model" --kv-cache-dtype $kv --input-len 4000 --output-len 128 \
            --max-model-len 4200 --num-iters 1 --warmup 0 --num-threads 2 --output-json "$tmp/$kv-$round.json" >&2
    done
done
python - "$tmp" <<'PY'
import glob, json, statistics, sys
runs = {kv: [json.load(open(f)) for f in sorted(glob.glob(f"{sys.argv[1]}/{kv}-*.json"))] for kv in ("auto", "int8")}
median = {kv: {k: statistics.median(r["results"][0][k] for r in rs) for k in ("decode_tok_s", "prefill_tok_s")}
          for kv, rs in runs.items()}
print(json.dumps({"command": "bash benchmarks/suites/cpu_kv_cache.sh", "medians": median,
                  "int8_over_float": {k: median["int8"][k] / median["auto"][k] for k in median["auto"]},
                  "goal": {"decode_tok_s": "int8 >= 1.15x float at 4k context (issue 44)"}, "runs": runs}, indent=1))
PY
rm -rf "$tmp"
