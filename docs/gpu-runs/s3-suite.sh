#!/usr/bin/env bash
# Session 3 final (nvidia-h200-x2, carry .gpu with gpu-suite): every suite on the final code,
# ranks as threads (CubeCL transport), then one process a GPU (NCCL).
set -u
cd "$(dirname "$0")/../.."
bash .gpu/run.sh gpu-suite --unpack-only >/dev/null 2>&1
timeout 200 bash .gpu/run.sh gpu-suite --world 2 > "$OUT/suite-threads.log" 2>&1
timeout 200 torchrun --nproc-per-node 2 --no-python bash .gpu/run.sh gpu-suite > "$OUT/suite-processes.log" 2>&1
grep -h "FAILED\|passed" "$OUT/suite-threads.log" "$OUT/suite-processes.log" | cut -c1-300
