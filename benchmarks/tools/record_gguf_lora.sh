#!/usr/bin/env bash
# llama.cpp's own GGUF form of a LoRA adapter, the reference tests/test_lora.py reads: the tiny Llama of
# tests/tiny_models.py and adapter "a" of tests/test_lora.py (seeded: rank 8 on every projection), converted
# by convert_lora_to_gguf.py from ../shared/peers' llama.cpp source, written to tests/data/lora_llama_a.gguf.
#   bash benchmarks/tools/record_gguf_lora.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
src=$(mktemp -d)
tar -xzf ../shared/peers/llamacpp-src.tgz -C "$src" --wildcards 'llama.cpp/convert_lora_to_gguf.py' \
    'llama.cpp/convert_hf_to_gguf.py' 'llama.cpp/conversion/*' 'llama.cpp/gguf-py/*'
work=$(mktemp -d)
python3 - "$work" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "tests")
from test_lora import ALL, make_adapter
from tiny_models import make_model

work = Path(sys.argv[1])
model, _ = make_model("llama", work)
make_adapter(model, work / "a", 1, 8, ALL)
PY
(cd "$src/llama.cpp" && PYTHONPATH=gguf-py:. python3 convert_lora_to_gguf.py --base "$work/llama" --outtype f32 \
    --outfile "$OLDPWD/tests/data/lora_llama_a.gguf" "$work/a")
echo "wrote tests/data/lora_llama_a.gguf ($(git -C "$src/llama.cpp" describe --always 2>/dev/null || echo 'llama.cpp source of ../shared/peers'))"
