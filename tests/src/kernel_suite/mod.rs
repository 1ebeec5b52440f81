//! burn-megatron-kernels' CUDA kernels against their references, on one GPU (`gpu-suite`): the
//! wgmma GEMM and flash attention, forward and backward, on ragged shapes and every operand
//! layout they read; the optimizer's kernels in `optim.rs`; the FP8 kernels and quantized
//! products in `quant.rs` and `blocks.rs` (DeepSeek-V3's blocks), the emulated
//! recipes' block kernels in `emulated.rs`; the decoding step's
//! kernels and a CUDA graph of them in `decode.rs`.

use burn::tensor::activation::silu;
use burn::tensor::module::attention as burn_attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{DType, Distribution, Tensor};
use burn_megatron_kernels::Gemm;
use burn_megatron_kernels::attention::{attention, rotary_attention};
use burn_megatron_kernels::cuda::wgmma::{Schedule, WgmmaError, matmul};
use burn_megatron_kernels::gated_mlp::gated_mlp;
use burn_megatron_kernels::rope::reference::rope as rope_reference;

use crate::Harness;

mod blocks;
mod decode;
mod documents;
mod emulated;
mod onto;
mod optim;
mod quant;
mod repeat;
mod rotated;
mod rows;
pub use blocks::{fp8_blocks, fp8_blockwise_gemm};
pub use decode::{decode_step, graph_replay, greedy_choice, skinny_gemm};
pub use documents::flash_documents;
pub use emulated::emulated_blocks;
pub use onto::residual_gemm;
pub use optim::{adamw, adamw_master, sum_of_squares};
pub use quant::{amax_notes, fp8_amax, fp8_gemm, fp8_tiles, quantized_linear, shared_input, weight_codes};
pub use repeat::flash_repeats;
pub use rotated::rotated_gemm;
pub use rows::{embedding_kernels, expert_order, router_product, router_top_k, row_kernels};

/// ‖a − b‖ / ‖b‖ in f32.
pub(super) fn relative_error<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> f32 {
    let (a, b) = (a.cast(DType::F32), b.cast(DType::F32));
    let norm = |t: Tensor<D>| t.square().sum().sqrt().into_scalar::<f32>();
    norm(a - b.clone()) / norm(b)
}

/// The wgmma GEMM, persistent and a block a tile, on shapes that fill no tile, each operand
/// plain and transposed, against the f32 product of the same bf16 operands. (129, 2056, 257)
/// runs 33 k-slices: eight rounds of the 4 stages and one more, so every stage's barrier flips
/// parity many times. (4100, 200, 2000) has 264 tiles in 33 rows of 8 columns, more than the
/// H200's 132 SMs: each persistent block runs two of 4 slices each, its stage count (and so
/// the barriers' parity) running on across them, and the last group of rows is one tile high.
pub fn wgmma_gemm(h: &Harness) {
    let device = h.device(0);
    let operand = |rows: usize, cols: usize, transposed: bool| {
        let normal = Distribution::Normal(0.0, 1.0);
        match transposed {
            true => Tensor::<2>::random([cols, rows], normal, (&device, DType::BF16)).transpose(),
            false => Tensor::<2>::random([rows, cols], normal, (&device, DType::BF16)),
        }
    };
    for kernel in [Schedule::Persistent, Schedule::TilePerBlock] {
        for (m, k, n) in [
            (300, 136, 520),
            (129, 2056, 257),
            (64, 24, 40),
            (1000, 64, 777),
            (4100, 200, 2000),
        ] {
            for (lhs_t, rhs_t) in [(false, false), (true, false), (false, true), (true, true)] {
                let (lhs, rhs) = (operand(m, k, lhs_t), operand(k, n, rhs_t));
                let out = matmul(lhs.clone(), rhs.clone(), kernel).unwrap();
                let expected = lhs.cast(DType::F32).matmul(rhs.cast(DType::F32));
                // The output is rounded to bf16 (2⁻⁹ relative each): about 2e-3 in norm; a
                // wrong tile, layout or stage is of order 1.
                let error = relative_error(out, expected);
                assert!(
                    error < 1e-2,
                    "{kernel:?} {m}×{k}×{n} lhs_t {lhs_t} rhs_t {rhs_t}: relative error {error}"
                );
            }
        }
    }
    let f32_operand = Tensor::<2>::random([64, 64], Distribution::Normal(0.0, 1.0), (&device, DType::F32));
    let refused = matmul(f32_operand.clone(), f32_operand, Schedule::Persistent).unwrap_err();
    assert_eq!(
        refused,
        WgmmaError::DType(DType::F32, DType::F32),
        "f32 is refused, not miscomputed"
    );
}

