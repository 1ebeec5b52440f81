#!/usr/bin/env bash
# Session 10, one H200 (carry .gpu with gpu-suite and bench): activation recomputation on
# llama-1b (bf16 compute, fp32 master weights, random ids). Part `time`: the preset's batch (4 ×
# 2048) with none / selective / full:1, 3 warm-up and 10 timed steps each, memory sampled; then
# the pipeline and recomputation suites on the GPU (ranks as threads on GPU 0). Part `ladder`:
# the largest batch each choice trains at (2 timed steps a rung, stopping at the first that
# fails).
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-time}
if [ "$part" = time ]; then
  run r-none 120 --preset llama-1b --steps 10 --warmup 3
  run r-selective 120 --preset llama-1b --steps 10 --warmup 3 --recompute selective
  run r-full 120 --preset llama-1b --steps 10 --warmup 3 --recompute full:1
  for suite in pipeline_suite recompute_suite; do
    timeout -s KILL 180 bash .gpu/run.sh gpu-suite --one-gpu --filter $suite 2>&1 | grep -h "test \|passed" | cut -c1-300
  done
else
  ladder() {  # CHOICE BATCH...: rungs until one fails
    local choice=$1; shift
    for b in "$@"; do
      run "ladder-${choice%%:*}-$b" 150 --preset llama-1b --steps 2 --warmup 1 --batch "$b" --recompute "$choice"
      grep -q RESULT "$OUT/bench-ladder-${choice%%:*}-$b.log" || break
    done
  }
  ladder none 24 28 32
  ladder selective 32 36 40
  ladder full:1 128 192 256
fi
