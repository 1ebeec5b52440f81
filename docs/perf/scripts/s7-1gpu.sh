#!/usr/bin/env bash
# Session 7, llama-1b on one H200 (nvidia-h200; carry .gpu with bench, .peers, .whl with the
# megatron-core 0.19.2 wheel): the peers' recipe (bf16 compute, fp32 master weights and moments,
# random ids, 3 warm-up and 10 timed steps) on the fused master-weight AdamW step, the pure-bf16
# recipe as a labelled second line, beside PyTorch eager, torch.compile and Megatron Core's
# local layers in the same call.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
bash .gpu/run.sh bench --help >/dev/null 2>&1
run 1b 150 --preset llama-1b --steps 10 --warmup 3 --profile
run 1b-pure 100 --preset llama-1b --steps 10 --warmup 3 --pure-bf16
peers 1b 330 llama-1b torch compile megatron
