//! One AdamW update of a parameter as a backend extension, [`AdamWOps`]: on CUDA one kernel
//! reads the parameter, its gradient and both moments once and writes the three new tensors;
//! elsewhere the tensor-op twin, [`reference`]. Both compute in f32, keep the moments in f32 and
//! round the parameter once to its dtype. With fp32 master weights
//! ([`adamw_master_step`]) the kernel updates the master copy and writes the model's
//! lower-precision copy of it in the same pass.
//!
//! With `g = grad · grad_scale`: `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)g²`,
//! `p ← p(1 − lr·λ) − lr · (m / (1−β₁ᵗ)) / (√(v / (1−β₂ᵗ)) + ε)` (decoupled weight decay λ, as
//! Burn's and PyTorch's AdamW).

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend, Backend};
use burn::tensor::{FloatDType, Tensor};

#[cfg(feature = "cuda")]
pub(crate) mod kernel;
pub mod reference;
mod step;

pub use step::{AdamWStep, MasterUpdate};

extension! {
    /// The backend extension behind [`adamw_step`].
    pub trait AdamWOps, cuda: kernel;

    /// `(parameter, moment_1, moment_2)` after one step; moments f32, the parameter in its dtype.
    fn adamw_update(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moment_1: FloatTensor<Self>,
        moment_2: FloatTensor<Self>,
        step: AdamWStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        reference::update::<Self>(param, grad, moment_1, moment_2, step)
    }

    /// `(master, moment_1, moment_2, parameter, squares, amax)` after one step of f32 master
    /// weights: the gradient in any float dtype, multiplied by `clip` (`[1]`, f32; negative: the
    /// step skipped, master and moments as they were, the parameter written from them), the new
    /// parameter the new master value in `dtype`; `squares` (`[1]`, f32) plus the gradient's
    /// `Σ g²` before clipping (a global norm's share, from the same read of the gradient); `amax`
    /// (`[1]`, f32) the new parameter's largest magnitude (NaN ignored; 0 when empty), for the FP8
    /// casts that read it next.
    fn adamw_master_update(
        master: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moment_1: FloatTensor<Self>,
        moment_2: FloatTensor<Self>,
        step: AdamWStep,
        clip: FloatTensor<Self>,
        dtype: FloatDType,
        squares: FloatTensor<Self>,
    ) -> MasterUpdate<Self> {
        reference::master_update::<Self>(master, grad, moment_1, moment_2, step, clip, dtype, squares)
    }
}

/// The new parameter and moments.
type Update<B> = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

/// Optimizers run on tensors outside the graph: the inner backend's update, as constants.
impl<B: Backend + AdamWOps, C: CheckpointStrategy> AdamWOps for Autodiff<B, C> {
    fn adamw_update(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        step: AdamWStep,
    ) -> Update<Self> {
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        let (p, m, v) = B::adamw_update(inner(param), inner(grad), inner(m), inner(v), step);
        let outer = |t| <Self as AutodiffBackend>::from_inner(t);
        (outer(p), outer(m), outer(v))
    }

    fn adamw_master_update(
        master: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        step: AdamWStep,
        clip: FloatTensor<Self>,
        dtype: FloatDType,
        squares: FloatTensor<Self>,
    ) -> MasterUpdate<Self> {
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        let new = B::adamw_master_update(
            inner(master),
            inner(grad),
            inner(m),
            inner(v),
            step,
            inner(clip),
            dtype,
            inner(squares),
        );
        let outer = |t| <Self as AutodiffBackend>::from_inner(t);
        MasterUpdate {
            master: outer(new.master),
            moment_1: outer(new.moment_1),
            moment_2: outer(new.moment_2),
            param: outer(new.param),
            squares: outer(new.squares),
            amax: outer(new.amax),
        }
    }
}

/// One AdamW step of `param` through [`AdamWOps`]: the new parameter and f32 moments. On CUDA
/// they are written where the old ones were when nothing else holds those (the caller handed
/// them over), as PyTorch's fused AdamW does.
///
/// # Shapes
/// all four of one shape
pub fn adamw_step<const D: usize>(
    param: Tensor<D>,
    grad: Tensor<D>,
    moment_1: Tensor<D>,
    moment_2: Tensor<D>,
    step: AdamWStep,
) -> (Tensor<D>, Tensor<D>, Tensor<D>) {
    let (p, m, v) = <burn::backend::Dispatch as AdamWOps>::adamw_update(
        param.into_dispatch(),
        grad.into_dispatch(),
        moment_1.into_dispatch(),
        moment_2.into_dispatch(),
        step,
    );
    (
        Tensor::from_dispatch(p),
        Tensor::from_dispatch(m),
        Tensor::from_dispatch(v),
    )
}

/// One step of [`adamw_master_step`]: the new master weights and f32 moments, the new value in
/// the model's dtype, the running sum of squares with the step's gradient added, and the new
/// value's largest magnitude (`[1]`, f32, NaN ignored), taken as it was written.
#[derive(Clone, Debug)]
pub struct MasterStep<const D: usize> {
    pub master: Tensor<D>,
    pub moment_1: Tensor<D>,
    pub moment_2: Tensor<D>,
    pub param: Tensor<D>,
    pub squares: Tensor<1>,
    pub amax: Tensor<1>,
}

