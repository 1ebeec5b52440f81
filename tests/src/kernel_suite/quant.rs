//! The FP8 kernels (1×128 tiles, the FP8 wgmma GEMM) and every recipe's quantized product on
//! CUDA against their references.

use burn::tensor::{DType, Distribution, Tensor};

use super::relative_error;
use crate::Harness;

/// FP8 in 1×128 tiles on CUDA against the host reference, bit for bit (codes and scales): E4M3
/// and E5M2, bf16 and f32 inputs, a ragged last tile, an all-zero tile, a tile with a NaN, one
/// with an infinity (its scale 1, its values saturated), and values far below the scaled
/// format's smallest subnormal.
pub fn fp8_tiles(h: &Harness) {
    use burn::tensor::{Device, TensorData};
    use burn_megatron_kernels::quant::format::Minifloat;
    use burn_megatron_kernels::quant::scaling::{Scaling, quantize};
    use burn_megatron_kernels::quant::tiles::quantize_tiles;
    let device = h.device(0);
    let (r, c) = (37, 300);
    let mut values: Vec<f32> =
        Tensor::<2>::random([r, c], Distribution::Normal(0.0, 3.0), (&Device::flex(), DType::F32))
            .into_data()
            .try_to_vec()
            .expect("f32");
    values[..128].fill(0.0); // row 0, tile 0
    values[c + 5] = f32::NAN; // row 1, tile 0
    values[2 * c + 130] = f32::INFINITY; // row 2, tile 1
    values[3 * c + 7] = 1e-30; // row 3: far below the smallest code
    values[3 * c + 8] = 1e4;
    for format in [Minifloat::E4M3, Minifloat::E5M2] {
        for dtype in [DType::BF16, DType::F32] {
            let x = Tensor::<2>::from_data(TensorData::new(values.clone(), [r, c]), (&device, DType::F32)).cast(dtype);
            let exact: Vec<f32> = x.clone().cast(DType::F32).into_data().try_to_vec().expect("f32");
            let q = quantize(&exact, [r, c], format, Scaling::Blocks { rows: 1, cols: 128 }, None);
            let (codes, scales) = quantize_tiles(x, format);
            let case = format!("{format:?} from {dtype:?}");
            assert_eq!(scales.dims(), [r, 3], "{case}: scales' shape");
            let codes: Vec<u8> = codes.into_data().try_to_vec().expect("u8 codes");
            let scales: Vec<f32> = scales.into_data().try_to_vec().expect("f32 scales");
            let differ = codes.iter().zip(&q.codes).filter(|(a, b)| a != b).count();
            let first = codes.iter().zip(&q.codes).position(|(a, b)| a != b);
            assert_eq!(differ, 0, "{case}: {differ} codes differ, the first at {first:?}");
            assert_eq!(scales, q.scales, "{case}: scales");
        }
    }
}

