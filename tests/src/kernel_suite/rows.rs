//! The mixture of experts' row kernels on CUDA (`burn_megatron_kernels::rows`) against Burn's
//! own `select`, products and sums in f32 on the same device, differentiated by autodiff: a
//! dispatch of 300 tokens' 4 copies over 8 experts (one expert empty, fillers up to 128 rows,
//! copies dropped), on rows of 2048 (vectors of 8) and of 36 (single elements), in f32 and bf16.
//! With them, the router's top k on CUDA against the CPU's on scores full of ties, and the
//! dispatch order the CUDA kernels decide against the host's, and the router's f32 product;
//! and the token embedding's rows and gradient against Burn's `embedding`.

use burn::tensor::{DType, Device, Distribution, Int, Tensor, TensorData};
use burn_megatron::layers::moe::dispatch::{dispatch_host, permute, unpermute};
use burn_megatron_kernels::embedding::embedding_rows;
use burn_megatron_kernels::order::{HostOrder, order_by_expert};
use burn_megatron_kernels::router::logits;
use burn_megatron_kernels::rows::gather_rows;
use burn_megatron_kernels::top_k::top_k;

use super::{relative_error, tolerance};
use crate::Harness;

/// Every 7th copy dropped, the others to expert `(slot · 5) mod 8` but never expert 3.
fn kept(slots: usize) -> Vec<Option<usize>> {
    (0..slots)
        .map(|s| (!s.is_multiple_of(7)).then_some((s * 5) % 8).filter(|&x| x != 3))
        .collect()
}

pub fn row_kernels(h: &Harness) {
    let device = h.device(0).autodiff();
    let (t, k) = (300, 4);
    let plan = dispatch_host(kept(t * k), k, 0..8, 128, &device);
    let r = plan.slots.dims()[0];
    for (d, dtype) in [(2048, DType::BF16), (2048, DType::F32), (36, DType::BF16)] {
        let case = format!("d {d} {dtype:?}");
        let normal = Distribution::Normal(0.0, 1.0);
        let x = Tensor::<2>::random([t, d], normal, (&device, dtype)).require_grad();
        let y = Tensor::<2>::random([r, d], normal, (&device, dtype)).require_grad();
        let weights =
            Tensor::<2>::random([t, k], Distribution::Uniform(0.0, 1.0), (&device, DType::F32)).require_grad();
        let f32 = |t: &Tensor<2>| t.clone().cast(DType::F32);
        let with_zero =
            |t: Tensor<2>, width: usize| Tensor::cat(vec![t, Tensor::zeros([1, width], (&device, DType::F32))], 0);

        // The permutation: a gather whose gradient adds each token's readers.
        let ours = permute(x.clone(), &plan);
        let theirs = f32(&x).select(0, plan.tokens.clone());
        let dy = Tensor::<2>::random([r, d], normal, (&device, DType::F32));
        // A filler repeats its expert's first token, but the readers list leaves it out, so
        // its row sends no gradient back: the reference masks it.
        let real: Tensor<2> = plan.slots.clone().lower_elem((t * k) as i64).float().unsqueeze_dim(1);
        let grads = (f32(&ours) * dy.clone()).sum().backward();
        let grads_ref = (theirs * dy * real).sum().backward();
        // Copies of bf16 rows are exact; the gradient sums ≤ 4 copies in f32 and rounds once.
        let error = relative_error(ours.clone(), f32(&x).select(0, plan.tokens.clone()));
        assert!(error == 0.0, "{case}: permuted rows off by {error}");
        let error = relative_error(x.grad(&grads).unwrap(), x.grad(&grads_ref).unwrap());
        assert!(error < tolerance(dtype), "{case}: permutation's gradient {error}");

        // The un-permutation: weighted copies summed into their tokens.
        let ours = unpermute(y.clone(), weights.clone(), &plan);
        let rows: Tensor<1, Int> = plan.rows.clone().reshape([t * k]);
        let copies = with_zero(f32(&y), d).select(0, rows).reshape([t, k, d]);
        let theirs = (copies * weights.clone().unsqueeze_dim::<3>(2))
            .sum_dim(1)
            .reshape([t, d]);
        let dout = Tensor::<2>::random([t, d], normal, (&device, DType::F32));
        let grads = (f32(&ours) * dout.clone()).sum().backward();
        let grads_ref = (theirs.clone() * dout).sum().backward();
        // Sums of 4 products in f32, the output rounded to the dtype once.
        let error = relative_error(ours, theirs);
        assert!(error < tolerance(dtype), "{case}: combined rows {error}");
        let error = relative_error(y.grad(&grads).unwrap(), y.grad(&grads_ref).unwrap());
        assert!(error < tolerance(dtype), "{case}: rows' gradient {error}");
        // Dot products of d terms in f32, in another order than Burn's; the output's gradient
        // reaches the kernel in the output's dtype (rounded to bf16, 2⁻⁹ relative each term).
        let error = relative_error(weights.grad(&grads).unwrap(), weights.grad(&grads_ref).unwrap());
        assert!(error < tolerance(dtype), "{case}: weights' gradient {error}");

        // A gather reading the zero row, and its gradient through an explicit readers list.
        let index = Tensor::<1, Int>::from_data([2, 3, 0, 2], &device);
        let readers = Tensor::<2, Int>::from_data([[2, 4], [4, 4], [0, 3]], &device);
        let small = x.clone().narrow(0, 0, 3);
        let ours = gather_rows(small.clone(), index.clone(), readers);
        let theirs = with_zero(f32(&small), d).select(0, index);
        assert_eq!(relative_error(ours, theirs), 0.0, "{case}: the zero row");
    }
}

