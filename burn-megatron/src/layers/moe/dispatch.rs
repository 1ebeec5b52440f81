//! Token dispatch within one rank: the token copies (one a chosen expert) ordered by expert, and
//! back. The order is decided on the host from the experts' ids (read once: the experts' row
//! ranges are host numbers anyway), by expert and, within an expert, by slot (`token · k + j`).
//! Both directions are row gathers that know their inverse (`burn_megatron_kernels::rows`), so
//! the gradients are gathers too: to the tokens, to the experts and to the router's weights.
//!
//! Each expert's copies may be followed by fillers up to a multiple of the grouped product's tile
//! ([`row_alignment`]): a filler repeats its expert's first token and reads weight slot `t·k`,
//! one past the last, which [`unpermute`] reads as zero. It adds nothing to any token, and the
//! gradient reaching its row is zero.
//!
//! Legend: `t` tokens, `k` top k, `d` d_model, `e` experts.
//!
//! [`row_alignment`]: burn_megatron_kernels::grouped::row_alignment

use std::ops::Range;

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron_kernels::rows::{combine_rows, gather_rows};

/// Where each copy of a token goes.
#[derive(Clone, Debug)]
pub struct Dispatch {
    /// `[r]`: the slot (`token · k + j`) of each row, in expert order (fillers: `t·k`).
    pub slots: Tensor<1, Int>,
    /// `[r]`: the token of each row, in expert order.
    pub tokens: Tensor<1, Int>,
    /// `[t, k]`: the row of each slot, `r` (one past the last) for a copy left out.
    pub rows: Tensor<2, Int>,
    /// The rows each expert runs on, fillers included, on the host (its row range).
    pub counts: Vec<usize>,
    /// Each slot's expert, or `None` for a copy left out (dropped for capacity).
    pub kept: Vec<Option<usize>>,
}

impl Dispatch {
    /// The copies (fillers not counted) each of the `e` experts takes.
    pub fn copies(&self, e: usize) -> Vec<usize> {
        let mut copies = vec![0; e];
        for x in self.kept.iter().flatten() {
            copies[*x] += 1;
        }
        copies
    }
}

/// The dispatch of `experts` (`[t, k]`, values below `e`), each expert's rows padded with
/// fillers to a multiple of `align`.
pub fn dispatch(experts: Tensor<2, Int>, e: usize, align: usize) -> Dispatch {
    let [_, k] = experts.dims();
    let device = experts.device();
    let ids: Vec<i64> = experts.into_data().convert::<i64>().try_to_vec().expect("expert ids");
    let kept = ids.into_iter().map(|x| Some(x as usize)).collect();
    dispatch_host(kept, k, 0..e, align, &device)
}

/// The dispatch of the copies whose expert (`kept[slot]`, `None` for a dropped copy) lies in
/// `experts`: the copies of each expert of the range in slot order, then its fillers up to a
/// multiple of `align`; indices into the `[slots / k]` tokens.
pub fn dispatch_host(
    kept: Vec<Option<usize>>,
    k: usize,
    experts: Range<usize>,
    align: usize,
    device: &Device,
) -> Dispatch {
    let filler = kept.len() as i64;
    let mut by_expert: Vec<Vec<i64>> = vec![Vec::new(); experts.len()];
    for (slot, expert) in kept.iter().enumerate() {
        if let Some(x) = expert.filter(|x| experts.contains(x)) {
            by_expert[x - experts.start].push(slot as i64);
        }
    }
    let (mut slots, mut tokens, mut counts) = (Vec::new(), Vec::new(), Vec::new());
    for mine in by_expert {
        let fill = mine.len().next_multiple_of(align.max(1)) - mine.len();
        let first = mine.first().map_or(0, |s| s / k as i64);
        tokens.extend(mine.iter().map(|s| s / k as i64));
        tokens.extend(std::iter::repeat_n(first, fill));
        counts.push(mine.len() + fill);
        slots.extend(mine);
        slots.extend(std::iter::repeat_n(filler, fill));
    }
    let r = slots.len();
    let mut rows = vec![r as i64; kept.len()];
    for (row, &slot) in slots.iter().enumerate() {
        if slot != filler {
            rows[slot as usize] = row as i64;
        }
    }
    let int = |values: Vec<i64>, shape: [usize; 2]| Tensor::<2, Int>::from_data(TensorData::new(values, shape), device);
    Dispatch {
        slots: Tensor::<1, Int>::from_data(TensorData::new(slots, [r]), device),
        tokens: Tensor::<1, Int>::from_data(TensorData::new(tokens, [r]), device),
        rows: int(rows, [kept.len() / k, k]),
        counts,
        kept,
    }
}

/// Each token's row once for each of its experts, in expert order (a filler repeats its
/// expert's first token): `[t, d]` → `[r, d]`.
pub fn permute(x: Tensor<2>, dispatch: &Dispatch) -> Tensor<2> {
    gather_rows(x, dispatch.tokens.clone(), dispatch.rows.clone())
}

/// The experts' outputs `y` (`[r, d]`, a row a copy in expert order, fillers included) weighted
/// by `weights` (`[t, k]`) and summed into their tokens' rows: `[t, d]`. A copy left out adds
/// nothing; a filler's row is read by no token.
pub fn unpermute(y: Tensor<2>, weights: Tensor<2>, dispatch: &Dispatch) -> Tensor<2> {
    combine_rows(y, weights, dispatch.rows.clone(), dispatch.slots.clone())
}
