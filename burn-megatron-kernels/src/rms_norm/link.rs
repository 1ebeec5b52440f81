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
use std::sync::{Arc, Mutex, MutexGuard};

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend};

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
    /// The autodiff node of the differentiated norm's output: the tensor whose readers
    /// [`fan_out`] links (not its memory: a mapping of the output over tp is another node).
    pub(crate) output: Option<NodeId>,
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

/// Leaves `link` on the norm output whose node is `node`, for [`fan_out`].
pub(crate) fn leave_on_output(node: NodeId, link: &NormLink) {
    link.lock().output = Some(node);
}

/// The readers of one [`fan_out`]: the link of the norm whose output they read, if any, and
/// whether one of them has registered its gradient yet.
#[derive(Clone, Debug, Default)]
pub struct FanOut {
    link: Option<NormLink>,
    registered: Arc<Mutex<bool>>,
}

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
    type State = (NormLink, Arc<Mutex<bool>>);

    /// The first reader's gradient is registered; a later one is handed to the norm.
    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let Some(node) = node else { return };
        let (link, registered) = ops.state;
        let mut registered = registered.lock().expect("a fan-out's lock");
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
    let sum = B::float_add(x.clone().into_parts().0, branch.clone().into_parts().0);
    residual_node::<B, C>(x, branch, link, sum)
}

/// `sum`, the inner backend's `x + branch` (computed by the caller, perhaps in the kernel of
/// the branch's last product: [`crate::gemm::GemmOps::gemm_onto`]), as the output of
/// [`residual_add`]'s node.
pub(crate) fn residual_node<B: Backend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    branch: FloatTensor<Autodiff<B, C>>,
    link: NormLink,
    sum: FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    let nodes = [x.node(), branch.node()];
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
    let linked = fan.link.filter(|link| link.lock().output == Some(x.id()));
    let Some(link) = linked else {
        return x;
    };
    let nodes = [x.node()];
    let value = x.into_parts().0;
    match FanOutBackward.prepare::<C>(nodes).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish((link, fan.registered), value),
        OpsKind::UnTracked(prep) => prep.finish(value),
    }
}

