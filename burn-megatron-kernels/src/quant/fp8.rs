//! The product of a linear layer in FP8 with per-tensor current scaling, as a backend extension,
//! [`Fp8Ops`], with its own backward. The primitive is `a · bᵀ` of `a` `[m, k]` and `b` `[n, k]`
//! (both K-major, as FP8 `wgmma` reads them), each operand quantized with one scale from this
//! call's amax; f32 accumulation; the result in `a`'s dtype. Its gradients are products of the
//! same kind, the incoming gradient in the gradient format:
//!
//! ```text
//! forward  y  = x · w   = product(x, wᵀ)          x, w E4M3
//! dgrad    dx = dy · wᵀ = product(dy, w)          dy E5M2 (hybrid) or E4M3
//! wgrad    dw = xᵀ · dy = product(xᵀ, dyᵀ)
//! ```
//!
//! On CUDA the quantization kernels (`quant_kernels::quantize_tensor`: amax, then the cast, with
//! the transpose of a transposed view in the same pass) and the wgmma GEMM on FP8 codes.
//! Elsewhere, and on CUDA for a k that is no multiple of 16, the same numerics emulated:
//! [`reference`] quantizes on the host with [`super::scaling`] and multiplies the dequantized
//! values in f32.

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, binary};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Flex, backend_extension};
use burn::tensor::Tensor;

use super::format::Minifloat;

/// The formats of one FP8 product and of its gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fp8Formats {
    /// `a`'s format.
    pub a: Minifloat,
    /// `b`'s format.
    pub b: Minifloat,
    /// The incoming gradient's format in the backward products.
    pub grad: Minifloat,
}

impl Fp8Formats {
    /// Transformer Engine's hybrid recipe: E4M3 forward, E5M2 gradients.
    pub const HYBRID: Self = Self {
        a: Minifloat::E4M3,
        b: Minifloat::E4M3,
        grad: Minifloat::E5M2,
    };
}

/// The backend extension behind [`product`].
#[backend_extension(Flex, Cube: cfg(feature = "cuda"), Autodiff)]
pub trait Fp8Ops: Backend {
    /// `q(a) · q(b)ᵀ`: `[m, k]`, `[n, k]` → `[m, n]` in `a`'s dtype.
    fn fp8_product(a: FloatTensor<Self>, b: FloatTensor<Self>, formats: Fp8Formats) -> FloatTensor<Self>;
}

/// The emulation: each operand quantized on the host with current scaling, the dequantized
/// values multiplied in f32. The CPU path and the kernels' oracle.
pub mod reference {
    use burn::tensor::{DType, Tensor, TensorData};

    use crate::quant::format::Minifloat;
    use crate::quant::scaling::{Scaling, amax, quantize, quantize_scale};

    /// `x` quantized to `format` with one scale from its amax, and dequantized: `[r, c]`, f32.
    pub fn fake_quantize(x: Tensor<2>, format: Minifloat) -> Tensor<2> {
        let (dims, device) = (x.dims(), x.device());
        let values: Vec<f32> = x.cast(DType::F32).into_data().try_to_vec().expect("f32 values");
        let scale = quantize_scale(format, amax(&values), 0);
        let q = quantize(&values, dims, format, Scaling::Tensor { quantize_scale: scale }, None);
        Tensor::from_data(TensorData::new(q.dequantize(), dims), (&device, DType::F32))
    }

    /// `fake_quantize(a) · fake_quantize(b)ᵀ` in f32, cast to `a`'s dtype.
    pub fn product(a: Tensor<2>, b: Tensor<2>, formats: super::Fp8Formats) -> Tensor<2> {
        let dtype = a.dtype();
        let (a, b) = (fake_quantize(a, formats.a), fake_quantize(b, formats.b));
        crate::f32_matmul::matmul(a, b.transpose()).cast(dtype)
    }
}

impl Fp8Ops for Flex {
    fn fp8_product(a: FloatTensor<Self>, b: FloatTensor<Self>, formats: Fp8Formats) -> FloatTensor<Self> {
        let t = |x| Tensor::<2>::from_primitive::<Flex>(x);
        reference::product(t(a), t(b), formats)
            .try_into_primitive::<Flex>()
            .expect("a CPU tensor")
    }
}

#[cfg(feature = "cuda")]
impl Fp8Ops for burn::backend::Cube {
    fn fp8_product(a: FloatTensor<Self>, b: FloatTensor<Self>, formats: Fp8Formats) -> FloatTensor<Self> {
        use burn::backend::Cube;
        use burn::backend::ops::FloatTensorOps;
        use burn::tensor::DType;
        let k = a.meta.shape()[1];
        let fp8 = |f: Minifloat| matches!(f, Minifloat::E4M3 | Minifloat::E5M2);
        if !k.is_multiple_of(16) || !fp8(formats.a) || !fp8(formats.b) {
            let t = |x| Tensor::<2>::from_primitive::<Cube>(x);
            return reference::product(t(a), t(b), formats)
                .try_into_primitive::<Cube>()
                .expect("a CUDA tensor");
        }
        let dtype = a.dtype;
        let (a_codes, a_scale) = quantize_operand(a, formats.a);
        let (b_codes, b_scale) = quantize_operand(b, formats.b);
        let scale = Cube::float_mul(a_scale, b_scale);
        let out = crate::wgmma::fp8_gemm(
            a_codes,
            b_codes,
            (formats.a, formats.b),
            scale,
            crate::wgmma::Schedule::Persistent,
        )
        .expect("FP8 codes of a k that is a multiple of 16");
        match dtype {
            DType::BF16 => out,
            other => Cube::float_cast(out, other.into()),
        }
    }
}

