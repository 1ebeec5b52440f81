//! `bench`'s timed steps: the recipe's optimizer, warm-up, the timed loop and the profile.

use std::time::Instant;

use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Int, Tensor};
use burn_megatron::models::llama::Llama;
use burn_megatron::optim::{DistributedAdamW, DistributedAdamWConfig, FusedAdamWConfig, Overlap};
use burn_megatron::precision::{MasterWeights, PrecisionPolicy};
use burn_megatron::train::{Stepped, TokenBatch, TrainModel, Trainer};
use burn_megatron_dist::RankContext;

use crate::memory::Mark;

/// The peers' learning rate (`docs/performance.md`).
const LR: f64 = 1e-4;

/// What one rank measured.
pub struct Run {
    /// Mean seconds a step over the timed steps.
    pub step_s: f64,
    /// The last timed step's loss (averaged over the data-parallel ranks).
    pub loss: f64,
    /// `"forward_ms": …` fields of the PROFILE line, when asked for.
    pub profile: Option<String>,
    /// The pools once the model is built, after the first step, and at the start of one more
    /// step and after each of its pieces.
    pub memory: Vec<Mark>,
}

/// The optimizer a precision policy's master weights call for.
enum Optimizer {
    /// fp32 master weights and moments; gradients averaged over `grad_sync` bucket by bucket
    /// during backward, waited for at the step.
    Master(Box<DistributedAdamW>),
    /// The parameters updated in their own dtype (fp32 moments): no master weights, one rank.
    Pure(ModuleOptimizer),
}

/// The pieces of one step (of the recipe's optimizer), each ended by a device synchronization
/// when `timed`: the profile's decomposition of what [`burn_megatron::train::Trainer`] runs
/// whole in the timed steps.
#[derive(Default)]
struct Pieces {
    forward: f64,
    backward: f64,
    reduce_wait: f64,
    optimizer: f64,
    /// With `mark`, the pools after each piece.
    mark: bool,
    marks: Vec<Mark>,
}

struct Profiler<'a> {
    ctx: &'a RankContext,
    optimizer: Optimizer,
    ids: Tensor<2, Int>,
    targets: Tensor<2, Int>,
}

impl Profiler<'_> {
    /// One training step; with `timed`, each piece synchronized and added to `pieces`.
    fn step(&mut self, model: Llama, pieces: Option<&mut Pieces>) -> (Llama, Tensor<1>) {
        let ctx = self.ctx;
        let sync = || ctx.device.sync().expect("sync");
        let mut clock = Instant::now();
        let mut lap = |pieces: &mut Option<&mut Pieces>, label, field: fn(&mut Pieces) -> &mut f64| {
            if let Some(p) = pieces.as_deref_mut() {
                sync();
                *field(p) += clock.elapsed().as_secs_f64();
                if p.mark {
                    p.marks.push(Mark::take(label, &ctx.device));
                }
                clock = Instant::now();
            }
        };
        let mut pieces = pieces;
        match &mut self.optimizer {
            Optimizer::Master(optim) => {
                let group = ctx.groups.grad_sync();
                let overlap = Overlap::new(optim.reducer(&model));
                let tapped = overlap.tap(model.clone(), group);
                let loss = tapped
                    .forward_loss(self.ids.clone(), self.targets.clone())
                    .expect("forward");
                lap(&mut pieces, "after forward", |p| &mut p.forward);
                let reported = group
                    .all_reduce(loss.clone().detach(), burn_megatron_dist::ReduceOp::Avg)
                    .expect("loss");
                drop(loss.backward());
                lap(&mut pieces, "after backward", |p| &mut p.backward);
                let reduced = overlap
                    .finish(&ctx.device, burn::tensor::DType::BF16)
                    .expect("reduction");
                lap(&mut pieces, "after reduce wait", |p| &mut p.reduce_wait);
                let model = optim.step_reduced(LR, model, reduced).expect("step").0;
                // Delayed FP8 scaling's histories move with the step, as in training.
                let model = model.after_step(&[], &ctx.groups).expect("after the step");
                lap(&mut pieces, "after optimizer", |p| &mut p.optimizer);
                (model, reported)
            }
            Optimizer::Pure(optim) => {
                let loss = model
                    .forward_loss(self.ids.clone(), self.targets.clone())
                    .expect("forward");
                lap(&mut pieces, "after forward", |p| &mut p.forward);
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                lap(&mut pieces, "after backward", |p| &mut p.backward);
                let model = optim.step(LR, model, grads);
                burn_megatron::optim::release_freed_pages(&ctx.device);
                lap(&mut pieces, "after optimizer", |p| &mut p.optimizer);
                (model, loss.detach())
            }
        }
    }

    /// The data-parallel reduction of one step's gradients on its own (no backward to hide
    /// behind), synchronized: what `reduce_wait` would be with no overlap at all.
    fn reduction_alone(&mut self, model: &Llama) -> f64 {
        let Optimizer::Master(optim) = &self.optimizer else {
            return 0.0;
        };
        let loss = model
            .forward_loss(self.ids.clone(), self.targets.clone())
            .expect("forward");
        let grads = burn_megatron::params::take_grads(model, GradientsParams::from_grads(loss.backward(), model));
        let mut reducer = optim.reducer(model);
        self.ctx.device.sync().expect("sync");
        let start = Instant::now();
        // A parameter gradients do not train (delayed FP8's amax histories) has none and is in
        // no bucket, as in the timed steps.
        for (index, grad) in grads.into_iter().enumerate().rev() {
            if let Some(grad) = grad {
                reducer.add(index, grad).expect("reduce");
            }
        }
        let reduced = reducer
            .finish(&self.ctx.device, burn::tensor::DType::BF16)
            .expect("reduce");
        self.ctx.device.sync().expect("sync");
        drop(reduced);
        start.elapsed().as_secs_f64()
    }
}

