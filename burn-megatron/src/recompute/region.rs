//! A region of the forward pass that keeps only its inputs: [`recompute`] runs it without a
//! graph, and its backward runs it again with one, seeded by the output's gradient (what
//! Megatron's `tensor_parallel.checkpoint` and PyTorch's `torch.utils.checkpoint` do).
//!
//! It is one Burn backend extension, [`RegionOps`]:
//! - The concrete backends run the region on tensors that require no gradient, so no graph and
//!   no activation outlives the call; for the gradient they run it again on fresh leaves, with
//!   a graph of its own, and take every leaf's gradient from that graph's backward.
//! - The `Autodiff` implementation records one node for the region. Its parents are every
//!   input, the region's tensors and the module's parameters, tied into one anchor (a chain of
//!   no-op nodes), so the backward pass reaches each of them after the region and runs their
//!   own steps (a data-parallel tap behind a parameter, say) once the region has registered
//!   their gradients.
//!
//! The region is run again exactly as it ran (same inputs, same parameters, same kernels), so
//! its gradients are the ones of no recomputation. A collective inside it is called again on
//! every rank, in the same order, during backward.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    Autodiff, AutodiffBackend, Backend, DispatchKindConversion, Flex, TensorMetadata, backend_extension,
};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{BackendPrimitive, DispatchTensor, Float, FloatDType, Tensor};

use super::seeded_backward;
use crate::error::LayerError;

/// What a region computes, over its inputs flattened (the region's tensors, then the module's
/// parameters in traversal order), to its output flattened.
type Run = dyn Fn(Vec<Tensor<1>>) -> Result<Tensor<1>, LayerError> + Send + Sync;

/// A region: what it computes, tensors it travels with, and the first error its forward met
/// (an extension op returns only tensors). A downstream extension op takes its tensors one
/// argument each, so a region's inputs past the first travel here: `tensors`.
#[derive(Clone)]
pub struct Region {
    run: Arc<Run>,
    error: Arc<Mutex<Option<LayerError>>>,
    tensors: Vec<Tensor<1>>,
    /// The output's last dim (its rows' width), once it has run: how its seed is reduced.
    width: Arc<AtomicUsize>,
}

impl Region {
    fn with_tensors(&self, tensors: Vec<Tensor<1>>) -> Self {
        Self {
            tensors,
            ..self.clone()
        }
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Region of {} tensors", self.tensors.len())
    }
}

/// The backend extension behind [`recompute`].
#[backend_extension(Flex, Cube: cfg(feature = "cuda"), Autodiff)]
pub trait RegionOps: Backend {
    /// The region's output (flattened) from its inputs (each flattened): `first`, then the
    /// region's tensors. On the autodiff backend, a node whose backward runs the region again.
    fn region(first: FloatTensor<Self>, region: Region) -> FloatTensor<Self>;

    /// Each input's gradient (flattened; zeros for one the output does not depend on), given
    /// the output's: the region, whose tensors are then all its inputs, run again with a graph
    /// of its own.
    fn region_grad(grad: FloatTensor<Self>, region: Region) -> Vec<FloatTensor<Self>>;
}

/// The region's output on a concrete backend: its inputs on the autodiff device (where its
/// module's own tensors, RoPE's tables say, live) but requiring no gradient, so no graph is
/// kept. An error is left in the region and an empty tensor returned.
fn run_concrete<B: Backend>(first: FloatTensor<B>, region: &Region) -> FloatTensor<B>
where
    Float: BackendPrimitive<B, Primitive = FloatTensor<B>>,
    DispatchTensor: DispatchKindConversion<B>,
{
    let empty = B::float_zeros([0].into(), &first.device(), FloatDType::from(first.dtype()));
    let inputs = std::iter::once(Tensor::<1>::from_primitive::<B>(first))
        .chain(region.tensors.iter().cloned())
        .map(Tensor::autodiff)
        .collect();
    match (region.run)(inputs) {
        Ok(out) => out
            .without_autodiff()
            .try_into_primitive::<B>()
            .expect("the output stays on its backend"),
        Err(error) => {
            region.error.lock().expect("region error").get_or_insert(error);
            empty
        }
    }
}

