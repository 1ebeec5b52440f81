//! Llama: the model (`model.rs`), the plan that parallelizes it (`plan.rs`), the recipes that
//! name whole runs (`recipes.rs`), Hugging Face checkpoints (`hf.rs`) and the Learner's step
//! (`learner.rs`).

pub mod hf;
#[cfg(feature = "learner")]
pub mod learner;
pub mod model;
pub mod plan;
pub mod recipes;

pub use model::{Llama, LlamaBlock, LlamaConfig};
pub use plan::ParallelPlan;
pub use recipes::{LlamaRecipe, preset};
