//! A mixture of experts' dispatch order, [`OrderOps`]: the token copies (slot `s = token·k + j`
//! chose expert `ids[s]`) in expert order and, within an expert, in slot order, each expert's
//! rows followed by fillers up to a multiple of `align` (the grouped product's tile). Four
//! index lists, one after another in one int tensor of `2r + n + e + 1`:
//!
//! - `slots[ρ]`: the slot row `ρ` holds (a filler: `n`, one past the last);
//! - `tokens[ρ]`: its token (a filler: its expert's first token, token 0 for an expert without
//!   copies);
//! - `rows[s]`: the row of slot `s` (`r`, one past the last, for a copy left out);
//! - `starts[x]`: expert `x`'s first row, and `starts[e]` the end of the last expert's rows.
//!
//! `r` is the room the rows are given: decided where the ids are, it is the most the experts'
//! padded rows can take ([`room`]), so that no count has to reach the host; the rows past
//! `starts[e]` are fillers of no expert (slot `n`, token 0).
//!
//! On CUDA two kernels decide it on the device: one counts each expert's copies, one places
//! them (a block an expert: each thread counts its run of slots, a scan over the block gives
//! each thread where its copies start, a second pass writes them). Neither the ids nor the
//! counts travel to the host. Elsewhere the host builds it ([`HostOrder`]), which is also the
//! kernels' oracle and the order of dispatches that are decided on the host anyway (capacity,
//! the all-gather dispatcher).
//!
//! Legend: `n` slots (`t·k`), `e` experts, `r` rows (the copies, fillers included).

use std::ops::Range;

use burn::backend::tensor::IntTensor;
use burn::backend::{Autodiff, Backend, Flex};
use burn::tensor::{Int, Tensor, TensorData};

#[cfg(feature = "cuda")]
pub(crate) mod kernel;

extension! {
    /// The backend extension behind [`order_by_expert`].
    pub trait OrderOps, cuda: kernel;

    /// The copies each of the `e` experts takes.
    ///
    /// # Shapes
    /// `ids`: `[n]` → `[e]`
    fn expert_copies(ids: IntTensor<Self>, e: usize) -> IntTensor<Self> {
        let order = HostOrder::new(&host_ids(ids), 1, 0..e, 1);
        host_tensor(order.copies.iter().map(|&c| c as i64).collect())
    }

    /// The order of `ids` (every value below `e`), given each expert's `copies`, in `r` rows
    /// (at least the copies padded to multiples of `align`): slots, tokens, rows and starts in
    /// one tensor.
    ///
    /// # Shapes
    /// `ids`: `[n]`, `copies`: `[e]` → `[2r + n + e + 1]`
    fn order_by_expert(
        ids: IntTensor<Self>,
        copies: IntTensor<Self>,
        k: usize,
        align: usize,
        r: usize,
    ) -> IntTensor<Self> {
        let e = Tensor::<1, Int>::from_primitive::<Self>(copies).dims()[0];
        host_tensor(HostOrder::new(&host_ids(ids), k, 0..e, align).laid_out(r))
    }
}

/// A dispatch order decided on the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostOrder {
    /// `[r]`: the slot each row holds (fillers: `n`).
    pub slots: Vec<i64>,
    /// `[r]`: the token of each row.
    pub tokens: Vec<i64>,
    /// `[n]`: the row of each slot (`r` for a copy left out).
    pub rows: Vec<i64>,
    /// The rows each expert of the range takes, fillers included.
    pub counts: Vec<usize>,
    /// The copies each expert of the range takes.
    pub copies: Vec<usize>,
}

impl HostOrder {
    /// The order of the copies whose expert (`kept[slot]`, `None` for a dropped copy) lies in
    /// `experts`, indices into the `[slots / k]` tokens.
    pub fn new(kept: &[Option<usize>], k: usize, experts: Range<usize>, align: usize) -> Self {
        let filler = kept.len() as i64;
        let local = |x: &Option<usize>| x.filter(|x| experts.contains(x)).map(|x| x - experts.start);
        let mut copies = vec![0usize; experts.len()];
        for x in kept.iter().filter_map(local) {
            copies[x] += 1;
        }
        let counts: Vec<usize> = copies.iter().map(|c| c.next_multiple_of(align.max(1))).collect();
        let starts = starts(&counts);
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
        for x in 0..counts.len() {
            let first = if copies[x] > 0 { tokens[starts[x]] } else { 0 };
            tokens[next[x]..starts[x] + counts[x]].fill(first);
        }
        Self {
            slots,
            tokens,
            rows,
            counts,
            copies,
        }
    }

    /// Slots, tokens and rows one after another, in the rows this order takes.
    pub fn concatenated(&self) -> Vec<i64> {
        [self.slots.as_slice(), &self.tokens, &self.rows].concat()
    }

    /// The layout of [`OrderOps::order_by_expert`] in `r` rows (at least this order's): slots,
    /// tokens, rows and starts, the rows past the experts' fillers of no expert.
    pub fn laid_out(&self, r: usize) -> Vec<i64> {
        let (used, n) = (self.slots.len(), self.rows.len());
        assert!(r >= used, "{r} rows hold the order's {used}");
        let mut slots = self.slots.clone();
        slots.resize(r, n as i64);
        let mut tokens = self.tokens.clone();
        tokens.resize(r, 0);
        let rows = self.rows.iter().map(|&x| if x == used as i64 { r as i64 } else { x });
        let mut starts = starts(&self.counts);
        starts.push(used);
        let starts = starts.into_iter().map(|x| x as i64);
        [slots, tokens, rows.collect(), starts.collect()].concat()
    }
}

