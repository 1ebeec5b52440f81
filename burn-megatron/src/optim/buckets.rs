//! Data-parallel gradient reduction in buckets: the gradients of several parameters are packed
//! into one buffer and reduced by one collective, and a bucket is reduced as soon as its last
//! gradient arrives — during the backward pass when gradients come from taps
//! ([`tap_grad`](burn_megatron_dist::mappings::tap_grad)). The collective is left in flight
//! ([`ProcessGroup::all_reduce_async`]): on NCCL it runs beside the rest of backward, and only
//! [`GradReducer::finish`] makes the device wait for it.
//!
//! Buckets are filled in reverse traversal order, the order backward produces gradients in
//! (Megatron and PyTorch DDP do the same). With ZeRO-1 a bucket is reduce-scattered so that
//! each rank receives, for every parameter of the bucket, its own shard of that parameter's
//! (padded) gradient: the layout [`DistributedAdamW`](super::DistributedAdamW) keeps its state
//! in.
//!
//! Each parameter is averaged over its own group ([`GradGroup`]): dp × cp, or for experts the
//! expert-data-parallel group; a bucket never mixes groups. A parameter gradients do not train
//! (delayed FP8's amax histories, a router's expert bias) is in no bucket: it would hold its
//! bucket back until [`GradReducer::finish`] and be reduced as zeros every step.
//!
//! Legend: `dp` the data-parallel group size, `n_p` parameter `p`'s element count, `k_p` its
//! shard `⌈n_p / dp⌉`.

use burn::module::Module;
use burn::tensor::{DType, Device, Tensor};
use burn_megatron_dist::{CommError, InFlight, ProcessGroup, ProcessGroups, ReduceOp};

use crate::params::{ParamInfo, param_infos};

/// How gradients are bucketed and reduced.
#[derive(burn::config::Config, Debug, PartialEq)]
pub struct BucketConfig {
    /// A bucket closes once it holds at least this many bytes of gradients (Megatron's
    /// default bucket is 40M parameters; 25 MiB is PyTorch DDP's).
    #[config(default = 25_165_824)]
    pub bytes: usize,
    /// Reduce bf16/f16 gradients in fp32 (twice the bytes on the wire, no rounding in the sum).
    #[config(default = false)]
    pub reduce_in_fp32: bool,
}

/// What a reduction produces for each parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// The whole gradient, averaged over its group.
    AllReduce,
    /// This rank's shard (`k_p` elements) of the padded gradient, averaged over its group
    /// (ZeRO-1).
    ReduceScatter,
}

/// The ranks a parameter's gradient is averaged over, and a factor applied to the average.
///
/// Most parameters: dp × cp, which hold different tokens, factor 1. An expert's gradient
/// already sums what every rank of its ep group routed to it (the all-to-all's backward), so
/// the mean over dp × cp is its average over the expert-data-parallel group (the ranks holding
/// the same experts) divided by ep.
#[derive(Clone, Debug)]
pub struct GradGroup {
    pub group: ProcessGroup,
    pub scale: f64,
}

impl GradGroup {
    /// The group of the parameter `info` describes.
    pub fn of(info: &ParamInfo, groups: &ProcessGroups) -> Self {
        match info.expert {
            // An expert's gradient sums the copies of its ep group's ranks; over ep-dp that makes
            // every stage rank of its etp rank, `tp/etp · dp · cp` of them, where the loss is
            // the mean over dp · cp.
            true => Self {
                group: groups.ep_dp.clone(),
                scale: (groups.tp.size() / groups.etp.size()) as f64 / groups.ep.size() as f64,
            },
            false => Self {
                group: groups.grad_sync().clone(),
                scale: 1.0,
            },
        }
    }

    /// Every parameter's group, in traversal order; none for a parameter gradients do not train
    /// ([`ParamInfo::trainable`]).
    pub fn for_model<M: Module>(model: &M, groups: &ProcessGroups) -> Vec<Option<Self>> {
        param_infos(model)
            .iter()
            .map(|info| info.trainable.then(|| Self::of(info, groups)))
            .collect()
    }

    fn same(&self, other: &Self) -> bool {
        self.group.members() == other.group.members() && self.scale == other.scale
    }
}

