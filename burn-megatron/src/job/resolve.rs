//! A job resolved: every default filled in from the model (its sequence length and batch), every
//! number checked against the rest before any tensor exists, and what a run builds from it: the
//! planned model configuration, the plan, the precision policy, the batch's split.

use std::path::PathBuf;

use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn_megatron_dist::ParallelDims;
use burn_megatron_kernels::Gemm;

use super::file::JobError;
use super::{Dtype, InitKind, JobConfig, ParallelSection};
use crate::error::ConfigError;
use crate::init::{InitMode, ParamInit};
use crate::models::llama::{LlamaConfig, MemoryEstimate, MtpConfig, WordEmbeddings, gguf, hf, preset};
use crate::optim::DistributedAdamWConfig;
use crate::plan::{ContextParallel, ParallelPlan, PipelineSchedule, TensorParallel};
use crate::precision::{KeptBlocks, PrecisionPolicy};

/// A resolved job: see the module docs.
#[derive(Clone, Debug)]
pub struct Job {
    /// The job with every default filled in: what a run prints and its checkpoints keep.
    pub config: JobConfig,
    /// The model's configuration, planned for the layout and set by the precision policy.
    pub model: LlamaConfig,
    pub plan: ParallelPlan,
    pub policy: PrecisionPolicy,
    /// Tokens a sequence.
    pub seq: usize,
    /// Sequences a step over every data-parallel rank, and on each.
    pub global_batch: usize,
    pub per_rank: usize,
    /// The pieces a rank's share of a step runs in: gradient accumulation's microbatches, or
    /// (pp > 1) the pipeline's.
    pub microbatches: usize,
}

impl JobConfig {
    /// The job resolved and checked: see the module docs. Reads a Hugging Face or GGUF model's
    /// configuration from its files.
    pub fn resolve(&self) -> Result<Job, JobError> {
        let mut config = self.clone();
        let field = |field: &'static str, detail: String| JobError::Field { field, detail };
        if config.steps == 0 {
            return Err(field("steps", "must be at least 1".into()));
        }
        let vocab = vocabulary(&config)?;
        let (model, seq, batch) = base_model(&mut config)?;
        let seq = config.data.seq.unwrap_or(seq);
        let global_batch = config.batch.global.unwrap_or(batch);
        config.data.seq = Some(seq);
        config.batch.global = Some(global_batch);
        let mut model = model;
        if let Some(vocab) = vocab {
            model.embedding.vocab_size = vocab;
            model.output.d_output = vocab;
            model.loss.vocab_size = vocab;
        }
        match config.model.layers {
            Some(0) => return Err(field("model.layers", "must be at least 1".into())),
            Some(layers) => model.n_layers = layers,
            None => {}
        }
        if let Some(tied) = config.model.tied {
            model.word_embeddings = match tied {
                true => WordEmbeddings::Tied,
                false => WordEmbeddings::Untied,
            };
        }
        model.recompute = config.model.recompute;
        if config.model.mtp_depth > 0 {
            let weight = config.model.mtp_loss_weight;
            if !(weight.is_finite() && weight >= 0.0) {
                return Err(field("model.mtp_loss_weight", format!("{weight} is no loss weight")));
            }
            model.mtp = Some(MtpConfig::new(config.model.mtp_depth).with_loss_weight(weight));
        }
        model.check_sizes()?;
        let p = &config.parallel;
        for (name, size) in [
            ("parallel.tp", p.tp),
            ("parallel.dp", p.dp),
            ("parallel.cp", p.cp),
            ("parallel.ep", p.ep),
            ("parallel.etp", p.etp.unwrap_or(1)),
            ("parallel.pp", p.pp),
            ("parallel.vpp", p.vpp),
        ] {
            if size == 0 {
                return Err(field(name, "must be at least 1".into()));
            }
        }
        let plan = p.plan();
        let (dims, schedule) = (plan.dims, plan.pipeline);
        let policy = policy(&config)?;
        let model = policy.apply(plan.apply(model, dims.world_size(), seq)?);
        let per_rank = match global_batch {
            0 => return Err(ConfigError::Zero { what: "batch size" }.into()),
            b if b.is_multiple_of(p.dp) => b / p.dp,
            batch => return Err(ConfigError::BatchNotDivisible { batch, dp: p.dp }.into()),
        };
        let micro = config.batch.micro.unwrap_or(match p.pp {
            1 => per_rank,
            pp => (per_rank / pp).max(1),
        });
        if micro == 0 || micro > per_rank || !per_rank.is_multiple_of(micro) {
            return Err(field(
                "batch.micro",
                format!(
                    "{micro} sequences a microbatch do not split a rank's {per_rank} (the global batch over dp = {})",
                    p.dp
                ),
            ));
        }
        config.batch.micro = Some(micro);
        let microbatches = per_rank / micro;
        if p.pp > 1 {
            schedule.check_microbatches(p.pp, microbatches)?;
        }
        crate::optim::check_lr(config.optimizer.lr)?;
        config.schedule.scheduler(config.optimizer.lr, config.steps)?;
        if let Some(clip) = config.optimizer.clip_grad
            && !(clip.is_finite() && clip > 0.0)
        {
            return Err(field(
                "optimizer.clip_grad",
                format!("{clip} must be a finite norm above 0"),
            ));
        }
        if config.data.pack_conversations && p.cp > 1 && p.context != ContextParallel::AllToAll {
            return Err(field(
                "data.pack_conversations",
                format!(
                    "packed conversations do not take context parallelism's {} exchange yet \
                     (parallel.context: all-to-all does)",
                    p.context.name()
                ),
            ));
        }
        check_rest(&mut config)?;
        Ok(Job {
            config,
            model,
            plan,
            policy,
            seq,
            global_batch,
            per_rank,
            microbatches,
        })
    }
}

