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
    Order::new(read_experts(experts), k, 0..e, align).upload(&device)
}

/// Each slot's expert (`[t, k]` read in one copy to the host).
pub fn read_experts(experts: Tensor<2, Int>) -> Vec<Option<usize>> {
    let ids: Vec<i64> = experts.into_data().convert::<i64>().try_to_vec().expect("expert ids");
    ids.into_iter().map(|x| Some(x as usize)).collect()
}

/// [`Order::new`], uploaded.
pub fn dispatch_host(
    kept: Vec<Option<usize>>,
    k: usize,
    experts: Range<usize>,
    align: usize,
    device: &Device,
) -> Dispatch {
    Order::new(kept, k, experts, align).upload(device)
}

/// A dispatch decided on the host, before its indices go to the device.
#[derive(Clone, Debug)]
pub struct Order {
    slots: Vec<i64>,
    tokens: Vec<i64>,
    rows: Vec<i64>,
    k: usize,
    counts: Vec<usize>,
    kept: Vec<Option<usize>>,
}

impl Order {
    /// The dispatch of the copies whose expert (`kept[slot]`, `None` for a dropped copy) lies
    /// in `experts`: the copies of each expert of the range in slot order, then its fillers up
    /// to a multiple of `align`; indices into the `[slots / k]` tokens.
    pub fn new(kept: Vec<Option<usize>>, k: usize, experts: Range<usize>, align: usize) -> Self {
        let filler = kept.len() as i64;
        let local = |x: &Option<usize>| x.filter(|x| experts.contains(x)).map(|x| x - experts.start);
        // Each expert's copies, its rows (fillers included) and where they start.
        let mut copies = vec![0usize; experts.len()];
        for x in kept.iter().filter_map(local) {
            copies[x] += 1;
        }
        let counts: Vec<usize> = copies.iter().map(|c| c.next_multiple_of(align.max(1))).collect();
        let starts: Vec<usize> = counts
            .iter()
            .scan(0, |at, &n| {
                *at += n;
                Some(*at - n)
            })
            .collect();
        let r = counts.iter().sum();
        let (mut slots, mut tokens, mut rows) = (vec![filler; r], vec![0i64; r], vec![r as i64; kept.len()]);
        // One pass in slot order keeps each expert's copies in slot order.
        let mut next = starts.clone();
        for (slot, x) in kept.iter().enumerate() {
            if let Some(x) = local(x) {
                let row = next[x];
                next[x] += 1;
                slots[row] = slot as i64;
                tokens[row] = (slot / k) as i64;
                rows[slot] = row as i64;
            }
        }
        // A filler repeats its expert's first token (token 0 for an expert without copies).
        for x in 0..counts.len() {
            let first = if copies[x] > 0 { tokens[starts[x]] } else { 0 };
            tokens[next[x]..starts[x] + counts[x]].fill(first);
        }
        Self {
            slots,
            tokens,
            rows,
            k,
            counts,
            kept,
        }
    }

    /// The indices on `device`, in one upload: slots, tokens and rows one after another, each
    /// a view of it (a copy where CubeCL cannot place a view at its offset).
    pub fn upload(self, device: &Device) -> Dispatch {
        let (r, n) = (self.slots.len(), self.rows.len());
        let mut all = self.slots;
        all.extend(self.tokens);
        all.extend(self.rows);
        let all = Tensor::<1, Int>::from_data(TensorData::new(all, [2 * r + n]), device);
        // Burn narrows to one entry at least: an empty part is a tensor of its own.
        let part = |start: usize, len: usize| match len {
            0 => Tensor::<1, Int>::from_data(TensorData::new(Vec::<i64>::new(), [0]), device),
            _ => all.clone().narrow(0, start, len),
        };
        Dispatch {
            slots: part(0, r),
            tokens: part(r, r),
            rows: part(2 * r, n).reshape([n / self.k, self.k]),
            counts: self.counts,
            kept: self.kept,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Each expert's copies in slot order, then its fillers (its first token, slot `t·k`); a
    /// dropped copy's row is one past the last; an expert outside the range takes no row.
    #[test]
    fn orders_copies_by_expert_then_slot() {
        let kept = vec![Some(1), Some(0), None, Some(1), Some(2), Some(1)];
        let order = Order::new(kept, 2, 0..2, 2);
        assert_eq!(order.counts, vec![2, 4]);
        assert_eq!(order.slots, vec![1, 6, 0, 3, 5, 6]);
        assert_eq!(order.tokens, vec![0, 0, 0, 1, 2, 0]);
        assert_eq!(order.rows, vec![2, 0, 6, 3, 6, 4]);
        let dispatch = order.upload(&Device::flex());
        assert_eq!(dispatch.rows.dims(), [3, 2]);
        assert_eq!(dispatch.copies(3), vec![1, 3, 1]);
    }
}
