//! Rotary position embedding on the two halves of each head (Hugging Face Llama's and
//! Megatron's layout) as a backend extension, [`RopeOps`], with its own backward (the inverse
//! rotation of the gradient): on CUDA one elementwise kernel that reads any `[b, h, s, d]` view
//! with a contiguous head dim; elsewhere the tensor-op twin, [`reference`]. Both rotate in f32
//! and round once. Where FP8 tensorwise products quantize the input's gradient next (q's and k's
//! projections), the CUDA kernel leaves its blocks' maxima for its amax ([`NoteAmaxes`]).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend};
use burn::tensor::Tensor;

use crate::quant::notes::{AmaxNotes, NoteAmaxes};

#[cfg(feature = "cuda")]
pub(crate) mod kernel;
pub mod reference;

extension! {
    /// The backend extension behind [`rope`].
    pub trait RopeOps, cuda: kernel;

    /// `x` rotated for positions `0..s` by the `[≥ s, d/2]` f32 tables: `(x₁, x₂) →
    /// (x₁cos − x₂sin, x₂cos + x₁sin)`, or by the inverse rotation when `inverse`; amaxes
    /// noted as `notes` says.
    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        inverse: bool,
        notes: NoteAmaxes,
    ) -> FloatTensor<Self> {
        let table = |t| Tensor::<2>::from_primitive::<Self>(t);
        reference::rope(Tensor::from_primitive::<Self>(x), table(cos), table(sin), inverse)
            .try_into_primitive::<Self>()
            .expect("flex")
    }
}

/// Where the backward notes the input gradient's amax, if it does.
#[derive(Debug)]
struct RopeBackward(Option<AmaxNotes>);

impl<B: Backend + RopeOps> Backward<B, 1> for RopeBackward {
    /// The tables and the direction.
    type State = (FloatTensor<B>, FloatTensor<B>, bool);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (cos, sin, inverse) = ops.state;
        // A rotation's transpose is its inverse.
        let notes = NoteAmaxes::output(self.0);
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::rope(grad, cos, sin, !inverse, notes)
        });
    }
}

impl<B: Backend + RopeOps, C: CheckpointStrategy> RopeOps for Autodiff<B, C> {
    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        inverse: bool,
        notes: NoteAmaxes,
    ) -> FloatTensor<Self> {
        let (cos, sin) = (cos.into_parts().0, sin.into_parts().0);
        let forward = NoteAmaxes::output(notes.output);
        match RopeBackward(notes.input_grads)
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::rope(x.into_parts().0, cos.clone(), sin.clone(), inverse, forward);
                prep.finish((cos, sin, inverse), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::rope(x.into_parts().0, cos, sin, inverse, forward)),
        }
    }
}

/// `x` rotated for positions `0..s` through [`RopeOps`], differentiable in `x` (the tables are
/// constants).
///
/// # Shapes
/// `[b, h, s, d]`, `[≥ s, d/2]` × 2 → `[b, h, s, d]`
pub fn rope(x: Tensor<4>, cos: Tensor<2>, sin: Tensor<2>) -> Tensor<4> {
    rope_noting(x, cos, sin, NoteAmaxes::default())
}

/// [`rope`], the amaxes `notes` names taken as they are written (CUDA): the output's, or the
/// input gradient's (q's and k's projections' output gradients), for the FP8 tensorwise casts
/// that quantize them next.
pub fn rope_noting(x: Tensor<4>, cos: Tensor<2>, sin: Tensor<2>, notes: NoteAmaxes) -> Tensor<4> {
    Tensor::from_dispatch(<burn::backend::Dispatch as RopeOps>::rope(
        x.into_dispatch(),
        cos.into_dispatch(),
        sin.into_dispatch(),
        false,
        notes,
    ))
}

/// Heads `[b, h, s, d]` held as RoPE rotates them for positions `0..s`, differentiable as the
/// heads before the rotation: the gradient they take is the unrotated heads'. A product that
/// rotates in its epilogue makes them ([`crate::gemm::linear_rotated`]); the attention op that
/// rotates q and k reads them as they are
/// ([`crate::attention::rotary::rotary_attention_rotated`]), its backward handing back the
/// unrotated heads' gradients as it does for heads it rotates itself. The type keeps them from
/// any other op, which would read rotated values and hand back a gradient of the wrong heads.
#[derive(Clone, Debug)]
pub struct RotatedHeads(Tensor<4>);

impl RotatedHeads {
    pub(crate) fn new(heads: Tensor<4>) -> Self {
        Self(heads)
    }

    pub(crate) fn into_tensor(self) -> Tensor<4> {
        self.0
    }

    pub fn dims(&self) -> [usize; 4] {
        self.0.dims()
    }

    /// The rotated values, as constants (nothing differentiates through them).
    pub fn values(&self) -> Tensor<4> {
        self.0.clone().detach()
    }

    /// The heads laid out anew by `f`, which may move values along the batch and head dims
    /// only (a view of `[b, s, h·d]` as heads, kv heads repeated for grouped queries): each
    /// value keeps its position and its place in its head, with which the rotation commutes.
    pub fn map_layout(self, f: impl FnOnce(Tensor<4>) -> Tensor<4>) -> Self {
        let [_, _, s, d] = self.dims();
        let heads = f(self.0);
        let [_, _, s2, d2] = heads.dims();
        assert!(
            (s2, d2) == (s, d),
            "a layout of rotated heads keeps their positions and head dim: [.., {s}, {d}], not [.., {s2}, {d2}]"
        );
        Self(heads)
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Tensor, Tolerance};

    /// On the CPU the extension is the rotation written in tensor ops, differentiated by
    /// autodiff: the same values and gradients (the backward is the inverse rotation).
    #[test]
    fn matches_autodiff_with_gradients() {
        let device = Device::flex().autodiff();
        let x = Tensor::<4>::random([2, 3, 5, 8], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let angles = Tensor::<2>::random([7, 4], Distribution::Uniform(0.0, 6.0), &device);
        let (cos, sin) = (angles.clone().cos(), angles.sin());
        let ours = super::rope(x.clone(), cos.clone(), sin.clone());
        let theirs = super::reference::rope(x.clone(), cos, sin, false);
        // The same f32 products: equal up to rounding order.
        let tolerance = Tolerance::absolute(1e-6);
        ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
        let weights = Tensor::<4>::random([2, 3, 5, 8], Distribution::Normal(0.0, 1.0), &device);
        let (g1, g2) = (
            (ours * weights.clone()).sum().backward(),
            (theirs * weights).sum().backward(),
        );
        x.grad(&g1)
            .unwrap()
            .to_data()
            .assert_approx_eq::<f32>(&x.grad(&g2).unwrap().to_data(), tolerance);
    }
}
