//! Megatron's `check_for_nan_in_grad`: whether a gradient shard on any rank holds a NaN or an
//! infinity, known on the device before the update and agreed over every rank, so that the
//! update leaves every weight and moment as it was ([`FiniteCheck::keep`] signs the clipping
//! factor the update kernel reads); once read, which parameter on which rank
//! ([`FiniteCheck::locate`]). One pass over the gradients gives each a few partial sums of
//! squares ([`GradSquares`]): the global norm's sums are runs of them, the check their total.

use std::ops::Range;

use burn::tensor::{DType, Device, Tensor};
use burn_megatron_dist::{CommError, ProcessGroup, ReduceOp};
use burn_megatron_kernels::grad_norm::square_partials;

use crate::params::ParamInfo;

/// The partial sums of squares of a step's gradient shards, grouped by class (where the global
/// norm counts them: dense, experts, nowhere), one pass over the gradients.
#[derive(Clone, Debug)]
pub struct GradSquares {
    partials: Option<Tensor<1>>,
    device: Device,
    /// Each gradient's index and its partials' range, in the order of `partials`.
    segments: Vec<(usize, Range<usize>)>,
    /// Each class's range of partials.
    classes: [Range<usize>; CLASSES],
}

/// Dense parameters the norm counts here, experts it counts here, the rest.
pub(super) const CLASSES: usize = 3;

impl GradSquares {
    /// The squares of `shards` (on `device`), each in the class `class` gives its index.
    pub(super) fn of(shards: &[Tensor<1>], device: &Device, class: impl Fn(usize) -> usize) -> Self {
        let mut order: Vec<usize> = (0..shards.len()).collect();
        order.sort_by_key(|&i| class(i));
        let (partials, lengths) = square_partials(order.iter().map(|&i| shards[i].clone()).collect());
        let mut segments = Vec::with_capacity(order.len());
        let mut classes = [0, 1, 2].map(|_| 0..0);
        let mut start = 0;
        for (&index, length) in order.iter().zip(lengths) {
            let c = class(index);
            if classes[c].is_empty() {
                classes[c] = start..start;
            }
            classes[c].end = start + length;
            segments.push((index, start..start + length));
            start += length;
        }
        Self {
            partials,
            device: device.clone(),
            segments,
            classes,
        }
    }

    /// `Σ g²` over the gradients of class `class`, `[1]` f32 on the device.
    pub(super) fn class_sum(&self, class: usize) -> Tensor<1> {
        self.sum(self.classes[class].clone())
    }

    fn sum(&self, range: Range<usize>) -> Tensor<1> {
        match (&self.partials, range.is_empty()) {
            (Some(partials), false) => partials.clone().narrow(0, range.start, range.len()).sum(),
            _ => Tensor::zeros([1], (&self.device, DType::F32)),
        }
    }
}

/// Whether every gradient on every rank is finite, still on the device: see the module docs.
#[derive(Clone, Debug)]
pub struct FiniteCheck {
    /// `Σ g²` over every gradient of every rank: finite where each gradient is.
    total: Tensor<1>,
    squares: GradSquares,
}

impl FiniteCheck {
    /// The check of `squares`, this rank's, agreed over `world` (a collective: every rank calls
    /// it).
    pub(super) fn new(squares: GradSquares, world: &ProcessGroup) -> Result<Self, CommError> {
        let local = squares.sum(0..squares.partials.as_ref().map_or(0, |p| p.dims()[0]));
        let total = match world.size() {
            1 => local,
            _ => world.all_reduce(local, ReduceOp::Sum)?,
        };
        Ok(Self { total, squares })
    }

    /// `[1]` f32 on the device: 1 where every gradient is finite, else −1 (a clipping factor
    /// times it tells the update kernel to keep every state).
    pub(super) fn keep(&self) -> Tensor<1> {
        let finite = self.total.clone().is_finite();
        self.total.ones_like().mask_fill(finite.bool_not(), -1.0)
    }

    /// Whether every gradient was finite: reading it waits for the step's gradients.
    pub fn finite(&self) -> bool {
        self.total.clone().into_scalar::<f64>().is_finite()
    }

    /// Which parameter on which rank holds a gradient that is not finite, after
    /// [`finite`](Self::finite) said one does; `infos` are this rank's parameters'. A collective
    /// over `world`: every rank calls it, and every rank gets the same answer.
    pub(super) fn locate(&self, infos: &[ParamInfo], world: &ProcessGroup) -> Result<NonFiniteGradient, CommError> {
        let partials: Vec<f32> = match &self.squares.partials {
            Some(p) => p
                .clone()
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .expect("f32 partials"),
            None => Vec::new(),
        };
        let first_bad = self
            .squares
            .segments
            .iter()
            .filter(|(_, range)| partials[range.clone()].iter().any(|x| !x.is_finite()))
            .map(|(index, _)| *index)
            .min();
        // A row a rank: whether it found one, then the parameter's path, a byte an entry.
        let mut row = vec![0f32; 1 + NAME_BYTES];
        if let Some(index) = first_bad {
            row[0] = 1.0;
            for (slot, byte) in row[1..].iter_mut().zip(infos[index].path.bytes()) {
                *slot = byte as f32;
            }
        }
        let row = Tensor::<1>::from_floats(row.as_slice(), &self.squares.device);
        let rows: Vec<f32> = match world.size() {
            1 => row,
            _ => world.all_gather(row, 0)?,
        }
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32 rows");
        let found: Vec<(usize, String)> = rows
            .chunks(1 + NAME_BYTES)
            .enumerate()
            .filter(|(_, row)| row[0] == 1.0)
            .map(|(r, row)| {
                let bytes: Vec<u8> = row[1..].iter().map(|&b| b as u8).take_while(|&b| b != 0).collect();
                (r, String::from_utf8_lossy(&bytes).into_owned())
            })
            .collect();
        Ok(NonFiniteGradient {
            first: found.first().cloned(),
            ranks: found.iter().map(|(r, _)| *r).collect(),
        })
    }
}

/// The longest parameter path [`FiniteCheck::locate`] passes between ranks, in bytes.
const NAME_BYTES: usize = 160;

/// A step's gradients were not all finite: the first rank (of the world) that held one, and the
/// path of its first such parameter; every rank that held one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe())]
pub struct NonFiniteGradient {
    /// The lowest rank holding a gradient that is not finite, and the parameter's path there.
    /// None where each gradient was finite but their squares overflowed f32's range.
    pub first: Option<(usize, String)>,
    /// Every rank holding one.
    pub ranks: Vec<usize>,
}

impl NonFiniteGradient {
    fn describe(&self) -> String {
        match &self.first {
            Some((rank, path)) => {
                let others: Vec<String> = self.ranks.iter().filter(|r| *r != rank).map(usize::to_string).collect();
                let also = match others.is_empty() {
                    true => String::new(),
                    false => format!(" (ranks {} hold one too)", others.join(", ")),
                };
                format!("the gradient of {path} on rank {rank} is not finite{also}")
            }
            None => "every gradient is finite, but their sum of squares passes f32's range".into(),
        }
    }
}