/// A SwiGLU MLP's three products (`gated_mlp`: on CUDA the gate's and up projection's products
/// and the SwiGLU in one wgmma GEMM, the down projection's data gradient with the SwiGLU's
/// backward in another) against `(silu(x·w1) ∘ (x·w3)) · w2` in f32 by Burn's ops with
/// autodiff: the output and the gradients of the input and the three weights, on shapes that
/// fill no tile (n = 257 has unaligned rows: the weights are read K-major from copies, the
/// products' rows padded), the weights plain and as transposed views, more tiles than SMs (each
/// persistent block runs several, its pipeline's and its passes' barriers' parity running on),
/// and llama-1b's.
pub fn gated_gemm(h: &Harness) {
    let device = h.device(0).autodiff();
    let shapes = [(300, 136, 520), (129, 2056, 257), (4100, 200, 2000), (8192, 2048, 5632)];
    for (m, k, n) in shapes {
        for transposed in [false, true] {
            let normal = Distribution::Normal(0.0, 1.0);
            let x = Tensor::<2>::random([m, k], normal, (&device, DType::BF16)).require_grad();
            // Weights scaled as an initialization would (std 1/√fan-in): products of order 1.
            let weight = |rows: usize, cols: usize| {
                let w = match transposed {
                    true => Tensor::<2>::random([cols, rows], normal, (&device, DType::BF16)).transpose(),
                    false => Tensor::<2>::random([rows, cols], normal, (&device, DType::BF16)),
                };
                (w / (rows as f64).sqrt()).detach().require_grad()
            };
            let (w1, w3, w2) = (weight(k, n), weight(k, n), weight(n, k));
            let out = gated_mlp(x.clone(), x.clone(), w1.clone(), w3.clone(), w2.clone(), Gemm::Wgmma);
            let [x32, w1_32, w3_32, w2_32] = [&x, &w1, &w3, &w2].map(f32_leaf);
            let hidden = silu(x32.clone().matmul(w1_32.clone())) * x32.clone().matmul(w3_32.clone());
            let expected = hidden.matmul(w2_32.clone());
            let case = format!("{m}×{k}×{n} transposed {transposed}");
            // Both products, the SwiGLU and the output rounded to bf16 (2⁻⁹ relative each): a
            // few 1e-3 in norm. A wrong tile, half of B or epilogue register is of order 1.
            let error = relative_error(out.clone(), expected.clone());
            assert!(error < 1e-2, "{case}: output relative error {error}");
            let weights = Tensor::<2>::random([m, k], normal, (&device, DType::F32));
            let grads = (out.cast(DType::F32) * weights.clone()).sum().backward();
            let expected_grads = (expected * weights).sum().backward();
            let pairs = [
                ("x", &x, &x32),
                ("w1", &w1, &w1_32),
                ("w3", &w3, &w3_32),
                ("w2", &w2, &w2_32),
            ];
            for (name, ours, theirs) in pairs {
                let (g, e) = (ours.grad(&grads).unwrap(), theirs.grad(&expected_grads).unwrap());
                // The SwiGLU's output gradient and its input gradients also round to bf16
                // before their products: 2e-2. A wrong pass, box or derivative is of order 1.
                let error = relative_error(g, e);
                assert!(error < 2e-2, "{case}: d{name} relative error {error}");
            }
        }
    }
}

