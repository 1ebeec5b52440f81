#!/usr/bin/env bash
# Session 3 (nvidia-h200-x2, carry .gpu with bench, and .peers): the tp = 2 rows, each beside its
# peer in this call, one after the other on both GPUs: llama-1b and llama-8b with tensor and
# sequence parallelism (memory sampled by nvidia-smi), then PyTorch's tp = 2 + torch.compile peer
# for each preset.
set -u
cd "$(dirname "$0")/../../.."
bash .gpu/run.sh bench --unpack-only >/dev/null 2>&1
run() {  # NAME TIMEOUT ARGS...: one bench run with its memory sampled
  local name=$1 limit=$2; shift 2
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/mem-$name.csv" &
  local smi=$!
  timeout "$limit" bash .gpu/run.sh bench "$@" > "$OUT/bench-$name.log" 2>&1
  kill $smi
  grep -h 'RESULT\|PROFILE\|panicked' "$OUT/bench-$name.log" | cut -c1-320
  echo "$name peak MiB per GPU: $(awk -F', ' '{if ($2 > m[$1]) m[$1] = $2} END {for (g in m) printf "gpu%s=%s ", g, m[g]}' "$OUT/mem-$name.csv")"
}
run 1b-tp2 100 --preset llama-1b --tp 2 --sp --steps 5 --warmup 2
run 8b-tp2 150 --preset llama-8b --tp 2 --sp --steps 3 --warmup 2
cd .peers
TP=2 PEER_TIMEOUT=180 bash run_peers.sh llama-1b tp-torch > "$OUT/peers-1b.log" 2>&1
TP=2 PEER_TIMEOUT=240 bash run_peers.sh llama-8b tp-torch > "$OUT/peers-8b.log" 2>&1
grep -h 'RESULT' "$OUT/peers-1b.log" "$OUT/peers-8b.log" | cut -c1-320
tail -n 4 "$OUT/peers-8b.log" | cut -c1-300
