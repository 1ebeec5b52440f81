#!/usr/bin/env bash
# Session 4 (nvidia-h200-x2, carry .gpu with gpu-suite and bench): every suite with NCCL ordered
# on the GPU (ranks as threads, then one process a GPU), then llama-1b at tp = 2 with SP.
# `--filter NONE` only unpacks the binary (it matches no test).
set -u
cd "$(dirname "$0")/../.."
bash .gpu/run.sh gpu-suite --filter NONE >/dev/null 2>&1
timeout -s KILL 130 bash .gpu/run.sh gpu-suite --world 2 2>&1 | tee "$OUT/suite-threads.log" | grep -v " ok "
timeout -s KILL 110 torchrun --nproc-per-node 2 --no-python bash .gpu/run.sh gpu-suite > "$OUT/suite-processes.log" 2>&1
grep -h "FAILED\|passed\|panicked" "$OUT/suite-processes.log" | cut -c1-300
timeout -s KILL 100 bash .gpu/run.sh bench --preset llama-1b --tp 2 --sp --steps 5 --warmup 2 --profile > "$OUT/bench-1b-tp2.log" 2>&1
grep -h 'RESULT\|PROFILE\|panicked' "$OUT/bench-1b-tp2.log" | cut -c1-320
