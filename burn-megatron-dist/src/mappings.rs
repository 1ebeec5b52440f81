//! Collectives as autodiff ops. Each mapping pairs a forward with its backward (Megatron's
//! `tensor_parallel/mappings.py`):
//!
//! | mapping                | forward             | backward            |
//! |------------------------|---------------------|---------------------|
//! | [`copy_to_tp`]           | identity            | all-reduce (sum)    |
//! | [`reduce_from_tp`]       | all-reduce (sum)    | identity            |
//! | [`scatter_to_sp`]        | keep own slice      | all-gather          |
//! | [`gather_from_sp`]       | all-gather          | reduce-scatter      |
//! | [`gather_from_tp`]       | all-gather          | keep own slice      |
//! | [`reduce_scatter_to_sp`] | reduce-scatter      | all-gather          |
//! | [`all_to_all`]           | all-to-all          | all-to-all, inverse |
//! | [`all_to_all_uneven`]    | all-to-all (splits) | all-to-all, inverse |
//! | [`tap_grad`]             | identity            | hands the gradient to a [`GradTap`] |
//!
//! They are one Burn backend extension, [`MappingOps`]: the concrete backends run a single
//! [`Step`] through the rank's [`ProcessGroup`], and the `Autodiff` implementation records the
//! paired step for the backward pass. With a group of one member every mapping is the identity.
//!
//! A failure in the forward pass is returned as a [`CommError`]. A failure in the backward pass
//! (a peer that died mid-step) cannot be returned through Burn's `backward()`, so it panics with
//! the same error text, naming the group and the collective.

use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, TensorMetadata, backend_extension};
use burn::tensor::Tensor;

use crate::comm::{ProcessGroup, ReduceOp};
use crate::error::CommError;

mod concrete;

/// One collective step on a float tensor, as a concrete backend runs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    Identity,
    /// All-reduce (sum).
    AllReduce,
    AllGather {
        dim: usize,
    },
    /// Reduce-scatter (sum).
    ReduceScatter {
        dim: usize,
    },
    /// Keep this rank's slice of `dim`.
    Split {
        dim: usize,
    },
    AllToAll {
        split_dim: usize,
        concat_dim: usize,
    },
    AllToAllUneven {
        dim: usize,
        send_splits: Vec<usize>,
    },
    /// Hands the tensor, flattened, to a tap; passes it on unchanged.
    Tap(GradTap),
}

/// Receives a gradient during the backward pass, the moment autodiff has it whole: what
/// data-parallel training uses to launch a bucket's reduction while backward goes on.
#[derive(Clone)]
pub struct GradTap(Arc<dyn Fn(Tensor<1>) + Send + Sync>);

impl GradTap {
    pub fn new(deliver: impl Fn(Tensor<1>) + Send + Sync + 'static) -> Self {
        Self(Arc::new(deliver))
    }
}

impl std::fmt::Debug for GradTap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GradTap")
    }
}

impl PartialEq for GradTap {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for GradTap {}

/// A mapping call: the group, the step to run and the step its gradient takes.
#[derive(Clone, Debug)]
pub struct Mapping {
    group: ProcessGroup,
    step: Step,
    reverse: Step,
    outcome: Arc<Mutex<Outcome>>,
}

/// What a concrete backend reports back through the extension boundary, which only carries
/// tensors.
#[derive(Debug, Default)]
struct Outcome {
    error: Option<CommError>,
    /// For an uneven all-to-all: the entries received from each rank.
    recv_splits: Vec<usize>,
}

impl Mapping {
    fn new(group: &ProcessGroup, step: Step, reverse: Step) -> Self {
        Self {
            group: group.clone(),
            step,
            reverse,
            outcome: Arc::default(),
        }
    }

    /// The call its gradient makes: the reverse step, with an uneven all-to-all sending back
    /// what it received.
    fn reversed(&self) -> Self {
        let reverse = match &self.step {
            Step::AllToAllUneven { dim, .. } => Step::AllToAllUneven {
                dim: *dim,
                send_splits: self.outcome.lock().expect("outcome").recv_splits.clone(),
            },
            _ => self.reverse.clone(),
        };
        Self::new(&self.group, reverse, self.step.clone())
    }

