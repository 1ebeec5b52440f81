//! SwiGLU, `silu(a) ∘ b`, as a backend extension, [`SwigluOps`], with its own backward: on CUDA
//! one elementwise kernel each way (the backward reads a, b and the gradient once and writes
//! both input gradients); elsewhere the plain tensor-op twin, [`reference`]. Both compute in
//! f32 and round once to the inputs' dtype.
//!
//! [`swiglu_packed`] takes `a` and `b` side by side in one tensor, as one product of the gate
//! and up projections' weights side by side makes them, and gives its gradient the same way:
//! no slice of the product, whose gradient Burn would build as a zero tensor of the whole
//! product for each half and their sum.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, Flex, backend_extension};
use burn::tensor::Tensor;

/// The backend extension behind [`swiglu`].
#[backend_extension(Flex, Cube: cfg(feature = "cuda"), Autodiff)]
pub trait SwigluOps: Backend {
    /// `silu(a) ∘ b`; `a` and `b` of one shape.
    fn swiglu(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self>;

    /// The gradients of `a` and `b` given the output's.
    fn swiglu_backward(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `silu(a) ∘ b` of `y = [a | b]`, its two halves along the last dim.
    fn swiglu_packed(y: FloatTensor<Self>) -> FloatTensor<Self>;

    /// The gradient of `y = [a | b]` given the output's: `[da | db]`.
    fn swiglu_packed_backward(y: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// The plain tensor-op twin, on any backend's primitives: the CPU path and the kernels' oracle.
pub mod reference {
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{Backend, Scalar, TensorMetadata};
    use burn::tensor::FloatDType;

    /// `σ(a)` of an f32 tensor.
    fn sigmoid<B: Backend>(a: FloatTensor<B>) -> FloatTensor<B> {
        B::float_recip(B::float_add_scalar(B::float_exp(B::float_neg(a)), Scalar::from(1.0f32)))
    }

    fn f32<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
        B::float_cast(t, FloatDType::F32)
    }

    pub fn forward<B: Backend>(a: FloatTensor<B>, b: FloatTensor<B>) -> FloatTensor<B> {
        let dtype = FloatDType::from(a.dtype());
        let a = f32::<B>(a);
        let silu = B::float_mul(a.clone(), sigmoid::<B>(a));
        B::float_cast(B::float_mul(silu, f32::<B>(b)), dtype)
    }

    /// `da = g ∘ b ∘ σ(a)(1 + a(1 − σ(a)))`, `db = g ∘ a ∘ σ(a)`.
    pub fn backward<B: Backend>(
        a: FloatTensor<B>,
        b: FloatTensor<B>,
        grad: FloatTensor<B>,
    ) -> (FloatTensor<B>, FloatTensor<B>) {
        let dtype = FloatDType::from(a.dtype());
        let (a, b, grad) = (f32::<B>(a), f32::<B>(b), f32::<B>(grad));
        let s = sigmoid::<B>(a.clone());
        let one_minus_s = B::float_add_scalar(B::float_neg(s.clone()), Scalar::from(1.0f32));
        let slope = B::float_mul(
            s.clone(),
            B::float_add_scalar(B::float_mul(a.clone(), one_minus_s), Scalar::from(1.0f32)),
        );
        let da = B::float_mul(B::float_mul(grad.clone(), b), slope);
        let db = B::float_mul(grad, B::float_mul(a, s));
        (B::float_cast(da, dtype), B::float_cast(db, dtype))
    }

    /// `y`'s two halves along its last dim.
    fn halves<B: Backend>(y: FloatTensor<B>) -> (FloatTensor<B>, FloatTensor<B>) {
        let shape = y.shape();
        let (last, f) = (shape.num_dims() - 1, shape[shape.num_dims() - 1] / 2);
        let half = |start: usize| {
            let slices: Vec<burn::tensor::Slice> = (0..=last)
                .map(|d| match d == last {
                    true => burn::tensor::Slice::from(start..start + f),
                    false => burn::tensor::Slice::from(0..shape[d]),
                })
                .collect();
            B::float_slice(y.clone(), &slices)
        };
        (half(0), half(f))
    }

    pub fn forward_packed<B: Backend>(y: FloatTensor<B>) -> FloatTensor<B> {
        let (a, b) = halves::<B>(y);
        forward::<B>(a, b)
    }

    pub fn backward_packed<B: Backend>(y: FloatTensor<B>, grad: FloatTensor<B>) -> FloatTensor<B> {
        let last = y.shape().num_dims() - 1;
        let (a, b) = halves::<B>(y);
        let (da, db) = backward::<B>(a, b, grad);
        B::float_cat(vec![da, db], last)
    }
}

impl SwigluOps for Flex {
    fn swiglu(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::forward::<Flex>(a, b)
    }

    fn swiglu_backward(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::backward::<Flex>(a, b, grad)
    }

    fn swiglu_packed(y: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::forward_packed::<Flex>(y)
    }

    fn swiglu_packed_backward(y: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::backward_packed::<Flex>(y, grad)
    }
}

#[cfg(feature = "cuda")]
impl SwigluOps for burn::backend::Cube {
    fn swiglu(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::elementwise::swiglu(a, b)
    }

    fn swiglu_backward(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        crate::elementwise::swiglu_backward(a, b, grad)
    }

    fn swiglu_packed(y: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::elementwise::swiglu_packed(y)
    }

    fn swiglu_packed_backward(y: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::elementwise::swiglu_packed_backward(y, grad)
    }
}

#[derive(Debug)]
struct SwigluBackward;

impl<B: Backend + SwigluOps> Backward<B, 2> for SwigluBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_a, node_b] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (a, b) = ops.state;
        let (da, db) = B::swiglu_backward(a, b, grad);
        for (node, grad) in [(node_a, da), (node_b, db)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

#[derive(Debug)]
struct SwigluPackedBackward;

impl<B: Backend + SwigluOps> Backward<B, 1> for SwigluPackedBackward {
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let y = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| B::swiglu_packed_backward(y, grad));
    }
}

impl<B: Backend + SwigluOps, C: CheckpointStrategy> SwigluOps for Autodiff<B, C> {
    fn swiglu(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        let nodes = [a.node(), b.node()];
        let (a, b) = (a.into_parts().0, b.into_parts().0);
        match SwigluBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = B::swiglu(a.clone(), b.clone());
                prep.finish((a, b), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::swiglu(a, b)),
        }
    }

