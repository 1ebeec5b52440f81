//! `bench --gemm`: every cubek routine and Burn's own matmul on the llama GEMM shapes, in bf16,
//! one `GEMM {…}` line each; `gemm_peer.py` prints the same lines for cuBLAS through PyTorch.

use std::time::Instant;

use burn::tensor::{DType, Device, Tensor};
use burn_megatron_kernels::gemm::{GemmKernel, matmul};

/// `(name, m, k, n, lhs transposed)`: llama-1b's MLP (8192 tokens) forward `x·W` and weight
/// gradient `xᵀ·dy` (lhs a transposed view), its output layer, llama-8b's MLP at tp = 2 (4096
/// tokens), and the 8192³ reference product. Input gradients `dy·Wᵀ` have the forward shapes
/// with k and n swapped.
pub const SHAPES: [(&str, usize, usize, usize, bool); 5] = [
    ("1b.w13.fwd", 8192, 2048, 5632, false),
    ("1b.w13.wgrad", 2048, 8192, 5632, true),
    ("1b.out.fwd", 8192, 2048, 32768, false),
    ("8b.tp2.w13.fwd", 4096, 4096, 7168, false),
    ("square.8192", 8192, 8192, 8192, false),
];

pub fn run(device: &Device, iters: usize) {
    let options = (device, DType::BF16);
    for (name, m, k, n, transposed) in SHAPES {
        let lhs = match transposed {
            true => Tensor::<2>::random([k, m], burn::tensor::Distribution::Normal(0.0, 1.0), options).transpose(),
            false => Tensor::<2>::random([m, k], burn::tensor::Distribution::Normal(0.0, 1.0), options),
        };
        let rhs = Tensor::<2>::random([k, n], burn::tensor::Distribution::Normal(0.0, 1.0), options);
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
                // ‖out − ref‖ / ‖ref‖ against Burn's own product, in f32: bf16 operands land
                // between 1e-3 and 1e-2; a wrong kernel near 1.
                let (out, reference) = (out.cast(DType::F32), reference.clone().cast(DType::F32));
                let norm = |t: Tensor<2>| t.square().sum().sqrt().into_scalar::<f32>();
                let error = norm(out - reference.clone()) / norm(reference);
                println!(
                    "GEMM {{\"shape\": \"{name}\", \"m\": {m}, \"k\": {k}, \"n\": {n}, \"kernel\": \"{kernel}\", \"us\": {:.1}, \"tflops\": {:.1}, \"max_abs_diff_vs_burn\": {error:.3e}}}",
                    seconds * 1e6,
                    flops / seconds / 1e12
                )
            }
            Err(error) => println!("GEMM {{\"shape\": \"{name}\", \"kernel\": \"{kernel}\", \"error\": {:?}}}", error),
        };
        report("burn", time(&|| Ok(lhs.clone().matmul(rhs.clone()))));
        for kernel in GemmKernel::ALL {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                time(&|| matmul(lhs.clone(), rhs.clone(), kernel))
            }))
            .unwrap_or_else(|_| Err("panicked".into()));
            report(&format!("{kernel:?}"), result);
        }
    }
}
