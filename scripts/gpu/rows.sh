#!/usr/bin/env bash
# The measurements of this project on the GPU machine: our binaries beside their peers in the
# same call, on the recipe of the peers (bf16 compute, fp32 master weights, random token ids, 3
# warm-up and 10 timed steps). Run from the repository's root there, one or more modes a call:
#
#   bash scripts/gpu/rows.sh MODE...        e.g. bash scripts/gpu/rows.sh llama fp8
#
# Every run's output goes to $OUT/NAME.log with nvidia-smi's samples beside it; at the end a
# table (also $OUT/summary.txt) and the rest packed into $OUT/logs.tgz. Runs stop at BUDGET
# seconds (default 570: the device stops a command at 600).
#
# What travels (`carry`), named in [brackets] below: the binaries, in .gpu/ from
# scripts/gpu/bundle.sh (built here with `cargo build --release --no-default-features --features
# cuda -p burn-megatron-examples --example bench`, and so on; gpu-suite with `-p
# burn-megatron-tests --bin gpu-suite`; two binaries fit a call, three with XZ_LEVEL=9e), and the
# wheels, in .whl/, fetched here once with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl torchao==0.18.0 megatron-core==0.19.2
# (and /.whl/ in .git/info/exclude). A wheel marked `?` is optional: without it that peer is left
# out. The plays (`shakespeare.txt`): scripts/fetch-shakespeare.sh, then bundled with the binaries.
#
# One GPU:
#   llama        [bench; megatron-core?]   llama-1b bf16 beside PyTorch eager and PyTorch + compile
#                                          (and Megatron Core's local layers)
#   fp8          [bench; torchao]          llama-1b fp8-tensorwise-promoted beside torchao float8
#                                          tensorwise + compile
#   recipes      [bench]                   llama-1b under bf16, then under every low-precision recipe
#   curves       [train, shakespeare.txt]  llama-1b trained 300 steps on the plays under bf16 and each
#                                          of RECIPES (default fp8-tensorwise-promoted fp8-blockwise),
#                                          from each of SEEDS (default 1 2); losses against bf16's
#   curves-torch [shakespeare.txt; torchao] the same in PyTorch: bf16 and torchao float8 tensorwise
#   moe          [bench; megatron-core?]   moe-4b beside PyTorch's grouped_mm MoE + compile (and
#                                          Megatron Core's MoE)
#   families     [bench]                   qwen3-1.7b, qwen3-moe-2b and dsv3-2b beside transformers + compile
#                                          (hf_families.py)
#   context      [bench]                   llama-1b-32k at cp 1 beside PyTorch at cp 1 + compile; on
#                                          two GPUs also cp 2 beside PyTorch's context parallelism
#   decode       [generate]                decode speed (CUDA graph, and --eager) beside transformers'
#                                          generate (static cache, compiled): SmolLM2-135M's and
#                                          llama-1b's shapes at batch 1 and 32, 128 tokens after 128
#   gemm         [bench]                   bench --gemm (our GEMM) beside cuBLAS, bf16 and FP8
#   attention    [bench]                   bench --attention beside PyTorch's SDPA (flash, cuDNN)
#   grouped      [bench]                   bench --grouped beside torch._grouped_mm, moe-4b's shapes
#   recompute    [bench]                   llama-1b with no, selective and full recomputation
#   kernels      [bench, generate?]        ncu's time of each kernel of a llama-1b step, ours and
#                                          PyTorch + compile's; of eager decoding at batch 1 and 32
#   ab           [bench0, bench]           40 llama-1b steps of a build before (bench0) and of bench,
#                                          alternating, twice
#   suite        [gpu-suite]               the GPU test suite with its ranks as threads on GPU 0, then
#                                          its kernel tests (FILTER=TEXT [WORLD=N]: the tests matching
#                                          TEXT only, e.g. FILTER=kernel_suite WORLD=1)
#   smoke        [torchao?, megatron-core?] every peer on the tiny presets for 2 steps
#   guard        [train, generate?]       no silent failure: a llama-1b job past the card refused
#                                          before it starts and the microbatch it names trained; the
#                                          Learner driver on the tiny job; past
#                                          the card with the check off, the step's typed error (plain
#                                          and Learner drivers, generate); the gradient check's cost
#                                          (bench --no-finite-check beside bench, with bench); two
#                                          runs of 20 steps compared bit for bit
#   launch       [train]                   the README's launch lines on one GPU: torchrun on one
#                                          node, torchrun's c10d rendezvous, a SLURM task's command
#                                          (SLURM's variables set by hand: no SLURM here)
# Two GPUs:
#   tp           [bench; megatron-core?]   llama-1b at tp 2 + SP beside PyTorch tp 2 + SP + compile
#   dp           [bench]                   llama-1b at dp 2 beside PyTorch DDP, then FSDP2 (+ compile)
#   llama-8b     [bench; torchao]          llama-8b at tp 2 + SP beside PyTorch, bf16 then FP8 beside
#                                          torchao float8 (~80 GB a GPU: ask for H200s)
#   pipeline     [bench; megatron-core?]   llama-8b at pp 2 (1F1B, interleaved) and at tp 2, beside
#                                          Megatron Core's pipeline schedule
#   collectives  [collectives]             our collectives (threads, processes) beside torch.distributed
set -u
cd "$(dirname "$0")/../.." || exit
# shellcheck source=scripts/gpu/lib.sh
. scripts/gpu/lib.sh
[ $# -gt 0 ] || { sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 2; }
trap finish EXIT
ROW=(--steps 10 --warmup 3)  # the recipe's timing: 3 warm-up steps, then the mean of 10
export PYTHONUNBUFFERED=1
describe_machine
install_wheels

# The plays for the loss curves: carried in the bundle (or as data/).
plays() {
  [ -f data/shakespeare.txt ] && { echo data/shakespeare.txt; return; }
  [ -f .gpu/shakespeare.txt.xz ] && xz -dc .gpu/shakespeare.txt.xz >/tmp/shakespeare.txt && echo /tmp/shakespeare.txt
}

# train_curve RECIPE SEED: llama-1b on the plays, bytes as tokens, batch 1 x 2048, lr 3e-4; its
# metrics in $OUT/train-RECIPE-seedSEED.jsonl.
train_curve() {
  gpu "train-$1-seed$2" 100 train --preset llama-1b --device cuda --dtype bf16 --init per-shard \
    --precision "$1" --data "$DATA" --steps "${CURVE_STEPS:-300}" --batch 1 --lr 3e-4 --sample-every 0 --seed "$2" \
    --plain --metrics "$OUT/train-$1-seed$2.jsonl"
}

# profile NAME MARKER COMMAND...: ncu's time of every kernel COMMAND launches, then one step's
# kernels by name (kernel_times.py: the launches between the last two optimizer blocks; MARKER
# names the optimizer's kernels, `-` takes every kernel).
profile() {
  local name=$1 marker=$2 ncu
  shift 2
  ncu=$(command -v ncu || find /opt/nvidia/nsight-compute -maxdepth 2 -name ncu -type f 2>/dev/null | head -1)
  [ -n "$ncu" ] || { echo "-- $name: skipped, no ncu"; return 1; }
  measure "$name" 280 "$ncu" --clock-control none --target-processes all --csv --page raw --print-units base \
    --metrics gpu__time_duration.sum "$@" &&
    python3 examples/bench/peers/kernel_times.py "$LOG" "$marker" 30 | tee "${LOG%.log}.txt"
}

for mode in "$@"; do
  echo "== $mode ($SECONDS s)"
  case $mode in
    llama)
      ours llama-1b-bf16 120 --preset llama-1b "${ROW[@]}"
      peer torch-eager 150 llama-1b torch
      peer torch-compile 200 llama-1b compile
      wheel megatron_core && peer megatron-local 150 llama-1b megatron
      ;;
    fp8)
      wheel torchao || continue
      ours llama-1b-fp8-promoted 120 --preset llama-1b "${ROW[@]}" --precision fp8-tensorwise-promoted
      peer torchao-tensorwise 200 llama-1b fp8
      ;;
    recipes)
      ours llama-1b-bf16 90 --preset llama-1b "${ROW[@]}"
      for recipe in fp8-tensorwise fp8-tensorwise-promoted fp8-tensorwise-e4m3 fp8-tensorwise-e4m3-promoted \
        fp8-delayed fp8-blockwise mxfp8 nvfp4; do
        ours "llama-1b-$recipe" 90 --preset llama-1b "${ROW[@]}" --precision "$recipe"
      done
      ;;
    curves)
      needs train || continue
      DATA=$(plays) || { echo "-- skipped: carry the plays (bundle data/shakespeare.txt)"; continue; }
      read -ra recipes <<<"${RECIPES:-fp8-tensorwise-promoted fp8-blockwise}"
      read -ra seeds <<<"${SEEDS:-1 2}"
      for seed in "${seeds[@]}"; do  # each seed's runs together: a call cut short still compares
        for recipe in default "${recipes[@]}"; do train_curve "$recipe" "$seed"; done
      done
      args=()
      for recipe in default "${recipes[@]}"; do
        logs=$(compgen -G "$OUT/train-$recipe-seed*.jsonl" | paste -sd,)
        [ -n "$logs" ] && args+=("${recipe/default/bf16}=$logs")
      done
      python3 scripts/plot-curves.py "$OUT/curves.svg" "${args[@]}"
      ;;
    curves-torch)
      wheel torchao || continue
      DATA=$(plays) || { echo "-- skipped: carry the plays (bundle data/shakespeare.txt)"; continue; }
      read -ra seeds <<<"${SEEDS:-1 2}"
      measure torch-curves 560 python3 examples/bench/peers/fp8_curves.py --data "$DATA" \
        --seeds "${seeds[@]}" --budget $((BUDGET - SECONDS - 90))
      python3 scripts/plot-curves.py "${LOG%.log}.svg" "$LOG"
      ;;
    moe)
      ours moe-4b 150 --preset moe-4b "${ROW[@]}"
      peer torch-moe 200 moe-4b moe
      wheel megatron_core && peer megatron-moe 200 moe-4b megatron-moe
      ;;
    families)
      for preset in qwen3-1.7b qwen3-moe-2b dsv3-2b; do
        ours "$preset" 180 --preset "$preset" "${ROW[@]}"
        peer "hf-$preset" 300 "$preset" hf
      done
      ;;
    context)
      ours llama-1b-32k-cp1 240 --preset llama-1b-32k "${ROW[@]}"
      GPUS=1 peer torch-cp1 240 llama-1b-32k cp-torch
      needs_gpus 2 || continue
      ours llama-1b-32k-cp2 240 --preset llama-1b-32k "${ROW[@]}" --cp 2
      GPUS=2 peer torch-cp2 240 llama-1b-32k cp-torch
      ;;
    decode)
      needs generate || continue
      for preset in smollm2-135m llama-1b; do
        for batch in 1 32; do
          decode=(--preset "$preset" --device cuda --batch "$batch" --prompt-len 128 --max-new 128)
          gpu "decode-$preset-b$batch-graph" 120 generate "${decode[@]}"
          gpu "decode-$preset-b$batch-eager" 120 generate "${decode[@]}" --eager
          peer "decode-$preset-b$batch-hf" 120 "$preset" decode -- "$batch" 128 128
        done
      done
      ;;
    gemm)
      if ours gemm-ours 300 --gemm --kernels Wgmma; then
        echo "CHECK lines off bf16's rounding:"
        grep -h '^CHECK' "$LOG" | grep -v '"rel_error": [0-9.]*e-[34]' | cut -c1-300
      fi
      measure gemm-cublas 200 python3 examples/bench/peers/gemm.py
      ;;
    attention)
      ours attention-ours 120 --attention
      measure attention-sdpa 150 python3 examples/bench/peers/attention.py
      ;;
    grouped)
      ours grouped-ours 120 --grouped || continue
      sizes=$(sed -n 's/^GROUP_SIZES //p' "$LOG")
      measure grouped-cublas 90 python3 examples/bench/peers/grouped_gemm.py "$sizes"
      ;;
    recompute)
      for recompute in none selective full:1; do
        ours "llama-1b-recompute-$recompute" 120 --preset llama-1b "${ROW[@]}" --recompute "$recompute"
      done
      ;;
    kernels)
      # Ours: 2 warm-up steps and a timed one (the first step's optimizer compacts the parameters).
      needs bench && profile ncu-ours adamw -c 6000 bash .gpu/run.sh bench --preset llama-1b --steps 1 --warmup 2
      profile ncu-compile '[Aa]dam' --profile-from-start off \
        python3 examples/bench/peers/torch_llama.py --preset llama-1b --compile --steps 2 --profile-steps
      needs generate || continue
      for batch in 1 32; do
        profile "ncu-decode-b$batch" - -c 8000 bash .gpu/run.sh generate --preset llama-1b --device cuda \
          --batch "$batch" --prompt-len 128 --max-new 4 --eager
      done
      ;;
    ab)
      for round in 1 2; do
        BENCH=bench0 ours "before-$round" 120 --preset llama-1b --steps 40 --warmup 3
        ours "after-$round" 120 --preset llama-1b --steps 40 --warmup 3
      done
      ;;
    suite)
      if [ -n "${FILTER:-}" ]; then
        gpu suite 560 gpu-suite --one-gpu --world "${WORLD:-2}" --filter "$FILTER"
      else
        gpu suite 480 gpu-suite --one-gpu --world 2 --skip kernel_suite
        gpu suite-kernels 300 gpu-suite --world 1 --filter kernel_suite
      fi
      ;;
    smoke)
      quick=(-- --steps 2 --warmup 1)
      GPUS=1 peer smoke-llama 240 tiny torch compile fsdp-torch cp-torch "${quick[@]}"
      peer smoke-moe 120 tiny-moe moe "${quick[@]}"
      wheel torchao && peer smoke-fp8 120 tiny fp8 "${quick[@]}"
      wheel megatron_core && peer smoke-megatron 150 tiny megatron "${quick[@]}" &&
        peer smoke-megatron-moe 150 tiny-moe megatron-moe "${quick[@]}"
      peer smoke-hf 200 qwen3-moe-2b hf -- --steps 2 --warmup 1 --batch 1 --seq 256
      ;;
    guard)
      # The job's warm-up (30 steps) does not fit these short runs: a constant rate.
      job=(--config examples/jobs/llama-1b.toml --device cuda --schedule.kind constant)
      if needs train; then
        gpu preflight-96 90 train "${job[@]}" --plain --steps 2 --batch.global 96
        fits=$(sed -n 's/.*at most \([0-9]*\) sequences a microbatch fit.*/\1/p' "$LOG" | head -1)
        [ -n "$fits" ] && gpu "preflight-fits-$fits" 150 train "${job[@]}" --plain --steps 3 --batch.global "$fits"
        gpu learner-tiny 90 train --config examples/jobs/tiny.toml --device cuda --steps 5
        gpu oom-plain 120 train "${job[@]}" --plain --steps 2 --batch.global 128 --guard.memory false
        gpu oom-learner 120 train "${job[@]}" --steps 2 --batch.global 128 --guard.memory false
        for run in a b; do
          gpu "repeat-$run" 120 train "${job[@]}" --plain --steps 20 --model.layers 4 \
            --logging.metrics "$OUT/repeat-$run.jsonl"
        done
        python3 - "$OUT/repeat-a.jsonl" "$OUT/repeat-b.jsonl" <<'PY'
