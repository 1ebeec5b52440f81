#!/usr/bin/env python3
"""torch.distributed collectives over NCCL, one process a GPU: the peer of `examples/collectives`.

  torchrun --standalone --nproc-per-node 2 collectives.py

All-reduce, all-gather, reduce-scatter and all-to-all of 1 MiB, 16 MiB, 256 MiB and 1 GiB of
bf16: one RESULT line each with the median of 20 calls (after 5 warm-up calls), each timed by
CUDA events on the stream, and the bus bandwidth as nccl-tests defines it: all-reduce moves
2 (n - 1) / n of the buffer over each link, the others (n - 1) / n.
"""
import json
import os
import statistics

import torch
import torch.distributed as dist

SIZES_MIB = (1, 16, 256, 1024)


def median_seconds(call, warmup=5, runs=20):
    for _ in range(warmup):
        call()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main():
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    n, rank = dist.get_world_size(), dist.get_rank()
    for mib in SIZES_MIB:
        count = mib * 2**20 // 2 // n * n  # bf16 elements, a multiple of the ranks
        full = torch.randn(count, device="cuda", dtype=torch.bfloat16)
        gathered = torch.empty_like(full)
        shard = full[: count // n].clone()
        scattered = torch.empty_like(shard)
        ops = {
            "all_reduce": (lambda: dist.all_reduce(full), 2 * (n - 1) / n),
            "all_gather": (lambda: dist.all_gather_into_tensor(gathered, shard), (n - 1) / n),
            "reduce_scatter": (lambda: dist.reduce_scatter_tensor(scattered, full), (n - 1) / n),
            "all_to_all": (lambda: dist.all_to_all_single(gathered, full), (n - 1) / n),
        }
        for op, (call, factor) in ops.items():
            seconds = median_seconds(call)
            if rank == 0:
                size = count * 2
                print("RESULT " + json.dumps(dict(
                    peer="torch-nccl", op=op, bytes=size, gpus=n, time_us=round(seconds * 1e6, 1),
                    busbw_gbps=round(factor * size / seconds / 1e9, 1))), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
