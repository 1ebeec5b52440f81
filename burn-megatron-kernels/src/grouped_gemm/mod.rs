//! The grouped product of a mixture of experts, [`GroupedOps`]: rows in groups (one group an
//! expert, consecutive rows), each group times its own weight, in one call, with both backward
//! products (dgrad: each group's rows times its weight transposed; wgrad: each weight's
//! gradient from its own rows).
//!
//! Where the groups lie is [`Groups`]: counts on the host (any), or each group's first row on
//! the device, as the MoE dispatch decides them there, so that no count has to reach the
//! host. The backend ops take the device form, every group starting at a multiple of
//! [`row_alignment`]; [`grouped_matmul`] pads counts that are not with row gathers first.
//!
//! On CUDA, bf16 operands run one launch of our Hopper GEMM's grouped variant
//! (`grouped_kernel`), which finds each tile's group from the starts on the device. Elsewhere,
//! and for shapes that kernel does not take, one product a group ([`reference`]), the starts
//! read to the host.
//!
//! Legend: `r` rows, `k` input features, `n` output features, `e` groups.

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, binary};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, AutodiffBackend, Backend, Flex};
use burn::tensor::{Int, Tensor, TensorData};

#[cfg(feature = "cuda")]
pub(crate) mod kernel;
pub mod reference;

extension! {
    /// The backend extension behind [`grouped_matmul`]. `starts` (`[e + 1]`): group `g`'s rows are
    /// `starts[g]..starts[g + 1]`, from `starts[0] = 0`, each start a multiple of [`row_alignment`];
    /// the rows past `starts[e]` belong to no group: their output rows are zero, and no weight's
    /// gradient reads them.
    pub trait GroupedOps, cuda: kernel;

    /// `y_g = x_g · w_g` for each group `g`.
    ///
    /// # Shapes
    /// `[r, k]`, `[e, k, n]`, `[e + 1]` → `[r, n]`
    fn grouped_matmul(x: FloatTensor<Self>, w: FloatTensor<Self>, starts: IntTensor<Self>) -> FloatTensor<Self> {
        reference::forward::<Self>(x, w, &host_starts(starts), Self::float_matmul)
    }

    /// `dx_g = dy_g · w_gᵀ`.
    ///
    /// # Shapes
    /// `[r, n]`, `[e, k, n]`, `[e + 1]` → `[r, k]`
    fn grouped_matmul_dgrad(dy: FloatTensor<Self>, w: FloatTensor<Self>, starts: IntTensor<Self>) -> FloatTensor<Self> {
        reference::dgrad::<Self>(dy, w, &host_starts(starts), Self::float_matmul)
    }

    /// `dw_g = x_gᵀ · dy_g`, zero for a group without rows.
    ///
    /// # Shapes
    /// `[r, k]`, `[r, n]`, `[e + 1]` → `[e, k, n]`
    fn grouped_matmul_wgrad(x: FloatTensor<Self>, dy: FloatTensor<Self>, starts: IntTensor<Self>) -> FloatTensor<Self> {
        reference::wgrad::<Self>(x, dy, &host_starts(starts), Self::float_matmul)
    }
}

/// Where a grouped product's groups lie.
#[derive(Clone, Debug)]
pub enum Groups {
    /// `counts[g]` consecutive rows a group, adding up to the rows, known on the host.
    Counts(Vec<usize>),
    /// `[e + 1]` on the device: each group's first row and the end of the last, as
    /// [`GroupedOps`] takes them (each a multiple of [`row_alignment`]); rows past the end
    /// belong to no group.
    Starts(Box<Tensor<1, Int>>),
}

impl Groups {
    /// The rows each group holds, on the host: read from the device for [`Groups::Starts`]
    /// (one copy, which waits for the work before it).
    pub fn counts(&self) -> Vec<usize> {
        match self {
            Groups::Counts(counts) => counts.clone(),
            Groups::Starts(starts) => {
                let starts = read_starts(starts.as_ref().clone());
                starts.windows(2).map(|w| w[1] - w[0]).collect()
            }
        }
    }
}

/// Where each of `counts`' groups starts, and the end of the last.
fn starts_of(counts: &[usize]) -> Vec<usize> {
    let mut starts = vec![0];
    for &c in counts {
        starts.push(starts[starts.len() - 1] + c);
    }
    starts
}

/// Starts read to the host (one copy, which waits for the work before it).
pub(crate) fn read_starts(starts: Tensor<1, Int>) -> Vec<usize> {
    let starts: Vec<i64> = starts.into_data().convert::<i64>().try_to_vec().expect("starts");
    starts.into_iter().map(|s| s as usize).collect()
}

/// The starts of a CPU tensor, on the host.
fn host_starts(starts: IntTensor<Flex>) -> Vec<usize> {
    read_starts(Tensor::from_primitive::<Flex>(starts))
}

#[derive(Debug)]
struct GroupedBackward;

impl<B: Backend + GroupedOps> Backward<B, 2> for GroupedBackward {
    type State = (Option<NodeId>, Option<NodeId>, IntTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let (x, w, starts) = ops.state;
        let x: Option<FloatTensor<B>> = x.map(|id| checkpointer.retrieve_node_output(id));
        let w: Option<FloatTensor<B>> = w.map(|id| checkpointer.retrieve_node_output(id));
        let wgrad_starts = starts.clone();
        binary::<B, _, _>(
            ops.parents,
            ops.node,
            grads,
            |grad| B::grouped_matmul_dgrad(grad, w.expect("w saved for the rows' gradient"), starts),
            |grad| B::grouped_matmul_wgrad(x.expect("x saved for the weights' gradient"), grad, wgrad_starts),
        );
    }
}

