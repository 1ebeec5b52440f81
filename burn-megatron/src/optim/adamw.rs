//! AdamW with fp32 master weights, data-parallel gradient averaging in buckets and, optionally,
//! the distributed optimizer of ZeRO stage 1: master weights and moments split over the
//! data-parallel group, gradients reduce-scattered and updated shards all-gathered.
//!
//! Legend: `n` a parameter's element count on this rank, `dp` the data-parallel group size.

use burn::config::Config;
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{DType, FloatDType, Tensor};
use burn_megatron_dist::{CommError, ProcessGroups, ReduceOp};
use burn_megatron_kernels::adamw::{AdamWStep, adamw_master_step};
use burn_megatron_kernels::quant::notes::AmaxNotes;

use super::buckets::{BucketConfig, GradGroup, GradReducer, Reduction, pad};
use super::finite::{CLASSES, FiniteCheck, GradSquares, NonFiniteGradient};
use crate::optim::shared::StageCopies;
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
    /// Check every gradient shard for a NaN or an infinity before the update, agreed over all
    /// ranks: a step with one leaves every weight and state as it was ([`StepReport::check`]).
    #[config(default = true)]
    pub check_finite: bool,
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
#[derive(Clone, Debug, Default)]
pub struct StepReport {
    /// The global gradient norm before clipping, `[1]` on the device; none without
    /// parameters. A step never reads it to the host: clipping's factor is computed and
    /// applied on the device, so the host issues the next step while this one runs.
    pub norm: Option<Tensor<1>>,
    /// Whether every gradient was finite (else the step updated nothing), with the optimizer's
    /// `check_finite`; read it with [`DistributedAdamW::skipped`].
    pub check: Option<FiniteCheck>,
}

impl StepReport {
    /// The global gradient norm before clipping (0 without parameters). Reading it waits for
    /// the step's gradients.
    pub fn grad_norm(&self) -> f64 {
        self.norm.clone().map_or(0.0, |norm| norm.into_scalar::<f64>())
    }
}

/// AdamW over a model whose groups are `groups`; see the module docs.
pub struct DistributedAdamW {
    config: DistributedAdamWConfig,
    groups: ProcessGroups,
    infos: Vec<ParamInfo>,
    /// The group each parameter's gradient is averaged over (and its state sharded over,
    /// under ZeRO-1).
    grad_groups: Vec<GradGroup>,
    /// The parameters other pipeline stages hold too (tied embeddings), found at the first
    /// step ([`stage_copies`](Self::stage_copies)): the norm counts them on the first stage
    /// holding them only.
    copies: Option<StageCopies>,
    states: Vec<State>,
    step: u64,
    /// Where it keeps the amaxes of the values it writes, for the model's FP8 casts
    /// ([`keeping_amaxes`](DistributedAdamW::keeping_amaxes)); none: kept nowhere.
    notes: Option<AmaxNotes>,
}

impl DistributedAdamWConfig {
    pub fn init(&self, groups: &ProcessGroups) -> DistributedAdamW {
        DistributedAdamW {
            config: self.clone(),
            groups: groups.clone(),
            infos: Vec::new(),
            grad_groups: Vec::new(),
            copies: None,
            states: Vec::new(),
            step: 0,
            notes: None,
        }
    }
}

