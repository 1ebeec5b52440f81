//! The grouped product of a mixture of experts, [`GroupedOps`]: rows in groups (one group an
//! expert, `counts[g]` consecutive rows), each group times its own weight, in one call, with
//! both backward products (dgrad: each group's rows times its weight transposed; wgrad: each
//! weight's gradient from its own rows).
//!
//! On CUDA, bf16 operands run one launch of our Hopper GEMM's grouped variant
//! (`grouped_kernel`): each group's rows padded to the 128 rows of a tile, a table telling every
//! tile its group's rows, weight and output. Elsewhere, and for shapes that kernel does not
//! take, one product a group ([`reference`]).
//!
//! Legend: `r` rows (`Σ counts`), `k` input features, `n` output features, `e` groups.

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, binary};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend, Flex, backend_extension};
use burn::tensor::Tensor;

/// The backend extension behind [`grouped_matmul`].
#[backend_extension(Flex, Cube: cfg(feature = "cuda"), Autodiff)]
pub trait GroupedOps: Backend {
    /// `y_g = x_g · w_g` for each group `g` of `counts[g]` rows.
    ///
    /// # Shapes
    /// `[r, k]`, `[e, k, n]` → `[r, n]`
    fn grouped_matmul(x: FloatTensor<Self>, w: FloatTensor<Self>, counts: Vec<usize>) -> FloatTensor<Self>;

    /// `dx_g = dy_g · w_gᵀ`.
    ///
    /// # Shapes
    /// `[r, n]`, `[e, k, n]` → `[r, k]`
    fn grouped_matmul_dgrad(dy: FloatTensor<Self>, w: FloatTensor<Self>, counts: Vec<usize>) -> FloatTensor<Self>;

    /// `dw_g = x_gᵀ · dy_g`, zero for a group without rows.
    ///
    /// # Shapes
    /// `[r, k]`, `[r, n]` → `[e, k, n]`
    fn grouped_matmul_wgrad(x: FloatTensor<Self>, dy: FloatTensor<Self>, counts: Vec<usize>) -> FloatTensor<Self>;
}

/// One product a group, in backend ops: the CPU path, the test oracle, and CUDA's path for
/// what the grouped kernel does not take. `matmul` is the 2-D product to use.
pub mod reference {
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{Backend, TensorMetadata};
    use burn::tensor::{FloatDType, Slice};

    /// Rows `start..start + n` of `x`.
    fn rows<B: Backend>(x: FloatTensor<B>, start: usize, n: usize) -> FloatTensor<B> {
        let mut slices = vec![Slice::from(start..start + n)];
        slices.extend((1..x.shape().num_dims()).map(|_| Slice::from(..)));
        B::float_slice(x, &slices)
    }

    /// Weight `g` of `w` (`[e, k, n]`), as `[k, n]`.
    fn weight<B: Backend>(w: FloatTensor<B>, g: usize) -> FloatTensor<B> {
        let [_, k, n] = w.shape().dims();
        B::float_reshape(rows::<B>(w, g, 1), [k, n].into())
    }

    /// Each group's rows times its (possibly transposed) weight, concatenated.
    fn each<B: Backend>(
        x: FloatTensor<B>,
        w: FloatTensor<B>,
        counts: &[usize],
        transposed: bool,
        matmul: impl Fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
    ) -> FloatTensor<B> {
        let mut start = 0;
        let mut parts = Vec::new();
        for (g, &n) in counts.iter().enumerate() {
            if n > 0 {
                let w_g = weight::<B>(w.clone(), g);
                let w_g = if transposed { B::float_transpose(w_g) } else { w_g };
                parts.push(matmul(rows::<B>(x.clone(), start, n), w_g));
            }
            start += n;
        }
        B::float_cat(parts, 0)
    }

    pub fn forward<B: Backend>(
        x: FloatTensor<B>,
        w: FloatTensor<B>,
        counts: &[usize],
        matmul: impl Fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
    ) -> FloatTensor<B> {
        each::<B>(x, w, counts, false, matmul)
    }