/// The FP8 wgmma GEMM, with fast and with promoted accumulation, against the CPU's f32 product
/// of the dequantized operands: E4M3 · E4M3 and E4M3 · E5M2, tensorwise scales from each
/// operand's amax, on shapes that fill no tile (m and n ragged for 128 × 256 blocks, k a
/// multiple of 16 but not of the 128-deep slice, a k shorter than one slice) and one with more
/// tiles than SMs. Then a long k of positive values, where the sum grows far past each step's
/// addends: `wgmma`'s own accumulator drops their low bits at every step, the promoted kernel
/// only within a 128-deep slice.
pub fn fp8_gemm(h: &Harness) {
    use burn_megatron_kernels::cuda::wgmma::Accumulation;
    use burn_megatron_kernels::quant::format::Minifloat;
    let pairs = [(Minifloat::E4M3, Minifloat::E4M3), (Minifloat::E4M3, Minifloat::E5M2)];
    for accumulation in [Accumulation::Fast, Accumulation::Promoted] {
        for formats in pairs {
            for shape in [(300, 256, 520), (129, 2064, 257), (64, 32, 40), (4100, 256, 2000)] {
                let error = fp8_gemm_error(h, formats, shape, accumulation, Distribution::Normal(0.0, 1.0));
                // Products of FP8 values are exact in f32 and their sums reorder within ulps;
                // the output is rounded to bf16 (2⁻⁹ relative each): about 2e-3 in norm. A
                // wrong tile, half, scale or layout is of order 1.
                assert!(
                    error < 1e-2,
                    "{accumulation:?} {formats:?} {shape:?}: relative error {error}"
                );
            }
        }
    }
    let long = |accumulation| {
        let uniform = Distribution::Uniform(0.0, 1.0);
        fp8_gemm_error(h, pairs[0], (256, 16384, 256), accumulation, uniform)
    };
    let (fast, promoted) = (long(Accumulation::Fast), long(Accumulation::Promoted));
    println!("fp8_gemm: k = 16384 of positive values, relative error fast {fast:.2e}, promoted {promoted:.2e}");
    // Promoted, each 128-deep slice's partial sum (about 32) loses its low bits against itself
    // only, and what remains is the bf16 output's rounding (2⁻⁹ at most, about 1.1e-3 in norm).
    // Fast, the same bits go against a sum of up to 4096: dozens of times more.
    assert!(promoted < 2.5e-3, "promoted accumulation: relative error {promoted}");
    assert!(promoted < fast, "promoted {promoted} is no closer than fast {fast}");
}

/// The relative error of one FP8 product on CUDA against the CPU's f32 product of the same
/// dequantized operands, drawn from `distribution`.
fn fp8_gemm_error(
    h: &Harness,
    formats: (
        burn_megatron_kernels::quant::format::Minifloat,
        burn_megatron_kernels::quant::format::Minifloat,
    ),
    (m, k, n): (usize, usize, usize),
    accumulation: burn_megatron_kernels::cuda::wgmma::Accumulation,
    distribution: Distribution,
) -> f32 {
    use burn::tensor::{Device, Int, TensorData};
    use burn_megatron_kernels::cuda::wgmma::{Schedule, fp8_matmul};
    use burn_megatron_kernels::quant::format::Minifloat;
    use burn_megatron_kernels::quant::scaling::{Scaling, amax, quantize, quantize_scale};
    let device = h.device(0);
    let cpu = Device::flex();
    let host = |rows: usize| -> Vec<f32> {
        Tensor::<2>::random([rows, k], distribution, (&cpu, DType::F32))
            .into_data()
            .try_to_vec()
            .expect("f32")
    };
    let quantized = |x: &[f32], rows: usize, format: Minifloat| {
        let scale = quantize_scale(format, amax(x), 0);
        let q = quantize(x, [rows, k], format, Scaling::Tensor { quantize_scale: scale }, None);
        let codes = Tensor::<2, Int>::from_data(TensorData::new(q.codes.clone(), [rows, k]), (&device, DType::U8));
        let values = Tensor::<2>::from_data(TensorData::new(q.dequantize(), [rows, k]), &cpu);
        (codes, values, q.scales[0])
    };
    let (a_codes, a_values, a_scale) = quantized(&host(m), m, formats.0);
    let (b_codes, b_values, b_scale) = quantized(&host(n), n, formats.1);
    let scale = |x: f32| Tensor::<1>::from_data(TensorData::new(vec![x], [1]), (&device, DType::F32));
    let scales = [scale(a_scale), scale(b_scale)];
    let out =
        fp8_matmul(a_codes, b_codes, formats, scales, Schedule::Persistent, accumulation).expect("an FP8 product");
    relative_error(out.to_device(&cpu), a_values.matmul(b_values.transpose()))
}

