//! Activation recomputation: which parts of a forward pass keep only their inputs and run
//! again during backward (Megatron's `recompute_granularity`, `recompute_method` and
//! `recompute_num_layers`), and the region that does it ([`recompute`], our own checkpointing:
//! Burn's is a device-wide choice of which ops keep their outputs, not a region of a model).
//!
//! Megatron's selective recomputation runs the core attention again and frees its output once
//! the output projection has read it (`CheckpointWithoutOutput`). A Burn tensor another node
//! keeps cannot be freed early, so here a selective region runs on through the next
//! projection: the core attention with the output projection, and the SwiGLU with the down
//! projection. Their outputs (the attention context, `[b, s, h·k/tp]`, and the SwiGLU's,
//! `[b, s, f/tp]`) are then kept by nobody; the regions' inputs (q, k, v, and the gate and up
//! projections) are kept as without recomputation.

use std::ops::Range;

use burn::config::Config;
use burn::tensor::{Gradients, Tensor};

use crate::error::ConfigError;

pub mod region;

pub use region::{Region, RegionOps, recompute};

/// What a model recomputes during backward.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum Recompute {
    /// Every activation kept.
    None,
    /// In every block, the core attention with the output projection, and the SwiGLU with the
    /// down projection (see the module's documentation).
    Selective,
    /// Whole blocks run again from their input.
    Full {
        method: RecomputeMethod,
        /// Blocks a group (uniform) or blocks recomputed (block), at least 1.
        layers: usize,
    },
}

/// Which blocks full recomputation covers, of a model's (or a pipeline chunk's) blocks.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum RecomputeMethod {
    /// The blocks in groups of `layers`, each group recomputed as one from its input (the last
    /// group may be shorter): the fewest kept inputs.
    Uniform,
    /// The first `layers` blocks each recomputed from its own input, the rest not: memory
    /// traded for speed block by block.
    Block,
}

impl Recompute {
    /// Checks the choice against a model of `n_layers` blocks.
    pub fn check(&self, n_layers: usize) -> Result<(), ConfigError> {
        match *self {
            Recompute::Full { layers, .. } if layers == 0 || layers > n_layers => {
                Err(ConfigError::RecomputeLayers { layers, n_layers })
            }
            _ => Ok(()),
        }
    }

    /// Whether blocks run their selective regions.
    pub fn selective(&self) -> bool {
        *self == Recompute::Selective
    }

    /// The blocks `0..n` in consecutive runs, each with whether it is recomputed as one region.
    pub fn groups(&self, n: usize) -> Vec<(Range<usize>, bool)> {
        let chunks = |size: usize, recomputed: bool| {
            (0..n)
                .step_by(size.max(1))
                .map(|start| (start..(start + size).min(n), recomputed))
                .collect::<Vec<_>>()
        };
        match *self {
            Recompute::None | Recompute::Selective => chunks(n.max(1), false)
                .into_iter()
                .filter(|(r, _)| !r.is_empty())
                .collect(),
            Recompute::Full {
                method: RecomputeMethod::Uniform,
                layers,
            } => chunks(layers, true),
            Recompute::Full {
                method: RecomputeMethod::Block,
                layers,
            } => {
                let cut = layers.min(n);
                let mut groups: Vec<_> = (0..cut).map(|i| (i..i + 1, true)).collect();
                if cut < n {
                    groups.push((cut..n, false));
                }
                groups
            }
        }
    }
}

/// The backward pass from `output` seeded with `grad`, the loss's gradient with respect to it
/// (what a recomputed region and a pipeline stage run): through `Σ output ⊙ grad`, whose
/// gradient with respect to `output` is exactly `grad`. The sum goes row by row, then over the
/// rows: Burn's sum of a whole tensor runs as one long reduction on CUDA (178 ms for llama-1b's
/// 16.7M-element block output on an H200).
///
/// # Shapes
/// `[n, w]`, `[n, w]`
pub fn seeded_backward(output: Tensor<2>, grad: Tensor<2>) -> Gradients {
    seeded_backward_with(output, grad, None)
}

/// [`seeded_backward`] with `extra` (a scalar of the same graph: a pipeline stage's router
/// losses) differentiated too.
pub fn seeded_backward_with(output: Tensor<2>, grad: Tensor<2>, extra: Option<Tensor<1>>) -> Gradients {
    let seeded = (output * grad).sum_dim(1).sum();
    match extra {
        Some(extra) => {
            let dtype = seeded.dtype();
            (seeded + extra.cast(dtype)).backward()
        }
        None => seeded.backward(),
    }
}

impl Recompute {
    /// The choice as [`FromStr`](std::str::FromStr) reads it.
    pub fn spec(&self) -> String {
        match self {
            Recompute::None => "none".into(),
            Recompute::Selective => "selective".into(),
            Recompute::Full {
                method: RecomputeMethod::Uniform,
                layers,
            } => format!("full:{layers}"),
            Recompute::Full {
                method: RecomputeMethod::Block,
                layers,
            } => format!("full-block:{layers}"),
        }
    }
}

impl std::str::FromStr for Recompute {
    type Err = String;

    /// `none`, `selective`, `full:N` (uniform, groups of N blocks) or `full-block:N` (the first
    /// N blocks).
    fn from_str(text: &str) -> Result<Self, String> {
        let full = |method, count: &str| {
            count
                .parse()
                .map(|layers| Recompute::Full { method, layers })
                .map_err(|_| format!("{text}: expected a block count after ':'"))
        };
        match text.split_once(':') {
            None if text == "none" => Ok(Recompute::None),
            None if text == "selective" => Ok(Recompute::Selective),
            Some(("full", count)) => full(RecomputeMethod::Uniform, count),
            Some(("full-block", count)) => full(RecomputeMethod::Block, count),
            _ => Err(format!("{text}: expected none, selective, full:N or full-block:N")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_follow_megatron_methods() {
        let uniform = |layers| Recompute::Full {
            method: RecomputeMethod::Uniform,
            layers,
        };
        let block = |layers| Recompute::Full {
            method: RecomputeMethod::Block,
            layers,
        };
        assert_eq!(Recompute::None.groups(3), vec![(0..3, false)]);
        assert_eq!(Recompute::Selective.groups(0), vec![]);
        assert_eq!(uniform(2).groups(5), vec![(0..2, true), (2..4, true), (4..5, true)]);
        assert_eq!(uniform(1).groups(2), vec![(0..1, true), (1..2, true)]);
        assert_eq!(block(2).groups(4), vec![(0..1, true), (1..2, true), (2..4, false)]);
        // A pipeline chunk with fewer blocks than asked recomputes all of them.
        assert_eq!(block(3).groups(2), vec![(0..1, true), (1..2, true)]);
        assert!(uniform(0).check(4).is_err());
        assert!(block(5).check(4).is_err());
        assert!(block(4).check(4).is_ok());
        assert_eq!("full:2".parse(), Ok(uniform(2)));
        assert_eq!("full-block:3".parse(), Ok(block(3)));
        assert_eq!("selective".parse(), Ok(Recompute::Selective));
        assert!("full".parse::<Recompute>().is_err());
        for text in ["none", "selective", "full:2", "full-block:3"] {
            assert_eq!(text.parse::<Recompute>().unwrap().spec(), text);
        }
    }
}
