"""What every training peer shares: the workloads, the FLOP count, the timed loop and the RESULT line.

The workloads and the conventions are the project's benchmark recipe:
- presets: a Llama-style decoder (RMSNorm, multi-head attention with RoPE, SwiGLU MLP, no biases,
  untied embedding and output layer) at the sizes below; `experts`/`topk` make every MLP a MoE;
- FLOPs a step (Megatron's convention, no causal discount), with
  P = layers * (4 h^2 + 3 h ffn) + vocab * h  (a MoE layer counts the top-k experts a token visits
  and its router instead of the dense MLP):  batch * seq * (6 P + 12 layers seq h);
- MFU divides the FLOP/s of one GPU by the dense bf16 peak of an H100/H200 SXM;
- timing: 3 warm-up steps, then the mean of >= 10 steps, the device synchronized around them;
- one `RESULT {json}` line a configuration, keys in the order our own `bench` prints them.
"""
import argparse
import json
import os
import time

import torch

PEAK_BF16_FLOPS = 989.4e12

PRESETS = {
    # A correctness run in seconds, on any device.
    "tiny": dict(hidden=256, layers=2, heads=4, ffn=688, vocab=1024, seq=256, batch=2),
    "tiny-moe": dict(hidden=256, layers=2, heads=4, ffn=128, vocab=1024, seq=256, batch=2, experts=8, topk=2),
    # The one-GPU benchmark: about 1B parameters.
    "llama-1b": dict(hidden=2048, layers=16, heads=16, ffn=5632, vocab=32768, seq=2048, batch=4),
    # Wide enough for tensor parallelism to pay: Llama-3-8B's shape with multi-head attention.
    "llama-8b": dict(hidden=4096, layers=32, heads=32, ffn=14336, vocab=32768, seq=4096, batch=1),
    # llama-1b at 32k tokens a sequence: context parallelism's workload.
    "llama-1b-32k": dict(hidden=2048, layers=16, heads=16, ffn=5632, vocab=32768, seq=32768, batch=1),
    # llama-1b's attention with 32 experts of ffn 1408 in every block, top 4: ~4.6B parameters, ~1B active.
    "moe-4b": dict(hidden=2048, layers=16, heads=16, ffn=1408, vocab=32768, seq=2048, batch=4,
                   experts=32, topk=4),
}


def flops_per_step(p, batch=None):
    """Training FLOPs of one step of `batch` sequences (default: the preset's) on the whole model."""
    h, layers, seq = p["hidden"], p["layers"], p["seq"]
    mlp = 3 * h * p["ffn"] * p.get("topk", 1) + h * p.get("experts", 0)
    matmul_params = layers * (4 * h * h + mlp) + p["vocab"] * h
    return (batch or p["batch"]) * seq * (6 * matmul_params + 12 * layers * seq * h)


def arguments(description, default_preset="llama-1b", presets=None):
    """The flags every training peer takes; the caller adds its own and calls parse_args."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--preset", default=default_preset, choices=sorted(presets or PRESETS))
    ap.add_argument("--batch", type=int, help="sequences a rank (default: the preset's)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda, or cpu for a correctness run of the tiny presets")
    ap.add_argument("--profile-steps", action="store_true",
                    help="start the CUDA profiler after warm-up (ncu --profile-from-start off)")
    return ap


def preset(args):
    p = dict(PRESETS[args.preset])
    if args.batch:
        p["batch"] = args.batch
    return p


def rank():
    return int(os.environ.get("RANK", "0"))


def local_device(args):
    """This process's device: under torchrun, the GPU of its local rank."""
    if args.device != "cuda":
        return torch.device(args.device)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cuda", torch.cuda.current_device())


def random_tokens(p, device, seed=1234, vocab=None):
    """Uniformly random ids from a seeded generator: (inputs, next-token labels)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, vocab or p["vocab"], (p["batch"], p["seq"] + 1), device=device, generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step, args, device):
    """Runs `step` (returns the loss) args.warmup times, then args.steps times timed.

    Returns (seconds a step, the last loss, the peak bytes the caching allocator held over the
    timed steps). With --profile-steps the CUDA profiler runs over the timed steps only."""
    for _ in range(args.warmup):
        loss = step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        if args.profile_steps:
            torch.cuda.profiler.start()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync(device)
    seconds = (time.perf_counter() - start) / args.steps
    if device.type == "cuda" and args.profile_steps:
        torch.cuda.profiler.stop()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return seconds, loss, peak


def scalar(x):
    """A float from a loss that may be a DTensor or a tensor."""
    if hasattr(x, "full_tensor"):
        x = x.full_tensor()
    return float(x.detach()) if torch.is_tensor(x) else float(x)


def report(peer, preset_name, p, seconds, loss, peak_bytes, gpus=1, tp=1, dp=1, flops=None, **extra):
    """Prints the RESULT line (rank 0 only).

    dp: data-parallel ranks, each with its own batch (tokens, FLOPs and `batch` count them all);
    flops: FLOPs a step of one batch when the preset's formula does not apply."""
    if rank() != 0:
        return
    flops = (flops or flops_per_step(p)) * dp
    line = dict(
        peer=peer, preset=preset_name, batch=p["batch"] * dp, seq=p["seq"], tp=tp, dp=dp, gpus=gpus,
        step_ms=round(seconds * 1e3, 2),
        tokens_per_s=round(p["batch"] * p["seq"] * dp / seconds),
        tflops_per_gpu=round(flops / seconds / gpus / 1e12, 1),
        mfu=round(flops / seconds / gpus / PEAK_BF16_FLOPS, 4),
        peak_mem_gib=round(peak_bytes / 2**30, 2),
        loss=round(scalar(loss), 4),
    )
    line.update(extra, torch=torch.__version__)
    print("RESULT " + json.dumps(line), flush=True)


def max_over_ranks(value, device):
    """The largest of `value` over all ranks (the fullest GPU's memory), or value alone."""
    if not torch.distributed.is_initialized():
        return value
    t = torch.tensor(float(value), device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.item()
