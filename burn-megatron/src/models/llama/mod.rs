//! Llama: the model (`model.rs`), its layer table for the parallel plan and precision policies
//! (`plan.rs`), the recipes that name whole runs (`recipes.rs`), Hugging Face checkpoints
//! (`hf/`), llama.cpp's GGUF files (`gguf/`), generation with a KV cache (`generate/`) and the
//! Learner's step (`learner.rs`); a block's linear layers by path (`sites.rs`); pipeline stages
//! (`stage.rs`), their schedules' runtime (`pipeline.rs`) and a stage's step on its own
//! (`scheduled.rs`).

pub mod generate;
pub mod gguf;
pub mod hf;
#[cfg(feature = "learner")]
pub mod learner;
pub mod model;
pub mod pipeline;
pub mod plan;
pub mod recipes;
pub mod scheduled;
pub mod sites;
pub mod stage;

pub use model::{Llama, LlamaBlock, LlamaConfig, MoeBlocks, MoeReport, TiedOutput, WordEmbeddings};
pub use recipes::{LlamaRecipe, preset};
pub use sites::{LinearMut, Site, linear_mut};
pub use stage::LlamaStage;