/// Token embedding lookups on CUDA (`burn_megatron_kernels::embedding`) against Burn's
/// `embedding` on the same device in f32, differentiated by autodiff (its `select_assign` adds
/// each position's row in position order): llama-1b's table (32 768 rows of 2048, vectors of 8:
/// 16 whole tiles of the scan) and a ragged one (5003 rows of 36: three tiles, the last ending
/// inside a thread's run), 8192 positions of which half read one token (a bucket of
/// 4096, not a multiple of the sum's four), the rest random, with ids below and past the table
/// (another rank's, reading zero rows); in f32 and bf16.
pub fn embedding_kernels(h: &Harness) {
    let device = h.device(0).autodiff();
    let m = 8192;
    for (n, d, dtype) in [
        (32768, 2048, DType::BF16),
        (32768, 2048, DType::F32),
        (5003, 36, DType::BF16),
    ] {
        let case = format!("{n}×{d} {dtype:?}");
        let draws = Tensor::<1>::random([m], Distribution::Uniform(-0.01, 1.01), (&device, DType::F32));
        let mut ids: Vec<i64> = draws
            .to_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(|u| (u * n as f32).floor() as i64)
            .collect();
        for (i, id) in ids.iter_mut().enumerate() {
            if i % 2 == 1 && i != m - 1 {
                *id = 7;
            }
        }
        ids[m - 1] = 7;
        let inside: Vec<i64> = (0..m as i64)
            .filter(|&i| (0..n as i64).contains(&ids[i as usize]))
            .collect();
        let outside: Vec<i64> = (0..m as i64)
            .filter(|&i| !(0..n as i64).contains(&ids[i as usize]))
            .collect();
        assert!(!outside.is_empty(), "{case}: some ids outside the table");
        let kept: Vec<i64> = inside.iter().map(|&i| ids[i as usize]).collect();
        let ints = |v: Vec<i64>| {
            let len = v.len();
            Tensor::<1, Int>::from_data(TensorData::new(v, [len]), &device)
        };
        let weight = Tensor::<2>::random([n, d], Distribution::Normal(0.0, 1.0), (&device, dtype)).require_grad();
        let reference = weight.clone().cast(DType::F32).detach().require_grad();
        let ours = embedding_rows(weight.clone(), ints(ids.clone()));
        let kept_rows = kept.len();
        let theirs = burn::tensor::module::embedding(reference.clone(), ints(kept).reshape([1, kept_rows]))
            .reshape([kept_rows, d]);
        // Copies: exact; the rows of ids outside the table are zero.
        let inside_rows = ours.clone().cast(DType::F32).select(0, ints(inside.clone()));
        assert_eq!(relative_error(inside_rows, theirs.clone()), 0.0, "{case}: rows");
        let zeros = ours
            .clone()
            .cast(DType::F32)
            .select(0, ints(outside))
            .abs()
            .sum()
            .into_scalar::<f32>();
        assert_eq!(zeros, 0.0, "{case}: rows of ids outside the table");
        let dy = Tensor::<2>::random([m, d], Distribution::Normal(0.0, 1.0), (&device, dtype)).detach();
        let grads = (ours.cast(DType::F32) * dy.clone().cast(DType::F32)).sum().backward();
        let dy_kept = dy.cast(DType::F32).select(0, ints(inside));
        let grads_ref = (theirs * dy_kept).sum().backward();
        let (ours, theirs) = (weight.grad(&grads).unwrap(), reference.grad(&grads_ref).unwrap());
        let error = relative_error(ours, theirs);
        // Both add the same f32 values (the output's gradient is exact in bf16) in position order,
        // up to 4096 of them a row: a few f32 ulps of the sum at most; bf16 rounds the f32 sum
        // once (2⁻⁹ relative).
        let bound = if dtype == DType::F32 { 1e-6 } else { tolerance(dtype) };
        assert!(error <= bound, "{case}: the table's gradient {error}");
    }
}

/// moe-4b's top 4 of 32 experts over 8192 tokens of scores on five levels (most rows tied), on
/// CUDA (the kernel up to 16, the tensor-op twin above) and on the CPU: the same experts in the
/// same order (ties to the lower index).
pub fn router_top_k(h: &Harness) {
    let device = h.device(0);
    let levels = Tensor::<2>::random([8192, 32], Distribution::Uniform(0.0, 5.0), (&device, DType::F32)).floor();
    let on_cpu = Tensor::<2>::from_data(levels.to_data(), &Device::flex());
    for k in [1, 4, 16, 17] {
        let ids = |t: Tensor<2, Int>| t.into_data().convert::<i64>().try_to_vec::<i64>().unwrap();
        assert_eq!(ids(top_k(levels.clone(), k)), ids(top_k(on_cpu.clone(), k)), "top {k}");
    }
}

