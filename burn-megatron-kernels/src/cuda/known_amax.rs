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
//!
//! A parameter's amax is kept apart ([`keep_parameter`]): the optimizer's update takes it as it
//! writes the new value, and every cast of that value reads it (the forward's, again at each
//! microbatch or validation pass), so it is not taken away. It stays until the same parameter's
//! next value replaces it, or its owner forgets it ([`forget_parameters`]); a note whose value
//! nobody else holds any more (a model dropped without its optimizer) is dropped as the notes
//! grow.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};

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

/// A parameter's place: its owner (an optimizer) and its index there.
pub(crate) type ParameterKey = (u64, usize);

/// The parameters' notes: each value with its amax (`[1]`, f32), and how many notes the map
/// held after it last dropped those nobody else holds.
#[derive(Default)]
struct Parameters {
    notes: HashMap<ParameterKey, (CubeTensor, CubeTensor)>,
    swept: usize,
}

thread_local! {
    static NOTES: RefCell<VecDeque<(CubeTensor, Noted)>> = const { RefCell::new(VecDeque::new()) };
    static PARAMETERS: RefCell<Parameters> = RefCell::new(Parameters::default());
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

/// Keeps `amax` (`[1]`, f32, on `value`'s stream) as the largest magnitude of parameter `key`'s
/// new, compact `value`, in place of its last one.
pub(crate) fn keep_parameter(key: ParameterKey, value: &CubeTensor, amax: CubeTensor) {
    PARAMETERS.with_borrow_mut(|parameters| {
        parameters.notes.insert(key, (value.clone(), amax));
        // Held by the map alone (`can_mut`: no other handle to the memory): the parameter is gone.
        if parameters.notes.len() > 2 * parameters.swept.max(32) {
            parameters.notes.retain(|_, (value, _)| !value.can_mut());
            parameters.swept = parameters.notes.len();
        }
    });
}

/// Drops the notes of `owner`'s parameters.
pub(crate) fn forget_parameters(owner: u64) {
    PARAMETERS.with_borrow_mut(|parameters| parameters.notes.retain(|&(o, _), _| o != owner));
}

/// The amax noted for `tensor` (the same memory, offset, element count and dtype, both
/// compact: a reshape of the noted tensor is the same tensor): a kernel's, removed from the
/// notes, or a parameter's, kept for its next cast.
pub(crate) fn take(tensor: &CubeTensor) -> Option<CubeTensor> {
    let noted = NOTES.with_borrow_mut(|notes| {
        let at = notes.iter().position(|(noted, _)| same_values(noted, tensor))?;
        notes.remove(at).map(|(_, noted)| noted)
    });
    let Some(noted) = noted else {
        return PARAMETERS.with_borrow(|parameters| {
            let mut kept = parameters.notes.values();
            kept.find(|(value, _)| same_values(value, tensor))
                .map(|(_, amax)| amax.clone())
        });
    };
    Some(match noted {
        Noted::Amax(amax) => amax,
        Noted::Maxima(maxima) => crate::cuda::reduce::tensor_amax(maxima),
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
    use crate::cuda::launch::is_compact;
    std::ptr::eq(a.handle.memory.descriptor(), b.handle.memory.descriptor())
        && a.handle.offset_start == b.handle.offset_start
        && a.meta.num_elements() == b.meta.num_elements()
        && a.dtype == b.dtype
        && is_compact(a)
        && is_compact(b)
}