/// Every input's gradient on a concrete backend: the region run again on fresh leaves, its
/// output seeded with `grad` (`seeded_backward`, row by row). A failure here cannot be returned through Burn's `backward()`:
/// it panics with the error's text.
fn grad_concrete<B: Backend>(grad: FloatTensor<B>, region: &Region) -> Vec<FloatTensor<B>>
where
    Float: BackendPrimitive<B, Primitive = FloatTensor<B>>,
    DispatchTensor: DispatchKindConversion<B>,
{
    let leaves: Vec<Tensor<1>> = region
        .tensors
        .iter()
        .map(|x| x.clone().autodiff().require_grad())
        .collect();
    let out = (region.run)(leaves.clone()).unwrap_or_else(|error| panic!("recomputing a region failed: {error}"));
    let width = region.width.load(Ordering::Relaxed).max(1);
    let rows = |x: Tensor<1>| {
        let n = x.dims()[0];
        x.reshape([n / width, width])
    };
    let seed = Tensor::<1>::from_primitive::<B>(grad).autodiff();
    let grads = seeded_backward(rows(out), rows(seed));
    leaves
        .iter()
        .map(|leaf| {
            let grad = leaf
                .grad(&grads)
                .unwrap_or_else(|| leaf.zeros_like().without_autodiff());
            grad.try_into_primitive::<B>()
                .expect("the gradient stays on its backend")
        })
        .collect()
}

impl RegionOps for Flex {
    fn region(first: FloatTensor<Self>, region: Region) -> FloatTensor<Self> {
        run_concrete::<Self>(first, &region)
    }

    fn region_grad(grad: FloatTensor<Self>, region: Region) -> Vec<FloatTensor<Self>> {
        grad_concrete::<Self>(grad, &region)
    }
}

#[cfg(feature = "cuda")]
impl RegionOps for burn::backend::Cube {
    fn region(first: FloatTensor<Self>, region: Region) -> FloatTensor<Self> {
        run_concrete::<Self>(first, &region)
    }

    fn region_grad(grad: FloatTensor<Self>, region: Region) -> Vec<FloatTensor<Self>> {
        grad_concrete::<Self>(grad, &region)
    }
}

/// A no-op node joining its parents, so that one parent reaches them all.
#[derive(Debug)]
struct Tie;

impl<B: Backend, const N: usize> Backward<B, N> for Tie {
    type State = ();

    fn backward(self, _ops: Ops<(), N>, _grads: &mut Gradients, _checkpointer: &mut Checkpointer) {}
}

/// What the region's node keeps: the region with all its inputs (the region's tensors and the
/// parameters, which live on anyway) off autodiff and, for each, the node its gradient goes to
/// (`None`: not tracked).
#[derive(Clone, Debug)]
struct RegionState {
    nodes: Vec<Option<NodeId>>,
    region: Region,
}

#[derive(Debug)]
struct RegionBackward;

impl<B: Backend + RegionOps> Backward<B, 1> for RegionBackward {
    type State = RegionState;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let RegionState { nodes, region } = ops.state;
        for (node, grad) in nodes.into_iter().zip(B::region_grad(grad, region)) {
            if let Some(node) = node {
                grads.register::<B>(node, grad);
            }
        }
    }
}