/// Flash attention (bf16, head dim 128, the layer's `[b, s, h, d]` storage seen as
/// `[b, h, s, d]`) against Burn's attention in f32 differentiated by autodiff: outputs and the
/// gradients of q, k and v, with and without the causal mask, on lengths that fill no tile; and
/// the same with RoPE on q and k inside the op (`rotary_attention`, whose backward unrotates dQ
/// and dK as the kernels write them) against RoPE in f32 tensor ops before Burn's attention. A
/// head dim of 64 runs on the same kernels zero-padded to 128 and must match too.
pub fn flash_attention(h: &Harness) {
    let device = h.device(0).autodiff();
    // (16, 6, 257): 96 heads (batch entries × heads) of 3 blocks, where the kernels take 85
    // heads at a time (256 blocks' worth), so the heaviest-first order runs a whole group and a
    // partial one.
    let shapes = [
        (2, 3, 100, 128),
        (1, 2, 257, 128),
        (2, 2, 256, 128),
        (1, 2, 70, 64),
        (16, 6, 257, 128),
    ];
    for (b, heads, s, d) in shapes {
        // Tables three positions longer than the sequence: the kernels index them by position.
        let angles = Tensor::<2>::random([s + 3, d / 2], Distribution::Uniform(0.0, 6.0), (&device, DType::F32));
        let (cos, sin) = (angles.clone().cos(), angles.sin());
        for (causal, rotary) in [(false, false), (true, false), (false, true), (true, true)] {
            let input = || {
                Tensor::<4>::random([b, s, heads, d], Distribution::Normal(0.0, 1.0), (&device, DType::BF16))
                    .swap_dims(1, 2)
                    .detach()
                    .require_grad()
            };
            let (q, k, v) = (input(), input(), input());
            let out = match rotary {
                true => rotary_attention(q.clone(), k.clone(), v.clone(), cos.clone(), sin.clone(), causal, None),
                false => attention(q.clone(), k.clone(), v.clone(), causal),
            };
            let f32 = |t: &Tensor<4>| t.clone().cast(DType::F32).detach().require_grad();
            let (q32, k32, v32) = (f32(&q), f32(&k), f32(&v));
            // RoPE in f32 tensor ops, differentiated by autodiff with the attention.
            let rotate = |x: &Tensor<4>| match rotary {
                true => rope_reference(x.clone(), cos.clone(), sin.clone(), false),
                false => x.clone(),
            };
            let options = AttentionModuleOptions {
                scale: None,
                softcap: None,
                is_causal: causal,
            };
            let expected = burn_attention(rotate(&q32), rotate(&k32), v32.clone(), None, None, options);
            let case = format!("b {b} h {heads} s {s} d {d} causal {causal} rotary {rotary}");
            // bf16 inputs in both; ours rounds the probabilities and the output to bf16 (2⁻⁸
            // relative each), and rotated q and k to bf16: a few 1e-3 in norm. A wrong tile,
            // mask, layout or rotation is of order 1.
            let error = relative_error(out.clone(), expected.clone());
            assert!(error < 2e-2, "{case}: output relative error {error}");
            // The gradients also round dS and dP to bf16 before their products: 4e-2.
            assert_grads_close(&case, out, expected, [(&q, &q32), (&k, &k32), (&v, &v32)], 4e-2);
        }
    }
}

/// The gradients of q, k and v (`leaves`, ours beside the reference's) through `out` and
/// `expected` (`[b, h, s, d]`) weighted alike by random weights: each within `tolerance` in
/// relative norm.
pub(super) fn assert_grads_close(
    case: &str,
    out: Tensor<4>,
    expected: Tensor<4>,
    leaves: [(&Tensor<4>, &Tensor<4>); 3],
    tolerance: f32,
) {
    let weights = Tensor::<4>::random(
        expected.dims(),
        Distribution::Normal(0.0, 1.0),
        (&expected.device(), DType::F32),
    );
    let grads = (out.cast(DType::F32) * weights.clone()).sum().backward();
    let expected_grads = (expected * weights).sum().backward();
    for (name, (ours, theirs)) in ["q", "k", "v"].into_iter().zip(leaves) {
        let (g, e) = (ours.grad(&grads).unwrap(), theirs.grad(&expected_grads).unwrap());
        let error = relative_error(g, e);
        assert!(error < tolerance, "{case}: d{name} relative error {error}");
    }
}

/// `t` as f32, detached and tracked again: the reference's own leaf.
fn f32_leaf<const D: usize>(t: &Tensor<D>) -> Tensor<D> {
    t.clone().cast(DType::F32).detach().require_grad()
}

/// What a dtype's result may differ from the f32 reference by, in norm: f32 kernels differ in
/// summation order and `exp`/`sqrt` rounding (ulps); bf16 outputs and gradients are rounded to
/// 8 bits of mantissa (2⁻⁹ relative each).
pub(super) fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => 1e-2,
        _ => 1e-4,
    }
}

