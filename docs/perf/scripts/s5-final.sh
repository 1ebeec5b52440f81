#!/usr/bin/env bash
# Session 5, last call (nvidia-h200-x2, carry .gpu with bench and gpu-suite, and .peers): the
# whole GPU suite with ranks as threads on the TMA-store GEMM, then the tp = 2 rows of llama.md
# (llama-1b and llama-8b with SP, memory sampled by nvidia-smi) beside PyTorch's tp = 2 +
# torch.compile peer. The one-GPU row was measured beside its peers in s5-persistent.sh's call.
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
bash .gpu/run.sh gpu-suite --filter NONE >/dev/null 2>&1
timeout -s KILL 130 bash .gpu/run.sh gpu-suite --world 2 > "$OUT/suite-threads.log" 2>&1
grep -h "FAILED\|passed" "$OUT/suite-threads.log" | cut -c1-300
run 1b-tp2 70 --preset llama-1b --tp 2 --sp --steps 10 --warmup 2
run 8b-tp2 80 --preset llama-8b --tp 2 --sp --steps 5 --warmup 2
(cd .peers && TP=2 PEER_TIMEOUT=100 timeout -s KILL 105 bash run_peers.sh llama-1b tp-torch > "$OUT/peers-1b-tp2.log" 2>&1)
(cd .peers && TP=2 PEER_TIMEOUT=125 timeout -s KILL 130 bash run_peers.sh llama-8b tp-torch > "$OUT/peers-8b-tp2.log" 2>&1)
grep -h 'RESULT' "$OUT/peers-1b-tp2.log" "$OUT/peers-8b-tp2.log" | cut -c1-320
