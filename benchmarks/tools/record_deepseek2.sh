#!/usr/bin/env bash
# llama.cpp's greedy continuations for the seeded deepseek2 files of tests/deepseek2_file.py: the reference that
# tests/test_deepseek.py compares PocketLLM's reading of llama.cpp's DeepSeek format with. Builds llama-simple
# (CPU) from ../shared/peers when LLAMACPP_DIR has none, writes the files, runs each prompt, and writes
# tests/data/deepseek2_llamacpp.json (each continuation as the bytes llama-simple printed, in hex).
#   bash benchmarks/tools/record_deepseek2.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${LLAMACPP_DIR:-/tmp/lcb/llama.cpp}
bash benchmarks/tools/build_llamacpp_cpu.sh "$DIR" llama-simple
work=$(mktemp -d)
python3 - "$work" "$DIR" <<'PY'
import hashlib, json, subprocess, sys
from pathlib import Path
sys.path.insert(0, "tests")
from deepseek2_file import FILES, NEW_TOKENS, PROMPTS, write_deepseek2

work, lcpp = Path(sys.argv[1]), Path(sys.argv[2])
simple = str(lcpp / "build/bin/llama-simple")
record = {"what": "llama.cpp llama-simple greedy continuations of tests/deepseek2_file.py's files (the bytes printed "
                  "after the prompt, hex)", "command": "bash benchmarks/tools/record_deepseek2.sh", "files": {}}
for which in FILES:
    path = write_deepseek2(work / f"{which}.gguf", which)
    outs = {}
    for prompt in PROMPTS:
        out = subprocess.run([simple, "-m", str(path), "-n", str(NEW_TOKENS), prompt], capture_output=True,
                             check=True).stdout
        assert out.startswith(prompt.encode()) and out.endswith(b"\n"), out
        outs[prompt] = out[len(prompt):-1].hex()
    record["files"][which] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "continuations": outs}
tgz = Path("../shared/peers/llamacpp-src.tgz")
record["llama_cpp"] = ("llama-simple (CPU) built from ../shared/peers/llamacpp-src.tgz, sha256 "
                       + (hashlib.sha256(tgz.read_bytes()).hexdigest() if tgz.is_file() else "unknown"))
Path("tests/data/deepseek2_llamacpp.json").write_text(json.dumps(record, indent=1) + "\n")
print(json.dumps(record, indent=1))
PY
