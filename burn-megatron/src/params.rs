//! A model's float parameters in one fixed order (Burn's traversal order), for the optimizer,
//! checkpoints and Hugging Face import/export: their paths and tensor-parallel split
//! ([`param_infos`]), values ([`param_values`]), gradients ([`param_grads`], [`take_grads`],
//! [`grads_params`]) and new values ([`map_params`]). Every walk over parameters lives here.
//!
//! The split is read off the layer that owns the parameter: column-parallel weights and biases,
//! row-parallel weights, vocabulary-parallel embeddings and experts' hidden features are split
//! over tp, experts over ep; everything else (norms, row-parallel biases, routers, a user's
//! plain layers) is replicated.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Gradients, Tensor};

/// One parameter as the walk sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamInfo {
    /// Its path in the model, such as `layers.0.attention.wq.weight`.
    pub path: String,
    /// Whether each tensor-parallel rank holds a different slice of it.
    pub tp_split: bool,
    /// The dim it is split along over the tensor-parallel group, if it is.
    pub split_dim: Option<usize>,
    /// Whether it holds experts, split along dim 0 over the expert-parallel group (its
    /// gradient is then averaged over the expert-data-parallel group, not dp × cp).
    pub expert: bool,
    /// Whether gradients train it: false for a parameter set apart with
    /// `set_require_grad(false)` (a router's selection bias), which optimizers leave as it is.
    pub trainable: bool,
}

/// Tracks the module path and the type of the innermost layer.
#[derive(Default)]
struct Path {
    names: Vec<String>,
    containers: Vec<String>,
}

impl Path {
    fn enter(&mut self, name: &str, container: &str) {
        self.names.push(name.to_string());
        self.containers.push(container.to_string());
    }

    fn exit(&mut self) {
        self.names.pop();
        self.containers.pop();
    }

    /// The info of the parameter just entered: Burn enters each field with its name and the
    /// type of the struct that owns it, so the last entry names both.
    fn info(&self, trainable: bool) -> ParamInfo {
        let owner = self.containers.last().map(String::as_str).unwrap_or("");
        let field = self.names.last().map(String::as_str).unwrap_or("");
        let split_dim = match (owner, field) {
            ("Struct:ColumnParallelLinear", "weight") => Some(1),
            ("Struct:ColumnParallelLinear", "bias") => Some(0),
            ("Struct:RowParallelLinear", "weight") => Some(0),
            ("Struct:VocabParallelEmbedding", "weight") => Some(0),
            ("Struct:Experts", "w1" | "w3") => Some(2),
            ("Struct:Experts", "w2") => Some(1),
            _ => None,
        };
        ParamInfo {
            path: self.names.join("."),
            tp_split: split_dim.is_some(),
            split_dim,
            expert: owner == "Struct:Experts",
            trainable,
        }
    }
}

/// Every float parameter's info, in traversal order.
pub fn param_infos<M: Module>(model: &M) -> Vec<ParamInfo> {
    struct Collect {
        path: Path,
        out: Vec<ParamInfo>,
    }
    impl ModuleVisitor for Collect {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.path.enter(name, container);
        }
        fn exit_module(&mut self, _name: &str, _container: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.out.push(self.path.info(trainable(&param.val())));
        }
    }
    let mut collect = Collect {
        path: Path::default(),
        out: Vec::new(),
    };
    model.visit(&mut collect);
    collect.out
}

/// Replaces every float parameter's value, in traversal order, with `next(index, value)`.
pub fn map_params<M: Module>(model: M, next: &mut dyn FnMut(usize, Tensor<1>, Vec<usize>) -> Tensor<1>) -> M {
    struct Map<'a> {
        index: usize,
        next: &'a mut dyn FnMut(usize, Tensor<1>, Vec<usize>) -> Tensor<1>,
    }
    impl ModuleMapper for Map<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let index = self.index;
            self.index += 1;
            let next = &mut self.next;
            param.map(|value| {
                let dims = value.dims();
                let was_trainable = trainable(&value);
                let flat = value.detach().reshape([dims.iter().product::<usize>()]);
                let value = next(index, flat, dims.to_vec()).reshape(dims).detach();
                // A new leaf, trainable again on an autodiff device if it was.
                if value.is_autodiff() && was_trainable {
                    value.require_grad()
                } else {
                    value
                }
            })
        }
    }
    model.map(&mut Map { index: 0, next })
}

/// One parameter's value, flattened and detached, with its shape.
#[derive(Clone, Debug)]
pub struct ParamValue {
    pub dims: Vec<usize>,
    /// `[n]`, in the parameter's dtype, on its device.
    pub value: Tensor<1>,
}

