//! Typed errors of layer and model configurations, checked before any tensor is made.

use burn_megatron_dist::{CommError, MeshError};

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("{what} = {size} is not divisible by tp = {tp}")]
    NotDivisible { what: &'static str, size: usize, tp: usize },
    #[error("n_heads = {n_heads} is not a multiple of n_kv_heads = {n_kv_heads}")]
    HeadsNotMultipleOfKvHeads { n_heads: usize, n_kv_heads: usize },
    #[error("d_model = {d_model} is not divisible by n_heads = {n_heads}")]
    ModelNotDivisibleByHeads { d_model: usize, n_heads: usize },
    #[error("head_dim = {head_dim} is odd: RoPE rotates pairs of dims")]
    OddHeadDim { head_dim: usize },
    #[error("sequence length {seq_len} is not divisible by tp = {tp}, which sequence parallelism needs")]
    SequenceNotDivisible { seq_len: usize, tp: usize },
    #[error("sequence length {seq_len} is longer than the model's {max_seq_len} positions")]
    SequenceTooLong { seq_len: usize, max_seq_len: usize },
    #[error(
        "sequence length {seq_len} is past the model's sliding attention window of {window} tokens: \
         sliding-window attention is built only for sequences within the window"
    )]
    SequencePastWindow { seq_len: usize, window: usize },
    #[error("{what} must be at least 1")]
    Zero { what: &'static str },
    /// Packed documents that do not fit their rows, or a model part that cannot take them.
    #[error("packed documents: {0}")]
    Documents(String),
    #[error("{what} = {size} is past the largest a model may give ({max})")]
    TooLarge {
        what: &'static str,
        size: usize,
        max: usize,
    },
    #[error("{dimension} = {size} is not built yet: set it to 1")]
    NotBuilt { dimension: &'static str, size: usize },
    #[error("a global batch of {batch} sequences does not split evenly over dp = {dp}")]
    BatchNotDivisible { batch: usize, dp: usize },
    #[error("learning rate {lr} must be a finite number above 0")]
    LearningRate { lr: f64 },
    #[error("the model is configured for tp = {configured} but its tensor-parallel group has {group} ranks")]
    GroupSizeMismatch { configured: usize, group: usize },
    #[error(transparent)]
    Mesh(#[from] MeshError),
    #[error("top k = {top_k} is more than the {experts} experts a token can reach")]
    TopKAboveExperts { top_k: usize, experts: usize },
    #[error("{experts} experts do not form {groups} equal groups of which {top_groups} are kept")]
    ExpertGroups {
        experts: usize,
        groups: usize,
        top_groups: usize,
    },
    #[error("loss spike factor {factor} must be a finite number above 1")]
    SpikeFactor { factor: f64 },
    #[error("expert capacity factor {factor} must be a finite number above 0")]
    CapacityFactor { factor: f64 },
    #[error(
        "decoding with a KV cache runs on whole sequences: plan the model without sequence parallelism (TensorParallel::Plain)"
    )]
    DecodingSequenceParallel,
    #[error("{tokens} tokens do not fit a KV cache of {capacity} positions (at most the model's max_seq_len)")]
    CacheFull { tokens: usize, capacity: usize },
    #[error(
        "a KV cache of {layers} blocks used with a model of {blocks}: a cache serves the model it was made for, and a step that failed emptied it"
    )]
    CacheUnusable { layers: usize, blocks: usize },
    #[error(
        "full recomputation of {layers} blocks does not fit a model of {n_layers} blocks (at least 1, at most all)"
    )]
    RecomputeLayers { layers: usize, n_layers: usize },
    #[error(
        "full recomputation of mixture-of-experts blocks is not built: their router losses leave the block beside its output (selective recomputation, or full recomputation of dense blocks only)"
    )]
    RecomputeMoe,
    #[error("{microbatches} microbatches do not form whole rounds of pp = {pp}, which the interleaved schedule walks")]
    Microbatches { microbatches: usize, pp: usize },
    #[error(
        "{layers} blocks do not split into {stages} pipeline stages as asked (counts {counts:?}: each at least 1, adding up to the blocks; none given: an even split)"
    )]
    StageLayers {
        layers: usize,
        stages: usize,
        counts: Vec<usize>,
    },
    #[error("{sequences} sequences a rank do not split into {microbatches} equal microbatches")]
    MicrobatchSplit { sequences: usize, microbatches: usize },
    #[error("a schedule of {schedule} model chunks a rank for a stage of {stage}")]
    StageChunks { schedule: usize, stage: usize },
    #[error("the pipeline stage has no schedule: give it one with `LlamaStage::with_schedule`")]
    NoSchedule,
    #[error("{loads} expert loads for {blocks} MoE blocks: one a block, in block order")]
    LoadsPerBlock { loads: usize, blocks: usize },
    #[error("a pipeline stage's chunks reach block {end}, past the model's {blocks}")]
    StageBlocks { end: usize, blocks: usize },
    #[error("the model names no blocks for pipeline stages (`PlannedModel::blocks`): set pp to 1")]
    NoBlocks,
    #[error("an interleaved schedule needs at least 2 model chunks a rank, not {virtual_stages}")]
    VirtualStages { virtual_stages: usize },
    #[error("{experts} experts do not split evenly over ep = {ep}")]
    ExpertsNotDivisible { experts: usize, ep: usize },
    #[error(
        "expert tensor parallelism etp = {etp} below tp = {tp} needs sequence parallelism: each etp group's experts run on its own part of the sequence"
    )]
    ExpertTpNeedsSequenceParallel { etp: usize, tp: usize },
    #[error("{tokens} tokens do not form {sequences} sequences of equal length")]
    TokensNotInSequences { tokens: usize, sequences: usize },
    #[error("a sequence of {seq_len} tokens does not split into 2·cp = {} equal chunks (cp = {cp})", 2 * cp)]
    ContextChunks { seq_len: usize, cp: usize },
    #[error(
        "{heads} {what} on each tp rank do not scatter over cp = {cp} (all-to-all context parallelism; ring or all-gather take any heads)"
    )]
    ContextHeads {
        what: &'static str,
        heads: usize,
        cp: usize,
    },
    #[error("decoding with a KV cache runs on whole sequences: plan the model without context parallelism (cp = 1)")]
    DecodingContextParallel,
    #[error("decoding with a KV cache is built for grouped-query attention; this model's blocks have latent attention")]
    DecodingLatentAttention,
    #[error("learning-rate schedule: {detail}")]
    Schedule { detail: String },
    #[error(
        "unknown preset {0:?}: expected tiny, tiny-moe, llama-1b, llama-1b-32k, moe-4b, llama-8b, smollm2-135m, qwen3-1.7b, qwen3-moe-2b or dsv3-2b"
    )]
    UnknownPreset(String),
}

/// A layer or model that could not run or convert.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum LayerError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A recorded CUDA graph's replay or input write was refused (decoding).
    #[error(transparent)]
    Graph(#[from] burn_megatron_kernels::cuda::graph::GraphError),
    /// The device failed to run what was queued on it.
    #[error("the device failed: {detail}")]
    Device { detail: String },
    /// CubeCL could not run a launch (past the device's memory: the allocation that failed).
    #[error(transparent)]
    Failed(#[from] burn_megatron_kernels::failures::DeviceFailure),
    /// A row-parallel layer's input shard splits one of its input quantizer's tiles.
    #[error("a shard of {features} input features does not hold whole quantization tiles of {group}")]
    GroupsAcrossShards { features: usize, group: usize },
}

/// Checks that `size` splits over `tp` ranks.
pub fn divisible(what: &'static str, size: usize, tp: usize) -> Result<usize, ConfigError> {
    if size.is_multiple_of(tp) {
        Ok(size / tp)
    } else {
        Err(ConfigError::NotDivisible { what, size, tp })
    }
}
