#!/usr/bin/env python3
"""PyTorch peer: the benchmark Llama trained in plain PyTorch, as a PyTorch user would train it.

bf16 autocast over fp32 master weights, fused AdamW (lr 1e-4), SDPA attention (flash), and
  --compile      torch.compile on each block
  --tp N         tensor + sequence parallelism through torch.distributed.tensor.parallel with
                 torchtitan's plan for a Llama block and a vocab-parallel loss (torchrun, N GPUs)
  --dp N         DDP (torchrun, N GPUs): each rank its own batch, gradients all-reduced in 25 MiB
                 buckets during backward; tokens/s counts every rank
  --dp N --fsdp  FSDP2 instead: fully_shard on each block, then the root; bf16 parameters for
                 compute, fp32 gradient reduction, fp32 sharded master weights (torchtitan's
                 default). Without torchrun it runs as a world of one.

  python3 torch_llama.py --preset llama-1b [--compile]
  torchrun --standalone --nproc-per-node 2 torch_llama.py --preset llama-1b --tp 2 --compile
  torchrun --standalone --nproc-per-node 2 torch_llama.py --preset llama-1b --dp 2 [--fsdp] --compile
  python3 torch_llama.py --preset tiny --device cpu --steps 2        (a check without a GPU)

The model classes are shared by the other PyTorch peers (torch_fp8, torch_moe, torch_cp, fp8_curves).
"""
import contextlib
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import common


def rope_tables(seq, head_dim, device=None):
    """cos and sin of (position x frequency), [seq, head_dim / 2], base 10000."""
    freq = 10000.0 ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angle = torch.arange(seq, device=device, dtype=torch.float32)[:, None] * freq[None, :]
    return angle.cos(), angle.sin()


def rotate(x, cos, sin):
    """RoPE on x [batch, seq, heads, head_dim], rotating the two halves of each head (Hugging
    Face's Llama layout), in fp32."""
    first, second = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [seq, 1, head_dim / 2]: the same for every head
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.head_dim = hidden // heads
        self.wq = nn.Linear(hidden, hidden, bias=False)
        self.wk = nn.Linear(hidden, hidden, bias=False)
        self.wv = nn.Linear(hidden, hidden, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        heads = (b, s, -1, self.head_dim)  # -1: under tensor parallelism a rank holds heads / tp
        q = rotate(self.wq(x).view(heads), cos, sin).transpose(1, 2)
        k = rotate(self.wk(x).view(heads), cos, sin).transpose(1, 2)
        v = self.wv(x).view(heads).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden, ffn):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.attention_norm = nn.RMSNorm(p["hidden"], eps=1e-5)
        self.attention = Attention(p["hidden"], p["heads"])
        self.ffn_norm = nn.RMSNorm(p["hidden"], eps=1e-5)
        self.feed_forward = FeedForward(p["hidden"], p["ffn"])

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Embedding, blocks, final RMSNorm, output layer (untied). `block` builds one block from the
    preset (the MoE peer passes its own)."""

    def __init__(self, p, block=Block):
        super().__init__()
        self.tok_embeddings = nn.Embedding(p["vocab"], p["hidden"])
        self.layers = nn.ModuleList(block(p) for _ in range(p["layers"]))
        self.norm = nn.RMSNorm(p["hidden"], eps=1e-5)
        self.output = nn.Linear(p["hidden"], p["vocab"], bias=False)
        cos, sin = rope_tables(p["seq"], p["hidden"] // p["heads"])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens, cos=None, sin=None):
        """Logits [batch, seq, vocab]. cos/sin: the RoPE tables of the positions in `tokens`
        (context parallelism passes its shard's; by default the whole sequence's)."""
        cos = self.cos if cos is None else cos
        sin = self.sin if sin is None else sin
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


def compile_blocks(model):
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block)


def tensor_parallel(model, mesh, float8=False):
    """torchtitan's tensor + sequence parallel plan: the residual stream sharded along the
    sequence (RMSNorm on each rank's shard), gathered before q/k/v and w1/w3 (column-parallel),
    reduce-scattered after wo and w2 (row-parallel); the embedding row-parallel, the output layer
    column-parallel with its logits left sharded for the vocab-parallel loss. float8: torchao's
    float8 styles in the blocks (tensorwise scaling), which gather the activations in float8."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    colwise, rowwise, prepare = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if float8:
        from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel, Float8RowwiseParallel,
                                                           PrepareFloat8ModuleInput)
        colwise, rowwise, prepare = Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput

    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers:
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            # (x, cos, sin): only x is sharded; the tables are the same on every rank.
            "attention": prepare(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": colwise(),
            "attention.wk": colwise(),
            "attention.wv": colwise(),
            "attention.wo": rowwise(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": colwise(),
            "feed_forward.w3": colwise(),
            "feed_forward.w2": rowwise(output_layouts=Shard(1)),
        })


def adamw(model, device, dtensor):
    """AdamW at lr 1e-4: fused over plain tensors, foreach over DTensors (tp, FSDP)."""
    fused = device.type == "cuda" and not dtensor
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=dtensor)


def training_step(model, opt, inputs, labels, device, vocab_parallel=False):
    """One step: bf16 autocast forward, fp32 cross-entropy, backward, AdamW. vocab_parallel: the
    logits are sharded over the vocabulary (tensor parallelism), the loss computed where they lie."""
    from torch.distributed.tensor.parallel import loss_parallel

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(inputs)
        with loss_parallel() if vocab_parallel else contextlib.nullcontext():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def init_distributed(device):
    """A process group over torchrun's ranks, or a world of one without torchrun."""
    if torch.distributed.is_initialized():
        return
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")


def main():
    ap = common.arguments(__doc__.splitlines()[0])
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 over the --dp ranks instead of DDP")
    args = ap.parse_args()
    if args.tp > 1 and (args.dp > 1 or args.fsdp):
        raise SystemExit("--tp with --dp or --fsdp is not part of this peer")
    p = common.preset(args)
    device = common.local_device(args)
    torch.manual_seed(0)  # the same initial weights on every rank

    mesh = None
    if args.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (args.tp,))
    elif args.dp > 1 or args.fsdp:
        init_distributed(device)

    model = Llama(p).to(device)
    if mesh is not None:
        tensor_parallel(model, mesh)
    if args.compile:
        compile_blocks(model)
    if args.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    elif args.dp > 1:
        from torch.nn.parallel import DistributedDataParallel
        ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
    opt = adamw(model, device, dtensor=mesh is not None or args.fsdp)

    # Data-parallel ranks draw their own batches; tensor-parallel ranks share one.
    inputs, labels = common.random_tokens(p, device, seed=1234 + (common.rank() if args.dp > 1 else 0))
    step = training_step(model, opt, inputs, labels, device, vocab_parallel=mesh is not None)
    seconds, loss, peak = common.timed_steps(step, args, device)

    peer = "pytorch" + ("+fsdp2" if args.fsdp else "+ddp" if args.dp > 1 else "") + ("+compile" if args.compile else "")
    common.report(peer, args.preset, p, seconds, loss, common.max_over_ranks(peak, device),
                  gpus=args.tp * args.dp, tp=args.tp, dp=args.dp)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
