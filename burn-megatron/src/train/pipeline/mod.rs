//! The pipeline's runtime: a rank runs its schedule's actions on its stage ([`run_actions`],
//! over the pipeline group's point-to-point calls), and a stage that carries its schedule steps
//! on its own ([`scheduled_step`], [`forward_loss`]: what the training step and Burn's Learner
//! drive). The schedules themselves are the plan's (`plan::pipeline`).

mod run;
mod scheduled;

pub use run::{StageStep, StageTiming, Timing, run_actions};
pub use scheduled::{ScheduledStep, forward_loss, scheduled_step};
