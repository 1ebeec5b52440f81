#!/usr/bin/env bash
# Session 43, one GPU (carry .gpu7 with gpu-suite and bench of 4b114de, .peers; no room for the
# torchao wheel beside them in the carry's 64 MiB):
#   auto:  on an H200, the bf16 row beside PyTorch + compile (10 timed steps after 3 warm-up),
#          then 40 steps of each while time is left; on an H100 (whose row `logs/s43/call3`
#          measured), the GPU suite but the kernel tests with every rank on GPU 0 (`--one-gpu
#          --world 2`), the first such run since `docs/gpu-runs/2026-12-01-s7-suite-one-gpu.log`.
#   suite: the whole suite, whatever the card.
# Logs go to $OUT, packed into one $OUT/logs.tgz at the end.
set -u
trap 'tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/logs.tgz "$OUT/"' EXIT
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
rm -rf .gpu && ln -s .gpu7 .gpu
whole() {  # LIMIT [ARGS]: the whole suite, ranks as threads on GPU 0; a summary of what failed
  local limit=$1; shift
  timeout -s KILL "$limit" bash .gpu7/run.sh gpu-suite --one-gpu --world 2 "$@" > "$OUT/suite-one-gpu.log" 2>&1
  echo "-- whole suite: rc $?, $(grep -c '\.\.\. ok' "$OUT/suite-one-gpu.log") ok"
  grep -h "FAILED\|panicked\|passed," "$OUT/suite-one-gpu.log" | cut -c1-600
  tail -2 "$OUT/suite-one-gpu.log" | cut -c1-300
}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
case ${1:-auto} in
  auto)
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      run 1b-bf16 70 $bf16; memory 1b-bf16
      peers 1b-compile 150 llama-1b compile
      [ $SECONDS -lt 150 ] && ours steps-40
      [ $SECONDS -lt 180 ] && compiled compile-40
    else
      # The kernel tests of every kernel this session and the last changed ran alone
      # (`logs/s42`, `logs/s43`): the other families first, in the time left.
      whole 250 --skip kernel_suite
    fi
    ;;
  suite) whole 540 ;;
esac
