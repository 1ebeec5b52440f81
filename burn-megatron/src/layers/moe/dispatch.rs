//! Token dispatch within one rank: the token copies (one a chosen expert) ordered by expert and, within an expert, by slot (`token · k + j`), and
//! back. Dropless, the order is decided on the device from the experts' ids
//! (`burn_megatron_kernels::order`): nothing reaches the host, the rows are given the most room
//! the copies may take, and the experts' groups are their starts on the device; with a
//! capacity, or for the all-gather dispatcher, the host decides it from the ids it reads.
//! Both directions are row gathers that know their inverse (`burn_megatron_kernels::rows`), so
//! the gradients are gathers too: to the tokens, to the experts and to the router's weights.
//!
//! Each expert's copies may be followed by fillers up to a multiple of the grouped product's tile
//! ([`row_alignment`]): a filler repeats its expert's first token and reads weight slot `t·k`,
//! one past the last, which [`unpermute`] reads as zero. It adds nothing to any token, and the
//! gradient reaching its row is zero. The rows past the last expert's are fillers of no expert.
//!
//! Legend: `t` tokens, `k` top k, `d` d_model, `e` experts.
//!
//! [`row_alignment`]: burn_megatron_kernels::grouped_gemm::row_alignment

use std::ops::Range;

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron_kernels::grouped_gemm::Groups;
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
    /// Each expert's rows, fillers included: their starts on the device where the order was
    /// decided there, their counts where the host decided it.
    pub groups: Groups,
    /// `[e]`: the copies (fillers not counted) each expert takes, on the device.
    pub copies: Tensor<1, Int>,
    /// Each slot's expert, `None` for a copy left out (dropped for capacity), where the host
    /// decided the order.
    pub kept: Option<Vec<Option<usize>>>,
}

/// The views of one index tensor: `[2r + t·k]` then what follows (an empty part a tensor of
/// its own, as Burn narrows to one entry at least).
fn views(indices: &Tensor<1, Int>, r: usize, n: usize, k: usize) -> (Tensor<1, Int>, Tensor<1, Int>, Tensor<2, Int>) {
    let device = indices.device();
    let part = |start: usize, len: usize| match len {
        0 => Tensor::<1, Int>::from_data(TensorData::new(Vec::<i64>::new(), [0]), &device),
        _ => indices.clone().narrow(0, start, len),
    };
    (part(0, r), part(r, r), part(2 * r, n).reshape([n / k, k]))
}

/// The dispatch of `experts` (`[t, k]`, values below `e`), each expert's rows padded with
/// fillers to a multiple of `align`, decided on their device: nothing is read to the host.
pub fn dispatch(experts: Tensor<2, Int>, e: usize, align: usize) -> Dispatch {
    let [t, k] = experts.dims();
    let n = t * k;
    let order = order_by_expert(experts, e, align);
    let r = order.rows;
    let (slots, tokens, rows) = views(&order.indices, r, n, k);
    Dispatch {
        slots,
        tokens,
        rows,
        groups: Groups::Starts(Box::new(order.indices.narrow(0, 2 * r + n, e + 1))),
        copies: order.copies,
        kept: None,
    }
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
    let (r, n, e) = (order.slots.len(), kept.len(), order.counts.len());
    let copies = order.copies.iter().map(|&c| c as i64);
    let indices: Vec<i64> = order.concatenated().into_iter().chain(copies).collect();
    let size = indices.len();
    let indices = Tensor::<1, Int>::from_data(TensorData::new(indices, [size]), device);
    let (slots, tokens, rows) = views(&indices, r, n, k);
    let copies = match e {
        0 => Tensor::<1, Int>::from_data(TensorData::new(Vec::<i64>::new(), [0]), device),
        _ => indices.narrow(0, 2 * r + n, e),
    };
    Dispatch {
        slots,
        tokens,
        rows,
        groups: Groups::Counts(order.counts),
        copies,
        kept: Some(kept),
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

    /// The order decided where the ids are and the one decided on the host from the ids read
    /// hold the same indices (the device's followed by fillers of no expert in the room it is
    /// given), with the same groups and copies.
    #[test]
    fn both_paths_agree() {
        let device = Device::flex();
        let ids = Tensor::<2, Int>::from_data(TensorData::new(vec![1i64, 0, 1, 2, 0, 1], [3, 2]), &device);
        let on_device = dispatch(ids.clone(), 4, 2);
        let on_host = dispatch_host(read_experts(ids), 2, 0..4, 2, &device);
        let host = |t: Tensor<1, Int>| t.into_data().convert::<i64>().try_to_vec::<i64>().unwrap();
        // 6 copies in 4 experts padded to 2: at most 6 + 4 rows.
        let tail = |mut v: Vec<i64>, filler: i64| {
            v.resize(10, filler);
            v
        };
        assert_eq!(host(on_device.slots.clone()), tail(host(on_host.slots), 6));
        assert_eq!(host(on_device.tokens.clone()), tail(host(on_host.tokens), 0));
        assert_eq!(on_device.rows.dims(), [3, 2]);
        assert_eq!(host(on_device.rows.reshape([6])), host(on_host.rows.reshape([6])));
        assert!(matches!(on_device.groups, Groups::Starts(_)));
        assert_eq!(on_device.groups.counts(), vec![2, 4, 2, 0]);
        assert_eq!(on_host.groups.counts(), vec![2, 4, 2, 0]);
        assert_eq!(host(on_device.copies), vec![2, 3, 1, 0]);
        assert_eq!(host(on_host.copies), vec![2, 3, 1, 0]);
        assert!(on_device.kept.is_none() && on_host.kept.is_some());
    }
}
