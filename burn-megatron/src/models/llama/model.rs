//! The Llama decoder. Nothing here knows about parallelism: the layers do, and the plan
//! (`plan.rs`) sets them up before `init`.
//!
//! Legend: `b` batch, `s` sequence, `d` d_model, `v` vocabulary.

use burn::config::Config;
use burn::module::Module;
use burn::tensor::{Device, Int, Tensor};
use burn_megatron_dist::ProcessGroups;

use crate::error::{ConfigError, LayerError};
use crate::init::ParamInit;
use crate::layers::moe::{Load, Moe, MoeConfig, RouterLosses};
use crate::layers::{
    ColumnInput, ColumnOutput, ColumnParallelLinear, ColumnParallelLinearConfig, Documents, LatentAttention,
    LatentAttentionConfig, ParallelAttention, ParallelAttentionConfig, ParallelMlp, ParallelMlpConfig, RmsNorm,
    RmsNormConfig, VocabParallelCrossEntropy, VocabParallelCrossEntropyConfig, VocabParallelEmbedding,
    VocabParallelEmbeddingConfig, column_parallel,
};
use crate::precision::EdgeBlocks;
use crate::precision::linear::LinearPrecision;
use burn_megatron_dist::ProcessGroup;
use burn_megatron_kernels::quant::notes::AmaxNotes;

use super::mtp::{MtpConfig, MtpModule};
use super::sites::share_amax_notes;
use crate::recompute::Recompute;
use burn_megatron_kernels::Gemm;

/// Where the output layer's weight comes from.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum WordEmbeddings {
    /// The output layer has a weight of its own.
    Untied,
    /// The output layer multiplies by the embedding's weight, transposed (Hugging Face's
    /// `tie_word_embeddings`): one parameter, vocabulary-parallel `[v/tp, d]`, whose gradient is
    /// the sum of both uses. The output configuration still gives the input mapping and product.
    Tied,
}

/// A Llama model: the configuration of each of its parts.
#[derive(Config, Debug)]
pub struct LlamaConfig {
    pub n_layers: usize,
    pub embedding: VocabParallelEmbeddingConfig,
    pub attention: ParallelAttentionConfig,
    pub mlp: ParallelMlpConfig,
    pub norm: RmsNormConfig,
    /// The output layer, `d → v`.
    pub output: ColumnParallelLinearConfig,
    pub loss: VocabParallelCrossEntropyConfig,
    /// Whether the output layer shares the embedding's weight.
    #[config(default = "WordEmbeddings::Untied")]
    pub word_embeddings: WordEmbeddings,
    /// Blocks whose linear layers run another product than `attention.gemm` and `mlp.gemm` (a
    /// precision policy's kept blocks).
    #[config(default = "None")]
    pub edge_blocks: Option<EdgeBlocks>,
    /// Blocks whose feed-forward is a mixture of experts instead of `mlp`.
    #[config(default = "None")]
    pub moe: Option<MoeBlocks>,
    /// Multi-head latent attention in every block instead of `attention` (DeepSeek-V3's), whose
    /// `d_model`, `n_heads` and `max_seq_len` it shares.
    #[config(default = "None")]
    pub latent: Option<LatentAttentionConfig>,
    /// Multi-token prediction's modules after the blocks (DeepSeek-V3's; `mtp.rs`).
    #[config(default = "None")]
    pub mtp: Option<MtpConfig>,
    /// What the blocks run again during backward instead of keeping (`crate::recompute`).
    #[config(default = "Recompute::None")]
    pub recompute: Recompute,
}

/// Which blocks are mixtures of experts, and their layer.
#[derive(Config, Debug)]
pub struct MoeBlocks {
    pub layer: MoeConfig,
    /// Blocks `0, every, 2·every, …` are MoE blocks (Megatron's `moe_layer_freq`); 1: all.
    #[config(default = 1)]
    pub every: usize,
    /// The first blocks stay dense whatever `every` says (DeepSeek-V3's
    /// `first_k_dense_replace`); 0: none.
    #[config(default = 0)]
    pub first_dense: usize,
}

impl MoeBlocks {
    /// Whether block `i` is a MoE block.
    pub fn holds(&self, i: usize) -> bool {
        i >= self.first_dense && i.is_multiple_of(self.every.max(1))
    }
}

