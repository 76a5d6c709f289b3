#!/usr/bin/env bash
# Two trees' servers on the default model, alternated for ROUNDS rounds (default 3): `pocketllm bench serve`
# at 8 concurrent streams (32 requests of 128 prompt + 64 generated tokens). A change that should cost the
# chat path nothing (new routes, a refactored stream) is checked this way.
#   bash benchmarks/suites/cpu_serve_ab.sh BEFORE_DIR AFTER_DIR > summary.json   (each a checkout of PocketLLM)
set -uo pipefail
BEFORE=$(realpath "$1") AFTER=$(realpath "$2")
PORT=${PORT:-8311}
tmp=$(mktemp -d)
for round in $(seq "${ROUNDS:-3}"); do
    for tree in "$BEFORE" "$AFTER"; do
        tag=$([ "$tree" = "$BEFORE" ] && echo before || echo after)
        (cd "$tree" && PYTHONPATH=$tree exec python -m pocketllm.cli.main serve --port $PORT > "$tmp/$tag-$round.log" 2>&1) &
        server=$!
        until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 0.5; done
        (cd "$AFTER" && python -m pocketllm.cli.main bench serve --base-url "http://127.0.0.1:$PORT" --concurrency 8 \
            --num-prompts 32 --input-len 128 --output-len 64 --seed 0 --output-json "$tmp/$tag-$round.json" > /dev/null 2>&1)
        kill -INT $server; wait $server
    done
done
python - "$tmp" "$(git -C "$BEFORE" rev-parse --short HEAD)" "$(git -C "$AFTER" rev-parse --short HEAD)" <<'PY'
import glob, json, statistics, sys
runs = {tag: [json.load(open(f)) for f in sorted(glob.glob(f"{sys.argv[1]}/{tag}-*.json"))] for tag in ("before", "after")}
keys = ("output_tok_s", "ttft_p50_ms", "itl_p50_ms")
rows = {tag: [{k: r["results"][0].get(k) for k in keys} for r in rs] for tag, rs in runs.items()}
median = {tag: {k: statistics.median(x[k] for x in rs) for k in keys} for tag, rs in rows.items()}
print(json.dumps({"command": "bash benchmarks/suites/cpu_serve_ab.sh BEFORE AFTER",
                  "trees": {"before": sys.argv[2], "after": sys.argv[3]}, "machine": runs["after"][0]["machine"],
                  "medians": median, "after_over_before": {k: median["after"][k] / median["before"][k] for k in keys},
                  "runs": rows}, indent=1))
PY
rm -rf "$tmp"