/// Fused SwiGLU against `silu(a) ∘ b` in f32 with autodiff: values and both gradients, in f32
/// and bf16, with a row length that takes vectors of 8 and one that does not.
pub fn swiglu(h: &Harness) {
    let device = h.device(0).autodiff();
    for dtype in [DType::F32, DType::BF16] {
        for dims in [[2, 37, 2048], [3, 5, 100]] {
            // Drawn then cast on the autodiff device: detach, so the leaf is the cast tensor.
            let input = || {
                Tensor::<3>::random(dims, Distribution::Normal(0.0, 2.0), (&device, dtype))
                    .detach()
                    .require_grad()
            };
            let (a, b) = (input(), input());
            let ours = burn_megatron_kernels::swiglu::swiglu(a.clone(), b.clone());
            let (a32, b32) = (f32_leaf(&a), f32_leaf(&b));
            let theirs = burn::tensor::activation::silu(a32.clone()) * b32.clone();
            let case = format!("{dtype:?} {dims:?}");
            let error = relative_error(ours.clone(), theirs.clone());
            assert!(error < tolerance(dtype), "{case}: output relative error {error}");
            let weights = Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), (&device, DType::F32));
            let (g1, g2) = (
                (ours.cast(DType::F32) * weights.clone()).sum().backward(),
                (theirs * weights).sum().backward(),
            );
            for (name, x, x32) in [("a", &a, &a32), ("b", &b, &b32)] {
                let error = relative_error(x.grad(&g1).unwrap(), x32.grad(&g2).unwrap());
                assert!(error < tolerance(dtype), "{case}: d{name} relative error {error}");
            }
        }
    }
}

/// Fused RMSNorm against the formula in f32 with autodiff: values and the gradients of the input
/// and the weight, in f32 and bf16, on rows that take vectors of 8 and rows that do not, rows a
/// backward thread holds one and two vectors of, a row count no multiple of the backward's 16
/// rows a block, rows enough (4 200) that the weight gradient's column sum takes two sweeps of
/// loads a lane, and a row too wide for the backward kernel (the tensor ops take it). Linked to a
/// residual add and read by three readers (`h = x + y/2 + y/4 + y`, the readers through
/// `fan_out`), the backward's `dx` with the stream's and two readers' gradients added in the
/// kernel against the same formula's.
pub fn rms_norm(h: &Harness) {
    use burn_megatron_kernels::quant::notes::NoteAmaxes;
    use burn_megatron_kernels::rms_norm::rms_norm_linked;
    use burn_megatron_kernels::rms_norm::{fan_out, link::NormLink, residual_add};
    let device = h.device(0).autodiff();
    for dtype in [DType::F32, DType::BF16] {
        for dims in [
            [2, 37, 2048],
            [3, 100, 100],
            [2, 19, 4096],
            [2, 2100, 256],
            [1, 3, 8200],
        ] {
            let x = Tensor::<3>::random(dims, Distribution::Normal(0.0, 2.0), (&device, dtype))
                .detach()
                .require_grad();
            let w = Tensor::<1>::random([dims[2]], Distribution::Normal(1.0, 0.5), (&device, dtype))
                .detach()
                .require_grad();
            let ours = burn_megatron_kernels::rms_norm::rms_norm(x.clone(), w.clone(), 1e-5);
            let (x32, w32) = (f32_leaf(&x), f32_leaf(&w));
            let theirs =
                x32.clone() / x32.clone().square().mean_dim(2).add_scalar(1e-5).sqrt() * w32.clone().unsqueeze::<3>();
            let case = format!("{dtype:?} {dims:?}");
            let error = relative_error(ours.clone(), theirs.clone());
            assert!(error < tolerance(dtype), "{case}: output relative error {error}");
            let weights = Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), (&device, DType::F32));
            let (g1, g2) = (
                (ours.cast(DType::F32) * weights.clone()).sum().backward(),
                (theirs * weights).sum().backward(),
            );
            let error = relative_error(x.grad(&g1).unwrap(), x32.grad(&g2).unwrap());
            assert!(error < tolerance(dtype), "{case}: dx relative error {error}");
            // dw sums 3 to 4 200 rows of bf16 products: a little more rounding than the rest.
            let error = relative_error(w.grad(&g1).unwrap(), w32.grad(&g2).unwrap());
            assert!(error < 2.0 * tolerance(dtype), "{case}: dw relative error {error}");
            // The residual stream: `h = x + (y/2 + y/4 + y)`, x's gradient from all four.
            let link = NormLink::default();
            let y = rms_norm_linked(x.clone(), w.clone(), 1e-5, NoteAmaxes::default(), &link);
            let [a, b, c]: [Tensor<3>; 3] = fan_out(y, 3, Some(&link)).try_into().expect("three readers");
            let ours = residual_add(x.clone(), a.mul_scalar(0.5) + b.mul_scalar(0.25) + c, &link);
            let y32 =
                x32.clone() / x32.clone().square().mean_dim(2).add_scalar(1e-5).sqrt() * w32.clone().unsqueeze::<3>();
            let theirs = x32.clone() + y32.mul_scalar(1.75);
            let weights = Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), (&device, DType::F32));
            let (g1, g2) = (
                (ours.cast(DType::F32) * weights.clone()).sum().backward(),
                (theirs * weights).sum().backward(),
            );
            let error = relative_error(x.grad(&g1).unwrap(), x32.grad(&g2).unwrap());
            assert!(error < tolerance(dtype), "{case}: linked dx relative error {error}");
        }
    }
}