/// One decoder block: pre-norm attention (grouped-query or latent) and a pre-norm feed-forward
/// (a dense MLP or a mixture of experts), each with a residual.
#[derive(Module, Debug)]
pub struct LlamaBlock {
    pub attention_norm: RmsNorm,
    /// Grouped-query attention; `None` in a block of latent attention.
    pub attention: Option<ParallelAttention>,
    /// Multi-head latent attention (DeepSeek-V3); `None` in a block of grouped-query attention.
    pub latent: Option<LatentAttention>,
    pub mlp_norm: RmsNorm,
    /// The dense feed-forward; `None` in a MoE block.
    pub mlp: Option<ParallelMlp>,
    /// The mixture of experts of a MoE block.
    pub moe: Option<Moe>,
    /// Whether attention and the dense feed-forward run their selective recomputation regions.
    #[module(skip)]
    pub selective: bool,
}

/// What the MoE blocks of one forward pass report, one entry a MoE block.
#[derive(Clone, Debug, Default)]
pub struct MoeReport {
    pub losses: Vec<RouterLosses>,
    pub loads: Vec<Load>,
    /// Multi-token prediction's loss, weighted (`mtp.rs`), where the model has its modules.
    pub mtp: Option<Tensor<1>>,
}

impl MoeReport {
    /// The router losses of every MoE block and multi-token prediction's summed (added to the
    /// model's loss), if any.
    pub fn loss(&self) -> Option<Tensor<1>> {
        let router = self.losses.iter().filter_map(RouterLosses::total);
        router.chain(self.mtp.clone()).reduce(|a, b| a + b)
    }

    /// Another forward's loads added block by block (the microbatches of one step: what the
    /// expert bias moves by).
    pub fn add_loads(&mut self, other: &MoeReport) {
        self.loads = match self.loads.is_empty() {
            true => other.loads.clone(),
            false => self.loads.iter().zip(&other.loads).map(|(a, b)| a.add(b)).collect(),
        };
    }

    /// Each expert's copies summed over the MoE blocks, and the copies dropped.
    pub fn load(&self) -> Option<Load> {
        self.loads.iter().cloned().reduce(|a, b| a.add(&b))
    }
}

#[derive(Module, Debug)]
pub struct Llama {
    pub embedding: VocabParallelEmbedding,
    pub layers: Vec<LlamaBlock>,
    /// Which blocks run as recomputed regions (full recomputation).
    #[module(skip)]
    pub recompute: Recompute,
    pub norm: RmsNorm,
    /// The output layer; `None` with tied word embeddings, which use `tied_output` instead.
    pub output: Option<ColumnParallelLinear>,
    #[module(skip)]
    pub tied_output: Option<TiedOutput>,
    #[module(skip)]
    pub loss: VocabParallelCrossEntropy,
    /// Multi-token prediction's modules, in depth order (none without).
    pub mtp: Vec<MtpModule>,
    /// What their mean loss is added to the model's times (λ).
    #[module(skip)]
    pub mtp_weight: f64,
}

/// The output layer of tied word embeddings, which holds no weight: how it maps its input
/// (copy-to-tp, or gather-from-sp under sequence parallelism) and multiplies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TiedOutput {
    pub input: ColumnInput,
    pub gemm: Gemm,
}

impl LlamaConfig {
    /// A model with the given sizes, no parallelism applied, and the choices of
    /// `docs/performance.md`'s workloads: RMSNorm ε 1e-5, RoPE θ 10000 on halves, SwiGLU, no biases,
    /// untied embeddings (`with_word_embeddings(WordEmbeddings::Tied)` ties them).
    #[allow(clippy::too_many_arguments)]
    pub fn llama(
        vocab: usize,
        d_model: usize,
        n_layers: usize,
        n_heads: usize,
        n_kv_heads: usize,
        d_ff: usize,
        max_seq_len: usize,
    ) -> Self {
        Self::new(
            n_layers,
            VocabParallelEmbeddingConfig::new(vocab, d_model),
            ParallelAttentionConfig::new(d_model, n_heads, n_kv_heads, max_seq_len),
            ParallelMlpConfig::new(d_model, d_ff),
            RmsNormConfig::new(d_model),
            ColumnParallelLinearConfig::new(d_model, vocab),
            VocabParallelCrossEntropyConfig::new(vocab),
        )
    }