/// Parameters reduced by one collective over one group.
struct Bucket {
    /// Parameter indices, in the order backward fills them.
    members: Vec<usize>,
    grad: GradGroup,
}

/// Collects one step's gradients and reduces them bucket by bucket.
pub struct GradReducer {
    reduction: Reduction,
    reduce_in_fp32: bool,
    /// Element count of each parameter, in traversal order.
    numels: Vec<usize>,
    buckets: Vec<Bucket>,
    /// Each parameter's bucket; none for a parameter gradients do not train.
    bucket_of: Vec<Option<usize>>,
    waiting: Vec<usize>,
    grads: Vec<Option<Tensor<1>>>,
    /// Earlier microbatches' gradients of this step ([`hold`](Self::hold)), joined with each
    /// parameter's gradient when it arrives.
    held: Vec<Option<Tensor<1>>>,
    /// Each bucket's reduction once launched, unpacked at [`finish`](Self::finish).
    launched: Vec<Option<Launched>>,
}

/// A bucket's reduction, from its launch until [`GradReducer::finish`] unpacks it: on NCCL the
/// collective runs alongside the rest of backward until then.
enum Launched {
    /// One rank: the gradients themselves.
    Alone(Vec<Tensor<1>>),
    /// The packed collective, and each member's element count in its result.
    Packed(Box<InFlight<2>>, Vec<usize>),
}

impl Launched {
    /// Each member's result, in bucket order.
    fn unpack(self) -> Result<Vec<Tensor<1>>, CommError> {
        Ok(match self {
            Launched::Alone(grads) => grads,
            Launched::Packed(flight, sizes) => {
                let total: usize = sizes.iter().sum();
                flight.wait()?.reshape([total]).split_with_sizes(sizes, 0)
            }
        })
    }
}

impl GradReducer {
    /// A reducer for parameters of `(element count, group)` each, in traversal order, whose
    /// gradients are `dtype_bytes` wide: a bucket holds parameters of one group. A parameter
    /// without a group (gradients do not train it) is in no bucket.
    pub fn new(
        params: Vec<(usize, Option<GradGroup>)>,
        dtype_bytes: usize,
        reduction: Reduction,
        config: &BucketConfig,
    ) -> Self {
        let width = if config.reduce_in_fp32 { 4 } else { dtype_bytes };
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut filled = 0;
        for index in (0..params.len()).rev() {
            let (numel, Some(grad)) = &params[index] else {
                continue;
            };
            let open = buckets
                .last()
                .is_some_and(|b| filled < config.bytes.max(1) && b.grad.same(grad));
            if !open {
                buckets.push(Bucket {
                    members: Vec::new(),
                    grad: grad.clone(),
                });
                filled = 0;
            }
            buckets.last_mut().expect("one bucket at least").members.push(index);
            filled += numel * width;
        }
        let mut bucket_of = vec![None; params.len()];
        for (b, bucket) in buckets.iter().enumerate() {
            for &p in &bucket.members {
                bucket_of[p] = Some(b);
            }
        }
        let waiting = buckets.iter().map(|b| b.members.len()).collect();
        let n = params.len();
        let launched = buckets.iter().map(|_| None).collect();
        Self {
            reduction,
            reduce_in_fp32: config.reduce_in_fp32,
            numels: params.into_iter().map(|(n, _)| n).collect(),
            buckets,
            bucket_of,
            waiting,
            grads: vec![None; n],
            held: vec![None; n],
            launched,
        }
    }

    /// How many buckets the parameters fall into.
    pub fn bucket_count(&self) -> usize {
        self.buckets.len()
    }

    /// Takes parameter `index`'s flattened gradient; reduces its bucket if it was the last one
    /// missing. A second gradient for the same parameter in one step is added to the first. A
    /// parameter gradients do not train ignores it.
    pub fn add(&mut self, index: usize, grad: Tensor<1>) -> Result<(), CommError> {
        let Some(bucket) = self.bucket_of[index] else {
            return Ok(());
        };
        if self.launched[bucket].is_some() {
            panic!("parameter {index} received a gradient after its bucket was reduced");
        }
        self.grads[index] = Some(match self.grads[index].take() {
            Some(earlier) => earlier + grad,
            None => {
                self.waiting[bucket] -= 1;
                match self.held[index].take() {
                    Some(held) => held + grad,
                    None => grad,
                }
            }
        });
        if self.waiting[bucket] == 0 {
            self.reduce(bucket)
        } else {
            Ok(())
        }
    }

