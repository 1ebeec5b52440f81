//! The sum of squares of many tensors, what a global gradient norm sums, on a backend
//! extension, [`NormOps`], that leaves a few partial sums a tensor: on CUDA one kernel a tensor
//! writes a partial sum a block, and one reduction sums every tensor's partials (Burn's
//! reduction of one long vector in a single pass is slow: llama-1b's 146 gradients took 41 ms
//! that way); elsewhere the tensor-op twin, [`reference`]. Both square and
//! sum in f32.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend};
use burn::tensor::{DType, Device, Tensor};

#[cfg(feature = "cuda")]
pub(crate) mod kernel;
pub mod reference;

extension! {
    /// The backend extension behind [`sum_of_squares`].
    pub trait NormOps, cuda: kernel;

    /// Partial sums of `x²` over every element of `x` whose sum is `Σ x²`: `[p]` in f32, `p`
    /// the backend's choice.
    fn partial_sums_of_squares(x: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::sum_of_squares::<Self>(x)
    }
}

/// Norms are taken of tensors outside the graph: the inner backend's sums, as constants.
impl<B: Backend + NormOps, C: CheckpointStrategy> NormOps for Autodiff<B, C> {
    fn partial_sums_of_squares(x: FloatTensor<Self>) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::partial_sums_of_squares(x.into_parts().0))
    }
}

/// `Σ x²` over every element of every tensor of `xs`, through [`NormOps`]: `[1]` in f32 on
/// `device`, zero when `xs` is empty.
pub fn sum_of_squares<const D: usize>(xs: Vec<Tensor<D>>, device: &Device) -> Tensor<1> {
    match square_partials(xs).0 {
        Some(partials) => partials.sum(),
        None => Tensor::zeros([1], (device, DType::F32)),
    }
}

/// Each tensor of `xs`'s partial sums of `x²` ([`NormOps`]) end to end, `[p]` in f32 (none when
/// `xs` is empty), and how many partials each tensor has, in order: summing any run of them sums
/// those tensors' squares, and a tensor's are finite where all its elements are.
pub fn square_partials<const D: usize>(xs: Vec<Tensor<D>>) -> (Option<Tensor<1>>, Vec<usize>) {
    let partials: Vec<Tensor<1>> = xs
        .into_iter()
        .map(|x| {
            Tensor::from_dispatch(<burn::backend::Dispatch as NormOps>::partial_sums_of_squares(
                x.into_dispatch(),
            ))
        })
        .collect();
    let lengths = partials.iter().map(|p| p.dims()[0]).collect();
    let partials = (!partials.is_empty()).then(|| Tensor::cat(partials, 0));
    (partials, lengths)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{DType, Device, Distribution, Tensor};

    /// The sum over tensors of several lengths and dtypes is the plain sum of their squares.
    #[test]
    fn is_the_plain_sum_of_squares() {
        let device = Device::flex();
        let xs: Vec<Tensor<1>> = [(3 * 4096, DType::F32), (7, DType::F32), (100, DType::BF16)]
            .into_iter()
            .map(|(n, dtype)| Tensor::random([n], Distribution::Normal(0.0, 1.0), (&device, dtype)))
            .collect();
        let plain: f64 = xs
            .iter()
            .map(|x| x.clone().cast(DType::F32).square().sum().into_scalar::<f64>())
            .sum();
        let ours = super::sum_of_squares(xs, &device).into_scalar::<f64>();
        // The same f32 squares summed in another order: a few ulps of the sum.
        assert!((ours - plain).abs() <= 1e-5 * plain, "{ours} against {plain}");
    }
}
