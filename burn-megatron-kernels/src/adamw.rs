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
use burn::backend::{Autodiff, AutodiffBackend, Backend, ExtensionType, Flex, backend_extension};
use burn::tensor::{FloatDType, Tensor};

/// AdamW's hyper-parameters for one step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    pub lr: f32,
    pub beta_1: f32,
    pub beta_2: f32,
    pub epsilon: f32,
    pub weight_decay: f32,
    /// The step number, from 1 (bias correction).
    pub time: u32,
    /// Multiplies the gradient first (clipping by a global norm).
    pub grad_scale: f32,
}

impl AdamWStep {
    /// The bias corrections `(1 − β₁ᵗ, 1 − β₂ᵗ)`.
    pub(crate) fn bias(&self) -> (f32, f32) {
        (
            1.0 - self.beta_1.powi(self.time as i32),
            1.0 - self.beta_2.powi(self.time as i32),
        )
    }
}

/// The backend extension behind [`adamw_step`].
#[backend_extension(Flex, Cube: cfg(feature = "cuda"), Autodiff)]
pub trait AdamWOps: Backend {
    /// `(parameter, moment_1, moment_2)` after one step; moments f32, the parameter in its dtype.
    fn adamw_update(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moment_1: FloatTensor<Self>,
        moment_2: FloatTensor<Self>,
        step: AdamWStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// `(master, moment_1, moment_2, parameter, squares, amax)` after one step of f32 master
    /// weights: the gradient in any float dtype, multiplied by `clip` (`[1]`, f32), the new
    /// parameter the new master value in `dtype`; `squares` (`[1]`, f32) plus the gradient's
    /// `Σ g²` before clipping (a global norm's share, from the same read of the gradient); `amax`
    /// (`[1]`, f32) the new parameter's largest magnitude (NaN ignored; 0 when empty), for the FP8
    /// casts that read it next.
    #[allow(clippy::too_many_arguments)]
    fn adamw_master_update(
        master: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moment_1: FloatTensor<Self>,
        moment_2: FloatTensor<Self>,
        step: AdamWStep,
        clip: FloatTensor<Self>,
        dtype: FloatDType,
        squares: FloatTensor<Self>,
    ) -> MasterUpdate<Self>;
}

/// The plain tensor-op twin, on any backend's primitives: the CPU path and the kernel's oracle.
pub mod reference {
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{Backend, Scalar, TensorMetadata};
    use burn::tensor::FloatDType;

    use super::AdamWStep;

    pub fn update<B: Backend>(
        param: FloatTensor<B>,
        grad: FloatTensor<B>,
        m: FloatTensor<B>,
        v: FloatTensor<B>,
        step: AdamWStep,
    ) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
        let f32 = |t: FloatTensor<B>| B::float_cast(t, FloatDType::F32);
        let scalar = |x: f32| Scalar::from(x);
        let dtype = FloatDType::from(param.dtype());
        let (bias_1, bias_2) = step.bias();
        let g = B::float_mul_scalar(f32(grad), scalar(step.grad_scale));
        let m = B::float_add(
            B::float_mul_scalar(f32(m), scalar(step.beta_1)),
            B::float_mul_scalar(g.clone(), scalar(1.0 - step.beta_1)),
        );
        let v = B::float_add(
            B::float_mul_scalar(f32(v), scalar(step.beta_2)),
            B::float_mul_scalar(B::float_mul(g.clone(), g), scalar(1.0 - step.beta_2)),
        );
        let denominator = B::float_add_scalar(
            B::float_sqrt(B::float_div_scalar(v.clone(), scalar(bias_2))),
            scalar(step.epsilon),
        );
        let update = B::float_div(B::float_div_scalar(m.clone(), scalar(bias_1)), denominator);
        let decayed = B::float_mul_scalar(f32(param), scalar(1.0 - step.lr * step.weight_decay));
        let param = B::float_sub(decayed, B::float_mul_scalar(update, scalar(step.lr)));
        (B::float_cast(param, dtype), m, v)
    }

    /// The update of f32 master weights from a gradient multiplied by `clip` (`[1]`), their
    /// copy in `dtype`, and `squares` plus the gradient's `Σ g²` before clipping.
    #[allow(clippy::too_many_arguments)]
    pub fn master_update<B: Backend>(
        master: FloatTensor<B>,
        grad: FloatTensor<B>,
        m: FloatTensor<B>,
        v: FloatTensor<B>,
        step: AdamWStep,
        clip: FloatTensor<B>,
        dtype: FloatDType,
        squares: FloatTensor<B>,
    ) -> super::MasterUpdate<B> {
        let grad = B::float_cast(grad, FloatDType::F32);
        let n = grad.shape().num_elements();
        let flat = B::float_reshape(grad.clone(), [n].into());
        let squares = B::float_add(
            B::float_cast(squares, FloatDType::F32),
            B::float_sum(B::float_mul(flat.clone(), flat)),
        );
        let clip = B::float_expand(B::float_cast(clip, FloatDType::F32), grad.shape());
        let grad = B::float_mul(grad, clip);
        let (master, moment_1, moment_2) = update::<B>(B::float_cast(master, FloatDType::F32), grad, m, v, step);
        let param = B::float_cast(master.clone(), dtype);
        super::MasterUpdate {
            amax: amax::<B>(param.clone()),
            param,
            master,
            moment_1,
            moment_2,
            squares,
        }
    }

    /// The largest |x| (NaN ignored; 0 when empty), `[1]` f32.
    fn amax<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
        let device = x.device();
        let n = x.shape().num_elements();
        let zero = B::float_zeros([1].into(), &device, FloatDType::F32);
        if n == 0 {
            return zero;
        }
        let x = B::float_reshape(B::float_cast(x, FloatDType::F32), [n].into());
        let bools = burn::backend::get_device_settings::<B>(&device).bool_dtype;
        let nan = B::float_is_nan(x.clone(), bools);
        let magnitudes = B::float_mask_fill(B::float_abs(x), nan, Scalar::from(0.0f32));
        B::float_max(B::float_cat(vec![magnitudes, zero], 0))
    }
}

/// The new parameter and moments.
type Update<B> = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);
/// One step's new f32 master weights and moments, the parameter's copy of the master
/// weights in its own dtype, the running sum of squares with this gradient's added, and the
/// copy's amax.
#[derive(ExtensionType)]
pub struct MasterUpdate<B: Backend> {
    pub master: FloatTensor<B>,
    pub moment_1: FloatTensor<B>,
    pub moment_2: FloatTensor<B>,
    pub param: FloatTensor<B>,
    pub squares: FloatTensor<B>,
    pub amax: FloatTensor<B>,
}

impl AdamWOps for Flex {
    fn adamw_update(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        step: AdamWStep,
    ) -> Update<Self> {
        reference::update::<Flex>(param, grad, m, v, step)
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
        reference::master_update::<Flex>(master, grad, m, v, step, clip, dtype, squares)
    }
}

#[cfg(feature = "cuda")]
impl AdamWOps for burn::backend::Cube {
    fn adamw_update(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        step: AdamWStep,
    ) -> Update<Self> {
        crate::optim_kernels::adamw(param, grad, m, v, step)
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
        crate::optim_kernels::adamw_master(master, grad, m, v, step, clip, dtype, squares)
    }
}

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
/// multiplies the gradient; `squares` (f32) comes back with the gradient's `Σ g²` before
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
