#!/usr/bin/env bash
# Session 6, llama-1b with data parallelism over 2 H200s (nvidia-h200-x2; carry .gpu with bench,
# .peers): each rank its own batch of 4, gradients averaged in buckets during backward
# (`--profile` says how much of the reduction backward hides), beside PyTorch DDP +
# torch.compile (`run_peers.sh llama-1b dp-torch`) in the same call.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
bash .gpu/run.sh bench --help >/dev/null 2>&1
run 1b-dp2 200 --preset llama-1b --dp 2 --steps 10 --warmup 3 --profile
TP=2 peers 1b-dp2 200 llama-1b dp-torch
