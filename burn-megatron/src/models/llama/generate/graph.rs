//! The decoding loop's steps: launched op by op (eager), or on CUDA recorded once as a graph
//! and replayed, the tokens and the position rewritten in their device buffers between
//! replays. A replay is one launch where an eager step launches some twenty kernels a block
//! through Burn's dispatch, each with its host cost.
//!
//! The first [`EAGER_BEFORE_GRAPH`] steps run eagerly (Burn autotunes its matmuls and
//! reductions for the step's shapes on first use, and autotuning reads the device). The next is
//! the capture's warm-up, run for real on the graph's input buffers; the graph is recorded right
//! after it (recording executes nothing), and every later step replays it. A model the graph
//! cannot serve (tp > 1: the collectives; a mixture of experts: its dispatch reads counts to the
//! host) or a refusal from the runtime keeps every step eager, with the reason in
//! [`Stepping::Eager`].

use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_megatron_dist::ProcessGroup;
use burn_megatron_dist::mappings::gather_from_tp;
use burn_megatron_kernels::cuda::graph::{Graph, Recorder, overwrite, overwrite_int};
use burn_megatron_kernels::decode::{greedy, positions};

use super::cache::KvCache;
use super::cache::StepInputs;
use crate::error::LayerError;
use crate::models::llama::Llama;

/// Eager steps before the capture's warm-up.
pub const EAGER_BEFORE_GRAPH: usize = 2;

/// How a generation's decoding steps ran.
#[derive(Clone, Debug, PartialEq)]
pub enum Stepping {
    /// Every step launched its kernels one by one, for this reason.
    Eager(String),
    /// Steps from `from` (counted from 0) on replayed one CUDA graph.
    Graphed { from: usize },
}

/// What a step hands the sampler: each row's token chosen on the device (greedy), or each
/// row's logits over the whole vocabulary on the host.
pub(super) enum Next {
    Tokens(Vec<u32>),
    Rows(Vec<Vec<f32>>),
}

/// A recorded step: its input buffers, its output buffer, the graph.
struct Recorded {
    graph: Graph,
    inputs: StepInputs,
    output: Tensor<2>,
}

enum Mode {
    Eager(String),
    /// Eager until the capture.
    Warming,
    Graphed {
        recorded: Box<Recorded>,
        from: usize,
    },
}

/// Runs the decoding steps of one generation.
pub(super) struct Stepper<'a> {
    model: &'a Llama,
    tp: &'a ProcessGroup,
    mode: Mode,
    steps: usize,
    /// Whether each row's token is chosen on the device (greedy).
    greedy: bool,
}

impl<'a> Stepper<'a> {
    pub fn new(model: &'a Llama, tp: &'a ProcessGroup, graphs: bool, greedy: bool) -> Self {
        let weight = model.embedding.weight.val();
        let mode = if !graphs {
            Mode::Eager("CUDA graphs turned off".into())
        } else if tp.size() > 1 {
            Mode::Eager("tp > 1: the collectives are not recorded into graphs".into())
        } else if !model.decodes_by_kernels() {
            Mode::Eager("latent attention decodes by cached passes, not the step kernels a graph records".into())
        } else if model.layers.iter().any(|block| block.moe.is_some()) {
            Mode::Eager("a mixture of experts reads its dispatch counts to the host every step".into())
        } else if let Err(error) = Recorder::on(&weight) {
            Mode::Eager(error.to_string())
        } else {
            Mode::Warming
        };
        Self {
            model,
            tp,
            mode,
            steps: 0,
            greedy,
        }
    }

    /// How the steps so far ran.
    pub fn stepping(&self) -> Stepping {
        match &self.mode {
            Mode::Eager(why) => Stepping::Eager(why.clone()),
            Mode::Warming => Stepping::Eager(format!("{} steps or fewer: no graph recorded", EAGER_BEFORE_GRAPH)),
            Mode::Graphed { from, .. } => Stepping::Graphed { from: *from },
        }
    }

    /// What the logits `[b, v']` of each row's last position give the sampler.
    pub fn choose(&self, logits: Tensor<2>) -> Result<Next, LayerError> {
        self.output(logits).map(|out| self.read(out))
    }