impl<B: Backend + RegionOps, C: CheckpointStrategy> RegionOps for Autodiff<B, C>
where
    Float: BackendPrimitive<B, Primitive = FloatTensor<B>> + BackendPrimitive<Self, Primitive = FloatTensor<Self>>,
    DispatchTensor: DispatchKindConversion<B> + DispatchKindConversion<Self>,
{
    fn region(first: FloatTensor<Self>, region: Region) -> FloatTensor<Self> {
        let rest = region.tensors.iter().map(|x| {
            x.clone()
                .try_into_primitive::<Self>()
                .expect("a region's tensors are on its first input's backend")
        });
        let inputs: Vec<FloatTensor<Self>> = std::iter::once(first).chain(rest).collect();
        let nodes: Vec<Option<NodeId>> = inputs.iter().map(|x| x.is_tracked().then(|| x.id())).collect();
        let guards: Vec<_> = inputs.iter().map(|x| x.node()).collect();
        let inner: Vec<Tensor<1>> = inputs
            .into_iter()
            .map(|x| Tensor::<1>::from_primitive::<B>(x.into_primitive()))
            .collect();
        let first = inner[0]
            .clone()
            .try_into_primitive::<B>()
            .expect("the first input's backend");
        let output = B::region(first, region.with_tensors(inner[1..].to_vec()));
        // The tie nodes' outputs are never read: one element, shared.
        let dummy = B::float_zeros([1].into(), &output.device(), FloatDType::from(output.dtype()));
        let mut guards = guards.into_iter();
        let first = guards.next().expect("a region has inputs");
        let mut anchor: FloatTensor<Self> = Tie.prepare::<C>([first]).compute_bound().stateless(dummy.clone());
        for guard in guards {
            anchor = Tie
                .prepare::<C>([anchor.node(), guard])
                .compute_bound()
                .stateless(dummy.clone());
        }
        match RegionBackward.prepare::<C>([anchor.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(
                RegionState {
                    nodes,
                    region: region.with_tensors(inner),
                },
                output,
            ),
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }

    fn region_grad(grad: FloatTensor<Self>, region: Region) -> Vec<FloatTensor<Self>> {
        let inner = region.tensors.iter().map(|x| x.clone().without_autodiff()).collect();
        B::region_grad(grad.into_primitive(), region.with_tensors(inner))
            .into_iter()
            .map(<Self as AutodiffBackend>::from_inner)
            .collect()
    }
}

/// `run(module, inputs)`, keeping only `inputs` (and `module`'s parameters, which live on
/// anyway) for backward, which runs it again. Same values and gradients as `run` itself.
/// Outside autodiff (no input or parameter on an autodiff device) it is `run`.
///
/// `run` must be a function of `module` and `inputs` alone: called again in backward, it must
/// compute the same thing (the same collectives in the same order on every rank included).
pub fn recompute<M, const R: usize, const D: usize>(
    module: &M,
    inputs: Vec<Tensor<R>>,
    run: impl Fn(&M, Vec<Tensor<R>>) -> Result<Tensor<D>, LayerError> + Send + Sync + 'static,
) -> Result<Tensor<D>, LayerError>
where
    M: Module + Send + Sync + 'static,
{
    let params = live_params(module);
    if !inputs.iter().any(Tensor::is_autodiff) && !params.iter().any(|(p, _)| p.is_autodiff()) {
        return run(module, inputs);
    }
    let input_dims: Vec<[usize; R]> = inputs.iter().map(Tensor::dims).collect();
    let (params, param_dims): (Vec<Tensor<1>>, Vec<Vec<usize>>) = params.into_iter().unzip();
    let n = inputs.len();
    let flat: Vec<Tensor<1>> = inputs.into_iter().map(flatten).chain(params).collect();
    let out_dims: Arc<Mutex<Option<[usize; D]>>> = Arc::default();
    let (module, dims) = (module.clone(), out_dims.clone());
    let width = Arc::new(AtomicUsize::new(1));
    let shared_width = width.clone();
    let mut flat = flat.into_iter();
    let first = flat.next().expect("a region has inputs");
    let region = Region {
        tensors: flat.collect(),
        run: Arc::new(move |mut flat: Vec<Tensor<1>>| {
            let params = flat.split_off(n);
            let inputs = flat
                .into_iter()
                .zip(&input_dims)
                .map(|(x, dims)| x.reshape(*dims))
                .collect();
            let values = params
                .into_iter()
                .zip(&param_dims)
                .map(|(p, dims)| (p, dims.clone()))
                .collect();
            let out = run(&with_params(module.clone(), values), inputs)?;
            *dims.lock().expect("region dims") = Some(out.dims());
            width.store(out.dims()[D - 1], Ordering::Relaxed);
            Ok(flatten(out))
        }),
        error: Arc::default(),
        width: shared_width,
    };
    let out = Tensor::<1>::from_dispatch(<burn::backend::Dispatch as RegionOps>::region(
        first.into_dispatch(),
        region.clone(),
    ));
    if let Some(error) = region.error.lock().expect("region error").take() {
        return Err(error);
    }
    let dims = out_dims.lock().expect("region dims").expect("the region ran");
    Ok(out.reshape(dims))
}

fn flatten<const D: usize>(x: Tensor<D>) -> Tensor<1> {
    let n = x.shape().num_elements();
    x.reshape([n])
}

/// Every float parameter's value as the module holds it (not detached: behind whatever graph
/// it has, a data-parallel tap say), flattened, with its shape, in traversal order.
fn live_params<M: Module>(module: &M) -> Vec<(Tensor<1>, Vec<usize>)> {
    struct Collect(Vec<(Tensor<1>, Vec<usize>)>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            let dims = value.dims().to_vec();
            self.0.push((flatten(value), dims));
        }
    }
    let mut collect = Collect(Vec::new());
    module.visit(&mut collect);
    collect.0
}

/// `module` with its float parameters' values, in traversal order, replaced by `values` (each
/// flattened, with its shape), as they are: no detach, no new leaf.
fn with_params<M: Module>(module: M, values: Vec<(Tensor<1>, Vec<usize>)>) -> M {
    struct Substitute(std::vec::IntoIter<(Tensor<1>, Vec<usize>)>);
    impl ModuleMapper for Substitute {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (value, dims) = self.0.next().expect("a value a parameter");
            let dims: [usize; D] = dims.try_into().expect("the parameter's rank");
            param.map(|_| value.reshape(dims))
        }
    }
    module.map(&mut Substitute(values.into_iter()))
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use burn::module::{Module, Param};
    use burn::tensor::{Device, Distribution, Tensor, Tolerance};
    use burn_megatron_dist::ProcessGroups;
    use burn_megatron_dist::mappings::{GradTap, tap_grad};

    use super::recompute;
    use crate::error::LayerError;

    #[derive(Module, Debug)]
    struct Net {
        w: Param<Tensor<2>>,
        b: Param<Tensor<1>>,
        /// Not trainable: no gradient.
        frozen: Param<Tensor<1>>,
    }

    fn net(device: &Device) -> Net {
        let normal = Distribution::Normal(0.0, 1.0);
        Net {
            w: Param::from_tensor(Tensor::random([3, 4], normal, device)),
            b: Param::from_tensor(Tensor::random([4], normal, device)),
            frozen: Param::from_tensor(Tensor::random([4], normal, device)).set_require_grad(false),
        }
    }

    /// `tanh(x·w + b) ⊙ frozen + x₀·y`, two inputs, every parameter.
    fn body(net: &Net, mut xs: Vec<Tensor<2>>) -> Result<Tensor<2>, LayerError> {
        let (y, x) = (xs.pop().unwrap(), xs.pop().unwrap());
        let h = (x.matmul(net.w.val()) + net.b.val().unsqueeze()).tanh() * net.frozen.val().unsqueeze();
        Ok(h + y.clone() * y)
    }

    /// The region against running its body: the output, and the gradients of both inputs and
    /// of `w` (which the loss also uses outside the region: the two pieces are added), with
    /// the frozen parameter left without one. The same ops on the same values, so the same
    /// bits, up to the order of `w`'s two pieces.
    #[test]
    fn matches_running_the_body() {
        let device = Device::flex().autodiff();
        let model = net(&device);
        let normal = Distribution::Normal(0.0, 1.0);
        let x = Tensor::<2>::random([5, 3], normal, &device).require_grad();
        let y = Tensor::<2>::random([5, 4], normal, &device).require_grad();
        let outside = |net: &Net| net.w.val().powi_scalar(2).sum();
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = runs.clone();
        let counting = move |net: &Net, xs: Vec<Tensor<2>>| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            body(net, xs)
        };
        let ours = recompute(&model, vec![x.clone(), y.clone()], counting).unwrap();
        let theirs = body(&model, vec![x.clone(), y.clone()]).unwrap();
        ours.to_data().assert_eq(&theirs.to_data(), true);
        let dz = Tensor::<2>::random([5, 4], normal, &device);
        let g1 = ((ours * dz.clone()).sum() + outside(&model)).backward();
        let g2 = ((theirs * dz).sum() + outside(&model)).backward();
        // Once forward, once again in backward.
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
        let tolerance = Tolerance::absolute(1e-6);
        for (a, b) in [(x.grad(&g1), x.grad(&g2)), (y.grad(&g1), y.grad(&g2))] {
            a.unwrap().to_data().assert_eq(&b.unwrap().to_data(), true);
        }
        let (a, b) = (model.b.val().grad(&g1).unwrap(), model.b.val().grad(&g2).unwrap());
        a.to_data().assert_eq(&b.to_data(), true);
        let (a, b) = (model.w.val().grad(&g1).unwrap(), model.w.val().grad(&g2).unwrap());
        a.to_data().assert_approx_eq::<f32>(&b.to_data(), tolerance);
        assert!(model.frozen.val().grad(&g1).is_none());
    }

    /// Inputs that require no gradient still give the parameters theirs; outside autodiff the
    /// region is its body; an error in the body is returned.
    #[test]
    fn untracked_inputs_inference_and_errors() {
        let device = Device::flex().autodiff();
        let model = net(&device);
        let normal = Distribution::Normal(0.0, 1.0);
        let (x, y) = (
            Tensor::<2>::random([5, 3], normal, &device),
            Tensor::<2>::random([5, 4], normal, &device),
        );
        let grads = recompute(&model, vec![x.clone(), y.clone()], body)
            .unwrap()
            .sum()
            .backward();
        let expected = body(&model, vec![x.clone(), y.clone()]).unwrap().sum().backward();
        model
            .b
            .val()
            .grad(&grads)
            .unwrap()
            .to_data()
            .assert_eq(&model.b.val().grad(&expected).unwrap().to_data(), true);

        let plain = net(&Device::flex());
        let inputs = vec![x.without_autodiff(), y.without_autodiff()];
        let out = recompute(&plain, inputs.clone(), body).unwrap();
        out.to_data()
            .assert_eq(&body(&plain, inputs.clone()).unwrap().to_data(), true);

        let failing = |_: &Net, _: Vec<Tensor<2>>| -> Result<Tensor<2>, LayerError> {
            Err(crate::error::ConfigError::Zero { what: "blocks" }.into())
        };
        let inputs = inputs.into_iter().map(|x| x.autodiff().require_grad()).collect();
        assert!(recompute(&model, inputs, failing).is_err());
    }

    /// A parameter behind a data-parallel tap (`optim::Overlap`): its tap receives the
    /// region's gradient, once.
    #[test]
    fn taps_behind_parameters_receive_gradients() {
        let device = Device::flex().autodiff();
        let model = net(&device);
        let received: Arc<Mutex<Vec<Tensor<1>>>> = Arc::default();
        let sink = received.clone();
        let tap = GradTap::new(move |grad| sink.lock().unwrap().push(grad));
        let groups = ProcessGroups::single();
        let tapped = Net {
            b: model.b.clone().map(|b| tap_grad(b, &groups.dp, tap)),
            ..model.clone()
        };
        let normal = Distribution::Normal(0.0, 1.0);
        let xs = vec![
            Tensor::<2>::random([5, 3], normal, &device).require_grad(),
            Tensor::<2>::random([5, 4], normal, &device),
        ];
        let grads = recompute(&tapped, xs.clone(), body).unwrap().sum().backward();
        let expected = body(&model, xs).unwrap().sum().backward();
        let received = received.lock().unwrap();
        assert_eq!(received.len(), 1);
        received[0]
            .to_data()
            .assert_eq(&model.b.val().grad(&expected).unwrap().to_data(), true);
        assert!(model.b.val().grad(&grads).is_some());
    }
}
