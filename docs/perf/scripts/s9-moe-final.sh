#!/usr/bin/env bash
# Session 9, one H200 (carry .gpu with gpu-suite and bench, .peers, .whl with megatron-core
# 0.19.2's wheel): moe-4b on one GPU, ours beside PyTorch + torch._grouped_mm + torch.compile
# and Megatron Core's local MoE in the same call (the peers' recipe: bf16 compute, fp32 master
# weights, random ids, 3 warm-up and 10 timed steps); then the MoE layer suite's filler case
# three times on CUDA (one of its runs failed once on a shared GPU).
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
python3 -m pip install --quiet --no-deps --target /tmp/megatron .whl/megatron_core-*.whl
run moe4b-final 200 --preset moe-4b --steps 10 --warmup 3 --profile
peers moe4b-torch-final 200 moe-4b moe
PYTHONPATH=/tmp/megatron peers moe4b-megatron-final 150 moe-4b megatron-moe
for i in 1 2 3; do
  timeout -s KILL 60 bash .gpu/run.sh gpu-suite --one-gpu --filter padded_expert_rows 2>&1 | grep -h "FAILED\|passed" | cut -c1-250
done