/// Stops the benchmark, naming `when`, once CubeCL has logged a launch it could not run
/// (`burn_megatron_kernels::failures`).
pub fn check_failures(when: &str, device: &Device) {
    if let Err(failure) = burn_megatron_kernels::failures::check(device) {
        panic!("by {when}: {failure}");
    }
}

/// Stops the benchmark when the first step's loss is not what a freshly initialized model gives
/// on uniform random ids, about `ln vocab` (its logits are near zero): such a step did not run
/// as written. Past the device's memory, CubeCL 0.11 has been seen to leave a step unrun with no
/// error at any read, the loss reading 0 (`docs/reliability.md`), and the timed steps then
/// "run" many times faster than the device can. The failed launches' log lines
/// ([`check_failures`]) stop the bench first where CubeCL logs them.
pub fn check_first_loss(loss: f32, vocab: usize) {
    let expected = (vocab as f32).ln();
    // Initialized at std 0.02, the logits are a few hundredths: the loss is within a few
    // percent of ln V (10.8 against 10.4 for llama-1b). Half of ln V either way leaves room for
    // any preset and still catches a step that left its loss unwritten.
    if !(loss.is_finite() && (loss - expected).abs() <= 0.5 * expected) {
        panic!(
            "the first step's loss is {loss}, where a fresh model on uniform ids gives about ln {vocab} = {expected:.2}: \
             the step did not run as written (past the device's memory, a read may return what no launch wrote; \
             docs/reliability.md)"
        );
    }
}

