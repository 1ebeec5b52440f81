//! Which results of a fused kernel leave with their amax taken as the kernel writes them, for
//! the FP8 tensorwise cast that quantizes each next (on CUDA; the cast then skips its own pass
//! over the tensor). Only CUDA's kernels take them; the values are the same either way.

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