/// One AdamW step of f32 master weights through [`AdamWOps`]. `clip` (f32, on the device: a
/// global norm's clipping factor, 1 without clipping, read by the kernel rather than the host)
/// multiplies the gradient; a negative one skips the step (a gradient not finite: master weights
/// and moments stay as they were, the parameter is written from them); `squares` (f32) comes back with the gradient's `Σ g²` before
/// clipping added, from the same read (a global norm without a pass of its own).
///
/// # Shapes
/// all four of one shape; `clip` and `squares` `[1]`
#[allow(clippy::too_many_arguments)]
pub fn adamw_master_step<const D: usize>(
    master: Tensor<D>,
    grad: Tensor<D>,
    moment_1: Tensor<D>,
    moment_2: Tensor<D>,
    step: AdamWStep,
    clip: Tensor<1>,
    dtype: FloatDType,
    squares: Tensor<1>,
) -> MasterStep<D> {
    let new = <burn::backend::Dispatch as AdamWOps>::adamw_master_update(
        master.into_dispatch(),
        grad.into_dispatch(),
        moment_1.into_dispatch(),
        moment_2.into_dispatch(),
        step,
        clip.into_dispatch(),
        dtype,
        squares.into_dispatch(),
    );
    MasterStep {
        master: Tensor::from_dispatch(new.master),
        moment_1: Tensor::from_dispatch(new.moment_1),
        moment_2: Tensor::from_dispatch(new.moment_2),
        param: Tensor::from_dispatch(new.param),
        squares: Tensor::from_dispatch(new.squares),
        amax: Tensor::from_dispatch(new.amax),
    }
}

#[cfg(test)]
mod tests {
    use burn::optim::{AdamWConfig, Optimizer};
    use burn::tensor::{DType, Device, Distribution, Tensor, Tolerance};

    use super::*;

    /// Three steps on the CPU match Burn's AdamW (f32, so its moments are f32 too).
    #[test]
    fn matches_burns_adamw() {
        let device = Device::flex();
        let config = AdamWConfig::new().with_epsilon(1e-8).with_weight_decay(0.1);
        let burn = config.build();
        let mut theirs = Tensor::<2>::random([7, 9], Distribution::Normal(0.0, 1.0), &device);
        let mut ours = theirs.clone();
        let (mut m, mut v) = (
            theirs.zeros_like().cast(DType::F32),
            theirs.zeros_like().cast(DType::F32),
        );
        let mut state = None;
        for time in 1..=3 {
            let grad = Tensor::<2>::random([7, 9], Distribution::Normal(0.0, 1.0), &device);
            (theirs, state) = burn.step(1e-2, theirs, grad.clone(), state);
            let step = AdamWStep {
                lr: 1e-2,
                beta_1: 0.9,
                beta_2: 0.999,
                epsilon: 1e-8,
                weight_decay: 0.1,
                time,
                grad_scale: 1.0,
            };
            (ours, m, v) = adamw_step(ours, grad, m, v, step);
        }
        // f32 both ways, the same formula in another order: a few ulps of values of order 1.
        ours.to_data()
            .assert_approx_eq::<f32>(&theirs.to_data(), Tolerance::absolute(1e-5));
    }

    /// The master step's amax is the largest magnitude of the copy as written (bf16 here),
    /// a NaN left out; an empty parameter's is 0.
    #[test]
    fn master_step_takes_the_copys_amax() {
        use burn::tensor::TensorData;
        let device = Device::flex();
        let step = AdamWStep {
            lr: 1e-1,
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-8,
            weight_decay: 0.0,
            time: 1,
            grad_scale: 1.0,
        };
        let f32s = |v: Vec<f32>| Tensor::<1>::from_data(TensorData::new(v.clone(), [v.len()]), (&device, DType::F32));
        let amax_of = |master: Vec<f32>, grad: Vec<f32>| {
            let zeros = f32s(vec![0.0; master.len()]);
            let new = adamw_master_step(
                f32s(master),
                f32s(grad),
                zeros.clone(),
                zeros,
                step,
                f32s(vec![1.0]),
                FloatDType::BF16,
                f32s(vec![0.0]),
            );
            let copy: Vec<f32> = new.param.cast(DType::F32).into_data().try_to_vec().unwrap();
            (new.amax.into_scalar::<f32>(), copy)
        };
        // The first step moves each value by lr against its gradient's sign.
        let (amax, copy) = amax_of(vec![0.5, -3.0, 2.0], vec![1.0, 1.0, f32::NAN]);
        assert!(copy[2].is_nan());
        assert_eq!(amax, copy[1].abs());
        // −3.1 in bf16: within half its step there (2⁻⁷).
        assert!((amax - 3.1).abs() <= 2f32.powi(-7), "{amax}");
        assert_eq!(amax_of(vec![], vec![]).0, 0.0);
    }
}