/// The dispatch order decided by the CUDA kernels against the host's, index for index: moe-4b's
/// 8192 tokens' top 4 of 32 experts (skewed so experts 30 and 31 take none and expert 0 takes
/// a quarter), rows padded to 128 (the grouped product's tile) and unpadded; and a ragged case
/// of 37 tokens' top 3 of 5 with 8-row fillers.
pub fn expert_order(h: &Harness) {
    let device = h.device(0);
    for (t, k, e, align) in [(8192, 4, 32, 128), (8192, 4, 32, 1), (37, 3, 5, 8)] {
        let draws = Tensor::<2>::random([t, k], Distribution::Uniform(0.0, 1.0), (&device, DType::F32));
        // A square skews the draws towards expert 0; the last two experts stay empty at e = 32.
        let used = if e > 8 { e - 2 } else { e };
        let ids: Tensor<2, Int> = (draws.clone() * draws).mul_scalar(used as f32).floor().int();
        let host: Vec<Option<usize>> = ids
            .to_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .unwrap()
            .into_iter()
            .map(|x| Some(x as usize))
            .collect();
        let expected = HostOrder::new(&host, k, 0..e, align);
        let got = order_by_expert(ids, e, align);
        let case = format!("t {t} k {k} e {e} align {align}");
        let ints = |t: Tensor<1, Int>| t.into_data().convert::<i64>().try_to_vec::<i64>().unwrap();
        let copies: Vec<usize> = ints(got.copies).into_iter().map(|c| c as usize).collect();
        assert_eq!(copies, expected.copies, "{case}: copies");
        assert_eq!(got.rows, t * k + e * (align - 1), "{case}: the rows' room");
        // Slots, tokens and rows, then the starts, in the room: fillers of no expert after the last.
        assert_eq!(
            ints(got.indices),
            expected.laid_out(got.rows),
            "{case}: slots, tokens, rows and starts"
        );
    }
}

/// The router's f32 product on CUDA (`burn_megatron_kernels::router`) against the same product
/// on the CPU (f32 operands, f32 sums), with autodiff: moe-4b's 8192 tokens of 2048 by 32
/// experts in bf16, a ragged case (37 tokens, 100 features: no whole tile, a partial slice; 5
/// experts: idle lanes), and f32 operands; then the experts in several groups of 32: 40 (a
/// ragged second group) and 160 in bf16 (five groups, DeepSeek-style counts).
pub fn router_product(h: &Harness) {
    let device = h.device(0).autodiff();
    let cpu = Device::flex().autodiff();
    let normal = Distribution::Normal(0.0, 1.0);
    let cases = [
        (8192, 2048, 32, DType::BF16),
        (37, 100, 5, DType::BF16),
        (300, 256, 32, DType::F32),
        (64, 128, 40, DType::F32),
        (1000, 512, 160, DType::BF16),
    ];
    for (t, d, e, dtype) in cases {
        let case = format!("t {t} d {d} e {e} {dtype:?}");
        let x = Tensor::<2>::random([t, d], normal, (&device, dtype));
        let w = Tensor::<2>::random([d, e], normal, (&device, dtype)).mul_scalar(0.02);
        let dy = Tensor::<2>::random([t, e], normal, (&device, DType::F32));
        let on = |x: &Tensor<2>, w: &Tensor<2>, dy: &Tensor<2>, at: &Device| {
            let x = Tensor::<2>::from_data(x.to_data(), at).require_grad();
            let w = Tensor::<2>::from_data(w.to_data(), at).require_grad();
            let dy = Tensor::<2>::from_data(dy.to_data(), at);
            let out = logits(x.clone(), w.clone());
            let grads = (out.clone() * dy).sum().backward();
            let host = |t: Tensor<2>| Tensor::<2>::from_data(t.cast(DType::F32).to_data(), &Device::flex());
            (host(out), host(x.grad(&grads).unwrap()), host(w.grad(&grads).unwrap()))
        };
        let (ours, dx, dw) = on(&x, &w, &dy, &device);
        let (theirs, dx_ref, dw_ref) = on(&x, &w, &dy, &cpu);
        // The same f32 products summed in another order (up to 8192 terms): ~1e-6 relative;
        // the gradients are rounded once to the operands' dtype (bf16: 2⁻⁹ a value).
        let error = relative_error(ours, theirs);
        assert!(error < 1e-5, "{case}: logits off by {error}");
        let error = relative_error(dx, dx_ref);
        assert!(error < tolerance(dtype), "{case}: input's gradient off by {error}");
        let error = relative_error(dw, dw_ref);
        assert!(error < tolerance(dtype), "{case}: weight's gradient off by {error}");
    }
}
