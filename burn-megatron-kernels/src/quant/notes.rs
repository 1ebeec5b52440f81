//! Which results of a fused kernel leave with their amax taken as the kernel writes them, for
//! the FP8 tensorwise cast that quantizes each next (on CUDA; the cast then skips its own pass
//! over the tensor). Only CUDA's kernels take them; the values are the same either way. A
//! parameter's amax comes from the optimizer's update ([`keep_parameter_amax`]).

use burn::tensor::Tensor;

/// The amaxes a kernel (SwiGLU, RMSNorm, RoPE) notes: of its output (the next product's input)
/// and of its inputs' gradients (the previous products' output gradients).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoteAmaxes {
    pub output: bool,
    pub input_grads: bool,
}

impl NoteAmaxes {
    /// The output's amax where `note`, no gradient's.
    pub fn output(note: bool) -> Self {
        Self {
            output: note,
            input_grads: false,
        }
    }
}

/// Keeps `amax` (`[1]`, f32: [`crate::adamw::MasterStep::amax`]) as the largest magnitude of
/// `value`, the new value of parameter `index` of `owner` (an optimizer), for the FP8 casts that
/// read the parameter until its next value replaces this one (on CUDA; elsewhere nothing is kept).
pub fn keep_parameter_amax<const D: usize>(owner: u64, index: usize, value: &Tensor<D>, amax: Tensor<1>) {
    #[cfg(feature = "cuda")]
    {
        use burn::backend::Cube;
        let cuda = |t: Tensor<D>| t.inner().try_into_primitive::<Cube>().ok();
        if let (Some(value), Some(amax)) = (cuda(value.clone()), amax.inner().try_into_primitive::<Cube>().ok()) {
            crate::cuda::known_amax::keep_parameter((owner, index), &value, amax);
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (owner, index, value, amax);
}

/// Drops what [`keep_parameter_amax`] kept for `owner`'s parameters.
pub fn forget_parameter_amaxes(owner: u64) {
    #[cfg(feature = "cuda")]
    crate::cuda::known_amax::forget_parameters(owner);
    #[cfg(not(feature = "cuda"))]
    let _ = owner;
}