/// Current scaling's amax on CUDA (one launch, the blocks' maxima folded by atomics and written
/// by the last block) against the host's largest magnitude, exactly: one block, ~500, and blocks
/// that stride over two chunks each (a thousand chunks, more than the four blocks an SM), vectors
/// of 8 and single values, bf16 and f32, a NaN (ignored) and an infinity, an all-zero tensor.
/// The launches run back to back, a large amax before smaller ones, so an accumulator left
/// holding a value, or a ticket left counting, shows in the next.
pub fn fp8_amax(h: &Harness) {
    use burn::tensor::{Device, TensorData};
    use burn_megatron_kernels::quant::kernels::fp8::amax;
    let device = h.device(0);
    let cpu = Device::flex();
    for (i, (r, c)) in [(4100, 4104), (37, 13), (4100, 2056), (1, 8)].into_iter().enumerate() {
        let mut values: Vec<f32> = Tensor::<2>::random([r, c], Distribution::Normal(0.0, 1.0), (&cpu, DType::F32))
            .into_data()
            .try_to_vec()
            .expect("f32");
        if i == 0 {
            values[r * c - 1] = 1e6; // in the last block
        }
        for (case, planted) in [
            ("plain", None),
            ("a NaN", Some(f32::NAN)),
            ("an infinity", Some(f32::INFINITY)),
        ] {
            let mut values = values.clone();
            if let Some(v) = planted {
                values[(r * c) / 2] = v;
            }
            for dtype in [DType::BF16, DType::F32] {
                let x =
                    Tensor::<2>::from_data(TensorData::new(values.clone(), [r, c]), (&device, DType::F32)).cast(dtype);
                let held: Vec<f32> = x
                    .clone()
                    .cast(DType::F32)
                    .to_device(&cpu)
                    .into_data()
                    .try_to_vec()
                    .unwrap();
                let expected = held.iter().filter(|v| !v.is_nan()).fold(0.0f32, |m, v| m.max(v.abs()));
                let got = amax(x).to_device(&cpu).into_scalar::<f32>();
                assert_eq!(got, expected, "{r}×{c} {dtype:?} {case}");
            }
        }
    }
    let zeros = Tensor::<2>::zeros([300, 520], (&device, DType::BF16));
    assert_eq!(amax(zeros).to_device(&cpu).into_scalar::<f32>(), 0.0, "all zeros");
}

