"""torch._grouped_mm (cuBLAS) on the shapes and group sizes of `bench --grouped`
(examples/bench/grouped.rs), printing the same GROUPED lines.

  python3 examples/bench/peers/grouped_gemm.py '<the GROUP_SIZES list bench --grouped printed>'
"""
import json
import sys

import torch

EXPERTS, ROWS = 32, 8192 * 4
SHAPES = [("moe4b.w13", 2048, 1408), ("moe4b.w2", 1408, 2048)]
sizes = json.loads(sys.argv[1])
assert len(sizes) == EXPERTS and sum(sizes) == ROWS
offs = torch.cumsum(torch.tensor(sizes, device="cuda"), 0, dtype=torch.int32)


def timed(f, iters=20):
    for _ in range(3):
        f()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        f()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


for name, k, n in SHAPES:
    x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(ROWS, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(EXPERTS, k, n, device="cuda", dtype=torch.bfloat16) * 0.05
    wt = w.transpose(1, 2)
    passes = {
        "fwd": lambda: torch._grouped_mm(x, w, offs=offs),
        "dgrad": lambda: torch._grouped_mm(dy, wt, offs=offs),
        # dw_g = x_gᵀ · dy_g: the 2D × 2D form, groups along k.
        "wgrad": lambda: torch._grouped_mm(x.t(), dy, offs=offs),
    }
    for pass_name, f in passes.items():
        seconds = timed(f)
        print("GROUPED " + json.dumps({"shape": name, "pass": pass_name, "rows": ROWS, "k": k, "n": n, "experts": EXPERTS,
                                        "kernel": "torch._grouped_mm", "us": round(seconds * 1e6, 1),
                                        "tflops": round(2 * ROWS * k * n / seconds / 1e12, 1)}))