/// Each parameter's element count, in traversal order, and the dtype of the first.
fn numels_and_dtype<M: Module>(model: &M) -> (Vec<usize>, DType) {
    let values = param_values(model);
    let dtype = values.first().map(|p| p.value.dtype()).unwrap_or(DType::F32);
    (values.iter().map(|p| p.value.dims()[0]).collect(), dtype)
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
    /// The same optimizer keeping the amax of each value it writes in `notes` (its model's,
    /// `Llama::amax_notes`), where the model's FP8 tensorwise casts of the weights take them
    /// instead of a pass of their own over each weight.
    pub fn keeping_amaxes(mut self, notes: AmaxNotes) -> Self {
        self.notes = Some(notes);
        self
    }

    /// Checks gradients for a NaN or an infinity before each update, or not
    /// ([`DistributedAdamWConfig::check_finite`]).
    pub fn set_check_finite(&mut self, check: bool) {
        self.config.check_finite = check;
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Every parameter's state, whole over the data-parallel group (gathered under ZeRO-1),
    /// in traversal order; `numels` are the parameters' element counts on this rank. Empty
    /// before the first step.
    pub fn export_state(&self, numels: &[usize]) -> Result<Vec<ParamState>, CommError> {
        self.states
            .iter()
            .zip(numels)
            .enumerate()
            .map(|(i, (s, &n))| {
                let whole = |x: &Tensor<1>| -> Result<Tensor<1>, CommError> {
                    let x = match self.sharded_over(i) {
                        Some(group) => group.all_gather(x.clone(), 0)?,
                        None => x.clone(),
                    };
                    Ok(x.narrow(0, 0, n))
                };
                Ok(ParamState {
                    master: whole(&s.master)?,
                    m: whole(&s.m)?,
                    v: whole(&s.v)?,
                })
            })
            .collect()
    }

    /// Restores the state of `model`'s parameters exported by
    /// [`export_state`](Self::export_state) (possibly at another layout, resharded by the
    /// caller) after `steps` steps.
    pub fn import_state<M: Module>(&mut self, model: &M, states: Vec<ParamState>, steps: u64) {
        self.know(model);
        self.states = states
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                let group = self.sharded_over(i);
                State {
                    master: shard_of(s.master, group),
                    m: shard_of(s.m, group),
                    v: shard_of(s.v, group),
                }
            })
            .collect();
        self.step = steps;
    }

    /// Reads `model`'s parameters' infos and groups, once.
    fn know<M: Module>(&mut self, model: &M) {
        if self.infos.is_empty() {
            self.infos = param_infos(model);
            self.grad_groups = self
                .infos
                .iter()
                .map(|info| GradGroup::of(info, &self.groups))
                .collect();
        }
    }

    /// Which of `model`'s parameters other pipeline stages hold too (tied embeddings), found
    /// at the first call (a collective over pp: every pp rank calls it).
    pub fn stage_copies<M: Module>(&mut self, model: &M) -> Result<&StageCopies, CommError> {
        self.know(model);
        if self.copies.is_none() {
            let device = param_values(model).first().map(|p| p.value.device());
            self.copies = Some(match device {
                Some(device) => StageCopies::find(&self.infos, &self.groups.pp, &device)?,
                None => StageCopies::alone(&self.infos),
            });
        }
        Ok(self.copies.as_ref().expect("found above"))
    }

    /// The group parameter `index`'s state is split over under ZeRO-1, if it is split.
    fn sharded_over(&self, index: usize) -> Option<&burn_megatron_dist::ProcessGroup> {
        let group = &self.grad_groups[index].group;
        (self.config.zero1 && group.size() > 1).then_some(group)
    }

    /// Optimizer-state bytes held on this rank (fp32 master weights and two moments).
    pub fn state_bytes(&self) -> usize {
        self.states.iter().map(|s| 3 * 4 * s.master.dims()[0]).sum()
    }

    /// What the gradients of `model` go through before [`step_reduced`](Self::step_reduced):
    /// whole or sharded over each parameter's group, bucketed as configured. Gradients handed
    /// to the reducer during backward (through taps) overlap their reduction with the rest of
    /// backward.
    pub fn reducer<M: Module>(&self, model: &M) -> GradReducer {
        let (numels, dtype) = numels_and_dtype(model);
        let reduction = match self.config.zero1 {
            true => Reduction::ReduceScatter,
            false => Reduction::AllReduce,
        };
        let params = numels
            .into_iter()
            .zip(GradGroup::for_model(model, &self.groups))
            .collect();
        GradReducer::new(params, dtype.size(), reduction, &self.config.buckets)
    }

    /// One update of `model` from `grads`; averages gradients over the data-parallel group.
    pub fn step<M: Module>(&mut self, lr: f64, model: M, grads: GradientsParams) -> Result<(M, StepReport), CommError> {
        let mut reducer = self.reducer(&model);
        for (index, grad) in take_grads(&model, grads).into_iter().enumerate().rev() {
            // A parameter without a gradient counts as zeros (`GradReducer::finish`).
            if let Some(grad) = grad {
                reducer.add(index, grad)?;
            }
        }
        let like = param_values(&model)
            .first()
            .map(|p| (p.value.device(), p.value.dtype()));
        let reduced = match like {
            Some((device, dtype)) => reducer.finish(&device, dtype)?,
            None => Vec::new(),
        };
        self.step_reduced(lr, model, reduced)
    }

    /// One update of `model` from gradients already reduced by [`reducer`](Self::reducer):
    /// one flat tensor a parameter in any float dtype, in traversal order (this rank's shard
    /// under ZeRO-1). One kernel a parameter updates the fp32 master weights and moments and
    /// writes the parameter's new value in its dtype, taking its amax as it writes: kept with the
    /// value for the FP8 casts of the next forward pass, which then skip their own pass over the
    /// weight (in [`keeping_amaxes`](Self::keeping_amaxes)'s notes; a ZeRO-1 shard's reduced over its
    /// group). A parameter
    /// gradients do not train ([`ParamInfo::trainable`]) keeps its value, and its state is not
    /// stepped.
    pub fn step_reduced<M: Module>(
        &mut self,
        lr: f64,
        model: M,
        shards: Vec<Tensor<1>>,
    ) -> Result<(M, StepReport), CommError> {
        self.stage_copies(&model)?;
        let dtypes: Vec<DType> = param_values(&model).iter().map(|p| p.value.dtype()).collect();
        let Some(device) = shards.first().map(|s| s.device()) else {
            // No parameters here: nothing to update, and no norm.
            self.step += 1;
            return Ok((model, StepReport::default()));
        };
        // Clipping and the check need the squares before the update: a pass of their own over
        // the gradients. Without either, the update kernels add each gradient's squares as they
        // read it.
        let squares = (self.config.max_grad_norm.is_some() || self.config.check_finite)
            .then(|| GradSquares::of(&shards, &device, |i| self.class(i)));
        let clipping = match (self.config.max_grad_norm, &squares) {
            (Some(max), Some(squares)) => {
                let local = [0, 1].map(|class| squares.class_sum(class));
                let norm = self.global_norm(Tensor::cat(local.to_vec(), 0))?;
                // `max / (norm + 1e-6)` where the norm passes `max`, else 1 (a NaN norm too), as
                // a device tensor the update kernel reads.
                let factor = norm.clone().add_scalar(1e-6).recip().mul_scalar(max);
                let clip = factor.ones_like().mask_where(norm.clone().greater_elem(max), factor);
                Some((norm, clip))
            }
            _ => None,
        };
        let (norm, clip) = match clipping {
            Some((norm, clip)) => (Some(norm), clip),
            None => (None, Tensor::ones([1], (&device, DType::F32))),
        };
        let check = match (self.config.check_finite, squares) {
            (true, Some(squares)) => Some(FiniteCheck::new(squares, &self.groups.world)?),
            _ => None,
        };
        // A gradient not finite anywhere: a negative factor, and the kernels keep every state.
        let clip = match &check {
            Some(check) => clip * check.keep(),
            None => clip,
        };
        self.step += 1;
        if self.states.is_empty() {
            self.states = self.first_states(&model);
        }
        let c = &self.config;
        let step = AdamWStep {
            lr: lr as f32,
            beta_1: c.beta_1 as f32,
            beta_2: c.beta_2 as f32,
            epsilon: c.epsilon as f32,
            weight_decay: c.weight_decay as f32,
            time: self.step as u32,
            grad_scale: 1.0,
        };
        // The squares the updates add up: dense, experts, and those the norm does not count.
        let mut squares = [(); CLASSES].map(|_| Tensor::<1>::zeros([1], (&device, DType::F32)));
        // The new values in the parameters' dtype, gathered back whole under ZeRO-1, and their
        // amaxes; none for a parameter gradients do not train (every rank skips the same ones).
        let mut values = Vec::with_capacity(self.states.len());
        let mut amaxes = Vec::with_capacity(self.states.len());
        // Each state is handed to its update whole, held nowhere else, so the kernel updates it
        // in place (a checkpoint still holding a copy makes it write anew).
        let states = std::mem::take(&mut self.states);
        for (i, ((grad, dtype), state)) in shards.into_iter().zip(dtypes).zip(states).enumerate() {
            if !self.infos[i].trainable {
                self.states.push(state);
                values.push(None);
                amaxes.push(None);
                continue;
            }
            let sum = self.class(i);
            let new = adamw_master_step(
                state.master,
                grad,
                state.m,
                state.v,
                step,
                clip.clone(),
                FloatDType::from(dtype),
                squares[sum].clone(),
            );
            self.states.push(State {
                master: new.master,
                m: new.moment_1,
                v: new.moment_2,
            });
            squares[sum] = new.squares;
            values.push(Some(new.param));
            amaxes.push(Some(new.amax));
        }
        // Every state has stepped before anything can fail: the whole values under ZeRO-1.
        for (i, value) in values.iter_mut().enumerate() {
            if let (Some(group), Some(shard)) = (self.sharded_over(i), value.as_ref()) {
                *value = Some(group.all_gather(shard.clone(), 0)?);
            }
        }
        self.reduce_sharded_amaxes(&mut amaxes)?;
        let [dense, experts, _] = squares;
        let norm = match norm {
            Some(norm) => norm,
            None => self.global_norm(Tensor::cat(vec![dense, experts], 0))?,
        };
        let (infos, notes) = (&self.infos, &self.notes);
        let model = map_params(model, &mut |index, old, dims| match infos[index].trainable {
            true => {
                let n: usize = dims.iter().product();
                let value = values[index].clone().expect("a trained parameter's new value");
                let value = value.narrow(0, 0, n).to_device(&old.device());
                let amax = amaxes[index].clone().expect("a trained parameter's amax");
                if let Some(notes) = notes {
                    notes.keep_parameter(index, &value, amax);
                }
                value
            }
            // Not trained by gradients (a router's selection bias): as it was.
            false => old,
        });
        super::release_freed_pages(&device);
        Ok((
            model,
            StepReport {
                norm: Some(norm),
                check,
            },
        ))
    }

    /// The check of `shards` (gradients reduced for [`step_reduced`](Self::step_reduced)) that
    /// `step_reduced` makes, for an update of another optimizer's: see [`FiniteCheck`]. A
    /// collective over every rank.
    pub fn check_finite<M: Module>(
        &mut self,
        model: &M,
        shards: &[Tensor<1>],
    ) -> Result<Option<FiniteCheck>, CommError> {
        self.stage_copies(model)?;
        let Some(device) = shards.first().map(|s| s.device()) else {
            return Ok(None);
        };
        let squares = GradSquares::of(shards, &device, |i| self.class(i));
        FiniteCheck::new(squares, &self.groups.world).map(Some)
    }

    /// Whether the step `check` came from updated nothing, a gradient on some rank not being
    /// finite; if so, which parameter on which rank, and (`own`: the step was this optimizer's)
    /// the step count goes back, as the states did not move. Reads the check (waiting for the
    /// step's gradients); a collective over every rank where a gradient was not finite.
    pub fn skipped(&mut self, check: &FiniteCheck, own: bool) -> Result<Option<NonFiniteGradient>, CommError> {
        if check.finite() {
            return Ok(None);
        }
        if own {
            self.step -= 1;
        }
        check.locate(&self.infos, &self.groups.world).map(Some)
    }

    /// Makes each ZeRO-1 shard's amax its whole parameter's: the largest over the shard's group,
    /// one all-reduce for the dense parameters' and one for the experts'.
    fn reduce_sharded_amaxes(&self, amaxes: &mut [Option<Tensor<1>>]) -> Result<(), CommError> {
        for expert in [false, true] {
            let sharded: Vec<usize> = (0..amaxes.len())
                .filter(|&i| amaxes[i].is_some() && self.infos[i].expert == expert && self.sharded_over(i).is_some())
                .collect();
            let Some(group) = sharded.first().and_then(|&i| self.sharded_over(i)) else {
                continue;
            };
            let local = Tensor::cat(sharded.iter().filter_map(|&i| amaxes[i].clone()).collect(), 0);
            let whole = group.all_reduce(local, ReduceOp::Max)?;
            for (k, &i) in sharded.iter().enumerate() {
                amaxes[i] = Some(whole.clone().narrow(0, k, 1));
            }
        }
        Ok(())
    }

    /// Parameter `index`'s class in [`GradSquares`]: 0 dense and 1 experts where the norm counts
    /// it here, 2 elsewhere.
    fn class(&self, index: usize) -> usize {
        match self.norm_class(index) {
            Some(false) => 0,
            Some(true) => 1,
            None => CLASSES - 1,
        }
    }

    /// Where parameter `index`'s squares count in the global norm: `Some(expert)` (dense or
    /// expert), or none where another rank or stage counts them (tp-replicated parameters count
    /// on tp rank 0 only; a parameter several pipeline stages hold, on the first) or gradients do
    /// not train it.
    fn norm_class(&self, index: usize) -> Option<bool> {
        let info = &self.infos[index];
        let copies = self.copies.as_ref().expect("found by step_reduced");
        let counted =
            info.trainable && (info.tp_split || self.groups.tp.group_rank() == 0) && copies.counted_here(index);
        counted.then_some(info.expert)
    }

    /// √(Σ g²) over every rank from this rank's `[dense, experts]` sums of squares, each
    /// parameter counted once ([`norm_class`](Self::norm_class)): dp shards are disjoint only
    /// under ZeRO-1; experts differ over etp and ep, and a pipeline's stages over pp. `[1]` on
    /// the device.
    fn global_norm(&self, local: Tensor<1>) -> Result<Tensor<1>, CommError> {
        let (tp, groups) = (&self.groups.tp, &self.groups);
        let has_experts = (0..self.infos.len()).any(|i| self.norm_class(i) == Some(true));
        let dp = groups.grad_sync();
        let zero1 = self.config.zero1 && dp.size() > 1;
        let etp_is_tp = groups.etp.size() == tp.size();
        let mut total = match etp_is_tp {
            // Both reduce over tp, in one call: [dense, experts].
            true => tp.all_reduce(local, ReduceOp::Sum)?,
            false => Tensor::cat(
                vec![
                    tp.all_reduce(local.clone().narrow(0, 0, 1), ReduceOp::Sum)?,
                    groups.etp.all_reduce(local.narrow(0, 1, 1), ReduceOp::Sum)?,
                ],
                0,
            ),
        };
        if zero1 && etp_is_tp {
            // Disjoint shards of everything over dp × cp (experts: over ep-dp, and ep).
            total = dp.all_reduce(total, ReduceOp::Sum)?;
        } else {
            let mut dense = total.clone().narrow(0, 0, 1);
            let mut experts = total.narrow(0, 1, 1);
            if zero1 {
                dense = dp.all_reduce(dense, ReduceOp::Sum)?;
                experts = groups.ep_dp.all_reduce(experts, ReduceOp::Sum)?;
            }
            if has_experts && groups.ep.size() > 1 {
                experts = groups.ep.all_reduce(experts, ReduceOp::Sum)?;
            }
            total = Tensor::cat(vec![dense, experts], 0);
        }
        // Pipeline stages hold different parameters: the norm is over all of them.
        if self.groups.pp.size() > 1 {
            total = self.groups.pp.all_reduce(total, ReduceOp::Sum)?;
        }
        Ok(total.sum().sqrt())
    }

    /// fp32 master copies of the current values (this rank's shard under ZeRO-1) and zero
    /// moments.
    fn first_states<M: Module>(&self, model: &M) -> Vec<State> {
        param_values(model)
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                let master = shard_of(p.value.cast(DType::F32), self.sharded_over(i));
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

/// This rank's part of `x` padded to a multiple of `group`'s size, or `x` whole without a group.
fn shard_of(x: Tensor<1>, group: Option<&burn_megatron_dist::ProcessGroup>) -> Tensor<1> {
    match group {
        Some(group) => {
            let padded = pad(x, group.size());
            let part = padded.dims()[0] / group.size();
            padded.narrow(0, group.group_rank() * part, part)
        }
        None => x,
    }
}

#[cfg(test)]
mod tests {
    use burn::module::{Module, Param};
    use burn::tensor::{Device, Tensor};
    use burn_megatron_kernels::adamw::reference;

    use super::*;

    #[derive(Module, Debug)]
    struct One {
        w: Param<Tensor<1>>,
    }

    /// The step's norm and, with `max`, its update: ε = 1 so that the update depends on the
    /// gradient's scale (with a small ε Adam's first step is `lr · sign(g)` whatever the scale).
    fn step(max: Option<f64>, w: &[f32], g: &[f32]) -> (f64, Vec<f32>) {
        let device = Device::flex();
        let model = One {
            w: Param::from_tensor(Tensor::from_floats(w, &device)),
        };
        let mut grads = GradientsParams::new();
        grads.register(model.w.id, Tensor::<1>::from_floats(g, &device));
        let mut optim = DistributedAdamWConfig::new()
            .with_epsilon(1.0)
            .with_max_grad_norm(max)
            .init(&ProcessGroups::single());
        let (model, report) = optim.step(0.1, model, grads).unwrap();
        (report.grad_norm(), model.w.val().into_data().try_to_vec().unwrap())
    }

    /// The formula's update of `w` from the gradient `g · scale`, on the host's twin.
    fn expected(w: &[f32], g: &[f32], scale: f32) -> Vec<f32> {
        let device = Device::flex();
        let t = |x: &[f32]| Tensor::<1>::from_floats(x, &device).into_dispatch();
        let grad = Tensor::<1>::from_floats(g, &device).mul_scalar(scale).into_dispatch();
        let zeros = vec![0.0; w.len()];
        let c = DistributedAdamWConfig::new();
        let step = AdamWStep {
            lr: 0.1,
            beta_1: c.beta_1 as f32,
            beta_2: c.beta_2 as f32,
            epsilon: 1.0,
            weight_decay: c.weight_decay as f32,
            time: 1,
            grad_scale: 1.0,
        };
        let (p, _, _) = reference::update::<burn::backend::Dispatch>(t(w), grad, t(&zeros), t(&zeros), step);
        Tensor::<1>::from_dispatch(p).into_data().try_to_vec().unwrap()
    }

    /// Clipping by the global norm scales the gradient by `max / (norm + 1e-6)` where the norm
    /// passes `max` and leaves it alone where it does not; the report's norm is `√Σg²`.
    #[test]
    fn clipping_scales_by_the_norm_on_the_device() {
        let (w, g) = ([1.0, -2.0, 0.5], [3.0, 0.0, -4.0]); // ‖g‖ = 5
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(a, b)| (a - b).abs() <= 1e-6);
        for (max, scale) in [
            (None, 1.0),
            (Some(10.0), 1.0),
            (Some(5.0), 1.0),
            (Some(2.0), 2.0 / (5.0 + 1e-6)),
        ] {
            let (norm, got) = step(max, &w, &g);
            // √25 in f32: exact.
            assert_eq!(norm, 5.0, "max {max:?}");
            let want = expected(&w, &g, scale as f32);
            // The same f32 formula on the same values, the factor applied in another order:
            // an ulp or two of values of order 1.
            assert!(close(&got, &want), "max {max:?}: {got:?} vs {want:?}");
        }
        // A clipped step differs from an unclipped one (ε = 1 makes the update scale-aware).
        assert!(!close(&step(Some(2.0), &w, &g).1, &step(None, &w, &g).1));
    }
}
