//! AdamW with fp32 master weights, data-parallel gradient averaging in buckets and, optionally,
//! the distributed optimizer of ZeRO stage 1: master weights and moments split over the
//! data-parallel group, gradients reduce-scattered and updated shards all-gathered.
//!
//! Legend: `n` a parameter's element count on this rank, `dp` the data-parallel group size.

use burn::config::Config;
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};
use burn_megatron_dist::{CommError, ProcessGroups, ReduceOp};
use burn_megatron_kernels::adamw::{AdamWStep, adamw_step};

use super::buckets::{BucketConfig, GradReducer, Reduction, pad};
use crate::params::{ParamInfo, map_params, param_infos, param_values, take_grads};

/// Configuration of a [`DistributedAdamW`]. The defaults are PyTorch's and Megatron's (Burn's
/// AdamW defaults differ: ε 1e-5, weight decay 1e-4).
#[derive(Config, Debug)]
pub struct DistributedAdamWConfig {
    #[config(default = 0.9)]
    pub beta_1: f64,
    #[config(default = 0.999)]
    pub beta_2: f64,
    #[config(default = 1e-8)]
    pub epsilon: f64,
    #[config(default = 0.01)]
    pub weight_decay: f64,
    /// Split master weights and moments over the data-parallel group (ZeRO-1).
    #[config(default = false)]
    pub zero1: bool,
    /// Clip gradients to this global norm (over every rank, each parameter counted once).
    #[config(default = "None")]
    pub max_grad_norm: Option<f64>,
    /// How gradients are bucketed for the data-parallel reduction.
    #[config(default = "BucketConfig::new()")]
    pub buckets: BucketConfig,
}

/// Checks a learning rate before any step: finite and above 0.
pub fn check_lr(lr: f64) -> Result<f64, crate::error::ConfigError> {
    match lr.is_finite() && lr > 0.0 {
        true => Ok(lr),
        false => Err(crate::error::ConfigError::LearningRate { lr }),
    }
}

/// One parameter's optimizer state on this rank: fp32, the whole parameter or its dp shard.
struct State {
    master: Tensor<1>,
    m: Tensor<1>,
    v: Tensor<1>,
}

/// What a step reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
}

/// AdamW over a model whose groups are `groups`; see the module docs.
pub struct DistributedAdamW {
    config: DistributedAdamWConfig,
    groups: ProcessGroups,
    infos: Vec<ParamInfo>,
    states: Vec<State>,
    step: u64,
}

impl DistributedAdamWConfig {
    pub fn init(&self, groups: &ProcessGroups) -> DistributedAdamW {
        DistributedAdamW {
            config: self.clone(),
            groups: groups.clone(),
            infos: Vec::new(),
            states: Vec::new(),
            step: 0,
        }
    }
}

/// Every parameter's gradient, flattened, in traversal order (zeros for an unused parameter).
fn flat_grads<M: Module>(model: &M, grads: GradientsParams) -> Vec<(Tensor<1>, DType)> {
    take_grads(model, grads)
        .into_iter()
        .zip(param_values(model))
        .map(|(grad, p)| (grad.unwrap_or_else(|| p.value.zeros_like()), p.value.dtype()))
        .collect()
}

/// Each parameter's element count, in traversal order, and the dtype of the first.
fn numels_and_dtype<M: Module>(model: &M) -> (Vec<usize>, DType) {
    let values = param_values(model);
    let dtype = values.first().map(|p| p.value.dtype()).unwrap_or(DType::F32);
    (values.iter().map(|p| p.value.dims()[0]).collect(), dtype)
}

/// `Σ x²` of a flat tensor, `[1]`. Rows of up to 4096 elements are summed first, then their
/// sums: Burn's CUDA reduction of one long vector in a single pass is slow (llama-1b's gradients
/// took 41 ms that way, `docs/perf/llama.md`), while its row reduction runs a row a cube.
fn sum_of_squares(x: Tensor<1>) -> Tensor<1> {
    let n = x.dims()[0];
    // The largest power of two up to 4096 that divides n.
    let row = 1 << n.trailing_zeros().min(12);
    match row >= 64 {
        true => x.reshape([n / row, row]).square().sum_dim(1).sum(),
        false => x.square().sum(),
    }
}

