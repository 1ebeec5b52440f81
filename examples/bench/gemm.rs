//! `bench --gemm`: the matmul routines and Burn's own matmul on the llama GEMM shapes, in bf16,
//! and our wgmma kernel on E4M3 codes (`Fp8Wgmma`; `Fp8WgmmaPromoted`, its partial sums
//! promoted every slice; blockwise `Fp8Blockwise`, B in 128×128 blocks, and `Fp8BlockwiseRows`,
//! B in 1×128 tiles), one `GEMM {…}` line each; `peers/gemm.py` prints the same lines for cuBLAS through PyTorch.
//! Before timing, each routine is checked on ragged shapes with every operand layout
//! (`CHECK {…}` lines).

use std::time::Instant;

use crate::routines::{GemmKernel, matmul};
use burn::tensor::{DType, Device, Tensor};
use burn_megatron_kernels::cuda::wgmma::{Accumulation, BScales, Schedule, fp8_blockwise_matmul, fp8_matmul};
use burn_megatron_kernels::quant::format::Minifloat;
use burn_megatron_kernels::quant::tiles::{quantize_squares, quantize_tiles};

/// `(name, m, k, n, lhs transposed, rhs transposed)`: llama-1b's MLP (8192 tokens) forward `x·W` and weight
/// gradient `xᵀ·dy` (lhs a transposed view), its down projection and attention projections,
/// its output layer, llama-8b's MLP at tp = 2 (4096 tokens), and the 8192³ reference product.
/// Input gradients `dy·Wᵀ` have the forward shapes with k and n swapped. Then the products of
/// llama-1b's projections fused side by side (q, k and v: 6144 columns; gate and up: 11264):
/// forward, input gradient and weight gradient, beside the attention projections' weight
/// gradient alone. Last, two input gradients as the layers run them: `dy·Wᵀ` with `W` stored
/// `[in, out]`, so B a transposed view (K-major), where the rows above read B MN-major. Then
/// the rest of llama-8b's products on a rank at tp = 2 (4096 tokens, each of q, k and v 2048
/// columns, the MLP 7168), each pass as the layers run it, for the FP8 GEMM's 1.2 PFLOP/s target
/// on the llama-8b shapes.
pub const SHAPES: [(&str, usize, usize, usize, bool, bool); 27] = [
    ("1b.w13.fwd", 8192, 2048, 5632, false, false),
    ("1b.w13.wgrad", 2048, 8192, 5632, true, false),
    ("1b.w2.fwd", 8192, 5632, 2048, false, false),
    ("1b.qkvo.fwd", 8192, 2048, 2048, false, false),
    ("1b.out.fwd", 8192, 2048, 32768, false, false),
    ("8b.tp2.w13.fwd", 4096, 4096, 7168, false, false),
    ("square.8192", 8192, 8192, 8192, false, false),
    ("1b.qkvo.wgrad", 2048, 8192, 2048, true, false),
    ("1b.qkv.fwd", 8192, 2048, 6144, false, false),
    ("1b.qkv.dgrad", 8192, 6144, 2048, false, false),
    ("1b.qkv.wgrad", 2048, 8192, 6144, true, false),
    ("1b.w13cat.fwd", 8192, 2048, 11264, false, false),
    ("1b.w13cat.dgrad", 8192, 11264, 2048, false, false),
    ("1b.w13cat.wgrad", 2048, 8192, 11264, true, false),
    ("1b.w13.dgrad", 8192, 5632, 2048, false, true),
    ("1b.qkvo.dgrad", 8192, 2048, 2048, false, true),
    ("8b.tp2.qkv.fwd", 4096, 4096, 2048, false, false),
    ("8b.tp2.qkv.dgrad", 4096, 2048, 4096, false, true),
    ("8b.tp2.qkv.wgrad", 4096, 4096, 2048, true, false),
    ("8b.tp2.o.fwd", 4096, 2048, 4096, false, false),
    ("8b.tp2.o.dgrad", 4096, 4096, 2048, false, true),
    ("8b.tp2.o.wgrad", 2048, 4096, 4096, true, false),
    ("8b.tp2.w13.dgrad", 4096, 7168, 4096, false, true),
    ("8b.tp2.w13.wgrad", 4096, 4096, 7168, true, false),
    ("8b.tp2.w2.fwd", 4096, 7168, 4096, false, false),
    ("8b.tp2.w2.dgrad", 4096, 4096, 7168, false, true),
    ("8b.tp2.w2.wgrad", 7168, 4096, 4096, true, false),
];

