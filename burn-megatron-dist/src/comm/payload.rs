//! What the transports move: a rank-3 view of the caller's tensor.
//!
//! [`ProcessGroup`](super::ProcessGroup) reshapes a tensor of any rank to `[outer, n, inner]`,
//! where `n` is the dim the collective works on, so a transport only ever concatenates, splits
//! and reduces along dim 1. Float and integer tensors travel alike.

use std::ops::Range;

use burn::tensor::{DType, Device, Int, Tensor};

/// A tensor in a transport's hands, viewed as `[outer, n, inner]`.
#[derive(Clone, Debug)]
pub enum Payload {
    Float(Tensor<3>),
    Int(Tensor<3, Int>),
}

/// Runs the same expression on either variant, rewrapping a tensor result.
macro_rules! each {
    ($payload:expr, $t:ident => $body:expr) => {
        match $payload {
            Payload::Float($t) => Payload::Float($body),
            Payload::Int($t) => Payload::Int($body),
        }
    };
}

/// Runs the same expression on either variant, for a result that is not a tensor.
macro_rules! read {
    ($payload:expr, $t:ident => $body:expr) => {
        match $payload {
            Payload::Float($t) => $body,
            Payload::Int($t) => $body,
        }
    };
}

impl Payload {
    pub fn dims(&self) -> [usize; 3] {
        read!(self, t => t.dims())
    }

    pub fn dtype(&self) -> DType {
        read!(self, t => t.dtype())
    }

    pub fn device(&self) -> Device {
        read!(self, t => t.device())
    }

    pub fn is_float(&self) -> bool {
        matches!(self, Payload::Float(_))
    }

    /// Reads the first element back to the host (nothing for an empty payload): returns once
    /// everything queued that writes this payload's buffer has run.
    pub fn read_first(&self) -> Result<(), String> {
        let [o, n, i] = self.dims();
        if o * n * i == 0 {
            return Ok(());
        }
        read!(self, t => t.clone().slice([0..1, 0..1, 0..1]).try_into_data().map(|_| ()).map_err(|e| format!("{e:?}")))
    }

    pub fn to_device(self, device: &Device) -> Self {
        each!(self, t => t.to_device(device))
    }

    /// A slice of dim 1; an empty range gives an empty payload of the same kind and dtype.
    pub fn narrow(self, range: Range<usize>) -> Self {
        if range.is_empty() {
            let [o, _, i] = self.dims();
            let options = (&self.device(), self.dtype());
            return match self {
                Payload::Float(_) => Payload::Float(Tensor::zeros([o, 0, i], options)),
                Payload::Int(_) => Payload::Int(Tensor::zeros([o, 0, i], options)),
            };
        }
        each!(self, t => t.narrow(1, range.start, range.len()))
    }

    /// `[a, b, i]` → `[b, a, i]` (a strided view until something lays it out).
    pub fn swap_outer(self) -> Self {
        each!(self, t => t.swap_dims(0, 1))
    }

    /// Element-wise sum; both payloads have the same variant.
    pub fn add_pair(self, other: Self) -> Self {
        match (self, other) {
            (Payload::Float(a), Payload::Float(b)) => Payload::Float(a.add(b)),
            (Payload::Int(a), Payload::Int(b)) => Payload::Int(a.add(b)),
            _ => panic!("payload kinds differ; the group's checks rule this out"),
        }
    }

    /// Element-wise maximum; both payloads have the same variant.
    pub fn max_pair(self, other: Self) -> Self {
        match (self, other) {
            (Payload::Float(a), Payload::Float(b)) => Payload::Float(a.max_pair(b)),
            (Payload::Int(a), Payload::Int(b)) => Payload::Int(a.max_pair(b)),
            _ => panic!("payload kinds differ; the group's checks rule this out"),
        }
    }

    /// Divides by the group size (the `Avg` reduction); only float payloads are averaged.
    pub fn div_scalar(self, n: usize) -> Self {
        match self {
            Payload::Float(t) => Payload::Float(t.div_scalar(n as f32)),
            Payload::Int(_) => panic!("integer averages are refused by the group's checks"),
        }
    }

    /// Concatenates along dim 1; all parts have the same variant.
    pub fn cat(parts: Vec<Payload>) -> Self {
        match parts.first() {
            Some(Payload::Float(_)) => {
                Payload::Float(Tensor::cat(parts.into_iter().map(|p| p.into_float()).collect(), 1))
            }
            Some(Payload::Int(_)) => Payload::Int(Tensor::cat(parts.into_iter().map(|p| p.into_int()).collect(), 1)),
            None => panic!("nothing to concatenate"),
        }
    }

    pub fn into_float(self) -> Tensor<3> {
        match self {
            Payload::Float(t) => t,
            Payload::Int(_) => panic!("expected a float payload"),
        }
    }

    pub fn into_int(self) -> Tensor<3, Int> {
        match self {
            Payload::Int(t) => t,
            Payload::Float(_) => panic!("expected an integer payload"),
        }
    }
}

/// The consecutive ranges of dim 1 that `sizes` cut it into, in order.
pub(crate) fn split_points(sizes: &[usize]) -> impl Iterator<Item = Range<usize>> + '_ {
    sizes.iter().scan(0, |start, &n| {
        *start += n;
        Some(*start - n..*start)
    })
}