/// One parameter's whole optimizer state on this rank's tensor-parallel shard, flattened:
/// what a checkpoint stores, whatever the data-parallel split.
#[derive(Clone, Debug)]
pub struct ParamState {
    pub master: Tensor<1>,
    pub m: Tensor<1>,
    pub v: Tensor<1>,
}

impl DistributedAdamW {
    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Every parameter's state, whole over the data-parallel group (gathered under ZeRO-1),
    /// in traversal order; `numels` are the parameters' element counts on this rank. Empty
    /// before the first step.
    pub fn export_state(&self, numels: &[usize]) -> Result<Vec<ParamState>, CommError> {
        let dp = self.groups.grad_sync();
        let zero1 = self.config.zero1 && dp.size() > 1;
        let whole = |x: &Tensor<1>, n: usize| -> Result<Tensor<1>, CommError> {
            let x = if zero1 { dp.all_gather(x.clone(), 0)? } else { x.clone() };
            Ok(x.narrow(0, 0, n))
        };
        self.states
            .iter()
            .zip(numels)
            .map(|(s, &n)| {
                Ok(ParamState {
                    master: whole(&s.master, n)?,
                    m: whole(&s.m, n)?,
                    v: whole(&s.v, n)?,
                })
            })
            .collect()
    }

    /// Restores the state exported by [`export_state`](Self::export_state) (possibly at another
    /// layout, resharded by the caller) after `steps` steps.
    pub fn import_state(&mut self, states: Vec<ParamState>, steps: u64) {
        let dp = self.groups.grad_sync();
        let zero1 = self.config.zero1 && dp.size() > 1;
        let mine = |x: Tensor<1>| match zero1 {
            true => {
                let padded = pad(x, dp.size());
                let part = padded.dims()[0] / dp.size();
                padded.narrow(0, dp.group_rank() * part, part)
            }
            false => x,
        };
        self.states = states
            .into_iter()
            .map(|s| State {
                master: mine(s.master),
                m: mine(s.m),
                v: mine(s.v),
            })
            .collect();
        self.step = steps;
    }

    /// Optimizer-state bytes held on this rank (fp32 master weights and two moments).
    pub fn state_bytes(&self) -> usize {
        self.states.iter().map(|s| 3 * 4 * s.master.dims()[0]).sum()
    }

    /// What the gradients of `model` go through before [`step_reduced`](Self::step_reduced):
    /// whole or sharded over dp, bucketed as configured. Gradients handed to the reducer
    /// during backward (through taps) overlap their reduction with the rest of backward.
    pub fn reducer<M: Module>(&self, model: &M) -> GradReducer {
        let (numels, dtype) = numels_and_dtype(model);
        let reduction = match self.config.zero1 && self.groups.grad_sync().size() > 1 {
            true => Reduction::ReduceScatter,
            false => Reduction::AllReduce,
        };
        GradReducer::new(
            self.groups.grad_sync(),
            numels,
            dtype.size(),
            reduction,
            &self.config.buckets,
        )
    }

    /// One update of `model` from `grads`; averages gradients over the data-parallel group.
    pub fn step<M: Module>(&mut self, lr: f64, model: M, grads: GradientsParams) -> Result<(M, StepReport), CommError> {
        let mut reducer = self.reducer(&model);
        let flat = flat_grads(&model, grads);
        let like = flat.first().map(|(g, dtype)| (g.device(), *dtype));
        for (index, (grad, _)) in flat.into_iter().enumerate().rev() {
            reducer.add(index, grad)?;
        }
        let reduced = match like {
            Some((device, dtype)) => reducer.finish(&device, dtype)?,
            None => Vec::new(),
        };
        self.step_reduced(lr, model, reduced)
    }

