//! The matrix product of the linear layers as a backend extension, [`GemmOps`]. Which product
//! runs is part of each layer's configuration, a [`Gemm`], passed with every call (forward and
//! both backward products): on CUDA, our Hopper GEMM ([`crate::cuda::wgmma`]) for bf16 operands
//! (products of at most 32 rows, a decoding step's, by `crate::gemm::skinny`),
//! f32 operands in f32 ([`crate::gemm::f32_matmul`], never TF32); Burn's own matmul for everything
//! else.
//!
//! Legend: `m` rows (tokens), `k` input features, `n` output features.

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, binary};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, TensorMetadata};
use burn::config::Config;
use burn::tensor::Tensor;

use crate::quant::product::Amax;
use crate::quant::recipe::Recipe;
use crate::rms_norm::link::{NormLink, residual_node};
use crate::rope::RotatedHeads;

pub mod f32_matmul;
#[cfg(feature = "cuda")]
mod kernel;
pub mod reference;
#[cfg(feature = "cuda")]
mod skinny;

/// The matrix product a linear layer runs. It lives in the layer's configuration (a precision
/// policy sets it before `init`), never in process state, so two layers of one model may run
/// different products.
#[derive(Config, Debug, Copy, PartialEq, Eq, Hash)]
pub enum Gemm {
    /// Burn's matmul, on every backend and dtype (f32 operands on CUDA in f32, not TF32).
    Burn,
    /// Our Hopper GEMM (`wgmma` through inline PTX, one persistent block an SM) for bf16
    /// operands on CUDA; Burn's matmul for other dtypes, for shapes it refuses (an inner size
    /// that is no multiple of 8) and on other devices.
    Wgmma,
    /// A low-precision recipe ([`crate::quant::recipe`]): FP8 or FP4 operands with their block
    /// scales, each product (forward, dgrad, wgrad) quantized as the recipe says
    /// ([`crate::quant::product`]). [`gemm`] and [`linear`] route it there before the
    /// [`GemmOps`] extension, which never sees it.
    Quantized(Recipe),
}

impl Gemm {
    /// Whether `pass`'s product scales its `a` operand (the forward's input, the gradients'
    /// output gradient) by that tensor's amax: the FP8 tensorwise and delayed recipes, whose
    /// casts can take the amax noted by the kernel that wrote the tensor
    /// ([`crate::quant::notes::NoteAmaxes`]).
    pub fn scales_by_tensor_amax(self, pass: crate::quant::recipe::Pass) -> bool {
        use crate::quant::recipe::Blocks;
        matches!(self, Gemm::Quantized(recipe) if recipe.operands(pass).0.blocks == Blocks::Tensor)
    }
}

extension! {
    /// The backend extension behind [`gemm`] and [`linear`].
    pub trait GemmOps, cuda: kernel;

    /// `[m, k] · [k, n] → [m, n]` with `kind`; operands may be transposed views.
    fn gemm(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>, kind: Gemm) -> FloatTensor<Self> {
        Self::float_matmul(lhs, rhs)
    }

    /// `x + lhs · rhs` with `kind`: a residual stream plus a branch's last product, `x` added in
    /// the product's epilogue where `kind`'s kernel can ([`crate::cuda::wgmma::gemm_onto`]), and `x`'s
    /// gradient handed to `link`'s norm as [`crate::rms_norm::link::residual_add`] hands it (so `x`
    /// keeps the norm's input's shape: `m` is the product of its leading dims).
    ///
    /// # Shapes
    /// `[.., n]`, `[m, k]`, `[k, n]` → `[.., n]`
    fn gemm_onto(
        x: FloatTensor<Self>,
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        kind: Gemm,
        link: NormLink,
    ) -> FloatTensor<Self> {
        let shape = x.shape();
        Self::float_add(x, Self::float_reshape(Self::float_matmul(lhs, rhs), shape))
    }