    pub fn dgrad<B: Backend>(
        dy: FloatTensor<B>,
        w: FloatTensor<B>,
        counts: &[usize],
        matmul: impl Fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
    ) -> FloatTensor<B> {
        each::<B>(dy, w, counts, true, matmul)
    }

    pub fn wgrad<B: Backend>(
        x: FloatTensor<B>,
        dy: FloatTensor<B>,
        counts: &[usize],
        matmul: impl Fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
    ) -> FloatTensor<B> {
        let ([_, k], [_, n]) = (x.shape().dims(), dy.shape().dims());
        let device = x.device();
        let dtype = FloatDType::from(x.dtype());
        let mut start = 0;
        let parts = counts
            .iter()
            .map(|&c| {
                let part = match c {
                    0 => B::float_zeros([k, n].into(), &device, dtype),
                    _ => matmul(
                        B::float_transpose(rows::<B>(x.clone(), start, c)),
                        rows::<B>(dy.clone(), start, c),
                    ),
                };
                start += c;
                B::float_reshape(part, [1, k, n].into())
            })
            .collect();
        B::float_cat(parts, 0)
    }
}

impl GroupedOps for Flex {
    fn grouped_matmul(x: FloatTensor<Self>, w: FloatTensor<Self>, counts: Vec<usize>) -> FloatTensor<Self> {
        reference::forward::<Flex>(x, w, &counts, Flex::float_matmul)
    }

    fn grouped_matmul_dgrad(dy: FloatTensor<Self>, w: FloatTensor<Self>, counts: Vec<usize>) -> FloatTensor<Self> {
        reference::dgrad::<Flex>(dy, w, &counts, Flex::float_matmul)
    }

    fn grouped_matmul_wgrad(x: FloatTensor<Self>, dy: FloatTensor<Self>, counts: Vec<usize>) -> FloatTensor<Self> {
        reference::wgrad::<Flex>(x, dy, &counts, Flex::float_matmul)
    }
}

#[cfg(feature = "cuda")]
impl GroupedOps for burn::backend::Cube {
    fn grouped_matmul(x: FloatTensor<Self>, w: FloatTensor<Self>, counts: Vec<usize>) -> FloatTensor<Self> {
        crate::grouped_kernel::forward(x, w, &counts)
    }

    fn grouped_matmul_dgrad(dy: FloatTensor<Self>, w: FloatTensor<Self>, counts: Vec<usize>) -> FloatTensor<Self> {
        crate::grouped_kernel::dgrad(dy, w, &counts)
    }

    fn grouped_matmul_wgrad(x: FloatTensor<Self>, dy: FloatTensor<Self>, counts: Vec<usize>) -> FloatTensor<Self> {
        crate::grouped_kernel::wgrad(x, dy, &counts)
    }
}

#[derive(Debug)]
struct GroupedBackward;

impl<B: Backend + GroupedOps> Backward<B, 2> for GroupedBackward {
    type State = (Option<NodeId>, Option<NodeId>, Vec<usize>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let (x, w, counts) = ops.state;
        let x: Option<FloatTensor<B>> = x.map(|id| checkpointer.retrieve_node_output(id));
        let w: Option<FloatTensor<B>> = w.map(|id| checkpointer.retrieve_node_output(id));
        let wgrad_counts = counts.clone();
        binary::<B, _, _>(
            ops.parents,
            ops.node,
            grads,
            |grad| B::grouped_matmul_dgrad(grad, w.expect("w saved for the rows' gradient"), counts),
            |grad| B::grouped_matmul_wgrad(x.expect("x saved for the weights' gradient"), grad, wgrad_counts),
        );
    }
}

