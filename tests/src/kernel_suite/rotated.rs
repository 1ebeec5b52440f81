//! q's and k's projections with RoPE in the wgmma GEMM's epilogue (`linear_rotated`) and the
//! attention op that reads them as they are (`rotary_attention_rotated`), against the products,
//! RoPE and Burn's attention in f32 differentiated by autodiff.

use burn::tensor::module::attention as burn_attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{DType, Distribution, Tensor};
use burn_megatron_kernels::Gemm;
use burn_megatron_kernels::attention::rotary_attention_rotated;
use burn_megatron_kernels::linear_rotated;
use burn_megatron_kernels::rope::reference::rope as rope_reference;

use super::{f32_leaf, relative_error};
use crate::Harness;

/// The rotated heads' values, then the attention over them: its output and the gradients of the
/// input, both weights and v. Shapes: tiles the rows and heads fill partly (300 positions, three
/// heads: a tile's second head past the output), two sequences a tile spans (positions from
/// `row % s`), weights plain and transposed, llama-1b's q projection, and 16 rows (the decoding
/// product, then RoPE's kernel). The tables are longer than the sequence, random angles.
pub fn rotated_gemm(h: &Harness) {
    let device = h.device(0).autodiff();
    let normal = Distribution::Normal(0.0, 1.0);
    for (b, s, k, heads) in [(1, 300, 136, 3), (2, 200, 2056, 2), (4, 4, 64, 2), (2, 2048, 2048, 16)] {
        let angles = Tensor::<2>::random([s + 5, 64], Distribution::Uniform(0.0, 6.0), (&device, DType::F32));
        let (cos, sin) = (angles.clone().cos(), angles.sin());
        for transposed in [false, true] {
            let n = heads * 128;
            let weight = || {
                let w = match transposed {
                    true => Tensor::<2>::random([n, k], normal, (&device, DType::BF16)).transpose(),
                    false => Tensor::<2>::random([k, n], normal, (&device, DType::BF16)),
                };
                // std 1/√fan-in: products of order 1.
                (w / (k as f64).sqrt()).detach().require_grad()
            };
            let (wq, wk) = (weight(), weight());
            let x = Tensor::<3>::random([b, s, k], normal, (&device, DType::BF16)).require_grad();
            let v = Tensor::<4>::random([b, heads, s, 128], normal, (&device, DType::BF16)).require_grad();
            let rotated = |w: &Tensor<2>| linear_rotated(x.clone(), w.clone(), cos.clone(), sin.clone(), Gemm::Wgmma);
            let (q, kk) = (rotated(&wq).unwrap(), rotated(&wk).unwrap());
            let [wq32, wk32] = [&wq, &wk].map(f32_leaf);
            let (x32, v32) = (f32_leaf(&x), f32_leaf(&v));
            let heads_of = |w: &Tensor<2>| {
                let y = x32.clone().reshape([b * s, k]).matmul(w.clone());
                rope_reference(
                    y.reshape([b, s, heads, 128]).swap_dims(1, 2),
                    cos.clone(),
                    sin.clone(),
                    false,
                )
            };
            let (q32, k32) = (heads_of(&wq32), heads_of(&wk32));
            let case = format!("b {b} s {s} k {k} heads {heads} transposed {transposed}");
            // Rotated from the f32 accumulators and rounded to bf16 once (2⁻⁹ relative): about
            // 2e-3 in norm; a wrong position, frequency or sign is of order 1.
            let error = relative_error(q.values(), q32.clone());
            assert!(error < 1e-2, "{case}: q's heads relative error {error}");
            let out = rotary_attention_rotated(q, kk, v.clone(), cos.clone(), sin.clone(), true, None);
            let options = AttentionModuleOptions {
                scale: None,
                softcap: None,
                is_causal: true,
            };
            let expected = burn_attention(q32, k32, v32.clone(), None, None, options);
            // As `flash_attention`'s rotary cases: bf16 probabilities and output, a few 1e-3.
            let error = relative_error(out.clone(), expected.clone());
            assert!(error < 2e-2, "{case}: output relative error {error}");
            let weights = Tensor::<4>::random(expected.dims(), normal, (&device, DType::F32));
            let grads = (out.cast(DType::F32) * weights.clone()).sum().backward();
            let expected_grads = (expected * weights).sum().backward();
            let pairs = [
                (
                    "x",
                    x.grad(&grads).unwrap().reshape([b * s, k]),
                    x32.grad(&expected_grads).unwrap().reshape([b * s, k]),
                ),
                ("wq", wq.grad(&grads).unwrap(), wq32.grad(&expected_grads).unwrap()),
                ("wk", wk.grad(&grads).unwrap(), wk32.grad(&expected_grads).unwrap()),
            ];
            for (name, ours, theirs) in pairs {
                // bf16 gradients through the attention's bf16 backward and bf16 products, as
                // `flash_attention`'s and `gated_gemm`'s: 3e-2. A gradient taken in the rotated
                // frame (the contract broken) is off by order 1.
                let error = relative_error(ours, theirs);
                assert!(error < 3e-2, "{case}: d{name} relative error {error}");
            }
            let error = relative_error(v.grad(&grads).unwrap(), v32.grad(&expected_grads).unwrap());
            assert!(error < 3e-2, "{case}: dv relative error {error}");
        }
    }
}