import json, sys
runs = [[json.loads(l)["loss"] for l in open(p) if '"loss"' in l] for p in sys.argv[1:]]
print("REPEAT", len(runs[0]), "steps,", "bitwise equal" if runs[0] == runs[1] else f"DIFFER: {runs}")
PY
        # The check's cost where no clipping pass pays for it: 40 steps without and with, ROUNDS
        # times (2).
        sed '/clip_grad/d' examples/jobs/llama-1b.toml >"$OUT/noclip.toml"
        for round in $(seq "${ROUNDS:-2}"); do
          for check in off stop; do
            gpu "train-check-$check-$round" 120 train --config "$OUT/noclip.toml" --device cuda --plain \
              --steps 40 --guard.nonfinite "$check" --logging.metrics "$OUT/check-$check-$round.jsonl"
          done
        done
        python3 - "$OUT" <<'PY'
import json, statistics, sys
rate = lambda p: statistics.mean(json.loads(l)["tokens_per_s"] for l in list(open(p))[10:] if '"loss"' in l)
import glob
off = [rate(p) for p in sorted(glob.glob(f"{sys.argv[1]}/check-off-*.jsonl"))]
on = [rate(p) for p in sorted(glob.glob(f"{sys.argv[1]}/check-stop-*.jsonl"))]
print("CHECK tokens/s off", [round(x) for x in off], "on", [round(x) for x in on],
      f"cost {100 * (1 - statistics.mean(on) / statistics.mean(off)):.2f}%")