/// The most rows `n` copies over `e` experts take when each expert's are padded to a multiple
/// of `align`: the room an order decided on the device is given.
pub fn room(n: usize, e: usize, align: usize) -> usize {
    n + e * (align.max(1) - 1)
}

/// Where each of `counts`' groups starts.
fn starts(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |at, &n| {
            *at += n;
            Some(*at - n)
        })
        .collect()
}

/// An order decided where the ids are, all of it on their device.
#[derive(Clone, Debug)]
pub struct DeviceOrder {
    /// `[2r + n + e + 1]`: slots, tokens, rows and starts.
    pub indices: Tensor<1, Int>,
    /// `[e]`: the copies each expert takes.
    pub copies: Tensor<1, Int>,
    /// The rows' room, `r` ([`room`]).
    pub rows: usize,
}

/// The order of `ids` (`[t, k]`, every value below `e`), each expert's rows padded with fillers
/// to a multiple of `align`, in the room they may take ([`room`]). Reads nothing to the host.
pub fn order_by_expert(ids: Tensor<2, Int>, e: usize, align: usize) -> DeviceOrder {
    let [t, k] = ids.dims();
    let rows = room(t * k, e, align);
    let ids = ids.reshape([t * k]).into_dispatch();
    type D = burn::backend::Dispatch;
    let copies = <D as OrderOps>::expert_copies(ids.clone(), e);
    let indices = <D as OrderOps>::order_by_expert(ids, copies.clone(), k, align.max(1), rows);
    DeviceOrder {
        indices: Tensor::from_dispatch(indices),
        copies: Tensor::from_dispatch(copies),
        rows,
    }
}

/// The ids of a CPU tensor, each an expert.
fn host_ids(ids: IntTensor<Flex>) -> Vec<Option<usize>> {
    let ids: Vec<i64> = Tensor::<1, Int>::from_primitive::<Flex>(ids)
        .into_data()
        .convert::<i64>()
        .try_to_vec()
        .expect("expert ids");
    ids.into_iter().map(|x| Some(x as usize)).collect()
}

/// `values` as a CPU int tensor.
fn host_tensor(values: Vec<i64>) -> IntTensor<Flex> {
    let n = values.len();
    Tensor::<1, Int>::from_data(TensorData::new(values, [n]), &burn::tensor::Device::flex())
        .try_into_primitive::<Flex>()
        .expect("a CPU tensor")
}

/// Indices carry no gradient: the inner backend's.
impl<B: Backend + OrderOps, C: burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy> OrderOps
    for Autodiff<B, C>
{
    fn expert_copies(ids: IntTensor<Self>, e: usize) -> IntTensor<Self> {
        B::expert_copies(ids, e)
    }

    fn order_by_expert(
        ids: IntTensor<Self>,
        copies: IntTensor<Self>,
        k: usize,
        align: usize,
        r: usize,
    ) -> IntTensor<Self> {
        B::order_by_expert(ids, copies, k, align, r)
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Int, Tensor, TensorData};

    use super::*;

    /// Each expert's copies in slot order, then its fillers (its first token, slot `n`); a
    /// dropped copy's row is one past the last; an expert outside the range takes no row.
    #[test]
    fn orders_copies_by_expert_then_slot() {
        let kept = vec![Some(1), Some(0), None, Some(1), Some(2), Some(1)];
        let order = HostOrder::new(&kept, 2, 0..2, 2);
        assert_eq!(order.counts, vec![2, 4]);
        assert_eq!(order.copies, vec![1, 3]);
        assert_eq!(order.slots, vec![1, 6, 0, 3, 5, 6]);
        assert_eq!(order.tokens, vec![0, 0, 0, 1, 2, 0]);
        assert_eq!(order.rows, vec![2, 0, 6, 3, 6, 4]);
        // In 8 rows: two more fillers, the dropped copies one past them, then the starts.
        let laid_out = [
            &[1, 6, 0, 3, 5, 6, 6, 6][..],
            &[0, 0, 0, 1, 2, 0, 0, 0],
            &[2, 0, 8, 3, 8, 4],
            &[0, 2, 6],
        ];
        assert_eq!(order.laid_out(8), laid_out.concat());
    }

    /// On the device's path (here the CPU's), the order of ids as a tensor: the host's laid
    /// out in the room of `n + e·(align − 1)` rows, with an expert that takes no copy, fillers
    /// of no expert after the last one's and its starts after the rows.
    #[test]
    fn device_order_is_the_hosts() {
        let ids = vec![3i64, 0, 3, 1, 0, 3, 3, 1];
        let tensor = Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [4, 2]), &Device::flex());
        let got = order_by_expert(tensor, 5, 4);
        let host = HostOrder::new(&ids.iter().map(|&x| Some(x as usize)).collect::<Vec<_>>(), 2, 0..5, 4);
        assert_eq!(host.counts, vec![4, 4, 0, 4, 0]);
        assert_eq!(got.rows, 8 + 5 * 3);
        let copies: Vec<i64> = got.copies.into_data().convert::<i64>().try_to_vec().unwrap();
        assert_eq!(copies, vec![2, 2, 0, 4, 0]);
        let indices: Vec<i64> = got.indices.into_data().convert::<i64>().try_to_vec().unwrap();
        assert_eq!(indices, host.laid_out(23));
        let (r, n) = (23, 8);
        assert_eq!(&indices[12..r], &[8; 11], "the rows past the experts' are fillers");
        assert_eq!(&indices[r + 12..2 * r], &[0; 11]);
        assert_eq!(&indices[2 * r + n..], &[0, 4, 8, 8, 12, 12], "the starts");
    }
}
