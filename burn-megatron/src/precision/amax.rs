//! The tensor-parallel group as the ranks a quantized product's tensor-level amaxes are reduced
//! over (`burn_megatron_kernels::quant::product::AmaxGroup`): each rank holds a piece of a
//! sharded weight, of a sequence-parallel activation or of a gradient, and scales it as one
//! device holding the whole tensor would (Megatron's amax reduction over tp).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use burn::tensor::Tensor;
use burn_megatron_dist::{CommError, ProcessGroup, ReduceOp};
use burn_megatron_kernels::quant::product::{AmaxGroup, Operand, ScaleAmax};

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