PY
      fi
      needs generate && gpu oom-generate 120 generate --preset llama-1b --device cuda --batch 1024 \
        --prompt-len 2040 --max-new 8
      if needs bench; then
        for round in 1 2; do
          ours "check-off-$round" 120 --preset llama-1b "${ROW[@]}" --no-finite-check
          ours "check-on-$round" 120 --preset llama-1b "${ROW[@]}"
        done
      fi
      ;;
    launch)
      needs train || continue
      run=(--config examples/jobs/tiny.toml --plain --steps 5 --device cuda)
      measure torchrun-one-node 120 torchrun --no-python --nproc-per-node 1 bash .gpu/run.sh train "${run[@]}"
      measure torchrun-c10d 120 torchrun --no-python --nnodes 1 --nproc-per-node 1 \
        --rdzv-backend c10d --rdzv-endpoint localhost:29400 bash .gpu/run.sh train "${run[@]}"
      measure slurm-task 120 env SLURM_PROCID=0 SLURM_NTASKS=1 SLURM_LOCALID=0 MASTER_ADDR=127.0.0.1 \
        MASTER_PORT=29500 bash -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID \
        exec bash .gpu/run.sh train "$@"' task "${run[@]}"
      ;;
    tp)
      needs_gpus 2 || continue
      ours llama-1b-tp2-sp 150 --preset llama-1b "${ROW[@]}" --tp 2 --sp
      peer torch-tp2 200 llama-1b tp-torch
      wheel megatron_core && peer megatron-tp2 150 llama-1b tp-megatron
      ;;
    dp)
      needs_gpus 2 || continue
      ours llama-1b-dp2 150 --preset llama-1b "${ROW[@]}" --dp 2 --profile
      peer torch-ddp2 200 llama-1b dp-torch
      peer torch-fsdp2 200 llama-1b fsdp-torch
      ;;
    llama-8b)
      needs_gpus 2 || continue
      ours llama-8b-tp2-sp 200 --preset llama-8b "${ROW[@]}" --tp 2 --sp
      peer torch-8b-tp2 200 llama-8b tp-torch
      wheel torchao || continue
      ours llama-8b-tp2-fp8-promoted 200 --preset llama-8b "${ROW[@]}" --tp 2 --sp --precision fp8-tensorwise-promoted
      peer torchao-8b-tp2 200 llama-8b tp-fp8
      ;;
    pipeline)
      needs_gpus 2 || continue
      ours llama-8b-pp2 200 --preset llama-8b --pp 2 --batch 8 --microbatches 8 "${ROW[@]}"
      ours llama-8b-pp2-vpp2 200 --preset llama-8b --pp 2 --vpp 2 --batch 8 --microbatches 8 "${ROW[@]}"
      ours llama-8b-tp2-b8 170 --preset llama-8b --tp 2 --sp --batch 8 "${ROW[@]}"
      wheel megatron_core || continue
      for vpp in 1 2; do
        peer "megatron-pp2-vpp$vpp" 300 llama-8b megatron-pp -- --batch 8 --microbatches 8 --vpp "$vpp"
      done
      ;;
    collectives)
      needs_gpus 2 || continue
      gpu collectives-threads 150 collectives
      gpu collectives-processes 150 collectives --processes
      GPUS=$NGPU peer collectives-torch 150 - collectives
      ;;
    *) echo "unknown mode $mode: see the header of $0" ;;
  esac
done
