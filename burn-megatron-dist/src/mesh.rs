//! The process mesh: how the world's ranks are laid out over the parallel axes.
//!
//! Ranks are numbered in Megatron's order: tensor-parallel fastest, then context, data and
//! pipeline (`global_rank = tp + TP·(cp + CP·(dp + DP·pp))`). Expert parallelism is not an axis
//! of its own: expert layers lay a pipeline stage's ranks out again as Megatron does, expert
//! tensor parallelism fastest, then ep, then expert data parallelism (`stage rank = etp_rank +
//! ETP·(ep_rank + EP·ep_dp_rank)`). With etp = tp (the default) an expert group is a block of
//! `ep` consecutive ranks of the dp×cp group; with a smaller etp the tp ranks outside an etp
//! group fold into ep and expert data parallelism too.

/// A layout that cannot be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MeshError {
    #[error("parallel axis {axis} has size 0; every axis needs at least one rank")]
    ZeroSize { axis: &'static str },
    #[error("layout {dims:?} needs tp·cp·dp·pp = {product} ranks, but the world has {world_size}")]
    WorldSizeMismatch {
        dims: ParallelDims,
        product: usize,
        world_size: usize,
    },
    #[error(
        "ep = {ep} must divide (tp/etp)·dp·cp = {ranks}: expert layers fold ep over the data and context ranks, and the tp ranks outside an etp group"
    )]
    ExpertsDoNotDivide { ep: usize, ranks: usize },
    #[error("etp = {etp} must divide tp = {tp}: an expert's hidden features split over consecutive tp ranks")]
    ExpertTpDoesNotDivide { etp: usize, tp: usize },
}

/// Sizes of the parallel axes. Every size is at least 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ParallelDims {
    /// Tensor parallelism (and sequence parallelism, which shares its group).
    pub tp: usize,
    /// Context parallelism: the sequence split over ranks inside attention.
    pub cp: usize,
    /// Expert parallelism, folded over dp×cp (and the tp ranks outside an etp group) for
    /// expert layers.
    pub ep: usize,
    /// Data parallelism.
    pub dp: usize,
    /// Pipeline parallelism.
    pub pp: usize,
    /// Expert tensor parallelism: how many consecutive tp ranks split each expert's hidden
    /// features; `None` for all of tp (Megatron's default).
    pub etp: Option<usize>,
}

/// A parallel axis of the mesh (and the combined axes that later layers need).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Axis {
    Tp,
    Cp,
    Dp,
    Pp,
    /// Experts: the ranks of a stage with the same etp rank, `ep` consecutive ones.
    Ep,
    /// Data parallelism over the expert layers: the ranks of a stage with the same etp and ep
    /// ranks.
    EpDp,
    /// Expert tensor parallelism: `etp` consecutive ranks of the tp group.
    Etp,
    /// tp×cp: the ranks that shard one sample's activations.
    TpCp,
    /// dp×cp: the ranks that hold the same parameters (gradients are reduced over these).
    DpCp,
}

impl Axis {
    /// Every axis, in a fixed order.
    pub const ALL: [Axis; 9] = [
        Axis::Tp,
        Axis::Cp,
        Axis::Dp,
        Axis::Pp,
        Axis::Ep,
        Axis::EpDp,
        Axis::Etp,
        Axis::TpCp,
        Axis::DpCp,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Axis::Tp => "tp",
            Axis::Cp => "cp",
            Axis::Dp => "dp",
            Axis::Pp => "pp",
            Axis::Ep => "ep",
            Axis::EpDp => "ep-dp",
            Axis::Etp => "etp",
            Axis::TpCp => "tp-cp",
            Axis::DpCp => "dp-cp",
        }
    }
}

/// Where one rank sits in the expert layers' layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExpertCoordinates {
    pub etp: usize,
    pub ep: usize,
    pub ep_dp: usize,
}

/// Where one rank sits on the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Coordinates {
    pub tp: usize,
    pub cp: usize,
    pub dp: usize,
    pub pp: usize,
}

impl ParallelDims {
    /// A layout of `tp` × `dp` ranks with every other axis of size 1.
    pub fn tp_dp(tp: usize, dp: usize) -> Self {
        Self {
            tp,
            cp: 1,
            ep: 1,
            dp,
            pp: 1,
            etp: None,
        }
    }

