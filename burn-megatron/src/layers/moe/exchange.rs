//! Token copies exchanged over the expert-parallel group: ep rank `r` holds experts
//! `r·e/ep .. (r+1)·e/ep`, so a copy goes to the rank of its expert and its output comes back.
//! Two dispatchers, Megatron's:
//!
//! - [`AllToAll`]: every rank sends each copy only where its expert lives. The copies per expert
//!   are exchanged first (an all-gather of each rank's `[e]` counts, so every rank knows every
//!   split), the rows go in one uneven all-to-all, and arrive grouped by source; they are
//!   reordered by expert for the experts, and the way back undoes both.
//! - [`AllGather`]: every rank gathers every rank's tokens, choices and weights, runs its own
//!   experts on the copies that chose them and combines them into every rank's tokens; a
//!   reduce-scatter then sums each rank's outputs from all ep ranks. Cheaper to set up for a
//!   small ep, and no count exchange before the rows move.
//!
//! Both are differentiable: the collectives are the mappings of `burn_megatron_dist`, whose
//! backward goes back along the same routes, and the reorderings are row gathers that know
//! their inverse (`burn_megatron_kernels::rows`).
//!
//! Legend: `t` tokens, `k` top k, `d` d_model, `e` experts, `n` copies.

use burn::config::Config;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron_dist::mappings::{all_to_all_uneven, gather_from_sp, reduce_scatter_to_sp};
use burn_megatron_dist::{CommError, ProcessGroup};
use burn_megatron_kernels::rows::gather_rows;

use super::dispatch::{Dispatch, dispatch_host, permute, unpermute};

/// How token copies reach the experts of other ep ranks.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum ExpertParallel {
    /// Uneven all-to-all over the ep group (Megatron's `alltoall` dispatcher).
    AllToAll,
    /// Every ep rank gathers all tokens and runs its experts' copies; the outputs are
    /// reduce-scattered back (Megatron's `allgather` dispatcher, for a small ep).
    AllGather,
}

impl ExpertParallel {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::AllToAll => "all-to-all",
            Self::AllGather => "all-gather",
        }
    }
}

impl std::str::FromStr for ExpertParallel {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        [Self::AllToAll, Self::AllGather]
            .into_iter()
            .find(|e| e.name() == name)
            .ok_or_else(|| format!("unknown dispatcher {name:?}: expected all-to-all or all-gather"))
    }
}

/// The experts this ep rank holds, as a range of global expert ids.
pub fn local_experts(e: usize, ep: &ProcessGroup) -> std::ops::Range<usize> {
    let per = e / ep.size();
    ep.group_rank() * per..(ep.group_rank() + 1) * per
}

/// Every ep rank's copies per expert, `[rank][expert]`.
fn all_counts(counts: &[usize], ep: &ProcessGroup, device: &Device) -> Result<Vec<Vec<usize>>, CommError> {
    let e = counts.len();
    let local = int_tensor(counts.iter().map(|&c| c as i64).collect(), device);
    let all = host_ints(ep.all_gather(local, 0)?);
    Ok(all
        .chunks(e)
        .map(|row| row.iter().map(|&c| c as usize).collect())
        .collect())
}

/// The way back of an all-to-all dispatch.
#[derive(Clone, Debug)]
pub struct Route {
    /// The reordering of the arrived rows (grouped by source) into expert order, fillers
    /// included, and back; `None` with no rows.
    order: Option<Reorder>,
    /// Rows this rank received from each ep rank: what it sends back to each.
    received: Vec<usize>,
}

/// Arrived rows `a` and the expert-ordered rows `r` (fillers included) that read them, as row
/// gathers in both directions with their inverses.
#[derive(Clone, Debug)]
struct Reorder {
    /// `[r]`: the arrived row each expert-ordered row reads.
    forward: Tensor<1, Int>,
    /// `[a, 1]` as the forward's readers, `[a]` as the way back's index: each arrived row's
    /// position in expert order.
    position: Tensor<1, Int>,
    /// `[r, 1]`: the arrived row each expert-ordered row goes back to (`a` for a filler).
    back: Tensor<2, Int>,
}

/// All-to-all dispatch.
pub struct AllToAll;

