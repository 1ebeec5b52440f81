//! Attention over queries and keys that RoPE rotates first, as one op differentiable in the
//! unrotated q and k: [`RotaryAttentionOps`]. The forward rotates q and k ([`crate::rope`]) and
//! runs [`AttentionOps`]'s attention; on CUDA the backward's kernels write dQ and dK through the
//! inverse rotation as they leave (dK's store from registers, dQ's conversion from its f32
//! sums), where RoPE's own backward read and wrote both once more. Elsewhere, and for tables the
//! kernels cannot index, the same rotations run apart.
//!
//! Legend: `b` batch, `h` heads, `s` sequence, `d` head dim.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend};
use burn::tensor::Tensor;

use super::{AttentionOps, constant_grads};
use crate::quant::notes::{AmaxNotes, NoteAmaxes};
use crate::rope::{RopeOps, RotatedHeads};

extension! {
    /// The backend extension behind [`rotary_attention`].
    pub trait RotaryAttentionOps, cuda: on_cuda;

    /// q and k rotated for positions `0..s` by the `[≥ s, d/2]` f32 tables (unless `rotated`:
    /// they arrive so, [`RotatedHeads`]), then [`AttentionOps::attention_forward`]: the output,
    /// each row's `lse₂`, and the rotated q and k (what the backward reads).
    ///
    /// # Shapes
    /// `[b, h, s, d]` × 3, `[≥ s, d/2]` × 2 → `[b, h, s, d]`, `[b, h, s]`, `[b, h, s, d]` × 2
    fn rotary_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        causal: bool,
        scale: f32,
        note: Option<AmaxNotes>,
        rotated: bool,
        ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        rotate_then_attend::<Self>(q, k, v, cos, sin, causal, scale, note, rotated)
    }

    /// The gradients of the unrotated q and k, and of v, given the rotated q and k, the
    /// forward's output and `lse₂`, and the output's gradient.
    fn rotary_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        causal: bool,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dq, dk, dv) = Self::attention_backward(q, k, v, out, lse, grad, causal, scale);
        // A rotation's transpose is its inverse.
        let unrotate = |x| Self::rope(x, cos.clone(), sin.clone(), true, NoteAmaxes::default());
        (unrotate(dq), unrotate(dk), dv)
    }
}

/// The forward as two rotations (unless q and k arrive `rotated`) and the attention, on any
/// backend that has both.
#[allow(clippy::too_many_arguments)]
fn rotate_then_attend<B: RopeOps + AttentionOps>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    causal: bool,
    scale: f32,
    note: Option<AmaxNotes>,
    rotated: bool,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let rotate = |x| match rotated {
        true => x,
        false => B::rope(x, cos.clone(), sin.clone(), false, NoteAmaxes::default()),
    };
    let (q, k) = (rotate(q), rotate(k));
    let (out, lse) = B::attention_forward(q.clone(), k.clone(), v, causal, scale, note);
    (out, lse, q, k)
}

/// CUDA's: the forward's two rotations and the flash kernels, the backward's kernels writing
/// dQ and dK unrotated.
#[cfg(feature = "cuda")]
mod on_cuda {
    use burn::backend::Cube;
    use burn_cubecl::tensor::CubeTensor;

    use crate::attention::launch::{Masking, Tables, backward};
    use crate::quant::notes::AmaxNotes;

    #[allow(clippy::too_many_arguments)]
    pub(super) fn rotary_attention_forward(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        cos: CubeTensor,
        sin: CubeTensor,
        causal: bool,
        scale: f32,
        note: Option<AmaxNotes>,
        rotated: bool,
    ) -> (CubeTensor, CubeTensor, CubeTensor, CubeTensor) {
        super::rotate_then_attend::<Cube>(q, k, v, cos, sin, causal, scale, note, rotated)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn rotary_attention_backward(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        out: CubeTensor,
        lse: CubeTensor,
        grad: CubeTensor,
        cos: CubeTensor,
        sin: CubeTensor,
        causal: bool,
        scale: f32,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        backward(
            q,
            k,
            v,
            out,
            lse,
            grad,
            Masking::Causal(causal),
            scale,
            Some(&Tables { cos, sin }),
        )
    }
}

#[derive(Debug)]
struct RotaryAttentionBackward;

/// The rotated q and k, v, the output and `lse₂`, the tables, the mask and the scale.
type State<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    bool,
    f32,
);

