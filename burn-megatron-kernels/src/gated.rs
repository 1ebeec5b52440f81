//! A SwiGLU MLP's gated projection, `silu(x · w_gate) ∘ (x · w_up)`, as a backend extension,
//! [`GatedOps`]: on CUDA with bf16 operands one wgmma GEMM computes both products and the
//! SwiGLU in its epilogue ([`crate::wgmma::gated_gemm`]); elsewhere, and for what that kernel
//! does not take, the two products ([`GemmOps`]) and the SwiGLU ([`SwigluOps`]) apart.
//!
//! Under autodiff the one kernel's three results become the outputs of the same three nodes the
//! ops apart would make (two products, then the SwiGLU over them), so the backward is theirs:
//! the SwiGLU's kernel, then each product's two gradient GEMMs.
//!
//! Legend: `m` rows (tokens), `k` input features, `n` output features of each product.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Flex, backend_extension};
use burn::tensor::Tensor;

use crate::linear::{Gemm, GemmOps, gemm_node};
use crate::quant::notes::NoteAmaxes;
use crate::swiglu::{SwigluOps, swiglu_node};

/// The backend extension behind [`gated_projection`].
#[backend_extension(Flex, Cube: cfg(feature = "cuda"), Autodiff)]
pub trait GatedOps: Backend {
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
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// The two products and the SwiGLU, each its own op.
fn apart<B: GemmOps + SwigluOps>(
    x_gate: FloatTensor<B>,
    x_up: FloatTensor<B>,
    w_gate: FloatTensor<B>,
    w_up: FloatTensor<B>,
    kind: Gemm,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let (gate, up) = (B::gemm(x_gate, w_gate, kind), B::gemm(x_up, w_up, kind));
    (B::swiglu(gate.clone(), up.clone(), NoteAmaxes::default()), gate, up)
}

impl GatedOps for Flex {
    fn gated_projection(
        x_gate: FloatTensor<Self>,
        x_up: FloatTensor<Self>,
        w_gate: FloatTensor<Self>,
        w_up: FloatTensor<Self>,
        kind: Gemm,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        apart::<Self>(x_gate, x_up, w_gate, w_up, kind)
    }
}

#[cfg(feature = "cuda")]
impl GatedOps for burn::backend::Cube {
    fn gated_projection(
        x_gate: FloatTensor<Self>,
        x_up: FloatTensor<Self>,
        w_gate: FloatTensor<Self>,
        w_up: FloatTensor<Self>,
        kind: Gemm,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let fused = match kind {
            Gemm::Wgmma => crate::wgmma::gated_gemm(x_gate.clone(), w_gate.clone(), w_up.clone()),
            Gemm::Burn | Gemm::Quantized(_) => None,
        };
        fused.unwrap_or_else(|| apart::<Self>(x_gate, x_up, w_gate, w_up, kind))
    }
}

impl<B: Backend + GatedOps + GemmOps + SwigluOps, C: CheckpointStrategy> GatedOps for Autodiff<B, C> {
    fn gated_projection(
        x_gate: FloatTensor<Self>,
        x_up: FloatTensor<Self>,
        w_gate: FloatTensor<Self>,
        w_up: FloatTensor<Self>,
        kind: Gemm,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let inner = |t: &FloatTensor<Self>| t.clone().into_parts().0;
        let (out, gate, up) = B::gated_projection(inner(&x_gate), inner(&x_up), inner(&w_gate), inner(&w_up), kind);
        let gate = gemm_node::<B, C>(x_gate, w_gate, kind, gate);
        let up = gemm_node::<B, C>(x_up, w_up, kind, up);
        let out = swiglu_node::<B, C>(gate.clone(), up.clone(), false, out);
        (out, gate, up)
    }
}

/// `silu(x_gate · w_gate) ∘ (x_up · w_up)` over the last dim, through [`GatedOps`],
/// differentiable; `x_gate` and `x_up` hold the same values (one input's two readers: a linked
/// norm's [`crate::norm_link::fan_out`]). `kind` is a bf16 product's (the quantized recipes
/// multiply apart, [`crate::linear::linear`]).
///
/// # Shapes
/// `[.., k]` × 2, `[k, n]` × 2 → `[.., n]`
pub fn gated_projection<const D: usize>(
    x_gate: Tensor<D>,
    x_up: Tensor<D>,
    w_gate: Tensor<2>,
    w_up: Tensor<2>,
    kind: Gemm,
) -> Tensor<D> {
    let mut dims = x_gate.dims();
    let k = dims[D - 1];
    let rows = dims[..D - 1].iter().product();
    let n = w_up.dims()[1];
    let flat = |x: Tensor<D>| x.reshape([rows, k]).into_dispatch();
    let (out, ..) = <burn::backend::Dispatch as GatedOps>::gated_projection(
        flat(x_gate),
        flat(x_up),
        w_gate.into_dispatch(),
        w_up.into_dispatch(),
        kind,
    );
    dims[D - 1] = n;
    Tensor::<2>::from_dispatch(out).reshape(dims)
}

#[cfg(test)]
mod tests {
    use burn::tensor::activation::silu;
    use burn::tensor::{Device, Distribution, Tensor, Tolerance};

    use crate::linear::Gemm;

    /// On the CPU: `silu(x·w1) ∘ (x·w3)` in Burn's ops differentiated by autodiff gives the same
    /// output and the same gradients of the input (both readers' summed) and both weights.
    #[test]
    fn matches_burn_with_gradients() {
        let device = Device::flex().autodiff();
        let leaf = |dims: [usize; 2]| Tensor::<2>::random(dims, Distribution::Normal(0.0, 1.0), &device).require_grad();
        let x = Tensor::<3>::random([2, 5, 6], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let (w1, w3) = (leaf([6, 7]), leaf([6, 7]));
        let ours = super::gated_projection(x.clone(), x.clone(), w1.clone(), w3.clone(), Gemm::Wgmma);
        let theirs = silu(x.clone().matmul(w1.clone().unsqueeze())) * x.clone().matmul(w3.clone().unsqueeze());
        // The same f32 products and SwiGLU, summed in another order perhaps: a few ulps.
        let tolerance = Tolerance::absolute(1e-5);
        ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
        let weights = Tensor::<3>::random([2, 5, 7], Distribution::Normal(0.0, 1.0), &device);
        let (g1, g2) = (
            (ours * weights.clone()).sum().backward(),
            (theirs * weights).sum().backward(),
        );
        let same = |a: Tensor<3>, b: Tensor<3>| a.to_data().assert_approx_eq::<f32>(&b.to_data(), tolerance);
        same(x.grad(&g1).unwrap(), x.grad(&g2).unwrap());
        for w in [&w1, &w3] {
            let (a, b) = (w.grad(&g1).unwrap(), w.grad(&g2).unwrap());
            a.to_data().assert_approx_eq::<f32>(&b.to_data(), tolerance);
        }
    }
}