/// `(m, k, n)` that fill no tile: m and n ragged for 128 × 256 blocks, k for 64-deep slices (a
/// multiple of 8, which TMA's 16-byte rows need), plus a k shorter than one slice.
const RAGGED: [(usize, usize, usize); 3] = [(300, 136, 520), (129, 2056, 257), (64, 24, 40)];

/// ‖out − ref‖ / ‖ref‖ in f32: bf16 operands land between 1e-3 and 1e-2; a wrong kernel near 1.
fn relative_error(out: Tensor<2>, reference: Tensor<2>) -> f32 {
    let (out, reference) = (out.cast(DType::F32), reference.cast(DType::F32));
    let norm = |t: Tensor<2>| t.square().sum().sqrt().into_scalar::<f32>();
    norm(out - reference.clone()) / norm(reference)
}

/// `[rows, cols]`, or a transposed view of a `[cols, rows]` tensor.
fn operand(rows: usize, cols: usize, transposed: bool, device: &Device) -> Tensor<2> {
    let normal = burn::tensor::Distribution::Normal(0.0, 1.0);
    match transposed {
        true => Tensor::<2>::random([cols, rows], normal, (device, DType::BF16)).transpose(),
        false => Tensor::<2>::random([rows, cols], normal, (device, DType::BF16)),
    }
}

/// Every kernel on the ragged shapes, each operand plain and transposed, against Burn's product.
fn check(device: &Device, kernels: &[GemmKernel]) {
    for kernel in kernels {
        for (m, k, n) in RAGGED {
            for (lhs_t, rhs_t) in [(false, false), (true, false), (false, true), (true, true)] {
                let (lhs, rhs) = (operand(m, k, lhs_t, device), operand(k, n, rhs_t, device));
                let reference = lhs.clone().cast(DType::F32).matmul(rhs.clone().cast(DType::F32));
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let out = matmul(lhs, rhs, *kernel)?;
                    device.sync().map_err(|e| format!("{e:?}"))?;
                    Ok::<_, String>(out)
                }));
                // The norms too: an output never written can still be close to some reference.
                let norm = |t: Tensor<2>| t.cast(DType::F32).square().sum().sqrt().into_scalar::<f32>();
                let error = match result {
                    Ok(Ok(out)) => format!(
                        "{:.3e}, \"out_norm\": {:.4e}, \"ref_norm\": {:.4e}",
                        relative_error(out.clone(), reference.clone()),
                        norm(out),
                        norm(reference)
                    ),
                    Ok(Err(e)) => format!("{e:?}"),
                    Err(_) => "\"panicked\"".into(),
                };
                println!(
                    "CHECK {{\"kernel\": \"{kernel:?}\", \"m\": {m}, \"k\": {k}, \"n\": {n}, \"lhs_t\": {lhs_t}, \"rhs_t\": {rhs_t}, \"rel_error\": {error}}}"
                );
            }
        }
    }
}

