//! The mapping suite: each differentiable collective against the same computation on one
//! device, outputs and input gradients.
//!
//! Every rank `r` of a group of `n` holds inputs and weights made from seeds that depend on `r`,
//! runs the mapping inside a small loss, and back-propagates. The twin computes the sum of the
//! ranks' losses on one device from everybody's full tensors; the rank's gradient must equal
//! the twin's gradient for that rank's input.

use burn::tensor::{Device, Tensor};
use burn_megatron_dist::mappings::{
    all_to_all, all_to_all_uneven, copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp, reduce_scatter_to_sp,
    scatter_to_sp,
};
use burn_megatron_dist::{CommError, RankContext};

use crate::Harness;
use crate::data::{assert_close, fixed};

/// What every check needs: the autodiff device, the group's size and this rank's index.
struct Ctx<'a> {
    h: &'a Harness,
    dev: Device,
    n: usize,
    r: usize,
}

impl Ctx<'_> {
    fn new<'a>(h: &'a Harness, ctx: &RankContext) -> Ctx<'a> {
        let g = &ctx.groups.tp;
        Ctx {
            h,
            dev: ctx.device.clone().autodiff(),
            n: g.size(),
            r: g.group_rank(),
        }
    }

    fn t<const D: usize>(&self, shape: [usize; D], seed: u64) -> Tensor<D> {
        fixed(shape, seed, &self.dev, self.h.float)
    }

    fn leaf<const D: usize>(&self, shape: [usize; D], seed: u64) -> Tensor<D> {
        self.t(shape, seed).require_grad()
    }

    fn close<const D: usize>(&self, actual: &Tensor<D>, expected: &Tensor<D>, what: &str) {
        assert_close(actual, expected, self.h.tolerance, what);
    }
}

fn grad<const D: usize>(x: &Tensor<D>, loss: Tensor<1>) -> Tensor<D> {
    x.grad(&loss.backward()).expect("the input takes part in the loss")
}

/// Σ over `n` ranks of `loss(j)`.
fn total(n: usize, loss: impl Fn(usize) -> Tensor<1>) -> Tensor<1> {
    (0..n).map(loss).reduce(|a, b| a + b).expect("a group has members")
}

/// Identity forward; the gradient is the sum of every rank's gradient.
pub fn copy_to_tp_grads(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let c = Ctx::new(h, &ctx);
        let x = c.leaf([3, 4], 1);
        let y = copy_to_tp(x.clone(), &ctx.groups.tp).unwrap();
        c.close(&y, &x, "copy_to_tp output");
        let dx = grad(&x, (y * c.t([3, 4], 100 + c.r as u64)).sum());
        let x1 = c.leaf([3, 4], 1);
        let dx1 = grad(&x1, total(c.n, |j| (x1.clone() * c.t([3, 4], 100 + j as u64)).sum()));
        c.close(&dx, &dx1, "copy_to_tp input gradient");
    });
}

/// Sum of the ranks' partials forward; each partial's gradient is the output's.
pub fn reduce_from_tp_grads(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let c = Ctx::new(h, &ctx);
        let part = |j: usize, x: Tensor<2>| x * c.t([3, 4], 200 + j as u64);
        let x = c.leaf([3, 4], 10 + c.r as u64);
        let y = reduce_from_tp(part(c.r, x.clone()), &ctx.groups.tp).unwrap();
        let v = c.t([3, 4], 300);
        let dx = grad(&x, (y.clone() * v.clone()).sum());
        let xs: Vec<_> = (0..c.n).map(|j| c.leaf([3, 4], 10 + j as u64)).collect();
        let y1 = total(c.n, |j| part(j, xs[j].clone()).reshape([12])).reshape([3, 4]);
        c.close(&y, &y1, "reduce_from_tp output");
        c.close(&dx, &grad(&xs[c.r], (y1 * v).sum()), "reduce_from_tp input gradient");
    });
}

/// Own slice forward; the gradient of the replicated input is gathered from every slice.
pub fn scatter_to_sp_grads(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let c = Ctx::new(h, &ctx);
        let (s, dim) = (2 * c.n, 1);
        let w = c.t([3, s, 4], 400);
        let x = c.leaf([3, s, 4], 2);
        let y = scatter_to_sp(x.clone(), &ctx.groups.tp, dim).unwrap();
        c.close(&y, &x.clone().narrow(dim, 2 * c.r, 2), "scatter_to_sp output");
        let dx = grad(&x, (y * w.clone().narrow(dim, 2 * c.r, 2)).sum());
        let x1 = c.leaf([3, s, 4], 2);
        c.close(&dx, &grad(&x1, (x1.clone() * w).sum()), "scatter_to_sp input gradient");
    });
}

/// All-gather forward; each shard's gradient is its slice of the sum of the ranks' gradients.
pub fn gather_from_sp_grads(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let c = Ctx::new(h, &ctx);
        let dim = 0;
        let w = |j: usize| c.t([2 * c.n, 3], 500 + j as u64);
        let x = c.leaf([2, 3], 20 + c.r as u64);
        let y = gather_from_sp(x.clone(), &ctx.groups.tp, dim).unwrap();
        let dx = grad(&x, (y.clone() * w(c.r)).sum());
        let xs: Vec<_> = (0..c.n).map(|j| c.leaf([2, 3], 20 + j as u64)).collect();
        let full = Tensor::cat(xs.clone(), dim);
        c.close(&y, &full, "gather_from_sp output");
        c.close(
            &dx,
            &grad(&xs[c.r], total(c.n, |j| (full.clone() * w(j)).sum())),
            "gather_from_sp input gradient",
        );
    });
}

