//! Token dispatch within one rank: the token copies (one a chosen expert) ordered by expert and, within an expert, by slot (`token · k + j`), and
//! back. Dropless, the order is decided on the device from the experts' ids
//! (`burn_megatron_kernels::order`; only each expert's copies reach the host, to size the rows);
//! with a capacity, or for the all-gather dispatcher, the host decides it from the ids it reads.
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
use burn_megatron_kernels::order::{HostOrder, order_by_expert};
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
    /// The copies (fillers not counted) each expert takes.
    pub copies: Vec<usize>,
    /// Each slot's expert, `None` for a copy left out (dropped for capacity), where the host
    /// decided the order.
    pub kept: Option<Vec<Option<usize>>>,
}

impl Dispatch {
    /// Slots, tokens and rows as views of `indices` (`[2r + t·k]`, one upload or one kernel's
    /// output; an empty part a tensor of its own, as Burn narrows to one entry at least).
    fn of(
        indices: Tensor<1, Int>,
        k: usize,
        counts: Vec<usize>,
        copies: Vec<usize>,
        kept: Option<Vec<Option<usize>>>,
    ) -> Self {
        let r: usize = counts.iter().sum();
        let n = indices.dims()[0] - 2 * r;
        let device = indices.device();
        let part = |start: usize, len: usize| match len {
            0 => Tensor::<1, Int>::from_data(TensorData::new(Vec::<i64>::new(), [0]), &device),
            _ => indices.clone().narrow(0, start, len),
        };
        Dispatch {
            slots: part(0, r),
            tokens: part(r, r),
            rows: part(2 * r, n).reshape([n / k, k]),
            counts,
            copies,
            kept,
        }
    }
}

/// The dispatch of `experts` (`[t, k]`, values below `e`), each expert's rows padded with
/// fillers to a multiple of `align`, decided on their device.
pub fn dispatch(experts: Tensor<2, Int>, e: usize, align: usize) -> Dispatch {
    let [_, k] = experts.dims();
    let order = order_by_expert(experts, e, align);
    Dispatch::of(order.indices, k, order.counts, order.copies, None)
}

/// Each slot's expert (`[t, k]` read in one copy to the host).
pub fn read_experts(experts: Tensor<2, Int>) -> Vec<Option<usize>> {
    let ids: Vec<i64> = experts.into_data().convert::<i64>().try_to_vec().expect("expert ids");
    ids.into_iter().map(|x| Some(x as usize)).collect()
}

/// The dispatch of the copies whose expert (`kept[slot]`, `None` for a dropped copy) lies in
/// `experts`, decided on the host ([`HostOrder`]) and uploaded in one tensor.
pub fn dispatch_host(
    kept: Vec<Option<usize>>,
    k: usize,
    experts: Range<usize>,
    align: usize,
    device: &Device,
) -> Dispatch {
    let order = HostOrder::new(&kept, k, experts, align);
    let indices = order.concatenated();
    let n = indices.len();
    let indices = Tensor::<1, Int>::from_data(TensorData::new(indices, [n]), device);
    Dispatch::of(indices, k, order.counts, order.copies, Some(kept))
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

    /// The order decided where the ids are and the one decided on the host from the ids read
    /// hold the same indices, in the same views, with the same counts.
    #[test]
    fn both_paths_agree() {
        let device = Device::flex();
        let ids = Tensor::<2, Int>::from_data(TensorData::new(vec![1i64, 0, 1, 2, 0, 1], [3, 2]), &device);
        let on_device = dispatch(ids.clone(), 4, 2);
        let on_host = dispatch_host(read_experts(ids), 2, 0..4, 2, &device);
        let host = |t: Tensor<1, Int>| t.into_data().convert::<i64>().try_to_vec::<i64>().unwrap();
        assert_eq!(host(on_device.slots.clone()), host(on_host.slots));
        assert_eq!(host(on_device.tokens.clone()), host(on_host.tokens));
        assert_eq!(on_device.rows.dims(), [3, 2]);
        assert_eq!(host(on_device.rows.reshape([6])), host(on_host.rows.reshape([6])));
        assert_eq!(on_device.counts, vec![2, 4, 2, 0]);
        assert_eq!(on_device.copies, vec![2, 3, 1, 0]);
        assert_eq!(on_device.copies, on_host.copies);
        assert!(on_device.kept.is_none() && on_host.kept.is_some());
    }
}
