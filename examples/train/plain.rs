//! The plain driver: a loop of the library's training step, a line a step (or a progress bar
//! in a terminal), for logs and CI.

use burn_megatron::train::routine::Hook;
use burn_megatron::train::{Reporter, TrainModel};
use burn_megatron_dist::{RankContext, launch};

use crate::rank::{RankModel, Run};

/// Trains the run; returns the losses the reporting rank read.
pub fn run(run: &Run, reporter: impl Fn() -> Box<dyn Reporter> + Sync) -> Result<Vec<f64>, String> {
    let results = launch(
        run.job.dims(),
        crate::device_of(run),
        |ctx| -> Result<Vec<f64>, String> {
            let device = ctx.device.clone().autodiff();
            match run.model(&ctx, &device)? {
                RankModel::Whole(model) => steps(run, &ctx, model, reporter(), run.hooks(&ctx)),
                RankModel::Stage(stage) => steps(run, &ctx, stage, reporter(), None),
            }
        },
    )
    .map_err(|e| e.to_string())?;
    crate::reported(results)
}

/// Steps whose data is read ahead.
const PREFETCH: usize = 2;

/// This rank's steps after the checkpoint's up to the job's last.
fn steps<M: TrainModel>(
    run: &Run,
    ctx: &RankContext,
    model: M,
    reporter: Box<dyn Reporter>,
    hook: Option<Hook<M>>,
) -> Result<Vec<f64>, String> {
    let job = &run.job;
    let mut trainer = run.trainer(model, ctx)?;
    let mut routine = run.routine(ctx, reporter, hook)?;
    let mut scheduler = job.scheduler();
    for _ in 0..run.done {
        scheduler.step();
    }
    let device = ctx.device.clone().autodiff();
    let mut losses = Vec::new();
    routine.start();
    let steps = run.done + 1..=job.config.steps;
    // The data is read a step ahead on a thread of its own, off the step's critical path.
    std::thread::scope(|scope| -> Result<(), String> {
        let (ahead, tokens) = std::sync::mpsc::sync_channel(PREFETCH);
        let reader = steps.clone();
        scope.spawn(move || {
            for step in reader {
                if ahead.send(run.tokens(step, ctx)).is_err() {
                    break;
                }
            }
        });
        for _ in steps {
            let lr = scheduler.step().base();
            let read = tokens.recv().map_err(|_| "the data reader stopped".to_string())??;
            let stepped = trainer
                .step(lr, run.token_batch(read, &device)?)
                .map_err(|e| e.to_string())?;
            let values = routine.after_step(&mut trainer, stepped).map_err(|e| e.to_string())?;
            losses.push(values.loss);
        }
        Ok(())
    })?;
    let summary = routine.finish().map_err(|e| e.to_string())?;
    if let Some(measured) = summary.bubble {
        routine.note(&crate::bubble_line(run, measured)?);
    }
    // fp32 master weights and both moments: 1/dp of them per rank with ZeRO-1.
    let mib = trainer.optimizer().state_bytes() as f64 / (1 << 20) as f64;
    routine.note(&format!("optimizer state on this rank: {mib:.2} MiB"));
    Ok(match burn_megatron::train::routine::reports(&ctx.groups) {
        true => losses,
        false => Vec::new(),
    })
}