/// The kernels that note the amaxes of what they write (`NoteAmaxes`), against the amax pass
/// over the same tensors, exactly, in bf16 and f32: SwiGLU's output and both input gradients (a
/// tensor of many vectors a thread, one of vectors of 8 and one of single values), RMSNorm's
/// output (its rows' maxima) and, linked to a residual add, its input gradient (its blocks'
/// maxima), and RoPE's input gradient in the `[b, s, h, d]` memory of a
/// projection's heads (its blocks' maxima, the note on that memory as the product reads it),
/// flash attention's output as the output projection reads it (its warps' maxima). An
/// FP8 tensorwise product on a noted output takes the note and equals, bit for bit, the product
/// on an un-noted output of the same values; nothing is noted where nothing was asked.
pub fn amax_notes(h: &Harness) {
    use burn_megatron_kernels::attention::attention_noting;
    use burn_megatron_kernels::quant::kernels::fp8::amax;
    use burn_megatron_kernels::quant::notes::{AmaxNotes, NoteAmaxes};
    use burn_megatron_kernels::quant::product::product;
    use burn_megatron_kernels::quant::recipe::Recipe;
    use burn_megatron_kernels::rms_norm::{link::NormLink, residual_add};
    use burn_megatron_kernels::rms_norm::{rms_norm_linked, rms_norm_noting};
    use burn_megatron_kernels::rope::rope_noting;
    use burn_megatron_kernels::swiglu::{swiglu, swiglu_noting};
    let device = h.device(0).autodiff();
    let cpu = burn::tensor::Device::flex();
    let scalar = |t: Tensor<1>| t.to_device(&cpu).into_scalar::<f32>();
    let store = AmaxNotes::default();
    let notes = NoteAmaxes {
        output: Some(store.clone()),
        input_grads: Some(store.clone()),
    };
    let noted = |t: &Tensor<2>, case: &str| {
        let amax_noted = store.take(t).unwrap_or_else(|| panic!("{case}: an amax is noted"));
        assert_eq!(scalar(amax_noted), scalar(amax(t.clone().detach())), "{case}");
        assert!(store.take(t).is_none(), "{case}: a note is taken once");
    };
    for dtype in [DType::BF16, DType::F32] {
        let input = |dims: [usize; 3]| {
            Tensor::<3>::random(dims, Distribution::Normal(0.0, 2.0), (&device, dtype))
                .detach()
                .require_grad()
        };
        let flat = |t: Tensor<3>| {
            let [b, s, c] = t.dims();
            t.reshape([b * s, c])
        };
        for dims in [[2, 2048, 4104], [2, 37, 256], [3, 5, 101]] {
            let case = format!("SwiGLU {dtype:?} {dims:?}");
            let (a, b) = (input(dims), input(dims));
            let out = swiglu_noting(a.clone(), b.clone(), notes.clone());
            noted(&flat(out.clone()), &format!("{case}: output"));
            let weights = Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), (&device, dtype));
            let grads = (out * weights).sum().backward();
            for (name, x) in [("da", &a), ("db", &b)] {
                noted(&flat(x.grad(&grads).expect("a gradient")), &format!("{case}: {name}"));
            }
            let plain = swiglu(a.clone().detach(), b.clone().detach());
            assert!(store.take(&plain).is_none(), "{case}: nothing asked, nothing noted");
            if dims[2] % 16 == 0 {
                let w = Tensor::<2>::random([64, dims[2]], Distribution::Normal(0.0, 0.05), (&device, dtype));
                let recipe = Recipe::Fp8Tensorwise;
                let noted = flat(swiglu_noting(a.clone().detach(), b.clone().detach(), notes.clone()));
                let on_noted = product(
                    noted.clone(),
                    w.clone(),
                    recipe,
                    Some(std::sync::Arc::new(store.clone())),
                );
                assert!(store.take(&noted).is_none(), "{case}: the product took the note");
                let on_plain = product(flat(plain), w, recipe, None);
                on_noted.into_data().assert_eq(&on_plain.into_data(), true);
            }
        }
        for dims in [[2, 37, 2048], [3, 5, 100]] {
            let case = format!("RMSNorm {dtype:?} {dims:?}");
            let w = Tensor::<1>::random([dims[2]], Distribution::Normal(1.0, 0.5), (&device, dtype));
            noted(
                &flat(rms_norm_noting(input(dims), w.clone(), 1e-5, notes.clone())),
                &case,
            );
            // Linked to the residual add: the input gradient (the stream's added) noted too.
            let (x, link) = (input(dims), NormLink::default());
            let y = rms_norm_linked(x.clone(), w, 1e-5, notes.clone(), &link);
            noted(&flat(y.clone()), &case);
            let weights = Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), (&device, dtype));
            let grads = (residual_add(x.clone(), y, &link) * weights).sum().backward();
            noted(&flat(x.grad(&grads).expect("a gradient")), &format!("{case}: dx"));
        }
        let (b, s, heads, d) = (2, 100, 4, 64);
        let (cos, sin) = (
            Tensor::<2>::random([s, d / 2], Distribution::Normal(0.0, 1.0), (&device, DType::F32)),
            Tensor::<2>::random([s, d / 2], Distribution::Normal(0.0, 1.0), (&device, DType::F32)),
        );
        let x = Tensor::<4>::random([b, s, heads, d], Distribution::Normal(0.0, 2.0), (&device, dtype))
            .detach()
            .require_grad();
        // As in the attention layer: q's heads a `[b, h, s, d]` view of `[b, s, h, d]` memory,
        // and the gradient reaching RoPE in that memory too (as flash attention writes dQ).
        let rotated = rope_noting(x.clone().swap_dims(1, 2), cos, sin, notes.clone()).swap_dims(1, 2);
        let weights = Tensor::<4>::random([b, s, heads, d], Distribution::Normal(0.0, 1.0), (&device, dtype));
        let grads = (rotated * weights).sum().backward();
        let dx = x.grad(&grads).expect("a gradient").reshape([b * s, heads * d]);
        noted(&dx, &format!("RoPE {dtype:?}: the input gradient"));
    }
    // Flash attention's output (bf16, heads of 128), as the output projection reads it: its
    // `[b, s, h, d]` memory as `[b·s, h·d]` rows; a sequence that ends inside a block.
    for s in [200, 1024] {
        let (b, heads, d) = (2, 4, 128);
        let qkv = || Tensor::<4>::random([b, heads, s, d], Distribution::Normal(0.0, 1.0), (&device, DType::BF16));
        let (q, k, v) = (qkv(), qkv(), qkv());
        let rows = |t: Tensor<4>| t.swap_dims(1, 2).reshape([b * s, heads * d]);
        let out = attention_noting(q.clone(), k.clone(), v.clone(), true, Some(store.clone()));
        noted(&rows(out), &format!("attention s {s}: the output"));
        let plain = rows(attention_noting(q, k, v, true, None));
        assert!(
            store.take(&plain).is_none(),
            "attention s {s}: nothing asked, nothing noted"
        );
    }
}

