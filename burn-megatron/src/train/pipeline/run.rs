//! A pipeline step of a Llama: one rank runs its [`Action`] list (`plan::pipeline::schedule`)
//! on its [`LlamaStage`], over the pipeline group's point-to-point calls, and returns its loss
//! and its parameters' gradients summed over the microbatches.
//!
//! A forward keeps its input (a new leaf, when it came from another stage) and its output; its
//! backward seeds the output with the received gradient (`recompute::seeded_backward`), and
//! sends its input's gradient on. The last stage's loss is divided by the microbatches, so the summed gradients
//! are the mean loss's. A chunk's router losses (MoE blocks) are differentiated with its output
//! where they arise and summed over the pipeline into the reported loss.
//!
//! Legend: `m` microbatches, `b` a microbatch's sequences, `s` sequence, `d` d_model.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use burn::tensor::Tensor;
use burn_megatron_dist::ProcessGroup;

use crate::error::LayerError;
use crate::layers::moe::Load;
use crate::models::llama::LlamaStage;
use crate::params::{param_grads, param_values};
use crate::plan::pipeline::schedule::{Action, Payload};
use crate::recompute::seeded_backward_with;
use crate::train::batch::TokenBatch;

/// What one rank's step produced.
pub struct StageStep {
    /// The mean loss over the microbatches, `[1]`, on the rank holding the last stage.
    pub loss: Option<Tensor<1>>,
    /// Each of this rank's parameters' gradient, flattened, summed over the microbatches, in
    /// traversal order (`None` for one no microbatch reached).
    pub grads: Vec<Option<Tensor<1>>>,
    /// The load of each of this rank's MoE blocks (in block order) summed over the
    /// microbatches, for [`LlamaStage::update_expert_bias`].
    pub loads: Vec<Load>,
    pub timing: StageTiming,
}

/// Whether a step times its forwards and backwards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timing {
    /// The device synchronized after each forward and backward, so each is timed whole: the
    /// measured bubble, at the cost of the host waiting for the device at every action.
    Synchronized,
    /// No synchronization: the host queues the next action's work while the device runs (and
    /// a send's peer may receive sooner); only the step's total is timed.
    Off,
}

/// Where one rank's step went: its forwards and backwards (under [`Timing::Synchronized`]),
/// and the step from its first action to its last.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StageTiming {
    pub busy_s: Option<f64>,
    pub total_s: f64,
}

impl StageTiming {
    /// The share of the step this rank spent outside its forwards and backwards: waiting on
    /// another stage, or sending and receiving (its measured bubble), if they were timed.
    pub fn idle(&self) -> Option<f64> {
        let busy = self.busy_s?;
        Some(match self.total_s > 0.0 {
            true => (1.0 - busy / self.total_s).max(0.0),
            false => 0.0,
        })
    }
}

/// What a forward left for its backward.
struct Kept {
    /// The input leaf (not on the first stage).
    input: Option<Tensor<3>>,
    /// The output, sent on; none on the last virtual stage.
    output: Option<Tensor<3>>,
    /// Differentiated beside the seeded output: the microbatch's loss share on the last
    /// virtual stage, the chunk's router losses (their share) elsewhere.
    scalar: Option<Tensor<1>>,
}

