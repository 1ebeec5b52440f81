#!/usr/bin/env bash
# Session 35, one GPU (carry .gpu with bench and gpu-suite; `rows` also .peers and .whl):
#   check:  the AdamW master step as many short blocks and the norm's weight-gradient column sum
#           over more blocks: their kernel tests; ncu's times, registers and DRAM throughput for
#           those two kernels over four steps; the bf16 and FP8 rows alone; then `oom`.
#   again:  (after logs/s35/call1) the ncu part of `check` and an `oom` run; the rows on an H200.
#   watch:  the failures' watch in the kernels crate: bench and train past the device's memory.
#   pairs:  the AdamW master step two vectors a turn: its tests, ncu; the rows on an H200.
#   h200:   on an H200 only, the ncu part of `check` and the rows.
#   oom:    llama-1b at batch 56, past the H200's memory (its first step printed loss 0 and no
#           error in logs/s34/call3): our GEMM and Burn's.
#   rows:   FP8 promoted beside torchao float8 + compile, bf16 beside PyTorch + compile.
# Logs go to $OUT.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-check}
oom() {  # GEMM...
  for gemm in "$@"; do
    [ $SECONDS -lt 430 ] || return
    timeout -s KILL 150 bash .gpu/run.sh bench --preset llama-1b --steps 1 --warmup 1 --batch 56 --linear-gemm $gemm \
      > "$OUT/bench-oom-$gemm.log" 2>&1
    echo "== oom $gemm: rc $?"; grep -v '^MEMORY' "$OUT/bench-oom-$gemm.log" | cut -c1-400 | head -12
  done
}
optim() {  # ncu over the two kernels, four steps
  # One row a launch: kernel, duration, registers a thread, blocks an SM the registers allow,
  # DRAM throughput as a share of its peak.
  timeout -s KILL 150 ncu --clock-control none -k 'regex:adamw_master|column_sum' \
    --metrics gpu__time_duration.sum,launch__registers_per_thread,launch__occupancy_limit_registers,launch__grid_size,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    --csv bash .gpu/run.sh bench --preset llama-1b --steps 1 --warmup 2 > "$OUT/ncu-optim.csv" 2> "$OUT/ncu-optim.err"
  python3 - "$OUT/ncu-optim.csv" <<'EOF'
import csv, sys, collections
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
head, rows = rows[0], rows[1:]
ix = {k: head.index(k) for k in ("ID", "Kernel Name", "Metric Name", "Metric Value")}
launches = collections.defaultdict(dict)
for r in rows:
  launches[r[ix["ID"]]][r[ix["Metric Name"]]] = r[ix["Metric Value"]].replace(",", "")
  launches[r[ix["ID"]]]["name"] = r[ix["Kernel Name"]].split("(")[0]
by = collections.defaultdict(list)
for l in launches.values():
  by[l["name"]].append(l)
for name, ls in by.items():
  last = ls[len(ls) * 3 // 4:]  # the last of four steps (two warm-up, one timed, one marked)
  t = sum(float(l["gpu__time_duration.sum"]) for l in last) / 1e3
  print(f"{name}: {len(ls)} launches, the last step's {len(last)} {t:.1f} us")
  for key in ("launch__registers_per_thread", "launch__occupancy_limit_registers"):
      print(f"  {key}: {sorted(set(l[key] for l in ls))}")
  big = sorted(last, key=lambda l: -float(l["gpu__time_duration.sum"]))[:5]
  for l in big:
      print(f"  {float(l['gpu__time_duration.sum'])/1e3:8.1f} us grid {l['launch__grid_size']:>6} dram {l['dram__throughput.avg.pct_of_peak_sustained_elapsed']}%")
EOF
  tail -3 "$OUT/ncu-optim.err" | cut -c1-300
  rm -f "$OUT/ncu-optim.csv"
}
case $part in
  again)
    # The ncu part of `check` and one `oom` run (bench's failure log), then the rows on an H200.
    optim
    oom wgmma
    nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && rows
    ;;
  watch)
    # (carry .gpu with bench and train) The failures' watch moved into the kernels crate: bench
    # at batch 56 again, and train's own loop past the device's memory (batch 64 on the H100's
    # 80 GB, 72 on an H200's 141).
    oom wgmma
    timeout -s KILL 150 bash .gpu/run.sh train --preset llama-1b --device cuda --batch 72 --steps 2 --sample-every 0 \
      > "$OUT/train-oom.log" 2>&1
    echo "== train oom: rc $?"; grep -v 'reclaiming\|^No backtrace' "$OUT/train-oom.log" | cut -c1-300 | tail -8
    ;;
  pairs)
    # The AdamW master step loading two vectors a turn: its kernel tests and ncu; the rows on an
    # H200.
    suite adamw_master adamw
    optim
    nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && rows
    ;;
  h200)
    # On an H200 only: the two kernels' ncu (against logs/s34's 8.12 ms of AdamW a step), then
    # the rows.
    nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200"; exit 0; }
    optim
    rows
    ;;
  check)
    suite adamw_master adamw rms_norm
    optim
    run 1b-bf16 70 $bf16; memory 1b-bf16
    run 1b-fp8 90 $fp8; memory 1b-fp8
    oom wgmma burn
    ;;
  oom)
    oom wgmma burn
    ;;
  rows)
    rows
    ;;
esac
