//! The communicator parity suite: every collective, in every dtype it supports, against the
//! answer it must give. Each rank sends values built from its rank, so the results are known
//! exactly; every rank checks its own.

use std::time::{Duration, Instant};

use burn::tensor::{DType, Int, Tensor};
use burn_megatron_dist::{CommError, ReduceOp};

use crate::Harness;
use crate::data::{assert_exact, int_values, ints, small_ints};

const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// Sum, average and maximum of `ones·(rank+1)` plus a pattern, in each float dtype: exact,
/// since small integers (and their average, a multiple of ½) are exact in bf16 and f16.
pub fn all_reduce_floats(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let n = ctx.groups.tp.size() as i64;
        let r = ctx.groups.tp.group_rank() as i64;
        for dtype in FLOATS {
            let x = small_ints([3, 5], r + 1, &ctx.device, dtype);
            let sum = ctx.groups.tp.all_reduce(x.clone(), ReduceOp::Sum).unwrap();
            let expected_sum = small_ints([3, 5], 0, &ctx.device, dtype)
                .mul_scalar(n as f32)
                .add_scalar((n * (n + 1) / 2) as f32);
            assert_exact(&sum, &expected_sum, &format!("all_reduce sum {dtype:?}"));
            let avg = ctx.groups.tp.all_reduce(x.clone(), ReduceOp::Avg).unwrap();
            assert_exact(
                &avg,
                &expected_sum.div_scalar(n as f32),
                &format!("all_reduce avg {dtype:?}"),
            );
            let max = ctx.groups.tp.all_reduce(x, ReduceOp::Max).unwrap();
            assert_exact(
                &max,
                &small_ints([3, 5], n, &ctx.device, dtype),
                &format!("all_reduce max {dtype:?}"),
            );
            assert_eq!(sum.dtype(), dtype, "the dtype survives the collective");
        }
    });
}

/// Sum and maximum of integer tensors (i64 and i32), and the refusal of an integer average.
pub fn all_reduce_ints(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let n = ctx.groups.tp.size() as i64;
        let r = ctx.groups.tp.group_rank() as i64;
        for dtype in [DType::I64, DType::I32] {
            let x = ints([4, 2], 1000 * (r + 1), &ctx.device).cast(dtype);
            let sum = ctx.groups.tp.all_reduce(x.clone(), ReduceOp::Sum).unwrap();
            let expected = ints([4, 2], 0, &ctx.device)
                .mul_scalar(n)
                .add_scalar(1000 * n * (n + 1) / 2);
            assert_eq!(sum.dtype(), dtype);
            assert_eq!(int_values(sum), int_values(expected), "int sum {dtype:?}");
            let max = ctx.groups.tp.all_reduce(x.clone(), ReduceOp::Max).unwrap();
            assert_eq!(
                int_values(max),
                int_values(ints([4, 2], 1000 * n, &ctx.device)),
                "int max {dtype:?}"
            );
            let avg = ctx.groups.tp.all_reduce(x, ReduceOp::Avg);
            assert!(matches!(avg, Err(CommError::InvalidArgument { .. })), "{avg:?}");
        }
    });
}

/// All-gather along every dim of a rank-3 tensor: the ranks' tensors, in group-rank order.
pub fn all_gather_every_dim(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let g = &ctx.groups.tp;
        for dtype in FLOATS {
            let mine = |r: usize| small_ints([2, 3, 4], 10 * r as i64, &ctx.device, dtype);
            for dim in 0..3 {
                let got = g.all_gather(mine(g.group_rank()), dim).unwrap();
                let expected = Tensor::cat((0..g.size()).map(mine).collect(), dim);
                assert_exact(&got, &expected, &format!("all_gather dim {dim} {dtype:?}"));
            }
        }
        let got = g
            .all_gather(ints([2, 2], g.group_rank() as i64, &ctx.device), 1)
            .unwrap();
        let expected = Tensor::cat((0..g.size()).map(|r| ints([2, 2], r as i64, &ctx.device)).collect(), 1);
        assert_eq!(int_values(got), int_values(expected), "integer all_gather");
    });
}

/// Reduce-scatter along dims 0 and 2: this rank's slice of the sum.
pub fn reduce_scatter_every_dim(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let g = &ctx.groups.tp;
        let (n, r) = (g.size(), g.group_rank());
        for dtype in FLOATS {
            for dim in [0, 2] {
                let mut shape = [2, 3, 2];
                shape[dim] *= n;
                let x = small_ints(shape, r as i64 + 1, &ctx.device, dtype);
                let got = g.reduce_scatter(x, dim, ReduceOp::Sum).unwrap();
                let total: i64 = (1..=n as i64).sum();
                let full = small_ints(shape, 0, &ctx.device, dtype)
                    .mul_scalar(n as f32)
                    .add_scalar(total as f32);
                let expected = full.narrow(dim, r * shape[dim] / n, shape[dim] / n);
                assert_exact(&got, &expected, &format!("reduce_scatter dim {dim} {dtype:?}"));
            }
        }
        let odd = g.reduce_scatter(small_ints([n + 1, 2], 0, &ctx.device, DType::F32), 0, ReduceOp::Sum);
        assert!(
            n == 1 || matches!(odd, Err(CommError::InvalidArgument { .. })),
            "{odd:?}"
        );
    });
}