pub fn run(device: &Device, iters: usize, kernels: &[GemmKernel]) {
    check(device, kernels);
    for (name, m, k, n, lhs_t, rhs_t) in SHAPES {
        let (lhs, rhs) = (operand(m, k, lhs_t, device), operand(k, n, rhs_t, device));
        let reference = lhs.clone().matmul(rhs.clone());
        let flops = 2.0 * (m * n * k) as f64;
        let time = |f: &dyn Fn() -> Result<Tensor<2>, String>| -> Result<(f64, Tensor<2>), String> {
            let out = f()?;
            device.sync().map_err(|e| format!("{e:?}"))?;
            let start = Instant::now();
            for _ in 0..iters {
                f()?;
            }
            device.sync().map_err(|e| format!("{e:?}"))?;
            Ok((start.elapsed().as_secs_f64() / iters as f64, out))
        };
        let report = |kernel: &str, result: Result<(f64, Tensor<2>), String>| match result {
            Ok((seconds, out)) => {
                let error = relative_error(out, reference.clone());
                println!(
                    "GEMM {{\"shape\": \"{name}\", \"m\": {m}, \"k\": {k}, \"n\": {n}, \"kernel\": \"{kernel}\", \"us\": {:.1}, \"tflops\": {:.1}, \"max_abs_diff_vs_burn\": {error:.3e}}}",
                    seconds * 1e6,
                    flops / seconds / 1e12
                )
            }
            Err(error) => println!(
                "GEMM {{\"shape\": \"{name}\", \"kernel\": \"{kernel}\", \"error\": {:?}}}",
                error
            ),
        };
        report("burn", time(&|| Ok(lhs.clone().matmul(rhs.clone()))));
        for &kernel in kernels {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                time(&|| matmul(lhs.clone(), rhs.clone(), kernel))
            }))
            .unwrap_or_else(|_| Err("panicked".into()));
            report(&format!("{kernel:?}"), result);
        }
        // FP8: E4M3 codes of both operands K-major (as FP8 wgmma reads them), one scale, and
        // blockwise: A in 1×128 tiles, B in 128×128 blocks (forward, dgrad) or 1×128 tiles
        // (wgrad). Their values are other numbers than the bf16 operands', so only the time is
        // compared.
        let report_fp8 = |kernel: &str, result: Result<(f64, Tensor<2>), String>| match result {
            Ok((seconds, _)) => println!(
                "GEMM {{\"shape\": \"{name}\", \"m\": {m}, \"k\": {k}, \"n\": {n}, \"kernel\": \"{kernel}\", \"us\": {:.1}, \"tflops\": {:.1}}}",
                seconds * 1e6,
                flops / seconds / 1e12
            ),
            Err(error) => println!("GEMM {{\"shape\": \"{name}\", \"kernel\": \"{kernel}\", \"error\": {error:?}}}"),
        };
        let tiles = |rows: usize| quantize_tiles(operand(rows, k, false, device), Minifloat::E4M3);
        let (a, b) = (tiles(m), tiles(n));
        let scale = Tensor::<1>::ones([1], (device, DType::F32));
        let formats = (Minifloat::E4M3, Minifloat::E4M3);
        for (kernel, accumulation) in [
            ("Fp8Wgmma", Accumulation::Fast),
            ("Fp8WgmmaPromoted", Accumulation::Promoted),
        ] {
            let tensorwise = || {
                let scales = [scale.clone(), scale.clone()];
                let schedule = Schedule::Persistent;
                fp8_matmul(a.0.clone(), b.0.clone(), formats, scales, schedule, accumulation).map_err(|e| e.to_string())
            };
            report_fp8(kernel, time(&tensorwise));
        }
        let (squares, _, square_scales) = quantize_squares(operand(n, k, false, device), Minifloat::E4M3);
        for (kernel, b, blocks) in [
            ("Fp8Blockwise", (squares, square_scales), BScales::Squares),
            ("Fp8BlockwiseRows", b.clone(), BScales::Rows),
        ] {
            let blockwise = || fp8_blockwise_matmul(a.clone(), b.clone(), blocks, formats).map_err(|e| e.to_string());
            report_fp8(kernel, time(&blockwise));
        }
    }
}
