//! Pipeline parallelism: the model's blocks split into stages over the pp group ([`stages`]).
//! Its schedules are built ([`schedule`]) and checked ([`simulate`]); a Llama's stage runs them
//! (`models/llama/pipeline.rs`). The plan does not lay a model out over pp yet (nor do `train`
//! and `bench` drive stages), so a plan asking for pp > 1 is refused by name.

pub mod schedule;
pub mod shared;
pub mod simulate;
pub mod stages;

use crate::error::ConfigError;

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

impl PipelineSchedule {
    /// Pipeline parallelism over `pp` ranks: only `pp = 1` runs today.
    pub fn check(self, pp: usize) -> Result<(), ConfigError> {
        match pp {
            1 => Ok(()),
            size => Err(ConfigError::NotBuilt {
                dimension: "pipeline parallelism",
                size,
            }),
        }
    }
}