impl FanOut {
    /// The readers of one fan-out of the output of `link`'s norm, if any.
    pub(crate) fn new(link: Option<&NormLink>) -> Self {
        Self {
            link: link.cloned(),
            registered: Arc::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Tensor, Tolerance};

    use super::NormLink;
    use crate::quant::notes::NoteAmaxes;
    use crate::rms_norm::{fan_out, residual_add};
    use crate::rms_norm::{rms_norm, rms_norm_linked};

    /// A pre-norm block's half, `h = x + (rms_norm(x) ∘ v)`, with the norm linked to the residual
    /// add against the same written with a plain norm and `+`: the same output and, bit for bit
    /// (f32: the norm's gradient and the stream's added once, in either order), the gradients of
    /// `x`, the weight and `v`. With `x` untracked the add keeps nothing for the norm, and `v`'s
    /// gradient is the same.
    #[test]
    fn linked_residual_matches_the_plain_sum() {
        let device = Device::flex().autodiff();
        let leaf = |dims: [usize; 3], mean: f64| {
            Tensor::<3>::random(dims, Distribution::Normal(mean, 1.0), &device).require_grad()
        };
        let (x, v) = (leaf([2, 5, 12], 0.0), leaf([2, 5, 12], 1.0));
        let w = Tensor::<1>::random([12], Distribution::Normal(1.0, 0.5), &device).require_grad();
        let weights = Tensor::<3>::random([2, 5, 12], Distribution::Normal(0.0, 1.0), &device);
        let link = NormLink::default();
        let linked = residual_add(
            x.clone(),
            rms_norm_linked(x.clone(), w.clone(), 1e-5, NoteAmaxes::default(), &link) * v.clone(),
            &link,
        );
        let plain = x.clone() + rms_norm(x.clone(), w.clone(), 1e-5) * v.clone();
        linked.to_data().assert_eq(&plain.to_data(), true);
        let (g1, g2) = (
            (linked * weights.clone()).sum().backward(),
            (plain * weights.clone()).sum().backward(),
        );
        assert_eq!(link.lock().taken, 1, "the stream's gradient went through the link");
        for (name, t) in [("x", &x), ("v", &v)] {
            let (a, b) = (t.grad(&g1).unwrap(), t.grad(&g2).unwrap());
            assert_eq!(a.to_data(), b.to_data(), "{name}'s gradient");
        }
        assert_eq!(
            w.grad(&g1).unwrap().to_data(),
            w.grad(&g2).unwrap().to_data(),
            "w's gradient"
        );
        let untracked = x.clone().detach();
        let link = NormLink::default();
        let y = rms_norm_linked(untracked.clone(), w.clone(), 1e-5, NoteAmaxes::default(), &link) * v.clone();
        let g = (residual_add(untracked, y, &link) * weights).sum().backward();
        let (a, b) = (v.grad(&g).unwrap(), v.grad(&g2).unwrap());
        assert_eq!(a.to_data(), b.to_data(), "v's gradient with x untracked");
    }

    /// The whole half-block with the norm's output read by three products through `fan_out` (as
    /// q, k and v read it), `h = x + Σᵢ fan_out(rms_norm(x))ᵢ ∘ vᵢ`, against the plain norm read
    /// three times: the same output, and every gradient within f32 rounding (the readers'
    /// gradients summed in another order than autodiff's). A fan-out of a tensor no linked norm
    /// wrote is plain handles: gradients summed by autodiff, bit for bit.
    #[test]
    fn fanned_out_readers_match_the_plain_sum() {
        let device = Device::flex().autodiff();
        let leaf = |dims: [usize; 3], mean: f64| {
            Tensor::<3>::random(dims, Distribution::Normal(mean, 1.0), &device).require_grad()
        };
        let x = leaf([2, 5, 12], 0.0);
        let vs = [leaf([2, 5, 12], 1.0), leaf([2, 5, 12], -1.0), leaf([2, 5, 12], 0.5)];
        let w = Tensor::<1>::random([12], Distribution::Normal(1.0, 0.5), &device).require_grad();
        let weights = Tensor::<3>::random([2, 5, 12], Distribution::Normal(0.0, 1.0), &device);
        let branch = |readers: Vec<Tensor<3>>| {
            let mut terms = readers.into_iter().zip(&vs).map(|(r, v)| r * v.clone());
            let first = terms.next().expect("three readers");
            terms.fold(first, |sum, t| sum + t)
        };
        let link = NormLink::default();
        let y = rms_norm_linked(x.clone(), w.clone(), 1e-5, NoteAmaxes::default(), &link);
        let linked = residual_add(x.clone(), branch(fan_out(y, 3, Some(&link))), &link);
        let y = rms_norm(x.clone(), w.clone(), 1e-5);
        let plain = x.clone() + branch(vec![y; 3]);
        linked.to_data().assert_eq(&plain.to_data(), true);
        let (g1, g2) = (
            (linked * weights.clone()).sum().backward(),
            (plain * weights.clone()).sum().backward(),
        );
        // The stream's gradient and two of the three readers' went through the link.
        assert_eq!(link.lock().taken, 3, "gradients the norm took");
        // Sums of three f32 terms of order 1 in another order: an ulp or two.
        let tolerance = Tolerance::absolute(1e-5);
        for (name, a, b) in [
            ("x", x.grad(&g1), x.grad(&g2)),
            ("v0", vs[0].grad(&g1), vs[0].grad(&g2)),
            ("v2", vs[2].grad(&g1), vs[2].grad(&g2)),
        ] {
            let (a, b) = (a.unwrap(), b.unwrap());
            a.to_data().assert_approx_eq::<f32>(&b.to_data(), tolerance);
            assert!(
                a.abs().sum().into_scalar::<f32>() > 0.0,
                "{name}'s gradient is not zero"
            );
        }
        w.grad(&g1)
            .unwrap()
            .to_data()
            .assert_approx_eq::<f32>(&w.grad(&g2).unwrap().to_data(), tolerance);
        let (fanned, copies) = (branch(fan_out(x.clone(), 3, Some(&link))), branch(vec![x.clone(); 3]));
        let (g1, g2) = (
            (fanned * weights.clone()).sum().backward(),
            (copies * weights).sum().backward(),
        );
        assert_eq!(
            x.grad(&g1).unwrap().to_data(),
            x.grad(&g2).unwrap().to_data(),
            "plain handles"
        );
    }

    /// The branch's last product added onto the stream in its op (`linear_onto`, and the fused
    /// MLP's `gated_mlp_onto`), after a linked norm: `h = x + rms_norm(x) · w` and
    /// `h = x + mlp(rms_norm(x))` against the same written with a plain norm and `+`. The same
    /// output and gradients of `x`, the norm's weight and the products' weights within f32
    /// rounding (the products summed in another order perhaps), with the stream's gradient
    /// handed through the link.
    #[test]
    fn products_onto_the_stream_match_the_plain_sum() {
        use crate::gated_mlp::gated_mlp_onto;
        use crate::gemm::{Gemm, linear_onto};
        use burn::tensor::TensorData;
        use burn::tensor::activation::silu;
        let device = Device::flex().autodiff();
        let normal = Distribution::Normal(0.0, 1.0);
        let x = Tensor::<3>::random([2, 5, 12], normal, &device).require_grad();
        let w = Tensor::<1>::random([12], Distribution::Normal(1.0, 0.5), &device).require_grad();
        let leaf = |dims: [usize; 2]| Tensor::<2>::random(dims, normal, &device).require_grad();
        let (w_out, w1, w3, w2) = (leaf([12, 12]), leaf([12, 7]), leaf([12, 7]), leaf([7, 12]));
        let weights = Tensor::<3>::random([2, 5, 12], normal, &device);
        let norm = |link: &NormLink| rms_norm_linked(x.clone(), w.clone(), 1e-5, NoteAmaxes::default(), link);
        let batched = |m: &Tensor<2>| m.clone().unsqueeze::<3>();
        for fused in [false, true] {
            let link = NormLink::default();
            let (ours, plain) = match fused {
                false => (
                    linear_onto(x.clone(), norm(&link), w_out.clone(), Gemm::Wgmma, &link),
                    x.clone() + rms_norm(x.clone(), w.clone(), 1e-5).matmul(batched(&w_out)),
                ),
                true => {
                    let readers: [Tensor<3>; 2] = fan_out(norm(&link), 2, Some(&link)).try_into().expect("two readers");
                    let [x1, x3] = readers;
                    let y = rms_norm(x.clone(), w.clone(), 1e-5);
                    let hidden = silu(y.clone().matmul(batched(&w1))) * y.matmul(batched(&w3));
                    (
                        gated_mlp_onto(
                            x.clone(),
                            &link,
                            x1,
                            x3,
                            [w1.clone(), w3.clone(), w2.clone()],
                            Gemm::Wgmma,
                        ),
                        x.clone() + hidden.matmul(batched(&w2)),
                    )
                }
            };
            // f32 products of 12 and 7 terms of order 1, perhaps summed in another order.
            let tolerance = Tolerance::absolute(1e-4);
            ours.to_data().assert_approx_eq::<f32>(&plain.to_data(), tolerance);
            let (g1, g2) = (
                (ours * weights.clone()).sum().backward(),
                (plain * weights.clone()).sum().backward(),
            );
            // The stream's gradient (and the second reader's) went through the link.
            assert_eq!(link.lock().taken, 1 + usize::from(fused), "fused {fused}");
            let same = |a: TensorData, b: TensorData| a.assert_approx_eq::<f32>(&b, tolerance);
            same(x.grad(&g1).unwrap().to_data(), x.grad(&g2).unwrap().to_data());
            same(w.grad(&g1).unwrap().to_data(), w.grad(&g2).unwrap().to_data());
            let products = match fused {
                false => vec![&w_out],
                true => vec![&w1, &w3, &w2],
            };
            for t in products {
                same(t.grad(&g1).unwrap().to_data(), t.grad(&g2).unwrap().to_data());
            }
        }
    }
}