impl<B: Backend + GroupedOps, C: CheckpointStrategy> GroupedOps for Autodiff<B, C> {
    fn grouped_matmul(x: FloatTensor<Self>, w: FloatTensor<Self>, starts: IntTensor<Self>) -> FloatTensor<Self> {
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
                let out = B::grouped_matmul(x.into_parts().0, w.into_parts().0, starts.clone());
                prep.finish((x_state, w_state, starts), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::grouped_matmul(x.into_parts().0, w.into_parts().0, starts)),
        }
    }

    fn grouped_matmul_dgrad(dy: FloatTensor<Self>, w: FloatTensor<Self>, starts: IntTensor<Self>) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::grouped_matmul_dgrad(dy.into_parts().0, w.into_parts().0, starts))
    }

    fn grouped_matmul_wgrad(x: FloatTensor<Self>, dy: FloatTensor<Self>, starts: IntTensor<Self>) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::grouped_matmul_wgrad(x.into_parts().0, dy.into_parts().0, starts))
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

/// `y_g = x_g · w_g` for each group `g` of `groups` (rows past the groups' come out zero),
/// differentiable in both. Counts that are not multiples of [`row_alignment`] are padded
/// with zero rows first (a row gather in, one out).
///
/// # Shapes
/// `[r, k]`, `[e, k, n]` → `[r, n]`
pub fn grouped_matmul(x: Tensor<2>, w: Tensor<3>, groups: &Groups) -> Tensor<2> {
    let e = w.dims()[0];
    let device = x.device();
    match groups {
        Groups::Starts(starts) => {
            assert_eq!(starts.dims(), [e + 1], "a start a group and the end");
            product(x, w, starts.as_ref().clone())
        }
        Groups::Counts(counts) => {
            assert_eq!(counts.len(), e, "one count a group");
            assert_eq!(
                counts.iter().sum::<usize>(),
                x.dims()[0],
                "the counts add up to the rows"
            );
            let align = row_alignment(&x);
            if counts.iter().all(|c| c.is_multiple_of(align)) {
                return product(x, w, ints(&starts_of(counts), &device));
            }
            // Each group's rows, then zero rows (row `r` of `x` with one zero row below it).
            let (r, k) = (x.dims()[0], x.dims()[1]);
            let padded: Vec<usize> = counts.iter().map(|c| c.next_multiple_of(align)).collect();
            let (mut source, mut real) = (Vec::new(), Vec::new());
            for (&c, start) in counts.iter().zip(starts_of(counts)) {
                real.extend((0..c).map(|j| source.len() + j));
                source.extend(start..start + c);
                source.resize(source.len() + c.next_multiple_of(align) - c, r);
            }
            let zero = Tensor::<2>::zeros([1, k], (&device, x.dtype()));
            let rows = Tensor::cat(vec![x, zero], 0).select(0, ints(&source, &device));
            product(rows, w, ints(&starts_of(&padded), &device)).select(0, ints(&real, &device))
        }
    }
}

/// The backend op on starts already on the device.
fn product(x: Tensor<2>, w: Tensor<3>, starts: Tensor<1, Int>) -> Tensor<2> {
    Tensor::from_dispatch(<burn::backend::Dispatch as GroupedOps>::grouped_matmul(
        x.into_dispatch(),
        w.into_dispatch(),
        starts.into_dispatch(),
    ))
}

/// `values` as an int tensor on `device`.
fn ints(values: &[usize], device: &burn::tensor::Device) -> Tensor<1, Int> {
    let values: Vec<i32> = values.iter().map(|&v| v as i32).collect();
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
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
        let ours = super::grouped_matmul(x.clone(), w.clone(), &super::Groups::Counts(counts.to_vec()));
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

    /// Groups given by their starts, with rows past the last group's: those rows' outputs are
    /// zero and add nothing to any gradient; an unaligned count goes through the padded path
    /// of the CPU too (alignment 1 there, so the counts themselves).
    #[test]
    fn starts_leave_the_rows_past_the_groups_out() {
        let device = Device::flex().autodiff();
        let x = Tensor::<2>::random([10, 6], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let w = Tensor::<3>::random([3, 6, 4], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let starts = Tensor::<1, burn::tensor::Int>::from_ints([0, 3, 3, 8], &device);
        let ours = super::grouped_matmul(x.clone(), w.clone(), &super::Groups::Starts(Box::new(starts)));
        let counted = super::grouped_matmul(
            x.clone().narrow(0, 0, 8),
            w.clone(),
            &super::Groups::Counts(vec![3, 0, 5]),
        );
        // The same products in the same order.
        let exact = Tolerance::absolute(0.0);
        ours.clone()
            .narrow(0, 0, 8)
            .to_data()
            .assert_approx_eq::<f32>(&counted.to_data(), exact);
        assert_eq!(ours.clone().narrow(0, 8, 2).abs().max().into_scalar::<f32>(), 0.0);
        let grads = ours.sum().backward();
        let past = x.grad(&grads).unwrap().narrow(0, 8, 2).abs().max().into_scalar::<f32>();
        assert_eq!(past, 0.0, "no gradient reaches the rows past the groups");
        let counts = super::Groups::Starts(Box::new(Tensor::from_ints([0, 3, 3, 8], &Device::flex()))).counts();
        assert_eq!(counts, vec![3, 0, 5]);
    }
}
