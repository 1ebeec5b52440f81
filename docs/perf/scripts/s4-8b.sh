#!/usr/bin/env bash
# Session 4 (nvidia-h200-x2, carry .gpu with bench, and .peers): the llama-8b tp = 2 row again,
# after s4-rows.sh's run of ours was cut by its limit while it still initialized its parameters
# on one host thread (now threaded, init.rs): ours with memory sampled, then the peer.
set -u
cd "$(dirname "$0")/../../.."
nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/mem-8b-tp2.csv" &
smi=$!
start=$(date +%s)
timeout -s KILL 95 bash .gpu/run.sh bench --preset llama-8b --tp 2 --sp --steps 5 --warmup 2 > "$OUT/bench-8b-tp2.log" 2>&1
kill $smi
echo "ours: $(( $(date +%s) - start )) s"
grep -h 'RESULT\|panicked' "$OUT/bench-8b-tp2.log" | cut -c1-320
echo "8b-tp2 peak MiB per GPU: $(awk -F', ' '{if ($2 > m[$1]) m[$1] = $2} END {for (g in m) printf "gpu%s=%s ", g, m[g]}' "$OUT/mem-8b-tp2.csv")"
(cd .peers && TP=2 PEER_TIMEOUT=110 timeout -s KILL 115 bash run_peers.sh llama-8b tp-torch > "$OUT/peers-8b-tp2.log" 2>&1)
grep -h 'RESULT' "$OUT/peers-8b-tp2.log" .peers/*.jsonl 2>/dev/null | cut -c1-320 | head -3
