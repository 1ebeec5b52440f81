//! Llama: the model (`model.rs`), its layer table for the parallel plan and precision policies
//! (`plan.rs`), the recipes that name whole runs (`recipes.rs`), Hugging Face checkpoints
//! (`hf/`), llama.cpp's GGUF files (`gguf/`), a step's FLOPs (`flops.rs`), generation with a KV cache (`generate/`); a
//! block's linear layers by path (`sites.rs`); a rank's pipeline stage (`stage.rs`, which
//! `train::pipeline` runs).

mod flops;
pub mod generate;
pub mod gguf;
pub mod hf;
mod limits;
mod memory;
pub mod model;
pub mod mtp;
pub mod plan;
pub mod recipes;
pub mod sites;
pub mod stage;

pub use limits::{MAX_DIM, MAX_LAYERS};
pub use memory::{MemoryEstimate, POOL_OVERHEAD, RUNTIME_BYTES};
pub use model::{Llama, LlamaBlock, LlamaConfig, MoeBlocks, MoeReport, TiedOutput, WordEmbeddings};
pub use mtp::{MtpConfig, MtpModule};
pub use recipes::{LlamaRecipe, preset};
pub use sites::{LinearMut, Site, linear_mut};
pub use stage::LlamaStage;