/// Collectives left in flight: an all-reduce and a reduce-scatter are launched, the rank queues
/// other device work and a plain all-reduce behind them, and waits for the two last, the
/// reduce-scatter before the all-reduce. On NCCL the device has then signalled three calls
/// before waiting for the first, and waits for them out of order; every result must still be
/// the collective's. A refused call is refused at launch.
pub fn deferred_collectives(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let g = &ctx.groups.tp;
        let (n, r) = (g.size(), g.group_rank());
        let dev = &ctx.device;
        let total: i64 = (1..=n as i64).sum();
        let summed = |shape: [usize; 2]| {
            small_ints(shape, 0, dev, DType::F32)
                .mul_scalar(n as f32)
                .add_scalar(total as f32)
        };
        let reduce = g
            .all_reduce_async(small_ints([64, 33], r as i64 + 1, dev, DType::F32), ReduceOp::Sum)
            .unwrap();
        let scatter = g
            .reduce_scatter_async(small_ints([8 * n, 5], r as i64 + 1, dev, DType::BF16), 0, ReduceOp::Sum)
            .unwrap();
        // Device work of this rank's own, queued while both collectives may be running.
        let busy = small_ints([256, 256], 0, dev, DType::F32);
        let busy = busy.clone().matmul(busy).sum();
        let plain = g
            .all_reduce(small_ints([3, 4], r as i64 + 1, dev, DType::F32), ReduceOp::Sum)
            .unwrap();
        assert_exact(&plain, &summed([3, 4]), "the plain all-reduce behind two in flight");
        let scattered = scatter.wait().unwrap();
        let expected = summed([8 * n, 5]).cast(DType::BF16).narrow(0, 8 * r, 8);
        assert_exact(&scattered, &expected, "the deferred reduce-scatter, waited for first");
        assert_exact(
            &reduce.wait().unwrap(),
            &summed([64, 33]),
            "the deferred all-reduce, waited for last",
        );
        assert!(busy.into_scalar::<f32>().is_finite());
        let refused = g.all_reduce_async(ints([2, 2], 0, dev), ReduceOp::Avg);
        assert!(
            matches!(refused, Err(CommError::InvalidArgument { .. })),
            "an integer average is refused at launch"
        );
    });
}

/// Even all-to-all over every pairing of split and concat dims (the parts consecutive memory
/// or not, on either side), and uneven all-to-all: rank r sends r+j+1 rows to rank j, then
/// entries of an inner dim with some ranks sent none.
pub fn all_to_all_even_and_uneven(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let g = &ctx.groups.tp;
        let (n, r) = (g.size(), g.group_rank());
        let dev = &ctx.device;
        let block = |from: usize| small_ints([2, 3 * n], 10 * from as i64, dev, DType::BF16);
        let mine = |from: usize, dim: usize| block(from).narrow(dim, 3 * r, 3);
        let even = [(1, 0, "split inner, concat outer"), (1, 1, "both inner")];
        for (split, concat, what) in even {
            let got = g.all_to_all(block(r), split, concat).unwrap();
            let expected = Tensor::cat((0..n).map(|from| mine(from, split)).collect(), concat);
            assert_exact(&got, &expected, &format!("even all_to_all, {what}"));
        }
        let column = |from: usize| small_ints([3 * n, 2], 10 * from as i64, dev, DType::F32);
        let got = g.all_to_all(column(r), 0, 1).unwrap();
        let expected = Tensor::cat((0..n).map(|from| column(from).narrow(0, 3 * r, 3)).collect(), 1);
        assert_exact(&got, &expected, "even all_to_all, split outer, concat inner");
        let got = g.all_to_all(column(r), 0, 0).unwrap();
        let expected = Tensor::cat((0..n).map(|from| column(from).narrow(0, 3 * r, 3)).collect(), 0);
        assert_exact(&got, &expected, "even all_to_all, both outer");

        let splits = |from: usize| (0..n).map(|to| from + to + 1).collect::<Vec<_>>();
        let rows = |from: usize| small_ints([splits(from).iter().sum(), 2], 20 * from as i64, dev, DType::F32);
        let (got, recv) = g.all_to_all_uneven(rows(r), 0, &splits(r)).unwrap();
        assert_eq!(recv, (0..n).map(|from| from + r + 1).collect::<Vec<_>>());
        let offset = |from: usize| splits(from)[..r].iter().sum::<usize>();
        let expected = Tensor::cat(
            (0..n)
                .map(|from| rows(from).narrow(0, offset(from), from + r + 1))
                .collect(),
            0,
        );
        assert_exact(&got, &expected, "uneven all_to_all");

        // Along dim 1 of [2, Σ, 3] integers; from rank `from` to rank `to`, none when the sum is odd.
        let splits = |from: usize| (0..n).map(|to| (from + to + 1) % 2 * (to + 2)).collect::<Vec<_>>();
        let entries = |from: usize| {
            let total = splits(from).iter().sum::<usize>();
            Tensor::<1, Int>::arange(0..(6 * total) as i64, dev).reshape([2, total, 3]) + 1000 * from as i64
        };
        let (got, recv) = g.all_to_all_uneven(entries(r), 1, &splits(r)).unwrap();
        assert_eq!(recv, (0..n).map(|from| splits(from)[r]).collect::<Vec<_>>());
        let offset = |from: usize| splits(from)[..r].iter().sum::<usize>();
        let parts: Vec<_> = (0..n)
            .filter(|&from| recv[from] > 0)
            .map(|from| entries(from).narrow(1, offset(from), recv[from]))
            .collect();
        let got = int_values(got);
        let expected = match parts.is_empty() {
            true => vec![],
            false => int_values(Tensor::cat(parts, 1)),
        };
        assert_eq!(got, expected, "uneven all_to_all of an inner dim, some parts empty");
    });
}