/// Fused RoPE on the attention layer's `[b, s, h, d]`-storage views against the rotation in
/// tensor ops (f32, autodiff): values and the input gradient, for head dims that take vectors of
/// 8 and one that takes none.
pub fn rope(h: &Harness) {
    let device = h.device(0).autodiff();
    for dtype in [DType::F32, DType::BF16] {
        // A projection's heads (`[b, s, h, d]` memory seen as `[b, h, s, d]`: the output keeps
        // that layout), and a window of positions of them (not dense: the output is compact, as
        // under context parallelism's chunks).
        for ((b, heads, s, d), window) in [((2, 3, 50, 128), false), ((1, 2, 9, 6), false), ((2, 3, 50, 128), true)] {
            let extra = if window { 4 } else { 0 };
            let x = Tensor::<4>::random(
                [b, s + extra, heads, d],
                Distribution::Normal(0.0, 1.0),
                (&device, dtype),
            )
            .swap_dims(1, 2)
            .narrow(2, extra / 2, s)
            .detach()
            .require_grad();
            let angles = Tensor::<2>::random([s + 3, d / 2], Distribution::Uniform(0.0, 6.0), (&device, DType::F32));
            let (cos, sin) = (angles.clone().cos(), angles.sin());
            let ours = burn_megatron_kernels::rope::rope(x.clone(), cos.clone(), sin.clone());
            let x32 = f32_leaf(&x);
            let theirs = burn_megatron_kernels::rope::reference::rope(x32.clone(), cos, sin, false);
            let case = format!("{dtype:?} b {b} h {heads} s {s} d {d} window {window}");
            let error = relative_error(ours.clone(), theirs.clone());
            assert!(error < tolerance(dtype), "{case}: output relative error {error}");
            let weights = Tensor::<4>::random([b, heads, s, d], Distribution::Normal(0.0, 1.0), (&device, DType::F32));
            let (g1, g2) = (
                (ours.cast(DType::F32) * weights.clone()).sum().backward(),
                (theirs * weights).sum().backward(),
            );
            let error = relative_error(x.grad(&g1).unwrap(), x32.grad(&g2).unwrap());
            assert!(error < tolerance(dtype), "{case}: dx relative error {error}");
        }
    }
}

