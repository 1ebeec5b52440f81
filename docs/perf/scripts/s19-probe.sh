#!/usr/bin/env bash
# Session 19, call 4 (logs/s19/call4): moe_suite::moe_steps_match on the probe build s19.sh describes
# (carry .gpu with that gpu-suite), each rows op switched back to Burn's ops in turn.
set -u
for v in DEBUG_REF_GATHER DEBUG_REF_GATHER_BACK DEBUG_REF_COMBINE DEBUG_REF_COMBINE_BACK; do
  env $v=1 timeout -s KILL 50 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter "moe_suite::moe_steps_match" > "$OUT/probe-$v.log" 2>&1
  echo "$v: $(grep -h "FAILED\|ok (" "$OUT/probe-$v.log" | cut -c1-200)"
  grep -h "DEBUG tp 1 ep 2 AllToAll" "$OUT/probe-$v.log" | awk '{print $10 ":" $13}' | head -8 | tr '\n' ';'; echo
done
