#!/usr/bin/env bash
# Session 32 wrote this for the next call on two GPUs (none were lent that session):
#   collectives: (nvidia-h200-x2 or nvidia-h100-x2; carry .gpu with collectives and gpu-suite,
#           and .peers) the communicator and mapping suites on 2 GPUs, ranks as threads and one
#           process a GPU (all-to-all into one buffer, the store's one-round-trip check), then
#           `examples/collectives` both ways beside torch.distributed (`peer_collectives.py`),
#           for the table of docs/perf/collectives.md (time_us and pipelined_us beside the peer's
#           event time).
#   moe:    (carry .gpu with gpu-suite and bench, .peers) the MoE suites on 2 GPUs (the token
#           dispatch's all-to-all), then moe-4b at ep 2 beside the ep-moe peer.
# Logs go to $OUT.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-collectives}
threads() {  # FILTER NAME LIMIT: gpu-suite's tests matching FILTER, ranks as threads on 2 GPUs
  timeout -s KILL "$3" bash .gpu/run.sh gpu-suite --world 2 --filter "$1" > "$OUT/suite-$2-threads.log" 2>&1
  grep -h "FAILED\|passed\|panicked" "$OUT/suite-$2-threads.log" | cut -c1-600
}
processes() {  # FILTER NAME LIMIT: the same tests, one process a GPU
  bash .gpu/run.sh gpu-suite --filter NONE >/dev/null 2>&1  # unpacks the binary once
  timeout -s KILL "$3" torchrun --nproc-per-node 2 .gpu/.bin/gpu-suite --filter "$1" \
    > "$OUT/suite-$2-processes.log" 2>&1
  grep -h "FAILED\|passed\|panicked" "$OUT/suite-$2-processes.log" | cut -c1-600
}
case $part in
  collectives)
    threads comm_suite comm 120
    threads mapping_suite mappings 120
    processes comm_suite comm 150
    timeout -s KILL 150 bash .gpu/run.sh collectives > "$OUT/coll-threads.log" 2>&1
    timeout -s KILL 150 bash .gpu/run.sh collectives --processes > "$OUT/coll-procs.log" 2>&1
    (cd .peers && timeout -s KILL 150 torchrun --nproc-per-node 2 peer_collectives.py > "$OUT/peer-coll.log" 2>&1)
    grep -h "RESULT\|panicked" "$OUT/coll-threads.log" "$OUT/coll-procs.log" "$OUT/peer-coll.log" | cut -c1-400
    ;;
  moe)
    threads moe_suite moe 200
    run moe-4b-ep2 150 --preset moe-4b --ep 2 --dp 2 --steps 10 --warmup 3
    export TP=2
    peers moe-4b-ep2 200 moe-4b ep-moe
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
