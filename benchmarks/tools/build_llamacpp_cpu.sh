#!/usr/bin/env bash
# Build llama.cpp's CPU TARGETS from ../shared/peers/llamacpp-src.tgz into DIR, unless DIR/build/bin has them:
# the reference runs of the record_*.sh tools (AVX2 named, no native build: see ../shared/peers/llamacpp.sh).
#   bash benchmarks/tools/build_llamacpp_cpu.sh DIR TARGET [TARGET ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=$1; shift
missing=(); for t in "$@"; do [ -x "$DIR/build/bin/$t" ] || missing+=("$t"); done
[ ${#missing[@]} -eq 0 ] && exit 0
mkdir -p "$(dirname "$DIR")"
[ -d "$DIR" ] || tar -xzf ../shared/peers/llamacpp-src.tgz -C "$(dirname "$DIR")"
cmake -S "$DIR" -B "$DIR/build" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON > /dev/null
cmake --build "$DIR/build" -j"$(nproc)" --target "${missing[@]}" > /dev/null
