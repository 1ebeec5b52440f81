//! Causal attention inside documents, for sequences that pack several documents end to end
//! (packed SFT): each query sees the keys of its own document up to itself. A backend extension,
//! [`DocumentAttentionOps`], with its own backward that keeps q, k, v, the output and `lse₂`
//! only (as [`super::AttentionOps`] does): the `[b, h, s, s]` scores live one layer at a time,
//! in its forward and again in its backward.
//!
//! Every backend runs the f32 reference ([`reference::Mask::Documents`]): the flash kernels do
//! not take a document mask yet.
//!
//! Legend: `b` batch, `h` heads, `s` sequence, `d` head dim.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor};

#[cfg(feature = "cuda")]
use super::launch;
use super::reference::{self, Mask};

extension! {
    /// The backend extension behind [`document_attention`].
    pub trait DocumentAttentionOps, cuda: launch;

    /// `softmax(q·kᵀ·scale, the keys outside each query's document or after it hidden) · v` and
    /// each row's `lse₂` (f32); `starts` `[b, s]` is each query's document's first position.
    ///
    /// # Shapes
    /// `[b, h, s, d]` × 3, `[b, s]` → `[b, h, s, d]`, `[b, h, s]`
    fn document_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let t = |x| Tensor::<4>::from_primitive::<Self>(x);
        let starts = Tensor::<2, Int>::from_primitive::<Self>(starts);
        let (out, lse) = reference::forward_masked(t(q), t(k), t(v), Mask::Documents(&starts), scale);
        (
            out.try_into_primitive::<Self>().expect("flex"),
            lse.try_into_primitive::<Self>().expect("flex"),
        )
    }

    /// The gradients of q, k and v, given the forward's output and `lse₂` and the output's
    /// gradient.
    fn document_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let t = |x| Tensor::<4>::from_primitive::<Self>(x);
        let lse = Tensor::<3>::from_primitive::<Self>(lse);
        let starts = Tensor::<2, Int>::from_primitive::<Self>(starts);
        let (dq, dk, dv) = reference::backward_masked(t(q), t(k), t(v), t(out), lse, t(grad), Mask::Documents(&starts), scale);
        let p = |x: Tensor<4>| x.try_into_primitive::<Self>().expect("flex");
        (p(dq), p(dk), p(dv))
    }
}

#[derive(Debug)]
struct DocumentAttentionBackward;

impl<B: Backend + DocumentAttentionOps> Backward<B, 3> for DocumentAttentionBackward {
    /// q, k, v, the output and `lse₂`, the documents' starts and the scale.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        IntTensor<B>,
        f32,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (q, k, v, out, lse, starts, scale) = ops.state;
        let (dq, dk, dv) = B::document_attention_backward(q, k, v, out, lse, grad, starts, scale);
        for (node, grad) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: Backend + DocumentAttentionOps, C: CheckpointStrategy> DocumentAttentionOps for Autodiff<B, C> {
    fn document_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let nodes = [q.node(), k.node(), v.node()];
        let (q, k, v) = (q.into_parts().0, k.into_parts().0, v.into_parts().0);
        let (out, lse) = B::document_attention_forward(q.clone(), k.clone(), v.clone(), starts.clone(), scale);
        let lse_out = <Self as AutodiffBackend>::from_inner(lse.clone());
        let out = match DocumentAttentionBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((q, k, v, out.clone(), lse, starts, scale), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        (out, lse_out)
    }

    /// The inner backend's backward, as constants (no second-order gradients).
    fn document_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        starts: IntTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        let (dq, dk, dv) = B::document_attention_backward(
            inner(q),
            inner(k),
            inner(v),
            inner(out),
            inner(lse),
            inner(grad),
            starts,
            scale,
        );
        let outer = |t| <Self as AutodiffBackend>::from_inner(t);
        (outer(dq), outer(dk), outer(dv))
    }
}

/// Causal attention inside documents, `softmax(q·kᵀ / √d, masked) · v`, through
/// [`DocumentAttentionOps`]: query `i` of row `b` sees keys `starts[b, i] ..= i`. Differentiable.
///
/// # Shapes
/// `[b, h, s, d]` × 3, `[b, s]` → `[b, h, s, d]`
pub fn document_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, starts: Tensor<2, Int>) -> Tensor<4> {
    let scale = (q.dims()[3] as f32).sqrt().recip();
    let (out, _) = <burn::backend::Dispatch as DocumentAttentionOps>::document_attention_forward(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        starts.into_dispatch(),
        scale,
    );
    Tensor::from_dispatch(out)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Int, Tensor, TensorData, Tolerance};

    use super::document_attention;
    use crate::attention::attention;

    /// Two documents packed in one row (5 and 3 tokens) give each document's own causal
    /// attention, run alone; the gradients of q, k and v too. A row holding one document is
    /// plain causal attention.
    #[test]
    fn packed_documents_attend_as_if_alone() {
        let device = Device::flex().autodiff();
        let input = || Tensor::<4>::random([2, 3, 8, 16], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let (q, k, v) = (input(), input(), input());
        let starts = Tensor::<2, Int>::from_data(
            TensorData::new(vec![0i64, 0, 0, 0, 0, 5, 5, 5, 0, 0, 0, 0, 0, 0, 0, 0], [2, 8]),
            &device,
        );
        let packed = document_attention(q.clone(), k.clone(), v.clone(), starts);
        let part =
            |t: &Tensor<4>, row: usize, from: usize, len: usize| t.clone().narrow(0, row, 1).narrow(2, from, len);
        let alone = |row, from, len| {
            attention(
                part(&q, row, from, len),
                part(&k, row, from, len),
                part(&v, row, from, len),
                true,
            )
        };
        let expected = Tensor::cat(
            vec![Tensor::cat(vec![alone(0, 0, 5), alone(0, 5, 3)], 2), alone(1, 0, 8)],
            0,
        );
        // The same f32 arithmetic over the same keys (masked keys add exp(-inf) = 0): ulps.
        let tolerance = Tolerance::absolute(1e-5);
        packed.to_data().assert_approx_eq::<f32>(&expected.to_data(), tolerance);
        let weights = Tensor::<4>::random([2, 3, 8, 16], Distribution::Normal(0.0, 1.0), &device);
        let (ours, theirs) = (
            (packed * weights.clone()).sum().backward(),
            (expected * weights).sum().backward(),
        );
        for x in [&q, &k, &v] {
            let (a, e) = (x.grad(&ours).unwrap(), x.grad(&theirs).unwrap());
            a.to_data().assert_approx_eq::<f32>(&e.to_data(), tolerance);
        }
    }
}
