//! The MoE layer: route, dispatch, run the experts, combine with the routing weights, plus an
//! optional shared expert every token passes through (DeepSeek/Qwen).
//!
//! Over the expert-parallel group each rank holds `e/ep` experts and the copies travel to them
//! and back ([`exchange`](super::exchange), all-to-all or all-gather). Over the tensor-parallel
//! group every rank routes the whole tokens (the same choices, bit for bit), and each expert's
//! hidden features are split over the expert-tensor-parallel group (etp):
//!
//! - etp = tp (Megatron's default), as the dense MLP splits its own: the experts run on the
//!   whole tokens, their outputs are partial sums, and the layer's output is reduced over tp
//!   (reduce-scattered along the sequence under SP).
//! - etp < tp (under SP): each etp group takes its own part of the sequence (the etp ranks'
//!   shards gathered) and dispatches it over ep, which folds over the other tp ranks too; the
//!   output is reduce-scattered over etp only. With etp = 1 each tp rank sends its own shard's
//!   copies and keeps its experts whole.
//!
//! The routing weights enter that region through `copy_to_tp`, since their gradient is a
//! partial sum on each tp rank: over etp's hidden features, and over the parts of the sequence.
//!
//! Legend: `b` batch, `s` sequence, `d` d_model.

use burn::config::Config;
use burn::module::Module;
use burn::tensor::kind::Numeric;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron_dist::mappings::{copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp, reduce_scatter_to_sp};
use burn_megatron_dist::{CommError, ProcessGroup, ProcessGroups, ReduceOp};

use super::capacity::{Capacity, dispatch_with_capacity};
use super::dispatch::{Dispatch, dispatch, dispatch_host, permute, read_experts, unpermute};
use super::exchange::ExpertParallel;
use super::exchange::{AllGather, AllToAll};
use super::experts::{Experts, ExpertsConfig};
use super::router::{Router, RouterConfig, Routing};
use crate::error::{ConfigError, LayerError, divisible};
use crate::init::ParamInit;
use crate::layers::{ParallelMlp, ParallelMlpConfig, SequenceLayout};
use burn_megatron_kernels::grouped_gemm::{Groups, row_alignment};

#[derive(Config, Debug)]
pub struct MoeConfig {
    pub router: RouterConfig,
    /// Each routed expert's hidden size.
    pub d_ff: usize,
    /// The shared expert's hidden size, if there is one.
    #[config(default = "None")]
    pub shared_d_ff: Option<usize>,
    /// Dropless (`None`) or a capacity each expert's copies are cut to.
    #[config(default = "None")]
    pub capacity: Option<Capacity>,
    /// The input's and output's layout along the sequence (set by the tensor plan).
    #[config(default = "SequenceLayout::Whole")]
    pub sequence: SequenceLayout,
    /// How copies reach the experts of other ep ranks (set by the expert plan).
    #[config(default = "ExpertParallel::AllToAll")]
    pub dispatcher: ExpertParallel,
    /// Each expert's rows padded to a multiple of this with fillers that add nothing; `None`:
    /// the grouped product's tile on the device at hand (128 rows for bf16 on CUDA, 1 elsewhere).
    #[config(default = "None")]
    pub rows_multiple: Option<usize>,
}

#[derive(Module, Debug)]
pub struct Moe {
    pub router: Router,
    /// This rank's `e/ep` experts, each its `f/tp` hidden features.
    pub experts: Experts,
    pub shared: Option<ParallelMlp>,
    #[module(skip)]
    pub capacity: Option<Capacity>,
    #[module(skip)]
    pub n_experts: usize,
    #[module(skip)]
    pub sequence: SequenceLayout,
    #[module(skip)]
    pub dispatcher: ExpertParallel,
    #[module(skip)]
    pub rows_multiple: Option<usize>,
    #[module(skip)]
    pub tp: ProcessGroup,
    /// The tp ranks that split each expert's hidden features (`tp` itself by default).
    #[module(skip)]
    pub etp: ProcessGroup,
    #[module(skip)]
    pub ep: ProcessGroup,
}