    /// Expert tensor parallelism's size: `etp`, or tp.
    pub fn expert_tp(&self) -> usize {
        self.etp.unwrap_or(self.tp)
    }

    /// The ranks a stage's experts fold ep and expert data parallelism over, for each etp
    /// rank: `tp/etp · dp · cp`.
    pub fn expert_ranks(&self) -> usize {
        self.tp / self.expert_tp() * self.dp * self.cp
    }

    /// One rank: every axis of size 1.
    pub fn single() -> Self {
        Self::tp_dp(1, 1)
    }

    /// Checks the layout against the world size.
    pub fn validate(&self, world_size: usize) -> Result<(), MeshError> {
        let sizes = [
            ("tp", self.tp),
            ("cp", self.cp),
            ("ep", self.ep),
            ("dp", self.dp),
            ("pp", self.pp),
            ("etp", self.expert_tp()),
        ];
        if let Some((axis, _)) = sizes.iter().find(|(_, size)| *size == 0) {
            return Err(MeshError::ZeroSize { axis });
        }
        let product = self.tp * self.cp * self.dp * self.pp;
        if product != world_size {
            return Err(MeshError::WorldSizeMismatch {
                dims: *self,
                product,
                world_size,
            });
        }
        if !self.tp.is_multiple_of(self.expert_tp()) {
            return Err(MeshError::ExpertTpDoesNotDivide {
                etp: self.expert_tp(),
                tp: self.tp,
            });
        }
        if !self.expert_ranks().is_multiple_of(self.ep) {
            return Err(MeshError::ExpertsDoNotDivide {
                ep: self.ep,
                ranks: self.expert_ranks(),
            });
        }
        Ok(())
    }

    /// The number of ranks the layout needs.
    pub fn world_size(&self) -> usize {
        self.tp * self.cp * self.dp * self.pp
    }

    /// Coordinates of a global rank.
    pub fn coordinates(&self, global_rank: usize) -> Coordinates {
        let tp = global_rank % self.tp;
        let cp = (global_rank / self.tp) % self.cp;
        let dp = (global_rank / (self.tp * self.cp)) % self.dp;
        let pp = global_rank / (self.tp * self.cp * self.dp);
        Coordinates { tp, cp, dp, pp }
    }

    /// The global rank at some coordinates.
    pub fn global_rank(&self, at: Coordinates) -> usize {
        at.tp + self.tp * (at.cp + self.cp * (at.dp + self.dp * at.pp))
    }

    /// The members of `axis`'s group that holds `global_rank`, in group-rank order.
    pub fn group_members(&self, axis: Axis, global_rank: usize) -> Vec<usize> {
        let me = self.coordinates(global_rank);
        let at = |tp, cp, dp, pp| self.global_rank(Coordinates { tp, cp, dp, pp });
        match axis {
            Axis::Tp => (0..self.tp).map(|tp| at(tp, me.cp, me.dp, me.pp)).collect(),
            Axis::Cp => (0..self.cp).map(|cp| at(me.tp, cp, me.dp, me.pp)).collect(),
            Axis::Dp => (0..self.dp).map(|dp| at(me.tp, me.cp, dp, me.pp)).collect(),
            Axis::Pp => (0..self.pp).map(|pp| at(me.tp, me.cp, me.dp, pp)).collect(),
            Axis::TpCp => (0..self.cp)
                .flat_map(|cp| (0..self.tp).map(move |tp| (tp, cp)))
                .map(|(tp, cp)| at(tp, cp, me.dp, me.pp))
                .collect(),
            Axis::DpCp => self.dp_cp_members(me),
            Axis::Ep => {
                let (members, index) = self.expert_members(global_rank);
                let block = index / self.ep;
                members[block * self.ep..(block + 1) * self.ep].to_vec()
            }
            Axis::EpDp => {
                let (members, index) = self.expert_members(global_rank);
                members.into_iter().skip(index % self.ep).step_by(self.ep).collect()
            }
            Axis::Etp => {
                let etp = self.expert_tp();
                let first = me.tp / etp * etp;
                (first..first + etp).map(|tp| at(tp, me.cp, me.dp, me.pp)).collect()
            }
        }
    }

    /// `global_rank`'s place in the expert layout: its etp rank, ep rank and expert data
    /// parallel rank.
    pub fn expert_coordinates(&self, global_rank: usize) -> ExpertCoordinates {
        let (_, index) = self.expert_members(global_rank);
        ExpertCoordinates {
            etp: self.coordinates(global_rank).tp % self.expert_tp(),
            ep: index % self.ep,
            ep_dp: index / self.ep,
        }
    }