/// f32 products stay f32 on CUDA ([`burn_megatron_kernels::gemm::f32_matmul`]), plain, batched and
/// through transposed views, against the CPU's f32 product of the same operands. TF32 rounds
/// operands to a 10-bit mantissa (about 1e-3 relative off on these shapes); f32 sums of up to
/// 1000 products in another order are within 1e-5.
pub fn f32_matmul(h: &Harness) {
    use burn::tensor::Device;
    use burn_megatron_kernels::gemm::f32_matmul::matmul;
    use burn_megatron_kernels::{Gemm, gemm};
    let device = h.device(0);
    let cpu = Device::flex();
    let normal = Distribution::Normal(0.0, 1.0);
    for (m, k, n) in [(256, 256, 256), (77, 1000, 130)] {
        let lhs = Tensor::<2>::random([m, k], normal, (&device, DType::F32));
        let rhs = Tensor::<2>::random([n, k], normal, (&device, DType::F32)).transpose();
        let expected = lhs.clone().to_device(&cpu).matmul(rhs.clone().to_device(&cpu));
        for (what, out) in [
            ("f32_matmul", matmul(lhs.clone(), rhs.clone())),
            ("gemm Burn", gemm(lhs.clone(), rhs.clone(), Gemm::Burn)),
            ("gemm Wgmma", gemm(lhs.clone(), rhs.clone(), Gemm::Wgmma)),
        ] {
            let error = relative_error(out.to_device(&cpu), expected.clone());
            assert!(error < 1e-5, "{what} {m}×{k}×{n}: relative error {error}");
        }
    }
    let q = Tensor::<4>::random([2, 3, 100, 64], normal, (&device, DType::F32));
    let k = Tensor::<4>::random([2, 3, 100, 64], normal, (&device, DType::F32));
    let expected = q
        .clone()
        .to_device(&cpu)
        .matmul(k.clone().to_device(&cpu).swap_dims(2, 3));
    let error = relative_error(matmul(q, k.swap_dims(2, 3)).to_device(&cpu), expected);
    assert!(error < 1e-5, "batched q·kᵀ: relative error {error}");
}

/// The cross-entropy's one pass over the logits (`burn_megatron_kernels::cross_entropy`) against
/// its tensor-op twin on the same f32 values, with autodiff: the rows' max exactly (a maximum
/// rounds nothing, a larger value in the padded columns left out), the sums, and the logits'
/// gradient, in f32 and bf16, on rows that take vectors of 8 with padded columns (2000 of 2048
/// real: the last vectors part real, part padding) and rows that do not (100), targets in other
/// slices.
pub fn cross_entropy(h: &Harness) {
    use burn::tensor::TensorData;
    use burn_megatron_kernels::cross_entropy::{partials, reference};
    let device = h.device(0).autodiff();
    for dtype in [DType::F32, DType::BF16] {
        for (rows, columns, valid) in [(37, 2048, 2000), (9, 100, 100)] {
            let logits = Tensor::<2>::random([rows, columns], Distribution::Normal(0.0, 3.0), (&device, dtype))
                .detach()
                .require_grad();
            // Every third row's target lies in another slice (-1).
            let targets: Vec<f32> = (0..rows)
                .map(|r| if r % 3 == 0 { -1.0 } else { ((r * 37) % valid) as f32 })
                .collect();
            let target = Tensor::<1>::from_data(TensorData::new(targets, [rows]), (&device, DType::F32));
            let mut cases = vec![("logits", logits.clone().detach())];
            if valid < columns {
                let peak = Tensor::full([1, columns - valid], 1e4, (&device, dtype));
                let x = logits.clone().detach().slice_assign([0..1, valid..columns], peak);
                cases.push(("a peak in the padding", x));
            }
            for (what, x) in cases {
                let expected = x
                    .clone()
                    .cast(DType::F32)
                    .narrow(1, 0, valid)
                    .max_dim(1)
                    .reshape([rows]);
                let got = partials(x, target.clone(), valid).narrow(1, 0, 1).reshape([rows]);
                assert_eq!(
                    got.into_data().try_to_vec::<f32>().unwrap(),
                    expected.into_data().try_to_vec::<f32>().unwrap(),
                    "{dtype:?} {rows}×{columns} valid {valid}, {what}: rows' max"
                );
            }
            let ours = partials(logits.clone(), target.clone(), valid);
            let logits32 = f32_leaf(&logits);
            let theirs = reference::partials(logits32.clone(), target, valid);
            let case = format!("{dtype:?} {rows}×{columns} valid {valid}");
            // Sums of up to 2048 f32 terms read from the same values, in another order, each
            // exponential from `ex2.approx` (2 ulp) against `exp`: ulps of the sums.
            let error = relative_error(ours.clone(), theirs.clone());
            assert!(error < 1e-4, "{case}: max and sums relative error {error}");
            let weights = Tensor::<2>::random([rows, 4], Distribution::Normal(0.0, 1.0), (&device, DType::F32));
            let (g1, g2) = (
                (ours * weights.clone()).sum().backward(),
                (theirs * weights).sum().backward(),
            );
            let error = relative_error(logits.grad(&g1).unwrap(), logits32.grad(&g2).unwrap());
            assert!(
                error < tolerance(dtype),
                "{case}: logits gradient relative error {error}"
            );
        }
    }
}

