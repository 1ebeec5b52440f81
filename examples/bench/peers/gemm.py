"""cuBLAS through PyTorch on the shapes of `bench --gemm` (examples/bench/gemm.rs), printing the
same GEMM lines: bf16 (`cublas`), and E4M3 codes with one scale each, `a` row-major and `b`
column-major as `torch._scaled_mm` takes them, bf16 out (`cublas-fp8`, beside `bench --gemm`'s
`Fp8Wgmma`).

  python3 examples/bench/peers/gemm.py
"""
import json
import torch

SHAPES = [
    ("1b.w13.fwd", 8192, 2048, 5632, False, False),
    ("1b.w13.wgrad", 2048, 8192, 5632, True, False),
    ("1b.w2.fwd", 8192, 5632, 2048, False, False),
    ("1b.qkvo.fwd", 8192, 2048, 2048, False, False),
    ("1b.out.fwd", 8192, 2048, 32768, False, False),
    ("8b.tp2.w13.fwd", 4096, 4096, 7168, False, False),
    ("square.8192", 8192, 8192, 8192, False, False),
    ("1b.qkvo.wgrad", 2048, 8192, 2048, True, False),
    ("1b.qkv.fwd", 8192, 2048, 6144, False, False),
    ("1b.qkv.dgrad", 8192, 6144, 2048, False, False),
    ("1b.qkv.wgrad", 2048, 8192, 6144, True, False),
    ("1b.w13cat.fwd", 8192, 2048, 11264, False, False),
    ("1b.w13cat.dgrad", 8192, 11264, 2048, False, False),
    ("1b.w13cat.wgrad", 2048, 8192, 11264, True, False),
    ("1b.w13.dgrad", 8192, 5632, 2048, False, True),
    ("1b.qkvo.dgrad", 8192, 2048, 2048, False, True),
    ("8b.tp2.qkv.fwd", 4096, 4096, 2048, False, False),
    ("8b.tp2.qkv.dgrad", 4096, 2048, 4096, False, True),
    ("8b.tp2.qkv.wgrad", 4096, 4096, 2048, True, False),
    ("8b.tp2.o.fwd", 4096, 2048, 4096, False, False),
    ("8b.tp2.o.dgrad", 4096, 4096, 2048, False, True),
    ("8b.tp2.o.wgrad", 2048, 4096, 4096, True, False),
    ("8b.tp2.w13.dgrad", 4096, 7168, 4096, False, True),
    ("8b.tp2.w13.wgrad", 4096, 4096, 7168, True, False),
    ("8b.tp2.w2.fwd", 4096, 7168, 4096, False, False),
    ("8b.tp2.w2.dgrad", 4096, 4096, 7168, False, True),
    ("8b.tp2.w2.wgrad", 7168, 4096, 4096, True, False),
]


def timed(product, iters=20):
    """Seconds a call, the mean of `iters` after 3 warm-up calls."""
    for _ in range(3):
        product()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        product()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def report(name, m, k, n, kernel, seconds):
    print("GEMM " + json.dumps({"shape": name, "m": m, "k": k, "n": n, "kernel": kernel, "us": round(seconds * 1e6, 1), "tflops": round(2 * m * n * k / seconds / 1e12, 1)}))


for name, m, k, n, lhs_t, rhs_t in SHAPES:
    lhs = torch.randn(k, m, device="cuda", dtype=torch.bfloat16).t() if lhs_t else torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    rhs = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() if rhs_t else torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    report(name, m, k, n, "cublas", timed(lambda: lhs @ rhs))
    try:
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()
        one = torch.tensor(1.0, device="cuda")
        fp8 = lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
        report(name, m, k, n, "cublas-fp8", timed(fp8))
    except Exception as error:  # an API change shows as a line, the bf16 figures stand
        print("GEMM " + json.dumps({"shape": name, "kernel": "cublas-fp8", "error": repr(error)[:300]}))
