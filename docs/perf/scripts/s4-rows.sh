#!/usr/bin/env bash
# Session 4 (nvidia-h200-x2, carry .gpu with bench, and .peers): every row of llama.md beside its
# peer in this one call. First the tp = 2 rows (NCCL ordered on the GPU): llama-1b and llama-8b
# with tensor and sequence parallelism, memory sampled by nvidia-smi, then PyTorch's tp = 2 +
# torch.compile peer for each. Then the one-GPU row: ours on GPU 0 while the eager and compile
# peers run on GPU 1. Every step has a hard limit, so the call ends inside the device's.
set -u
cd "$(dirname "$0")/../../.."
sample() { nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/mem-$1.csv" & }
peak() { awk -F', ' '{if ($2 > m[$1]) m[$1] = $2} END {for (g in m) printf "gpu%s=%s ", g, m[g]}' "$OUT/mem-$1.csv"; }
run() {  # NAME LIMIT ARGS...: one bench run with its memory sampled
  local name=$1 limit=$2; shift 2
  sample "$name"; local smi=$!
  timeout -s KILL "$limit" bash .gpu/run.sh bench "$@" > "$OUT/bench-$name.log" 2>&1
  kill $smi
  grep -h 'RESULT\|PROFILE\|panicked' "$OUT/bench-$name.log" | cut -c1-320
  echo "$name peak MiB per GPU: $(peak "$name")"
}
run 1b-tp2 70 --preset llama-1b --tp 2 --sp --steps 10 --warmup 2
run 8b-tp2 80 --preset llama-8b --tp 2 --sp --steps 5 --warmup 2
(cd .peers && TP=2 PEER_TIMEOUT=100 timeout -s KILL 105 bash run_peers.sh llama-1b tp-torch > "$OUT/peers-1b-tp2.log" 2>&1)
(cd .peers && TP=2 PEER_TIMEOUT=125 timeout -s KILL 130 bash run_peers.sh llama-8b tp-torch > "$OUT/peers-8b-tp2.log" 2>&1)
grep -h 'RESULT' "$OUT/peers-1b-tp2.log" "$OUT/peers-8b-tp2.log" | cut -c1-320
(
  export CUDA_VISIBLE_DEVICES=0
  run 1b 90 --preset llama-1b --profile --steps 10 --warmup 3
) &
(cd .peers && CUDA_VISIBLE_DEVICES=1 PEER_TIMEOUT=140 timeout -s KILL 145 bash run_peers.sh llama-1b torch compile > "$OUT/peers-1b.log" 2>&1) &
wait
grep -h 'RESULT' "$OUT/peers-1b.log" | cut -c1-320
