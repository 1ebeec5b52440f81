"""PyTorch's scaled-dot-product attention on the shapes of `bench --attention`
(examples/bench/attention.rs), each backend that takes them, printing the same ATTENTION lines
(forward alone; the backward alone, re-run on one recorded graph).

  python3 examples/bench/peers/attention.py
"""
import json
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [("1b", 4, 16, 2048), ("8b.tp2", 1, 16, 4096), ("1b.32k", 1, 16, 32768)]
D = 128
ITERS = 20


def timed(f):
    f()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(ITERS):
        f()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / ITERS


for name, b, h, s in SHAPES:
    make = lambda: torch.randn(b, s, h, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    q, k, v = make(), make(), make()
    grad = torch.randn(b, h, s, D, device="cuda", dtype=torch.bfloat16)
    flops = 2.0 * b * h * s * s * D
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel(backend):
                forward = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                backward = timed(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
        except RuntimeError as error:
            print("ATTENTION " + json.dumps({"shape": name, "kernel": backend.name, "error": str(error)[:200]}))
            continue
        print("ATTENTION " + json.dumps({
            "shape": name, "b": b, "h": h, "s": s, "kernel": backend.name,
            "forward_us": round(forward * 1e6, 1), "forward_tflops": round(flops / forward / 1e12, 1),
            "backward_us": round(backward * 1e6, 1), "backward_tflops": round(2.5 * flops / backward / 1e12, 1),
        }))
