//! Gradient reduction overlapped with backward: the model's parameters go behind taps
//! ([`tap_grad`]) that hand each gradient to a [`GradReducer`] the moment autodiff has it whole,
//! so a bucket is reduced as soon as its last gradient exists, while backward goes on.
//!
//! ```text
//! let overlap = Overlap::new(optim.reducer(&model));
//! let loss = overlap.tap(model.clone(), groups.grad_sync()).forward_loss(ids, targets)?;
//! loss.backward();                                   // buckets reduced on the way
//! let reduced = overlap.finish(&device, dtype)?;
//! model = optim.step_reduced(lr, model, reduced)?.0;
//! ```

use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{DType, Device, Tensor};
use burn_megatron_dist::mappings::{GradTap, tap_grad};
use burn_megatron_dist::{CommError, ProcessGroup};

use super::buckets::GradReducer;

/// One step's overlapped reduction.
pub struct Overlap {
    reducer: Arc<Mutex<GradReducer>>,
    /// A collective that failed inside backward, where it cannot be returned.
    errors: Arc<Mutex<Vec<CommError>>>,
}

impl Overlap {
    pub fn new(reducer: GradReducer) -> Self {
        Self {
            reducer: Arc::new(Mutex::new(reducer)),
            errors: Arc::default(),
        }
    }

    /// `model` with every parameter behind a tap into this reduction (the same parameters,
    /// ids and values): run forward and backward on it. `dp` is the group reduced over.
    pub fn tap<M: Module>(&self, model: M, dp: &ProcessGroup) -> M {
        struct Tap<'a> {
            index: usize,
            dp: &'a ProcessGroup,
            overlap: &'a Overlap,
        }
        impl ModuleMapper for Tap<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let index = self.index;
                self.index += 1;
                let (reducer, errors) = (self.overlap.reducer.clone(), self.overlap.errors.clone());
                let tap = GradTap::new(move |grad| {
                    if let Err(error) = reducer.lock().expect("reducer lock").add(index, grad) {
                        errors.lock().expect("errors lock").push(error);
                    }
                });
                param.map(|value| tap_grad(value, self.dp, tap))
            }
        }
        model.map(&mut Tap {
            index: 0,
            dp,
            overlap: self,
        })
    }

    /// Hands parameter `index`'s flattened gradient to the reducer directly (gradients taken
    /// after backward instead of through taps).
    pub fn add(&self, index: usize, grad: Tensor<1>) -> Result<(), CommError> {
        self.reducer.lock().expect("reducer lock").add(index, grad)
    }

    /// Holds parameter `index`'s gradient of an earlier microbatch of the step, to join the
    /// gradient its tap brings ([`GradReducer::hold`]).
    pub fn hold(&self, index: usize, grad: Tensor<1>) {
        self.reducer.lock().expect("reducer lock").hold(index, grad)
    }

    /// Once backward is done: the first error a tap met, or every parameter's reduced
    /// gradient (see [`GradReducer::finish`]).
    pub fn finish(self, device: &Device, dtype: DType) -> Result<Vec<Tensor<1>>, CommError> {
        if let Some(error) = self.errors.lock().expect("errors lock").drain(..).next() {
            return Err(error);
        }
        self.reducer.lock().expect("reducer lock").finish(device, dtype)
    }
}
