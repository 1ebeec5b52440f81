//! The tensor-parallel group as the ranks a quantized product's tensor-level amaxes are reduced
//! over (`burn_megatron_kernels::quant::product::AmaxGroup`): each rank holds a piece of a
//! sharded weight, of a sequence-parallel activation or of a gradient, and scales it as one
//! device holding the whole tensor would (Megatron's amax reduction over tp).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use burn::tensor::Tensor;
use burn_megatron_dist::{CommError, ProcessGroup, ReduceOp};
use burn_megatron_kernels::quant::product::{Amax, AmaxGroup, Operand, ScaleAmax, SharedInput, WeightCodes};

use super::delayed::{DelayedAmax, DelayedState};
use burn_megatron_kernels::{Gemm, linear_over};

/// One layer call's amax reductions over tp: a failure in the forward pass is kept for
/// [`finish_forward`](Self::finish_forward) to return; one in the backward pass (which cannot
/// return an error) panics, as the backward of a collective does.
#[derive(Debug)]
pub struct TensorParallelAmax {
    tp: ProcessGroup,
    error: Mutex<Option<CommError>>,
    forward_done: AtomicBool,
}

impl TensorParallelAmax {
    /// The reductions of a layer over `tp`; `None` at tp = 1, where each amax is already whole.
    pub fn over(tp: &ProcessGroup) -> Option<Arc<Self>> {
        (tp.size() > 1).then(|| {
            Arc::new(Self {
                tp: tp.clone(),
                error: Mutex::new(None),
                forward_done: AtomicBool::new(false),
            })
        })
    }

    /// The first error of the forward pass's reductions, if any; later reductions (backward)
    /// panic on an error.
    pub fn finish_forward(&self) -> Result<(), CommError> {
        self.forward_done.store(true, Ordering::SeqCst);
        match self.error.lock().expect("the amax error").take() {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }
}

impl AmaxGroup for TensorParallelAmax {
    fn max(&self, amax: Tensor<1>, _operand: Operand) -> ScaleAmax {
        ScaleAmax::current(match self.tp.all_reduce(amax.clone(), ReduceOp::Max) {
            Ok(reduced) => reduced,
            Err(error) if self.forward_done.load(Ordering::SeqCst) => {
                panic!("backward's amax reduction over tp failed: {error}")
            }
            Err(error) => {
                self.error.lock().expect("the amax error").get_or_insert(error);
                amax
            }
        })
    }
}

/// What a quantized product reuses of earlier quantizations: its input's, shared with the
/// layer call's other products of the same input ([`SharedInput`]), and its weight's, kept
/// across the calls that read the same weight ([`WeightCodes`]: the microbatches of a step).
#[derive(Clone, Debug, Default)]
pub struct Reuse {
    pub input: Option<Arc<SharedInput>>,
    pub weight: Option<Arc<WeightCodes>>,
}

/// A product's amax group with what it reuses ([`Reuse`]): the amaxes reduced over tp (none at
/// tp = 1) as [`TensorParallelAmax`] does.
#[derive(Debug)]
struct Sharing {
    tp: Option<Arc<TensorParallelAmax>>,
    reuse: Reuse,
}

impl AmaxGroup for Sharing {
    fn max(&self, amax: Tensor<1>, operand: Operand) -> ScaleAmax {
        match &self.tp {
            Some(tp) => tp.max(amax, operand),
            None => ScaleAmax::current(amax),
        }
    }

    fn shared_input(&self) -> Option<&SharedInput> {
        self.reuse.input.as_deref()
    }

    fn weight_codes(&self) -> Option<&WeightCodes> {
        self.reuse.weight.as_deref()
    }
}

/// `x · weight + bias` of a layer whose weight is sharded over `tp`, a quantized product's
/// tensor-level amaxes reduced over tp (forward here, backward when the gradients run); under
/// delayed scaling each scaled by the layer's history instead (`delayed`). It reuses what
/// `reuse` holds: its quantization of `x` shared with the other products given it, its weight's
/// kept for later calls on the same weight (current scaling and blocks only: under delayed
/// scaling each call scales by the layer's history and records its amaxes).
///
/// # Shapes
/// `[.., k]`, `[k, n]`, `[n]` → `[.., n]`
pub fn sharded_linear<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    gemm: Gemm,
    delayed: Option<DelayedState>,
    reuse: Reuse,
    tp: &ProcessGroup,
) -> Result<Tensor<D>, CommError> {
    let amax = match gemm {
        Gemm::Quantized(_) => TensorParallelAmax::over(tp),
        _ => None,
    };
    let reuses = reuse.input.is_some() || reuse.weight.is_some();
    let group: Amax = match delayed {
        Some(state) => Some(Arc::new(DelayedAmax {
            state,
            tp: amax.clone(),
            input: reuse.input.clone(),
        })),
        None if reuses && matches!(gemm, Gemm::Quantized(_)) => Some(Arc::new(Sharing {
            tp: amax.clone(),
            reuse,
        })),
        None => amax.clone().map(|group| group as Arc<dyn AmaxGroup>),
    };
    let y = linear_over(x, weight, bias, gemm, group);
    match amax {
        Some(amax) => amax.finish_forward().map(|()| y),
        None => Ok(y),
    }
}
