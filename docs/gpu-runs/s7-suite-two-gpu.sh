#!/usr/bin/env bash
# Session 7 (nvidia-h200-x2, carry .gpu with gpu-suite): the whole suite with ranks as threads on
# two GPUs (NCCL among threads), then every suite but the kernel suite with one process a GPU; f32
# products in f32 (no TF32) at the CPU's tolerances. `--filter NONE` only unpacks the binary.
set -u
cd "$(dirname "$0")/../.."
bash .gpu/run.sh gpu-suite --filter NONE >/dev/null 2>&1
timeout -s KILL 200 bash .gpu/run.sh gpu-suite --world 2 > "$OUT/suite-threads.log" 2>&1
grep -h "FAILED\|passed" "$OUT/suite-threads.log" | cut -c1-300
timeout -s KILL 150 torchrun --nproc-per-node 2 --no-python bash .gpu/run.sh gpu-suite --skip kernel_suite > "$OUT/suite-processes.log" 2>&1
grep -h "FAILED\|passed" "$OUT/suite-processes.log" | cut -c1-300