impl AllToAll {
    /// Sends this rank's copies (`rows`, in expert order, `counts[x]` of them for expert `x`,
    /// over all `e` experts) to the ranks holding their experts. Returns the rows this rank's
    /// experts run on, in expert order, each expert's padded with fillers to a multiple of
    /// `align`, how many each of them got, and the route back (which drops the fillers).
    ///
    /// # Shapes
    /// `rows`: `[Σ counts, d]` → `[Σ local counts, d]`
    pub fn dispatch(
        rows: Tensor<2>,
        counts: &[usize],
        ep: &ProcessGroup,
        align: usize,
    ) -> Result<(Tensor<2>, Vec<usize>, Route), CommError> {
        let device = rows.device();
        let matrix = all_counts(counts, ep, &device)?;
        let (size, mine) = (ep.size(), local_experts(counts.len(), ep));
        let per = mine.len();
        let send: Vec<usize> = (0..size).map(|j| counts[j * per..(j + 1) * per].iter().sum()).collect();
        let (arrived, received) = all_to_all_uneven(rows, ep, 0, &send)?;
        // Arrived: by source, then by expert within each source. Wanted: by expert, then source.
        let starts: Vec<usize> = (0..size)
            .scan(0, |at, src| {
                let start = *at;
                *at += received[src];
                Some(start)
            })
            .collect();
        let mut order = Vec::with_capacity(received.iter().sum());
        let mut inverse = vec![0i64; received.iter().sum()];
        let mut local_counts = vec![0; per];
        for (i, x) in mine.enumerate() {
            let first = order.len();
            for src in 0..size {
                let before: usize = matrix[src][x - i..x].iter().sum();
                let (start, n) = (starts[src] + before, matrix[src][x]);
                for (row, back) in inverse.iter_mut().enumerate().skip(start).take(n) {
                    *back = order.len() as i64;
                    order.push(row as i64);
                }
                local_counts[i] += n;
            }
            // Fillers up to the grouped product's tile: the expert's first row again (its
            // output is dropped on the way back, so its gradient is zero).
            let fill = local_counts[i].next_multiple_of(align.max(1)) - local_counts[i];
            let filler = order.get(first).copied().unwrap_or(0);
            order.extend(std::iter::repeat_n(filler, fill));
            local_counts[i] += fill;
        }
        let order = (!order.is_empty()).then(|| {
            let a = inverse.len();
            let mut back = vec![a as i64; order.len()];
            for (arrived_row, &position) in inverse.iter().enumerate() {
                back[position as usize] = arrived_row as i64;
            }
            let r = back.len();
            Reorder {
                forward: int_tensor(order, &device),
                position: int_tensor(inverse, &device),
                back: int_tensor(back, &device).reshape([r, 1]),
            }
        });
        let rows = match &order {
            Some(o) => {
                let a = arrived.dims()[0];
                gather_rows(arrived, o.forward.clone(), o.position.clone().reshape([a, 1]))
            }
            None => arrived,
        };
        Ok((rows, local_counts, Route { order, received }))
    }

    /// The experts' outputs (`rows`, as [`dispatch`](Self::dispatch) returned them) sent back
    /// to the ranks their copies came from, in the order those ranks sent them.
    pub fn combine(rows: Tensor<2>, route: &Route, ep: &ProcessGroup) -> Result<Tensor<2>, CommError> {
        let rows = match &route.order {
            Some(o) => gather_rows(rows, o.position.clone(), o.back.clone()),
            None => rows,
        };
        Ok(all_to_all_uneven(rows, ep, 0, &route.received)?.0)
    }
}

/// All-gather dispatch.
pub struct AllGather;

/// What an all-gather dispatch hands the experts: every ep rank's copies of this rank's experts.
pub struct Gathered {
    /// `[Σ counts, d]`, in expert order.
    pub rows: Tensor<2>,
    /// The copies each of this rank's experts got.
    pub counts: Vec<usize>,
    /// Where they go back to among every rank's tokens, with every rank's weights `[ep·t, k]`.
    dispatch: Dispatch,
    weights: Tensor<2>,
}

impl AllGather {
    /// Gathers every ep rank's `tokens`, `weights` and kept copies (`kept[slot]` the copy's
    /// expert, or `None` when capacity dropped it) and picks those of this rank's experts, each
    /// expert's padded with fillers to a multiple of `align` ([`Dispatch::aligned`]).
    ///
    /// # Shapes
    /// `tokens`: `[t, d]`, `weights`: `[t, k]`
    pub fn dispatch(
        tokens: Tensor<2>,
        weights: Tensor<2>,
        kept: &[Option<usize>],
        e: usize,
        ep: &ProcessGroup,
        align: usize,
    ) -> Result<Gathered, CommError> {
        let device = tokens.device();
        let [_, k] = weights.dims();
        let ids = kept.iter().map(|x| x.map_or(-1, |x| x as i64)).collect();
        let all_ids: Vec<Option<usize>> = host_ints(ep.all_gather(int_tensor(ids, &device), 0)?)
            .into_iter()
            .map(|x| usize::try_from(x).ok())
            .collect();
        let tokens = gather_from_sp(tokens, ep, 0)?; // [ep·t, d]
        let weights = gather_from_sp(weights, ep, 0)?; // [ep·t, k]
        let dispatch = dispatch_host(all_ids, k, local_experts(e, ep), align, &device);
        let counts = dispatch.groups.counts();
        Ok(Gathered {
            rows: permute(tokens, &dispatch),
            counts,
            dispatch,
            weights,
        })
    }

    /// The experts' weighted outputs summed into every rank's tokens, then each rank's tokens
    /// summed over the ep group and kept by their rank.
    ///
    /// # Shapes
    /// `rows`: `[Σ counts, d]` → `[t, d]`
    pub fn combine(rows: Tensor<2>, gathered: Gathered, ep: &ProcessGroup) -> Result<Tensor<2>, CommError> {
        let all = unpermute(rows, gathered.weights, &gathered.dispatch); // [ep·t, d]
        reduce_scatter_to_sp(all, ep, 0)
    }
}

fn int_tensor(values: Vec<i64>, device: &Device) -> Tensor<1, Int> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
}

fn host_ints(x: Tensor<1, Int>) -> Vec<i64> {
    x.into_data().convert::<i64>().try_to_vec().expect("ints")
}
