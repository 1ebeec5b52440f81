//! The decoding step's kernels (cache append, one-query attention) on CUDA against their
//! reference on the same values in f32 on the CPU, and a step recorded as a CUDA graph replayed
//! with rewritten inputs against the same step run eagerly.

use burn::tensor::{DType, Device, Distribution, Tensor};
use burn_megatron_kernels::cuda::graph::{Recorder, overwrite};
use burn_megatron_kernels::decode::{cache_append, decode_attention, positions, reference};

use super::{relative_error, tolerance};
use crate::Harness;

/// `t` (on any device) as f32 on the CPU.
fn host<const D: usize>(t: &Tensor<D>) -> Tensor<D> {
    let data = t.clone().cast(DType::F32).into_data();
    Tensor::from_data(data, (&Device::flex(), DType::F32))
}

/// Random values on the CPU and the same values in `dtype` on `device`.
fn pair<const D: usize>(shape: [usize; D], device: &Device, dtype: DType) -> (Tensor<D>, Tensor<D>) {
    let on_device = Tensor::<D>::random(shape, Distribution::Normal(0.0, 1.0), (device, DType::F32)).cast(dtype);
    (host(&on_device), on_device)
}

/// RoPE tables for `c` positions of heads of `k`, on the CPU and on `device`.
fn tables(c: usize, k: usize, device: &Device) -> ((Tensor<2>, Tensor<2>), (Tensor<2>, Tensor<2>)) {
    let angles = Tensor::<2>::random([c, k / 2], Distribution::Uniform(0.0, 6.0), (device, DType::F32));
    let (cos, sin) = (angles.clone().cos(), angles.sin());
    ((host(&cos), host(&sin)), (cos, sin))
}

/// Appends at position 517 of 600 (keys rotated, values not) and the attention of 3 rows × 6
/// query heads over 2 kv heads of 64, the rows starting at keys 0, 5 and 300 (three chunks of
/// 256 positions, a row whose first chunk is partial, one that starts mid-cache); heads of 16
/// (two 8-element vectors) over two chunks; heads of 128 over 4 positions; and heads of 6 with
/// 2 positions (no whole vectors: the reference path), in f32 and bf16.
pub fn decode_step(h: &Harness) {
    let device = h.device(0);
    let cpu = Device::flex();
    for dtype in [DType::F32, DType::BF16] {
        for (b, heads, kv, k, c, p, first) in [(3, 6, 2, 64, 600, 517, vec![0, 5, 300]), (2, 4, 4, 6, 8, 1, vec![0, 1])]
        {
            let case = format!("{dtype:?} b {b} h {heads}/{kv} k {k} at {p} of {c}");
            let (cache_host, cache) = pair([b, kv, c, k], &device, dtype);
            let (new_host, new) = pair([b, kv * k], &device, dtype);
            let (q_host, q) = pair([b, heads * k], &device, dtype);
            let (tables_host, tables) = tables(c, k, &device);
            let (at, at_host) = (positions(&[p], &device), positions(&[p], &cpu));
            let (from, from_host) = (positions(&first, &device), positions(&first, &cpu));
            let keys = cache_append(cache.clone(), new.clone(), tables.clone(), at.clone(), true);
            let values = cache_append(cache, new, tables.clone(), at.clone(), false);
            let keys_ref = reference::cache_append(
                cache_host.clone(),
                new_host.clone(),
                tables_host.0.clone(),
                tables_host.1.clone(),
                at_host.clone(),
                true,
            );
            let values_ref = reference::cache_append(
                cache_host,
                new_host,
                tables_host.0.clone(),
                tables_host.1.clone(),
                at_host.clone(),
                false,
            );
            let ours = |t: &Tensor<4>| host(&t.clone().cast(DType::F32));
            // The same f32 rotation rounded once to the cache's dtype: off by at most one
            // rounding of either side's FMA contraction.
            let error = relative_error(ours(&keys), keys_ref.clone().cast(dtype).cast(DType::F32));
            assert!(
                error < tolerance(dtype) / 10.0,
                "{case}: appended keys, relative error {error}"
            );
            // Values are copied: exactly.
            let same = ours(&values)
                .equal(values_ref.clone().cast(dtype).cast(DType::F32))
                .all()
                .into_scalar::<bool>();
            assert!(same, "{case}: appended values differ");
            let out = decode_attention(q, keys, values, tables, at, from);
            let out_ref = reference::decode_attention(
                q_host,
                keys_ref.cast(dtype).cast(DType::F32),
                values_ref.cast(dtype).cast(DType::F32),
                tables_host.0,
                tables_host.1,
                at_host,
                from_host,
            );
            // f32: another summation order and the online softmax's rescaling (ulps); bf16: the
            // output rounded once more, and the query rounded after its rotation.
            let error = relative_error(host(&out), out_ref);
            assert!(error < tolerance(dtype), "{case}: attention, relative error {error}");
        }
    }
}