    pub fn init(&self, device: &Device, groups: &ProcessGroups, init: &ParamInit) -> Result<Llama, LayerError> {
        self.check_recompute()?;
        let layers = (0..self.n_layers)
            .map(|i| self.init_block(i, device, groups, init))
            .collect::<Result<_, LayerError>>()?;
        let (mut output, tied_output) = self.init_output(device, groups, init)?;
        let mut layers: Vec<LlamaBlock> = layers;
        let mut mtp = self.init_mtp(device, groups, init)?;
        let blocks = layers.iter_mut().chain(mtp.iter_mut().map(|m| &mut m.block));
        share_amax_notes(blocks, output.as_mut().map(|o| &mut o.precision));
        Ok(Llama {
            embedding: self.embedding.init(device, groups, init, "embedding"),
            layers,
            recompute: self.recompute,
            norm: self.norm.init(device, groups, init),
            output,
            tied_output,
            loss: self.loss.init(groups),
            mtp,
            mtp_weight: self.mtp.map_or(0.0, |m| m.loss_weight),
        })
    }
}

impl LlamaConfig {
    /// The output layer: its own weight, or how the tied embedding's serves as one.
    pub(crate) fn init_output(
        &self,
        device: &Device,
        groups: &ProcessGroups,
        init: &ParamInit,
    ) -> Result<(Option<ColumnParallelLinear>, Option<TiedOutput>), LayerError> {
        Ok(match self.word_embeddings {
            WordEmbeddings::Untied => (Some(self.output.init(device, groups, init, "output")?), None),
            WordEmbeddings::Tied => {
                // The embedding's rows are the output's columns: the same padded vocabulary.
                crate::error::divisible("d_output", self.output.d_output, groups.tp.size())?;
                let tied = TiedOutput {
                    input: self.output.input,
                    gemm: self.output.gemm,
                };
                (None, Some(tied))
            }
        })
    }

    /// The recomputation asked for fits the model: full recomputation's block count, and no
    /// MoE block inside a fully recomputed region.
    pub fn check_recompute(&self) -> Result<(), ConfigError> {
        self.recompute.check(self.n_layers)?;
        if matches!(self.recompute, Recompute::Full { .. }) && self.moe.is_some() {
            return Err(ConfigError::RecomputeMoe);
        }
        Ok(())
    }

    /// Block `i`, named `layers.{i}` (so its values are the whole model's at every layout).
    pub fn init_block(
        &self,
        i: usize,
        device: &Device,
        groups: &ProcessGroups,
        init: &ParamInit,
    ) -> Result<LlamaBlock, LayerError> {
        self.init_block_named(i, &format!("layers.{i}"), device, groups, init)
    }

    /// A block of the kind block `i` is (its precision, dense or MoE), named `name`.
    pub(crate) fn init_block_named(
        &self,
        i: usize,
        name: &str,
        device: &Device,
        groups: &ProcessGroups,
        init: &ParamInit,
    ) -> Result<LlamaBlock, LayerError> {
        let (mut attention, mut mlp) = (self.attention.clone(), self.mlp.clone());
        if let Some(edges) = self.edge_blocks.filter(|e| e.holds(i, self.n_layers)) {
            (attention.gemm, mlp.gemm) = (edges.gemm, edges.gemm);
        }
        let (mlp, moe) = match self.moe.as_ref().filter(|m| m.holds(i)) {
            Some(blocks) => (
                None,
                Some(blocks.layer.init(device, groups, init, &format!("{name}.moe"))?),
            ),
            None => (Some(mlp.init(device, groups, init, &format!("{name}.mlp"))?), None),
        };
        let (attention, latent) = match &self.latent {
            Some(latent) => {
                let mut latent = latent.clone();
                latent.gemm = attention.gemm;
                (
                    None,
                    Some(latent.init(device, groups, init, &format!("{name}.latent"))?),
                )
            }
            None => (
                Some(attention.init(device, groups, init, &format!("{name}.attention"))?),
                None,
            ),
        };
        Ok(LlamaBlock {
            attention_norm: self.norm.init(device, groups, init),
            attention,
            latent,
            mlp_norm: self.norm.init(device, groups, init),
            mlp,
            moe,
            selective: self.recompute.selective(),
        })
    }
}

impl LlamaBlock {
    pub fn forward(&self, x: Tensor<3>) -> Result<Tensor<3>, LayerError> {
        self.forward_report(x, &mut MoeReport::default(), None)
    }

