# Helpers of scripts/gpu/rows.sh (sourced from the repository's root): each run under a timeout
# that fits the call, its GPUs sampled by nvidia-smi, its output in $OUT; at the end a summary
# table and the logs packed into one file.
# shellcheck shell=bash

OUT=${OUT:-/tmp/rows}
mkdir -p "$OUT"
# The device stops a command at 600 s; runs end by BUDGET, which leaves time to pack the logs.
BUDGET=${BUDGET:-570}
RUNS="$OUT/runs.tsv"
PEERS=examples/bench/peers/run.sh
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')

# measure NAME LIMIT COMMAND...: runs COMMAND with its output in $OUT/NAME.log, stopped after
# LIMIT seconds or when the call's budget runs out, every GPU's memory, SM clock, power and
# utilization sampled every 200 ms into $OUT/NAME.smi. Skipped with under 20 s left. A name
# used before in the call becomes NAME-2, NAME-3...; LOG holds the log's path.
measure() {
  local base=$1 name=$1 limit=$2 rest=$((BUDGET - SECONDS)) start=$SECONDS smi rc n=2
  shift 2
  while [ -e "$OUT/$name.log" ]; do
    name="$base-$n" n=$((n + 1))
  done
  if [ "$rest" -lt 20 ]; then
    echo "-- $name: skipped, ${rest} s left"
    printf '%s\tskipped\t0\n' "$name" >>"$RUNS"
    return 1
  fi
  [ "$limit" -gt "$rest" ] && limit=$rest
  LOG="$OUT/$name.log"
  nvidia-smi --query-gpu=index,memory.used,clocks.sm,power.draw,utilization.gpu \
    --format=csv,noheader,nounits -lms 200 >"$OUT/$name.smi" 2>/dev/null &
  smi=$!
  timeout -k 10 "$limit" "$@" >"$LOG" 2>&1
  rc=$?
  kill "$smi" 2>/dev/null
  wait "$smi" 2>/dev/null
  printf '%s\t%s\t%s\n' "$name" "$rc" $((SECONDS - start)) >>"$RUNS"
  echo "-- $name: rc $rc, $((SECONDS - start)) s"
  grep -h -m 4 -e '^RESULT' -e 'panicked' -e 'Error' -e ' passed, ' "$LOG" | cut -c1-300
  return "$rc"
}

# needs BINARY...: true when .gpu/ holds each (bundle.sh); else says what to carry.
needs() {
  local b
  for b in "$@"; do
    [ -f ".gpu/$b.xz" ] || { echo "-- skipped: carry .gpu with $b (scripts/gpu/bundle.sh)"; return 1; }
  done
}

# gpu NAME LIMIT BINARY ARGS...: a bundled binary, measured.
gpu() {
  local name=$1 limit=$2 binary=$3
  shift 3
  needs "$binary" && measure "$name" "$limit" bash .gpu/run.sh "$binary" "$@"
}

# ours NAME LIMIT ARGS...: bench (BENCH=NAME picks another bundled build of it).
ours() {
  local name=$1 limit=$2
  shift 2
  gpu "$name" "$limit" "${BENCH:-bench}" "$@"
}

# peer NAME LIMIT PRESET WHICH... [-- ARGS]: the repository's peers (GPUS: their GPU count).
peer() {
  local name=$1 limit=$2
  shift 2
  measure "$name" "$limit" env GPUS="${GPUS:-2}" bash "$PEERS" "$@"
}

# wheel NAME: true when .whl/ holds NAME's wheel (installed by install_wheels).
wheel() {
  compgen -G ".whl/$1-*.whl" >/dev/null || { echo "-- skipped: carry .whl with the $1 wheel"; return 1; }
}

# needs_gpus N: true when the machine has N GPUs.
needs_gpus() {
  [ "$NGPU" -ge "$1" ] || { echo "-- skipped: needs $1 GPUs, this machine has $NGPU"; return 1; }
}

# The carried wheels (torchao, megatron-core), installed once where Python finds them.
install_wheels() {
  compgen -G ".whl/*.whl" >/dev/null || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
}

# What ran where: the GPUs, their clocks and power limit, the bundle's commit.
describe_machine() {
  nvidia-smi --query-gpu=index,name,clocks.max.sm,power.limit,memory.total --format=csv,noheader
  [ -f .gpu/BUILD ] && cat .gpu/BUILD
  python3 -c 'import torch; print("torch", torch.__version__)' 2>/dev/null
}

# The summary table (also $OUT/summary.txt), then every other file of $OUT packed into
# $OUT/logs.tgz: the device returns a few files only.
finish() {
  [ -f "$RUNS" ] && python3 scripts/gpu/summary.py "$RUNS" >"$OUT/summary.txt" 2>&1
  echo
  cat "$OUT/summary.txt" 2>/dev/null
  (cd "$OUT" && compgen -G '*.log' >/dev/null &&
    tar czf /tmp/logs.tgz --remove-files --exclude=summary.txt --exclude='*.svg' --exclude=logs.tgz -- * &&
    mv /tmp/logs.tgz .)
}
