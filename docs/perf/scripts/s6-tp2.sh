#!/usr/bin/env bash
# Session 6, the tp = 2 rows (nvidia-h200-x2; carry .gpu with bench, .peers): llama-1b and
# llama-8b with sequence parallelism on the peers' recipe, beside PyTorch tp = 2 + SP +
# torch.compile; the llama-1b peer twice (it varied 64k-103k between calls).
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
bash .gpu/run.sh bench --help >/dev/null 2>&1
run 1b-tp2 110 --preset llama-1b --tp 2 --sp --steps 10 --warmup 3
run 8b-tp2 170 --preset llama-8b --tp 2 --sp --steps 10 --warmup 3
TP=2 peers 1b-tp2-a 110 llama-1b tp-torch
TP=2 peers 8b-tp2 150 llama-8b tp-torch
TP=2 peers 1b-tp2-b 110 llama-1b tp-torch