/// Every float parameter's value, in traversal order.
pub fn param_values<M: Module>(model: &M) -> Vec<ParamValue> {
    struct Collect(Vec<ParamValue>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val().detach();
            let dims = value.dims().to_vec();
            self.0.push(ParamValue {
                value: value.reshape([dims.iter().product::<usize>()]),
                dims,
            });
        }
    }
    let mut collect = Collect(Vec::new());
    model.visit(&mut collect);
    collect.0
}

/// Every float parameter's gradient from an autodiff backward pass, flattened, in traversal
/// order (`None` for a parameter the loss did not reach).
pub fn param_grads<M: Module>(model: &M, grads: &Gradients) -> Vec<Option<Tensor<1>>> {
    struct Collect<'a>(&'a Gradients, Vec<Option<Tensor<1>>>);
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.1.push(param.val().grad(self.0).map(flatten));
        }
    }
    let mut collect = Collect(grads, Vec::new());
    model.visit(&mut collect);
    collect.1
}

/// Every float parameter's gradient taken out of `grads`, flattened, in traversal order
/// (`None` for a parameter without one).
pub fn take_grads<M: Module>(model: &M, grads: GradientsParams) -> Vec<Option<Tensor<1>>> {
    struct Take(GradientsParams, Vec<Option<Tensor<1>>>);
    impl ModuleVisitor for Take {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let grad = self.0.remove::<D>(param.id).map(flatten);
            self.1.push(grad);
        }
    }
    let mut take = Take(grads, Vec::new());
    model.visit(&mut take);
    take.1
}

/// Flat gradients, one a parameter in traversal order, back in the parameters' shapes and
/// dtypes, as Burn's optimizers take them. A parameter gradients do not train gets none, so
/// Burn's optimizers leave it as it is (weight decay included).
pub fn grads_params<M: Module>(model: &M, flat: Vec<Tensor<1>>) -> GradientsParams {
    struct Put(std::vec::IntoIter<Tensor<1>>, GradientsParams);
    impl ModuleVisitor for Put {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            let grad = self.0.next().expect("a gradient a parameter");
            if trainable(&value) {
                self.1
                    .register::<D>(param.id, grad.reshape(value.shape()).cast(value.dtype()));
            }
        }
    }
    let mut put = Put(flat.into_iter(), GradientsParams::new());
    model.visit(&mut put);
    put.1
}

/// Whether gradients train a parameter of value `value`: on an autodiff device, whether it
/// requires them; elsewhere every parameter counts (nothing tells them apart there).
fn trainable<const D: usize>(value: &Tensor<D>) -> bool {
    !value.is_autodiff() || value.is_require_grad()
}

fn flatten<const D: usize>(t: Tensor<D>) -> Tensor<1> {
    let n = t.shape().num_elements();
    t.reshape([n])
}

#[cfg(test)]
mod tests {
    use burn::tensor::Device;
    use burn_megatron_dist::ProcessGroups;

    use super::*;
    use crate::init::{InitMode, ParamInit};
    use crate::models::llama::recipes;

    /// A router's selection bias is not trained by gradients: the walk says so, Burn's
    /// optimizers get no gradient for it, and new values keep it out of autodiff; the experts
    /// are marked, with their tp split dims.
    #[test]
    fn the_walk_tells_what_trains_and_what_holds_experts() {
        let mut config = recipes::tiny_moe().model;
        let moe = config.moe.as_mut().unwrap();
        moe.layer.router = moe.layer.router.clone().with_expert_bias(true);
        let device = Device::flex().autodiff();
        let model = config
            .init(&device, &ProcessGroups::single(), &ParamInit::new(0, InitMode::Full))
            .unwrap();
        let infos = param_infos(&model);
        let info = |path: &str| infos.iter().find(|i| i.path == path).unwrap().clone();
        assert!(!info("layers.0.moe.router.bias").trainable);
        assert!(info("layers.0.moe.router.weight").trainable);
        let w1 = info("layers.0.moe.experts.w1");
        assert!(w1.expert && w1.trainable && w1.split_dim == Some(2));
        assert_eq!(info("layers.0.moe.experts.w2").split_dim, Some(1));
        assert!(!info("layers.0.moe.router.weight").expert);

        let flat: Vec<Tensor<1>> = param_values(&model).into_iter().map(|p| p.value.zeros_like()).collect();
        let grads = grads_params(&model, flat);
        let bias = model.layers[0].moe.as_ref().unwrap().router.bias.as_ref().unwrap();
        assert!(grads.get::<1>(bias.id).is_none(), "no gradient for the bias");

        let model = map_params(model, &mut |_, value, _| value);
        let infos_after = param_infos(&model);
        assert_eq!(infos, infos_after, "new values keep each parameter's kind");
    }
}
