#!/usr/bin/env bash
# llama.cpp's vectors for the seeded Nomic BERT file of tests/nomic_bert_file.py: the reference that
# tests/test_embeddings.py compares PocketLLM's nomic-bert runtime with (no Hugging Face class exists).
# Builds llama-embedding (CPU) from ../shared/peers when LLAMACPP_DIR has none, writes the file, embeds
# tests/nomic_bert_file.TEXTS (mean pooling, L2-normalized, as the file says) and writes
# tests/data/nomic_bert_llamacpp.json.
#   bash benchmarks/tools/record_nomic_bert.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${LLAMACPP_DIR:-/tmp/lcb/llama.cpp}
bash benchmarks/tools/build_llamacpp_cpu.sh "$DIR" llama-embedding
work=$(mktemp -d)
python3 - "$work" "$DIR" <<'PY'
import hashlib, json, subprocess, sys
from pathlib import Path
sys.path.insert(0, "tests")
from nomic_bert_file import TEXTS, write_nomic_bert
from test_embeddings import make_wordpiece_bert

work, lcpp = Path(sys.argv[1]), Path(sys.argv[2])
_, _, tokenizer_dir = make_wordpiece_bert(work)
path = write_nomic_bert(work / "nomic-bert.gguf", tokenizer_dir)
out = subprocess.run([str(lcpp / "build/bin/llama-embedding"), "-m", str(path), "-p", "\n".join(TEXTS),
                      "--pooling", "mean", "--embd-normalize", "2", "--embd-output-format", "json", "-t", "2",
                      "-c", "256", "-b", "256", "-ub", "256"], capture_output=True, text=True, check=True).stdout
data = json.loads(out[out.index("{"):])
version = subprocess.run([str(lcpp / "build/bin/llama-embedding"), "--version"], capture_output=True, text=True)
record = {"what": "llama.cpp llama-embedding vectors of tests/nomic_bert_file.py's file (mean pooling, L2-normalized)",
          "file_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
          "llama_cpp": (version.stdout + version.stderr).strip().splitlines()[0],
          "command": "bash benchmarks/tools/record_nomic_bert.sh",
          "texts": TEXTS, "embeddings": [d["embedding"] for d in sorted(data["data"], key=lambda d: d["index"])]}
Path("tests/data/nomic_bert_llamacpp.json").write_text(json.dumps(record, indent=1) + "\n")
print(record["file_sha256"], record["llama_cpp"], len(record["embeddings"]))
PY
rm -rf "$work"