/// Warm-up, timed steps and (with `profile`) the synchronized pieces of as many more steps.
pub fn run(
    ctx: &RankContext,
    model: Llama,
    (ids, targets): (Tensor<2, Int>, Tensor<2, Int>),
    policy: PrecisionPolicy,
    optim: &DistributedAdamWConfig,
    (warmup, steps): (usize, usize),
    profile: bool,
) -> Run {
    // The pools once the model is built, and after the first step (kernels compiled and tuned).
    let mut memory = vec![Mark::take("model built", &ctx.device)];
    let vocab = model.embedding.vocab_size;
    let batch = TokenBatch::new(ids.clone(), targets.clone());
    let timing = Timing {
        ctx,
        warmup,
        steps,
        vocab,
    };
    let (step_s, loss, mut model, optimizer) = match policy.master {
        // The library's training step, as `train` runs it.
        MasterWeights::F32 => {
            let trainer = Trainer::new(model, optim, &ctx.groups, &ctx.device);
            // Both closures step the one trainer, one after the other.
            let trainer = std::cell::RefCell::new(trainer);
            let step = || {
                let stepped = trainer.borrow_mut().step(LR, batch.clone());
                stepped.unwrap_or_else(|e| panic!("{e}"))
            };
            let read = |stepped: Stepped, when: &str| {
                let values = trainer.borrow_mut().read(stepped);
                values.unwrap_or_else(|e| panic!("by {when}: {e}")).loss
            };
            let (step_s, loss) = timing.run(&mut memory, step, read);
            let (model, optim) = trainer.into_inner().into_parts();
            (step_s, loss, model, Optimizer::Master(Box::new(optim)))
        }
        MasterWeights::None => {
            let mut profiler = Profiler {
                ctx,
                optimizer: Optimizer::Pure(FusedAdamWConfig::new().init()),
                ids: ids.clone(),
                targets: targets.clone(),
            };
            let mut model = Some(model);
            let step = || {
                let (next, loss) = profiler.step(model.take().expect("the model"), None);
                model = Some(next);
                loss
            };
            let read = |loss: Tensor<1>, when: &str| {
                let loss = loss.into_scalar::<f64>();
                check_failures(when, &ctx.device);
                loss
            };
            let (step_s, loss) = timing.run(&mut memory, step, read);
            (step_s, loss, model.expect("the model"), profiler.optimizer)
        }
    };
    let mut trainer = Profiler {
        ctx,
        optimizer,
        ids,
        targets,
    };
    // One more step, the pools read at its start and after each piece.
    let mut marked = Pieces {
        mark: true,
        marks: vec![Mark::take("step start", &ctx.device)],
        ..Pieces::default()
    };
    model = trainer.step(model, Some(&mut marked)).0;
    memory.append(&mut marked.marks);
    let profile = profile.then(|| {
        let mut pieces = Pieces::default();
        for _ in 0..steps {
            model = trainer.step(model.clone(), Some(&mut pieces)).0;
        }
        // The host's own time to issue a step from an idle device: far below `step_ms`, the
        // step waits for the GPU; near it, for the host.
        let mut issue = 0.0;
        for _ in 0..steps {
            ctx.device.sync().expect("sync");
            let start = Instant::now();
            model = trainer.step(model.clone(), None).0;
            issue += start.elapsed().as_secs_f64();
        }
        ctx.device.sync().expect("sync");
        let alone = trainer.reduction_alone(&model);
        let ms = |s: f64| s * 1e3 / steps as f64;
        let hidden = if alone > 0.0 { 1.0 - (ms(pieces.reduce_wait) / (alone * 1e3)).min(1.0) } else { 0.0 };
        format!(
            "\"forward_ms\": {:.1}, \"backward_ms\": {:.1}, \"reduce_wait_ms\": {:.1}, \"optimizer_ms\": {:.1}, \"reduce_alone_ms\": {:.1}, \"hidden\": {hidden:.2}, \"issue_ms\": {:.1}",
            ms(pieces.forward),
            ms(pieces.backward),
            ms(pieces.reduce_wait),
            ms(pieces.optimizer),
            alone * 1e3,
            ms(issue)
        )
    });
    Run {
        step_s,
        loss,
        profile,
        memory,
    }
}

/// How many steps warm up and are timed, on which rank.
struct Timing<'a> {
    ctx: &'a RankContext,
    warmup: usize,
    steps: usize,
    vocab: usize,
}

impl Timing<'_> {
    /// Warm-up steps (each read, the first one's loss checked) and the timed steps of `step`,
    /// which returns its loss unread; `read` reads one, stopping the benchmark on a failure.
    /// Returns the mean seconds a timed step and the last one's loss.
    fn run<L>(&self, memory: &mut Vec<Mark>, mut step: impl FnMut() -> L, read: impl Fn(L, &str) -> f64) -> (f64, f64) {
        let ctx = self.ctx;
        for i in 0..self.warmup {
            let start = Instant::now();
            let loss = read(step(), &format!("warm-up step {i}"));
            if ctx.global_rank == 0 {
                eprintln!("warmup {i}: {:.1} s, loss {loss}", start.elapsed().as_secs_f64());
            }
            if i == 0 {
                check_first_loss(loss as f32, self.vocab);
                memory.push(Mark::take("after the first step", &ctx.device));
            }
        }
        ctx.device.sync().expect("sync");
        let start = Instant::now();
        // The loss is read once, after the last step, as the peers do: a read each step would
        // stop the host from issuing the next step while this one runs.
        let mut last = None;
        for _ in 0..self.steps {
            last = Some(step());
        }
        ctx.device.sync().expect("sync");
        let step_s = start.elapsed().as_secs_f64() / self.steps as f64;
        let loss = last.map_or(0.0, |loss| read(loss, "the timed steps"));
        (step_s, loss)
    }
}
