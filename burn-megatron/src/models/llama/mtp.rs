//! Multi-token prediction (DeepSeek-V3's MTP modules; Megatron Core's
//! `multi_token_prediction.py`): after the main model, `depth` modules in sequence, module `k`
//! predicting the token `k + 1` positions ahead. Module `k` RMS-normalizes the previous depth's
//! hidden states (the main model's last block's output for the first) and the embedding of the
//! token `k` positions ahead, projects the two side by side (the embedding's first) back to the
//! model's width, runs one transformer block of the model's kind, and reads its own norm's output through the model's
//! output layer (shared, like the embedding). Its loss is the cross-entropy against the token
//! `k + 1` ahead, positions past the sequence's end not counted; the modules' mean loss times
//! `loss_weight` is added to the model's. In rows packing several documents each module attends
//! inside each one and leaves out the targets of the next.
//!
//! Tensor, sequence, data and expert parallelism, and recomputation, apply to the modules as to
//! the blocks. Context parallelism (each rank would need its neighbours' tokens ahead) and
//! pipeline parallelism (the modules and the shared embedding would sit on the last stage) are
//! not built: the model refuses them ([`ConfigError::NotBuilt`]).
//!
//! Legend: `b` batch, `s` sequence, `d` d_model.

use burn::config::Config;
use burn::module::Module;
use burn::tensor::{Device, Int, Tensor};
use burn_megatron_dist::ProcessGroups;
use burn_megatron_dist::mappings::gather_from_tp;

use super::model::{LlamaBlock, LlamaConfig, MoeReport};
use crate::error::{ConfigError, LayerError};
use crate::init::ParamInit;
use crate::layers::{
    Documents, RmsNorm, RowInput, RowOutput, RowParallelLinear, RowParallelLinearConfig, SequenceLayout,
    VocabParallelCrossEntropy,
};

/// How many tokens ahead a model also learns to predict, and how much that counts.
#[derive(Config, Debug, Copy, PartialEq)]
pub struct MtpConfig {
    /// Modules, each one token further ahead (DeepSeek-V3: 1).
    pub depth: usize,
    /// λ: the modules' mean loss is added to the model's times this (DeepSeek-V3: 0.3, then
    /// 0.1).
    #[config(default = 0.1)]
    pub loss_weight: f64,
}

/// One module: its two norms, its projection `[2d → d]`, its block and its output norm.
#[derive(Module, Debug)]
pub struct MtpModule {
    /// The previous depth's hidden states' norm (DeepSeek-V3's `hnorm`).
    pub hidden_norm: RmsNorm,
    /// The embedding's norm (`enorm`).
    pub embedding_norm: RmsNorm,
    /// `[2d → d]` over the two normed inputs side by side, the embedding's first (`eh_proj`),
    /// split by input features.
    pub projection: RowParallelLinear,
    pub block: LlamaBlock,
    /// The norm before the shared output layer (`shared_head.norm`).
    pub norm: RmsNorm,
}

impl LlamaConfig {
    /// The multi-token prediction modules, `mtp.{k}`, their blocks of the model's kind (a
    /// mixture of experts where the last block is one).
    pub(crate) fn init_mtp(
        &self,
        device: &Device,
        groups: &ProcessGroups,
        init: &ParamInit,
    ) -> Result<Vec<MtpModule>, LayerError> {
        let Some(mtp) = self.mtp else {
            return Ok(Vec::new());
        };
        if groups.cp.size() > 1 {
            return Err(ConfigError::NotBuilt {
                dimension: "multi-token prediction under context parallelism",
                size: groups.cp.size(),
            }
            .into());
        }
        let d = self.attention.d_model;
        let sequence = self.norm.sequence;
        let output = match sequence {
            SequenceLayout::Sharded => RowOutput::SequenceScattered,
            SequenceLayout::Whole => RowOutput::Reduced,
        };
        (0..mtp.depth)
            .map(|k| {
                let name = format!("mtp.{k}");
                let projection = RowParallelLinearConfig::new(2 * d, d)
                    .with_input(RowInput::Replicated)
                    .with_output(output)
                    .with_gemm(self.mlp.gemm)
                    .init(device, groups, init, &format!("{name}.projection"))?;
                Ok(MtpModule {
                    hidden_norm: self.norm.init(device, groups, init),
                    embedding_norm: self.norm.init(device, groups, init),
                    projection,
                    block: self.init_block_named(self.n_layers, &format!("{name}.block"), device, groups, init)?,
                    norm: self.norm.init(device, groups, init),
                })
            })
            .collect()
    }
}

impl MtpModule {
    /// The module's hidden states from the previous depth's and the embedding of the tokens
    /// ahead, its MoE block reporting to `report`, rows packing `documents` attended inside
    /// each one.
    ///
    /// # Shapes
    /// `[b, s, d]` × 2 (`[b, s/tp, d]` under sequence parallelism) → the same
    pub fn forward(
        &self,
        hidden: Tensor<3>,
        embedded: Tensor<3>,
        report: &mut MoeReport,
        documents: Option<&Documents>,
    ) -> Result<Tensor<3>, LayerError> {
        // The embedding's features first: the order DeepSeek-V3's `eh_proj` weight has in its
        // files (and Megatron's `eh_proj`).
        let both = Tensor::cat(
            vec![
                self.embedding_norm.forward(embedded)?,
                self.hidden_norm.forward(hidden)?,
            ],
            2,
        );
        // The projection reads every token whole on every rank and keeps its slice of the
        // features: under SP the sequence is gathered first, each rank's gradient of the
        // gathered tensor then whole already (the projection's backward gathers it), so only
        // its own shard goes back, unsummed.
        let both = match self.hidden_norm.sequence {
            SequenceLayout::Sharded => gather_from_tp(both, &self.projection.tp, 1)?,
            SequenceLayout::Whole => both,
        };
        self.block
            .forward_report(self.projection.forward(both)?, report, documents)
    }
}

/// `x` moved `k` positions to the left along the sequence, `fill` past its end.
///
/// # Shapes
/// `[b, s]` → `[b, s]`
pub(crate) fn ahead(x: Tensor<2, Int>, k: usize, fill: i64) -> Tensor<2, Int> {
    let [b, s] = x.dims();
    let kept = s.saturating_sub(k);
    let pad = Tensor::<2, Int>::full([b, s - kept], fill, &x.device());
    match kept {
        0 => pad,
        _ => Tensor::cat(vec![x.narrow(1, k, kept), pad], 1),
    }
}

/// The token id no target is, which the modules' loss leaves out past the sequence's end: the
/// model's own ignored id where it has one.
pub(crate) fn ignored(loss: &VocabParallelCrossEntropy) -> i64 {
    loss.ignore_index.unwrap_or(-1)
}
