//! Attention over the packed product of the q, k and v projections, as a backend extension,
//! [`PackedAttentionOps`], with its own backward: RoPE on the q and k heads, grouped-query
//! attention, and the gradient of the whole packed tensor at once.
//!
//! One product of the three projections' weights side by side gives each token a row of `h`
//! query heads, then `g` key heads, then `g` value heads (`[b, s, (h + 2g)·d]`). Slicing that
//! row into q, k and v would cost the backward a zero tensor of the whole product for each
//! slice and their sum (Burn's slice backward); this op takes the row as it is and gives its
//! gradient back the same way. On CUDA (bf16, head dim 128) RoPE rotates the q and k heads in
//! place and the flash kernels read all three as views of the row; the backward's dV lands in
//! the packed gradient straight from the kernel, and dQ and dK through the inverse rotation.
//! Elsewhere the tensor-op twin, [`reference`], composes RoPE's and attention's references.
//!
//! Legend: `b` batch, `s` sequence, `h` query heads, `g` kv heads, `n = h + 2g`, `d` head dim.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, Flex, backend_extension};
use burn::tensor::Tensor;

/// The backend extension behind [`packed_attention`].
#[backend_extension(Flex, Cube: cfg(feature = "cuda"), Autodiff)]
pub trait PackedAttentionOps: Backend {
    /// The attention of the packed `y` (`heads` query heads, `kv_heads` key and value heads a
    /// row), its q and k heads rotated by the `[≥ s, d/2]` f32 tables, scaled by `1/√d`: the
    /// output, each query row's `lse₂` and `y` with q and k rotated (what the backward reads).
    ///
    /// # Shapes
    /// `[b, s, n·d]` → `[b, s, h·d]`, `[b, h, s]`, `[b, s, n·d]`
    #[allow(clippy::too_many_arguments)]
    fn packed_attention_forward(
        y: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        heads: usize,
        kv_heads: usize,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// The gradient of the packed input, given the forward's rotated input, output and `lse₂`
    /// and the output's gradient.
    ///
    /// # Shapes
    /// `[b, s, n·d]`, `[b, s, h·d]`, `[b, h, s]`, `[b, s, h·d]` → `[b, s, n·d]`
    #[allow(clippy::too_many_arguments)]
    fn packed_attention_backward(
        rotated: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        heads: usize,
        kv_heads: usize,
        causal: bool,
    ) -> FloatTensor<Self>;
}

/// The plain tensor-op twin: the CPU path and the CUDA kernels' oracle.
pub mod reference {
    use burn::tensor::Tensor;

    use crate::rope::reference::rope;

    /// The q, k and v heads of a packed `y`.
    ///
    /// # Shapes
    /// `[b, s, n·d]` → `[b, h, s, d]`, `[b, g, s, d]`, `[b, g, s, d]`
    pub fn split(y: Tensor<3>, heads: usize, kv_heads: usize) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
        let [b, s, width] = y.dims();
        let n = heads + 2 * kv_heads;
        let y = y.reshape([b, s, n, width / n]).swap_dims(1, 2);
        (
            y.clone().narrow(1, 0, heads),
            y.clone().narrow(1, heads, kv_heads),
            y.narrow(1, heads + kv_heads, kv_heads),
        )
    }

