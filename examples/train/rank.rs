//! What both drivers build on every rank from the resolved job: the model (a whole Llama, or
//! this rank's pipeline stage), its [`Trainer`] (resumed from the checkpoint), the batches a
//! step and an evaluation read, and the [`Routine`] around each step (reporting, metrics,
//! evaluation, checkpoints, greedy samples).

use burn::module::Module;
use burn::tensor::Device;
use burn_megatron::checkpoint::{self, Saver};
use burn_megatron::job::{DeviceKind, Job};
use burn_megatron::models::llama::{Llama, LlamaStage, hf, sites};
use burn_megatron::train::pipeline::Timing;
use burn_megatron::train::routine::Hook;
use burn_megatron::train::{Reporter, Routine, Throughput, TokenBatch, TrainModel, Trainer};
use burn_megatron_dist::RankContext;

use crate::common;
use crate::data::Corpus;
use crate::sample;

/// A dense bf16 peak FLOP/s of an H100 or H200 SXM, which MFU divides by on CUDA.
const HOPPER_PEAK_FLOPS: f64 = 989.4e12;

/// Everything a run shares over its ranks.
pub struct Run {
    pub job: Job,
    pub corpus: Corpus,
    pub held_out: Option<Corpus>,
    /// Steps the checkpoint resumed from had taken (0 for a fresh run).
    pub done: usize,
    /// A greedy sample's prompt and the token that pads it.
    pub prompt: Vec<u32>,
    pub pad: u32,
}

