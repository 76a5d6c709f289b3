#!/usr/bin/env bash
# Two trees on the same GGUF files in one device call, alternated run by run: `bench latency` at
# batch 1 and at 64 sequences (512 prompt + 128 generated tokens, bf16 activations), the measure of
# results/LATEST.md's GPU table. A change that should not move speed is checked this way.
#   benchmarks/suites/gpu_ab.sh BEFORE_DIR AFTER_DIR     (each a checkout of PocketLLM)
#   GGUF_FILES: shape:type pairs (default "llama3-8b:Q4_K_M llama3-8b:IQ2_XXS gpt-oss-20b:MXFP4_MOE");
#     shape@N: the shape's first N layers (`dummy-gguf --layers`), e.g. llama3-70b@32:IQ2_XXS on an 80 GB card
#   BATCHED_SHAPES: shapes whose files also run 64 sequences (default "llama3-8b")
#   GGUF_DIR: where the files are written once and kept (default /tmp); REPS: rounds (default 1)
#   STAGES: "write" writes the files only, "bench" measures only (default both)
# Results: $OUT/ab-<tree>-<shape>-<type>-b<batch>-<round>.json and $OUT/ab-summary.txt.
set -uo pipefail
BEFORE=$1 AFTER=$2
OUT=$(realpath -m "${OUT:-benchmarks/results}")  # absolute: each tree runs from its own folder
GGUF_FILES=${GGUF_FILES:-"llama3-8b:Q4_K_M llama3-8b:IQ2_XXS gpt-oss-20b:MXFP4_MOE"}
BATCHED_SHAPES=${BATCHED_SHAPES:-llama3-8b}
GGUF_DIR=${GGUF_DIR:-/tmp}
STAGES=${STAGES:-"write bench"}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$GGUF_DIR"
path_of() { echo "$GGUF_DIR/${1%%:*}-${1##*:}.gguf"; }

if [[ " $STAGES " == *" write "* ]]; then
    for f in $GGUF_FILES; do  # written in parallel: the CPU's cores, not the GPU
        shape=${f%%:*} depth=()
        [[ $shape == *@* ]] && depth=(--layers "${shape##*@}") && shape=${shape%%@*}
        [ -f "$(path_of "$f")" ] || (cd "$AFTER" && timeout 500 $PY -m pocketllm.cli.main dummy-gguf "$(path_of "$f")" \
            --shape "$shape" "${depth[@]}" --type "${f##*:}" -q 2>&1 | tail -n 1) &
    done
    wait
fi
if [[ " $STAGES " == *" bench "* ]]; then
    for round in $(seq 1 "${REPS:-1}"); do
        for f in $GGUF_FILES; do
            batches=1
            [[ " $BATCHED_SHAPES " == *" ${f%%:*} "* ]] && batches="1 64"
            for b in $batches; do
                # before, after in odd rounds; after, before in even ones
                trees="before after"; (( round % 2 == 0 )) && trees="after before"
                for tree in $trees; do
                    dir=$BEFORE; [ "$tree" = after ] && dir=$AFTER
                    tag=$(echo "${f%%:*}-${f##*:}" | tr 'A-Z' 'a-z')
                    (cd "$dir" && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 300 $PY -m pocketllm.cli.main bench latency \
                        "$(path_of "$f")" --dtype bfloat16 --max-model-len 1024 --input-len 512 --output-len 128 \
                        --batch-size "$b" --num-iters 2 --output-json "$OUT/ab-$tree-$tag-b$b-$round.json" 2>&1 | tail -n 2)
                done
            done
        done
    done
    $PY - "$OUT" <<'EOF' | tee "$OUT/ab-summary.txt"
import json, pathlib, re, sys
from collections import defaultdict
runs = defaultdict(lambda: defaultdict(list))
for p in sorted(pathlib.Path(sys.argv[1]).glob("ab-*.json")):
    tree, key = re.match(r"ab-(before|after)-(.+)-\d+\.json", p.name).groups()
    d = json.loads(p.read_text())
    runs[key][tree].append(d["results"][-1]["decode_tok_s"])
print(f"{'file, batch (decode tok/s, best run)':40} {'before':>12} {'after':>12} {'after/before':>13}")
for key, t in runs.items():
    b, a = max(t["before"] or [0]), max(t["after"] or [0])
    print(f"{key:40} {b:12.1f} {a:12.1f} {a / b if b else float('nan'):13.3f}")
EOF
fi