    /// The inner backend's backward, as constants (no second-order gradients).
    fn swiglu_backward(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        let (da, db) = B::swiglu_backward(inner(a), inner(b), inner(grad));
        (
            <Self as AutodiffBackend>::from_inner(da),
            <Self as AutodiffBackend>::from_inner(db),
        )
    }

    fn swiglu_packed(y: FloatTensor<Self>) -> FloatTensor<Self> {
        match SwigluPackedBackward.prepare::<C>([y.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let y = y.into_parts().0;
                let out = B::swiglu_packed(y.clone());
                prep.finish(y, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::swiglu_packed(y.into_parts().0)),
        }
    }

    /// The inner backend's backward, as a constant (no second-order gradients).
    fn swiglu_packed_backward(y: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        let dy = B::swiglu_packed_backward(y.into_parts().0, grad.into_parts().0);
        <Self as AutodiffBackend>::from_inner(dy)
    }
}

/// `silu(a) ∘ b` through [`SwigluOps`], differentiable.
///
/// # Shapes
/// `a` and `b` of one shape → that shape
pub fn swiglu<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<burn::backend::Dispatch as SwigluOps>::swiglu(
        a.into_dispatch(),
        b.into_dispatch(),
    ))
}

/// `silu(a) ∘ b` of `y = [a | b]` (its halves along the last dim) through [`SwigluOps`],
/// differentiable: `y`'s gradient is `[da | db]`.
///
/// # Shapes
/// `[.., 2f]` → `[.., f]`
pub fn swiglu_packed<const D: usize>(y: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<burn::backend::Dispatch as SwigluOps>::swiglu_packed(y.into_dispatch()))
}

#[cfg(test)]
mod tests {
    use burn::tensor::activation::silu;
    use burn::tensor::{Device, Distribution, Tensor, Tolerance};

    /// On the CPU the extension is `silu(a) ∘ b` differentiated by autodiff: the same values and
    /// gradients.
    #[test]
    fn matches_burn_with_gradients() {
        let device = Device::flex().autodiff();
        let input = || Tensor::<3>::random([2, 5, 7], Distribution::Normal(0.0, 2.0), &device).require_grad();
        let (a, b) = (input(), input());
        let ours = super::swiglu(a.clone(), b.clone());
        let theirs = silu(a.clone()) * b.clone();
        // f32 both ways, the derivative written out instead of chained: a few ulps.
        let tolerance = Tolerance::absolute(1e-5);
        ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
        let weights = Tensor::<3>::random([2, 5, 7], Distribution::Normal(0.0, 1.0), &device);
        let (g1, g2) = (
            (ours * weights.clone()).sum().backward(),
            (theirs * weights).sum().backward(),
        );
        for x in [&a, &b] {
            x.grad(&g1)
                .unwrap()
                .to_data()
                .assert_approx_eq::<f32>(&x.grad(&g2).unwrap().to_data(), tolerance);
        }
    }

    /// The packed form is the two-input one on `y`'s halves: the same values, and `y`'s
    /// gradient is the two inputs' side by side.
    #[test]
    fn packed_is_the_halves_with_gradients() {
        let device = Device::flex().autodiff();
        let y = Tensor::<3>::random([2, 5, 14], Distribution::Normal(0.0, 2.0), &device).require_grad();
        let ours = super::swiglu_packed(y.clone());
        let theirs = silu(y.clone().narrow(2, 0, 7)) * y.clone().narrow(2, 7, 7);
        // f32 both ways, the derivative written out instead of chained: a few ulps.
        let tolerance = Tolerance::absolute(1e-5);
        ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
        let weights = Tensor::<3>::random([2, 5, 7], Distribution::Normal(0.0, 1.0), &device);
        let (g1, g2) = (
            (ours * weights.clone()).sum().backward(),
            (theirs * weights).sum().backward(),
        );
        y.grad(&g1)
            .unwrap()
            .to_data()
            .assert_approx_eq::<f32>(&y.grad(&g2).unwrap().to_data(), tolerance);
    }
}
