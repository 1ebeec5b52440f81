#!/usr/bin/env bash
# One H200 (carry .gpu with generate and gpu-suite): the decoding tests, then every kernel of
# eager decoding steps timed by ncu (llama-1b at batch 1 and 32, 4 new tokens after 128; each
# `generate --preset` run is a warm-up generation and the timed one), summed by kernel name.
set -u
cd "$(dirname "$0")/../../.."
timeout -s KILL 200 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter decod > "$OUT/suite-decode.log" 2>&1
timeout -s KILL 60 bash .gpu/run.sh gpu-suite --world 1 --filter graph_replay >> "$OUT/suite-decode.log" 2>&1
grep -h '^test\|passed' "$OUT/suite-decode.log" | cut -c1-400
for batch in 1 32; do
  timeout -s KILL 150 ncu --clock-control none --target-processes all --metrics gpu__time_duration.sum -c 8000 \
    bash .gpu/run.sh generate --preset llama-1b --device cuda --batch $batch --prompt-len 128 --max-new 4 --eager \
    > "$OUT/ncu-decode-$batch.log" 2>&1
  echo "== batch $batch: $(grep -c gpu__time "$OUT/ncu-decode-$batch.log") kernels"
  grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" "$OUT/ncu-decode-$batch.log" | paste - - \
    | awk '{name=$1; sub(/_[0-9a-f]{8}$/,"",name); t[name]+=$NF; c[name]++} END {for (n in t) printf "%10.1f us %5d  %s\n", t[n], c[n], n}' \
    | sort -rn | head -30
done