    /// `lhs · rhs` with `kind`, each `d = 2 · cos.dims[1]` columns a head rotated by RoPE for
    /// position `row % seq` ([`crate::rope::RopeOps::rope`] on the `[m/seq, n/d, seq, d]`
    /// heads): in the product's epilogue where `kind`'s kernel can
    /// ([`crate::cuda::wgmma::gemm_rotated`]). Differentiable as the product before the rotation: its
    /// gradient is the unrotated heads' ([`crate::rope::RotatedHeads`]).
    ///
    /// # Shapes
    /// `[m, k]`, `[k, n]`, `[≥ seq, d/2]` × 2 → `[m, n]`
    fn gemm_rotated(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        seq: usize,
        kind: Gemm,
    ) -> FloatTensor<Self> {
        reference::rotate_heads::<Self>(Self::float_matmul(lhs, rhs), cos, sin, seq)
    }
}

#[derive(Debug)]
struct GemmBackward;

impl<B: Backend + GemmOps> Backward<B, 2> for GemmBackward {
    type State = (Option<NodeId>, Option<NodeId>, Gemm);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let (lhs, rhs, kind) = ops.state;
        let lhs: Option<FloatTensor<B>> = lhs.map(|id| checkpointer.retrieve_node_output(id));
        let rhs: Option<FloatTensor<B>> = rhs.map(|id| checkpointer.retrieve_node_output(id));
        binary::<B, _, _>(
            ops.parents,
            ops.node,
            grads,
            // d lhs = d out · rhsᵀ: [m, n] · [n, k]
            |grad| {
                B::gemm(
                    grad,
                    B::float_transpose(rhs.expect("rhs saved for the lhs gradient")),
                    kind,
                )
            },
            // d rhs = lhsᵀ · d out: [k, m] · [m, n]
            |grad| {
                B::gemm(
                    B::float_transpose(lhs.expect("lhs saved for the rhs gradient")),
                    grad,
                    kind,
                )
            },
        );
    }
}

impl<B: Backend + GemmOps, C: CheckpointStrategy> GemmOps for Autodiff<B, C> {
    fn gemm(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>, kind: Gemm) -> FloatTensor<Self> {
        let out = B::gemm(lhs.clone().into_parts().0, rhs.clone().into_parts().0, kind);
        gemm_node::<B, C>(lhs, rhs, kind, out)
    }

    /// The product's node and the residual add's ([`crate::rms_norm::link`]) over the one sum the
    /// inner backend computes: the product's output is the sum (as `[m, n]`), which only the
    /// add's node reads, through a reshape (no backward here reads its output).
    fn gemm_onto(
        x: FloatTensor<Self>,
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        kind: Gemm,
        link: NormLink,
    ) -> FloatTensor<Self> {
        let inner = |t: &FloatTensor<Self>| t.clone().into_parts().0;
        let sum = B::gemm_onto(inner(&x), inner(&lhs), inner(&rhs), kind, link.clone());
        let flat = B::float_reshape(sum.clone(), [lhs.shape()[0], rhs.shape()[1]].into());
        let branch = Self::float_reshape(gemm_node::<B, C>(lhs, rhs, kind, flat), x.shape());
        residual_node::<B, C>(x, branch, link, sum)
    }

    /// The product's node over the rotated result: its gradient is taken as the unrotated
    /// product's ([`crate::rope::RotatedHeads`]'s contract), which its backward reads (no
    /// backward here reads its output).
    fn gemm_rotated(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        seq: usize,
        kind: Gemm,
    ) -> FloatTensor<Self> {
        let inner = |t: &FloatTensor<Self>| t.clone().into_parts().0;
        let out = B::gemm_rotated(inner(&lhs), inner(&rhs), inner(&cos), inner(&sin), seq, kind);
        gemm_node::<B, C>(lhs, rhs, kind, out)
    }
}

