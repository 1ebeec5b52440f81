#!/usr/bin/env bash
# Session 7 on 2 H200s (nvidia-h200-x2; carry .gpu with bench, .peers): rows 2-4 of llama.md
# on the fused master-weight step, beside their peers in one call: llama-1b and llama-8b at
# tp = 2 + SP beside tp = 2 + SP + compile (the 1b peer twice), llama-1b at dp = 2 beside DDP +
# compile, with the reduction's hidden share. The peers' recipe: bf16 compute, fp32 master
# weights, random ids, 3 warm-up and 10 timed steps.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
bash .gpu/run.sh bench --help >/dev/null 2>&1
run 1b-tp2 110 --preset llama-1b --tp 2 --sp --steps 10 --warmup 3
run 8b-tp2 170 --preset llama-8b --tp 2 --sp --steps 10 --warmup 3 --profile
TP=2 peers 1b-tp2-a 110 llama-1b tp-torch
TP=2 peers 8b-tp2 150 llama-8b tp-torch
TP=2 peers 1b-tp2-b 110 llama-1b tp-torch
run 1b-dp2 200 --preset llama-1b --dp 2 --steps 10 --warmup 3 --profile
TP=2 peers 1b-dp2 200 llama-1b dp-torch
