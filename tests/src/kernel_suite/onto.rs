//! A branch's last product added onto the residual stream in the wgmma GEMM's epilogue
//! (`linear_onto`, `gated_mlp_onto`) against the stream plus the product in f32 by Burn's ops
//! with autodiff.

use burn::tensor::activation::silu;
use burn::tensor::{DType, Distribution, Tensor};
use burn_megatron_kernels::Gemm;
use burn_megatron_kernels::gated_mlp::gated_mlp_onto;
use burn_megatron_kernels::linear_onto;
use burn_megatron_kernels::rms_norm::link::NormLink;

use super::{f32_leaf, relative_error};
use crate::Harness;

/// `x + a · w` (`linear_onto`) and `x + (silu(a·w1) ∘ (a·w3)) · w2` (`gated_mlp_onto`): the sum
/// and the gradients of the stream, the input and every weight, on shapes that fill no tile
/// (n = 257: the stream's rows are unaligned, so the epilogue cannot read it and the sum is
/// taken apart; the rest read it by TMA), weights plain and as transposed views, more tiles
/// than SMs, 16 rows (the decoding product, then the add), and llama-1b's output projection and
/// MLP. The stream is of order 3, the products of order 1, so a tile that misses the stream or
/// the product is off by far more than rounding.
pub fn residual_gemm(h: &Harness) {
    let device = h.device(0).autodiff();
    let normal = Distribution::Normal(0.0, 1.0);
    let shapes = [
        (300, 136, 520),
        (129, 2056, 257),
        (4100, 200, 2000),
        (16, 64, 256),
        (8192, 2048, 2048),
    ];
    for (m, k, n) in shapes {
        for transposed in [false, true] {
            let weight = |rows: usize, cols: usize| {
                let w = match transposed {
                    true => Tensor::<2>::random([cols, rows], normal, (&device, DType::BF16)).transpose(),
                    false => Tensor::<2>::random([rows, cols], normal, (&device, DType::BF16)),
                };
                // std 1/√fan-in, as an initialization: products of order 1.
                (w / (rows as f64).sqrt()).detach().require_grad()
            };
            let a = Tensor::<2>::random([m, k], normal, (&device, DType::BF16)).require_grad();
            let w = weight(k, n);
            let x = (Tensor::<2>::random([m, n], normal, (&device, DType::BF16)) * 3.0)
                .detach()
                .require_grad();
            let out = linear_onto(x.clone(), a.clone(), w.clone(), Gemm::Wgmma, &NormLink::default());
            let [x32, a32, w32] = [&x, &a, &w].map(f32_leaf);
            let expected = x32.clone() + a32.clone().matmul(w32.clone());
            let case = format!("linear_onto {m}×{k}×{n} transposed {transposed}");
            // The sum rounded to bf16 once (2⁻⁹ relative): about 2e-3 in norm.
            check(
                &case,
                out,
                expected,
                [("x", &x, &x32), ("a", &a, &a32), ("w", &w, &w32)],
            );
            if n != 2048 {
                continue;
            }
            let (w1, w3, w2) = (weight(n, 5632), weight(n, 5632), weight(5632, n));
            let out = gated_mlp_onto(
                x.clone(),
                &NormLink::default(),
                x.clone(),
                x.clone(),
                [w1.clone(), w3.clone(), w2.clone()],
                Gemm::Wgmma,
            );
            let [w1_32, w3_32, w2_32] = [&w1, &w3, &w2].map(f32_leaf);
            let hidden = silu(x32.clone().matmul(w1_32.clone())) * x32.clone().matmul(w3_32.clone());
            let expected = x32.clone() + hidden.matmul(w2_32.clone());
            let case = format!("gated_mlp_onto {m}×{n}×5632 transposed {transposed}");
            check(
                &case,
                out,
                expected,
                [("x", &x, &x32), ("w1", &w1, &w1_32), ("w2", &w2, &w2_32)],
            );
        }
    }
}

/// The output and the named leaves' gradients for a random weighting of it, against the f32
/// reference's.
fn check(case: &str, out: Tensor<2>, expected: Tensor<2>, leaves: [(&str, &Tensor<2>, &Tensor<2>); 3]) {
    let error = relative_error(out.clone(), expected.clone());
    // The products (and the SwiGLU) rounded to bf16 before the last one: a few 1e-3.
    assert!(error < 1e-2, "{case}: output relative error {error}");
    let weights = Tensor::<2>::random(expected.dims(), Distribution::Normal(0.0, 1.0), &expected.device());
    let grads = (out.cast(DType::F32) * weights.clone()).sum().backward();
    let expected_grads = (expected * weights).sum().backward();
    for (name, ours, theirs) in leaves {
        let (g, e) = (ours.grad(&grads).unwrap(), theirs.grad(&expected_grads).unwrap());
        // bf16 gradients through bf16 products, as `gated_gemm`'s: 2e-2. A gradient that
        // misses the stream's share, or takes it twice, is of order 1.
        let error = relative_error(g, e);
        assert!(error < 2e-2, "{case}: d{name} relative error {error}");
    }
}