/// The copies each expert ran on in one call, and those dropped for capacity.
#[derive(Clone, Debug)]
pub struct Load {
    /// `[e]`: the copies of this rank's tokens (whole over tp) a (global) expert took, on the
    /// device (a dropless dispatch decided there reads nothing to the host).
    pub per_expert: Tensor<1, Int>,
    /// The copies dropped for capacity (which decides on the host).
    pub dropped: usize,
}

impl Load {
    /// The loads of two calls added.
    pub fn add(&self, other: &Load) -> Load {
        Load {
            per_expert: self.per_expert.clone() + other.per_expert.clone(),
            dropped: self.dropped + other.dropped,
        }
    }

    /// Each expert's copies, read to the host (one copy, which waits for the work before it).
    pub fn read(&self) -> Vec<usize> {
        let counts: Vec<i64> = self.per_expert.to_data().convert::<i64>().try_to_vec().expect("counts");
        counts.into_iter().map(|c| c as usize).collect()
    }
}

impl MoeConfig {
    /// Checks that the layer splits over `tp`, its experts over `etp` and `ep` ranks.
    pub fn check(&self, tp: usize, etp: usize, ep: usize) -> Result<(), ConfigError> {
        self.router.check()?;
        if let Some(capacity) = &self.capacity {
            capacity.check()?;
        }
        if etp < tp && self.sequence != SequenceLayout::Sharded {
            return Err(ConfigError::ExpertTpNeedsSequenceParallel { etp, tp });
        }
        divisible("d_ff", self.d_ff, etp)?;
        if let Some(f) = self.shared_d_ff {
            divisible("shared_d_ff", f, tp)?;
        }
        match self.router.n_experts.is_multiple_of(ep) {
            true => Ok(()),
            false => Err(ConfigError::ExpertsNotDivisible {
                experts: self.router.n_experts,
                ep,
            }),
        }
    }

    /// This rank's experts over `groups.ep` and hidden features over `groups.etp`, cut from the
    /// same whole layer at every layout (`InitMode::Full`).
    pub fn init(
        &self,
        device: &Device,
        groups: &ProcessGroups,
        init: &ParamInit,
        name: &str,
    ) -> Result<Moe, LayerError> {
        let (tp, etp, ep) = (&groups.tp, &groups.etp, &groups.ep);
        self.check(tp.size(), etp.size(), ep.size())?;
        let (d, e) = (self.router.d_model, self.router.n_experts);
        let router = self.router.init(device, init, &format!("{name}.router"))?;
        let experts = ExpertsConfig::new(d, self.d_ff, e).init_part(
            device,
            init,
            &format!("{name}.experts"),
            (ep.group_rank(), ep.size()),
            (etp.group_rank(), etp.size()),
        );
        let shared = match self.shared_d_ff {
            Some(f) => Some(ParallelMlpConfig::new(d, f).with_sequence(self.sequence).init(
                device,
                groups,
                init,
                &format!("{name}.shared"),
            )?),
            None => None,
        };
        Ok(Moe {
            router,
            experts,
            shared,
            capacity: self.capacity,
            n_experts: e,
            sequence: self.sequence,
            dispatcher: self.dispatcher,
            rows_multiple: self.rows_multiple,
            tp: tp.clone(),
            etp: etp.clone(),
            ep: ep.clone(),
        })
    }
}

impl Moe {
    /// Moves the router's bias, where it has one, by its rate toward balance from `load`
    /// summed over `grad_sync` (every rank holding a replica of this layer's router: the data-
    /// and context-parallel ranks), DeepSeek-V3's auxiliary-loss-free balancing. Every rank of
    /// the group calls it after the optimizer step.
    pub fn update_expert_bias(&mut self, load: &Load, grad_sync: &ProcessGroup) -> Result<(), CommError> {
        if self.router.bias.is_none() {
            return Ok(());
        }
        let total = grad_sync.all_reduce(load.per_expert.clone(), ReduceOp::Sum)?;
        let rate = self.router.settings.bias_update_rate;
        self.router = self.router.clone().update_bias(total, rate);
        Ok(())
    }

