"""cuBLAS through PyTorch on the shapes of examples/bench/gemm.rs, printing the same GEMM lines."""
import json
import torch

SHAPES = [
    ("1b.w13.fwd", 8192, 2048, 5632, False),
    ("1b.w13.wgrad", 2048, 8192, 5632, True),
    ("1b.w2.fwd", 8192, 5632, 2048, False),
    ("1b.qkvo.fwd", 8192, 2048, 2048, False),
    ("1b.out.fwd", 8192, 2048, 32768, False),
    ("8b.tp2.w13.fwd", 4096, 4096, 7168, False),
    ("square.8192", 8192, 8192, 8192, False),
]

for name, m, k, n, transposed in SHAPES:
    lhs = torch.randn(k, m, device="cuda", dtype=torch.bfloat16).t() if transposed else torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    rhs = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        lhs @ rhs
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    iters = 20
    start.record()
    for _ in range(iters):
        lhs @ rhs
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    print("GEMM " + json.dumps({"shape": name, "m": m, "k": k, "n": n, "kernel": "cublas", "us": round(seconds * 1e6, 1), "tflops": round(2 * m * n * k / seconds / 1e12, 1)}))