/// Every recipe's linear product on CUDA against its CPU emulation on the same bf16 values,
/// forward and both gradients. FP8 tensorwise runs the FP8 kernels, which quantize to the host
/// reference's codes bit for bit; the other recipes quantize in tensor ops on the GPU, to the
/// same values as on the CPU (stochastic draws included: their seed is exact on both), and
/// multiply in bf16. So they differ by bf16 roundings (of the output, about 2e-3 in norm, and of
/// f32-scaled block values, 2⁻⁹ each) and the sums' order. The weight enters as a transposed
/// view (quantized and transposed in one pass); m and n ragged for the GEMM's tiles, then
/// multiples of 16, where FP8 tensorwise keeps its forward's codes for the gradients (filling
/// the transposing cast's tiles, then not).
pub fn quantized_linear(h: &Harness) {
    use burn_megatron_kernels::quant::{fake::draws, recipe::Recipe};
    // Stochastic rounding's draws: the CUDA kernel is the host hash, bit for bit.
    let cpu = burn::tensor::Device::flex();
    let host: Vec<f32> = draws([300, 520], 7, &cpu).into_data().try_to_vec().unwrap();
    let device: Vec<f32> = draws([300, 520], 7, &h.device(0))
        .to_device(&cpu)
        .into_data()
        .try_to_vec()
        .unwrap();
    let differ: Vec<(usize, f32, f32)> = (0..host.len())
        .filter(|&i| host[i] != device[i])
        .take(4)
        .map(|i| (i, host[i], device[i]))
        .collect();
    assert!(
        differ.is_empty(),
        "the draws differ between CUDA and the host (index, host, CUDA): {differ:?}"
    );
    for recipe in Recipe::ALL {
        quantized_linear_with(h, recipe);
    }
}