    /// The layer's output, its routing (the router's losses among it) and the experts' load.
    ///
    /// # Shapes
    /// `x`: `[b, s, d]` → `[b, s, d]`; `[b, s/tp, d]` → `[b, s/tp, d]` under SP.
    pub fn forward(&self, x: Tensor<3>) -> Result<(Tensor<3>, Routing, Load), LayerError> {
        let (tp, etp, sharded) = (&self.tp, &self.etp, self.sequence == SequenceLayout::Sharded);
        // The router sees whole tokens with their whole gradient; the experts, their etp group's
        // tokens (whole ones at etp = tp) whose gradient is a partial sum over etp.
        let (to_router, to_experts) = match (tp.size() > 1, sharded) {
            (false, _) => (x.clone(), x.clone()),
            (true, true) => (gather_from_tp(x.clone(), tp, 1)?, gather_from_sp(x.clone(), etp, 1)?),
            (true, false) => (x.clone(), copy_to_tp(x.clone(), tp)?),
        };
        let [b, s, d] = to_router.dims();
        let routing = self.router.forward(to_router.reshape([b * s, d]), b)?;
        // This etp group's part of the sequence: all of it at etp = tp (of any length: one
        // decoding step's token at tp 2 too).
        let part = s * etp.size() / tp.size();
        let first = tp.group_rank() / etp.size() * part;
        let experts = sequence_part(routing.experts.clone(), b, first..first + part);
        let weights = sequence_part(copy_to_tp(routing.weights.clone(), tp)?, b, first..first + part);
        let tokens = to_experts.reshape([b * part, d]);
        let (plan, dropped, pad_to) = self.plan(experts, &weights, &tokens);
        let load = self.whole_load(Load {
            per_expert: plan.copies.clone(),
            dropped,
        })?;
        let y = self.routed(tokens, weights, &plan, pad_to)?.reshape([b, part, d]);
        let y = match (tp.size() > 1, sharded) {
            (false, _) => y,
            (true, true) => reduce_scatter_to_sp(y, etp, 1)?,
            (true, false) => reduce_from_tp(y, tp)?,
        };
        let y = match &self.shared {
            Some(mlp) => y + mlp.forward(x)?,
            None => y,
        };
        Ok((y, routing, load))
    }

    /// This etp group's copies' `load` summed with the other groups' of the tp group: the load of
    /// the tokens the rank routed. As it is at etp = tp.
    fn whole_load(&self, load: Load) -> Result<Load, LayerError> {
        let (tp, etp) = (self.tp.size(), self.etp.size());
        if etp == tp {
            return Ok(load);
        }
        // Each etp rank of a group counted the same copies.
        let per_expert = self
            .tp
            .all_reduce(load.per_expert, ReduceOp::Sum)?
            .div_scalar(etp as i64);
        let dropped = match self.capacity {
            // Only a capacity drops; its counts were read on the host already.
            Some(_) => {
                let device = per_expert.device();
                let local = Tensor::<1, Int>::from_data(TensorData::new(vec![load.dropped as i64], [1]), &device);
                let summed = self.tp.all_reduce(local, ReduceOp::Sum)?.into_scalar::<i64>();
                summed as usize / etp
            }
            None => 0,
        };
        Ok(Load { per_expert, dropped })
    }

    fn plan(
        &self,
        experts: Tensor<2, Int>,
        weights: &Tensor<2>,
        tokens: &Tensor<2>,
    ) -> (Dispatch, usize, Option<usize>) {
        let e = self.n_experts;
        let [t, k] = experts.dims();
        let pad_to = self
            .capacity
            .filter(|c| c.pad)
            .map(|c| self.ep.size() * c.per_expert(t, k, e));
        let align = match self.ep.size() {
            1 => self.alignment(tokens, pad_to),
            _ => 1,
        };
        let gathers = self.ep.size() > 1 && self.dispatcher == ExpertParallel::AllGather;
        match &self.capacity {
            // The all-gather dispatcher sends each copy's expert to the other ep ranks.
            None if gathers => {
                let device = experts.device();
                (dispatch_host(read_experts(experts), k, 0..e, align, &device), 0, pad_to)
            }
            None => (dispatch(experts, e, align), 0, pad_to),
            Some(capacity) => {
                let (plan, dropped) = dispatch_with_capacity(experts, weights, e, capacity, align);
                (plan, dropped, pad_to)
            }
        }
    }

