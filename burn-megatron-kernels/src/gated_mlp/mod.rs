//! A SwiGLU MLP's three products, `(silu(x · w_gate) ∘ (x · w_up)) · w_down`, as a backend
//! extension, [`GatedOps`]. On CUDA with bf16 operands:
//! - forward, one wgmma GEMM computes both the gate's and the up projection's products and the
//!   SwiGLU in its epilogue ([`crate::cuda::wgmma::gated_gemm`]), then the down projection, which
//!   [`gated_mlp_onto`] adds onto the residual stream in its own ([`crate::cuda::wgmma::gemm_onto`]);
//! - backward, the down projection's data gradient runs with the SwiGLU's backward in its
//!   epilogue ([`crate::cuda::wgmma::gated_dgrad`]), so the SwiGLU's output gradient is never
//!   written.
//!
//! Elsewhere, and for what those kernels do not take, the products ([`GemmOps`]) and the
//! SwiGLU ([`SwigluOps`]) apart.
//!
//! Under autodiff (`nodes`) the gate's and up projection's results are the outputs of the
//! product nodes the ops apart would make, and the down projection's output that of a node
//! with three parents (both and the down weight) whose backward is [`GatedOps::gated_down_backward`]
//! and the down weight's gradient. [`swiglu_down`] is that last node alone, for a SwiGLU whose
//! inputs are at hand (selective recomputation's MLP).
//!
//! Legend: `m` rows (tokens), `k` input features, `n` hidden features, `o` output features.

use burn::backend::tensor::FloatTensor;
use burn::tensor::Tensor;

use crate::gemm::Gemm;
use crate::rms_norm::link::NormLink;

#[cfg(feature = "cuda")]
mod kernel;
mod nodes;
pub mod reference;

extension! {
    /// The backend extension behind [`gated_mlp`].
    pub trait GatedOps, cuda: kernel;

    /// `(silu(g) ∘ u, g, u)` for `g = x_gate · w_gate` and `u = x_up · w_up` with `kind`:
    /// `x_gate` and `x_up` hold the same values (one input read by two products, perhaps
    /// tracked apart).
    ///
    /// # Shapes
    /// `[m, k]` × 2, `[k, n]` × 2 → `[m, n]` × 3
    fn gated_projection(
        x_gate: FloatTensor<Self>,
        x_up: FloatTensor<Self>,
        w_gate: FloatTensor<Self>,
        w_up: FloatTensor<Self>,
        kind: Gemm,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        reference::apart::<Self>(x_gate, x_up, w_gate, w_up, kind)
    }

    /// `(silu(x_gate · w_gate) ∘ (x_up · w_up)) · w_down` with `kind`.
    ///
    /// # Shapes
    /// `[m, k]` × 2, `[k, n]` × 2, `[n, o]` → `[m, o]`
    fn gated_mlp(
        x_gate: FloatTensor<Self>,
        x_up: FloatTensor<Self>,
        w_gate: FloatTensor<Self>,
        w_up: FloatTensor<Self>,
        w_down: FloatTensor<Self>,
        kind: Gemm,
    ) -> FloatTensor<Self> {
        let (hidden, ..) = reference::apart::<Self>(x_gate, x_up, w_gate, w_up, kind);
        reference::down::<Self>(hidden, w_down, kind, None)
    }

    /// `stream + `[`gated_mlp`](Self::gated_mlp)`(..)`, the down projection added onto the
    /// residual stream in its kernel where it can, `stream`'s gradient handed to `link`'s norm
    /// ([`GemmOps::gemm_onto`]; `stream` keeps the norm's input's shape).
    ///
    /// # Shapes
    /// `[.., o]`, `[m, k]` × 2, `[k, n]` × 2, `[n, o]` → `[.., o]`
    fn gated_mlp_onto(
        stream: FloatTensor<Self>,
        x_gate: FloatTensor<Self>,
        x_up: FloatTensor<Self>,
        w_gate: FloatTensor<Self>,
        w_up: FloatTensor<Self>,
        w_down: FloatTensor<Self>,
        kind: Gemm,
        link: NormLink,
    ) -> FloatTensor<Self> {
        let (hidden, ..) = reference::apart::<Self>(x_gate, x_up, w_gate, w_up, kind);
        reference::down::<Self>(hidden, w_down, kind, Some((stream, link)))
    }

    /// `(silu(gate) ∘ up) · w_down` with `kind`: the down projection of a SwiGLU whose inputs
    /// are at hand (selective recomputation's MLP, `gated_mlp`'s where its products are not
    /// alike).
    ///
    /// # Shapes
    /// `[m, n]` × 2, `[n, o]` → `[m, o]`
    fn swiglu_down(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        w_down: FloatTensor<Self>,
        kind: Gemm,
    ) -> FloatTensor<Self> {
        reference::swiglu_then_down::<Self>(gate, up, w_down, kind)
    }

