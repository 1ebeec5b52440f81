#!/usr/bin/env bash
# Session 5, a second sample of llama.md's tp = 2 llama-1b row (nvidia-h200-x2, carry .gpu with
# bench, and .peers): the torch.compile peer gave 64.4k tokens/s in s5-final.sh's call, against
# 83.0k-102.7k in earlier sessions' calls, so ours and the peer once more, in one call.
set -u
cd "$(dirname "$0")/../../.."
timeout -s KILL 70 bash .gpu/run.sh bench --preset llama-1b --tp 2 --sp --steps 10 --warmup 2 > "$OUT/bench-1b-tp2-again.log" 2>&1
(cd .peers && TP=2 PEER_TIMEOUT=100 timeout -s KILL 105 bash run_peers.sh llama-1b tp-torch > "$OUT/peers-1b-tp2-again.log" 2>&1)
grep -h 'RESULT\|panicked' "$OUT/bench-1b-tp2-again.log" "$OUT/peers-1b-tp2-again.log" | cut -c1-320