    /// The multiple each expert's rows are padded to: none when capacity pads them, else the
    /// configured one or the grouped product's tile on this device.
    fn alignment(&self, tokens: &Tensor<2>, pad_to: Option<usize>) -> usize {
        match (pad_to, self.rows_multiple) {
            (Some(_), _) => 1,
            (None, Some(multiple)) => multiple,
            (None, None) => row_alignment(tokens),
        }
    }

    /// The routed experts' weighted outputs for this rank's `tokens` (`[t, d]`), partial sums
    /// over tp.
    fn routed(
        &self,
        tokens: Tensor<2>,
        weights: Tensor<2>,
        plan: &Dispatch,
        pad_to: Option<usize>,
    ) -> Result<Tensor<2>, LayerError> {
        let ep = &self.ep;
        if ep.size() == 1 {
            let routed = self.experts.forward(permute(tokens, plan), &plan.groups, pad_to);
            return Ok(unpermute(routed, weights, plan));
        }
        let align = self.alignment(&tokens, pad_to);
        Ok(match self.dispatcher {
            ExpertParallel::AllToAll => {
                // The exchange sizes its messages by the counts: read here.
                let counts = plan.groups.counts();
                let (rows, counts, route) = AllToAll::dispatch(permute(tokens, plan), &counts, ep, align)?;
                let out = self.experts.forward(rows, &Groups::Counts(counts), pad_to);
                unpermute(AllToAll::combine(out, &route, ep)?, weights, plan)
            }
            ExpertParallel::AllGather => {
                let kept = plan
                    .kept
                    .as_deref()
                    .expect("`plan` decides on the host for the all-gather dispatcher");
                let gathered = AllGather::dispatch(tokens, weights, kept, self.n_experts, ep, align)?;
                let groups = Groups::Counts(gathered.counts.clone());
                let out = self.experts.forward(gathered.rows.clone(), &groups, pad_to);
                AllGather::combine(out, gathered, ep)?
            }
        })
    }
}

/// The rows of positions `range` of each of `b` sequences, from `[b·s, k]` rows in sequence
/// order: `[b·|range|, k]`, `t` itself for the whole sequence.
fn sequence_part<K: Numeric>(t: Tensor<2, K>, b: usize, range: std::ops::Range<usize>) -> Tensor<2, K> {
    let [n, k] = t.dims();
    let s = n / b;
    match range.len() == s {
        true => t,
        false => t
            .reshape([b, s, k])
            .narrow(1, range.start, range.len())
            .reshape([b * range.len(), k]),
    }
}

#[cfg(test)]
mod tests {
    use burn::module::Param;
    use burn::tensor::activation::silu;
    use burn::tensor::{Distribution, IndexingUpdateOp, Tolerance};

    use super::*;
    use crate::init::InitMode;
    use crate::layers::moe::Scoring;

    /// The dense twin: every expert on every token, each output times the token's weight for
    /// that expert (zero where it was not chosen), summed; the shared expert added.
    fn dense(moe: &Moe, x: Tensor<3>) -> Tensor<3> {
        dense_keeping(moe, x, None)
    }

