#!/usr/bin/env bash
# Session 43, one GPU (carry .gpu7 with gpu-suite and bench of 61f84bd, bundled by
# `bundle-small.sh` so that .whl with the torchao wheel and .peers fit beside them):
#   auto:  on an H200, the rows beside the peers (s6-common's `rows`: FP8 promoted beside
#          torchao float8 + compile, bf16 beside PyTorch + compile, 10 timed steps after 3
#          warm-up), then 40 bf16 steps of each while time is left; on an H100 (whose rows
#          `logs/s43/call3` measured), `suite`.
#   suite: the GPU suite but the kernel tests (the kernels this session and the last changed
#          ran theirs alone, `logs/s42`, `logs/s43`), every rank on GPU 0 (`--one-gpu --world
#          2`): the first such run since `docs/gpu-runs/2026-12-01-s7-suite-one-gpu.log`.
# Logs go to $OUT, packed into one $OUT/logs.tgz at the end.
set -u
trap 'tar czf /tmp/logs.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/logs.tgz "$OUT/"' EXIT
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
rm -rf .gpu && ln -s .gpu7 .gpu
suite() {  # LIMIT: the suite but its kernel tests, ranks as threads on GPU 0; what failed
  timeout -s KILL "$1" bash .gpu7/run.sh gpu-suite --one-gpu --world 2 --skip kernel_suite \
    > "$OUT/suite-one-gpu.log" 2>&1
  echo "-- suite: rc $?, $(grep -c '\.\.\. ok' "$OUT/suite-one-gpu.log") ok"
  grep -h "FAILED\|panicked\|passed," "$OUT/suite-one-gpu.log" | cut -c1-600
  tail -2 "$OUT/suite-one-gpu.log" | cut -c1-300
}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
case ${1:-auto} in
  auto)
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      rows
      [ $SECONDS -lt 470 ] && ours steps-40
      [ $SECONDS -lt 430 ] && compiled compile-40
    else
      suite 540
    fi
    ;;
  suite) suite 540 ;;
esac