fn quantized_linear_with(h: &Harness, recipe: burn_megatron_kernels::quant::recipe::Recipe) {
    use burn::tensor::Device;
    use burn_megatron_kernels::quant::product::product;
    let run = |device: &Device, x: &Tensor<2>, w: &Tensor<2>, dy: &Tensor<2>| {
        let (x, w, dy) = (
            x.clone().to_device(device).autodiff().require_grad(),
            w.clone().to_device(device).autodiff().require_grad(),
            dy.clone().to_device(device).autodiff(),
        );
        let y = product(x.clone(), w.clone().transpose(), recipe, None);
        let grads = (y.clone().cast(DType::F32) * dy).sum().backward();
        let cpu = Device::flex();
        let back = |t: Tensor<2>| t.cast(DType::F32).to_device(&cpu);
        (
            back(y.detach()),
            back(x.grad(&grads).unwrap()),
            back(w.grad(&grads).unwrap()),
        )
    };
    let cpu = Device::flex();
    let normal = Distribution::Normal(0.0, 1.0);
    // Ragged tokens and outputs (FP8 tensorwise keeps the operands and quantizes them again in
    // backward), then multiples of 16 (it keeps the forward's FP8 codes of `xᵀ` and `w`; the
    // cast reads and writes vectors of 8), filling the cast's 64 × 64 tiles and not.
    for (tokens, outputs) in [(300, 520), (320, 512), (336, 528)] {
        let x = Tensor::<2>::random([tokens, 256], normal, (&cpu, DType::BF16));
        let w = Tensor::<2>::random([256, outputs], normal, (&cpu, DType::BF16));
        let dy = Tensor::<2>::random([tokens, outputs], normal, (&cpu, DType::F32));
        let ours = run(&h.device(0), &x, &w, &dy);
        let theirs = run(&cpu, &x, &w, &dy);
        for (what, a, b) in [
            ("y", ours.0, theirs.0),
            ("dx", ours.1, theirs.1),
            ("dw", ours.2, theirs.2),
        ] {
            let error = relative_error(a, b);
            assert!(
                error < 1e-2,
                "{recipe:?} {tokens}×{outputs} {what}: relative error {error} against the CPU emulation"
            );
        }
    }
}

