//! The packed ops that take one product of several projections' weights side by side: SwiGLU
//! of the gate and up halves, and attention of the q, k and v heads (RoPE in place), against
//! their f32 references differentiated by autodiff.

use burn::tensor::{DType, Distribution, Tensor};
use burn_megatron_kernels::attention::packed::reference;
use burn_megatron_kernels::attention::packed_attention;
use burn_megatron_kernels::swiglu::swiglu_packed;

use super::{f32_leaf, relative_error, tolerance};
use crate::Harness;

/// Packed SwiGLU against `silu(a) ∘ b` on its halves in f32: values and the packed input's
/// gradient, in f32 and bf16, on halves that take vectors of 8 and halves that do not.
pub fn swiglu_packed_halves(h: &Harness) {
    let device = h.device(0).autodiff();
    for dtype in [DType::F32, DType::BF16] {
        for dims in [[2, 37, 2 * 2048], [3, 5, 2 * 100], [1, 4, 2 * 7]] {
            let y = Tensor::<3>::random(dims, Distribution::Normal(0.0, 2.0), (&device, dtype))
                .detach()
                .require_grad();
            let ours = swiglu_packed(y.clone());
            let f = dims[2] / 2;
            let y32 = f32_leaf(&y);
            let theirs = burn::tensor::activation::silu(y32.clone().narrow(2, 0, f)) * y32.clone().narrow(2, f, f);
            let case = format!("{dtype:?} {dims:?}");
            let error = relative_error(ours.clone(), theirs.clone());
            assert!(error < tolerance(dtype), "{case}: output relative error {error}");
            let weights = Tensor::<3>::random(
                [dims[0], dims[1], f],
                Distribution::Normal(0.0, 1.0),
                (&device, DType::F32),
            );
            let (g1, g2) = (
                (ours.cast(DType::F32) * weights.clone()).sum().backward(),
                (theirs * weights).sum().backward(),
            );
            let error = relative_error(y.grad(&g1).unwrap(), y32.grad(&g2).unwrap());
            assert!(error < tolerance(dtype), "{case}: dy relative error {error}");
        }
    }
}

/// Packed attention (bf16, head dim 128: RoPE in place on the q and k heads, the flash kernels
/// on views of the row, dV written into the packed gradient) against the f32 reference
/// (RoPE's and attention's tensor ops) differentiated by autodiff: the output and the packed
/// input's gradient, with grouped-query attention and without, on lengths that fill no tile.
/// Once on an input the op holds alone (rotated in place) and once on one the caller still
/// holds, which must come back unchanged. A head dim of 64 goes to the reference path.
pub fn packed_attention_heads(h: &Harness) {
    let device = h.device(0).autodiff();
    for (b, heads, kv_heads, s, d) in [(2, 4, 2, 100, 128), (1, 2, 2, 257, 128), (1, 3, 1, 70, 64)] {
        let n = heads + 2 * kv_heads;
        let y = Tensor::<3>::random([b, s, n * d], Distribution::Normal(0.0, 1.0), (&device, DType::BF16))
            .detach()
            .require_grad();
        let angles = Tensor::<2>::random([s + 3, d / 2], Distribution::Uniform(0.0, 6.0), (&device, DType::F32));
        let (cos, sin) = (angles.clone().cos(), angles.sin());
        let y32 = f32_leaf(&y);
        let (expected, _, _) = reference::forward(y32.clone(), cos.clone(), sin.clone(), heads, kv_heads, true);
        let weights = Tensor::<3>::random([b, s, heads * d], Distribution::Normal(0.0, 1.0), (&device, DType::F32));
        let expected_grads = (expected.clone() * weights.clone()).sum().backward();
        let expected_dy = y32.grad(&expected_grads).unwrap();
        for held in [false, true] {
            let before = y.clone().into_data();
            // Held: the caller keeps `y` itself; not held: the op gets a new tensor of its own.
            let input = if held { y.clone() } else { y.clone().mul_scalar(1.0) };
            let out = packed_attention(input, cos.clone(), sin.clone(), heads, kv_heads, true);
            let case = format!("b {b} h {heads} g {kv_heads} s {s} d {d} held {held}");
            assert_eq!(y.clone().into_data(), before, "{case}: the caller's input was changed");
            // bf16 inputs in both; ours rounds the rotated heads, the probabilities and the
            // output to bf16 (2⁻⁸ relative each): a few 1e-3 in norm. A wrong head, rotation or
            // layout is of order 1.
            let error = relative_error(out.clone(), expected.clone());
            assert!(error < 2e-2, "{case}: output relative error {error}");
            let grads = (out.cast(DType::F32) * weights.clone()).sum().backward();
            // The gradients also round dS and dP to bf16 before their products: 4e-2.
            let error = relative_error(y.grad(&grads).unwrap(), expected_dy.clone());
            assert!(error < 4e-2, "{case}: dy relative error {error}");
        }
    }
}
