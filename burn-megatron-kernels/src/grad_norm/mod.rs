//! The sum of squares of many tensors, what a global gradient norm sums, on a backend
//! extension, [`NormOps`], that writes a few partial sums a tensor into one buffer shared by all
//! of them ([`square_partials`]: no concatenation after, which would launch a copy a tensor); on
//! CUDA one kernel a tensor writes a partial sum a block (Burn's reduction of one long vector in
//! a single pass is slow: llama-1b's 146 gradients took 41 ms that way); elsewhere the tensor-op
//! twin, [`reference`]. Both square and sum in f32, in blocks of [`partials_count`]'s size.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend};
use burn::tensor::{DType, Device, Tensor};

#[cfg(feature = "cuda")]
pub(crate) mod kernel;
pub mod reference;

/// Vectors one partial sum covers: 256 threads, 8 vectors each.
pub(crate) const CHUNK: usize = 2048;

/// The values a vector of a tensor of `len` elements holds: 8, 4, 2 or 1, the largest that
/// divides `len` (16-byte bf16 loads where it can).
pub(crate) fn vector(len: usize) -> usize {
    [8, 4, 2, 1]
        .into_iter()
        .find(|v| len.is_multiple_of(*v))
        .expect("1 divides")
}

/// The partial sums of squares of a tensor of `len` elements: one a [`CHUNK`] of its vectors.
pub fn partials_count(len: usize) -> usize {
    (len / vector(len)).div_ceil(CHUNK)
}

extension! {
    /// The backend extension behind [`sum_of_squares`] and [`square_partials`].
    pub trait NormOps, cuda: kernel;

    /// `out` (f32) with `x`'s [`partials_count`] partial sums of `x²` written from `offset`:
    /// partial `i` sums chunk `i` of `x`'s vectors.
    fn square_partials_into(x: FloatTensor<Self>, out: FloatTensor<Self>, offset: usize) -> FloatTensor<Self> {
        reference::partials_into::<Self>(x, out, offset)
    }
}

/// Norms are taken of tensors outside the graph: the inner backend's sums, as constants.
impl<B: Backend + NormOps, C: CheckpointStrategy> NormOps for Autodiff<B, C> {
    fn square_partials_into(x: FloatTensor<Self>, out: FloatTensor<Self>, offset: usize) -> FloatTensor<Self> {
        let out = B::square_partials_into(x.into_parts().0, out.into_parts().0, offset);
        <Self as AutodiffBackend>::from_inner(out)
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

/// Each tensor of `xs`'s partial sums of `x²` ([`partials_count`] of them) end to end in one
/// buffer, `[p]` in f32 (none when `xs` is empty), and how many each tensor has, in order:
/// summing any run of them sums those tensors' squares, and a tensor's are finite where all its
/// elements are.
pub fn square_partials<const D: usize>(xs: Vec<Tensor<D>>) -> (Option<Tensor<1>>, Vec<usize>) {
    let lengths: Vec<usize> = xs.iter().map(|x| partials_count(x.shape().num_elements())).collect();
    let Some(device) = xs.first().map(|x| x.device()) else {
        return (None, lengths);
    };
    let mut out = Tensor::<1>::zeros([lengths.iter().sum::<usize>()], (&device, DType::F32)).into_dispatch();
    let mut offset = 0;
    for (x, length) in xs.into_iter().zip(&lengths) {
        out = <burn::backend::Dispatch as NormOps>::square_partials_into(x.into_dispatch(), out, offset);
        offset += length;
    }
    (Some(Tensor::from_dispatch(out)), lengths)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{DType, Device, Distribution, Tensor};

    /// The sum over tensors of several lengths and dtypes is the plain sum of their squares.
    #[test]
    fn is_the_plain_sum_of_squares() {
        let device = Device::flex();
        let xs: Vec<Tensor<1>> = [(3 * 8192, DType::F32), (7, DType::F32), (100, DType::BF16)]
            .into_iter()
            .map(|(n, dtype)| Tensor::random([n], Distribution::Normal(0.0, 1.0), (&device, dtype)))
            .collect();
        let plain: f64 = xs
            .iter()
            .map(|x| x.clone().cast(DType::F32).square().sum().into_scalar::<f64>())
            .sum();
        let ours = super::sum_of_squares(xs.clone(), &device).into_scalar::<f64>();
        // The same f32 squares summed in another order: a few ulps of the sum.
        assert!((ours - plain).abs() <= 1e-5 * plain, "{ours} against {plain}");
        // Each tensor's run of partials sums its own squares.
        let (partials, lengths) = super::square_partials(xs.clone());
        assert_eq!(
            lengths,
            [2, 1, 1],
            "3·8192 values are 3072 vectors of 8: two chunks of 2048"
        );
        let partials: Vec<f32> = partials.unwrap().into_data().try_to_vec().unwrap();
        let mut at = 0;
        for (x, n) in xs.into_iter().zip(lengths) {
            let own = x.cast(DType::F32).square().sum().into_scalar::<f64>();
            let run: f64 = partials[at..at + n].iter().map(|&p| p as f64).sum();
            assert!((run - own).abs() <= 1e-5 * own, "{run} against {own}");
            at += n;
        }
    }
}
