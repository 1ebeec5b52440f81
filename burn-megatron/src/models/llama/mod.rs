//! Llama: the model (`model.rs`), the plan that parallelizes it (`plan.rs`), the recipes that
//! name whole runs (`recipes.rs`) and Hugging Face checkpoints (`hf.rs`).

pub mod hf;
pub mod model;
pub mod plan;
pub mod recipes;

pub use model::{Llama, LlamaBlock, LlamaConfig};
pub use plan::ParallelPlan;
pub use recipes::{LlamaRecipe, preset};