    /// q, k and v heads packed back into one row a token.
    ///
    /// # Shapes
    /// `[b, h, s, d]`, `[b, g, s, d]`, `[b, g, s, d]` → `[b, s, n·d]`
    pub fn pack(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<3> {
        let [b, _, s, d] = q.dims();
        let n = q.dims()[1] + k.dims()[1] + v.dims()[1];
        Tensor::cat(vec![q, k, v], 1).swap_dims(1, 2).reshape([b, s, n * d])
    }

    /// Each of `x`'s kv heads `repeat` times in a row: query head `i` reads kv head `i / repeat`.
    ///
    /// # Shapes
    /// `[b, g, s, d]` → `[b, g·repeat, s, d]`
    pub fn repeat_heads(x: Tensor<4>, repeat: usize) -> Tensor<4> {
        if repeat == 1 {
            return x;
        }
        let [b, g, s, d] = x.dims();
        x.unsqueeze_dim::<5>(2)
            .repeat_dim(2, repeat)
            .reshape([b, g * repeat, s, d])
    }

    /// [`repeat_heads`]'s backward: each kv head's gradient is the sum of its query heads'.
    ///
    /// # Shapes
    /// `[b, g·repeat, s, d]` → `[b, g, s, d]`
    pub fn sum_heads(x: Tensor<4>, repeat: usize) -> Tensor<4> {
        if repeat == 1 {
            return x;
        }
        let [b, h, s, d] = x.dims();
        x.reshape([b, h / repeat, repeat, s, d])
            .sum_dim(2)
            .reshape([b, h / repeat, s, d])
    }

    /// The output `[b, s, h·d]`, `lse₂` `[b, h, s]` and the rotated packed input.
    pub fn forward(
        y: Tensor<3>,
        cos: Tensor<2>,
        sin: Tensor<2>,
        heads: usize,
        kv_heads: usize,
        causal: bool,
    ) -> (Tensor<3>, Tensor<3>, Tensor<3>) {
        let [b, s, _] = y.dims();
        let (q, k, v) = split(y, heads, kv_heads);
        let d = q.dims()[3];
        let (q, k) = (rope(q, cos.clone(), sin.clone(), false), rope(k, cos, sin, false));
        let rotated = pack(q.clone(), k.clone(), v.clone());
        let repeat = heads / kv_heads;
        let (out, lse) =
            super::super::reference::forward(q, repeat_heads(k, repeat), repeat_heads(v, repeat), causal, scale(d));
        (out.swap_dims(1, 2).reshape([b, s, heads * d]), lse, rotated)
    }

    /// The packed input's gradient `[b, s, n·d]`.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        rotated: Tensor<3>,
        out: Tensor<3>,
        lse: Tensor<3>,
        grad: Tensor<3>,
        cos: Tensor<2>,
        sin: Tensor<2>,
        heads: usize,
        kv_heads: usize,
        causal: bool,
    ) -> Tensor<3> {
        let [b, s, _] = out.dims();
        let (q, k, v) = split(rotated, heads, kv_heads);
        let d = q.dims()[3];
        let per_head = |t: Tensor<3>| t.reshape([b, s, heads, d]).swap_dims(1, 2);
        let repeat = heads / kv_heads;
        let (dq, dk, dv) = super::super::reference::backward(
            q,
            repeat_heads(k, repeat),
            repeat_heads(v, repeat),
            per_head(out),
            lse,
            per_head(grad),
            causal,
            scale(d),
        );
        let (dk, dv) = (sum_heads(dk, repeat), sum_heads(dv, repeat));
        // A rotation's transpose is its inverse.
        pack(rope(dq, cos.clone(), sin.clone(), true), rope(dk, cos, sin, true), dv)
    }

    /// `1/√d`.
    pub fn scale(d: usize) -> f32 {
        (d as f32).sqrt().recip()
    }
}

impl PackedAttentionOps for Flex {
    fn packed_attention_forward(
        y: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        heads: usize,
        kv_heads: usize,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (out, lse, rotated) = reference::forward(t(y), t(cos), t(sin), heads, kv_heads, causal);
        (p(out), p(lse), p(rotated))
    }

    fn packed_attention_backward(
        rotated: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        heads: usize,
        kv_heads: usize,
        causal: bool,
    ) -> FloatTensor<Self> {
        p(reference::backward(
            t(rotated),
            t(out),
            t(lse),
            t(grad),
            t(cos),
            t(sin),
            heads,
            kv_heads,
            causal,
        ))
    }
}

fn t<const D: usize>(x: FloatTensor<Flex>) -> Tensor<D> {
    Tensor::from_primitive::<Flex>(x)
}

fn p<const D: usize>(x: Tensor<D>) -> FloatTensor<Flex> {
    x.try_into_primitive::<Flex>().expect("flex")
}

#[cfg(feature = "cuda")]
impl PackedAttentionOps for burn::backend::Cube {
    fn packed_attention_forward(
        y: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        heads: usize,
        kv_heads: usize,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        super::packed_launch::forward(y, cos, sin, heads, kv_heads, causal)
    }

    fn packed_attention_backward(
        rotated: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        heads: usize,
        kv_heads: usize,
        causal: bool,
    ) -> FloatTensor<Self> {
        super::packed_launch::backward(rotated, out, lse, grad, cos, sin, heads, kv_heads, causal)
    }
}

#[derive(Debug)]
struct PackedAttentionBackward;

/// The rotated input, the output, `lse₂`, the tables, the heads and the mask.
type PackedState<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    usize,
    usize,
    bool,
);