/// The bytes a rank's step may take on `device`: a GPU's memory, or on the CPU (where every
/// rank shares it) the machine's (Linux's `MemTotal`); none where neither is known.
fn capacity(device: &Device) -> Option<u64> {
    if let Some(total) = burn_megatron_kernels::memory::device_memory(device).and_then(|m| m.total) {
        return Some(total);
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// This rank's part of the model.
pub enum RankModel {
    Whole(Llama),
    Stage(LlamaStage),
}

impl Run {
    /// This rank's model, on the autodiff `device`: its weights from the job's model files
    /// unless a checkpoint will replace them.
    pub fn model(&self, ctx: &RankContext, device: &Device) -> Result<RankModel, String> {
        let job = &self.job;
        // Before any tensor of the model: a job past the device's memory is refused, naming
        // the microbatch that fits.
        if let Some(capacity) = capacity(&ctx.device).filter(|_| job.config.guard.memory) {
            job.check_memory(capacity).map_err(|e| e.to_string())?;
        }
        let init = job.init();
        let fail = |e: &dyn std::fmt::Display| e.to_string();
        let files = match (&job.config.model.hf, &job.config.model.gguf) {
            (Some(dir), _) => Some(common::Source::Hf(dir.clone())),
            (_, Some(path)) => Some(common::Source::Gguf(path.clone())),
            _ => None,
        };
        let files = files.filter(|_| job.config.checkpoint.load.is_none());
        if job.dims().pp > 1 {
            let mut stage = job
                .model
                .init_planned_stage(&job.plan, job.microbatches, device, &ctx.groups, &init)
                .map_err(|e| fail(&e))?;
            if let Some(files) = &files {
                stage = common::load_stage(files, stage, &job.model, &ctx.groups)?;
            }
            // The microbatches of a step quantize each weight once (FP8 current scaling, blockwise).
            return Ok(RankModel::Stage(match job.microbatches > 1 {
                true => stage.keeping_weight_codes(),
                false => stage,
            }));
        }
        let mut model = job.model.init(device, &ctx.groups, &init).map_err(|e| fail(&e))?;
        if let Some(files) = &files {
            model = common::load(files, model, &ctx.groups)?;
        }
        if job.accumulation() > 1 {
            model.blocks_mut().for_each(sites::keep_weight_codes);
        }
        Ok(RankModel::Whole(model))
    }

    /// The trainer of `model`, resumed from the job's checkpoint if it names one.
    pub fn trainer<M: TrainModel>(&self, model: M, ctx: &RankContext) -> Result<Trainer<M>, String> {
        let job = &self.job;
        // Under pp each forward and backward is timed whole: the measured bubble.
        let timing = match job.dims().pp {
            1 => Timing::Off,
            _ => Timing::Synchronized,
        };
        let mut trainer = Trainer::new(model, &job.optimizer(), &ctx.groups, &ctx.device)
            .with_accumulation(job.accumulation())
            .and_then(|trainer| trainer.with_guard(job.config.guard.clone()))
            .map_err(|e| e.to_string())?
            .with_timing(timing);
        if let Some(dir) = &job.config.checkpoint.load {
            // Any layout's checkpoint: each rank reads its own pieces by their paths.
            let load = |model, optim: &mut _| checkpoint::load(dir, model, optim, &ctx.groups);
            trainer.restore(load).map_err(|e| e.to_string())?;
        }
        Ok(trainer)
    }

    /// This rank's sequences of `step`: inputs and targets.
    pub fn tokens(&self, step: usize, ctx: &RankContext) -> Result<crate::data::Tokens, String> {
        let (per_rank, seq) = (self.job.per_rank, self.job.seq);
        let first = ctx.groups.dp.group_rank() * per_rank;
        self.corpus.tokens(step, first, per_rank, seq)
    }

    /// [`tokens`](Self::tokens) as the training step takes them.
    pub fn token_batch(&self, tokens: crate::data::Tokens, device: &Device) -> Result<TokenBatch, String> {
        crate::data::token_batch(tokens, device)
    }

    /// The routine around each step on this rank, reporting through `reporter`, with `hook`
    /// after each step.
    pub fn routine<M: TrainModel>(
        &self,
        ctx: &RankContext,
        reporter: Box<dyn Reporter>,
        hook: Option<Hook<M>>,
    ) -> Result<Routine<M>, String> {
        let job = &self.job;
        let c = &job.config;
        let throughput = Throughput {
            tokens_per_step: job.global_batch * job.seq,
            flops_per_token: job.model.flops_per_token(job.seq),
            devices: job.dims().world_size(),
            peak_flops: (c.device == DeviceKind::Cuda).then_some(HOPPER_PEAK_FLOPS),
        };
        let saver = c.checkpoint.dir.as_ref().map(|dir| {
            Saver::new(dir)
                .with_interval(c.checkpoint.interval)
                .with_keep_last(c.checkpoint.keep_last)
                .in_background(c.checkpoint.async_save)
                .with_attachment("job.toml", c.to_toml().into_bytes())
        });
        let eval = match &self.held_out {
            Some(held) => {
                let device = ctx.device.clone();
                let first = ctx.groups.dp.group_rank() * job.per_rank;
                // Windows of their own: evaluation's "steps" start past any run's.
                (0..c.eval.batches)
                    .map(|b| held.token_batch(crate::data::EVAL_FIRST + b, first, job.per_rank, job.seq, &device))
                    .collect::<Result<_, _>>()?
            }
            None => Vec::new(),
        };
        let routine = Routine::new(&ctx.groups, &ctx.device, reporter, c.steps, throughput)
            .with_metrics(c.logging.metrics.clone())
            .map_err(|e| e.to_string())?
            .with_saver(saver)
            .with_eval(c.eval.interval, eval);
        Ok(match hook {
            Some(hook) => routine.with_hook(hook),
            None => routine,
        })
    }

    /// What runs after a step of the whole model: greedy samples ([`sample_hook`]) and, at the
    /// end, the Hugging Face export (`checkpoint.export`).
    ///
    /// [`sample_hook`]: Self::sample_hook
    pub fn hooks(&self, ctx: &RankContext) -> Option<Hook<Llama>> {
        let mut sample = self.sample_hook(ctx);
        let mut export = self.export_hook(ctx);
        if sample.is_none() && export.is_none() {
            return None;
        }
        Some(Box::new(move |model: &Llama, step: u64| {
            let mut lines = Vec::new();
            for hook in [&mut sample, &mut export].into_iter().flatten() {
                lines.extend(hook(model, step)?);
            }
            Ok((!lines.is_empty()).then(|| lines.join("\n")))
        }))
    }

    /// The trained model written as a Hugging Face directory after the last step, with the
    /// job's tokenizer (every rank takes part; global rank 0 writes).
    fn export_hook(&self, ctx: &RankContext) -> Option<Hook<Llama>> {
        let dir = self.job.config.checkpoint.export.clone()?;
        let (groups, config, last) = (ctx.groups.clone(), self.job.model.clone(), self.job.config.steps as u64);
        let data = &self.job.config.data;
        let tokenizer = data
            .tokenizer
            .clone()
            .or_else(|| self.job.config.model.hf.as_ref().map(|d| d.join("tokenizer.json")));
        Some(Box::new(move |model: &Llama, step: u64| {
            if step != last {
                return Ok(None);
            }
            let options = hf::ExportOptions::new();
            hf::save(&dir, model, &config, &groups, &options).map_err(|e| format!("{}: {e}", dir.display()))?;
            if groups.global_rank == 0
                && let Some(tokenizer) = tokenizer.as_ref().filter(|t| t.exists())
            {
                let to = dir.join("tokenizer.json");
                std::fs::copy(tokenizer, &to).map_err(|e| format!("{}: {e}", to.display()))?;
            }
            Ok(Some(format!("exported to {} (Hugging Face)", dir.display())))
        }))
    }

    /// Greedy samples of the whole model every `logging.sample_every` steps and at the end.
    pub fn sample_hook(&self, ctx: &RankContext) -> Option<Hook<Llama>> {
        let every = self.job.config.logging.sample_every.unwrap_or(0);
        if every == 0 {
            return None;
        }
        let (groups, device) = (ctx.groups.clone(), ctx.device.clone());
        let (prompt, pad, seq, last) = (
            self.prompt.clone(),
            self.pad,
            self.job.seq,
            self.job.config.steps as u64,
        );
        let decode = self.corpus.decoder();
        Some(Box::new(move |model: &Llama, step: u64| {
            if !(step.is_multiple_of(every as u64) || step == last) {
                return Ok(None);
            }
            // The model as inference sees it: no autodiff graph, and no amaxes recorded into
            // delayed FP8 histories.
            let text = sample::greedy(&model.valid(), &groups, &prompt, pad, 12, seq, &device)?;
            Ok(Some(format!("sample {:?} -> {:?}", decode(&prompt), decode(&text))))
        }))
    }
}
