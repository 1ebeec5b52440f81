//! Expert capacity: dropless by default; with a capacity factor each expert takes at most
//! `⌈factor · t·k / e⌉` token copies and drops the rest (Megatron's `moe_expert_capacity_factor`).
//! A dropped copy adds nothing to its token's output, so the token passes on through the
//! residual alone. Which copies an expert keeps: its highest-weighted (`Probs`, Megatron's
//! default) or its earliest tokens (`Position`); ties go to the earlier token.
//!
//! Legend: `t` tokens, `k` top k, `e` experts.

use burn::config::Config;
use burn::tensor::{Int, Tensor};

use super::dispatch::{Dispatch, dispatch_host};
use crate::error::ConfigError;

/// Which copies an over-full expert keeps.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum DropPolicy {
    Probs,
    Position,
}

/// An expert capacity.
#[derive(Config, Debug, Copy, PartialEq)]
pub struct Capacity {
    /// Capacity as a multiple of the balanced load `t·k / e` (above 0).
    pub factor: f64,
    #[config(default = "DropPolicy::Probs")]
    pub policy: DropPolicy,
    /// Pad every expert's rows to the capacity with zeros (fixed shapes; the same values).
    #[config(default = false)]
    pub pad: bool,
}

impl Capacity {
    pub fn check(&self) -> Result<(), ConfigError> {
        match self.factor.is_finite() && self.factor > 0.0 {
            true => Ok(()),
            false => Err(ConfigError::CapacityFactor { factor: self.factor }),
        }
    }

    /// The copies one expert takes at most.
    pub fn per_expert(&self, tokens: usize, k: usize, e: usize) -> usize {
        (self.factor * (tokens * k) as f64 / e as f64).ceil() as usize
    }
}

/// The dispatch of `experts` (`[t, k]`) with each expert cut to `capacity` copies by the
/// policy, reading `weights` (`[t, k]`), each expert's rows padded with fillers to a multiple of
/// `align`; and the number of copies dropped. Decided on the host, where the counts are read
/// anyway.
pub fn dispatch_with_capacity(
    experts: Tensor<2, Int>,
    weights: &Tensor<2>,
    e: usize,
    capacity: &Capacity,
    align: usize,
) -> (Dispatch, usize) {
    let [t, k] = experts.dims();
    let device = experts.device();
    let chosen: Vec<i64> = experts.into_data().convert::<i64>().try_to_vec().expect("expert ids");
    let weight: Vec<f32> = weights
        .clone()
        .detach()
        .into_data()
        .convert::<f32>()
        .try_to_vec()
        .expect("weights");
    let limit = capacity.per_expert(t, k, e);
    let mut kept = vec![None; t * k];
    for expert in 0..e {
        // This expert's copies in token order, then the ones it keeps.
        let mut mine: Vec<usize> = (0..t * k).filter(|&s| chosen[s] == expert as i64).collect();
        if mine.len() > limit && capacity.policy == DropPolicy::Probs {
            mine.sort_by(|&a, &b| weight[b].total_cmp(&weight[a]).then(a.cmp(&b)));
        }
        mine.iter().take(limit).for_each(|&s| kept[s] = Some(expert));
    }
    let dropped = kept.iter().filter(|x| x.is_none()).count();
    (dispatch_host(kept, k, 0..e, align, &device), dropped)
}
