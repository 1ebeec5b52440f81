//! The plain tensor-op twin, on any backend's primitives: the CPU path and the kernel's oracle.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Scalar, TensorMetadata};
use burn::tensor::FloatDType;

use super::step::AdamWStep;

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

/// The update of f32 master weights from a gradient multiplied by `clip` (`[1]`; negative, no
/// update), their copy in `dtype`, and `squares` plus the gradient's `Σ g²` before clipping.
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
    let grad = B::float_mul(grad, clip.clone());
    let (master, m) = (
        B::float_cast(master, FloatDType::F32),
        B::float_cast(m, FloatDType::F32),
    );
    let v = B::float_cast(v, FloatDType::F32);
    let new = update::<B>(master.clone(), grad, m.clone(), v.clone(), step);
    // A negative factor (a gradient somewhere not finite) skips the step: each state as it was.
    let bools = burn::backend::get_device_settings::<B>(&clip.device()).bool_dtype;
    let skip = B::float_lower_elem(clip, Scalar::from(0.0f32), bools);
    let keep = |old: FloatTensor<B>, new: FloatTensor<B>| B::float_mask_where(new, skip.clone(), old);
    let (master, moment_1, moment_2) = (keep(master, new.0), keep(m, new.1), keep(v, new.2));
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
