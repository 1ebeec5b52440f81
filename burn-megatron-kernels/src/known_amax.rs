//! Amaxes taken by the kernel that wrote a tensor, for the FP8 cast that quantizes it next: the
//! cast then skips its own amax pass, one read of the tensor (SwiGLU's output and its inputs'
//! gradients, RMSNorm's outputs, RoPE's input gradients: 0.57 GB a llama-1b layer). A kernel asked
//! to folds the largest magnitude of what it writes into the amax as it writes it ([`record`]),
//! or leaves one maximum a block or row ([`record_maxima`]); [`take`] hands that amax (the
//! maxima's, by one small launch) to the cast of the same tensor, once. Anything else gets
//! nothing and takes its own amax, so a miss costs only the pass it would have run anyway.
//!
//! A noted tensor is held with its amax until it is taken: the memory cannot become another
//! tensor's, and nothing writes it in place (Burn writes in place only into a tensor nobody else
//! holds), so a hit is always the amax of the values the cast reads. A thread keeps the last
//! [`KEPT`] notes; older ones are dropped (a tensor that went elsewhere, e.g. gathered over tp
//! before its product).

use std::cell::RefCell;
use std::collections::VecDeque;

use burn_cubecl::tensor::CubeTensor;

/// Notes a thread keeps: a kernel notes one or two tensors (SwiGLU's input gradients), each
/// taken by the next product.
const KEPT: usize = 4;

/// What a kernel left for a tensor's amax, f32 on the tensor's stream.
enum Noted {
    /// The amax, `[1]`.
    Amax(CubeTensor),
    /// Maxima (each ≥ 0, NaN ignored) whose largest is the amax, `[n]`.
    Maxima(CubeTensor),
}

thread_local! {
    static NOTES: RefCell<VecDeque<(CubeTensor, Noted)>> = const { RefCell::new(VecDeque::new()) };
}

fn note(tensor: &CubeTensor, noted: Noted) {
    NOTES.with_borrow_mut(|notes| {
        if notes.len() == KEPT {
            notes.pop_front();
        }
        notes.push_back((tensor.clone(), noted));
    });
}

/// Notes `amax` (`[1]`, f32, on `tensor`'s stream) as the largest magnitude of the compact
/// `tensor`, for the cast that quantizes it.
pub(crate) fn record(tensor: &CubeTensor, amax: CubeTensor) {
    note(tensor, Noted::Amax(amax));
}

/// Notes `maxima` (`[n]`, f32, each ≥ 0) as maxima over parts of the compact `tensor` that
/// cover it: its amax is their largest.
pub(crate) fn record_maxima(tensor: &CubeTensor, maxima: CubeTensor) {
    note(tensor, Noted::Maxima(maxima));
}

/// The amax noted for `tensor` (the same memory, offset, element count and dtype, both
/// compact: a reshape of the noted tensor is the same tensor), removed from the notes.
pub(crate) fn take(tensor: &CubeTensor) -> Option<CubeTensor> {
    let noted = NOTES.with_borrow_mut(|notes| {
        let at = notes.iter().position(|(noted, _)| same_values(noted, tensor))?;
        notes.remove(at).map(|(_, noted)| noted)
    })?;
    Some(match noted {
        Noted::Amax(amax) => amax,
        Noted::Maxima(maxima) => crate::amax_kernels::tensor_amax(maxima),
    })
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
    use crate::elementwise::is_compact;
    std::ptr::eq(a.handle.memory.descriptor(), b.handle.memory.descriptor())
        && a.handle.offset_start == b.handle.offset_start
        && a.meta.num_elements() == b.meta.num_elements()
        && a.dtype == b.dtype
        && is_compact(a)
        && is_compact(b)
}