    /// Holds parameter `index`'s gradient of an earlier microbatch of this step (gradient
    /// accumulation), summed with any held before: it joins the parameter's gradient when
    /// [`add`](Self::add) brings it, so buckets are reduced once a step, during the last
    /// microbatch's backward. A parameter gradients do not train ignores it.
    pub fn hold(&mut self, index: usize, grad: Tensor<1>) {
        if self.bucket_of[index].is_none() {
            return;
        }
        self.held[index] = Some(match self.held[index].take() {
            Some(earlier) => earlier + grad,
            None => grad,
        });
    }

    /// Reduces every bucket still open (a parameter without a gradient counts as its held
    /// gradient, or zeros) and returns each parameter's result in traversal order, in the dtype it was reduced in (the
    /// gradients', or f32 with `reduce_in_fp32`); resets for the next step. A parameter
    /// gradients do not train gets zeros of its whole length (under ZeRO-1 too: nothing steps
    /// it), views of one buffer.
    pub fn finish(&mut self, device: &Device, dtype: DType) -> Result<Vec<Tensor<1>>, CommError> {
        for bucket in 0..self.buckets.len() {
            if self.launched[bucket].is_none() {
                for &p in &self.buckets[bucket].members {
                    if self.grads[p].is_none() {
                        let held = self.held[p].take();
                        self.grads[p] = Some(held.unwrap_or_else(|| Tensor::zeros([self.numels[p]], (device, dtype))));
                    }
                }
                self.reduce(bucket)?;
            }
        }
        self.waiting = self.buckets.iter().map(|b| b.members.len()).collect();
        let mut reduced: Vec<Option<Tensor<1>>> = vec![None; self.numels.len()];
        for (bucket, launched) in self.buckets.iter().zip(&mut self.launched) {
            let results = launched.take().expect("every bucket was launched").unpack()?;
            for (&p, result) in bucket.members.iter().zip(results) {
                reduced[p] = Some(result);
            }
        }
        let untrained: Vec<usize> = (0..self.numels.len())
            .filter(|&p| self.bucket_of[p].is_none())
            .collect();
        if !untrained.is_empty() {
            let wire = match self.reduce_in_fp32 {
                true => DType::F32,
                false => dtype,
            };
            let lengths: Vec<usize> = untrained.iter().map(|&p| self.numels[p]).collect();
            let zeros = Tensor::<1>::zeros([lengths.iter().sum::<usize>()], (device, wire));
            let mut at = 0;
            for (&p, n) in untrained.iter().zip(lengths) {
                reduced[p] = Some(zeros.clone().narrow(0, at, n));
                at += n;
            }
        }
        Ok(reduced
            .into_iter()
            .map(|r| r.expect("every trained parameter is in a bucket"))
            .collect())
    }

    /// Launches bucket `bucket`'s reduction, leaving it in flight.
    fn reduce(&mut self, bucket: usize) -> Result<(), CommError> {
        let Bucket { members, grad } = &self.buckets[bucket];
        let grads: Vec<Tensor<1>> = members
            .iter()
            .map(|&p| self.grads[p].take().expect("a full bucket"))
            .collect();
        let wire = match self.reduce_in_fp32 {
            true => DType::F32,
            false => grads[0].dtype(),
        };
        let grads: Vec<Tensor<1>> = grads
            .into_iter()
            .map(|g| match grad.scale == 1.0 {
                true => g.cast(wire),
                false => g.cast(wire).mul_scalar(grad.scale),
            })
            .collect();
        let group = &grad.group;
        let launched = match self.reduction {
            // One rank: nothing to pack, every shard is the whole gradient.
            _ if group.size() == 1 => Launched::Alone(grads),
            Reduction::AllReduce => all_reduce(group, grads)?,
            Reduction::ReduceScatter => reduce_scatter(group, grads)?,
        };
        self.launched[bucket] = Some(launched);
        Ok(())
    }
}