/// The model's configuration, sequence length and global batch before the job's changes: a
/// preset's recipe, or a Hugging Face or GGUF model's configuration (whose sequence length and
/// batch the job must give).
fn base_model(config: &mut JobConfig) -> Result<(LlamaConfig, usize, usize), JobError> {
    let m = &config.model;
    let named = [m.preset.is_some(), m.hf.is_some(), m.gguf.is_some()];
    if named.iter().filter(|&&n| n).count() > 1 {
        return Err(JobError::Field {
            field: "model",
            detail: "name one of preset, hf and gguf".into(),
        });
    }
    let from_files = |what: &str, model: LlamaConfig| match (config.data.seq, config.batch.global) {
        (Some(seq), Some(batch)) => Ok((model, seq, batch)),
        _ => Err(JobError::Field {
            field: "model",
            detail: format!("a {what} model has no recipe: set data.seq and batch.global"),
        }),
    };
    let source = |e: &dyn std::fmt::Display| JobError::Source { detail: e.to_string() };
    if let Some(dir) = &m.hf {
        return from_files("Hugging Face", hf::config(dir).map_err(|e| source(&e))?);
    }
    if let Some(path) = &m.gguf {
        return from_files("GGUF", gguf::config(path).map_err(|e| source(&e))?);
    }
    let name = config.model.preset.get_or_insert_with(|| "tiny".into()).clone();
    let recipe = preset(&name)?;
    Ok((recipe.model, recipe.seq_len, recipe.batch_size))
}

/// The vocabulary a preset's model takes instead of its own: `model.vocab`, else
/// `data.tokenizer`'s; a Hugging Face or GGUF model's is its own.
fn vocabulary(config: &JobConfig) -> Result<Option<usize>, JobError> {
    let files = config.model.hf.is_some() || config.model.gguf.is_some();
    match (config.model.vocab, &config.data.tokenizer) {
        (Some(_), _) if files => Err(JobError::Field {
            field: "model.vocab",
            detail: "a Hugging Face or GGUF model's vocabulary is its own".into(),
        }),
        (Some(0), _) => Err(JobError::Field {
            field: "model.vocab",
            detail: "must be at least 1".into(),
        }),
        (Some(vocab), _) => Ok(Some(vocab)),
        (None, Some(path)) if !files => {
            let tokenizer = hf::tokenizer(path).map_err(|e| JobError::Source { detail: e.to_string() })?;
            Ok(Some(tokenizer.get_vocab_size(true)))
        }
        _ => Ok(None),
    }
}

