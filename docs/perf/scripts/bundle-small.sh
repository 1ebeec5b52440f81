#!/usr/bin/env bash
# ../shared/gpu/bundle.sh, then each binary recompressed with xz's strongest preset: a CUDA
# binary of this project shrinks from ~27.6 to ~22.7 MB (bench of 4b114de; 1.5 min a binary on
# this machine's two cores, unpacked on the device as fast), so gpu-suite, bench, the torchao
# wheel and .peers fit in one call's 64 MiB beside the tree.
#
# Usage: docs/perf/scripts/bundle-small.sh PATH_TO_BINARY...   (writes .gpu/, as bundle.sh does)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
"$root/../shared/gpu/bundle.sh" "$@" > /dev/null
for f in "$root"/.gpu/*.xz; do
  xz -dc "$f" | xz -9e -T2 > "$f.small"
  mv "$f.small" "$f"
done
du -sh "$root/.gpu"; ls -la "$root/.gpu"