/// Three FP8 tensorwise products of one input (q, k and v's) sharing its quantization
/// ([`SharedInput`]) against the same three quantizing it each: the first product keeps its codes
/// and the others reuse them, so the outputs, the input's gradient (the three dgrads summed) and
/// each weight's gradient are the same bit for bit. Under delayed scaling (three layers, each its
/// own history with equal input rows, empty or not) the same, and each layer records the same
/// amaxes as when it quantizes its input itself.
pub fn shared_input(h: &Harness) {
    use std::sync::Arc;

    use burn_megatron_kernels::quant::product::{Amax, AmaxGroup, Operand, ScaleAmax, SharedInput, product};
    use burn_megatron_kernels::quant::recipe::Recipe;

    #[derive(Debug)]
    struct Sharing(Arc<SharedInput>);
    impl AmaxGroup for Sharing {
        fn max(&self, amax: Tensor<1>, _: Operand) -> ScaleAmax {
            ScaleAmax::current(amax)
        }
        fn shared_input(&self) -> Option<&SharedInput> {
            Some(&self.0)
        }
    }
    let device = h.device(0).autodiff();
    let normal = Distribution::Normal(0.0, 1.0);
    let x = Tensor::<2>::random([320, 256], normal, (&device, DType::BF16));
    let weights: Vec<Tensor<2>> = [512, 128, 128]
        .map(|n| Tensor::<2>::random([256, n], normal, (&device, DType::BF16)))
        .to_vec();
    let dys: Vec<Tensor<2>> = [512, 128, 128]
        .map(|n| Tensor::<2>::random([320, n], normal, (&device, DType::F32)))
        .to_vec();
    let run = |recipe: Recipe, amax: &dyn Fn(usize) -> Amax| {
        let x = x.clone().detach().require_grad();
        let ws: Vec<Tensor<2>> = weights.iter().map(|w| w.clone().detach().require_grad()).collect();
        let ys: Vec<Tensor<2>> = ws
            .iter()
            .enumerate()
            .map(|(i, w)| product(x.clone(), w.clone().transpose(), recipe, amax(i)))
            .collect();
        let loss = ys
            .iter()
            .zip(&dys)
            .map(|(y, dy)| (y.clone().cast(DType::F32) * dy.clone()).sum())
            .reduce(|a, b| a + b)
            .expect("three products");
        let grads = loss.backward();
        let mut out: Vec<Tensor<2>> = ys.into_iter().map(|y| y.detach().cast(DType::F32)).collect();
        out.push(x.grad(&grads).expect("dx").cast(DType::F32));
        out.extend(ws.iter().map(|w| w.grad(&grads).expect("dw").cast(DType::F32)));
        out
    };
    let shared = Arc::new(SharedInput::default());
    let ours = run(Recipe::Fp8Tensorwise, &|_| {
        Some(Arc::new(Sharing(shared.clone())) as Arc<dyn AmaxGroup>)
    });
    assert!(shared.holds(), "the first product kept its quantization of the input");
    let theirs = run(Recipe::Fp8Tensorwise, &|_| None);
    let names = ["y_q", "y_k", "y_v", "dx", "dw_q", "dw_k", "dw_v"];
    let same = |ours: Vec<Tensor<2>>, theirs: Vec<Tensor<2>>, what: &str| {
        for ((name, a), b) in names.iter().zip(ours).zip(theirs) {
            let worst = (a - b).abs().max().into_scalar::<f32>();
            // The same codes multiplied in the same order: bit for bit.
            assert!(
                worst == 0.0,
                "{what} {name}: shared and unshared differ by up to {worst}"
            );
        }
    };
    same(ours, theirs, "tensorwise");

    use burn_megatron::precision::delayed::{AmaxRecorder, DelayedAmax, DelayedState};
    use burn_megatron_kernels::quant::recipe::AmaxAlgo;
    let recipe = Recipe::Fp8Delayed {
        history: 4,
        algo: AmaxAlgo::Max,
    };
    // Input rows equal over the layers (empty, then not); weight and gradient rows their own.
    for input_row in [[0.0f32; 4], [3.0, 0.5, 2.0, 0.0]] {
        let history = |layer: usize| {
            let mut rows = input_row.to_vec();
            rows.extend([1.0 + layer as f32, 0.0, 0.0, 0.0, 20.0, 10.0, 0.0, 0.0]);
            Tensor::<2>::from_data(burn::tensor::TensorData::new(rows, [3, 4]), &h.device(0))
        };
        let recorders: [Vec<AmaxRecorder>; 2] = [0, 1].map(|_| (0..3).map(|_| AmaxRecorder::default()).collect());
        let shared = Arc::new(SharedInput::default());
        let delayed = |sharing: bool| {
            let recorders = &recorders[sharing as usize];
            let shared = sharing.then(|| shared.clone());
            move |layer: usize| {
                Some(Arc::new(DelayedAmax {
                    state: DelayedState::new(history(layer), AmaxAlgo::Max, Some(recorders[layer].clone())),
                    tp: None,
                    input: shared.clone(),
                    notes: Default::default(),
                }) as Arc<dyn AmaxGroup>)
            }
        };
        let ours = run(recipe, &delayed(true));
        assert!(
            shared.holds(),
            "delayed scaling: the first product kept its quantization"
        );
        let theirs = run(recipe, &delayed(false));
        same(ours, theirs, &format!("delayed, input history {input_row:?}"));
        let take = |r: &AmaxRecorder| -> Vec<f32> {
            r.take(&h.device(0))
                .iter()
                .map(|t| t.clone().into_scalar::<f32>())
                .collect()
        };
        for (layer, (sharing, alone)) in recorders[1].iter().zip(&recorders[0]).enumerate() {
            let (a, b) = (take(sharing), take(alone));
            assert!(a[0] > 0.0, "layer {layer} recorded its input's amax");
            assert_eq!(a, b, "layer {layer}: recorded amaxes shared against unshared");
        }
    }
}

