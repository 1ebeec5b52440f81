//! Data parallelism: gradients averaged over the data-parallel group after the backward pass.
//!
//! This is the plain, correct form: one all-reduce per parameter, after backward. Bucketing
//! and overlapping the reduction with backward belong to the training issue.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

use crate::comm::{ProcessGroup, ReduceOp};
use crate::error::CommError;

/// Averages every parameter gradient of `model` over `dp`.
pub fn average_gradients<M: Module>(grads: GradientsParams, model: &M, dp: &ProcessGroup) -> Result<GradientsParams, CommError> {
    if dp.size() == 1 {
        return Ok(grads);
    }
    let mut visitor = Average { grads, dp, error: None };
    model.visit(&mut visitor);
    match visitor.error {
        Some(error) => Err(error),
        None => Ok(visitor.grads),
    }
}

struct Average<'a> {
    grads: GradientsParams,
    dp: &'a ProcessGroup,
    error: Option<CommError>,
}

impl ModuleVisitor for Average<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.error.is_some() {
            return;
        }
        // Every rank holds the same parameters in the same order, so the collectives pair up.
        if let Some(grad) = self.grads.remove::<D>(param.id) {
            match self.dp.all_reduce(grad, ReduceOp::Avg) {
                Ok(avg) => self.grads.register(param.id, avg),
                Err(error) => self.error = Some(error),
            }
        }
    }
}
