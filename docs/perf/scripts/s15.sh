#!/usr/bin/env bash
# Session 15, one H200 (carry .gpu with gpu-suite and bench, .peers (../shared/peers) and .whl
# with torchao 0.18's wheel): a step that never waits for the host (the global norm and the
# clipping factor stay on the device, the loss is read after the last step), the coalesced
# `delta` of flash attention's backward, FP8 scales multiplied in the GEMM.
#   suite: the kernel tests (flash attention, AdamW with a clipping factor, the GEMMs with their
#          scales among them).
#   ncu:   every kernel of one llama-1b step (no warm-up) under bf16 and FP8 tensorwise, timed by
#          ncu and summed by name: the GPU's busy time against the step's wall time.
#   steady: the same for one step in steady state (after two), with the host's own time to
#          issue a step (`issue_ms`).
#   config: the same bench under CubeCL's stream policy and CUDA allocator settings.
#   shared: the shared-input kernel test, then FP8 tensorwise beside torchao.
#   rows:  llama-1b bf16 and FP8 tensorwise beside PyTorch + compile (bf16) and torchao float8 +
#          compile in the same call: fp32 master weights, random ids, 3 warm-up and 10 timed steps.
set -u
cd "$(dirname "$0")/../../.."
. docs/perf/scripts/s6-common.sh
part=${1:-suite}
case $part in
  suite)
    timeout -s KILL 240 bash .gpu/run.sh gpu-suite --world 1 --filter "${FILTER:-kernel_suite}" \
      > "$OUT/suite.log" 2>&1
    grep -h "FAILED\|passed\|ok (\|panicked" "$OUT/suite.log" | cut -c1-400
    ;;
  ncu)
    for recipe in ${RECIPES:-bf16 fp8-tensorwise}; do
      args="--preset llama-1b --steps 1 --warmup 0"
      [ "$recipe" = bf16 ] || args="$args --precision $recipe"
      timeout -s KILL 200 ncu --clock-control none --target-processes all --metrics gpu__time_duration.sum -c 9000 \
        bash .gpu/run.sh bench $args > "$OUT/ncu-$recipe.log" 2>&1
      grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" "$OUT/ncu-$recipe.log" | paste - - \
        | awk '{name=$1; sub(/_[0-9a-f]{8}$/,"",name); t[name]+=$NF; c[name]++} END {for (n in t) printf "%10.1f us %5d  %s\n", t[n], c[n], n}' \
        | sort -rn > "$OUT/ncu-$recipe.txt"
      echo "== $recipe: $(grep -c gpu__time "$OUT/ncu-$recipe.log") kernels, $(awk '{s+=$1} END {print s/1000}' "$OUT/ncu-$recipe.txt") ms"
      head -30 "$OUT/ncu-$recipe.txt"; rm -f "$OUT/ncu-$recipe.log"
    done
    ;;
  steady)
    # Three steps; the kernels between the second and the third step's cross-entropy are one
    # whole step in steady state (the second's backward and optimizer, the third's forward).
    for recipe in ${RECIPES:-bf16 fp8-tensorwise}; do
      args="--preset llama-1b"
      [ "$recipe" = bf16 ] || args="$args --precision $recipe"
      timeout -s KILL 240 ncu --clock-control none --target-processes all --metrics gpu__time_duration.sum -c 14000 \
        bash .gpu/run.sh bench $args --steps 1 --warmup 2 > "$OUT/ncu-$recipe.log" 2>&1
      grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" "$OUT/ncu-$recipe.log" | paste - - \
        | awk '{name=$1; sub(/_[0-9a-f]{8}$/,"",name); print name, $NF}' > "$OUT/ordered.txt"
      awk '/^ce_partials/ {n++} n == 2 && !/^ce_partials/ {t[$1] += $2; c[$1]++} n == 2 && /^ce_partials/ {t[$1] += $2; c[$1]++}
           END {for (k in t) printf "%10.1f us %5d  %s\n", t[k], c[k], k}' "$OUT/ordered.txt" | sort -rn > "$OUT/steady-$recipe.txt"
      echo "== $recipe steady step: $(awk '{s+=$3} END {print s}' "$OUT/steady-$recipe.txt") kernels, $(awk '{s+=$1} END {print s/1000}' "$OUT/steady-$recipe.txt") ms of GPU time"
      grep -h "RESULT\|PROFILE" "$OUT/ncu-$recipe.log" | cut -c1-300
      head -32 "$OUT/steady-$recipe.txt"; rm -f "$OUT/ncu-$recipe.log" "$OUT/ordered.txt"
      run "profile-$recipe" 90 $args --steps 10 --warmup 3 --profile
    done
    ;;
  config)
    # CubeCL's run-time settings (`cubecl.toml`, read from the working directory up): one stream
    # for the process instead of one a thread, CUDA's stream-ordered allocator, both; and the
    # streaming logger, which names every wait between streams.
    repo=$(pwd)
    for recipe in ${RECIPES:-bf16 fp8-tensorwise}; do
      prec=""; [ "$recipe" = bf16 ] || prec="--precision $recipe"
      for variant in ${VARIANTS:-default single async single-async}; do
        dir=/tmp/cfg-$variant; mkdir -p $dir; : > $dir/cubecl.toml
        case $variant in *single*) printf '[streaming]\npolicy = "single"\n' >> $dir/cubecl.toml;; esac
        case $variant in *async*) printf '[memory.cuda]\nallocator = "async"\n' >> $dir/cubecl.toml;; esac
        case $variant in logged) printf '[streaming.logger]\nlevel = "full"\nstderr = true\n' >> $dir/cubecl.toml;; esac
        (cd $dir && timeout -s KILL 90 bash "$repo/.gpu/run.sh" bench --preset llama-1b --steps 10 --warmup 3 $prec) \
          > "$OUT/bench-cfg-$variant-$recipe.log" 2>&1
        echo "$recipe $variant: $(grep -h RESULT "$OUT/bench-cfg-$variant-$recipe.log" | grep -o '"step_ms": [0-9.]*') $(grep -ch 'panicked\|rror' "$OUT/bench-cfg-$variant-$recipe.log") errors, $(grep -ci wait "$OUT/bench-cfg-$variant-$recipe.log") waits logged"
      done
    done
    ;;
  shared)
    # q, k and v (and the gate and up projections) quantizing their shared input once: the
    # kernel tests, then FP8 tensorwise twice beside torchao in the same call.
    for test in shared_input quantized_linear; do FILTER=$test bash "$0" suite; done
    python3 -m pip install --quiet --no-deps --target /tmp/torchao .whl/torchao-0.18.0-*.whl
    export PYTHONPATH=/tmp/torchao
    run 1b-fp8-tensorwise 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise
    peers 1b-torchao 150 llama-1b fp8
    run 1b-fp8-tensorwise-again 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise --profile
    ;;
  rows)
    python3 -m pip install --quiet --no-deps --target /tmp/torchao .whl/torchao-0.18.0-*.whl
    export PYTHONPATH=/tmp/torchao
    # The SM clock and the power drawn every 100 ms over each run: the median of each, and of
    # the clock while more than 400 W are drawn (the timed steps rather than start-up).
    clocked() {
      local name=$1; shift
      nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 100 > "/tmp/clocks-$name.csv" &
      local smi=$!
      "$@"
      kill $smi
      sort -t, -k1 -n "/tmp/clocks-$name.csv" | awk -F', ' '{c[NR]=$1} END {printf "%s clock median %s MHz, ", "'"$name"'", c[int(NR/2)+1]}'
      awk -F', ' '$2 > 400 {print $1}' "/tmp/clocks-$name.csv" | sort -n | awk '{c[NR]=$1} END {printf "under load %s MHz (%d samples)\n", c[int(NR/2)+1], NR}'
    }
    clocked bf16 run 1b-bf16 90 --preset llama-1b --steps 10 --warmup 3
    clocked fp8 run 1b-fp8-tensorwise 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise
    clocked torchao peers 1b-torchao 150 llama-1b fp8
    clocked compile peers 1b-compile 150 llama-1b compile
    run 1b-fp8-tensorwise-again 90 --preset llama-1b --steps 10 --warmup 3 --precision fp8-tensorwise --profile
    run 1b-bf16-again 90 --preset llama-1b --steps 10 --warmup 3 --profile
    ;;
esac
