#!/usr/bin/env bash
# Session 6 (nvidia-h200-x2, carry .gpu with gpu-suite): the plan and precision rooms (layer
# configs carrying their GEMM, `gemm_per_layer` new), the NCCL transport for ranks as threads
# apart from the in-process one. The whole suite with ranks as threads, then every suite but the
# kernel suite with one process a GPU. `--filter NONE` only unpacks the binary.
set -u
cd "$(dirname "$0")/../.."
bash .gpu/run.sh gpu-suite --filter NONE >/dev/null 2>&1
timeout -s KILL 150 bash .gpu/run.sh gpu-suite --world 2 > "$OUT/suite-threads.log" 2>&1
grep -h "FAILED\|passed\|gemm_per_layer" "$OUT/suite-threads.log" | cut -c1-300
timeout -s KILL 150 torchrun --nproc-per-node 2 --no-python bash .gpu/run.sh gpu-suite --skip kernel_suite > "$OUT/suite-processes.log" 2>&1
grep -h "FAILED\|passed" "$OUT/suite-processes.log" | cut -c1-300