    /// One step: `tokens` (a row each) at the cache's next position.
    pub fn step(&mut self, tokens: &[u32], cache: &mut KvCache) -> Result<Next, LayerError> {
        let step = self.steps;
        self.steps += 1;
        let ids: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
        if let Mode::Graphed { recorded, .. } = &self.mode {
            cache.check_step(self.model)?;
            overwrite_int(&recorded.inputs.ids, &ids)?;
            overwrite(&recorded.inputs.position, &[cache.len() as f32])?;
            // SAFETY: `recorded` holds the graph's inputs and output and `cache` its blocks;
            // this stepper is their one user and rewrites them only with `overwrite`, on this
            // thread.
            unsafe { recorded.graph.replay() }?;
            cache.advance();
            return Ok(self.read(recorded.output.clone()));
        }
        let device = self.model.embedding.weight.val().device();
        let inputs = StepInputs {
            ids: Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [ids.len(), 1]), &device),
            position: positions(&[cache.len()], &device),
            first: positions(&cache.first_tokens(), &device),
        };
        if !matches!(self.mode, Mode::Warming) || step < EAGER_BEFORE_GRAPH {
            return self.eager(&inputs, cache);
        }
        let (next, recorded) = self.record(inputs, cache)?;
        self.mode = match recorded {
            Ok(recorded) => Mode::Graphed {
                recorded: Box::new(recorded),
                from: step + 1,
            },
            Err(why) => Mode::Eager(why),
        };
        Ok(next)
    }

    /// The capture's warm-up (a real step on the graph's input buffers), then the recording:
    /// the warm-up's choice, and the recorded step or why there is none. Both run on a copy of
    /// the cache, which becomes the cache once the graph exists: a refused recording leaves
    /// the buffers it would have written failed (CubeCL marks them so that no read returns
    /// bytes nothing wrote), so the step is run again on the untouched original.
    fn record(&self, inputs: StepInputs, cache: &mut KvCache) -> Result<(Next, Result<Recorded, String>), LayerError> {
        let mut copy = cache.duplicate();
        let recorder = Recorder::on(&self.model.embedding.weight.val()).and_then(|r| r.prepare().map(|_| r));
        let recorder = match recorder {
            Ok(recorder) => recorder,
            Err(error) => return Ok((self.eager(&inputs, cache)?, Err(error.to_string()))),
        };
        let next = self.eager(&inputs, &mut copy)?;
        let run = || {
            let logits = copy.record_step(self.model, &inputs)?;
            let [b, _, v] = logits.dims();
            self.output(logits.reshape([b, v]))
        };
        let why = match recorder.record(run) {
            Ok((Ok(output), graph)) => {
                *cache = copy;
                return Ok((next, Ok(Recorded { graph, inputs, output })));
            }
            Ok((Err(error), _)) => error.to_string(),
            Err(error) => error.to_string(),
        };
        Ok((self.eager(&inputs, cache)?, Err(why)))
    }

    fn eager(&self, inputs: &StepInputs, cache: &mut KvCache) -> Result<Next, LayerError> {
        let logits = cache.step(self.model, inputs)?;
        let [b, _, v] = logits.dims();
        self.choose(logits.reshape([b, v]))
    }

    /// The device's answer to `logits` `[b, v']`: `[b, 1]` f32 token ids when greedy, else
    /// `[b, vocab]` f32 logits over the whole vocabulary.
    fn output(&self, logits: Tensor<2>) -> Result<Tensor<2>, LayerError> {
        let vocab = self.model.embedding.vocab_size;
        let whole = gather_from_tp(logits, self.tp, 1)?;
        Ok(match self.greedy {
            true => greedy(whole, vocab),
            false => whole.narrow(1, 0, vocab).cast(DType::F32),
        })
    }

    fn read(&self, output: Tensor<2>) -> Next {
        let [b, v] = output.dims();
        let values = output
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .expect("f32 output");
        match self.greedy {
            true => Next::Tokens(values.into_iter().map(|t| t as u32).collect()),
            false => Next::Rows((0..b).map(|i| values[i * v..(i + 1) * v].to_vec()).collect()),
        }
    }
}
