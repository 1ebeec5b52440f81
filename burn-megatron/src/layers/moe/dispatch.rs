//! Token dispatch within one rank: the token copies (one a chosen expert) ordered by expert, and
//! back. Sorting by `expert · t·k + slot` orders the copies by expert and, within an expert, by
//! token, whatever the sort's stability. Both directions are tensor ops (`select`, and
//! `select_assign` adding each copy's weighted output into its token's row), so the gradients
//! flow through them: to the tokens, to the experts and to the router's weights.
//!
//! Legend: `t` tokens, `k` top k, `d` d_model, `e` experts.

use burn::tensor::{Device, IndexingUpdateOp, Int, Tensor, TensorData};

use super::router::counts;

/// Where each copy of a token goes.
#[derive(Clone, Debug)]
pub struct Dispatch {
    /// `[t·k]`: the slot (`token · k + j`) of each copy, in expert order.
    pub slots: Tensor<1, Int>,
    /// `[t·k]`: the token of each copy, in expert order.
    pub tokens: Tensor<1, Int>,
    /// The copies each expert receives, on the host (the experts' row ranges).
    pub counts: Vec<usize>,
}

impl Dispatch {
    /// The same dispatch with each expert's copies followed by filler copies up to a multiple
    /// of `align` (the grouped product's tile, [`row_alignment`]), `counts` counting them. A
    /// filler repeats its expert's first token and reads weight slot `slots_total` (one past
    /// the last), which [`unpermute`] reads as zero: it adds nothing to any token, and the
    /// gradient reaching its row is zero.
    ///
    /// [`row_alignment`]: burn_megatron_kernels::grouped::row_alignment
    pub fn aligned(self, align: usize, slots_total: usize) -> Dispatch {
        if align <= 1 || self.counts.iter().all(|n| n.is_multiple_of(align)) {
            return self;
        }
        let device = self.slots.device();
        let host = |t: Tensor<1, Int>| -> Vec<i64> { t.into_data().convert::<i64>().try_to_vec().expect("indices") };
        let (slots, tokens) = (host(self.slots), host(self.tokens));
        let (mut padded_slots, mut padded_tokens, mut counts) = (Vec::new(), Vec::new(), Vec::new());
        let mut start = 0;
        for &n in &self.counts {
            let fill = n.next_multiple_of(align) - n;
            padded_slots.extend(&slots[start..start + n]);
            padded_tokens.extend(&tokens[start..start + n]);
            padded_slots.extend(std::iter::repeat_n(slots_total as i64, fill));
            padded_tokens.extend(std::iter::repeat_n(tokens.get(start).copied().unwrap_or(0), fill));
            counts.push(n + fill);
            start += n;
        }
        let tensor = |values: Vec<i64>| {
            let n = values.len();
            Tensor::<1, Int>::from_data(TensorData::new(values, [n]), &device)
        };
        Dispatch {
            slots: tensor(padded_slots),
            tokens: tensor(padded_tokens),
            counts,
        }
    }

    /// Each slot's expert (`routing.experts` read at the slot), or `None` for a copy this
    /// dispatch leaves out (dropped for capacity).
    pub fn kept(&self, routing: &super::Routing) -> Vec<Option<usize>> {
        let chosen: Vec<i64> = routing
            .experts
            .clone()
            .into_data()
            .convert::<i64>()
            .try_to_vec()
            .expect("ids");
        let slots: Vec<i64> = self
            .slots
            .clone()
            .into_data()
            .convert::<i64>()
            .try_to_vec()
            .expect("slots");
        let mut kept = vec![None; chosen.len()];
        for slot in slots {
            kept[slot as usize] = Some(chosen[slot as usize] as usize);
        }
        kept
    }
}

/// The dispatch of `experts` (`[t, k]`, values below `e`).
pub fn dispatch(experts: Tensor<2, Int>, e: usize) -> Dispatch {
    let [t, k] = experts.dims();
    let device = experts.device();
    let flat = experts.clone().reshape([t * k]);
    let key = flat.mul_scalar((t * k) as i64) + Tensor::<1, Int>::arange(0..(t * k) as i64, &device);
    let (_, slots) = key.sort_with_indices(0);
    let tokens = slots.clone().div_scalar(k as i64);
    let counts = counts(experts, e)
        .into_data()
        .convert::<i64>()
        .try_to_vec::<i64>()
        .expect("counts")
        .into_iter()
        .map(|c| c as usize)
        .collect();
    Dispatch { slots, tokens, counts }
}

/// The dispatch of the copies whose expert (`kept[slot]`, `None` for a dropped copy) lies in
/// `experts`, built on the host: the copies of each expert of the range in slot order, each
/// expert's count, indices into the `[slots / k]` tokens.
pub fn dispatch_host(kept: &[Option<usize>], k: usize, experts: std::ops::Range<usize>, device: &Device) -> Dispatch {
    let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); experts.len()];
    for (slot, expert) in kept.iter().enumerate() {
        if let Some(x) = expert.filter(|x| experts.contains(x)) {
            by_expert[x - experts.start].push(slot);
        }
    }
    let counts = by_expert.iter().map(Vec::len).collect();
    let slots: Vec<i64> = by_expert.into_iter().flatten().map(|s| s as i64).collect();
    let tokens = slots.iter().map(|&s| s / k as i64).collect();
    let tensor = |values: Vec<i64>| {
        let n = values.len();
        Tensor::<1, Int>::from_data(TensorData::new(values, [n]), device)
    };
    Dispatch {
        slots: tensor(slots),
        tokens: tensor(tokens),
        counts,
    }
}

/// Each token's row once for each of its experts, in expert order: `[t, d]` → `[t·k, d]`.
pub fn permute(x: Tensor<2>, dispatch: &Dispatch) -> Tensor<2> {
    x.select(0, dispatch.tokens.clone())
}

/// The experts' outputs `y` (a row a copy, expert order) weighted by `weights` (`[t, k]`) and
/// summed into their tokens' rows: `[t, d]`.
pub fn unpermute(y: Tensor<2>, weights: Tensor<2>, dispatch: &Dispatch) -> Tensor<2> {
    let [t, k] = weights.dims();
    let [_, d] = y.dims();
    // Slot t·k, one past the last, is a zero weight: the fillers of an aligned dispatch read it.
    let zero = Tensor::zeros([1], (&weights.device(), weights.dtype()));
    let sorted = Tensor::cat(vec![weights.reshape([t * k]), zero], 0)
        .select(0, dispatch.slots.clone())
        .cast(y.dtype());
    let weighted = y.clone() * sorted.unsqueeze_dim::<2>(1);
    Tensor::zeros([t, d], (&y.device(), y.dtype())).select_assign(
        0,
        dispatch.tokens.clone(),
        weighted,
        IndexingUpdateOp::Add,
    )
}
