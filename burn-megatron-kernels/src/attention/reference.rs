//! Attention in plain tensor ops, in f32: the CPU path, the fallback for what the flash kernels
//! do not take, and the oracle their tests compare against. It materializes the `[b, h, s, s]`
//! scores. Its products stay f32 on CUDA too ([`crate::gemm::f32_matmul`]: no TF32).

use burn::tensor::{Bool, DType, Int, Tensor};

use crate::gemm::f32_matmul::matmul;

/// log₂(e): natural logs to base-2 ones.
const LOG2_E: f32 = core::f32::consts::LOG2_E;

/// The keys each query sees.
#[derive(Clone, Copy, Debug)]
pub enum Mask<'a> {
    /// Every key.
    All,
    /// Keys at or before the query's position.
    Causal,
    /// Keys at or before the query's position and in its document: `[b, s]`, each query's
    /// document's first position (sequences packing several documents end to end).
    Documents(&'a Tensor<2, Int>),
}

impl Mask<'static> {
    /// [`Mask::Causal`] where `causal`, else [`Mask::All`].
    pub fn causal(causal: bool) -> Self {
        match causal {
            true => Self::Causal,
            false => Self::All,
        }
    }
}

/// The scaled scores `q·kᵀ·scale`, the keys `mask` hides at -inf, in f32.
fn scores(q: Tensor<4>, k: Tensor<4>, mask: Mask, scale: f32) -> Tensor<4> {
    let [b, h, s, _] = q.dims();
    let scores = matmul(q.cast(DType::F32), k.cast(DType::F32).swap_dims(2, 3)) * scale;
    let device = scores.device();
    let future = || Tensor::<2, Bool>::tril_mask([s, s], 0, &device).unsqueeze::<4>();
    match mask {
        Mask::All => scores,
        Mask::Causal => scores.mask_fill(future().expand([b, h, s, s]), f32::NEG_INFINITY),
        Mask::Documents(starts) => {
            let keys = Tensor::<1, Int>::arange(0..s as i64, &device).reshape([1, 1, 1, s]);
            let before = keys.lower(starts.clone().reshape([b, 1, s, 1])); // [b, 1, s, s]
            let hidden = before.bool_or(future().expand([b, 1, s, s]));
            scores.mask_fill(hidden.expand([b, h, s, s]), f32::NEG_INFINITY)
        }
    }
}

/// `softmax(q·kᵀ·scale) · v` in the inputs' dtype, and `lse₂` (`[b, h, s]`, f32).
pub fn forward(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, causal: bool, scale: f32) -> (Tensor<4>, Tensor<3>) {
    forward_masked(q, k, v, Mask::causal(causal), scale)
}

/// [`forward`] with the keys `mask` hides.
pub fn forward_masked(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, mask: Mask, scale: f32) -> (Tensor<4>, Tensor<3>) {
    let dtype = q.dtype();
    let scores = scores(q, k, mask, scale);
    let max = scores.clone().max_dim(3);
    let exp = (scores - max.clone()).exp();
    let sum = exp.clone().sum_dim(3);
    let out = matmul(exp / sum.clone(), v.cast(DType::F32)).cast(dtype);
    let lse = (max + sum.log()) * LOG2_E;
    (out, lse.squeeze_dim::<3>(3))
}

/// The gradients of q, k and v from the forward's output, `lse₂` and the output's gradient:
/// `P = 2^(scores·log₂e − lse₂)`, `dV = Pᵀ·dO`, `dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O))`,
/// `dQ = dS·K·scale`, `dK = dSᵀ·Q·scale`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    out: Tensor<4>,
    lse: Tensor<3>,
    grad: Tensor<4>,
    causal: bool,
    scale: f32,
) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
    backward_masked(q, k, v, out, lse, grad, Mask::causal(causal), scale)
}

/// [`backward`] with the keys `mask` hides.
#[allow(clippy::too_many_arguments)]
pub fn backward_masked(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    out: Tensor<4>,
    lse: Tensor<3>,
    grad: Tensor<4>,
    mask: Mask,
    scale: f32,
) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
    let dtype = q.dtype();
    let f32 = |t: Tensor<4>| t.cast(DType::F32);
    let (q, k, v, out, grad) = (f32(q), f32(k), f32(v), f32(out), f32(grad));
    let probs = (scores(q.clone(), k.clone(), mask, scale) - lse.unsqueeze_dim::<4>(3) * core::f32::consts::LN_2).exp();
    let dv = matmul(probs.clone().swap_dims(2, 3), grad.clone());
    let delta = (grad.clone() * out).sum_dim(3);
    let ds = probs * (matmul(grad, v.swap_dims(2, 3)) - delta);
    let dq = matmul(ds.clone(), k) * scale;
    let dk = matmul(ds.swap_dims(2, 3), q) * scale;
    (dq.cast(dtype), dk.cast(dtype), dv.cast(dtype))
}

#[cfg(test)]
mod tests {
    use burn::tensor::ops::AttentionModuleOptions;
    use burn::tensor::{Device, Distribution, Tensor, Tolerance, module};

    /// The extension on the CPU (this reference forward, and its own backward) against Burn's
    /// attention differentiated by autodiff: the same outputs and the same gradients, with and
    /// without the causal mask, on a ragged sequence length.
    #[test]
    fn matches_burn_attention_with_gradients() {
        let device = Device::flex().autodiff();
        for causal in [false, true] {
            let input = || Tensor::<4>::random([2, 3, 7, 16], Distribution::Normal(0.0, 1.0), &device).require_grad();
            let (q, k, v) = (input(), input(), input());
            let ours = crate::attention::attention(q.clone(), k.clone(), v.clone(), causal);
            let options = AttentionModuleOptions {
                scale: None,
                softcap: None,
                is_causal: causal,
            };
            let theirs = module::attention(q.clone(), k.clone(), v.clone(), None, None, options);
            // f32 throughout; the softmax is computed in another order (base 2, saved lse): a
            // few ulps of values of order 1.
            let tolerance = Tolerance::absolute(2e-5);
            ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
            let weights = Tensor::<4>::random([2, 3, 7, 16], Distribution::Normal(0.0, 1.0), &device);
            let (g1, g2) = (
                (ours * weights.clone()).sum().backward(),
                (theirs * weights).sum().backward(),
            );
            for x in [&q, &k, &v] {
                x.grad(&g1)
                    .unwrap()
                    .to_data()
                    .assert_approx_eq::<f32>(&x.grad(&g2).unwrap().to_data(), tolerance);
            }
        }
    }
}
