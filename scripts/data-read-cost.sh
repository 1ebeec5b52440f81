#!/usr/bin/env bash
# What reading a 1 GB tokenized dataset costs a training step on the CPU preset: writes 500M
# random uint16 tokens (a million documents of 500) in Megatron's indexed format under DIR
# (default /tmp/data-read-cost; Python with numpy), then alternates ROUNDS (4) runs of 60 steps
# on the generated arithmetic and on the dataset, printing each pair's tokens/s.
set -euo pipefail
dir=${1:-/tmp/data-read-cost}
train=${TRAIN:-target/release/examples/train}
mkdir -p "$dir"
[ -f "$dir/data.idx" ] || python3 - "$dir" <<'PY'
import struct, sys
import numpy
out, docs, per = sys.argv[1], 1_000_000, 500
numpy.random.default_rng(0).integers(1, 255, size=docs * per, dtype=numpy.uint16).tofile(f"{out}/data.bin")
with open(f"{out}/data.idx", "wb") as f:
    f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, docs, docs + 1))
    f.write(numpy.full(docs, per, dtype=numpy.int32).tobytes())
    f.write((numpy.arange(docs, dtype=numpy.int64) * per * 2).tobytes())
    f.write(numpy.arange(docs + 1, dtype=numpy.int64).tobytes())
PY
for round in $(seq "${ROUNDS:-4}"); do
  a=$("$train" --plain --steps 60 --sample-every 0 | sed -n 's/.*steps in .*: //p')
  b=$("$train" --plain --steps 60 --sample-every 0 --data.prefixes "[\"$dir/data\"]" | sed -n 's/.*steps in .*: //p')
  echo "round $round: arithmetic $a, 1 GB dataset $b"
done
