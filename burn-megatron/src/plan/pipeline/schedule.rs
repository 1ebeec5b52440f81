//! Pipeline schedules as plain lists of actions, one list a pipeline rank: forwards and
//! backwards of (microbatch, model chunk) and the sends and receives between them. A schedule is
//! generated here, checked by [`simulate`](super::simulate::simulate) (which runs every rank's
//! list against the others and reports a deadlock, a missing or repeated step, or a message
//! nobody takes), and executed in order by the pipeline runtime (`models/llama/pipeline.rs`,
//! driven by `train --pp`).
//!
//! Layout (Megatron's): rank `r` of `pp` holds model chunks `r, r + pp, …` (`v` of them with
//! virtual stages), so virtual stage `s = chunk · pp + r` of `pp · v`; activations go from stage
//! `s` to `s + 1`, gradients back. Sends are buffered (a send returns at once; the receive
//! waits for it), as the communicator's point-to-point calls are.

use crate::error::ConfigError;

use super::PipelineSchedule;
use burn_megatron_dist::ProcessGroup;

/// What crosses between stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Payload {
    /// A stage's output, to the next stage's forward.
    Activation,
    /// The gradient of a stage's input, to the previous stage's backward.
    Gradient,
}

/// One thing a pipeline rank does, in its list's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// The forward of `microbatch` through this rank's model chunk `chunk`.
    Forward { microbatch: usize, chunk: usize },
    /// Its backward.
    Backward { microbatch: usize, chunk: usize },
    /// Sends the `payload` of `microbatch` at virtual stage `stage` to pipeline rank `peer`.
    Send {
        peer: usize,
        payload: Payload,
        microbatch: usize,
        stage: usize,
    },
    /// Waits for it.
    Recv {
        peer: usize,
        payload: Payload,
        microbatch: usize,
        stage: usize,
    },
}

/// A whole pipeline's actions: `ranks[r]` is pipeline rank `r`'s list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    pub pp: usize,
    /// Model chunks a rank (1 without virtual stages).
    pub chunks: usize,
    pub microbatches: usize,
    pub ranks: Vec<Vec<Action>>,
}

impl PipelineSchedule {
    /// Model chunks a rank.
    pub fn chunks(self) -> usize {
        match self {
            Self::Interleaved { virtual_stages } => virtual_stages,
            _ => 1,
        }
    }

    /// Checks that `microbatches` suit this schedule over `pp` ranks: at least one; with
    /// virtual stages, at least two chunks a rank and a whole number of rounds of `pp`
    /// microbatches (Megatron's interleaved schedule walks them `pp` at a time).
    pub fn check_microbatches(self, pp: usize, microbatches: usize) -> Result<(), ConfigError> {
        if pp == 0 || microbatches == 0 {
            return Err(ConfigError::Zero {
                what: "pipeline ranks and microbatches",
            });
        }
        match self {
            Self::Interleaved { virtual_stages } if virtual_stages < 2 => {
                Err(ConfigError::VirtualStages { virtual_stages })
            }
            Self::Interleaved { .. } if microbatches < pp || !microbatches.is_multiple_of(pp) => {
                Err(ConfigError::Microbatches { microbatches, pp })
            }
            _ => Ok(()),
        }
    }

    /// Every rank's actions for `microbatches` microbatches over `pp` ranks.
    pub fn actions(self, pp: usize, microbatches: usize) -> Result<Schedule, ConfigError> {
        self.check_microbatches(pp, microbatches)?;
        let v = self.chunks();
        let ranks = (0..pp)
            .map(|rank| {
                let order = self.compute_order(pp, microbatches, rank);
                with_messages(&order, pp, v, rank)
            })
            .collect();
        Ok(Schedule {
            pp,
            chunks: v,
            microbatches,
            ranks,
        })
    }

