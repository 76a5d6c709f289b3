#!/bin/bash
# Test files each in their own pytest process, in LANES lanes side by side, each file under a time limit, with
# Python's fault handler on: a crash or a hang in one file leaves the others' results, and every file's log and
# failure list (OUT/<file>.log, one line each in OUT/summary.txt) comes back even when the call runs out of time.
# usage: OUT=dir [LANES=3] [LIMIT=100] [PYTEST_ARGS="--deselect ..."] bash benchmarks/tools/test_files_apart.sh \
#   tests/test_a.py tests/test_b.py ...
set -u
lanes=${LANES:-3}; limit=${LIMIT:-100}
mkdir -p "$OUT"
(lscpu; gcc --version; nproc; nvidia-smi -L) > "$OUT/host.txt" 2>&1
lane() {
  for f in "$@"; do
    n=$(basename "$f" .py)
    timeout "$limit" python3 -X faulthandler -m pytest -q -p no:cacheprovider -rfE ${PYTEST_ARGS:-} "$f" > "$OUT/$n.log" 2>&1
    echo "$n rc=$? $(tail -1 "$OUT/$n.log")" >> "$OUT/summary.txt"
  done
}
files=("$@")
for ((i = 0; i < lanes; i++)); do
  mine=()
  for ((j = i; j < ${#files[@]}; j += lanes)); do mine+=("${files[j]}"); done
  [ ${#mine[@]} -gt 0 ] && lane "${mine[@]}" &
done
wait
cat "$OUT/summary.txt"
