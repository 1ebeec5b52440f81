#!/usr/bin/env python3
"""PyTorch MoE peer: the moe-4b model (torch_llama's attention, a mixture of experts in every
block) in plain PyTorch, as torchtitan builds it.

The MoE: a linear router in fp32 (softmax over the experts, top k, the k weights renormalized),
the Switch load-balancing loss x 1e-2 added to the loss, dropless; the (token, expert) pairs
sorted by expert, the SwiGLU experts run as three torch._grouped_mm products over the sorted
rows, the outputs weighted and summed back onto their tokens. bf16 autocast over fp32 master
weights, fused AdamW (lr 1e-4), --compile on each block.

--ep N (torchrun, N GPUs): expert parallelism over ranks that are also data-parallel: each rank
its own batch, E/N of the experts and the whole dense part (DDP all-reduces its gradients); the
rows travel to the rank of their expert and back by all_to_all_single.

  python3 torch_moe.py --preset moe-4b --compile
  torchrun --standalone --nproc-per-node 2 torch_moe.py --preset moe-4b --ep 2 --compile
  python3 torch_moe.py --preset tiny-moe --device cpu --steps 2     (a check without a GPU)
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import common
from torch_llama import Attention, Llama, compile_blocks

AUX_LOSS_WEIGHT = 1e-2


class Exchange(torch.autograd.Function):
    """all_to_all_single with uneven splits; the gradient travels the reverse way."""

    @staticmethod
    def forward(ctx, rows, send, receive):  # send[r]: rows for rank r; receive[r]: rows from r
        ctx.splits = (send, receive)
        out = rows.new_empty((sum(receive), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=receive, input_split_sizes=send)
        return out

    @staticmethod
    def backward(ctx, grad):
        send, receive = ctx.splits
        return Exchange.apply(grad, receive, send), None, None


def inverse(permutation):
    out = torch.empty_like(permutation)
    out[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return out


class MoE(nn.Module):
    def __init__(self, p, ep=1):
        super().__init__()
        hidden, ffn = p["hidden"], p["ffn"]
        self.experts, self.topk, self.ep = p["experts"], p["topk"], ep
        local = self.experts // ep
        self.router = nn.Linear(hidden, self.experts, bias=False)
        # This rank's experts, stacked [expert, in, out] as torch._grouped_mm takes them.
        self.w1 = nn.Parameter(torch.randn(local, hidden, ffn) * 0.02)
        self.w3 = nn.Parameter(torch.randn(local, hidden, ffn) * 0.02)
        self.w2 = nn.Parameter(torch.randn(local, ffn, hidden) * 0.02)
        for w in (self.w1, self.w3, self.w2):
            w.expert = True  # differs from rank to rank: kept out of DDP

    def run_experts(self, rows, counts):
        """SwiGLU of bf16 rows sorted by expert, counts[j] rows for this rank's expert j."""
        w1, w3, w2 = (w.to(torch.bfloat16) for w in (self.w1, self.w3, self.w2))
        if rows.device.type != "cuda":  # no grouped GEMM off the GPU: one product an expert
            groups = rows.split(counts.tolist())
            return torch.cat([(F.silu(x @ w1[j]) * (x @ w3[j])) @ w2[j] for j, x in enumerate(groups)])
        ends = torch.cumsum(counts, 0, dtype=torch.int32)
        gated = F.silu(torch._grouped_mm(rows, w1, offs=ends)) * torch._grouped_mm(rows, w3, offs=ends)
        return torch._grouped_mm(gated, w2, offs=ends)

    @torch.compiler.disable  # the split sizes depend on the routing: the exchange runs eagerly
    def run_experts_remote(self, rows, counts):
        """Rows sorted by (global) expert go to the ranks holding their experts, run there,
        and come back in the order they left."""
        ep, local = self.ep, self.experts // self.ep
        arriving = torch.empty_like(counts)
        dist.all_to_all_single(arriving, counts)  # arriving[r * local + j]: rank r's rows for my expert j
        send = counts.view(ep, local).sum(1).tolist()
        receive = arriving.view(ep, local).sum(1).tolist()
        arrived = Exchange.apply(rows, send, receive)  # by source rank, then by expert
        expert = torch.arange(local, device=rows.device).repeat(ep)
        by_expert = expert.repeat_interleave(arriving, output_size=arrived.shape[0]).argsort(stable=True)
        out = self.run_experts(arrived[by_expert], arriving.view(ep, local).sum(0))
        return Exchange.apply(out[inverse(by_expert)], receive, send)

    def forward(self, x):
        shape, tokens = x.shape, x.reshape(-1, x.shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            probs = F.linear(tokens.float(), self.router.weight.float()).softmax(-1)
        weights, chosen = probs.topk(self.topk, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        chosen = chosen.flatten()  # slot i belongs to token i // topk
        counts = torch.zeros(self.experts, dtype=torch.long, device=x.device).scatter_add_(
            0, chosen, torch.ones_like(chosen))
        # Switch: experts x sum over e of (share of slots routed to e) x (mean probability of e).
        aux = self.experts * torch.dot(counts.float() / chosen.numel(), probs.mean(0))
        order = chosen.argsort(stable=True)
        token = order // self.topk
        rows = tokens.to(torch.bfloat16).index_select(0, token)
        out = self.run_experts(rows, counts) if self.ep == 1 else self.run_experts_remote(rows, counts)
        out = (out.float() * weights.flatten()[order, None]).to(torch.bfloat16)
        combined = torch.zeros(tokens.shape, dtype=torch.bfloat16, device=x.device).index_add_(0, token, out)
        return combined.view(shape), aux


class MoEBlock(nn.Module):
    def __init__(self, p, ep=1):
        super().__init__()
        self.attention_norm = nn.RMSNorm(p["hidden"], eps=1e-5)
        self.attention = Attention(p["hidden"], p["heads"])
        self.ffn_norm = nn.RMSNorm(p["hidden"], eps=1e-5)
        self.moe = MoE(p, ep)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        out, aux = self.moe(self.ffn_norm(x))
        return x + out, aux


class MoELlama(Llama):
    def __init__(self, p, ep=1):
        super().__init__(p, block=lambda p: MoEBlock(p, ep))

    def forward(self, tokens):
        """(logits, the blocks' summed load-balancing loss)."""
        x, aux = self.tok_embeddings(tokens), 0.0
        for layer in self.layers:
            x, block_aux = layer(x, self.cos, self.sin)
            aux = aux + block_aux
        return self.output(self.norm(x)), aux


def main():
    moe_presets = [name for name, p in common.PRESETS.items() if "experts" in p]
    ap = common.arguments(__doc__.splitlines()[0], default_preset="moe-4b", presets=moe_presets)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--ep", type=int, default=1)
    args = ap.parse_args()
    p = common.preset(args)
    device = common.local_device(args)
    if args.ep > 1:
        dist.init_process_group("nccl")
        if dist.get_world_size() != args.ep or p["experts"] % args.ep:
            raise SystemExit("--ep N runs N processes and needs N to divide the experts")
    torch.manual_seed(common.rank())  # each rank its own experts; DDP gives all rank 0's dense weights
    with torch.device(device):  # ~4.6B parameters: built on the GPU directly
        model = MoELlama(p, args.ep)
    if args.compile:
        compile_blocks(model)
    expert_names = [n for n, w in model.named_parameters() if getattr(w, "expert", False)]
    experts = [model.get_parameter(n) for n in expert_names]
    net = model
    if args.ep > 1:
        from torch.nn.parallel import DistributedDataParallel
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_names)
        net = DistributedDataParallel(model, broadcast_buffers=False, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    inputs, labels = common.random_tokens(p, device, seed=1234 + common.rank())

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits, aux = net(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        (loss + AUX_LOSS_WEIGHT * aux).backward()
        if args.ep > 1:  # an expert's gradient sums every rank's batch: average it, as DDP does the rest
            torch._foreach_div_([w.grad for w in experts if w.grad is not None], args.ep)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    seconds, loss, peak = common.timed_steps(step, args, device)
    common.report("pytorch-moe" + ("+compile" if args.compile else ""), args.preset, p, seconds, loss,
                  common.max_over_ranks(peak, device), gpus=args.ep, dp=args.ep, ep=args.ep,
                  experts=p["experts"], topk=p["topk"])
    if args.ep > 1:
        del step, net  # DDP's reducer goes before the process group
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
