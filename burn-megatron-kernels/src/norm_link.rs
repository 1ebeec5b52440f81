//! The gradients an RMSNorm's backward adds in its own kernel ([`NormLink`]).
//!
//! A pre-norm block reads its residual stream `x` twice: `h = x + f(rms_norm(x))`, and the
//! norm's output `y` feeds several products (q, k and v; the gate and up projections). Autodiff
//! sums the gradients of a tensor read twice in a pass of its own: `x`'s (the norm's input
//! gradient and `h`'s) and `y`'s (one from each product), every sum one more read and write of
//! the whole tensor. Linked, the ops around the norm hand those gradients to the norm's
//! backward instead, whose kernel adds them as it reads `dy` and writes `dx` (in f32, rounded
//! once):
//!
//! - [`residual_add`] hands `h`'s gradient over as `x`'s;
//! - [`fan_out`] gives `y` to `n` readers; the first gradient to arrive is registered with
//!   autodiff (the norm's own output gradient), the later ones are handed over.
//!
//! The norm's backward always runs after them: the branch is computed from the norm's output,
//! and the readers read it. Where the norm is not differentiated (an untracked input), or the
//! tensor is not a linked norm's own output (a mapping of it over tp is another tensor), the ops
//! register their gradients as autodiff would.

use std::any::Any;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend};
use burn::tensor::Tensor;

use crate::rms_norm::RmsNormOps;

/// Where the ops around one RMSNorm ([`crate::rms_norm::rms_norm_linked`]) hand it gradients
/// to add in its backward: see the module docs.
#[derive(Clone, Debug, Default)]
pub struct NormLink(Arc<Mutex<Linked>>);

/// What a link holds: float primitives of the backend the norm's backward runs on.
#[derive(Debug, Default)]
pub(crate) struct Linked {
    /// A differentiated norm will take what is handed over.
    pub(crate) norm: bool,
    /// The residual stream's gradient, added to the input gradient.
    pub(crate) residual: Option<Box<dyn Any + Send>>,
    /// Gradients of the output's later readers, added to the output gradient.
    pub(crate) uses: Vec<Box<dyn Any + Send>>,
    /// How many gradients the norm has taken.
    pub(crate) taken: usize,
}

impl NormLink {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Linked> {
        self.0.lock().expect("a norm link's lock")
    }
}

/// The gradients a link held for the norm's backward, taken out of it.
pub(crate) struct Handed<T> {
    pub(crate) residual: Option<T>,
    pub(crate) uses: Vec<T>,
}

impl Linked {
    pub(crate) fn take<T: 'static>(&mut self) -> Handed<T> {
        let cast = |b: Box<dyn Any + Send>| *b.downcast::<T>().expect("a gradient of the norm's backend");
        self.taken += self.uses.len() + usize::from(self.residual.is_some());
        Handed {
            residual: self.residual.take().map(cast),
            uses: self.uses.drain(..).map(cast).collect(),
        }
    }
}

/// Norms that leave links on their outputs: a thread keeps the last few, each found by the
/// autodiff node of the output (not its memory: a mapping of the output over tp is another node).
const KEPT: usize = 4;

thread_local! {
    static OUTPUTS: RefCell<VecDeque<(NodeId, NormLink)>> = const { RefCell::new(VecDeque::new()) };
}

/// Leaves `link` on the norm output whose node is `node`, for [`fan_out`].
pub(crate) fn leave_on_output(node: NodeId, link: NormLink) {
    OUTPUTS.with_borrow_mut(|outputs| {
        if outputs.len() == KEPT {
            outputs.pop_front();
        }
        outputs.push_back((node, link));
    });
}

fn link_of_output(node: NodeId) -> Option<NormLink> {
    OUTPUTS.with_borrow(|outputs| outputs.iter().find(|(n, _)| *n == node).map(|(_, l)| l.clone()))
}

/// The readers of one [`fan_out`]: whether one of them has registered its gradient yet.
#[derive(Clone, Debug, Default)]
pub struct FanOut(Arc<Mutex<bool>>);

#[derive(Debug)]
struct ResidualBackward;

impl<B: Backend> Backward<B, 2> for ResidualBackward {
    type State = NormLink;

    /// The sum's gradient is the branch's, and `x`'s: handed to the linked norm where one is
    /// differentiated, else registered here.
    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_branch] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = node_branch {
            grads.register::<B>(node.id, grad.clone());
        }
        if let Some(node) = node_x {
            let mut linked = ops.state.lock();
            match linked.norm && linked.residual.is_none() {
                true => linked.residual = Some(Box::new(grad)),
                false => grads.register::<B>(node.id, grad),
            }
        }
    }
}

#[derive(Debug)]
struct FanOutBackward;

impl<B: Backend> Backward<B, 1> for FanOutBackward {
    type State = (NormLink, FanOut);

    /// The first reader's gradient is registered; a later one is handed to the norm.
    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let Some(node) = node else { return };
        let (link, fan) = ops.state;
        let mut registered = fan.0.lock().expect("a fan-out's lock");
        let mut linked = link.lock();
        match *registered && linked.norm {
            true => linked.uses.push(Box::new(grad)),
            false => {
                *registered = true;
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// [`RmsNormOps::residual_add`] under autodiff.
pub(crate) fn residual_add_tracked<B: Backend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    branch: FloatTensor<Autodiff<B, C>>,
    link: NormLink,
) -> FloatTensor<Autodiff<B, C>> {
    let nodes = [x.node(), branch.node()];
    let sum = B::float_add(x.into_parts().0, branch.into_parts().0);
    match ResidualBackward.prepare::<C>(nodes).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish(link, sum),
        OpsKind::UnTracked(prep) => prep.finish(sum),
    }
}

/// [`RmsNormOps::fan_out_use`] under autodiff: a reader's own node where `x` is a linked,
/// differentiated norm's output, else `x`.
pub(crate) fn fan_out_use_tracked<B: Backend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    fan: FanOut,
) -> FloatTensor<Autodiff<B, C>> {
    let Some(link) = link_of_output(x.id()) else {
        return x;
    };
    let nodes = [x.node()];
    let value = x.into_parts().0;
    match FanOutBackward.prepare::<C>(nodes).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish((link, fan), value),
        OpsKind::UnTracked(prep) => prep.finish(value),
    }
}

/// `x + branch`, where `branch` is computed from the output of `x`'s
/// [`rms_norm_linked`](crate::rms_norm::rms_norm_linked) with the same `link`: `x`'s gradient
/// then reaches `x` through that norm's backward, added by its kernel.
///
/// # Shapes
/// both of one shape
pub fn residual_add<const D: usize>(x: Tensor<D>, branch: Tensor<D>, link: &NormLink) -> Tensor<D> {
    Tensor::from_dispatch(<burn::backend::Dispatch as RmsNormOps>::residual_add(
        x.into_dispatch(),
        branch.into_dispatch(),
        link.clone(),
    ))
}

/// `x` for `n` readers (the products that share a norm's output): where `x` is a linked norm's
/// own output, the readers' gradients after the first are added by the norm's backward kernel
/// instead of by autodiff; elsewhere `n` handles of `x`.
pub fn fan_out<const D: usize>(x: Tensor<D>, n: usize) -> Vec<Tensor<D>> {
    let fan = FanOut::default();
    (0..n)
        .map(|_| {
            Tensor::from_dispatch(<burn::backend::Dispatch as RmsNormOps>::fan_out_use(
                x.clone().into_dispatch(),
                fan.clone(),
            ))
        })
        .collect()
}