/// The grouped product (bf16, autodiff) against one f32 product a group on the CPU: output,
/// rows' gradient and weights' gradient, on uneven counts (one empty, none a whole number of
/// 128-row tiles: padded by row gathers first), on starts on the device (whole tiles, an empty
/// group, rows past the last group's, which come out zero), and on a shape the kernel leaves
/// to one product a group (k no multiple of 64).
pub fn grouped_gemm(h: &Harness) {
    use burn::tensor::{Device, Int, TensorData};
    use burn_megatron_kernels::grouped_gemm::{Groups, grouped_matmul};
    let device = h.device(0).autodiff();
    let cpu = Device::flex().autodiff();
    let on = |starts: &[i64], d: &Device| {
        Groups::Starts(Box::new(Tensor::<1, Int>::from_data(
            TensorData::new(starts.to_vec(), [starts.len()]),
            d,
        )))
    };
    let counted = |c: &[usize]| {
        (
            Groups::Counts(c.to_vec()),
            Groups::Counts(c.to_vec()),
            c.iter().sum(),
            c.len(),
        )
    };
    let started = (
        on(&[0, 256, 256, 640, 768], &device),
        on(&[0, 256, 256, 640, 768], &cpu),
        900,
        4,
    );
    let cases = [
        (counted(&[130, 0, 257, 64]), 256, 384),
        (counted(&[128, 256, 0, 1]), 128, 520),
        (started, 256, 384),
        (counted(&[5, 70, 33]), 72, 40),
    ];
    for ((groups, cpu_groups, r, e), k, n) in cases {
        let normal = Distribution::Normal(0.0, 1.0);
        let x = Tensor::<2>::random([r, k], normal, (&device, DType::BF16));
        let w = Tensor::<3>::random([e, k, n], normal, (&device, DType::BF16)).mul_scalar(0.1);
        let dy = Tensor::<2>::random([r, n], normal, (&device, DType::BF16));
        let run = |x: Tensor<2>, w: Tensor<3>, dy: Tensor<2>, groups: &Groups| {
            let (x, w) = (x.require_grad(), w.require_grad());
            let y = grouped_matmul(x.clone(), w.clone(), groups);
            let grads = (y.clone() * dy).sum().backward();
            (y.detach(), x.grad(&grads).unwrap(), w.grad(&grads).unwrap())
        };
        let (y, dx, dw) = run(x.clone(), w.clone(), dy.clone(), &groups);
        let f32_cpu = |t: &Tensor<2>| t.clone().detach().cast(DType::F32).to_device(&cpu);
        let w32 = w.clone().detach().cast(DType::F32).to_device(&cpu);
        let (ry, rdx, rdw) = run(f32_cpu(&x), w32, f32_cpu(&dy), &cpu_groups);
        let back = |t: Tensor<2>| t.cast(DType::F32).to_device(&Device::flex());
        let flat = |t: Tensor<3>| back(t.reshape([e * k, n]));
        let case = format!("{groups:?} k {k} n {n}");
        // bf16 results (2⁻⁹ relative each) of f32 sums: about 2e-3 in norm; a wrong tile, group
        // or offset is of order 1.
        for (what, ours, theirs) in [
            ("output", back(y.clone()), back(ry)),
            ("rows' gradient", back(dx), back(rdx)),
            ("weights' gradient", flat(dw), flat(rdw)),
        ] {
            let error = relative_error(ours, theirs);
            assert!(error < 1e-2, "{case} {what}: relative error {error}");
        }
        if let Groups::Starts(_) = groups {
            // Exactly zero past the groups (the tiles there store zeros), whatever the memory held.
            let past = y.narrow(0, 768, r - 768).abs().max().into_scalar::<f32>();
            assert_eq!(past, 0.0, "{case}: the rows past the groups");
        }
    }
}
