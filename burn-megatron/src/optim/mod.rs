//! Optimizers that know the mesh: AdamW with fp32 master weights, data-parallel averaging and
//! the ZeRO-1 distributed optimizer; and [`FusedAdamW`], Burn's optimizer interface on the fused
//! AdamW kernel.

pub mod adamw;
pub mod buckets;
pub mod fused;
pub mod overlap;

pub use adamw::{DistributedAdamW, DistributedAdamWConfig, ParamState, StepReport, check_lr};
pub use buckets::{BucketConfig, GradGroup, GradReducer, Reduction};
pub use fused::{FusedAdamW, FusedAdamWConfig};
pub use overlap::Overlap;