    fn take_result(&self) -> Result<Vec<usize>, CommError> {
        let mut outcome = self.outcome.lock().expect("outcome");
        match outcome.error.take() {
            Some(error) => Err(error),
            None => Ok(std::mem::take(&mut outcome.recv_splits)),
        }
    }
}

/// The backend extension behind every mapping.
#[backend_extension(Flex, Cube: cfg(feature = "cuda"), Autodiff)]
pub trait MappingOps: Backend {
    /// Runs `mapping`'s step on `x`; the autodiff backend also records its reverse.
    fn mapping(x: FloatTensor<Self>, mapping: Mapping) -> FloatTensor<Self>;
}

#[derive(Debug)]
struct MappingBackward;

impl<B: Backend + MappingOps> Backward<B, 1> for MappingBackward {
    type State = Mapping;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let mapping = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            let grad = B::mapping(grad, mapping.clone());
            if let Err(error) = mapping.take_result() {
                panic!("backward of a collective failed: {error}");
            }
            grad
        });
    }
}

impl<B: Backend + MappingOps, C: CheckpointStrategy> MappingOps for Autodiff<B, C> {
    fn mapping(x: FloatTensor<Self>, mapping: Mapping) -> FloatTensor<Self> {
        let (primitive, guard) = x.into_parts();
        let output = B::mapping(primitive, mapping.clone());
        match MappingBackward.prepare::<C>([guard]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(mapping.reversed(), output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }
}

fn apply<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    step: Step,
    reverse: Step,
) -> Result<(Tensor<D>, Vec<usize>), CommError> {
    let mapping = Mapping::new(group, step, reverse);
    let out = <burn::backend::Dispatch as MappingOps>::mapping(x.into_dispatch(), mapping.clone());
    let recv_splits = mapping.take_result()?;
    Ok((Tensor::from_dispatch(out), recv_splits))
}

fn apply_tensor<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    step: Step,
    reverse: Step,
) -> Result<Tensor<D>, CommError> {
    if group.size() == 1 {
        return Ok(x);
    }
    apply(x, group, step, reverse).map(|(x, _)| x)
}

/// Enters a tensor-parallel region: identity forward, all-reduce of the gradient backward.
pub fn copy_to_tp<const D: usize>(x: Tensor<D>, tp: &ProcessGroup) -> Result<Tensor<D>, CommError> {
    apply_tensor(x, tp, Step::Identity, Step::AllReduce)
}

/// Leaves a tensor-parallel region by summing partial results: all-reduce forward, identity
/// backward.
pub fn reduce_from_tp<const D: usize>(x: Tensor<D>, tp: &ProcessGroup) -> Result<Tensor<D>, CommError> {
    apply_tensor(x, tp, Step::AllReduce, Step::Identity)
}

/// Keeps this rank's slice of `dim` (the sequence, for sequence parallelism); the gradient is
/// all-gathered.
///
/// # Shapes
/// `[.., tp·n, ..]` → `[.., n, ..]`
pub fn scatter_to_sp<const D: usize>(x: Tensor<D>, tp: &ProcessGroup, dim: usize) -> Result<Tensor<D>, CommError> {
    apply_tensor(x, tp, Step::Split { dim }, Step::AllGather { dim })
}

/// All-gathers the sequence-parallel shards of `dim`; the gradient is reduce-scattered, since
/// each rank's gradient of the full tensor is a partial sum.
///
/// # Shapes
/// `[.., n, ..]` → `[.., tp·n, ..]`
pub fn gather_from_sp<const D: usize>(x: Tensor<D>, tp: &ProcessGroup, dim: usize) -> Result<Tensor<D>, CommError> {
    apply_tensor(x, tp, Step::AllGather { dim }, Step::ReduceScatter { dim })
}