/// `out`, the inner backend's `lhs · rhs` with `kind` (computed by the caller, perhaps in one
/// kernel with other results: [`crate::gated_mlp`]), as the output of a product node whose
/// gradients are [`GemmOps::gemm`]'s.
pub(crate) fn gemm_node<B: Backend + GemmOps, C: CheckpointStrategy>(
    lhs: FloatTensor<Autodiff<B, C>>,
    rhs: FloatTensor<Autodiff<B, C>>,
    kind: Gemm,
    out: FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    let (lhs_tracked, rhs_tracked) = (lhs.is_tracked(), rhs.is_tracked());
    match GemmBackward
        .prepare::<C>([lhs.node(), rhs.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            // Each operand is kept for the other's gradient.
            let lhs_state = rhs_tracked.then(|| prep.checkpoint(&lhs));
            let rhs_state = lhs_tracked.then(|| prep.checkpoint(&rhs));
            prep.finish((lhs_state, rhs_state, kind), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

/// `lhs · rhs` with `kind`, through [`GemmOps`].
///
/// # Shapes
/// `[m, k]`, `[k, n]` → `[m, n]`
pub fn gemm(lhs: Tensor<2>, rhs: Tensor<2>, kind: Gemm) -> Tensor<2> {
    gemm_over(lhs, rhs, kind, None)
}

/// [`gemm`], a quantized product's tensor-level amaxes reduced over `amax`.
fn gemm_over(lhs: Tensor<2>, rhs: Tensor<2>, kind: Gemm, amax: Amax) -> Tensor<2> {
    if let Gemm::Quantized(recipe) = kind {
        return crate::quant::product::product(lhs, rhs.transpose(), recipe, amax);
    }
    Tensor::from_dispatch(<burn::backend::Dispatch as GemmOps>::gemm(
        lhs.into_dispatch(),
        rhs.into_dispatch(),
        kind,
    ))
}

/// `x · weight + bias` over the last dim of `x`, Burn's `linear` with [`gemm`] inside.
///
/// # Shapes
/// `[.., k]`, `[k, n]`, `[n]` → `[.., n]`
pub fn linear<const D: usize>(x: Tensor<D>, weight: Tensor<2>, bias: Option<Tensor<1>>, kind: Gemm) -> Tensor<D> {
    linear_over(x, weight, bias, kind, None)
}

/// [`linear`] whose quantized operands scale by tensor-level amaxes reduced over `amax` (the
/// tensor-parallel ranks holding pieces of the same tensors); other products ignore it.
///
/// # Shapes
/// `[.., k]`, `[k, n]`, `[n]` → `[.., n]`
pub fn linear_over<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    kind: Gemm,
    amax: Amax,
) -> Tensor<D> {
    let mut dims = x.dims();
    let k = dims[D - 1];
    let rows = dims[..D - 1].iter().product();
    let [_, n] = weight.dims();
    let y = gemm_over(x.reshape([rows, k]), weight, kind, amax);
    let y = match bias {
        Some(b) => y + b.unsqueeze::<2>(),
        None => y,
    };
    dims[D - 1] = n;
    y.reshape(dims)
}

/// `stream + x · weight` over the last dim of `x`: a residual stream plus a branch's last
/// product ([`GemmOps::gemm_onto`]), `stream`'s gradient handed to `link`'s norm as
/// [`residual_add`](crate::rms_norm::link::residual_add) hands it. A quantized product runs apart,
/// then the add.
///
/// # Shapes
/// `[.., n]`, `[.., k]`, `[k, n]` → `[.., n]`
pub fn linear_onto<const D: usize>(
    stream: Tensor<D>,
    x: Tensor<D>,
    weight: Tensor<2>,
    kind: Gemm,
    link: &NormLink,
) -> Tensor<D> {
    if let Gemm::Quantized(_) = kind {
        return crate::rms_norm::residual_add(stream, linear(x, weight, None, kind), link);
    }
    let k = x.dims()[D - 1];
    let rows = x.dims()[..D - 1].iter().product();
    Tensor::from_dispatch(<burn::backend::Dispatch as GemmOps>::gemm_onto(
        stream.into_dispatch(),
        x.reshape([rows, k]).into_dispatch(),
        weight.into_dispatch(),
        kind,
        link.clone(),
    ))
}

/// `x · weight` with each head of `d = 2 · cos.dims[1]` output features rotated by RoPE for its
/// position in `x`'s sequence ([`GemmOps::gemm_rotated`]): q's or k's projection and their
/// rotation in one, in the product's epilogue where `kind`'s kernel can. The heads are
/// differentiable as the product before the rotation ([`RotatedHeads`]). `None` for a
/// quantized product, which quantizes its operands through nodes of its own: the caller runs it
/// and RoPE apart.
///
/// # Panics
/// Where `weight`'s outputs are no whole number of heads, or the tables are not two of
/// `[≥ s, d/2]`.
///
/// # Shapes
/// `[b, s, k]`, `[k, h·d]`, `[≥ s, d/2]` × 2 → `[b, h, s, d]`
pub fn linear_rotated(
    x: Tensor<3>,
    weight: Tensor<2>,
    cos: Tensor<2>,
    sin: Tensor<2>,
    kind: Gemm,
) -> Option<RotatedHeads> {
    if let Gemm::Quantized(_) = kind {
        return None;
    }
    let [b, s, k] = x.dims();
    let [_, n] = weight.dims();
    let [rows, half] = cos.dims();
    let d = 2 * half;
    assert!(
        d > 0 && n % d == 0 && rows >= s && sin.dims() == cos.dims(),
        "RoPE's heads of {d} features over {n} outputs need tables [≥ {s}, {half}] × 2, not {:?} and {:?}",
        cos.dims(),
        sin.dims()
    );
    let y = Tensor::<2>::from_dispatch(<burn::backend::Dispatch as GemmOps>::gemm_rotated(
        x.reshape([b * s, k]).into_dispatch(),
        weight.into_dispatch(),
        cos.into_dispatch(),
        sin.into_dispatch(),
        s,
        kind,
    ));
    Some(RotatedHeads::new(y.reshape([b, s, n / d, d]).swap_dims(1, 2)))
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Tensor, module};

    /// On the CPU, `linear` is Burn's `linear` whatever its GEMM: the same values and the same
    /// gradients.
    #[test]
    fn linear_matches_burns_with_gradients() {
        for kind in [super::Gemm::Burn, super::Gemm::Wgmma] {
            check(kind);
        }
    }

    /// The products whose casts may take a noted amax: every operand `a` of the tensorwise and
    /// delayed recipes, none of the block recipes' (their scales come from blocks) nor bf16's.
    #[test]
    fn tensor_amax_scaled_products() {
        use crate::quant::recipe::{Pass, Recipe};
        for recipe in Recipe::ALL {
            let tensorwise = matches!(
                recipe,
                Recipe::Fp8Tensorwise
                    | Recipe::Fp8TensorwisePromoted
                    | Recipe::Fp8TensorwiseE4m3
                    | Recipe::Fp8TensorwiseE4m3Promoted
                    | Recipe::Fp8Delayed { .. }
            );
            for pass in [Pass::Forward, Pass::Dgrad, Pass::Wgrad] {
                let gemm = super::Gemm::Quantized(recipe);
                assert_eq!(gemm.scales_by_tensor_amax(pass), tensorwise, "{recipe:?} {pass:?}");
            }
        }
        for gemm in [super::Gemm::Burn, super::Gemm::Wgmma] {
            assert!(!gemm.scales_by_tensor_amax(Pass::Forward));
        }
    }

    fn check(kind: super::Gemm) {
        let device = Device::flex().autodiff();
        let x = Tensor::<3>::random([2, 5, 7], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let w = Tensor::<2>::random([7, 3], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let b = Tensor::<1>::random([3], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let ours = super::linear(x.clone(), w.clone(), Some(b.clone()), kind);
        let theirs = module::linear(x.clone(), w.clone(), Some(b.clone()));
        // The same f32 products, perhaps summed in another order: a few ulps.
        let tolerance = burn::tensor::Tolerance::absolute(1e-5);
        ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
        let (g1, g2) = (ours.sum().backward(), theirs.sum().backward());
        let same = |a: Option<Tensor<3>>, b: Option<Tensor<3>>| {
            a.unwrap()
                .to_data()
                .assert_approx_eq::<f32>(&b.unwrap().to_data(), tolerance)
        };
        same(x.grad(&g1), x.grad(&g2));
        w.grad(&g1)
            .unwrap()
            .to_data()
            .assert_approx_eq::<f32>(&w.grad(&g2).unwrap().to_data(), tolerance);
        b.grad(&g1)
            .unwrap()
            .to_data()
            .assert_approx_eq::<f32>(&b.grad(&g2).unwrap().to_data(), tolerance);
    }
}
