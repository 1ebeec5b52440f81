#!/usr/bin/env python3
"""Megatron Core MoE peer: the moe-4b model built with Megatron Core 0.19 from its own layers
only (local spec: no Transformer Engine, no Apex), as megatron_llama.py builds the Llama.

Every MLP a MoELayer: top-k router in fp32 (softmax over the k chosen logits, which is the
renormalized top-k of the softmax over all experts), Switch aux loss x 1e-2 (Megatron adds its
gradient itself; the reported loss is the cross-entropy), the all-to-all token dispatcher, and
the experts as SequentialMLP, a loop of SwiGLU MLPs: in 0.19 the local spec has no grouped-GEMM
experts (those need Transformer Engine). --ep N (torchrun, N GPUs): the N ranks are the
expert-parallel group and the data-parallel group of the dense weights, each rank its own batch;
Megatron's DistributedDataParallel reduces the gradients during backward.

  torchrun --standalone --nproc-per-node 1 megatron_moe.py --preset moe-4b
  torchrun --standalone --nproc-per-node 2 megatron_moe.py --preset moe-4b --ep 2
"""
import torch

import common
from megatron_llama import gpt_model, positions, start, transformer_config, version


def main():
    moe_presets = [name for name, p in common.PRESETS.items() if "experts" in p]
    ap = common.arguments(__doc__.splitlines()[0], default_preset="moe-4b", presets=moe_presets)
    ap.add_argument("--ep", type=int, default=1)
    args = ap.parse_args()
    p = common.preset(args)
    device = start(args, tensor_model_parallel_size=1, expert_model_parallel_size=args.ep)
    if torch.distributed.get_world_size() != args.ep:
        raise SystemExit("--ep N runs N processes: the expert-parallel group is the whole world")
    config = transformer_config(p, tensor_model_parallel_size=1, expert_model_parallel_size=args.ep)
    model = gpt_model(p, config)
    params = [w for w in model.parameters() if w.requires_grad]
    ddp = None
    if args.ep > 1:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=True,
                                                   use_distributed_optimizer=False)
        model = ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    inputs, labels = common.random_tokens(p, device, seed=1234 + common.rank())
    where = positions(p)

    def step():
        loss = model(inputs, where, None, labels=labels).float().mean()
        loss.backward()
        if ddp is not None:
            # As Megatron's training loop: wait for the reduction, then step on its buffers.
            ddp.finish_grad_sync()
            for w in params:
                w.grad = w.main_grad
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ddp is not None:
            ddp.zero_grad_buffer()
        return loss.detach()

    seconds, loss, peak = common.timed_steps(step, args, device)
    common.report("megatron-core-local-moe", args.preset, p, seconds, loss, common.max_over_ranks(peak, device),
                  gpus=args.ep, dp=args.ep, ep=args.ep, experts=p["experts"], topk=p["topk"],
                  megatron_core=version())
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