    /// [`forward`](Self::forward), a MoE block adding its router losses and load to `report`;
    /// rows packing `documents` attended inside each one.
    ///
    /// Each half adds its branch to the residual stream its norm read ([`RmsNorm::pre_norm`]).
    /// The stream's gradient at the block's input is the previous block's down projection's
    /// output gradient; this block's stands in for it in whether to note its amax.
    pub fn forward_report(
        &self,
        x: Tensor<3>,
        report: &mut MoeReport,
        documents: Option<&Documents>,
    ) -> Result<Tensor<3>, LayerError> {
        let note_stream_grad = self.mlp.as_ref().and_then(|mlp| mlp.notes_output_grad());
        let note_input = self.attention.as_ref().and_then(ParallelAttention::notes_input);
        let (normed, stream) = self.attention_norm.pre_norm(x, note_input, note_stream_grad)?;
        let h = match (&self.attention, &self.latent, self.selective) {
            (Some(attention), _, true) => attention.forward_recomputed_onto(normed, stream, documents)?,
            (Some(attention), _, false) => attention.forward_onto(normed, stream, documents)?,
            (None, Some(latent), true) => stream.add_branch(latent.forward_recomputed(normed, documents)?),
            (None, Some(latent), false) => stream.add_branch(latent.forward_inside(normed, documents)?),
            (None, None, _) => unreachable!("a block has grouped-query or latent attention"),
        };
        self.feed_forward(h, report)
    }

    /// The context-parallel group its attention splits sequences over.
    pub fn context_group(&self) -> &ProcessGroup {
        match (&self.attention, &self.latent) {
            (Some(attention), _) => &attention.cp,
            (None, Some(latent)) => &latent.cp,
            (None, None) => unreachable!("a block has grouped-query or latent attention"),
        }
    }

    /// The second half of the block: `x` plus the feed-forward (dense or MoE, reporting to
    /// `report`) of its norm.
    pub(crate) fn feed_forward(&self, x: Tensor<3>, report: &mut MoeReport) -> Result<Tensor<3>, LayerError> {
        let note_input = self.mlp.as_ref().and_then(|mlp| mlp.notes_input());
        let note_grad = self.attention.as_ref().and_then(ParallelAttention::notes_output_grad);
        let (normed, stream) = self.mlp_norm.pre_norm(x, note_input, note_grad)?;
        Ok(match (&self.mlp, &self.moe) {
            (_, Some(moe)) => {
                let (y, routing, load) = moe.forward(normed)?;
                report.losses.push(routing.losses);
                report.loads.push(load);
                stream.add_branch(y)
            }
            (Some(mlp), None) if self.selective => mlp.forward_recomputed_onto(normed, stream)?,
            (Some(mlp), None) => mlp.forward_onto(normed, stream)?,
            (None, None) => unreachable!("a block has an MLP or a mixture of experts"),
        })
    }
}

/// `blocks` in order on `x`, each group full recomputation names (`recompute.groups`) run as
/// one recomputed region; a MoE block adds its router losses and load to `report`; rows packing
/// `documents` attended inside each one.
///
/// # Shapes
/// `[b, s, d]` → `[b, s, d]`
pub fn forward_blocks(
    blocks: &[LlamaBlock],
    x: Tensor<3>,
    recompute: Recompute,
    report: &mut MoeReport,
    documents: Option<&Documents>,
) -> Result<Tensor<3>, LayerError> {
    recompute
        .groups(blocks.len())
        .into_iter()
        .try_fold(x, |x, (range, recomputed)| {
            let group = &blocks[range];
            match recomputed {
                // No MoE block in a recomputed region (`LlamaConfig::check_recompute`).
                true => {
                    let documents = documents.cloned();
                    crate::recompute::recompute(&group.to_vec(), vec![x], move |group, mut x| {
                        let x = x.pop().expect("the group's input");
                        let mut report = MoeReport::default();
                        group
                            .iter()
                            .try_fold(x, |x, block| block.forward_report(x, &mut report, documents.as_ref()))
                    })
                }
                false => group
                    .iter()
                    .try_fold(x, |x, block| block.forward_report(x, report, documents)),
            }
        })
}