impl<B: Backend + PackedAttentionOps> Backward<B, 1> for PackedAttentionBackward {
    type State = PackedState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (rotated, out, lse, cos, sin, heads, kv_heads, causal) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::packed_attention_backward(rotated, out, lse, grad, cos, sin, heads, kv_heads, causal)
        });
    }
}

impl<B: Backend + PackedAttentionOps, C: CheckpointStrategy> PackedAttentionOps for Autodiff<B, C> {
    fn packed_attention_forward(
        y: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        heads: usize,
        kv_heads: usize,
        causal: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let node = y.node();
        let (cos, sin) = (cos.into_parts().0, sin.into_parts().0);
        let (out, lse, rotated) =
            B::packed_attention_forward(y.into_parts().0, cos.clone(), sin.clone(), heads, kv_heads, causal);
        // `lse₂` and the rotated input leave as constants: nothing differentiates through them.
        let constant = |t| <Self as AutodiffBackend>::from_inner(t);
        let (lse_out, rotated_out) = (constant(lse.clone()), constant(rotated.clone()));
        let out = match PackedAttentionBackward.prepare::<C>([node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((rotated, out.clone(), lse, cos, sin, heads, kv_heads, causal), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        (out, lse_out, rotated_out)
    }

    /// The inner backend's backward, as a constant (no second-order gradients).
    fn packed_attention_backward(
        rotated: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        heads: usize,
        kv_heads: usize,
        causal: bool,
    ) -> FloatTensor<Self> {
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        let dy = B::packed_attention_backward(
            inner(rotated),
            inner(out),
            inner(lse),
            inner(grad),
            inner(cos),
            inner(sin),
            heads,
            kv_heads,
            causal,
        );
        <Self as AutodiffBackend>::from_inner(dy)
    }
}

/// Causal (or full) attention of the packed product of the q, k and v projections, its q and k
/// heads rotated for positions `0..s` by the tables (RoPE, the halves of each head), through
/// [`PackedAttentionOps`]: differentiable in `y`, the tables constants. `heads` must be a
/// multiple of `kv_heads`.
///
/// # Shapes
/// `[b, s, (h + 2g)·d]`, `[≥ s, d/2]` × 2 → `[b, s, h·d]`
pub fn packed_attention(
    y: Tensor<3>,
    cos: Tensor<2>,
    sin: Tensor<2>,
    heads: usize,
    kv_heads: usize,
    causal: bool,
) -> Tensor<3> {
    let (out, _, _) = <burn::backend::Dispatch as PackedAttentionOps>::packed_attention_forward(
        y.into_dispatch(),
        cos.into_dispatch(),
        sin.into_dispatch(),
        heads,
        kv_heads,
        causal,
    );
    Tensor::from_dispatch(out)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Tensor, Tolerance};

    use super::reference::{repeat_heads, scale, split};

    /// On the CPU the op is RoPE, the kv heads repeated and attention, each from its own tensor
    /// ops, on slices of the packed input, differentiated by autodiff: the same output and the
    /// same gradient of the packed input, with grouped-query attention (6 heads on 2 kv heads)
    /// and without.
    #[test]
    fn matches_the_composed_ops_with_gradients() {
        for (heads, kv_heads) in [(6, 2), (3, 3)] {
            let device = Device::flex().autodiff();
            let (b, s, d) = (2, 5, 8);
            let n = heads + 2 * kv_heads;
            let y = Tensor::<3>::random([b, s, n * d], Distribution::Normal(0.0, 1.0), &device).require_grad();
            let angles = Tensor::<2>::random([7, d / 2], Distribution::Uniform(0.0, 6.0), &device);
            let (cos, sin) = (angles.clone().cos(), angles.sin());
            let ours = super::packed_attention(y.clone(), cos.clone(), sin.clone(), heads, kv_heads, true);
            let (q, k, v) = split(y.clone(), heads, kv_heads);
            let rope = |x| crate::rope::rope(x, cos.clone(), sin.clone());
            let repeat = heads / kv_heads;
            let (out, _) = crate::attention::reference::forward(
                rope(q),
                repeat_heads(rope(k), repeat),
                repeat_heads(v, repeat),
                true,
                scale(d),
            );
            let theirs = out.swap_dims(1, 2).reshape([b, s, heads * d]);
            // The same f32 arithmetic, the backward written out instead of chained: a few ulps.
            let tolerance = Tolerance::absolute(1e-5);
            ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
            let weights = Tensor::<3>::random([b, s, heads * d], Distribution::Normal(0.0, 1.0), &device);
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
}
