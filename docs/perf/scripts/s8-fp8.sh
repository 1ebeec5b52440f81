#!/usr/bin/env bash
# Session 8, one H200 (nvidia-h200; carry .gpu with gpu-suite and bench, .peers and .whl with
# torchao 0.18's wheel): the kernel suite (every recipe's product and gradients on CUDA against
# the CPU emulation among it), then llama-1b under bf16 and each low-precision recipe beside
# PyTorch + torch.compile + torchao float8 (tensorwise) in the same call. fp32 master weights
# everywhere, random ids, 3 warm-up and 10 timed steps.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
python3 -m pip install --quiet --no-deps --target /tmp/torchao .whl/torchao-0.18.0-*.whl
export PYTHONPATH=/tmp/torchao
bash .gpu/run.sh gpu-suite --filter NONE >/dev/null 2>&1
timeout -s KILL 170 bash .gpu/run.sh gpu-suite --world 1 --filter kernel_suite > "$OUT/kernel-suite.log" 2>&1
grep -h "FAILED\|passed\|ok (" "$OUT/kernel-suite.log" | cut -c1-400
run 1b-bf16 80 --preset llama-1b --steps 10 --warmup 3 --profile
run 1b-fp8-tensorwise 80 --preset llama-1b --steps 10 --warmup 3 --profile --precision fp8-tensorwise
peers 1b-torchao 150 llama-1b fp8
for recipe in fp8-blockwise mxfp8 nvfp4; do
  run "1b-$recipe" 100 --preset llama-1b --steps 10 --warmup 3 --profile --precision "$recipe"
done
