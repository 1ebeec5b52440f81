//! What an [`AmaxNotes`](crate::quant::notes::AmaxNotes) keeps on CUDA: the amaxes taken by the
//! kernel that wrote a tensor, for the FP8 cast that quantizes it next. The cast then skips its
//! own amax pass, one read of the tensor (SwiGLU's output and its inputs' gradients, RMSNorm's
//! outputs, RoPE's input gradients: 0.57 GB a llama-1b layer). A kernel asked to folds the
//! largest magnitude of what it writes into the amax as it writes it ([`Notes::record`]), or
//! leaves one maximum a block or row ([`Notes::record_maxima`]); [`Notes::take`] hands that amax
//! (the maxima's, by one small launch) to the cast of the same tensor, once.
//!
//! A noted tensor is held with its amax until it is taken: the memory cannot become another
//! tensor's, and nothing writes it in place (Burn writes in place only into a tensor nobody else
//! holds), so a hit is always the amax of the values the cast reads. The notes keep the last
//! [`KEPT`]; older ones are dropped (a tensor that went elsewhere, e.g. gathered over tp before
//! its product).
//!
//! A parameter's amax is kept apart ([`Notes::keep_parameter`]): the optimizer's update takes it
//! as it writes the new value, and every cast of that value reads it (the forward's, again at
//! each microbatch or validation pass), so it is not taken away. It stays until the same
//! parameter's next value replaces it; a note whose value nobody else holds any more (a model
//! dropped) is dropped as the notes grow.

use std::collections::{HashMap, VecDeque};

use burn_cubecl::tensor::CubeTensor;

/// Notes kept: a kernel notes one or two tensors (SwiGLU's input gradients), each taken by the
/// next product.
const KEPT: usize = 4;

/// What a kernel left for a tensor's amax, f32 on the tensor's stream.
enum Noted {
    /// The amax, `[1]`.
    Amax(CubeTensor),
    /// Maxima (each ≥ 0, NaN ignored) whose largest is the amax, `[n]`.
    Maxima(CubeTensor),
}

/// The kernels' notes and the parameters'.
#[derive(Default)]
pub(crate) struct Notes {
    kernels: VecDeque<(CubeTensor, Noted)>,
    /// Each parameter's value with its amax (`[1]`, f32), by its index in the optimizer.
    parameters: HashMap<usize, (CubeTensor, CubeTensor)>,
    /// How many parameter notes the map held after it last dropped those nobody else holds.
    swept: usize,
}

impl Notes {
    fn note(&mut self, tensor: &CubeTensor, noted: Noted) {
        if self.kernels.len() == KEPT {
            self.kernels.pop_front();
        }
        self.kernels.push_back((tensor.clone(), noted));
    }

    /// Notes `amax` (`[1]`, f32, on `tensor`'s stream) as the largest magnitude of the compact
    /// `tensor`, for the cast that quantizes it.
    pub(crate) fn record(&mut self, tensor: &CubeTensor, amax: CubeTensor) {
        self.note(tensor, Noted::Amax(amax));
    }

    /// Notes `maxima` (`[n]`, f32, each ≥ 0) as maxima over parts of the compact `tensor` that
    /// cover it: its amax is their largest.
    pub(crate) fn record_maxima(&mut self, tensor: &CubeTensor, maxima: CubeTensor) {
        self.note(tensor, Noted::Maxima(maxima));
    }

    /// Keeps `amax` (`[1]`, f32, on `value`'s stream) as the largest magnitude of parameter
    /// `index`'s new, compact `value`, in place of its last one.
    pub(crate) fn keep_parameter(&mut self, index: usize, value: &CubeTensor, amax: CubeTensor) {
        self.parameters.insert(index, (value.clone(), amax));
        // Held by the map alone (`can_mut`: no other handle to the memory): the parameter is gone.
        if self.parameters.len() > 2 * self.swept.max(32) {
            self.parameters.retain(|_, (value, _)| !value.can_mut());
            self.swept = self.parameters.len();
        }
    }

    /// The amax noted for `tensor` (the same memory, offset, element count and dtype, both
    /// compact: a reshape of the noted tensor is the same tensor): a kernel's, removed from the
    /// notes, or a parameter's, kept for its next cast.
    pub(crate) fn take(&mut self, tensor: &CubeTensor) -> Option<CubeTensor> {
        let at = self.kernels.iter().position(|(noted, _)| same_values(noted, tensor));
        let Some((_, noted)) = at.and_then(|at| self.kernels.remove(at)) else {
            let mut kept = self.parameters.values();
            return kept
                .find(|(value, _)| same_values(value, tensor))
                .map(|(_, amax)| amax.clone());
        };
        Some(match noted {
            Noted::Amax(amax) => amax,
            Noted::Maxima(maxima) => crate::cuda::reduce::tensor_amax(maxima),
        })
    }
}

/// `tensor`'s memory seen as one compact row (its values in memory order): the note of a dense
/// tensor in another order (RoPE's output in its input's layout), which the product reads
/// reshaped after its dims are swapped back.
pub(crate) fn flat(tensor: &CubeTensor) -> CubeTensor {
    CubeTensor::new_contiguous(
        tensor.client.clone(),
        tensor.device.clone(),
        burn::tensor::Shape::new([tensor.meta.num_elements()]),
        tensor.handle.clone(),
        tensor.dtype,
    )
}

/// Whether the compact `a` and `b` hold the same values in the same order.
fn same_values(a: &CubeTensor, b: &CubeTensor) -> bool {
    use crate::cuda::launch::is_compact;
    std::ptr::eq(a.handle.memory.descriptor(), b.handle.memory.descriptor())
        && a.handle.offset_start == b.handle.offset_start
        && a.meta.num_elements() == b.meta.num_elements()
        && a.dtype == b.dtype
        && is_compact(a)
        && is_compact(b)
}
