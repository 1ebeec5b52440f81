//! Walks a model's float parameters in a fixed order, knowing for each whether its value is
//! split over the tensor-parallel group or replicated on every rank of it.
//!
//! The split is read off the layer that owns the parameter: column-parallel weights and biases,
//! row-parallel weights and vocabulary-parallel embeddings are split; everything else (norms,
//! row-parallel biases, a user's plain layers) is replicated.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::Tensor;

/// One parameter as the walk sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamInfo {
    /// Its path in the model, such as `layers.0.attention.wq.weight`.
    pub path: String,
    /// Whether each tensor-parallel rank holds a different slice of it.
    pub tp_split: bool,
    /// The dim it is split along over the tensor-parallel group, if it is.
    pub split_dim: Option<usize>,
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
    fn info(&self) -> ParamInfo {
        let owner = self.containers.last().map(String::as_str).unwrap_or("");
        let field = self.names.last().map(String::as_str).unwrap_or("");
        let split_dim = match (owner, field) {
            ("Struct:ColumnParallelLinear", "weight") => Some(1),
            ("Struct:ColumnParallelLinear", "bias") => Some(0),
            ("Struct:RowParallelLinear", "weight") => Some(0),
            ("Struct:VocabParallelEmbedding", "weight") => Some(0),
            _ => None,
        };
        ParamInfo { path: self.names.join("."), tp_split: split_dim.is_some(), split_dim }
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
        fn visit_float<const D: usize>(&mut self, _param: &Param<Tensor<D>>) {
            self.out.push(self.path.info());
        }
    }
    let mut collect = Collect { path: Path::default(), out: Vec::new() };
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
                let flat = value.detach().reshape([dims.iter().product::<usize>()]);
                let value = next(index, flat, dims.to_vec()).reshape(dims).detach();
                // A new leaf, trainable again on an autodiff device.
                if value.is_autodiff() { value.require_grad() } else { value }
            })
        }
    }
    model.map(&mut Map { index: 0, next })
}
