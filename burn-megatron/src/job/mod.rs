//! The training job a user writes: [`JobConfig`], one TOML file of sections (model, parallel,
//! precision, optimizer, schedule, data, batch, checkpoint, eval, logging, guard), any field of which
//! the command line overrides (`--optimizer.lr 3e-4`, [`JobConfig::parse`]). [`JobConfig::resolve`]
//! checks every number before any tensor exists and gives the planned model, plan, precision
//! policy and batch split ([`Job`]); the resolved job is what a run prints, writes into its
//! checkpoints, and holds a resumed run to ([`JobConfig::check_resume`]).
//!
//! ```toml
//! steps = 300
//! [model]
//! preset = "llama-1b"
//! [parallel]
//! tp = 2
//! sp = true
//! [optimizer]
//! lr = 3e-4
//! clip_grad = 1.0
//! [schedule]
//! kind = "warmup-cosine"
//! warmup = 30
//! [batch]
//! global = 16
//! micro = 4
//! ```

mod file;
mod resolve;
#[cfg(test)]
mod tests;
mod text;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::layers::context::ContextParallel;
use crate::layers::moe::ExpertParallel;
use crate::recompute::Recompute;
use crate::train::{GuardConfig, LrSchedule};
use burn_megatron_kernels::quant::recipe::Recipe;

pub use file::{JobError, Override};
pub use resolve::Job;

/// A training job: see the module docs. Every section and field has a default, so a file holds
/// only what it changes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JobConfig {
    /// Optimizer steps to train (a resumed run continues up to it).
    pub steps: usize,
    /// Seeds the initialization and the generated data.
    pub seed: u64,
    /// Where the ranks run.
    pub device: DeviceKind,
    pub model: ModelSection,
    pub parallel: ParallelSection,
    pub precision: PrecisionSection,
    pub optimizer: OptimizerSection,
    pub schedule: LrSchedule,
    pub data: DataSection,
    pub batch: BatchSection,
    pub checkpoint: CheckpointSection,
    pub eval: EvalSection,
    pub logging: LoggingSection,
    /// What a step whose gradients are not finite does, and loss spikes.
    pub guard: GuardConfig,
}

impl Default for JobConfig {
    fn default() -> Self {
        Self {
            steps: 200,
            seed: 7,
            device: DeviceKind::Cpu,
            model: ModelSection::default(),
            parallel: ParallelSection::default(),
            precision: PrecisionSection::default(),
            optimizer: OptimizerSection::default(),
            schedule: LrSchedule::Constant,
            data: DataSection::default(),
            batch: BatchSection::default(),
            checkpoint: CheckpointSection::default(),
            eval: EvalSection::default(),
            logging: LoggingSection::default(),
            guard: GuardConfig::default(),
        }
    }
}

/// Where the ranks run: the CPU (ranks as threads), or one CUDA GPU a local rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    #[default]
    Cpu,
    Cuda,
}

/// The model: a preset of this crate, or a Hugging Face directory or GGUF file (its
/// configuration, and its weights to fine-tune from).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSection {
    /// `tiny`, `tiny-moe`, `llama-1b`, `llama-1b-32k`, `moe-4b`, `llama-8b`, `smollm2-135m`, `qwen3-1.7b`, `qwen3-moe-2b` or `dsv3-2b`
    /// (`tiny` when neither `hf` nor `gguf` names the model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preset: Option<String>,
    /// A Hugging Face model directory (`config.json`, safetensors, `tokenizer.json`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hf: Option<PathBuf>,
    /// A GGUF file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gguf: Option<PathBuf>,
    /// A preset's vocabulary, instead of its own (by default a preset takes `data.tokenizer`'s;
    /// a Hugging Face or GGUF model keeps its own).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vocab: Option<usize>,
    /// Blocks, instead of the model's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layers: Option<usize>,
    /// The output layer tied to the embedding, instead of the model's choice.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tied: Option<bool>,
    /// What the blocks run again in backward: `none`, `selective`, `full:N`, `full-block:N`.
    #[serde(with = "text")]
    pub recompute: Recompute,
    /// Multi-token prediction modules after the blocks (DeepSeek-V3's; 0: none).
    pub mtp_depth: usize,
    /// What their mean loss is added to the model's times (λ).
    pub mtp_loss_weight: f64,
    /// `full`: every parameter generated whole and sliced (the same model at every layout);
    /// `per-shard`: only this rank's slice.
    pub init: InitKind,
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            preset: None,
            hf: None,
            gguf: None,
            vocab: None,
            layers: None,
            tied: None,
            recompute: Recompute::None,
            mtp_depth: 0,
            mtp_loss_weight: 0.1,
            init: InitKind::Full,
        }
    }
}

/// How parameters get their first values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InitKind {
    #[default]
    Full,
    PerShard,
}

/// The layout: the mesh's sizes and one choice a dimension.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ParallelSection {
    pub tp: usize,
    pub dp: usize,
    /// Context parallelism: each sequence split over `cp` ranks in load-balanced chunks.
    pub cp: usize,
    /// Expert parallelism, folded over dp (a MoE model's experts split over `ep` ranks).
    pub ep: usize,
    /// Expert tensor parallelism: the tp ranks splitting each expert (all of tp when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub etp: Option<usize>,
    /// Pipeline stages, and model chunks a stage (interleaved 1F1B above 1).
    pub pp: usize,
    pub vpp: usize,
    /// Sequence parallelism beside tp.
    pub sp: bool,
    /// How attention sees the whole sequence under cp: `ring`, `all-to-all`, `all-gather`.
    #[serde(with = "text")]
    pub context: ContextParallel,
    /// How token copies reach other ep ranks' experts: `all-to-all`, `all-gather`.
    #[serde(with = "text")]
    pub dispatcher: ExpertParallel,
}