/// Each MoE block of `blocks` (in order, `loads[j]` the `j`-th MoE block's load) moves its
/// router bias, where it has one, by its rate toward balance from the load summed over
/// `groups.grad_sync()` ([`Llama::update_expert_bias`]). Loads that are not one a MoE block
/// are an error before any collective.
pub(crate) fn update_expert_biases<'a>(
    blocks: impl Iterator<Item = &'a mut LlamaBlock>,
    loads: &[Load],
    groups: &ProcessGroups,
) -> Result<(), LayerError> {
    let blocks: Vec<&mut LlamaBlock> = blocks.filter(|b| b.moe.is_some()).collect();
    if blocks.len() != loads.len() {
        return Err(ConfigError::LoadsPerBlock {
            loads: loads.len(),
            blocks: blocks.len(),
        }
        .into());
    }
    for (block, load) in blocks.into_iter().zip(loads) {
        let moe = block.moe.as_mut().expect("a MoE block");
        moe.update_expert_bias(load, groups.grad_sync())?;
    }
    Ok(())
}

/// The output layer on the normed `x`: its own, or the tied embedding's weight as one.
///
/// # Shapes
/// `[b, s, d]` → logits `[b, s, v']`
pub(crate) fn output_logits(
    x: Tensor<3>,
    output: Option<&ColumnParallelLinear>,
    tied: Option<(&TiedOutput, &VocabParallelEmbedding)>,
) -> Result<Tensor<3>, LayerError> {
    Ok(match (output, tied) {
        (Some(output), _) => output.forward(x)?,
        (None, Some((tied, embedding))) => {
            let weight = embedding.weight.val().transpose(); // [d, v/tp]
            let layout = (tied.input, ColumnOutput::Sharded);
            let precision = LinearPrecision::plain(tied.gemm);
            column_parallel(x, weight, None, layout, &precision, None, &embedding.tp)?
        }
        (None, None) => unreachable!("a Llama has an output layer or tied word embeddings"),
    })
}

impl Llama {
    /// Where this model's kernels and its optimizer note the amaxes its FP8 tensorwise casts
    /// take (one for the whole model: [`share_amax_notes`]); give it to the optimizer
    /// (`DistributedAdamW::keeping_amaxes`) to spare each cast of a weight its amax pass.
    pub fn amax_notes(&self) -> AmaxNotes {
        let first = self.layers.first().map(|b| b.first_precision());
        first
            .or(self.output.as_ref().map(|o| &o.precision))
            .map(|p| p.notes.clone())
            .unwrap_or_default()
    }

    /// # Shapes
    /// `[b, s]` token ids → logits `[b, s, v']`, `v'` this rank's share of the vocabulary.
    pub fn forward(&self, ids: Tensor<2, Int>) -> Result<Tensor<3>, LayerError> {
        Ok(self.forward_report(ids)?.0)
    }

    /// [`forward`](Self::forward) with what its MoE blocks report.
    pub fn forward_report(&self, ids: Tensor<2, Int>) -> Result<(Tensor<3>, MoeReport), LayerError> {
        let (x, report) = self.hidden_report(ids, None)?;
        Ok((self.head(x)?, report))
    }

    /// The last block's output, and what the MoE blocks report.
    ///
    /// # Shapes
    /// `[b, s]` → `[b, s, d]` (`[b, s/tp, d]` under sequence parallelism)
    fn hidden_report(
        &self,
        ids: Tensor<2, Int>,
        documents: Option<&Documents>,
    ) -> Result<(Tensor<3>, MoeReport), LayerError> {
        let mut report = MoeReport::default();
        let x = self.embedding.forward(ids)?;
        let x = forward_blocks(&self.layers, x, self.recompute, &mut report, documents)?;
        Ok((x, report))
    }

    /// Multi-token prediction's loss (`mtp.rs`): each module's cross-entropy against the token
    /// `k + 1` ahead, positions past the end left out, their mean times λ.
    ///
    /// # Shapes
    /// `[b, s]` × 2, the last block's output → `[1]`
    fn mtp_loss(
        &self,
        ids: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        mut hidden: Tensor<3>,
        report: &mut MoeReport,
        documents: Option<&Documents>,
    ) -> Result<Tensor<1>, LayerError> {
        let tied = self.tied_output.as_ref().map(|t| (t, &self.embedding));
        let mut loss = self.loss.clone();
        let ignored = super::mtp::ignored(&loss);
        loss.ignore_index = Some(ignored);
        let mut total: Option<Tensor<1>> = None;
        for (k, module) in self.mtp.iter().enumerate() {
            let embedded = self.embedding.forward(super::mtp::ahead(ids.clone(), k + 1, 0))?;
            hidden = module.forward(hidden, embedded, report, documents)?;
            let logits = output_logits(module.norm.forward(hidden.clone())?, self.output.as_ref(), tied)?;
            let mut ahead = super::mtp::ahead(targets.clone(), k + 1, ignored);
            if let Some(documents) = documents {
                // A target from the next packed document is not this token's to predict.
                let starts = documents.starts.clone();
                let crossing = super::mtp::ahead(starts.clone(), k + 1, -1).not_equal(starts);
                ahead = ahead.mask_fill(crossing, ignored);
            }
            let here = loss.forward(logits, ahead)?;
            total = Some(match total {
                Some(sum) => sum + here,
                None => here,
            });
        }
        let total = total.expect("a model with multi-token prediction has modules");
        Ok(total.mul_scalar(self.mtp_weight / self.mtp.len() as f64))
    }