/// Codes of `t` row-major, and its dequantization scale: a transposed view of a row-major
/// tensor is quantized and transposed back in one pass.
#[cfg(feature = "cuda")]
fn quantize_operand(
    t: burn_cubecl::tensor::CubeTensor,
    format: Minifloat,
) -> (burn_cubecl::tensor::CubeTensor, burn_cubecl::tensor::CubeTensor) {
    use burn::backend::Cube;
    use burn::backend::ops::FloatTensorOps;
    let transpose = Cube::float_transpose(t.clone());
    match !crate::elementwise::is_compact(&t) && crate::elementwise::is_compact(&transpose) {
        true => crate::quant_kernels::quantize_tensor(transpose, format, true),
        false => crate::quant_kernels::quantize_tensor(t, format, false),
    }
}

#[derive(Debug)]
struct Fp8Backward;

impl<B: Backend + Fp8Ops> Backward<B, 2> for Fp8Backward {
    type State = (Option<NodeId>, Option<NodeId>, Fp8Formats);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let (a, b, f) = ops.state;
        let a: Option<FloatTensor<B>> = a.map(|id| checkpointer.retrieve_node_output(id));
        let b: Option<FloatTensor<B>> = b.map(|id| checkpointer.retrieve_node_output(id));
        binary::<B, _, _>(
            ops.parents,
            ops.node,
            grads,
            // d a = d out · b: `[m, n] · [n, k]`, as `product(d out, bᵀ)`.
            |grad| {
                let b = b.expect("b saved for a's gradient");
                let formats = Fp8Formats {
                    a: f.grad,
                    b: f.b,
                    grad: f.grad,
                };
                B::fp8_product(grad, B::float_transpose(b), formats)
            },
            // d b = d outᵀ · a: `[n, m] · [m, k]`, as `product(d outᵀ, aᵀ)`.
            |grad| {
                let a = a.expect("a saved for b's gradient");
                let formats = Fp8Formats {
                    a: f.grad,
                    b: f.a,
                    grad: f.grad,
                };
                B::fp8_product(B::float_transpose(grad), B::float_transpose(a), formats)
            },
        );
    }
}

impl<B: Backend + Fp8Ops, C: CheckpointStrategy> Fp8Ops for Autodiff<B, C> {
    fn fp8_product(a: FloatTensor<Self>, b: FloatTensor<Self>, formats: Fp8Formats) -> FloatTensor<Self> {
        let (a_tracked, b_tracked) = (a.is_tracked(), b.is_tracked());
        match Fp8Backward
            .prepare::<C>([a.node(), b.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                // Each operand is kept (in its own dtype) for the other's gradient.
                let a_state = b_tracked.then(|| prep.checkpoint(&a));
                let b_state = a_tracked.then(|| prep.checkpoint(&b));
                let out = B::fp8_product(a.into_parts().0, b.into_parts().0, formats);
                prep.finish((a_state, b_state, formats), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fp8_product(a.into_parts().0, b.into_parts().0, formats)),
        }
    }
}

/// `q(a) · q(b)ᵀ` through [`Fp8Ops`], differentiable.
///
/// # Shapes
/// `[m, k]`, `[n, k]` → `[m, n]`
pub fn product(a: Tensor<2>, b: Tensor<2>, formats: Fp8Formats) -> Tensor<2> {
    Tensor::from_dispatch(<burn::backend::Dispatch as Fp8Ops>::fp8_product(
        a.into_dispatch(),
        b.into_dispatch(),
        formats,
    ))
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Tensor};

    use super::*;

    /// ‖a − b‖ / ‖b‖.
    fn relative(a: Tensor<2>, b: Tensor<2>) -> f32 {
        let norm = |t: Tensor<2>| t.square().sum().sqrt().into_scalar::<f32>();
        norm(a - b.clone()) / norm(b)
    }

    /// On the CPU, the FP8 product and both gradients against the f32 product: each operand's
    /// values carry a relative rounding error of at most half a step, 2⁻⁴ for E4M3 and 2⁻³ for
    /// E5M2; a product's error is at most the sum of its operands' (to first order), and sums of
    /// independent errors do not grow relative to the result's norm. So the forward is within
    /// 2⁻⁴ + 2⁻⁴ = 0.125 and the gradients within 2⁻³ + 2⁻⁴ = 0.19 in norm; and it is not exact
    /// (above 1e-3: the operands were quantized).
    #[test]
    fn product_and_gradients_within_the_formats_bounds() {
        let device = Device::flex().autodiff();
        let normal = Distribution::Normal(0.0, 1.0);
        let x = Tensor::<2>::random([24, 64], normal, &device).require_grad();
        let w = Tensor::<2>::random([64, 40], normal, &device).require_grad();
        let dy = Tensor::<2>::random([24, 40], normal, &device);
        let ours = product(x.clone(), w.clone().transpose(), Fp8Formats::HYBRID);
        let exact = x.clone().matmul(w.clone());
        let forward = relative(ours.clone().detach(), exact.clone().detach());
        assert!(forward < 0.125 && forward > 1e-3, "forward relative error {forward}");
        let (g1, g2) = ((ours * dy.clone()).sum().backward(), (exact * dy).sum().backward());
        let dx = relative(x.grad(&g1).unwrap(), x.grad(&g2).unwrap());
        let dw = relative(w.grad(&g1).unwrap(), w.grad(&g2).unwrap());
        assert!(dx < 0.19 && dx > 1e-3, "dx relative error {dx}");
        assert!(dw < 0.19 && dw > 1e-3, "dw relative error {dw}");
    }
}