    /// The gradients of `gate` and `up` through `(silu(gate) ∘ up) · w_down`, given its output's
    /// gradient `grad`, with `kind`.
    ///
    /// # Shapes
    /// `[m, o]`, `[n, o]`, `[m, n]` × 2 → `[m, n]` × 2
    fn gated_down_backward(
        grad: FloatTensor<Self>,
        w_down: FloatTensor<Self>,
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        kind: Gemm,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::down_backward_apart::<Self>(grad, w_down, gate, up, kind)
    }
}

/// `(silu(x_gate · w_gate) ∘ (x_up · w_up)) · w_down` over the last dim, through [`GatedOps`],
/// differentiable; `x_gate` and `x_up` hold the same values (one input's two readers: a linked
/// norm's [`crate::rms_norm::link::fan_out`]). `kind` is a bf16 product's (the quantized recipes
/// multiply apart, [`crate::gemm::linear`]).
///
/// # Shapes
/// `[.., k]` × 2, `[k, n]` × 2, `[n, o]` → `[.., o]`
pub fn gated_mlp<const D: usize>(
    x_gate: Tensor<D>,
    x_up: Tensor<D>,
    w_gate: Tensor<2>,
    w_up: Tensor<2>,
    w_down: Tensor<2>,
    kind: Gemm,
) -> Tensor<D> {
    mlp_onto(None, x_gate, x_up, [w_gate, w_up, w_down], kind)
}

/// `stream + gated_mlp(..)`: [`gated_mlp`] added onto the residual stream in the down
/// projection's kernel where it can ([`GemmOps::gemm_onto`]), `stream`'s gradient handed to
/// `link`'s norm as [`crate::rms_norm::link::residual_add`] hands it.
///
/// # Shapes
/// `[.., o]`, `[.., k]` × 2, `[k, n]` × 2, `[n, o]` → `[.., o]`
pub fn gated_mlp_onto<const D: usize>(
    stream: Tensor<D>,
    link: &NormLink,
    x_gate: Tensor<D>,
    x_up: Tensor<D>,
    [w_gate, w_up, w_down]: [Tensor<2>; 3],
    kind: Gemm,
) -> Tensor<D> {
    mlp_onto(Some((stream, link)), x_gate, x_up, [w_gate, w_up, w_down], kind)
}

fn mlp_onto<const D: usize>(
    onto: Option<(Tensor<D>, &NormLink)>,
    x_gate: Tensor<D>,
    x_up: Tensor<D>,
    [w_gate, w_up, w_down]: [Tensor<2>; 3],
    kind: Gemm,
) -> Tensor<D> {
    let mut dims = x_gate.dims();
    let k = dims[D - 1];
    let rows = dims[..D - 1].iter().product();
    let o = w_down.dims()[1];
    let flat = |x: Tensor<D>| x.reshape([rows, k]).into_dispatch();
    let (x_gate, x_up, w_gate, w_up, w_down) = (
        flat(x_gate),
        flat(x_up),
        w_gate.into_dispatch(),
        w_up.into_dispatch(),
        w_down.into_dispatch(),
    );
    type Ops = burn::backend::Dispatch;
    match onto {
        Some((stream, link)) => Tensor::from_dispatch(<Ops as GatedOps>::gated_mlp_onto(
            stream.into_dispatch(),
            x_gate,
            x_up,
            w_gate,
            w_up,
            w_down,
            kind,
            link.clone(),
        )),
        None => {
            dims[D - 1] = o;
            Tensor::<2>::from_dispatch(<Ops as GatedOps>::gated_mlp(x_gate, x_up, w_gate, w_up, w_down, kind))
                .reshape(dims)
        }
    }
}

/// `(silu(gate) ∘ up) · w_down` over the last dim, through [`GatedOps`], differentiable: on
/// CUDA with bf16 products the down projection's data gradient runs the SwiGLU's backward in its
/// epilogue ([`crate::cuda::wgmma::gated_dgrad`]).
///
/// # Shapes
/// `[.., n]` × 2, `[n, o]` → `[.., o]`
pub fn swiglu_down<const D: usize>(gate: Tensor<D>, up: Tensor<D>, w_down: Tensor<2>, kind: Gemm) -> Tensor<D> {
    let mut dims = gate.dims();
    let n = dims[D - 1];
    let rows = dims[..D - 1].iter().product();
    let o = w_down.dims()[1];
    let flat = |x: Tensor<D>| x.reshape([rows, n]).into_dispatch();
    let out = <burn::backend::Dispatch as GatedOps>::swiglu_down(flat(gate), flat(up), w_down.into_dispatch(), kind);
    dims[D - 1] = o;
    Tensor::<2>::from_dispatch(out).reshape(dims)
}

#[cfg(test)]
mod tests {
    use burn::tensor::activation::silu;
    use burn::tensor::{Device, Distribution, Tensor, Tolerance};

    use crate::gemm::Gemm;

