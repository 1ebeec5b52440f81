#!/usr/bin/env bash
# Session 34, one GPU (carry .gpu with bench; `rows` also .peers and .whl):
#   first:    llama-1b bf16 and FP8 promoted once the optimizer step flushes the device (the
#             driver's count at each MEMORY mark should be the pools' plus the context's), then
#             recompute selective and full:1 with their MEMORY marks. (The call that ran it,
#             logs/s34/call1, also looked for Nsight Systems: the device has only Nsight Compute.)
#   check:    (carry .gpu with bench and gpu-suite) FusedAdamW in place: kernel tests, the
#             pure-bf16 bench's memory; then steady.
#   steady:   ncu's kernel-by-kernel times of one steady bf16 step, then the ladder.
#   oom:      batch 56, past the H200's memory: our GEMM and Burn's.
#   ladder:   the largest batch none and selective recomputation train at.
#   rows:     FP8 promoted beside torchao float8 + compile, bf16 beside PyTorch + compile, with
#             the MEMORY marks and nvidia-smi's peaks.
# Logs go to $OUT.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-first}
ladder() {  # RECOMPUTE BATCH...: a rung a batch, stopped at the first that fails
  local r=$1; shift
  for batch in "$@"; do
    [ $SECONDS -lt 450 ] || return
    run "ladder-${r/:/-}-$batch" 100 --preset llama-1b --steps 2 --warmup 1 --batch "$batch" --recompute "$r"
    grep -h '"at": "after forward"' "$OUT/bench-ladder-${r/:/-}-$batch.log" | cut -c1-120
    grep -q RESULT "$OUT/bench-ladder-${r/:/-}-$batch.log" || { grep -h -i -m2 'memory\|panicked' "$OUT/bench-ladder-${r/:/-}-$batch.log" | cut -c1-300; return; }
  done
}
ladders() { ladder none 40 48 56 64; ladder selective 56 64 72 80; }
steady() {
  # ncu over one steady bf16 step (the kernels between the second and the third step's
  # cross-entropy: the second's backward and optimizer, the third's forward), kernel by kernel;
  # then the ladder below while time is left.
  timeout -s KILL 240 ncu --clock-control none --target-processes all --metrics gpu__time_duration.sum -c 14000 \
    bash .gpu/run.sh bench --preset llama-1b --steps 1 --warmup 2 > "$OUT/ncu-bf16.log" 2>&1
  grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" "$OUT/ncu-bf16.log" | paste - - \
    | awk '{name=$1; sub(/_[0-9a-f]{8}$/,"",name); print name, $NF}' > /tmp/ordered.txt
  awk '/^ce_partials/ {n++} n == 2 {t[$1] += $2; c[$1]++}
       END {for (k in t) printf "%10.1f us %5d  %s\n", t[k], c[k], k}' /tmp/ordered.txt | sort -rn > "$OUT/steady-bf16.txt"
  echo "== bf16 steady step: $(awk '{s+=$3} END {print s}' "$OUT/steady-bf16.txt") kernels, $(awk '{s+=$1} END {print s/1000}' "$OUT/steady-bf16.txt") ms of GPU time"
  head -40 "$OUT/steady-bf16.txt"; rm -f "$OUT/ncu-bf16.log"
  ladders
}
case $part in
  first)
    run 1b-bf16-flush 70 $bf16; memory 1b-bf16-flush
    run 1b-fp8-flush 90 $fp8; memory 1b-fp8-flush
    for r in selective full:1; do
      [ $SECONDS -lt 420 ] && { run "1b-recompute-${r/:/-}" 80 $bf16 --recompute $r; memory "1b-recompute-${r/:/-}"; }
    done
    ;;
  rows)
    rows
    ;;
  check)
    # FusedAdamW's kernel updating in place: its kernel test, and the pure-bf16 bench (Burn's
    # optimizer interface on FusedAdamW) with its MEMORY marks; then `steady`.
    suite adamw adamw_master
    run 1b-pure-bf16 70 $bf16 --pure-bf16; memory 1b-pure-bf16
    steady
    ;;
  steady)
    steady
    ;;
  oom)
    # llama-1b at batch 56 does not fit one H200: its first step printed loss 0 and no error
    # (logs/s34/call3). Again, and with Burn's GEMM in the linears instead of ours, to see
    # whether our kernels lose the failure CubeCL records on the buffer it could not allocate.
    for gemm in wgmma burn; do
      timeout -s KILL 150 bash .gpu/run.sh bench --preset llama-1b --steps 1 --warmup 1 --batch 56 --linear-gemm $gemm \
        > "$OUT/bench-oom-$gemm.log" 2>&1
      echo "== $gemm: rc $?"; grep -v '^MEMORY' "$OUT/bench-oom-$gemm.log" | cut -c1-400 | head -12
    done
    ;;
  ladder)
    # The largest batch each recompute choice trains at (one warm-up, two timed steps a rung,
    # each choice's ladder stopped at its first failure).
    ladders
    ;;
esac