/// `[1, Σ n_p]` packed, all-reduced.
fn all_reduce(group: &ProcessGroup, grads: Vec<Tensor<1>>) -> Result<Launched, CommError> {
    let sizes: Vec<usize> = grads.iter().map(|g| g.dims()[0]).collect();
    let packed = Tensor::cat(grads, 0).unsqueeze::<2>();
    Ok(Launched::Packed(
        Box::new(group.all_reduce_async(packed, ReduceOp::Avg)?),
        sizes,
    ))
}

/// `[g, Σ k_p]` (row `r` holds rank `r`'s shard of every parameter), reduce-scattered along
/// the rows into this rank's shards of `k_p`.
fn reduce_scatter(group: &ProcessGroup, grads: Vec<Tensor<1>>) -> Result<Launched, CommError> {
    let g = group.size();
    let parts: Vec<usize> = grads.iter().map(|x| x.dims()[0].div_ceil(g)).collect();
    let rows: Vec<Tensor<2>> = grads.into_iter().map(|x| pad(x, g).reshape([g as i32, -1])).collect();
    Ok(Launched::Packed(
        Box::new(group.reduce_scatter_async(Tensor::cat(rows, 1), 0, ReduceOp::Avg)?),
        parts,
    ))
}

/// `x` padded with zeros to a multiple of `parts`.
///
/// # Shapes
/// `[n]` → `[⌈n/parts⌉·parts]`
pub(crate) fn pad(x: Tensor<1>, parts: usize) -> Tensor<1> {
    let n = x.dims()[0];
    let padded = n.div_ceil(parts) * parts;
    match padded - n {
        0 => x,
        extra => Tensor::cat(vec![x.clone(), Tensor::zeros([extra], (&x.device(), x.dtype()))], 0),
    }
}

#[cfg(test)]
mod tests {
    use burn_megatron_dist::{ParallelDims, launch};

    use super::*;

    /// At dp 2, a bucket holding a parameter gradients do not train (between two that they
    /// do) is reduced as soon as its trained members' gradients arrive, not left for `finish`;
    /// both ways of reducing average the trained gradients over the ranks and hand the untrained
    /// one zeros of its length. Before, it held its bucket back until `finish`, where no
    /// reduction hides behind backward.
    #[test]
    fn an_untrained_parameter_holds_no_bucket_back() {
        for reduction in [Reduction::AllReduce, Reduction::ReduceScatter] {
            let results = launch(
                ParallelDims::tp_dp(1, 2),
                |_| Device::flex(),
                |ctx| {
                    let dp = ctx.groups.grad_sync().clone();
                    let group = || {
                        Some(GradGroup {
                            group: dp.clone(),
                            scale: 1.0,
                        })
                    };
                    let params = vec![(3, group()), (2, None), (4, group())];
                    let mut reducer = GradReducer::new(params, 4, reduction, &BucketConfig::new());
                    assert_eq!(reducer.bucket_count(), 1, "one bucket for the trained two");
                    let rank = ctx.groups.dp.group_rank() as f32;
                    let grad = |n: usize| Tensor::<1>::full([n], 1.0 + rank, (&ctx.device, DType::F32));
                    reducer.add(2, grad(4)).unwrap();
                    reducer.add(0, grad(3)).unwrap();
                    assert!(reducer.launched[0].is_some(), "launched before finish");
                    // A gradient for the untrained parameter is dropped, even after the bucket left.
                    reducer.add(1, grad(2)).unwrap();
                    let reduced = reducer.finish(&ctx.device, DType::F32).unwrap();
                    reduced
                        .into_iter()
                        .map(|t| t.into_data().try_to_vec::<f32>().unwrap())
                        .collect::<Vec<_>>()
                },
            )
            .unwrap();
            for (rank, reduced) in results.iter().enumerate() {
                // The mean of 1 and 2, exact in f32; under ZeRO-1 this rank's shard of the
                // padded gradient (⌈3/2⌉ = 2 and 4/2 = 2 values, the padding's zeros averaged in).
                let (first, last) = match reduction {
                    Reduction::AllReduce => (vec![1.5; 3], vec![1.5; 4]),
                    Reduction::ReduceScatter if rank == 0 => (vec![1.5; 2], vec![1.5; 2]),
                    Reduction::ReduceScatter => (vec![1.5, 0.0], vec![1.5; 2]),
                };
                assert_eq!(reduced, &vec![first, vec![0.0; 2], last], "{reduction:?} rank {rank}");
            }
        }
    }
}