    /// [`dense`] with only the copies `keep` (`[t, k]`, 1 or 0) weighted.
    fn dense_keeping(moe: &Moe, x: Tensor<3>, keep: Option<Tensor<2>>) -> Tensor<3> {
        let [b, s, d] = x.dims();
        let tokens = x.clone().reshape([b * s, d]);
        let routing = moe.router.forward(tokens.clone(), b).unwrap();
        let [e, _, f] = moe.experts.w1.dims();
        let weights = match keep {
            Some(keep) => routing.weights * keep,
            None => routing.weights,
        };
        let gates =
            Tensor::<2>::zeros([b * s, e], &x.device()).scatter(1, routing.experts, weights, IndexingUpdateOp::Add);
        let w = |p: &Param<Tensor<3>>, i: usize, shape: [usize; 2]| p.val().narrow(0, i, 1).reshape(shape);
        let mut y = Tensor::<2>::zeros([b * s, d], &x.device());
        for i in 0..e {
            let h = silu(tokens.clone().matmul(w(&moe.experts.w1, i, [d, f])))
                * tokens.clone().matmul(w(&moe.experts.w3, i, [d, f]));
            y = y + h.matmul(w(&moe.experts.w2, i, [f, d])) * gates.clone().narrow(1, i, 1);
        }
        let y = y.reshape([b, s, d]);
        match &moe.shared {
            Some(mlp) => y + mlp.forward(x).unwrap(),
            None => y,
        }
    }

    /// The layer against its dense twin, output and every gradient (input, router, experts,
    /// shared expert): the same f32 products summed in another order, within 1e-5. Softmax top 2
    /// with a shared expert; sigmoid with a bias that keeps expert 3 from every token, whose
    /// weights then get a zero gradient.
    #[test]
    fn matches_the_dense_twin() {
        let device = Device::flex().autodiff();
        let cases = [
            (RouterConfig::new(8, 4, 2).with_normalize(true), Some(12), None),
            (
                RouterConfig::new(8, 4, 2)
                    .with_scoring(Scoring::Sigmoid)
                    .with_expert_bias(true),
                None,
                Some(3),
            ),
        ];
        for (router, shared, starved) in cases {
            let config = MoeConfig::new(router, 16).with_shared_d_ff(shared);
            let mut moe = config
                .init(
                    &device,
                    &ProcessGroups::single(),
                    &ParamInit::new(5, InitMode::Full),
                    "moe",
                )
                .unwrap();
            if let Some(i) = starved {
                let mut bias = vec![0.0f32; 4];
                bias[i] = -100.0;
                moe.router.bias = Some(Param::from_tensor(Tensor::from_floats(bias.as_slice(), &device)));
            }
            let x = Tensor::<3>::random([2, 5, 8], Distribution::Normal(0.0, 1.0), &device).require_grad();
            let (ours, routing, _) = moe.forward(x.clone()).unwrap();
            let theirs = dense(&moe, x.clone());
            let tolerance = Tolerance::absolute(1e-5);
            ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
            let dy = Tensor::<3>::random([2, 5, 8], Distribution::Normal(0.0, 1.0), &device);
            let (g1, g2) = ((ours * dy.clone()).sum().backward(), (theirs * dy).sum().backward());
            let same =
                |a: burn::tensor::TensorData, b: burn::tensor::TensorData| a.assert_approx_eq::<f32>(&b, tolerance);
            same(x.grad(&g1).unwrap().into_data(), x.grad(&g2).unwrap().into_data());
            same(
                moe.router.weight.grad(&g1).unwrap().into_data(),
                moe.router.weight.grad(&g2).unwrap().into_data(),
            );
            for p in [&moe.experts.w1, &moe.experts.w2, &moe.experts.w3] {
                same(p.grad(&g1).unwrap().into_data(), p.grad(&g2).unwrap().into_data());
            }
            if let Some(mlp) = &moe.shared {
                same(
                    mlp.w1.weight.grad(&g1).unwrap().into_data(),
                    mlp.w1.weight.grad(&g2).unwrap().into_data(),
                );
            }
            if let Some(i) = starved {
                let load: Vec<i64> = routing
                    .tokens_per_expert
                    .into_data()
                    .convert::<i64>()
                    .try_to_vec()
                    .unwrap();
                assert_eq!(load[i], 0, "expert {i} starved: {load:?}");
                let g = moe.experts.w1.grad(&g1).unwrap().narrow(0, i, 1);
                assert_eq!(g.abs().max().into_scalar::<f32>(), 0.0);
            }
        }
    }

