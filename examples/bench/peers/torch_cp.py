#!/usr/bin/env python3
"""PyTorch context-parallel peer: torch_llama's model with each sequence split over --cp GPUs by
torch.distributed.tensor.experimental.context_parallel, as torchtitan trains long contexts.

Each step runs inside a context that shards the tokens, the labels and the RoPE tables along the
sequence (in place; load-balanced for the causal mask, the API's default) and turns SDPA into ring
attention, whose K/V exchange --rotate picks. The loss is the local shard's mean; DDP over the CP
group averages the gradients (every rank holds the whole model). bf16 autocast over fp32 master
weights, fused AdamW, --compile on each block. --cp 1 trains the same long sequence on one GPU.
tokens/s counts the whole sequence; TFLOP/s and MFU are per GPU; memory is the fullest rank's.

  python3 torch_cp.py --preset llama-1b-32k --cp 1 --compile
  torchrun --standalone --nproc-per-node 2 torch_cp.py --preset llama-1b-32k --cp 2 --compile [--rotate alltoall]
"""
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import common
from torch_llama import Llama, compile_blocks, rope_tables


def sharding_context(mesh, buffers, seq_dims, no_restore, rotate):
    """context_parallel over `mesh` with the K/V rotation set (`rotate`: allgather or alltoall)."""
    from torch.distributed.tensor.experimental import context_parallel
    try:
        from torch.distributed.tensor.experimental._attention import set_rotate_method
    except ImportError:
        from torch.distributed.tensor.experimental._context_parallel._attention import set_rotate_method
    set_rotate_method(rotate)
    return context_parallel(mesh, buffers=buffers, buffer_seq_dims=seq_dims, no_restore_buffers=no_restore)


def main():
    ap = common.arguments(__doc__.splitlines()[0], default_preset="llama-1b-32k")
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--rotate", default="allgather", choices=["allgather", "alltoall"])
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    p = common.preset(args)
    if int(os.environ.get("WORLD_SIZE", "1")) != args.cp:
        raise SystemExit(f"--cp {args.cp} runs {args.cp} processes: torchrun --nproc-per-node {args.cp}")
    if p["seq"] % (2 * args.cp):
        raise SystemExit(f"seq {p['seq']} does not split into 2 x cp chunks (load balancing)")
    device = common.local_device(args)
    torch.manual_seed(0)  # the same initial weights on every rank

    mesh = None
    if args.cp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda", (args.cp,), mesh_dim_names=("cp",))
    model = Llama(p).to(device)
    if args.compile:
        compile_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    if mesh is not None:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[device.index], process_group=mesh.get_group(),
                                        broadcast_buffers=False, gradient_as_bucket_view=True)

    # The whole sequence on every rank (one seed); the context keeps each rank's shard.
    inputs, labels = common.random_tokens(p, device)
    cos, sin = rope_tables(p["seq"], p["hidden"] // p["heads"], device)

    def step():
        # Fresh copies, as a data loader hands them: the context shards them in place and leaves
        # them so; the tables are sharded along their dim 0 and restored on exit.
        x, y = inputs.clone(), labels.clone()
        context = contextlib.nullcontext()
        if mesh is not None:
            context = sharding_context(mesh, [x, y, cos, sin], [1, 1, 0, 0], {x, y}, args.rotate)
        with context:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(x, cos, sin)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()  # ring attention's backward needs the context too
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    seconds, loss, peak = common.timed_steps(step, args, device)
    if mesh is not None:  # the whole sequence's loss (equal shards)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh.get_group())
    common.report("pytorch-cp" + ("+compile" if args.compile else ""), args.preset, p, seconds, loss,
                  common.max_over_ranks(peak, device), gpus=args.cp, cp=args.cp,
                  rotate=args.rotate if args.cp > 1 else None)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
