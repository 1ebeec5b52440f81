//! Training: the one training step ([`Trainer`], for any [`TrainModel`]: a whole Llama, a
//! pipeline stage), a step's values read and printed ([`StepValues`]), the pipeline's runtime
//! ([`pipeline`]) and, with the `learner` feature, Burn's Learner running one rank of the mesh
//! through the same step ([`learner`]: `MegatronStrategy`).

mod batch;
mod guard;
#[cfg(feature = "learner")]
pub mod learner;
mod llama;
mod metrics;
pub mod pipeline;
mod report;
pub mod routine;
mod schedule;
mod step;

pub use batch::{Targeted, TokenBatch};
pub use guard::{Guard, GuardConfig, NonFinite, Stopped};
pub use metrics::{MetricsLog, StepRate, read_metrics};
pub use report::{ExpertLoad, StepValues};
pub use routine::{Lines, Reporter, Routine, RunError, Summary, Throughput};
pub use schedule::LrSchedule;
pub use step::{Backward, Forwarded, Gradients, Pass, Stepped, TrainError, TrainModel, Trainer, router_parts};