    /// With a capacity, each expert keeps its highest-weighted copies (or its earliest), as a
    /// reference that decides by hand which copies survive; the dense twin weighting only those
    /// gives the same output and gradients, padding changes nothing, and the dropped copies are
    /// counted.
    #[test]
    fn capacity_drops_the_copies_the_reference_drops() {
        use crate::layers::moe::{Capacity, DropPolicy};
        let device = Device::flex().autodiff();
        let (t, k, e) = (16, 2, 4);
        let x = Tensor::<3>::random([2, 8, 8], Distribution::Normal(0.0, 1.0), &device).require_grad();
        for policy in [DropPolicy::Probs, DropPolicy::Position] {
            let mut outputs = Vec::new();
            for pad in [false, true] {
                let capacity = Capacity::new(0.5).with_policy(policy).with_pad(pad);
                let config = MoeConfig::new(RouterConfig::new(8, e, k), 16).with_capacity(Some(capacity));
                let moe = config
                    .init(
                        &device,
                        &ProcessGroups::single(),
                        &ParamInit::new(9, InitMode::Full),
                        "moe",
                    )
                    .unwrap();
                let (ours, routing, load) = moe.forward(x.clone()).unwrap();
                // The reference's choice: ⌈0.5 · 32 / 4⌉ = 4 copies an expert.
                let chosen: Vec<i64> = routing
                    .experts
                    .clone()
                    .into_data()
                    .convert::<i64>()
                    .try_to_vec()
                    .unwrap();
                let weight: Vec<f32> = routing.weights.clone().into_data().try_to_vec().unwrap();
                let mut keep = vec![0.0f32; t * k];
                for expert in 0..e as i64 {
                    let mut mine: Vec<usize> = (0..t * k).filter(|&c| chosen[c] == expert).collect();
                    if policy == DropPolicy::Probs {
                        mine.sort_by(|&a, &b| weight[b].partial_cmp(&weight[a]).unwrap().then(a.cmp(&b)));
                    }
                    mine.iter().take(4).for_each(|&c| keep[c] = 1.0);
                }
                let kept = keep.iter().filter(|&&v| v == 1.0).count();
                assert_eq!(load.dropped, t * k - kept, "{policy:?}");
                let per_expert = load.read();
                assert_eq!(per_expert.iter().sum::<usize>(), kept);
                assert!(load.dropped > 0 && per_expert.iter().all(|&n| n <= 4), "{load:?}");
                let keep = Tensor::<2>::from_data(burn::tensor::TensorData::new(keep, [t, k]), &device);
                let theirs = dense_keeping(&moe, x.clone(), Some(keep));
                let tolerance = Tolerance::absolute(1e-5);
                ours.to_data().assert_approx_eq::<f32>(&theirs.to_data(), tolerance);
                let (g1, g2) = (ours.clone().sum().backward(), theirs.sum().backward());
                x.grad(&g1)
                    .unwrap()
                    .into_data()
                    .assert_approx_eq::<f32>(&x.grad(&g2).unwrap().into_data(), tolerance);
                let (a, b) = (moe.experts.w2.grad(&g1).unwrap(), moe.experts.w2.grad(&g2).unwrap());
                a.into_data().assert_approx_eq::<f32>(&b.into_data(), tolerance);
                outputs.push(ours);
            }
            // Padding to the capacity: the same values.
            outputs[0]
                .to_data()
                .assert_approx_eq::<f32>(&outputs[1].to_data(), Tolerance::absolute(1e-6));
        }
        let bad = MoeConfig::new(RouterConfig::new(8, 4, 2), 16).with_capacity(Some(Capacity::new(0.0)));
        let error = bad
            .init(
                &device,
                &ProcessGroups::single(),
                &ParamInit::new(9, InitMode::Full),
                "moe",
            )
            .unwrap_err();
        assert_eq!(
            error,
            LayerError::Config(crate::error::ConfigError::CapacityFactor { factor: 0.0 })
        );
    }
}