    /// One update of `model` from gradients already reduced by [`reducer`](Self::reducer):
    /// one fp32 tensor a parameter, in traversal order (this rank's shard under ZeRO-1).
    pub fn step_reduced<M: Module>(
        &mut self,
        lr: f64,
        model: M,
        shards: Vec<Tensor<1>>,
    ) -> Result<(M, StepReport), CommError> {
        let dp = self.groups.grad_sync();
        let zero1 = self.config.zero1 && dp.size() > 1;
        if self.infos.is_empty() {
            self.infos = param_infos(&model);
        }
        let dtypes: Vec<DType> = param_values(&model).iter().map(|p| p.value.dtype()).collect();
        let grad_norm = self.global_norm(&shards, zero1)?;
        let scale = match self.config.max_grad_norm {
            Some(max) if grad_norm > max => max / (grad_norm + 1e-6),
            _ => 1.0,
        };
        self.step += 1;
        if self.states.is_empty() {
            self.states = self.first_states(&model, zero1);
        }
        let c = &self.config;
        let step = AdamWStep {
            lr: lr as f32,
            beta_1: c.beta_1 as f32,
            beta_2: c.beta_2 as f32,
            epsilon: c.epsilon as f32,
            weight_decay: c.weight_decay as f32,
            time: self.step as u32,
            grad_scale: scale as f32,
        };
        for (state, grad) in self.states.iter_mut().zip(shards) {
            // One fused kernel a parameter on CUDA (burn_megatron_kernels::adamw).
            (state.master, state.m, state.v) =
                adamw_step(state.master.clone(), grad, state.m.clone(), state.v.clone(), step);
        }
        // The new values, gathered back whole in the parameters' dtype.
        let mut values = Vec::with_capacity(self.states.len());
        for (state, dtype) in self.states.iter().zip(dtypes) {
            let value = state.master.clone().cast(dtype);
            values.push(if zero1 { dp.all_gather(value, 0)? } else { value });
        }
        let model = map_params(model, &mut |index, old, dims| {
            let n: usize = dims.iter().product();
            values[index].clone().narrow(0, 0, n).to_device(&old.device())
        });
        Ok((model, StepReport { grad_norm }))
    }

    /// √(Σ g²) over every rank, each parameter counted once: tp-replicated parameters count on
    /// tp rank 0 only, and dp shards are disjoint only under ZeRO-1.
    fn global_norm(&self, shards: &[Tensor<1>], zero1: bool) -> Result<f64, CommError> {
        let tp = &self.groups.tp;
        let device = shards.first().map(|s| s.device());
        let Some(device) = device else { return Ok(0.0) };
        let counted: Vec<Tensor<1>> = shards
            .iter()
            .zip(&self.infos)
            .filter(|(_, info)| info.tp_split || tp.group_rank() == 0)
            .map(|(shard, _)| sum_of_squares(shard.clone()))
            .collect();
        let local = match counted.is_empty() {
            true => Tensor::<1>::zeros([1], (&device, DType::F32)),
            false => Tensor::cat(counted, 0).sum(),
        };
        let mut total = tp.all_reduce(local, ReduceOp::Sum)?;
        if zero1 {
            total = self.groups.grad_sync().all_reduce(total, ReduceOp::Sum)?;
        }
        Ok(total.into_scalar::<f64>().sqrt())
    }

    /// fp32 master copies of the current values (this rank's dp shard under ZeRO-1) and zero
    /// moments.
    fn first_states<M: Module>(&self, model: &M, zero1: bool) -> Vec<State> {
        let group = self.groups.grad_sync();
        param_values(model)
            .into_iter()
            .map(|p| {
                let flat = p.value.cast(DType::F32);
                let master = match zero1 {
                    true => {
                        let padded = pad(flat, group.size());
                        let part = padded.dims()[0] / group.size();
                        padded.narrow(0, group.group_rank() * part, part)
                    }
                    false => flat,
                };
                let zeros = master.zeros_like();
                State {
                    m: zeros.clone(),
                    v: zeros,
                    master,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::Device;

    /// The two-pass sum of squares is the one-pass sum, for lengths that split into rows of
    /// 4096, of fewer, and of none.
    #[test]
    fn sum_of_squares_in_rows_is_the_plain_sum() {
        for n in [3 * 4096, 64 * 7, 100, 1] {
            let x = crate::init::normal([n], 5, 1.0, &Device::flex());
            let (ours, plain) = (super::sum_of_squares(x.clone()), x.square().sum());
            let (ours, plain) = (ours.into_scalar::<f64>(), plain.into_scalar::<f64>());
            // The same f32 squares summed in another order: a few ulps of the sum.
            assert!((ours - plain).abs() <= 1e-5 * plain, "n = {n}: {ours} against {plain}");
        }
    }
}
