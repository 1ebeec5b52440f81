#!/usr/bin/env bash
# Session 21, one H200.
#   moe:  (carry .gpu with gpu-suite and bench, .peers) the dispatch order kernels against the
#         host's order, the MoE suite on the one GPU as two and four ranks (every dropless
#         dispatch now decided on the device), the FP8 steps against tp = 1
#         (model_suite::fp8_*, their curve within 5e-2 on bf16 outputs), `bench
#         --moe-breakdown` (the dispatch decided on the device beside the same order decided on
#         the host, in one binary), then moe-4b beside PyTorch + torch._grouped_mm +
#         torch.compile in the same call (bf16 compute, fp32 master weights, random ids, 3
#         warm-up and 10 timed steps).
#   ab:   (carry .gpu with bench and bench-old, bench-old built at 24af85f, the commit before
#         this session; .peers) each one's --moe-breakdown, then moe-4b with each, alternating,
#         twice, then the peer.
#   router: (carry .gpu with gpu-suite and bench, .peers) the router's f32 product kernels,
#         moe-4b beside the peer, then the MoE suite.
#   final: (carry .gpu with gpu-suite and bench) the order and router kernels of the final build,
#         and the MoE layer's breakdown.
#   profile: (carry .gpu with bench, .peers) moe-4b's last step kernel by kernel under Nsight
#         Compute, ours and the peer's.
# Logs go to $OUT (a device call brings back a few files).
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-moe}
case $part in
  moe)
    timeout -s KILL 60 bash .gpu/run.sh gpu-suite --world 1 --filter "kernel_suite::expert_order" > "$OUT/suite-expert_order.log" 2>&1
    grep -h "FAILED\|passed\|panicked\|left:\|right:" "$OUT/suite-expert_order.log" | cut -c1-1500
    timeout -s KILL 150 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter "moe_suite::" > "$OUT/one-gpu-moe_suite.log" 2>&1
    grep -h "FAILED\|passed\|routing first" "$OUT/one-gpu-moe_suite.log" | cut -c1-400
    if [ -z "${SKIP_FP8:-}" ]; then
      timeout -s KILL 90 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter "model_suite::fp8" > "$OUT/one-gpu-fp8-steps.log" 2>&1
      grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/one-gpu-fp8-steps.log" | cut -c1-400
    fi
    timeout -s KILL 60 bash .gpu/run.sh bench --moe-breakdown > "$OUT/moe-breakdown.log" 2>&1
    grep -h "MOE\|panicked" "$OUT/moe-breakdown.log"
    [ $SECONDS -gt 330 ] && { echo "no time left for moe-4b"; exit 0; }
    run moe4b 100 --preset moe-4b --steps 10 --warmup 3
    peers moe4b-torch 160 moe-4b moe
    ;;
  ab)
    for b in bench-old bench; do
      timeout -s KILL 60 bash .gpu/run.sh $b --moe-breakdown > "$OUT/$b-breakdown.log" 2>&1
      echo "$b:"; grep -h "dispatch\|forward" "$OUT/$b-breakdown.log"
    done
    for i in 1 2; do
      for b in bench-old bench; do
        [ $SECONDS -gt 360 ] && { echo "no time left for $b $i"; continue; }
        timeout -s KILL 90 bash .gpu/run.sh $b --preset moe-4b --steps 10 --warmup 3 > "$OUT/$b-$i.log" 2>&1
        echo "$b $i: $(grep -h RESULT "$OUT/$b-$i.log" | grep -o '"step_ms": [0-9.]*, "tokens_per_s": [0-9]*')"
      done
    done
    [ $SECONDS -gt 400 ] && { echo "no time left for the peer"; exit 0; }
    peers moe4b-torch 170 moe-4b moe
    ;;
  router)
    # (carry .gpu with gpu-suite and bench, .peers) the router's f32 product kernels against
    # the CPU's product, moe-4b beside the peer in the same call, then the MoE suite on the
    # one GPU as two and four ranks while time is left.
    timeout -s KILL 90 bash .gpu/run.sh gpu-suite --world 1 --filter "kernel_suite::router_product" > "$OUT/suite-router.log" 2>&1
    grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-router.log" | cut -c1-600
    run moe4b 100 --preset moe-4b --steps 10 --warmup 3
    peers moe4b-torch 170 moe-4b moe
    [ $SECONDS -gt 420 ] && { echo "no time left for the MoE suite"; exit 0; }
    timeout -s KILL 150 bash .gpu/run.sh gpu-suite --one-gpu --world 2 --filter "moe_suite::" > "$OUT/one-gpu-moe_suite.log" 2>&1
    grep -h "FAILED\|passed\|routing first" "$OUT/one-gpu-moe_suite.log" | cut -c1-400
    ;;
  final)
    # (carry .gpu with gpu-suite and bench) the final build's order and router kernels against
    # their references, then the MoE layer phase by phase.
    for t in expert_order router_product; do
      timeout -s KILL 40 bash .gpu/run.sh gpu-suite --world 1 --filter "kernel_suite::$t" > "$OUT/suite-$t.log" 2>&1
      grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite-$t.log" | cut -c1-600
    done
    timeout -s KILL 50 bash .gpu/run.sh bench --moe-breakdown > "$OUT/moe-breakdown.log" 2>&1
    grep -h "MOE\|panicked" "$OUT/moe-breakdown.log"
    ;;
  profile)
    # moe-4b's step kernel by kernel, ours and the peer's, by Nsight Compute's durations (call 4
    # ran ours with one warm-up step, now two: see kernel_times.py; a timed step each; kernels serialized, so the sum is GPU time, not the
    # step's wall time): `examples/bench/peers/kernel_times.py` groups the last step's.
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    echo "ncu: $ncu"
    flags="--clock-control none --metrics gpu__time_duration.sum --csv --page raw --print-units base"
    bash .gpu/run.sh bench --help > /dev/null 2>&1 || true
    timeout -s KILL 240 "$ncu" $flags bash .gpu/run.sh bench --preset moe-4b --steps 1 --warmup 2 > "$OUT/ncu-ours.csv" 2> "$OUT/ncu-ours.err"
    tail -3 "$OUT/ncu-ours.err"
    python3 examples/bench/peers/kernel_times.py "$OUT/ncu-ours.csv" adamw 45 > "$OUT/kernels-ours.txt" 2>&1
    head -50 "$OUT/kernels-ours.txt" | cut -c1-140
    [ $SECONDS -gt 330 ] && { echo "no time left for the peer"; gzip "$OUT"/*.csv; exit 0; }
    (cd .peers && timeout -s KILL 240 "$ncu" $flags python3 peer_moe.py --preset moe-4b --compile --warmup 1 --steps 1 > "$OUT/ncu-peer.csv" 2> "$OUT/ncu-peer.err")
    tail -3 "$OUT/ncu-peer.err"
    python3 examples/bench/peers/kernel_times.py "$OUT/ncu-peer.csv" '[Aa]dam' 45 > "$OUT/kernels-peer.txt" 2>&1
    head -50 "$OUT/kernels-peer.txt" | cut -c1-140
    gzip "$OUT"/*.csv
    ;;
esac
