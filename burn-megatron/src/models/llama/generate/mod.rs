//! Generation with a KV cache: a batch of prompts of different lengths prefilled in one
//! forward pass, then decoded a token a step (`cache.rs`), each token chosen greedily or
//! sampled (`sample.rs`), until a stop token or the token budget. At any tp: every rank runs
//! the same steps on its heads and vocabulary share and draws the same tokens.

mod cache;
mod graph;
mod latent;
mod sample;
mod step;

pub use cache::KvCache;
pub use graph::{EAGER_BEFORE_GRAPH, Stepping};
pub use sample::{Draws, Sampling};

use std::time::Instant;

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron_dist::ProcessGroup;
use burn_megatron_kernels::failures;

use crate::error::{ConfigError, LayerError};
use crate::models::llama::Llama;

/// What [`generate`] does after the prompts.
#[derive(Clone, Debug)]
pub struct GenerateConfig {
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    /// Tokens that end a row (kept out of its output).
    pub stop: Vec<u32>,
    /// Fills the left of shorter prompts (masked: its value does not matter).
    pub pad: u32,
    pub seed: u64,
    /// Replay the decoding step as a CUDA graph where it can (`graph.rs`); eager otherwise.
    pub graphs: bool,
}

/// The tokens each prompt got, and how long the two phases took.
#[derive(Clone, Debug)]
pub struct Generated {
    /// Each prompt's new tokens, without the stop token.
    pub tokens: Vec<Vec<u32>>,
    /// Prompt positions prefilled (the batch times the longest prompt) and the seconds it took.
    pub prefill_tokens: usize,
    pub prefill_s: f64,
    /// Decoding steps run (each a token for every row) and their seconds.
    pub decode_steps: usize,
    pub decode_s: f64,
    /// How the decoding steps ran: eager (and why), or replayed as a CUDA graph.
    pub stepping: Stepping,
}

/// Generates after each of `prompts` (token ids; each at least one) with `model` (planned
/// without sequence parallelism) on `device`. Every rank of `tp` calls it with the same
/// arguments. Stops on a launch the device could not run (past its memory), read with each
/// step's tokens.
pub fn generate(
    model: &Llama,
    tp: &ProcessGroup,
    prompts: &[Vec<u32>],
    config: &GenerateConfig,
    device: &Device,
) -> Result<Generated, LayerError> {
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(ConfigError::Zero { what: "prompt tokens" }.into());
    }
    let (b, longest) = (prompts.len(), prompts.iter().map(Vec::len).max().unwrap_or(0));
    let mut cache = KvCache::new(model, b, longest + config.max_new_tokens, device)?;
    let mut ids = Vec::with_capacity(b * longest);
    let mut padding = Vec::with_capacity(b);
    for prompt in prompts {
        let pad = longest - prompt.len();
        ids.extend(std::iter::repeat_n(config.pad as i64, pad).chain(prompt.iter().map(|&t| t as i64)));
        padding.push((0..longest).map(|j| j < pad).collect::<Vec<_>>());
    }
    let begun = Instant::now();
    let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [b, longest]), device);
    let logits = model.forward_cached(ids, &padding, &mut cache)?;
    let [_, _, v] = logits.dims();
    let greedy = config.sampling.is_greedy();
    let mut stepper = graph::Stepper::new(model, tp, config.graphs, greedy);
    let mut next = stepper.choose(logits.narrow(1, longest - 1, 1).reshape([b, v]))?;
    // The tokens were read: a launch the device could not run is logged by now.
    failures::check(device)?;
    let prefill_s = begun.elapsed().as_secs_f64();

    let mut draws = sample::Draws::new(config.seed);
    let mut tokens = vec![Vec::new(); b];
    let mut done = vec![false; b];
    let (mut decode_steps, begun) = (0, Instant::now());
    for step in 0..config.max_new_tokens {
        let chosen: Vec<u32> = match next {
            graph::Next::Tokens(chosen) => chosen,
            graph::Next::Rows(rows) => rows.iter().map(|row| config.sampling.choose(row, &mut draws)).collect(),
        };
        for ((out, finished), &token) in tokens.iter_mut().zip(&mut done).zip(&chosen) {
            if *finished {
                continue;
            }
            match config.stop.contains(&token) {
                true => *finished = true,
                false => out.push(token),
            }
        }
        if done.iter().all(|d| *d) || step + 1 == config.max_new_tokens {
            break;
        }
        next = stepper.step(&chosen, &mut cache)?;
        failures::check(device)?;
        decode_steps += 1;
    }
    Ok(Generated {
        tokens,
        prefill_tokens: b * longest,
        prefill_s,
        decode_steps,
        decode_s: begun.elapsed().as_secs_f64(),
        stepping: stepper.stepping(),
    })
}