impl Default for ParallelSection {
    fn default() -> Self {
        Self {
            tp: 1,
            dp: 1,
            cp: 1,
            ep: 1,
            etp: None,
            pp: 1,
            vpp: 1,
            sp: false,
            context: ContextParallel::Ring,
            dispatcher: ExpertParallel::AllToAll,
        }
    }
}

/// Parameters' and activations' dtype, and the blocks' linear layers' recipe.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrecisionSection {
    /// `f32`, or `bf16` (the optimizer keeps fp32 master weights either way).
    pub dtype: Dtype,
    /// A low-precision recipe for the blocks' linear layers (`fp8-tensorwise`,
    /// `fp8-delayed:16:max`, `fp8-blockwise`, `mxfp8`, `nvfp4`, …; `default`: none).
    #[serde(with = "text::optional", skip_serializing_if = "Option::is_none")]
    pub recipe: Option<Recipe>,
    /// The first and last blocks that keep the compute dtype's product under the recipe (the
    /// recipe's own choice when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bf16_blocks: Option<[usize; 2]>,
}

/// The compute dtype.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    #[default]
    F32,
    Bf16,
}

/// The distributed AdamW (fp32 master weights). Defaults are PyTorch's and Megatron's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerSection {
    /// The peak learning rate (the schedule moves it).
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Clip gradients to this global norm (over every rank, each parameter once).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clip_grad: Option<f64>,
    /// Split master weights and moments over the data-parallel group (ZeRO-1, Megatron's
    /// distributed optimizer).
    pub zero1: bool,
}

impl Default for OptimizerSection {
    fn default() -> Self {
        Self {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            clip_grad: None,
            zero1: false,
        }
    }
}

/// What the model reads.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataSection {
    /// A text file or a directory of them (byte-level tokens unless `tokenizer`); none: the
    /// generated arithmetic corpus.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// A Hugging Face `tokenizer.json` to tokenize the text with.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// Tokens a sequence (the model's when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq: Option<usize>,
    /// Tokenized datasets (Megatron's `.bin` + `.idx`, by their path without the extension), in
    /// Megatron's `--data-path` form: prefixes alone (each weighted by its tokens), or weight
    /// and prefix pairs (`["0.7", "web", "0.3", "code"]`). Their documents are packed into
    /// sequences (`data::packed`); exclusive with `path`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub prefixes: Vec<String>,
    /// `prefixes` names chat datasets (`prepare-data` of chat lines: the conversations and
    /// their loss masks beside them), a conversation a sample, the loss over the assistant's
    /// tokens only.
    pub sft: bool,
    /// Under `sft`, as many whole conversations a sample as fit in turn, each attended inside
    /// itself with its own positions (packed SFT: fewer padding tokens; the model's grouped-query
    /// attention, without context or pipeline parallelism).
    pub pack_conversations: bool,
    /// Where the packed datasets' indexes are cached (beside each dataset when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache: Option<PathBuf>,
    /// The share of the text (of each dataset's documents) held out for evaluation (0: none).
    pub held_out: f64,
}

/// How many sequences a step trains on, and in how many pieces.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BatchSection {
    /// Sequences a step over every data-parallel rank (the model's when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub global: Option<usize>,
    /// Sequences a microbatch on one data-parallel rank: a rank's share of the global batch in
    /// `share / micro` microbatches (gradient accumulation, or a pipeline's microbatches; the
    /// whole share, or a pipeline's `share / pp`, when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub micro: Option<usize>,
}

/// Where and how often a run saves.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointSection {
    /// Save here, at the end and every `interval` steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interval: Option<usize>,
    /// Keep the newest `keep_last` checkpoints, removing older ones (all when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keep_last: Option<usize>,
    /// Write on a thread of its own while training goes on.
    #[serde(rename = "async")]
    pub async_save: bool,
    /// Continue from the latest checkpoint here, up to `steps`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load: Option<PathBuf>,
    /// Write the trained model here as a Hugging Face directory at the end (with the
    /// tokenizer, where the job has one); a whole model: pp = 1 (`examples/convert` turns any
    /// layout's checkpoint into one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub export: Option<PathBuf>,
}

/// Evaluation on the held-out text.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvalSection {
    /// Evaluate every `interval` steps and at the end (0: never).
    pub interval: usize,
    /// Global batches of held-out sequences an evaluation reads.
    pub batches: usize,
}

impl Default for EvalSection {
    fn default() -> Self {
        Self {
            interval: 0,
            batches: 2,
        }
    }
}

/// What a run shows and keeps.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoggingSection {
    /// The metrics file (JSON lines, one a step and one an evaluation); `metrics.jsonl` in the
    /// checkpoint directory when absent and there is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics: Option<PathBuf>,
    /// A greedy sample every this many steps (0: never; a fifth of the run when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sample_every: Option<usize>,
    /// Which loop drives the steps: `learner` (Burn's Learner, its metrics and display; the
    /// default where the `learner` feature is built) or `plain` (a line a step, for logs and
    /// CI; the default otherwise).
    pub driver: Driver,
}

/// The loop around the training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Driver {
    Learner,
    Plain,
}

impl Default for Driver {
    fn default() -> Self {
        match cfg!(feature = "learner") {
            true => Driver::Learner,
            false => Driver::Plain,
        }
    }
}
