//! Optimizers that know the mesh: AdamW with fp32 master weights, data-parallel averaging and
//! the ZeRO-1 distributed optimizer.

pub mod adamw;
pub mod buckets;
pub mod overlap;
pub mod params;

pub use adamw::{DistributedAdamW, DistributedAdamWConfig, ParamState, StepReport};
pub use buckets::{BucketConfig, GradReducer, Reduction};
pub use overlap::Overlap;
pub use params::{ParamInfo, param_infos};
