#!/usr/bin/env bash
# Runs peer baselines by name, one after the other, each printing its RESULT line(s).
#
#   examples/bench/peers/run.sh PRESET WHICH... [-- EXTRA_ARGS...]
#
# EXTRA_ARGS go to every peer named (e.g. `-- --steps 40`, or decode's `-- 32 128 128`).
# GPUS=N (default 2) sets the GPUs of the multi-GPU peers, launched by torchrun.
#
# WHICH            what runs                                                   needs
# torch            PyTorch eager (torch_llama.py)
# compile          PyTorch + torch.compile on each block
# tp-torch         + tensor and sequence parallelism over GPUS                   GPUS GPUs
# dp-torch         + DDP over GPUS, each rank its own batch                      GPUS GPUs
# fsdp-torch       + FSDP2 over GPUS (a world of one when GPUS=1)                GPUS GPUs
# fp8              PyTorch + compile + torchao float8 tensorwise (torch_fp8.py)  torchao
# fp8-rowwise      the same, rowwise scaling                                     torchao
# tp-fp8           torchao float8 tensorwise at tp GPUS                          torchao, GPUS GPUs
# moe              the MoE model, torch._grouped_mm experts + compile (torch_moe.py)
# ep-moe           the same with expert parallelism over GPUS                    GPUS GPUs
# cp-torch         context parallelism over GPUS + compile (torch_cp.py; GPUS=1: one GPU)
# hf               a transformers model family + compile (hf_families.py; PRESET from its list)
# collectives      torch.distributed collectives over NCCL (PRESET unused)       GPUS GPUs
# megatron         Megatron Core, local layers (megatron_llama.py)               megatron-core
# tp-megatron      the same at tp GPUS                                           megatron-core, GPUS GPUs
# megatron-moe     Megatron Core's MoE, local layers (megatron_moe.py)           megatron-core
# ep-megatron-moe  the same with expert parallelism over GPUS                    megatron-core, GPUS GPUs
# megatron-pp      Megatron Core's pipeline schedule over GPUS stages            megatron-core, GPUS GPUs
# decode           transformers' generate, static cache (decode.py; EXTRA_ARGS: BATCH PROMPT NEW)
#
# torchao and megatron-core must be importable: scripts/gpu/rows.sh installs their wheels.
set -u
here=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 2 ] || { sed -n '2,30p' "$0"; exit 2; }
preset=$1; shift
which=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do which+=("$1"); shift; done
[ $# -gt 0 ] && shift  # the "--"
extra=("$@")
gpus=${GPUS:-2}
# NVLink multicast off: on shared hosts it can take the GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

one() { echo "== $*"; python3 "$here/$1" "${@:2}" "${extra[@]}"; }
many() { echo "== torchrun ($1 GPUs) ${*:2}"; torchrun --standalone --nproc-per-node "$1" "$here/$2" "${@:3}" "${extra[@]}"; }

status=0
for w in "${which[@]}"; do
  case $w in
    torch) one torch_llama.py --preset "$preset" ;;
    compile) one torch_llama.py --preset "$preset" --compile ;;
    tp-torch) many "$gpus" torch_llama.py --preset "$preset" --tp "$gpus" --compile ;;
    dp-torch) many "$gpus" torch_llama.py --preset "$preset" --dp "$gpus" --compile ;;
    fsdp-torch) many "$gpus" torch_llama.py --preset "$preset" --dp "$gpus" --fsdp --compile ;;
    fp8) one torch_fp8.py --preset "$preset" ;;
    fp8-rowwise) one torch_fp8.py --preset "$preset" --recipe rowwise ;;
    tp-fp8) many "$gpus" torch_fp8.py --preset "$preset" --tp "$gpus" ;;
    moe) one torch_moe.py --preset "$preset" --compile ;;
    ep-moe) many "$gpus" torch_moe.py --preset "$preset" --ep "$gpus" --compile ;;
    cp-torch) many "$gpus" torch_cp.py --preset "$preset" --cp "$gpus" --compile ;;
    hf) one hf_families.py --preset "$preset" --compile ;;
    collectives) many "$gpus" collectives.py ;;
    megatron) many 1 megatron_llama.py --preset "$preset" ;;
    tp-megatron) many "$gpus" megatron_llama.py --preset "$preset" --tp "$gpus" ;;
    megatron-moe) many 1 megatron_moe.py --preset "$preset" ;;
    ep-megatron-moe) many "$gpus" megatron_moe.py --preset "$preset" --ep "$gpus" ;;
    megatron-pp) many "$gpus" megatron_pipeline.py --preset "$preset" --pp "$gpus" ;;
    decode) [ ${#extra[@]} -gt 0 ] || extra=(1 128 128); one decode.py "$preset" ;;
    *) echo "unknown peer $w" >&2; status=2; continue ;;
  esac || status=$?
done
exit $status
