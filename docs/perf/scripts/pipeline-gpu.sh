#!/usr/bin/env bash
# llama-8b over 2 pipeline stages on 2 H200s (nvidia-h200-x2; carry .gpu with bench, .peers,
# .whl with the megatron-core 0.19.2 wheel): 1F1B and interleaved (2 chunks a rank) over 8
# microbatches of one sequence, beside our tp = 2 + SP and Megatron Core's own schedule on its
# local layers, in one call. Each line carries its step time and tokens/s; ours also the bubble
# predicted and measured.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
bash .gpu/run.sh bench --help >/dev/null 2>&1
run 8b-pp2 200 --preset llama-8b --pp 2 --batch 8 --microbatches 8 --steps 10 --warmup 3
run 8b-pp2-vpp2 200 --preset llama-8b --pp 2 --vpp 2 --batch 8 --microbatches 8 --steps 10 --warmup 3
run 8b-tp2 170 --preset llama-8b --tp 2 --sp --batch 8 --steps 10 --warmup 3
for vpp in 1 2; do
  sample "megatron-pp2-vpp$vpp"; smi=$!
  PYTHONPATH=/tmp/site:.peers timeout -s KILL 300 torchrun --nproc-per-node 2 examples/bench/peers/peer_megatron_pp.py \
    --preset llama-8b --pp 2 --vpp "$vpp" --batch 8 --microbatches 8 > "$OUT/megatron-pp2-vpp$vpp.log" 2>&1
  kill $smi
  grep -h 'RESULT\|Error' "$OUT/megatron-pp2-vpp$vpp.log" | cut -c1-400
  echo "megatron pp2 vpp$vpp peak MiB per GPU: $(peak "megatron-pp2-vpp$vpp")"
done
