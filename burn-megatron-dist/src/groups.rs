//! The groups one rank belongs to: values built from a [`ParallelDims`], never globals.

use crate::comm::ProcessGroup;
use crate::mesh::{Axis, Coordinates, ParallelDims};

/// Every group of one rank, one per mesh axis (and the combined axes), plus the whole world.
#[derive(Clone, Debug)]
pub struct ProcessGroups {
    pub dims: ParallelDims,
    pub global_rank: usize,
    pub world: ProcessGroup,
    pub tp: ProcessGroup,
    pub cp: ProcessGroup,
    pub dp: ProcessGroup,
    pub pp: ProcessGroup,
    pub ep: ProcessGroup,
    pub ep_dp: ProcessGroup,
    /// The tp ranks that split each expert's hidden features: the tp group itself unless
    /// `dims.etp` is smaller.
    pub etp: ProcessGroup,
    pub tp_cp: ProcessGroup,
    pub dp_cp: ProcessGroup,
}

impl ProcessGroups {
    /// Builds every group of `global_rank`; `join(axis_name, members)` returns this rank's
    /// handle on the group with those global ranks. Every rank joins its groups in the same
    /// order: world, tp, cp, dp, pp, ep, ep-dp, etp (unless it is tp), tp-cp, dp-cp.
    pub fn build(
        dims: ParallelDims,
        global_rank: usize,
        mut join: impl FnMut(&str, Vec<usize>) -> ProcessGroup,
    ) -> Self {
        let infallible = Self::try_build(dims, global_rank, |axis, members| {
            Ok::<_, std::convert::Infallible>(join(axis, members))
        });
        match infallible {
            Ok(groups) => groups,
        }
    }

    /// [`build`](Self::build) with a `join` that can fail.
    pub fn try_build<E>(
        dims: ParallelDims,
        global_rank: usize,
        mut join: impl FnMut(&str, Vec<usize>) -> Result<ProcessGroup, E>,
    ) -> Result<Self, E> {
        let world = join("world", (0..dims.world_size()).collect())?;
        let mut group = |axis: Axis| join(axis.name(), dims.group_members(axis, global_rank));
        let tp = group(Axis::Tp)?;
        Ok(Self {
            cp: group(Axis::Cp)?,
            dp: group(Axis::Dp)?,
            pp: group(Axis::Pp)?,
            ep: group(Axis::Ep)?,
            ep_dp: group(Axis::EpDp)?,
            etp: match dims.expert_tp() == dims.tp {
                true => tp.clone(),
                false => group(Axis::Etp)?,
            },
            tp,
            tp_cp: group(Axis::TpCp)?,
            dp_cp: group(Axis::DpCp)?,
            world,
            dims,
            global_rank,
        })
    }

    /// The groups of a single-device run: every group has one member.
    pub fn single() -> Self {
        Self::build(ParallelDims::single(), 0, |_, _| ProcessGroup::solo())
    }

    pub fn coordinates(&self) -> Coordinates {
        self.dims.coordinates(self.global_rank)
    }

    /// The ranks whose gradients of the same (non-expert) parameters are averaged: dp × cp,
    /// which hold different tokens of the batch. The optimizer's reduction and its ZeRO-1
    /// shards, checkpoints and the loss's token count all use it; expert parameters will use
    /// `ep_dp` instead.
    pub fn grad_sync(&self) -> &ProcessGroup {
        &self.dp_cp
    }

    pub fn get(&self, axis: Axis) -> &ProcessGroup {
        match axis {
            Axis::Tp => &self.tp,
            Axis::Cp => &self.cp,
            Axis::Dp => &self.dp,
            Axis::Pp => &self.pp,
            Axis::Ep => &self.ep,
            Axis::EpDp => &self.ep_dp,
            Axis::Etp => &self.etp,
            Axis::TpCp => &self.tp_cp,
            Axis::DpCp => &self.dp_cp,
        }
    }
}