/// All-gather forward; the downstream loss is replicated, so each shard's gradient is its slice.
pub fn gather_from_tp_grads(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let c = Ctx::new(h, &ctx);
        let dim = 1;
        let w = c.t([2, 3 * c.n], 600);
        let x = c.leaf([2, 3], 30 + c.r as u64);
        let y = gather_from_tp(x.clone(), &ctx.groups.tp, dim).unwrap();
        let dx = grad(&x, (y.clone() * w.clone()).sum());
        let xs: Vec<_> = (0..c.n).map(|j| c.leaf([2, 3], 30 + j as u64)).collect();
        let full = Tensor::cat(xs.clone(), dim);
        c.close(&y, &full, "gather_from_tp output");
        c.close(&dx, &grad(&xs[c.r], (full * w).sum()), "gather_from_tp input gradient");
    });
}

/// Reduce-scatter forward; every partial's gradient is the gathered output gradient.
pub fn reduce_scatter_to_sp_grads(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let c = Ctx::new(h, &ctx);
        let (s, dim) = (2 * c.n, 1);
        let w = c.t([3, s], 700);
        let x = c.leaf([3, s], 40 + c.r as u64);
        let y = reduce_scatter_to_sp(x.clone(), &ctx.groups.tp, dim).unwrap();
        let dx = grad(&x, (y.clone() * w.clone().narrow(dim, 2 * c.r, 2)).sum());
        let xs: Vec<_> = (0..c.n).map(|j| c.leaf([3, s], 40 + j as u64)).collect();
        let sum = total(c.n, |j| xs[j].clone().reshape([3 * s])).reshape([3, s]);
        c.close(&y, &sum.clone().narrow(dim, 2 * c.r, 2), "reduce_scatter_to_sp output");
        c.close(
            &dx,
            &grad(&xs[c.r], (sum * w).sum()),
            "reduce_scatter_to_sp input gradient",
        );
    });
}

/// Split dim 2, gather dim 0; the gradient goes back the inverse way.
pub fn all_to_all_grads(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let c = Ctx::new(h, &ctx);
        let w = |j: usize| c.t([2 * c.n, 3, 2], 800 + j as u64);
        let x = c.leaf([2, 3, 2 * c.n], 50 + c.r as u64);
        let y = all_to_all(x.clone(), &ctx.groups.tp, 2, 0).unwrap();
        let dx = grad(&x, (y.clone() * w(c.r)).sum());
        let xs: Vec<_> = (0..c.n).map(|j| c.leaf([2, 3, 2 * c.n], 50 + j as u64)).collect();
        let out = |to: usize| Tensor::cat(xs.iter().map(|x| x.clone().narrow(2, 2 * to, 2)).collect(), 0);
        c.close(&y, &out(c.r), "all_to_all output");
        c.close(
            &dx,
            &grad(&xs[c.r], total(c.n, |j| (out(j) * w(j)).sum())),
            "all_to_all input gradient",
        );
    });
}

/// Rank `r` sends `r + j + 1` rows to rank `j`; the gradient rows travel back the same routes.
pub fn all_to_all_uneven_grads(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let c = Ctx::new(h, &ctx);
        let splits = |from: usize| (0..c.n).map(|to| from + to + 1).collect::<Vec<usize>>();
        let rows = |from: usize| splits(from).iter().sum::<usize>();
        let received = |to: usize| (0..c.n).map(|from| from + to + 1).sum::<usize>();
        let w = |j: usize| c.t([received(j), 3], 900 + j as u64);
        let x = c.leaf([rows(c.r), 3], 60 + c.r as u64);
        let (y, recv) = all_to_all_uneven(x.clone(), &ctx.groups.tp, 0, &splits(c.r)).unwrap();
        assert_eq!(recv, (0..c.n).map(|from| from + c.r + 1).collect::<Vec<_>>());
        let dx = grad(&x, (y.clone() * w(c.r)).sum());
        let xs: Vec<_> = (0..c.n).map(|j| c.leaf([rows(j), 3], 60 + j as u64)).collect();
        let out = |to: usize| {
            let parts = (0..c.n).map(|from| {
                let offset: usize = splits(from)[..to].iter().sum();
                xs[from].clone().narrow(0, offset, from + to + 1)
            });
            Tensor::cat(parts.collect(), 0)
        };
        c.close(&y, &out(c.r), "all_to_all_uneven output");
        c.close(
            &dx,
            &grad(&xs[c.r], total(c.n, |j| (out(j) * w(j)).sum())),
            "all_to_all_uneven input gradient",
        );
    });
}

/// A mapping given a bad shape returns a typed error instead of running.
pub fn mapping_errors_are_typed(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let g = &ctx.groups.tp;
        if g.size() == 1 {
            return;
        }
        let dev = ctx.device.clone().autodiff();
        let x = Tensor::<2>::ones([g.size() + 1, 2], &dev).require_grad();
        let err = scatter_to_sp(x.clone(), g, 0).unwrap_err();
        assert!(matches!(err, CommError::InvalidArgument { .. }), "{err}");
        let err = reduce_scatter_to_sp(x, g, 0).unwrap_err();
        assert!(matches!(err, CommError::InvalidArgument { .. }), "{err}");
    });
}