    /// The final norm and the output layer (or the tied embedding) on the last block's output.
    ///
    /// # Shapes
    /// `[b, s, d]` → logits `[b, s, v']`
    pub(crate) fn head(&self, x: Tensor<3>) -> Result<Tensor<3>, LayerError> {
        let tied = self.tied_output.as_ref().map(|t| (t, &self.embedding));
        output_logits(self.norm.forward(x)?, self.output.as_ref(), tied)
    }

    /// DeepSeek-V3's auxiliary-loss-free balancing, after a step: each MoE block's router bias
    /// (where it has one) moves by its rate toward balance, from the copies its experts took
    /// over the whole batch (`report`'s loads summed over `groups.grad_sync()`). Every rank
    /// calls it, with the report of its own forward pass.
    pub fn update_expert_bias(mut self, report: &MoeReport, groups: &ProcessGroups) -> Result<Self, LayerError> {
        update_expert_biases(self.blocks_mut(), &report.loads, groups)?;
        Ok(self)
    }

    /// Every block in the order a forward pass runs them: the model's, then multi-token
    /// prediction's.
    pub fn blocks_mut(&mut self) -> impl Iterator<Item = &mut LlamaBlock> {
        self.layers.iter_mut().chain(self.mtp.iter_mut().map(|m| &mut m.block))
    }

    /// Whether the output layer shares the embedding's weight.
    pub fn word_embeddings(&self) -> WordEmbeddings {
        match self.output {
            Some(_) => WordEmbeddings::Untied,
            None => WordEmbeddings::Tied,
        }
    }

    /// The next-token loss of `ids` against `targets` (see [`VocabParallelCrossEntropy`]).
    ///
    /// # Shapes
    /// `[b, s]`, `[b, s]` → `[1]`
    /// The MoE blocks' router losses are added to it.
    pub fn forward_loss(&self, ids: Tensor<2, Int>, targets: Tensor<2, Int>) -> Result<Tensor<1>, LayerError> {
        Ok(self.forward_loss_report(ids, targets)?.0)
    }

    /// [`forward_loss`](Self::forward_loss) with what the MoE blocks (and multi-token
    /// prediction) report.
    pub fn forward_loss_report(
        &self,
        ids: Tensor<2, Int>,
        targets: Tensor<2, Int>,
    ) -> Result<(Tensor<1>, MoeReport), LayerError> {
        self.forward_loss_documents(ids, targets, None)
    }

    /// [`forward_loss_report`](Self::forward_loss_report) of rows that pack `documents` (where
    /// given): each attended inside itself, its tokens rotated at their positions in it; the
    /// targets crossing from one document into the next are the caller's to ignore (the
    /// multi-token prediction modules ignore those further ahead themselves).
    ///
    /// # Shapes
    /// `[b, s]`, `[b, s]`, documents `[b, s]` → `[1]`
    pub fn forward_loss_documents(
        &self,
        ids: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        documents: Option<&Documents>,
    ) -> Result<(Tensor<1>, MoeReport), LayerError> {
        let (hidden, mut report) = self.hidden_report(ids.clone(), documents)?;
        let loss = self.loss.forward(self.head(hidden.clone())?, targets.clone())?;
        if !self.mtp.is_empty() {
            report.mtp = Some(self.mtp_loss(ids, targets, hidden, &mut report, documents)?);
        }
        let loss = match report.loss() {
            Some(router) => {
                let dtype = loss.dtype();
                loss + router.cast(dtype)
            }
            None => loss,
        };
        Ok((loss, report))
    }
}