/// Broadcast from the last rank; send/recv around a ring; a barrier.
pub fn broadcast_send_recv_barrier(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let g = &ctx.groups.tp;
        let (n, r) = (g.size(), g.group_rank());
        let dev = &ctx.device;
        let root = n - 1;
        let got = g
            .broadcast(small_ints([3, 3], r as i64, dev, DType::BF16), root)
            .unwrap();
        assert_exact(&got, &small_ints([3, 3], root as i64, dev, DType::BF16), "broadcast");
        let got = g.broadcast(ints([5], r as i64, dev), root).unwrap();
        assert_eq!(
            int_values(got),
            int_values(ints([5], root as i64, dev)),
            "integer broadcast"
        );
        if n > 1 {
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            g.send(small_ints([2, 4], r as i64, dev, DType::F32), next).unwrap();
            let got = g.recv(Tensor::<2>::zeros([2, 4], dev), prev).unwrap();
            assert_exact(
                &got,
                &small_ints([2, 4], prev as i64, dev, DType::F32),
                "ring send/recv",
            );
        }
        g.barrier().unwrap();
    });
}

/// A rank with another shape, dtype or collective: the same typed error on every rank.
pub fn mismatches_are_errors_on_every_rank(h: &Harness) {
    h.run(h.tp_world(), |ctx| {
        let g = &ctx.groups.tp;
        if g.size() == 1 {
            return;
        }
        let r = g.group_rank();
        let dev = &ctx.device;
        let shape_err = g
            .all_reduce(Tensor::<2>::ones([2, 2 + r % 2], dev), ReduceOp::Sum)
            .unwrap_err();
        assert!(
            matches!(&shape_err, CommError::Mismatch { .. }) && shape_err.to_string().contains("shape"),
            "{shape_err}"
        );
        let dtype = if r == 0 { DType::F32 } else { DType::BF16 };
        let dtype_err = g.all_gather(Tensor::<2>::ones([2, 2], (dev, dtype)), 0).unwrap_err();
        assert!(dtype_err.to_string().contains("dtype"), "{dtype_err}");
        let x = Tensor::<1>::ones([4], dev);
        let call_err = if r == 0 {
            g.all_reduce(x, ReduceOp::Sum).map(|_| ())
        } else {
            g.all_gather(x, 0).map(|_| ())
        };
        let call_err = call_err.unwrap_err();
        assert!(
            call_err.to_string().contains("all_gather") && call_err.to_string().contains("all_reduce"),
            "{call_err}"
        );
        // The group is still usable after a refused call.
        let sum = g.all_reduce(Tensor::<1, Int>::ones([2], dev), ReduceOp::Sum).unwrap();
        assert_eq!(int_values(sum), vec![g.size() as i64; 2]);
    });
}

/// A rank that never arrives: the others fail with a timeout naming it, within the timeout.
pub fn a_missing_rank_times_out_with_its_name(h: &Harness) {
    let timeout = Duration::from_secs(2);
    h.run_with_timeout(h.tp_world(), timeout, |ctx| {
        let g = &ctx.groups.tp;
        let last = g.size() - 1;
        if g.size() == 1 || g.group_rank() == last {
            return;
        }
        let start = Instant::now();
        let err = g
            .all_reduce(Tensor::<1>::ones([4], &ctx.device), ReduceOp::Sum)
            .unwrap_err();
        let waited = start.elapsed();
        match &err {
            CommError::Timeout {
                missing, collective, ..
            } => {
                assert_eq!(missing, &vec![last], "{err}");
                assert_eq!(*collective, "all_reduce");
            }
            other => panic!("expected a timeout, got {other}"),
        }
        assert!(waited >= timeout && waited < timeout * 3, "gave up after {waited:?}");
    });
}
