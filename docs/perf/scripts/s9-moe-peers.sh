#!/usr/bin/env bash
# Session 9, one H200 (carry .peers and .whl with megatron-core 0.19.2's wheel): moe-4b's peers
# on one GPU, PyTorch with torch._grouped_mm and torch.compile, and Megatron Core's MoE.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
python3 -m pip install --quiet --no-deps --target /tmp/megatron .whl/megatron_core-*.whl
peers moe4b-torch 300 moe-4b moe
PYTHONPATH=/tmp/megatron peers moe4b-megatron 250 moe-4b megatron-moe