/// The precision policy the job's section names.
fn policy(config: &JobConfig) -> Result<PrecisionPolicy, JobError> {
    let section = &config.precision;
    let policy = match section.dtype {
        Dtype::Bf16 => PrecisionPolicy::bf16(),
        Dtype::F32 => PrecisionPolicy::f32(),
    };
    let policy = match section.recipe {
        Some(recipe) => policy.with_gemm(Gemm::Quantized(recipe)),
        None => policy,
    };
    Ok(match section.bf16_blocks {
        Some(_) if section.recipe.is_none() => {
            return Err(JobError::Field {
                field: "precision.bf16_blocks",
                detail: "names the blocks a recipe leaves in the compute dtype: it needs precision.recipe".into(),
            });
        }
        Some([first, last]) => policy.with_kept_blocks(KeptBlocks::Count { first, last }),
        None => policy,
    })
}

/// The checkpoint, evaluation, data and logging fields against the rest.
fn check_rest(config: &mut JobConfig) -> Result<(), JobError> {
    let field = |field: &'static str, detail: &str| {
        Err(JobError::Field {
            field,
            detail: detail.to_string(),
        })
    };
    let c = &config.checkpoint;
    if c.interval == Some(0) {
        return field("checkpoint.interval", "must be at least 1");
    }
    if c.keep_last == Some(0) {
        return field("checkpoint.keep_last", "must be at least 1");
    }
    if c.export.is_some() && config.parallel.pp > 1 {
        return field(
            "checkpoint.export",
            "writes a whole model, at pp = 1: examples/convert turns a pipeline's checkpoint into one",
        );
    }
    if c.dir.is_none() && (c.interval.is_some() || c.async_save || c.keep_last.is_some()) {
        return field("checkpoint", "interval, keep_last and async need checkpoint.dir");
    }
    if let Err(e) = config.guard.clone().checked() {
        return field("guard", &e.to_string());
    }
    if !config.data.prefixes.is_empty() {
        if config.data.path.is_some() {
            return field(
                "data.prefixes",
                "reads tokenized datasets: data.path (text) names others",
            );
        }
        if let Err(e) = crate::data::blend::data_path(&config.data.prefixes) {
            return field("data.prefixes", &e.to_string());
        }
    }
    if config.data.sft && config.data.prefixes.is_empty() {
        return field("data.sft", "reads chat datasets: name them in data.prefixes");
    }
    if config.data.pack_conversations && !config.data.sft {
        return field(
            "data.pack_conversations",
            "packs chat datasets' conversations: set data.sft",
        );
    }
    let held_out = config.data.held_out;
    if !(0.0..0.5).contains(&held_out) {
        return field("data.held_out", "must be a share of at least 0 and below 0.5");
    }
    if config.eval.interval > 0 && held_out == 0.0 {
        return field(
            "eval.interval",
            "evaluation reads held-out text: set data.held_out above 0",
        );
    }
    if config.eval.interval > 0 && config.eval.batches == 0 {
        return field("eval.batches", "must be at least 1");
    }
    // Under context parallelism no rank holds a whole prompt: no samples.
    let every = *config.logging.sample_every.get_or_insert(match config.parallel.cp {
        1 => (config.steps / 5).max(1),
        _ => 0,
    });
    if config.parallel.cp > 1 && every > 0 {
        return field(
            "logging.sample_every",
            "cp splits every sequence over ranks: greedy samples of a whole prompt need sample_every = 0",
        );
    }
    if config.logging.metrics.is_none() {
        config.logging.metrics = config.checkpoint.dir.as_ref().map(|dir| dir.join("metrics.jsonl"));
    }
    Ok(())
}