impl<B: Backend + GroupedOps, C: CheckpointStrategy> GroupedOps for Autodiff<B, C> {
    fn grouped_matmul(x: FloatTensor<Self>, w: FloatTensor<Self>, counts: Vec<usize>) -> FloatTensor<Self> {
        let (x_tracked, w_tracked) = (x.is_tracked(), w.is_tracked());
        match GroupedBackward
            .prepare::<C>([x.node(), w.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                // Each operand is kept for the other's gradient.
                let x_state = w_tracked.then(|| prep.checkpoint(&x));
                let w_state = x_tracked.then(|| prep.checkpoint(&w));
                let out = B::grouped_matmul(x.into_parts().0, w.into_parts().0, counts.clone());
                prep.finish((x_state, w_state, counts), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::grouped_matmul(x.into_parts().0, w.into_parts().0, counts)),
        }
    }

    fn grouped_matmul_dgrad(dy: FloatTensor<Self>, w: FloatTensor<Self>, counts: Vec<usize>) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::grouped_matmul_dgrad(dy.into_parts().0, w.into_parts().0, counts))
    }

    fn grouped_matmul_wgrad(x: FloatTensor<Self>, dy: FloatTensor<Self>, counts: Vec<usize>) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::grouped_matmul_wgrad(x.into_parts().0, dy.into_parts().0, counts))
    }
}

/// The multiple of rows each group should hold for [`grouped_matmul`] to run without copying
/// its rows into whole tiles: 128 for bf16 rows on CUDA (the grouped kernel's tile), 1
/// elsewhere. Rows added to reach it may hold anything: their results are the caller's to drop,
/// and their gradient rows must be zero (rows no loss reads).
pub fn row_alignment(x: &Tensor<2>) -> usize {
    #[cfg(feature = "cuda")]
    {
        let plain = x.clone().detach().without_autodiff();
        let cuda = plain.try_into_primitive::<burn::backend::Cube>().is_ok();
        if cuda && x.dtype() == burn::tensor::DType::BF16 {
            return 128;
        }
    }
    let _ = x;
    1
}

/// `y_g = x_g · w_g` for each group `g` of `counts[g]` consecutive rows of `x` (`Σ counts` of
/// them, above 0), differentiable in both.
///
/// # Shapes
/// `[r, k]`, `[e, k, n]` → `[r, n]`
pub fn grouped_matmul(x: Tensor<2>, w: Tensor<3>, counts: &[usize]) -> Tensor<2> {
    assert_eq!(counts.len(), w.dims()[0], "one count a group");
    assert_eq!(
        counts.iter().sum::<usize>(),
        x.dims()[0],
        "the counts add up to the rows"
    );
    Tensor::from_dispatch(<burn::backend::Dispatch as GroupedOps>::grouped_matmul(
        x.into_dispatch(),
        w.into_dispatch(),
        counts.to_vec(),
    ))
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Tensor, Tolerance};

    /// Against one matmul a group with Burn's autodiff: values and both gradients, an empty
    /// group included (its weight's gradient zero).
    #[test]
    fn matches_a_product_per_group() {
        let device = Device::flex().autodiff();
        let counts = [3, 0, 5, 1];
        let x = Tensor::<2>::random([9, 6], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let w = Tensor::<3>::random([4, 6, 7], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let ours = super::grouped_matmul(x.clone(), w.clone(), &counts);
        let mut start = 0;
        let mut parts = Vec::new();
        for (g, &n) in counts.iter().enumerate() {
            if n > 0 {
                let w_g = w.clone().narrow(0, g, 1).reshape([6, 7]);
                parts.push(x.clone().narrow(0, start, n).matmul(w_g));
            }
            start += n;
        }
        let theirs = Tensor::cat(parts, 0);
        // The same f32 products: equal up to the order of their sums.
        let tolerance = Tolerance::absolute(1e-5);
        ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
        let dy = Tensor::<2>::random([9, 7], Distribution::Normal(0.0, 1.0), &device);
        let (g1, g2) = ((ours * dy.clone()).sum().backward(), (theirs * dy).sum().backward());
        x.grad(&g1)
            .unwrap()
            .to_data()
            .assert_approx_eq::<f32>(&x.grad(&g2).unwrap().to_data(), tolerance);
        let (ours, theirs) = (w.grad(&g1).unwrap(), w.grad(&g2).unwrap());
        ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
        let empty = ours.narrow(0, 1, 1).abs().max().into_scalar::<f32>();
        assert_eq!(empty, 0.0, "a group without rows gets a zero gradient");
    }
}
