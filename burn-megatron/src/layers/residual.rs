//! A pre-norm block's residual stream around one branch, `x + branch(norm(x))`: the norm is
//! linked to the add and to the branch's readers of its output, so the norm's backward kernel
//! adds the stream's gradient and the readers' gradients as it reads and writes its own
//! (`burn_megatron_kernels::rms_norm::link`), where autodiff would sum each in a pass of its
//! own. [`RmsNorm::pre_norm`](super::RmsNorm::pre_norm) starts one; the branch
//! (`ParallelAttention::forward_onto`, `ParallelMlp::forward_onto`) ends it, in its last
//! product's kernel where it can.

use burn::tensor::Tensor;
use burn_megatron_kernels::rms_norm::{fan_out, link::NormLink, residual_add};

/// The residual stream `x` a branch's output goes back into, linked to the norm that read it.
#[derive(Clone, Debug)]
pub struct Residual {
    x: Tensor<3>,
    link: NormLink,
}

impl Residual {
    pub(crate) fn new(x: Tensor<3>, link: NormLink) -> Self {
        Self { x, link }
    }

    /// A stream no linked norm read: [`add_branch`](Self::add_branch) is then a plain sum, its gradient
    /// autodiff's.
    pub fn unlinked(x: Tensor<3>) -> Self {
        Self::new(x, NormLink::default())
    }

    /// `x + branch`, `x`'s gradient handed to the linked norm.
    ///
    /// # Shapes
    /// `branch` of the stream's shape
    pub fn add_branch(self, branch: Tensor<3>) -> Tensor<3> {
        residual_add(self.x, branch, &self.link)
    }

    /// The stream and its link, for a product that adds the branch in its own kernel.
    pub(crate) fn into_parts(self) -> (Tensor<3>, NormLink) {
        (self.x, self.link)
    }
}

/// `x` for `n` readers, through `stream`'s norm where there is one (its readers' gradients added
/// by its backward kernel), else `n` handles of `x`.
pub(crate) fn readers<const D: usize, const N: usize>(x: Tensor<D>, stream: Option<&Residual>) -> [Tensor<D>; N] {
    let all = fan_out(x, N, stream.map(|stream| &stream.link));
    all.try_into().unwrap_or_else(|_| unreachable!("{N} readers"))
}