/// Three microbatches through one weight with a [`WeightCodes`] slot (gradient accumulation)
/// against the same without it, under FP8 tensorwise and blockwise: the first call keeps the
/// weight's codes and the others reuse them, so the outputs, each input's gradient and the
/// accumulated weight gradient are the same bit for bit; a new weight tensor (the optimizer's
/// step) is quantized afresh, not served the old codes; under delayed scaling nothing is kept.
pub fn weight_codes(h: &Harness) {
    use std::sync::Arc;

    use burn_megatron_kernels::quant::product::{Amax, AmaxGroup, Operand, ScaleAmax, WeightCodes, product};
    use burn_megatron_kernels::quant::recipe::{AmaxAlgo, Recipe};

    #[derive(Debug)]
    struct Keeping(Arc<WeightCodes>);
    impl AmaxGroup for Keeping {
        fn max(&self, amax: Tensor<1>, _: Operand) -> ScaleAmax {
            ScaleAmax::current(amax)
        }
        fn weight_codes(&self) -> Option<&WeightCodes> {
            Some(&self.0)
        }
    }

    let device = h.device(0).autodiff();
    let normal = Distribution::Normal(0.0, 1.0);
    let w = Tensor::<2>::random([256, 384], normal, (&device, DType::BF16));
    let xs: Vec<Tensor<2>> = (0..3)
        .map(|_| Tensor::<2>::random([256, 256], normal, (&device, DType::BF16)))
        .collect();
    let dys: Vec<Tensor<2>> = (0..3)
        .map(|_| Tensor::<2>::random([256, 384], normal, (&device, DType::F32)))
        .collect();
    for recipe in [Recipe::Fp8Tensorwise, Recipe::Fp8Blockwise] {
        let run = |w: &Tensor<2>, amax: &dyn Fn() -> Amax| {
            let w = w.clone().detach().require_grad();
            let xs: Vec<Tensor<2>> = xs.iter().map(|x| x.clone().detach().require_grad()).collect();
            let ys: Vec<Tensor<2>> = xs
                .iter()
                .map(|x| product(x.clone(), w.clone().transpose(), recipe, amax()))
                .collect();
            let loss = ys
                .iter()
                .zip(&dys)
                .map(|(y, dy)| (y.clone().cast(DType::F32) * dy.clone()).sum())
                .reduce(|a, b| a + b)
                .expect("three microbatches");
            let grads = loss.backward();
            let mut out: Vec<Tensor<2>> = ys.into_iter().map(|y| y.detach().cast(DType::F32)).collect();
            out.extend(xs.iter().map(|x| x.grad(&grads).expect("dx").cast(DType::F32)));
            out.push(w.grad(&grads).expect("dw").cast(DType::F32));
            out
        };
        let slot = Arc::new(WeightCodes::default());
        let keeping = || Some(Arc::new(Keeping(slot.clone())) as Arc<dyn AmaxGroup>);
        let ours = run(&w, &keeping);
        assert!(slot.holds(), "{recipe:?}: the first product kept the weight's codes");
        let theirs = run(&w, &|| None);
        let names = ["y1", "y2", "y3", "dx1", "dx2", "dx3", "dw"];
        for ((name, a), b) in names.iter().zip(ours).zip(theirs) {
            let worst = (a - b).abs().max().into_scalar::<f32>();
            // The same codes multiplied in the same order: bit for bit.
            assert!(
                worst == 0.0,
                "{recipe:?} {name}: kept and requantized differ by up to {worst}"
            );
        }
        // The slot still holds the old weight's codes; a new weight is quantized afresh.
        let stepped = w.clone() + 0.5;
        let ours = run(&stepped, &keeping);
        let theirs = run(&stepped, &|| None);
        let worst = (ours[0].clone() - theirs[0].clone()).abs().max().into_scalar::<f32>();
        assert!(
            worst == 0.0,
            "{recipe:?}: a new weight got other codes than its own (by up to {worst})"
        );
    }
    let delayed = Arc::new(WeightCodes::default());
    let _ = product(
        xs[0].clone().detach().require_grad(),
        w.clone().detach().require_grad().transpose(),
        Recipe::Fp8Delayed {
            history: 4,
            algo: AmaxAlgo::Max,
        },
        Some(Arc::new(Keeping(delayed.clone())) as Arc<dyn AmaxGroup>),
    );
    assert!(!delayed.holds(), "a delayed-scaling product kept its weight's codes");
}
