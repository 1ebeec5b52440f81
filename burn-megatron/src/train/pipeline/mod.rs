//! The pipeline's runtime: a rank runs its schedule's actions on its stage ([`run_actions`],
//! over the pipeline group's point-to-point calls), a plain training step of a stage
//! ([`train_step`]), and a stage that carries its schedule stepping on its own
//! ([`scheduled_step`], [`forward_loss`]: what Burn's Learner drives). The schedules themselves
//! are the plan's (`plan::pipeline`).

mod run;
mod scheduled;

pub use run::{PipelineReport, StageStep, StageTiming, Timing, run_actions, train_step};
pub use scheduled::{ScheduledStep, forward_loss, scheduled_step};