impl<B: Backend + RotaryAttentionOps> Backward<B, 3> for RotaryAttentionBackward {
    type State = State<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (q, k, v, out, lse, cos, sin, causal, scale) = ops.state;
        let (dq, dk, dv) = B::rotary_attention_backward(q, k, v, out, lse, grad, cos, sin, causal, scale);
        for (node, grad) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: Backend + RotaryAttentionOps, C: CheckpointStrategy> RotaryAttentionOps for Autodiff<B, C> {
    fn rotary_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        causal: bool,
        scale: f32,
        note: Option<AmaxNotes>,
        rotated: bool,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        let nodes = [q.node(), k.node(), v.node()];
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        let (cos, sin, v) = (inner(cos), inner(sin), inner(v));
        let (out, lse, q, k) = B::rotary_attention_forward(
            inner(q),
            inner(k),
            v.clone(),
            cos.clone(),
            sin.clone(),
            causal,
            scale,
            note,
            rotated,
        );
        // `lse₂` and the rotated q and k leave as constants: nothing differentiates through them.
        let outer = |t| <Self as AutodiffBackend>::from_inner(t);
        let (lse_out, q_out, k_out) = (outer(lse.clone()), outer(q.clone()), outer(k.clone()));
        let out = match RotaryAttentionBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((q, k, v, out.clone(), lse, cos, sin, causal, scale), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        (out, lse_out, q_out, k_out)
    }

    /// The inner backend's backward, as constants (no second-order gradients).
    fn rotary_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        causal: bool,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let tensors = [q, k, v, out, lse, grad, cos, sin];
        constant_grads::<B, C, 8>(tensors, |[q, k, v, out, lse, grad, cos, sin]| {
            B::rotary_attention_backward(q, k, v, out, lse, grad, cos, sin, causal, scale)
        })
    }
}

/// `attention(rope(q), rope(k), v)` through [`RotaryAttentionOps`], differentiable in q, k (as
/// they are before the rotation) and v; with `note`, the output's amax noted as
/// [`super::attention_noting`] does. The tables are `cos` and `sin` of each position's angles
/// ([`crate::rope::rope`]'s), constants.
///
/// # Shapes
/// `[b, h, s, d]` × 3, `[≥ s, d/2]` × 2 → `[b, h, s, d]`
pub fn rotary_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    cos: Tensor<2>,
    sin: Tensor<2>,
    causal: bool,
    note: Option<AmaxNotes>,
) -> Tensor<4> {
    attend_rotating(q, k, v, [cos, sin], causal, note, false)
}

/// [`rotary_attention`] of q and k that arrive rotated (their products rotated them:
/// [`crate::gemm::linear_rotated`]), read as they are; differentiable in the heads before the
/// rotation, as [`RotatedHeads`] are.
///
/// # Shapes
/// `[b, h, s, d]` × 3, `[≥ s, d/2]` × 2 → `[b, h, s, d]`
pub fn rotary_attention_rotated(
    q: RotatedHeads,
    k: RotatedHeads,
    v: Tensor<4>,
    cos: Tensor<2>,
    sin: Tensor<2>,
    causal: bool,
    note: Option<AmaxNotes>,
) -> Tensor<4> {
    let tables = [cos, sin];
    attend_rotating(q.into_tensor(), k.into_tensor(), v, tables, causal, note, true)
}

