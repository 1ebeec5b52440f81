#!/usr/bin/env bash
# Packs CUDA binaries built here (and any data file a run needs) into .gpu/ at the repository's
# root, xz-compressed, beside the runner scripts/gpu/run.sh, for the GPU machine to carry.
#
#   scripts/gpu/bundle.sh FILE...
#   e.g. cargo build --release --no-default-features --features cuda -p burn-megatron-examples \
#          --example bench --example train
#        scripts/gpu/bundle.sh target/release/examples/{bench,train} data/shakespeare.txt
#   then on the GPU machine, carrying .gpu:  bash .gpu/run.sh bench --preset llama-1b
#
# Binaries are stripped first. A binary with Burn's CUDA backend is ~130 MB stripped (LLVM is
# linked in) and ~28-33 MB after xz, so at most two fit the 64 MiB a call carries. XZ_LEVEL
# (default 1, fast) sets xz's preset: XZ_LEVEL=9e shrinks each binary ~18% more (~23 MB), at
# ~1.5 minutes a binary on two cores; unpacking is as fast either way. KEEP=1 adds to the
# bundle already in .gpu/ instead of starting a new one. .gpu/BUILD records the commit.
set -euo pipefail
[ $# -gt 0 ] || { sed -n '2,15p' "$0"; exit 2; }
root=$(git rev-parse --show-toplevel)
here=$(cd "$(dirname "$0")" && pwd)
out="$root/.gpu"
# The bundle is a build output: keep it out of git.
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"

[ "${KEEP:-0}" = 1 ] || rm -rf "$out"
mkdir -p "$out"
for file in "$@"; do
  name=$(basename "$file")
  strip -o "$out/$name" "$file" 2>/dev/null || cp "$file" "$out/$name"  # data files: as they are
  xz -f -"${XZ_LEVEL:-1}" -T2 "$out/$name"
done
cp "$here/run.sh" "$out/run.sh"
{
  changes=$(git -C "$root" diff --quiet HEAD || echo ' with uncommitted changes')
  echo "commit $(git -C "$root" rev-parse --short HEAD)$changes"
  echo "bundled $(date -u +%Y-%m-%dT%H:%MZ): $*"
} >>"$out/BUILD"
du -sh "$out"
ls -la "$out"