/// Runs `actions` (this pipeline rank's list) on `stage`: `batches[i]` is microbatch `i`,
/// `[b, s]` (this cp rank's chunks under context parallelism,
/// [`TokenBatch::context_shard`]); activations are [`LlamaStage::activation_shape`].
pub fn run_actions(
    stage: &LlamaStage,
    actions: &[Action],
    batches: &[TokenBatch],
    pp: &ProcessGroup,
    timing: Timing,
) -> Result<StageStep, LayerError> {
    let m = batches.len();
    let (rank, size) = (pp.group_rank(), pp.size());
    let stages = size * stage.chunks.len();
    let virtual_stage = |chunk: usize| chunk * size + rank;
    let mut inbox: HashMap<(Payload, usize, usize), Tensor<3>> = HashMap::new();
    let mut outbox: HashMap<(Payload, usize, usize), Tensor<3>> = HashMap::new();
    let mut kept: HashMap<(usize, usize), Kept> = HashMap::new();
    let mut grads: Vec<Option<Tensor<1>>> = Vec::new();
    let mut loss: Option<Tensor<1>> = None;
    let mut loads: BTreeMap<usize, Load> = BTreeMap::new();
    // The router losses of chunks that are not the last virtual stage: added to the reported
    // loss after the actions.
    let mut elsewhere: Option<Tensor<1>> = None;
    let device = batches.first().map(|b| b.ids.device());
    let begun = Instant::now();
    let mut busy = 0.0;
    // A compute action's time, the device synchronized at its end (kernels run asynchronously).
    let mut timed = |started: Instant| -> Result<(), LayerError> {
        if timing == Timing::Off {
            return Ok(());
        }
        if let Some(device) = &device {
            device.sync().map_err(|e| LayerError::Device {
                detail: format!("{e:?}"),
            })?;
        }
        busy += started.elapsed().as_secs_f64();
        Ok(())
    };
    for &action in actions {
        match action {
            Action::Recv {
                peer,
                payload,
                microbatch,
                stage: s,
            } => {
                let [b, len] = batches[microbatch].ids.dims();
                let device = batches[microbatch].ids.device();
                let like = Tensor::<3>::zeros(stage.activation_shape(b, len), (&device, stage_dtype(stage)));
                let x = pp.recv(like.without_autodiff(), peer)?;
                inbox.insert((payload, microbatch, s), x);
            }
            Action::Send {
                peer,
                payload,
                microbatch,
                stage: s,
            } => {
                let x = outbox.remove(&(payload, microbatch, s)).expect("sent after it is made");
                pp.send(x, peer)?;
            }
            Action::Forward { microbatch, chunk } => {
                let started = Instant::now();
                let s = virtual_stage(chunk);
                let TokenBatch {
                    ids,
                    targets,
                    documents,
                } = &batches[microbatch];
                let (input, x) = match s {
                    0 => (None, stage.embed(ids.clone())?),
                    _ => {
                        let received = inbox
                            .remove(&(Payload::Activation, microbatch, s - 1))
                            .expect("received before its forward");
                        let leaf = received.autodiff().require_grad();
                        (Some(leaf.clone()), leaf)
                    }
                };
                let (y, report) = stage.forward_chunk(chunk, x, documents.as_ref())?;
                for (block, load) in stage.moe_blocks(chunk).into_iter().zip(report.loads.iter().cloned()) {
                    let sum = match loads.remove(&block) {
                        Some(sum) => sum.add(&load),
                        None => load,
                    };
                    loads.insert(block, sum);
                }
                let routed = report.loss().map(|r| r.div_scalar(m as f64));
                let entry = match s + 1 == stages {
                    true => {
                        let share = stage.loss(y, targets.clone())?.div_scalar(m as f64);
                        let share = match routed {
                            Some(r) => {
                                let dtype = share.dtype();
                                share + r.cast(dtype)
                            }
                            None => share,
                        };
                        let value = share.clone().detach();
                        loss = Some(match loss.take() {
                            Some(sum) => sum + value,
                            None => value,
                        });
                        Kept {
                            input,
                            output: None,
                            scalar: Some(share),
                        }
                    }
                    false => {
                        let value = y.clone().detach().without_autodiff();
                        outbox.insert((Payload::Activation, microbatch, s), value);
                        if let Some(r) = &routed {
                            let r = r.clone().detach().without_autodiff().cast(burn::tensor::DType::F32);
                            elsewhere = Some(match elsewhere.take() {
                                Some(sum) => sum + r,
                                None => r,
                            });
                        }
                        Kept {
                            input,
                            output: Some(y),
                            scalar: routed,
                        }
                    }
                };
                kept.insert((microbatch, chunk), entry);
                timed(started)?;
            }
            Action::Backward { microbatch, chunk } => {
                let started = Instant::now();
                let s = virtual_stage(chunk);
                let Kept { input, output, scalar } = kept.remove(&(microbatch, chunk)).expect("a forward before");
                let backward = match output {
                    None => scalar.expect("the last stage keeps its loss share").backward(),
                    Some(y) => {
                        let gradient = inbox
                            .remove(&(Payload::Gradient, microbatch, s + 1))
                            .expect("received before its backward");
                        let [b, len, d] = y.dims();
                        let rows = |x: Tensor<3>| x.reshape([b * len, d]);
                        seeded_backward_with(rows(y), rows(gradient.autodiff()), scalar)
                    }
                };
                let step = param_grads(stage, &backward);
                grads = match grads.is_empty() {
                    true => step,
                    false => grads
                        .into_iter()
                        .zip(step)
                        .map(|(sum, g)| match (sum, g) {
                            (Some(a), Some(b)) => Some(a + b),
                            (a, b) => a.or(b),
                        })
                        .collect(),
                };
                if let Some(input) = input {
                    let gradient = input.grad(&backward).expect("the input reached the output");
                    outbox.insert((Payload::Gradient, microbatch, s), gradient.without_autodiff());
                }
                timed(started)?;
            }
        }
    }
    pp.flush()?;
    if stage.has_experts()
        && let Some(device) = &device
    {
        // Every rank takes part, whether or not its stages hold MoE blocks.
        let zero = || Tensor::<1>::zeros([1], (device, burn::tensor::DType::F32)).without_autodiff();
        let routed = pp.all_reduce(elsewhere.unwrap_or_else(zero), burn_megatron_dist::ReduceOp::Sum)?;
        loss = loss.map(|l| {
            let dtype = l.dtype();
            l + routed.cast(dtype)
        });
    }
    let timing = StageTiming {
        busy_s: (timing == Timing::Synchronized).then_some(busy),
        total_s: begun.elapsed().as_secs_f64(),
    };
    Ok(StageStep {
        loss,
        grads,
        loads: loads.into_values().collect(),
        timing,
    })
}

/// The dtype activations travel in: the stage's parameters'.
fn stage_dtype(stage: &LlamaStage) -> burn::tensor::DType {
    param_values(stage)
        .first()
        .map(|p| p.value.dtype())
        .unwrap_or(burn::tensor::DType::F32)
}