    /// On the CPU: `(silu(x·w1) ∘ (x·w3)) · w2` in Burn's ops differentiated by autodiff gives the
    /// same output and the same gradients of the input (both readers' summed) and the three
    /// weights.
    #[test]
    fn matches_burn_with_gradients() {
        let device = Device::flex().autodiff();
        let leaf = |dims: [usize; 2]| Tensor::<2>::random(dims, Distribution::Normal(0.0, 1.0), &device).require_grad();
        let x = Tensor::<3>::random([2, 5, 6], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let (w1, w3, w2) = (leaf([6, 7]), leaf([6, 7]), leaf([7, 4]));
        let ours = super::gated_mlp(x.clone(), x.clone(), w1.clone(), w3.clone(), w2.clone(), Gemm::Wgmma);
        let hidden = silu(x.clone().matmul(w1.clone().unsqueeze())) * x.clone().matmul(w3.clone().unsqueeze());
        let theirs = hidden.matmul(w2.clone().unsqueeze());
        // The same f32 products and SwiGLU, summed in another order perhaps: a few ulps of
        // values of order 10.
        let tolerance = Tolerance::absolute(1e-4);
        ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
        let weights = Tensor::<3>::random([2, 5, 4], Distribution::Normal(0.0, 1.0), &device);
        let (g1, g2) = (
            (ours * weights.clone()).sum().backward(),
            (theirs * weights).sum().backward(),
        );
        let same = |a: Tensor<3>, b: Tensor<3>| a.to_data().assert_approx_eq::<f32>(&b.to_data(), tolerance);
        same(x.grad(&g1).unwrap(), x.grad(&g2).unwrap());
        for w in [&w1, &w3, &w2] {
            let (a, b) = (w.grad(&g1).unwrap(), w.grad(&g2).unwrap());
            a.to_data().assert_approx_eq::<f32>(&b.to_data(), tolerance);
        }
    }

    /// On the CPU: `(silu(g) ∘ u) · w2` in Burn's ops differentiated by autodiff gives the same
    /// output and the same gradients of g, u and w2.
    #[test]
    fn swiglu_down_matches_burn_with_gradients() {
        let device = Device::flex().autodiff();
        let leaf = |dims: [usize; 3]| Tensor::<3>::random(dims, Distribution::Normal(0.0, 2.0), &device).require_grad();
        let (g, u) = (leaf([2, 5, 7]), leaf([2, 5, 7]));
        let w2 = Tensor::<2>::random([7, 4], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let ours = super::swiglu_down(g.clone(), u.clone(), w2.clone(), Gemm::Wgmma);
        let theirs = (silu(g.clone()) * u.clone()).matmul(w2.clone().unsqueeze());
        // f32 both ways, the derivative written out instead of chained: a few ulps of values of
        // order 10.
        let tolerance = Tolerance::absolute(1e-4);
        ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
        let weights = Tensor::<3>::random([2, 5, 4], Distribution::Normal(0.0, 1.0), &device);
        let (g1, g2) = (
            (ours * weights.clone()).sum().backward(),
            (theirs * weights).sum().backward(),
        );
        for t in [&g, &u] {
            let (a, b) = (t.grad(&g1).unwrap(), t.grad(&g2).unwrap());
            a.to_data().assert_approx_eq::<f32>(&b.to_data(), tolerance);
        }
        let (a, b) = (w2.grad(&g1).unwrap(), w2.grad(&g2).unwrap());
        a.to_data().assert_approx_eq::<f32>(&b.to_data(), tolerance);
    }

    /// Only the tracked parents get gradients: with the up and down weights frozen the gate's
    /// is what it is with all three trained, and the frozen ones have none.
    #[test]
    fn frozen_weights_get_none() {
        let device = Device::flex().autodiff();
        let normal = Distribution::Normal(0.0, 1.0);
        let x = Tensor::<2>::random([3, 6], normal, &device);
        let w1 = Tensor::<2>::random([6, 5], normal, &device).require_grad();
        let (w3, w2) = (
            Tensor::<2>::random([6, 5], normal, &device),
            Tensor::<2>::random([5, 4], normal, &device),
        );
        let mlp = |w3: &Tensor<2>, w2: &Tensor<2>| {
            super::gated_mlp(x.clone(), x.clone(), w1.clone(), w3.clone(), w2.clone(), Gemm::Burn)
                .sum()
                .backward()
        };
        let frozen = mlp(&w3, &w2);
        let (w3_t, w2_t) = (w3.clone().require_grad(), w2.clone().require_grad());
        let trained = mlp(&w3_t, &w2_t);
        assert!(w3.grad(&frozen).is_none() && w2.grad(&frozen).is_none());
        assert!(w3_t.grad(&trained).is_some() && w2_t.grad(&trained).is_some());
        // The same ops on the same values: equal.
        let tolerance = Tolerance::absolute(1e-6);
        w1.grad(&frozen)
            .unwrap()
            .to_data()
            .assert_approx_eq::<f32>(&w1.grad(&trained).unwrap().to_data(), tolerance);
    }
}
