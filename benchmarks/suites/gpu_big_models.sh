#!/usr/bin/env bash
# Llama-3-70B-shaped GGUF files on one GPU (the big-models issue): peak GPU memory while loading, on
# this tree and on a tree before a change (BEFORE, optional), batch-1 decode, and llama.cpp on the
# same files in the same call.
#   benchmarks/suites/gpu_big_models.sh [BEFORE_DIR]
#   FILES: shape:type pairs (default "llama3-70b:IQ2_XXS"); GGUF_DIR (default /tmp/gg: /tmp is kept
#   between the calls of a warm lease, ignored folders of the checkout were not); LLAMACPP_DIR
#   (default /tmp/llama.cpp, built there from .peer/llamacpp.sh); PYTHONPATH must name the checkout
#   STAGES: any of "write build load bench peer" (default all); build runs in the background and is
#   waited for by "peer"
# Results in $OUT: load-<tree>-<file>.json, pocketllm-<file>-b1.json, llamacpp-big.json, logs.
set -uo pipefail
BEFORE=${1:-}
OUT=$(realpath -m "${OUT:-benchmarks/results}")
FILES=${FILES:-"llama3-70b:IQ2_XXS"}
GGUF_DIR=$(realpath -m "${GGUF_DIR:-/tmp/gg}")
export LLAMACPP_DIR=$(realpath -m "${LLAMACPP_DIR:-/tmp/llama.cpp}")
STAGES=${STAGES:-"write build load bench peer"}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$GGUF_DIR"
path_of() { echo "$GGUF_DIR/${1%%:*}-${1##*:}.gguf"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }
build_pid=

if has build && [ ! -x "$LLAMACPP_DIR/build/bin/llama-bench" ]; then
    bash .peer/llamacpp.sh build cuda > "$OUT/llamacpp-build.log" 2>&1 &
    build_pid=$!
fi
if has write; then
    for f in $FILES; do
        [ -f "$(path_of "$f")" ] || $PY -m pocketllm.cli.main dummy-gguf "$(path_of "$f")" --shape "${f%%:*}" \
            --type "${f##*:}" -q 2>&1 | tail -n 1 &
    done
    wait $(jobs -p | grep -v "^${build_pid:-none}$") 2>/dev/null
fi
for f in $FILES; do
    tag=$(basename "$(path_of "$f")" .gguf | tr 'A-Z' 'a-z')
    if has load; then
        $PY benchmarks/tools/load_peak.py "$(path_of "$f")" --output-json "$OUT/load-after-$tag.json" | tail -n 4
        [ -n "$BEFORE" ] && (cd "$BEFORE" && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 300 $PY \
            "$OLDPWD/benchmarks/tools/load_peak.py" "$(path_of "$f")" --output-json "$OUT/load-before-$tag.json" | tail -n 4)
    fi
    if has bench; then
        timeout 400 $PY -m pocketllm.cli.main bench latency "$(path_of "$f")" --dtype bfloat16 --max-model-len 1024 \
            --input-len 512 --output-len 128 --batch-size 1 --num-iters 3 --output-json "$OUT/pocketllm-$tag-b1.json" \
            2>&1 | tail -n 3
    fi
done
if has peer; then
    [ -n "$build_pid" ] && { wait "$build_pid"; tail -n 3 "$OUT/llamacpp-build.log"; }
    files=(); for f in $FILES; do files+=("$(path_of "$f")"); done
    $PY benchmarks/suites/llamacpp.py --output-json "$OUT/llamacpp-big.json" "${files[@]}" 2>&1 | tail -n 6
fi
