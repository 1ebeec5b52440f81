#!/usr/bin/env bash
# One H200 (carry .gpu with gpu-suite and bench, and .peers): the context-parallel suite with
# every rank on GPU 0 (f32; bf16 with heads of 128, every block on the flash kernels), then
# llama-1b-32k at cp 1 (bf16 compute, fp32 master weights, random ids; 3 warm-up and 10 timed
# steps) beside PyTorch's context-parallel peer at --cp 1 with compile, memory sampled.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
timeout -s KILL 240 bash .gpu/run.sh gpu-suite --one-gpu --filter context_suite 2>&1 | grep -h "test \|passed" | cut -c1-300
run 32k-cp1 220 --preset llama-1b-32k --steps 10 --warmup 3
sample peer-32k-cp1; smi=$!
(cd .peers && timeout -s KILL 240 python3 peer_cp.py --preset llama-1b-32k --cp 1 --compile > "$OUT/peer-32k-cp1.log" 2>&1)
kill $smi
grep -h RESULT "$OUT/peer-32k-cp1.log" || tail -5 "$OUT/peer-32k-cp1.log"
echo "peer 32k-cp1 peak MiB per GPU: $(peak peer-32k-cp1)"
