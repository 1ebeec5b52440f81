//! SwiGLU, `silu(a) ∘ b`, as a backend extension, [`SwigluOps`], with its own backward: on CUDA
//! one elementwise kernel each way (the backward reads a, b and the gradient once and writes
//! both input gradients); elsewhere the plain tensor-op twin, [`reference`]. Both compute in
//! f32 and round once to the inputs' dtype. Where FP8 tensorwise products quantize a result next,
//! the CUDA kernels take its amax as they write it ([`NoteAmaxes`]), which spares the cast its own
//! pass over the tensor.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend};
use burn::tensor::Tensor;

use crate::quant::notes::{AmaxNotes, NoteAmaxes};

#[cfg(feature = "cuda")]
pub(crate) mod kernel;
pub mod reference;

extension! {
    /// The backend extension behind [`swiglu`].
    pub trait SwigluOps, cuda: kernel;

    /// `silu(a) ∘ b`; `a` and `b` of one shape. `notes` as [`NoteAmaxes`] says.
    fn swiglu(a: FloatTensor<Self>, b: FloatTensor<Self>, notes: NoteAmaxes) -> FloatTensor<Self> {
        reference::forward::<Self>(a, b)
    }

    /// The gradients of `a` and `b` given the output's, their amaxes noted into `note`.
    fn swiglu_backward(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        note: Option<AmaxNotes>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::backward::<Self>(a, b, grad)
    }
}

/// Where the backward notes its gradients' amaxes, if it does.
#[derive(Debug)]
struct SwigluBackward(Option<AmaxNotes>);

impl<B: Backend + SwigluOps> Backward<B, 2> for SwigluBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_a, node_b] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (a, b) = ops.state;
        let (da, db) = B::swiglu_backward(a, b, grad, self.0);
        for (node, grad) in [(node_a, da), (node_b, db)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: Backend + SwigluOps, C: CheckpointStrategy> SwigluOps for Autodiff<B, C> {
    fn swiglu(a: FloatTensor<Self>, b: FloatTensor<Self>, notes: NoteAmaxes) -> FloatTensor<Self> {
        let note = notes.input_grads.clone();
        let out = B::swiglu(a.clone().into_parts().0, b.clone().into_parts().0, notes);
        swiglu_node::<B, C>(a, b, note, out)
    }

    /// The inner backend's backward, as constants (no second-order gradients).
    fn swiglu_backward(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        note: Option<AmaxNotes>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        let (da, db) = B::swiglu_backward(inner(a), inner(b), inner(grad), note);
        (
            <Self as AutodiffBackend>::from_inner(da),
            <Self as AutodiffBackend>::from_inner(db),
        )
    }
}

/// `out`, the inner backend's `silu(a) ∘ b` (computed by the caller, perhaps in the epilogue
/// of the products that wrote `a` and `b`: [`crate::gated_mlp`]), as the output of a SwiGLU node
/// whose backward is [`SwigluOps::swiglu_backward`] (noting its gradients' amaxes with `note`).
pub(crate) fn swiglu_node<B: Backend + SwigluOps, C: CheckpointStrategy>(
    a: FloatTensor<Autodiff<B, C>>,
    b: FloatTensor<Autodiff<B, C>>,
    note: Option<AmaxNotes>,
    out: FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    let nodes = [a.node(), b.node()];
    match SwigluBackward(note).prepare::<C>(nodes).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish((a.into_parts().0, b.into_parts().0), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

/// `silu(a) ∘ b` through [`SwigluOps`], differentiable.
///
/// # Shapes
/// `a` and `b` of one shape → that shape
pub fn swiglu<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> Tensor<D> {
    swiglu_noting(a, b, NoteAmaxes::default())
}

/// [`swiglu`], the amaxes of the results `notes` names taken as they are written (CUDA), for the
/// FP8 tensorwise casts that quantize them next.
pub fn swiglu_noting<const D: usize>(a: Tensor<D>, b: Tensor<D>, notes: NoteAmaxes) -> Tensor<D> {
    Tensor::from_dispatch(<burn::backend::Dispatch as SwigluOps>::swiglu(
        a.into_dispatch(),
        b.into_dispatch(),
        notes,
    ))
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
}