/// All-gathers tensor-parallel outputs along `dim` (a column-parallel output that must be
/// whole); each rank's gradient is its own slice.
///
/// # Shapes
/// `[.., n, ..]` → `[.., tp·n, ..]`
pub fn gather_from_tp<const D: usize>(x: Tensor<D>, tp: &ProcessGroup, dim: usize) -> Result<Tensor<D>, CommError> {
    apply_tensor(x, tp, Step::AllGather { dim }, Step::Split { dim })
}

/// Sums partial results and keeps this rank's sequence shard of `dim`: reduce-scatter forward,
/// all-gather backward.
///
/// # Shapes
/// `[.., tp·n, ..]` → `[.., n, ..]`
pub fn reduce_scatter_to_sp<const D: usize>(
    x: Tensor<D>,
    tp: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<D>, CommError> {
    apply_tensor(x, tp, Step::ReduceScatter { dim }, Step::AllGather { dim })
}

/// Splits `split_dim` over the group and gathers `concat_dim`; the gradient goes back the
/// inverse way.
///
/// # Shapes
/// `[.., g·a, .., b, ..]` → `[.., a, .., g·b, ..]`
pub fn all_to_all<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    split_dim: usize,
    concat_dim: usize,
) -> Result<Tensor<D>, CommError> {
    let step = Step::AllToAll { split_dim, concat_dim };
    let reverse = Step::AllToAll {
        split_dim: concat_dim,
        concat_dim: split_dim,
    };
    apply_tensor(x, group, step, reverse)
}

/// Sends `send_splits[j]` entries of `dim` to group rank `j` and returns what arrived with the
/// count from each rank; the gradient is sent back along the same routes.
///
/// # Shapes
/// `[.., Σ send_splits, ..]` → `[.., Σ recv_splits, ..]`
pub fn all_to_all_uneven<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
    send_splits: &[usize],
) -> Result<(Tensor<D>, Vec<usize>), CommError> {
    let step = Step::AllToAllUneven {
        dim,
        send_splits: send_splits.to_vec(),
    };
    apply(x, group, step, Step::Identity)
}

/// Identity forward; backward, the gradient of `x` goes to `tap` (flattened, without autodiff)
/// and on unchanged. `x` is typically a parameter's value: its gradient reaches the tap once,
/// summed over every use. `group` is the group the tap reduces over (it runs no collective
/// itself).
pub fn tap_grad<const D: usize>(x: Tensor<D>, group: &ProcessGroup, tap: GradTap) -> Tensor<D> {
    let (out, _) = apply(x, group, Step::Identity, Step::Tap(tap)).expect("a tap runs no collective");
    out
}

/// Runs one step on a rank-`D` tensor through the group's collectives.
fn run_step<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    step: &Step,
) -> Result<(Tensor<D>, Vec<usize>), CommError> {
    let size = group.size();
    let none = Vec::new;
    match step {
        Step::Identity => Ok((x, none())),
        Step::AllReduce => Ok((group.all_reduce(x, ReduceOp::Sum)?, none())),
        Step::AllGather { dim } => Ok((group.all_gather(x, *dim)?, none())),
        Step::ReduceScatter { dim } => Ok((group.reduce_scatter(x, *dim, ReduceOp::Sum)?, none())),
        Step::Split { dim } => {
            let n = x.dims().get(*dim).copied().unwrap_or(0);
            if *dim >= D || n % size != 0 {
                return Err(CommError::InvalidArgument {
                    group: group.label().to_string(),
                    collective: "split",
                    detail: format!("dim {dim} of shape {:?} does not split over {size} ranks", x.dims()),
                });
            }
            let part = n / size;
            Ok((x.narrow(*dim, group.group_rank() * part, part), none()))
        }
        Step::AllToAll { split_dim, concat_dim } => Ok((group.all_to_all(x, *split_dim, *concat_dim)?, none())),
        Step::AllToAllUneven { dim, send_splits } => group.all_to_all_uneven(x, *dim, send_splits),
        Step::Tap(tap) => {
            let n = x.shape().num_elements();
            (tap.0)(x.clone().reshape([n]));
            Ok((x, none()))
        }
    }
}

/// The rank of a primitive, for the concrete backends.
fn rank_of<T: TensorMetadata>(x: &T) -> usize {
    x.shape().num_dims()
}
