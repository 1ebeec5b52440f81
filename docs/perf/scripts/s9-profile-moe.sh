timeout -s KILL 200 bash .gpu/run.sh gpu-suite --one-gpu --filter moe_suite > "$OUT/moe-suite.log" 2>&1
grep -h "FAILED\|passed\|ok (" "$OUT/moe-suite.log" | cut -c1-250
timeout -s KILL 300 ncu --clock-control none --target-processes all --metrics gpu__time_duration.sum -c 6000 bash .gpu/run.sh bench --preset moe-4b --steps 1 --warmup 0 > "$OUT/ncu.log" 2>&1
grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" "$OUT/ncu.log" | paste - - | awk '{name=$1; sub(/_[0-9a-f]{8}$/,"",name); t[name]+=$NF; c[name]++} END {for (n in t) printf "%10.1f us %5d  %s\n", t[n], c[n], n}' | sort -rn | head -45
grep -c gpu__time "$OUT/ncu.log"
