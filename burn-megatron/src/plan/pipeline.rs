//! Pipeline parallelism: the model's blocks split into stages over the pp group ([`stages`]).
//! Its schedules are built ([`schedule`]: a rank's actions, [`schedule::StageSchedule`]) and
//! checked ([`simulate`]); `train::pipeline` runs them on a Llama's stage, and the optimizer sums
//! the gradients of parameters several stages hold (`optim::shared`). The plan checks that the
//! blocks split for its schedule.

pub mod schedule;
pub mod simulate;
pub mod stages;

/// The order in which a pipeline stage runs its microbatches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PipelineSchedule {
    /// All forwards, then all backwards.
    GPipe,
    /// One forward, one backward in the steady state.
    #[default]
    OneForwardOneBackward,
    /// 1F1B over `virtual_stages` model chunks a rank (Megatron's interleaved schedule).
    Interleaved { virtual_stages: usize },
}
