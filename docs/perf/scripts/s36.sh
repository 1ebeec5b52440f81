#!/usr/bin/env bash
# Session 36, one GPU (carry .gpu with bench and train, .peers):
#   clocks: why our bf16 step runs at a lower SM clock than PyTorch + compile's. nvidia-smi every
#           50 ms (SM clock, power, GPU and memory temperature, the active clock-event reasons)
#           over 40 timed llama-1b steps of each, alternating: compile, ours, compile, ours.
#           Per run: the busy samples' clock quartiles, mean and top power, top temperatures, and
#           how often each clock-event reason was active.
#   watch:  (s35.sh watch) bench and train past the device's memory stop on CubeCL's failures.
#   fused:  (carry .gpu with gpu-suite and bench) the backward as one kernel, dQ added by TMA
#           reductions: its kernel tests, flash attention alone, and 40 llama-1b steps.
#   ab:     (carry .gpu with bench0, the bench of 693a92f, and bench) the step before and after,
#           alternating, and PyTorch + compile.
# Logs go to $OUT.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-clocks}
fields=timestamp,clocks.sm,power.draw,temperature.gpu,temperature.memory,utilization.gpu,clocks_event_reasons.active
nvidia-smi --query-gpu=$fields --format=csv,noheader,nounits > /dev/null 2>&1 ||
  fields=${fields/clocks_event_reasons/clocks_throttle_reasons}
dense() { nvidia-smi --query-gpu=$fields --format=csv,noheader,nounits -lms 50 > "$OUT/clk-$1.csv" & }
report() {  # NAME: the busy samples (utilization >= 90%) of one run
  python3 - "$OUT/clk-$1.csv" "$1" <<'EOF'
import sys, collections
rows = [l.strip().split(", ") for l in open(sys.argv[1]) if l.count(",") >= 6]
busy = [r for r in rows if r[5].strip().isdigit() and int(r[5]) >= 90]
if not busy:
    sys.exit(print(f"{sys.argv[2]}: no busy samples of {len(rows)}"))
clock = sorted(int(r[1]) for r in busy)
power = [float(r[2]) for r in busy]
q = lambda p: clock[min(len(clock) - 1, int(p * len(clock)))]
names = {0x1: "idle", 0x2: "app-clocks", 0x4: "sw-power-cap", 0x8: "hw-slowdown", 0x10: "sync-boost",
         0x20: "sw-thermal", 0x40: "hw-thermal", 0x80: "hw-power-brake", 0x100: "display"}
reasons = collections.Counter()
for r in busy:
    bits = int(r[6], 16) if r[6].startswith("0x") else 0
    reasons.update(n for b, n in names.items() if bits & b) if bits else reasons.update(["none"])
share = ", ".join(f"{n} {100 * c / len(busy):.0f}%" for n, c in reasons.most_common())
print(f"{sys.argv[2]}: {len(busy)} busy samples; SM clock p10/p50/p90 {q(0.1)}/{q(0.5)}/{q(0.9)} MHz; "
      f"power mean {sum(power) / len(power):.0f} W, max {max(power):.0f} W; GPU temp max {max(int(r[3]) for r in busy)} C, "
      f"memory temp max {max(r[4] for r in busy)} C; reasons: {share}")
EOF
}
ours() {  # NAME: 40 llama-1b steps of $BENCH (default bench)
  dense "$1"; local smi=$!
  timeout -s KILL 120 bash .gpu/run.sh "${BENCH:-bench}" $bf16 --steps 40 > "$OUT/bench-$1.log" 2>&1
  kill $smi; grep -h 'RESULT\|panicked' "$OUT/bench-$1.log" | cut -c1-300; report "$1"
}
compiled() {  # NAME
  dense "$1"; local smi=$!
  (cd .peers && timeout -s KILL 200 python3 peer_torch.py --preset llama-1b --compile --steps 40) > "$OUT/peer-$1.log" 2>&1
  kill $smi; grep -h 'RESULT' "$OUT/peer-$1.log" | cut -c1-300; report "$1"
}
case $part in
  clocks)
    nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
    compiled compile-1
    ours ours-1
    [ $SECONDS -lt 380 ] && compiled compile-2
    [ $SECONDS -lt 480 ] && ours ours-2
    ;;
  watch)
    bash docs/perf/scripts/s35.sh watch
    ;;
  fused)
    suite flash_attention
    timeout -s KILL 120 bash .gpu/run.sh bench --attention > "$OUT/attention.log" 2>&1
    grep -v '^MEMORY' "$OUT/attention.log" | grep -i 'attention\|panicked\|error' | cut -c1-300
    ours fused-1
    ;;
  ab)
    for b in bench0 bench; do
      timeout -s KILL 90 bash .gpu/run.sh $b --attention > "$OUT/attention-$b.log" 2>&1
      echo "$b: $(grep -h '^ATTENTION' "$OUT/attention-$b.log" | cut -c1-200 | tr '\n' ' ')"
    done
    BENCH=bench0 ours before-1
    ours after-1
    compiled compile-1
    [ $SECONDS -lt 420 ] && BENCH=bench0 ours before-2
    [ $SECONDS -lt 480 ] && ours after-2
    ;;
esac
