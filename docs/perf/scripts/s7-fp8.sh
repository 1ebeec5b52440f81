#!/usr/bin/env bash
# Session 7, one H200 (nvidia-h200; carry .gpu with gpu-suite and bench): the kernel suite (the
# FP8 tests among them), then llama-1b with FP8 current scaling in the blocks' linear layers
# (E4M3 forward, E5M2 gradients, the output layer bf16) beside the bf16 recipe in the same call,
# both with fp32 master weights, 3 warm-up and 10 timed steps.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
bash .gpu/run.sh gpu-suite --filter NONE >/dev/null 2>&1
timeout -s KILL 150 bash .gpu/run.sh gpu-suite --world 1 --filter kernel_suite > "$OUT/kernel-suite.log" 2>&1
grep -h "FAILED\|passed\|ok (" "$OUT/kernel-suite.log" | cut -c1-400
run 1b-bf16 150 --preset llama-1b --steps 10 --warmup 3 --profile
run 1b-fp8 150 --preset llama-1b --steps 10 --warmup 3 --profile --precision fp8-tensorwise