impl ParallelSection {
    /// The plan of this layout: the mesh, sequence parallelism, the experts' dispatcher, the cp
    /// exchange, 1F1B (interleaved over `vpp` chunks above 1).
    pub fn plan(&self) -> ParallelPlan {
        let dims = ParallelDims {
            ep: self.ep,
            etp: self.etp,
            cp: self.cp,
            pp: self.pp,
            ..ParallelDims::tp_dp(self.tp, self.dp)
        };
        let schedule = match self.vpp {
            1 => PipelineSchedule::OneForwardOneBackward,
            v => PipelineSchedule::Interleaved { virtual_stages: v },
        };
        let tensor = match self.sp {
            true => TensorParallel::SequenceParallel,
            false => TensorParallel::Plain,
        };
        ParallelPlan::new(dims)
            .with_tensor(tensor)
            .with_expert(self.dispatcher)
            .with_context(self.context)
            .with_pipeline(schedule)
    }
}

impl Job {
    /// A rank's estimated peak memory ([`LlamaConfig::memory`]) and the microbatches whose
    /// activations it holds at once (a pipeline's first stage: as many as it warms up).
    pub fn memory(&self) -> (MemoryEstimate, usize) {
        let bytes = match self.config.precision.dtype {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        };
        let (dims, zero1) = (self.plan.dims, self.config.optimizer.zero1);
        let estimate = self.model.memory(dims, self.plan.tensor, self.seq, bytes, zero1);
        (estimate, self.microbatches.min(dims.pp))
    }

    /// Refuses a job whose estimated peak memory a rank passes `capacity` bytes (a device's),
    /// naming the largest microbatch that fits; the estimate where it fits.
    pub fn check_memory(&self, capacity: u64) -> Result<u64, JobError> {
        let (estimate, in_flight) = self.memory();
        let micro = self.config.batch.micro.unwrap_or(self.per_rank);
        let peak = estimate.peak(micro, in_flight);
        if peak <= capacity {
            return Ok(peak);
        }
        let largest = estimate.largest_micro(capacity, in_flight);
        let dp = self.plan.dims.dp;
        let advice = match largest {
            0 => "not even the parameters and optimizer state fit: split them further (tp, pp, ep, ZeRO-1)".to_string(),
            n => format!(
                "at most {n} sequences a microbatch fit (batch.micro = {n} keeps the global batch through accumulation where it divides it; batch.global = {} without), or recompute more",
                n * dp
            ),
        };
        let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
        Err(JobError::Memory {
            peak_gib: gib(peak),
            state_gib: gib(estimate.state),
            micro,
            sequence_gib: gib(estimate.per_sequence),
            capacity_gib: gib(capacity),
            largest,
            advice,
        })
    }

    pub fn dims(&self) -> ParallelDims {
        self.plan.dims
    }

    /// The distributed optimizer the job's section configures.
    pub fn optimizer(&self) -> DistributedAdamWConfig {
        let o = &self.config.optimizer;
        DistributedAdamWConfig::new()
            .with_beta_1(o.beta1)
            .with_beta_2(o.beta2)
            .with_epsilon(o.eps)
            .with_weight_decay(o.weight_decay)
            .with_max_grad_norm(o.clip_grad)
            .with_zero1(o.zero1)
    }

    /// The learning rate's scheduler (checked when the job resolved).
    pub fn scheduler(&self) -> ModuleLrScheduler {
        let c = &self.config;
        c.schedule
            .scheduler(c.optimizer.lr, c.steps)
            .expect("checked when the job resolved")
    }

    /// How parameters get their first values.
    pub fn init(&self) -> ParamInit {
        let mode = match self.config.model.init {
            InitKind::Full => InitMode::Full,
            InitKind::PerShard => InitMode::PerShard,
        };
        self.policy.init(self.config.seed, mode)
    }

    /// Gradient accumulation's microbatches a step (1 under pp: the pipeline runs them).
    pub fn accumulation(&self) -> usize {
        match self.dims().pp {
            1 => self.microbatches,
            _ => 1,
        }
    }

    /// Where the run writes its metrics, if anywhere.
    pub fn metrics(&self) -> Option<&PathBuf> {
        self.config.logging.metrics.as_ref()
    }
}
