//! The routed experts: `e` SwiGLU MLPs, each run on the rows dispatched to it, all of them in one
//! grouped product a projection (`burn_megatron_kernels::grouped_gemm`: one launch on CUDA). An
//! expert that receives no token is skipped, and its weights' gradient is zero.
//!
//! A rank holds `e/ep` of them (expert parallelism: ep rank `r` holds experts `r·e/ep ..`), and
//! of each its `f/etp` hidden features (expert tensor parallelism, as the dense MLP splits them:
//! `w1`, `w3` by columns, `w2` by rows), so its outputs are partial sums over etp.
//!
//! Legend: `d` d_model, `f` an expert's hidden size, `e` experts.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor};
use burn_megatron_kernels::grouped_gemm::{Groups, grouped_matmul};
use burn_megatron_kernels::swiglu::swiglu;

use crate::init::{ParamInit, Shard};

#[derive(Config, Debug)]
pub struct ExpertsConfig {
    pub d_model: usize,
    pub d_ff: usize,
    pub n_experts: usize,
    #[config(default = 0.02)]
    pub init_std: f64,
}

/// The experts' weights, stacked.
#[derive(Module, Debug)]
pub struct Experts {
    /// Gate projections, `[e, d, f]`.
    pub w1: Param<Tensor<3>>,
    /// Down projections, `[e, f, d]`.
    pub w2: Param<Tensor<3>>,
    /// Up projections, `[e, d, f]`.
    pub w3: Param<Tensor<3>>,
}

impl ExpertsConfig {
    /// All `e` experts, whole.
    pub fn init(&self, device: &Device, init: &ParamInit, name: &str) -> Experts {
        self.init_part(device, init, name, (0, 1), (0, 1))
    }

    /// Part `ep.0` of `ep.1` of the experts and, of each, part `etp.0` of `etp.1` of its hidden
    /// features, cut from the same whole weights at every layout (`InitMode::Full`). The
    /// counts must divide (the plan checks them).
    pub fn init_part(
        &self,
        device: &Device,
        init: &ParamInit,
        name: &str,
        ep: (usize, usize),
        etp: (usize, usize),
    ) -> Experts {
        let (d, f, e) = (self.d_model, self.d_ff, self.n_experts);
        let param = |w: &str, shape: [usize; 3], hidden: usize| {
            let shards = [Shard::new(0, ep.0, ep.1), Shard::new(hidden, etp.0, etp.1)];
            Param::from_tensor(init.normal_in(&format!("{name}.{w}"), shape, &shards, self.init_std, device))
        };
        Experts {
            w1: param("w1", [e, d, f], 2),
            w2: param("w2", [e, f, d], 1),
            w3: param("w3", [e, d, f], 2),
        }
    }
}

impl Experts {
    /// Expert `i`'s SwiGLU on its group's rows of `x` (rows of no group come out zero), every
    /// expert in one grouped product a projection ([`grouped_matmul`]); with `pad_to`, each
    /// expert's rows (counted on the host) padded with zeros to that many first (fixed shapes;
    /// a zero row's output is zero and is cut off again).
    ///
    /// # Shapes
    /// `x`: `[r, d]` → `[r, d]`
    pub fn forward(&self, x: Tensor<2>, groups: &Groups, pad_to: Option<usize>) -> Tensor<2> {
        if let Groups::Counts(counts) = groups
            && counts.iter().all(|&n| n == 0)
        {
            return x; // no rows at all
        }
        let (rows, run, counts) = match pad_to {
            Some(p) => {
                let counts = groups.counts();
                let run = Groups::Counts(counts.iter().map(|&n| n.max(p)).collect());
                (pad(x, &counts, p), run, counts)
            }
            None => (x, groups.clone(), Vec::new()),
        };
        let gate = grouped_matmul(rows.clone(), self.w1.val(), &run);
        let up = grouped_matmul(rows, self.w3.val(), &run);
        let y = grouped_matmul(swiglu(gate, up), self.w2.val(), &run);
        match run {
            Groups::Counts(padded) if pad_to.is_some() => unpad(y, &counts, &padded),
            _ => y,
        }
    }
}

/// Each group's rows of `x` followed by zero rows up to `p`.
fn pad(x: Tensor<2>, counts: &[usize], p: usize) -> Tensor<2> {
    let [_, d] = x.dims();
    let mut start = 0;
    let mut parts = Vec::new();
    for &n in counts {
        if n > 0 {
            parts.push(x.clone().narrow(0, start, n));
        }
        if p > n {
            parts.push(Tensor::zeros([p - n, d], (&x.device(), x.dtype())));
        }
        start += n;
    }
    Tensor::cat(parts, 0)
}

/// The rows of `y` (groups of `padded` rows) that [`pad`] took from `counts`.
fn unpad(y: Tensor<2>, counts: &[usize], padded: &[usize]) -> Tensor<2> {
    let mut start = 0;
    let mut parts = Vec::new();
    for (&n, &p) in counts.iter().zip(padded) {
        if n > 0 {
            parts.push(y.clone().narrow(0, start, n));
        }
        start += p;
    }
    Tensor::cat(parts, 0)
}