/// A step of an append and an attention recorded as a graph, replayed at three positions with
/// its position rewritten in place, gives what the same ops give eagerly at each (bit for bit:
/// the same kernels on the same values), and the cache it updates holds every replay's key.
pub fn graph_replay(h: &Harness) {
    let device = h.device(0);
    let (b, heads, kv, k, c) = (2, 4, 2, 16, 40);
    let dtype = DType::BF16;
    let (_, base) = pair([b, kv, c, k], &device, dtype);
    let (_, new) = pair([b, kv * k], &device, dtype);
    let (_, q) = pair([b, heads * k], &device, dtype);
    let (_, rope) = tables(c, k, &device);
    let first = positions(&[0, 3], &device);
    let step = |cache: Tensor<4>, at: &Tensor<1>| {
        let keys = cache_append(cache, new.clone(), rope.clone(), at.clone(), true);
        let out = decode_attention(
            q.clone(),
            keys.clone(),
            keys.clone(),
            rope.clone(),
            at.clone(),
            first.clone(),
        );
        (keys, out)
    };
    let own = |t: &Tensor<4>| t.clone().mul_scalar(1.0);
    // Eagerly, step after step on one cache.
    let mut eager = own(&base);
    let mut expected = Vec::new();
    for p in [10, 11, 12, 13] {
        let (keys, out) = step(eager, &positions(&[p], &device));
        expected.push(out.into_data());
        eager = keys;
    }
    // Warm-up at 10 on the graph's own buffers, the recording, replays at 11, 12 and 13.
    let recorder = Recorder::on(&q).expect("a CUDA tensor");
    let at = positions(&[10], &device);
    recorder.prepare().expect("prepare");
    let (cache, warm) = step(own(&base), &at);
    assert_eq!(warm.into_data(), expected[0], "the warm-up step");
    let ((cache, out), graph) = recorder.record(|| step(cache, &at)).expect("the recording");
    for (i, p) in [11.0, 12.0, 13.0].into_iter().enumerate() {
        overwrite(&at, &[p]).expect("the position rewritten");
        // SAFETY: every buffer the graph touches (`at`, `cache`, `out`, the inputs) is alive
        // and written only by replays and `overwrite`, on this thread.
        unsafe { graph.replay() }.expect("a replay");
        assert_eq!(out.clone().into_data(), expected[i + 1], "the replay at {p}");
    }
    assert_eq!(cache.into_data(), eager.into_data(), "the cache after the replays");
}

/// The linear layers' product for a few rows (`crate::skinny` under `Gemm::Wgmma`) against
/// the CPU's f32 product of the same bf16 operands: weights stored `[k, n]` and as the
/// transposed view of `[n, k]` (the tied output layer's), 1 to 32 rows (one row tile, both, a
/// ragged second), a `k` no multiple of 8 (the wgmma GEMM's fallback), a `k` no multiple of the
/// 32-deep chunk and an `n` no multiple of the 64-column block, `k` split over blocks and not,
/// and llama-1b's and SmolLM2's decoding shapes.
pub fn skinny_gemm(h: &Harness) {
    use burn_megatron_kernels::{Gemm, gemm};
    let device = h.device(0);
    for (m, k, n) in [
        (1, 2048, 2048),
        (5, 100, 264),
        (9, 576, 1536),
        (17, 40, 200),
        (32, 5632, 2048),
        (32, 2048, 256),
        (1, 576, 49152),
        (32, 576, 49152),
    ] {
        for transposed in [false, true] {
            let (lhs_host, lhs) = pair([m, k], &device, DType::BF16);
            let (rhs_host, rhs) = match transposed {
                true => {
                    let (host_t, device_t) = pair([n, k], &device, DType::BF16);
                    (host_t.transpose(), device_t.transpose())
                }
                false => pair([k, n], &device, DType::BF16),
            };
            let out = host(&gemm(lhs, rhs, Gemm::Wgmma));
            let expected = lhs_host.matmul(rhs_host);
            // f32 sums in another order, rounded once to bf16 (2⁻⁹ relative): about 2e-3 in
            // norm; a wrong column, row or split is of order 1.
            let error = relative_error(out, expected);
            assert!(
                error < 1e-2,
                "{m}×{k}×{n} transposed {transposed}: relative error {error}"
            );
        }
    }
}

/// The device's greedy choice against the reference on the CPU: bf16 and f32 logits, rows with
/// ties (the first of equals wins), a maximum in the padded columns past `vocab` (ignored), a
/// maximum in the last valid column, and a row of a single value.
pub fn greedy_choice(h: &Harness) {
    use burn::tensor::TensorData;
    use burn_megatron_kernels::decode::greedy;
    let device = h.device(0);
    let (b, columns, vocab) = (5, 1000, 997);
    for dtype in [DType::F32, DType::BF16] {
        let mut values: Vec<f32> = host(&Tensor::<2>::random(
            [b, columns],
            Distribution::Normal(0.0, 1.0),
            &device,
        ))
        .into_data()
        .try_to_vec()
        .expect("f32");
        values[3] = 9.0; // row 0: a tie at 3 and 700, 3 wins
        values[700] = 9.0;
        values[columns + 998] = 50.0; // row 1: past `vocab`, ignored
        values[2 * columns + 996] = 9.0; // row 2: the last valid column
        values[3 * columns..4 * columns].fill(0.5); // row 3: all equal, 0 wins
        let data = TensorData::new(values, [b, columns]);
        let on_device = Tensor::<2>::from_data(data.clone(), (&device, DType::F32)).cast(dtype);
        let on_host = host(&on_device);
        let ours: Vec<f32> = host(&greedy(on_device, vocab)).into_data().try_to_vec().expect("f32");
        let theirs: Vec<f32> = reference::greedy(on_host, vocab).into_data().try_to_vec().expect("f32");
        assert_eq!(ours, theirs, "{dtype:?}");
        assert_eq!(
            (ours[0], ours[2], ours[3]),
            (3.0, 996.0, 0.0),
            "{dtype:?}: ties and edges"
        );
        assert!(ours[1] < vocab as f32, "{dtype:?}: a padded column chosen");
    }
}