fn attend_rotating(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    [cos, sin]: [Tensor<2>; 2],
    causal: bool,
    note: Option<AmaxNotes>,
    rotated: bool,
) -> Tensor<4> {
    let scale = (q.dims()[3] as f32).sqrt().recip();
    let (out, ..) = <burn::backend::Dispatch as RotaryAttentionOps>::rotary_attention_forward(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        cos.into_dispatch(),
        sin.into_dispatch(),
        causal,
        scale,
        note,
        rotated,
    );
    Tensor::from_dispatch(out)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Tensor, Tolerance};

    use crate::attention::reference;

    /// On the CPU: RoPE and attention written in tensor ops and differentiated by Burn's
    /// autodiff give the same output and the same gradients of the unrotated q and k, and of v.
    #[test]
    fn matches_rope_then_attention_in_tensor_ops() {
        let device = Device::flex().autodiff();
        let input = || Tensor::<4>::random([2, 3, 7, 8], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let (q, k, v) = (input(), input(), input());
        let angles = Tensor::<2>::random([9, 4], Distribution::Uniform(0.0, 6.0), &device);
        let (cos, sin) = (angles.clone().cos(), angles.sin());
        let ours = super::rotary_attention(q.clone(), k.clone(), v.clone(), cos.clone(), sin.clone(), true, None);
        let rotate = |x: &Tensor<4>| crate::rope::reference::rope(x.clone(), cos.clone(), sin.clone(), false);
        let (theirs, _) = reference::forward(rotate(&q), rotate(&k), v.clone(), true, (8f32).sqrt().recip());
        // The same f32 operations in another order (the backward's softmax from lse₂): sums of
        // terms of order 1 rounded differently, up to 2.4e-5 apart in 800 unseeded draws (on
        // small values too, where terms cancel; 1e-5 failed one CI run); a rotation missed or
        // misplaced errs by the values' own size, order 0.1–1.
        let tolerance = Tolerance::rel_abs(1e-4, 1e-4);
        ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
        let weights = Tensor::<4>::random([2, 3, 7, 8], Distribution::Normal(0.0, 1.0), &device);
        let (g1, g2) = (
            (ours * weights.clone()).sum().backward(),
            (theirs * weights).sum().backward(),
        );
        for x in [&q, &k, &v] {
            let (a, b) = (x.grad(&g1).unwrap(), x.grad(&g2).unwrap());
            a.to_data().assert_approx_eq::<f32>(&b.to_data(), tolerance);
        }
    }

    /// On the CPU: q and k rotated by their products (`linear_rotated`, two heads of 8 over
    /// sequences of 5 in a batch of 2) and read as they are by the attention op give the output
    /// and the gradients of the input and both weights that RoPE and attention after the
    /// products in tensor ops give; a quantized product is refused (`None`).
    #[test]
    fn rotated_products_match_rotation_after_the_products() {
        use crate::gemm::{Gemm, linear_rotated};
        let device = Device::flex().autodiff();
        let normal = Distribution::Normal(0.0, 1.0);
        let x = Tensor::<3>::random([2, 5, 6], normal, &device).require_grad();
        let weight = || Tensor::<2>::random([6, 16], normal, &device).require_grad();
        let (wq, wk) = (weight(), weight());
        let v = Tensor::<4>::random([2, 2, 5, 8], normal, &device).require_grad();
        let angles = Tensor::<2>::random([7, 4], Distribution::Uniform(0.0, 6.0), &device);
        let (cos, sin) = (angles.clone().cos(), angles.sin());
        let rotated =
            |w: &Tensor<2>| linear_rotated(x.clone(), w.clone(), cos.clone(), sin.clone(), Gemm::Burn).unwrap();
        let (q, k) = (rotated(&wq), rotated(&wk));
        let heads = |w: &Tensor<2>| {
            let y = x
                .clone()
                .matmul(w.clone().unsqueeze::<3>())
                .reshape([2, 5, 2, 8])
                .swap_dims(1, 2);
            crate::rope::reference::rope(y, cos.clone(), sin.clone(), false)
        };
        // The same f32 operations in another order, the rotation before the attention either
        // way: sums of terms of order 1 through the softmax's backward rounded differently, up
        // to 2.4e-5 apart in 800 unseeded draws (on small values too, where terms cancel; 1e-5
        // failed one CI run); a rotation missed or misplaced errs by the values' own size.
        let tolerance = Tolerance::rel_abs(1e-4, 1e-4);
        q.values()
            .to_data()
            .assert_approx_eq::<f32>(&heads(&wq).to_data(), tolerance);
        let ours = super::rotary_attention_rotated(q, k, v.clone(), cos.clone(), sin.clone(), true, None);
        let (theirs, _) = reference::forward(heads(&wq), heads(&wk), v.clone(), true, (8f32).sqrt().recip());
        ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
        let weights = Tensor::<4>::random([2, 2, 5, 8], normal, &device);
        let (g1, g2) = (
            (ours * weights.clone()).sum().backward(),
            (theirs * weights).sum().backward(),
        );
        let grad = |t: &Tensor<3>, g| t.grad(g).unwrap().to_data();
        grad(&x, &g1).assert_approx_eq::<f32>(&grad(&x, &g2), tolerance);
        for w in [&wq, &wk] {
            let (a, b) = (w.grad(&g1).unwrap(), w.grad(&g2).unwrap());
            a.to_data().assert_approx_eq::<f32>(&b.to_data(), tolerance);
        }
        let (a, b) = (v.grad(&g1).unwrap(), v.grad(&g2).unwrap());
        a.to_data().assert_approx_eq::<f32>(&b.to_data(), tolerance);
        let recipe = crate::quant::recipe::Recipe::Fp8Tensorwise;
        assert!(linear_rotated(x, wq, cos, sin, Gemm::Quantized(recipe)).is_none());
    }
}