    /// Rank `rank`'s forwards and backwards in order, without the messages.
    fn compute_order(self, pp: usize, m: usize, rank: usize) -> Vec<Action> {
        let forward = |microbatch, chunk| Action::Forward { microbatch, chunk };
        let backward = |microbatch, chunk| Action::Backward { microbatch, chunk };
        match self {
            Self::GPipe => (0..m)
                .map(|i| forward(i, 0))
                .chain((0..m).map(|i| backward(i, 0)))
                .collect(),
            Self::OneForwardOneBackward => {
                // Warm-up forwards fill the pipeline below this rank; then one forward, one
                // backward; the cool-down drains the backwards.
                let warmup = (pp - rank - 1).min(m);
                let mut order: Vec<Action> = (0..warmup).map(|i| forward(i, 0)).collect();
                for i in warmup..m {
                    order.push(forward(i, 0));
                    order.push(backward(i - warmup, 0));
                }
                order.extend((m - warmup..m).map(|i| backward(i, 0)));
                order
            }
            Self::Interleaved { virtual_stages: v } => {
                // Virtual microbatch k (of m·v): chunk (k / pp) mod v, microbatch
                // (k / (pp·v))·pp + k mod pp; backwards walk the chunks from the last.
                let total = m * v;
                let unit = |k: usize, reverse: bool| {
                    let chunk = (k / pp) % v;
                    let chunk = if reverse { v - 1 - chunk } else { chunk };
                    ((k / (pp * v)) * pp + k % pp, chunk)
                };
                let warmup = ((pp - rank - 1) * 2 + (v - 1) * pp).min(total);
                let mut order = Vec::with_capacity(2 * total);
                for k in 0..warmup {
                    let (i, c) = unit(k, false);
                    order.push(forward(i, c));
                }
                for k in warmup..total {
                    let (i, c) = unit(k, false);
                    order.push(forward(i, c));
                    let (i, c) = unit(k - warmup, true);
                    order.push(backward(i, c));
                }
                for k in total - warmup..total {
                    let (i, c) = unit(k, true);
                    order.push(backward(i, c));
                }
                order
            }
        }
    }
}

/// `order` with the receive each step needs before it and the send it makes after it.
fn with_messages(order: &[Action], pp: usize, v: usize, rank: usize) -> Vec<Action> {
    let stages = pp * v;
    let stage = |chunk: usize| chunk * pp + rank;
    let mut out = Vec::with_capacity(3 * order.len());
    for &action in order {
        match action {
            Action::Forward { microbatch, chunk } => {
                let s = stage(chunk);
                if s > 0 && pp > 1 {
                    out.push(Action::Recv {
                        peer: (s - 1) % pp,
                        payload: Payload::Activation,
                        microbatch,
                        stage: s - 1,
                    });
                }
                out.push(action);
                if s + 1 < stages && pp > 1 {
                    out.push(Action::Send {
                        peer: (s + 1) % pp,
                        payload: Payload::Activation,
                        microbatch,
                        stage: s,
                    });
                }
            }
            Action::Backward { microbatch, chunk } => {
                let s = stage(chunk);
                if s + 1 < stages && pp > 1 {
                    out.push(Action::Recv {
                        peer: (s + 1) % pp,
                        payload: Payload::Gradient,
                        microbatch,
                        stage: s + 1,
                    });
                }
                out.push(action);
                if s > 0 && pp > 1 {
                    out.push(Action::Send {
                        peer: (s - 1) % pp,
                        payload: Payload::Gradient,
                        microbatch,
                        stage: s,
                    });
                }
            }
            other => out.push(other),
        }
    }
    out
}

/// This rank's actions of a schedule over `microbatches`, and the pipeline group they run on.
#[derive(Clone, Debug)]
pub struct StageSchedule {
    pub actions: Vec<Action>,
    pub microbatches: usize,
    pub pp: ProcessGroup,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_microbatch_counts_are_typed_errors() {
        let interleaved = PipelineSchedule::Interleaved { virtual_stages: 2 };
        assert_eq!(
            interleaved.check_microbatches(4, 2),
            Err(ConfigError::Microbatches { microbatches: 2, pp: 4 })
        );
        assert_eq!(
            interleaved.check_microbatches(4, 6),
            Err(ConfigError::Microbatches { microbatches: 6, pp: 4 })
        );
        assert_eq!(
            PipelineSchedule::Interleaved { virtual_stages: 1 }.check_microbatches(2, 4),
            Err(ConfigError::VirtualStages { virtual_stages: 1 })
        );
        assert!(PipelineSchedule::OneForwardOneBackward.check_microbatches(4, 2).is_ok());
        assert!(matches!(
            PipelineSchedule::GPipe.check_microbatches(2, 0),
            Err(ConfigError::Zero { .. })
        ));
    }
}