    /// Every group of `axis`, each in group-rank order, sorted by their first member.
    pub fn all_groups(&self, axis: Axis) -> Vec<Vec<usize>> {
        let mut groups: Vec<Vec<usize>> = (0..self.world_size())
            .map(|rank| self.group_members(axis, rank))
            .collect();
        groups.sort();
        groups.dedup();
        groups
    }

    /// The ranks of `global_rank`'s stage with its etp rank, in rank order (with etp = tp, its
    /// dp×cp group), and its index among them.
    fn expert_members(&self, global_rank: usize) -> (Vec<usize>, usize) {
        let stage_size = self.tp * self.cp * self.dp;
        let (stage, within) = (global_rank / stage_size, global_rank % stage_size);
        let etp = self.expert_tp();
        let members = (within % etp..stage_size)
            .step_by(etp)
            .map(|r| stage * stage_size + r)
            .collect();
        (members, within / etp)
    }

    // The dp×cp ranks sharing this rank's tp and pp coordinates, cp fastest (Megatron's order).
    fn dp_cp_members(&self, me: Coordinates) -> Vec<usize> {
        (0..self.dp)
            .flat_map(|dp| (0..self.cp).map(move |cp| (cp, dp)))
            .map(|(cp, dp)| {
                self.global_rank(Coordinates {
                    tp: me.tp,
                    cp,
                    dp,
                    pp: me.pp,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(tp: usize, cp: usize, ep: usize, dp: usize, pp: usize) -> ParallelDims {
        ParallelDims {
            tp,
            cp,
            ep,
            dp,
            pp,
            etp: None,
        }
    }

    #[test]
    fn validation_rejects_bad_layouts() {
        assert_eq!(dims(2, 1, 1, 2, 2).validate(8), Ok(()));
        assert!(matches!(
            dims(2, 1, 1, 2, 2).validate(6),
            Err(MeshError::WorldSizeMismatch { .. })
        ));
        assert!(matches!(
            dims(0, 1, 1, 2, 2).validate(0),
            Err(MeshError::ZeroSize { axis: "tp" })
        ));
        assert!(matches!(
            dims(1, 1, 3, 2, 1).validate(2),
            Err(MeshError::ExpertsDoNotDivide { .. })
        ));
        // ep folds over dp×cp: 4 divides 2×2.
        assert_eq!(dims(1, 2, 4, 2, 1).validate(4), Ok(()));
        // ... and over the tp ranks outside an etp group: 4 divides 2/1 × 2.
        let etp = |tp, ep, dp, etp| ParallelDims {
            etp: Some(etp),
            ..dims(tp, 1, ep, dp, 1)
        };
        assert_eq!(etp(2, 4, 2, 1).validate(4), Ok(()));
        assert_eq!(
            etp(2, 4, 1, 1).validate(2),
            Err(MeshError::ExpertsDoNotDivide { ep: 4, ranks: 2 })
        );
        assert_eq!(
            etp(4, 1, 1, 3).validate(4),
            Err(MeshError::ExpertTpDoesNotDivide { etp: 3, tp: 4 })
        );
        assert!(matches!(
            etp(2, 1, 1, 0).validate(2),
            Err(MeshError::ZeroSize { axis: "etp" })
        ));
    }

    /// Megatron's expert layout at tp 4, etp 2, ep 2, dp 2: stage rank = etp_rank + 2·(ep_rank +
    /// 2·ep_dp_rank), so a dense tp group holds two ep ranks and the ep groups cross dp.
    #[test]
    fn groups_of_experts_with_a_smaller_etp() {
        let d = ParallelDims {
            etp: Some(2),
            ..dims(4, 1, 2, 2, 1)
        };
        assert_eq!(d.validate(8), Ok(()));
        assert_eq!(
            d.all_groups(Axis::Etp),
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
        );
        assert_eq!(
            d.all_groups(Axis::Ep),
            vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
        );
        assert_eq!(
            d.all_groups(Axis::EpDp),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        for rank in 0..8 {
            let at = d.expert_coordinates(rank);
            assert_eq!(at.etp + 2 * (at.ep + 2 * at.ep_dp), rank, "rank {rank}");
        }
        // etp 1 at tp 2 × dp 2, ep 4: every rank its own experts.
        let one = ParallelDims {
            etp: Some(1),
            ..dims(2, 1, 4, 2, 1)
        };
        assert_eq!(one.all_groups(Axis::Ep), vec![vec![0, 1, 2, 3]]);
        assert_eq!(one.all_groups(Axis::Etp), (0..4).map(|r| vec![r]).collect::<Vec<_>>());
        // etp = tp is the dp×cp layout of before, the Etp group the tp group.
        let same = dims(2, 2, 2, 2, 2);
        assert_eq!(same.all_groups(Axis::Etp), same.all_groups(Axis::Tp));
    }

    #[test]
    fn coordinates_round_trip_with_tp_fastest() {
        let d = dims(2, 2, 1, 2, 2);
        for rank in 0..16 {
            assert_eq!(d.global_rank(d.coordinates(rank)), rank);
        }
        assert_eq!(
            d.coordinates(1),
            Coordinates {
                tp: 1,
                cp: 0,
                dp: 0,
                pp: 0
            }
        );
        assert_eq!(
            d.coordinates(2),
            Coordinates {
                tp: 0,
                cp: 1,
                dp: 0,
                pp: 0
            }
        );
        assert_eq!(
            d.coordinates(4),
            Coordinates {
                tp: 0,
                cp: 0,
                dp: 1,
                pp: 0
            }
        );
        assert_eq!(
            d.coordinates(8),
            Coordinates {
                tp: 0,
                cp: 0,
                dp: 0,
                pp: 1
            }
        );
    }

    #[test]
    fn groups_of_world_8_tp2_dp2_pp2() {
        let d = dims(2, 1, 1, 2, 2);
        assert_eq!(
            d.all_groups(Axis::Tp),
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
        );
        assert_eq!(
            d.all_groups(Axis::Dp),
            vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
        );
        assert_eq!(
            d.all_groups(Axis::Pp),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        assert_eq!(d.all_groups(Axis::Cp), (0..8).map(|r| vec![r]).collect::<Vec<_>>());
        assert_eq!(
            d.all_groups(Axis::TpCp),
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
        );
        assert_eq!(
            d.all_groups(Axis::DpCp),
            vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
        );
    }

    #[test]
    fn groups_of_world_16_tp2_cp2_dp2_pp2() {
        let d = dims(2, 2, 2, 2, 2);
        assert_eq!(d.validate(16), Ok(()));
        assert_eq!(d.group_members(Axis::Tp, 5), vec![4, 5]);
        assert_eq!(
            d.all_groups(Axis::Cp)[..4],
            [vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
        );
        assert_eq!(
            d.all_groups(Axis::Dp)[..4],
            [vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        assert_eq!(
            d.all_groups(Axis::Pp)[..4],
            [vec![0, 8], vec![1, 9], vec![2, 10], vec![3, 11]]
        );
        assert_eq!(d.group_members(Axis::TpCp, 6), vec![4, 5, 6, 7]);
        assert_eq!(d.all_groups(Axis::DpCp)[..2], [vec![0, 2, 4, 6], vec![1, 3, 5, 7]]);
        assert_eq!(
            d.all_groups(Axis::DpCp)[2..],
            [vec![8, 10, 12, 14], vec![9, 11, 13, 15]]
        );
        // ep = 2 over dp×cp = [0, 2, 4, 6]: experts in blocks [0, 2] and [4, 6] ...
        assert_eq!(d.group_members(Axis::Ep, 0), vec![0, 2]);
        assert_eq!(d.group_members(Axis::Ep, 6), vec![4, 6]);
        // ... and expert data parallelism across the blocks.
        assert_eq!(d.group_members(Axis::EpDp, 2), vec![2, 6]);
        assert_eq!(d.group_members(Axis::EpDp, 9), vec![9, 13]);
    }

    #[test]
    fn every_rank_is_in_exactly_one_group_of_each_axis() {
        for d in [
            dims(2, 2, 4, 2, 2),
            ParallelDims {
                etp: Some(1),
                ..dims(2, 2, 8, 2, 2)
            },
        ] {
            for axis in Axis::ALL {
                let mut seen: Vec<usize> = d.all_groups(axis).concat();
                seen.sort();
                assert_eq!(seen, (0..16).collect::<Vec<_>>(), "axis {}", axis.name());
            }
        }
    }
}
