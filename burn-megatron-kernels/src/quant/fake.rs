//! Quantization emulated in tensor ops, on any backend: a 2-D operand quantized with a
//! [`Quantizer`] and dequantized again (f32), so a product of two such tensors is the product
//! of the quantized operands. Rounding to nearest matches the scalar reference
//! ([`super::scaling::quantize`]) bit for bit, scales and values; stochastic rounding takes its
//! draws from [`draws`] and adds them in f32 where the reference adds in f64 (a code differs
//! only where `scaled + draw` lies within f32 rounding of a whole step).
//!
//! The steps, all elementwise or per block:
//! - the block amax over a zero-padded `[R/br, br, C/bc, bc]` view (padding changes no amax);
//! - the scale and the factor each block's values are multiplied by, as the reference derives
//!   them (tensor, f32 block, E8M0 and NVFP4's two levels);
//! - the value rounded onto the format's grid: the binade's exponent from `log2` corrected by
//!   exact comparisons against powers of two, the step `2^(e − mantissa bits)`, a whole number
//!   of steps, saturated at the format's largest value.
//!
//! NaN inputs are outside this emulation (the reference keeps them as NaN codes).

use burn::tensor::{DType, Tensor, TensorData};

use super::format::Minifloat;
use super::recipe::{Blocks, Quantizer, Rounding};
use super::scaling::{MX_BLOCK, NV_BLOCK};
use crate::quant::tiles::TILE;

/// `x` quantized with `q` and dequantized: `[r, c]` → `[r, c]`, f32. `draws` are one uniform
/// draw in `[0, 1)` a value, used when `q` rounds stochastically; `reduce` takes the
/// tensor-level amax (`[1]`) over the ranks holding pieces of the tensor.
pub fn fake_quantize(
    x: Tensor<2>,
    q: Quantizer,
    draws: Option<Tensor<2>>,
    reduce: Option<&dyn Fn(Tensor<1>) -> Tensor<1>>,
) -> Tensor<2> {
    let x = x.cast(DType::F32);
    let [r, c] = x.dims();
    let [br, bc] = block(q.blocks, [r, c]);
    let [gr, gc] = [r.div_ceil(br), c.div_ceil(bc)];
    let padded = x.pad(
        [(0, gr * br - r), (0, gc * bc - c)],
        burn::tensor::ops::PadMode::Constant(0.0),
    );
    let blocked: Tensor<4> = padded.reshape([gr, br, gc, bc]);
    let amax = blocked.clone().abs().max_dim(3).max_dim(1);
    let (factor, scale) = scales(amax, q, reduce);
    let scaled = blocked * factor;
    let draws = match q.rounding {
        Rounding::Stochastic => Some(pad_draws(
            draws.expect("stochastic rounding takes draws"),
            [gr, br, gc, bc],
        )),
        Rounding::Nearest => None,
    };
    let values = round_to(q.format, scaled, draws) * scale;
    values.reshape([gr * br, gc * bc]).slice([0..r, 0..c])
}

/// The block of `blocks` on a `[r, c]` operand.
pub fn block(blocks: Blocks, [r, c]: [usize; 2]) -> [usize; 2] {
    match blocks {
        Blocks::Tensor => [r.max(1), c.max(1)],
        Blocks::Tiles => [1, TILE],
        Blocks::Squares => [TILE, TILE],
        Blocks::Mx => [1, MX_BLOCK],
        Blocks::Nv { rows } => [rows, NV_BLOCK],
    }
}

/// Per block (`[gr, 1, gc, 1]`): the factor values are multiplied by before rounding, and the
/// dequantization scale, from each block's `amax`; a tensor-level amax through `reduce`.
fn scales(amax: Tensor<4>, q: Quantizer, reduce: Option<&dyn Fn(Tensor<1>) -> Tensor<1>>) -> (Tensor<4>, Tensor<4>) {
    let max = q.format.max();
    let whole = |t: Tensor<4>| match reduce {
        Some(reduce) => reduce(t.reshape([1])).reshape([1, 1, 1, 1]),
        None => t,
    };
    let usable = amax.clone().is_finite().bool_and(amax.clone().greater_elem(0.0));
    match q.blocks {
        // Transformer Engine's current scaling: `max / amax`, 1 for a zero or non-finite amax.
        // 1 as well where `max / amax` overflows.
        Blocks::Tensor => {
            let amax = whole(amax);
            let factor = amax.full_like(max) / amax.clone();
            let usable = amax.is_finite().bool_and(factor.clone().is_finite());
            let factor = factor.mask_fill(usable.bool_not(), 1.0);
            (factor.clone(), factor.recip())
        }
        // DeepSeek-V3: `amax / max`, 1 for a zero or non-finite amax and where the scale falls
        // below f32's normal range (its inverse would overflow).
        Blocks::Tiles | Blocks::Squares => {
            let scale = amax.clone().div_scalar(max);
            let usable = amax
                .is_finite()
                .bool_and(scale.clone().greater_equal_elem(f32::MIN_POSITIVE));
            let scale = scale.mask_fill(usable.bool_not(), 1.0);
            (scale.clone().recip(), scale)
        }
        Blocks::Mx => {
            let scale = mx_scale(amax, max, usable);
            (scale.clone().recip(), scale)
        }
        Blocks::Nv { .. } => {
            // The whole tensor's amax, `[1, 1, 1, 1]`.
            let t = whole(amax.clone().max_dim(2).max_dim(0));
            // The tensor scale: E4M3's current scaling of the amax (as `Blocks::Tensor`), times
            // FP4's largest value.
            let encode = t.full_like(Minifloat::E4M3.max()) / t.clone();
            let t_usable = t.is_finite().bool_and(encode.clone().is_finite());
            let encode = encode.mask_fill(t_usable.bool_not(), 1.0).mul_scalar(max);
            // Each block's scale in those units, stored as E4M3.
            let stored = round_to(Minifloat::E4M3, amax.div_scalar(max) * encode.clone(), None);
            let empty = stored.clone().equal_elem(0.0);
            let factor = (encode.clone() / stored.clone()).mask_fill(empty.clone(), 0.0);
            let scale = (stored / encode).mask_fill(empty, 0.0);
            (factor, scale)
        }
    }
}

/// The smallest power of two `2^k` with `amax ≤ max · 2^k`, `k` in E8M0's `[−127, 127]`;
/// `2^−127` for a zero or non-finite amax.
fn mx_scale(amax: Tensor<4>, max: f32, usable: Tensor<4, burn::tensor::Bool>) -> Tensor<4> {
    let safe = amax.clone().mask_fill(usable.clone().bool_not(), max);
    let guess = (safe.clone().div_scalar(max).log() / std::f32::consts::LN_2).ceil();
    let two = |k: Tensor<4>| k.full_like(2.0).powf(k);
    // `log2` rounded onto a neighbouring integer: settle on the smallest `k` that fits.
    let k = guess.clone() + safe.clone().greater(two(guess.clone()).mul_scalar(max)).float();
    let k = k.clone() - safe.lower_equal(two(k.clone() - 1.0).mul_scalar(max)).float();
    let k = k.clamp(-127.0, 127.0).mask_fill(usable.bool_not(), -127.0);
    two(k)
}

/// `y` rounded onto `format`'s grid and saturated at its largest value; with `draws`,
/// stochastically.
pub fn round_to<const D: usize>(format: Minifloat, y: Tensor<D>, draws: Option<Tensor<D>>) -> Tensor<D> {
    let sign = y.clone().sign();
    let a = y.abs().clamp_max(format.max());
    let mantissa = format.mantissa_bits() as f32;
    // The smallest normal's exponent: below it the subnormal step holds.
    let min_exponent = (1 - format.bias()) as f32;
    let binade = a.clone().clamp_min(2f32.powf(min_exponent));
    let guess = (binade.clone().log() / std::f32::consts::LN_2).floor();
    let power = guess.clone().full_like(2.0).powf(guess);
    // `log2` may land one off either way near a power of two; exact comparisons settle it.
    let above = power.clone().greater(binade.clone());
    let power = power.clone().mask_where(above, power.div_scalar(2.0));
    let below = power.clone().mul_scalar(2.0).lower_equal(binade);
    let power = power.clone().mask_where(below, power.mul_scalar(2.0));
    let step = power.mul_scalar(2f32.powf(-mantissa));
    let steps = a / step.clone();
    let whole = match draws {
        None => steps.round(),
        Some(u) => (steps + u).floor(),
    };
    (whole * step).clamp_max(format.max()) * sign
}

/// `draws` laid out as the blocked view `[gr, br, gc, bc]` (the padding draws 0).
fn pad_draws(draws: Tensor<2>, [gr, br, gc, bc]: [usize; 4]) -> Tensor<4> {
    let [r, c] = draws.dims();
    draws
        .cast(DType::F32)
        .pad(
            [(0, gr * br - r), (0, gc * bc - c)],
            burn::tensor::ops::PadMode::Constant(0.0),
        )
        .reshape([gr, br, gc, bc])
}

/// One uniform draw in `[0, 1)` a value of a `[r, c]` tensor, from `seed`: a counter-based hash
/// of each value's index (`hash32(i ^ key)`, 24 bits a draw), the same on every device and
/// thread; on CUDA one kernel (`quant_kernels::fill_draws`), elsewhere on the host.
pub fn draws(shape: [usize; 2], seed: u64, device: &burn::tensor::Device) -> Tensor<2> {
    let key = mix(seed) as u32;
    // One dimension: a 2-D allocation on CUDA may pad its rows, and the kernel writes by index.
    #[cfg(feature = "cuda")]
    if let Ok(out) =
        Tensor::<1>::empty([shape[0] * shape[1]], (device, DType::F32)).try_into_primitive::<burn::backend::Cube>()
    {
        return Tensor::<1>::from_primitive::<burn::backend::Cube>(crate::quant::kernels::cast::fill_draws(out, key))
            .reshape(shape);
    }
    let values: Vec<f32> = (0..shape[0] * shape[1])
        .map(|i| (hash32(i as u32 ^ key) >> 8) as f32 * 2f32.powi(-24))
        .collect();
    Tensor::from_data(TensorData::new(values, shape), (device, DType::F32))
}

/// Chris Wellons's lowbias32: a 32-bit integer hash with full avalanche.
fn hash32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// SplitMix64's finalizer.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The random Hadamard transform along rows, in blocks of 16: `x · (D·H₁₆/4)` with `H₁₆`
/// Sylvester's Hadamard matrix and `D` a fixed diagonal of random signs; orthogonal, so two
/// operands transformed alike keep their product (`(A·M)(B·M)ᵀ = A·Bᵀ`). Columns are padded
/// with zeros to a multiple of 16. Computed in f32 as the fast transform, in a fixed order
/// the CUDA block kernel repeats (so both give the same bits): each value times its sign, the
/// butterflies `(a, b) → (a + b, a − b)` over strides 1, 2, 4, 8, then times ¼ (exact).
///
/// # Shapes
/// `[r, c]` → `[r, ⌈c/16⌉·16]`
pub fn hadamard(x: Tensor<2>) -> Tensor<2> {
    const N: usize = 16;
    let [r, c] = x.dims();
    let cols = c.div_ceil(N) * N;
    let rows = r * cols / N;
    let x = x
        .cast(DType::F32)
        .pad([(0, 0), (0, cols - c)], burn::tensor::ops::PadMode::Constant(0.0));
    let signs: Vec<f32> = (0..N)
        .map(|i| if hadamard_signs() >> i & 1 == 1 { -1.0 } else { 1.0 })
        .collect();
    let signs = Tensor::<2>::from_data(TensorData::new(signs, [1, N]), (&x.device(), DType::F32));
    let mut y = x.reshape([rows, N]) * signs;
    for h in [1, 2, 4, 8] {
        let pairs: Tensor<4> = y.reshape([rows, N / (2 * h), 2, h]);
        let a = pairs.clone().slice([0..rows, 0..N / (2 * h), 0..1, 0..h]);
        let b = pairs.slice([0..rows, 0..N / (2 * h), 1..2, 0..h]);
        y = Tensor::cat(vec![a.clone() + b.clone(), a - b], 2).reshape([rows, N]);
    }
    y.mul_scalar(0.25).reshape([r, cols])
}

/// `D`'s signs as a mask: bit `i` set where value `i` of a block is negated, drawn from a fixed
/// seed.
pub(crate) fn hadamard_signs() -> u32 {
    (0..16).fold(0, |mask, i| mask | ((mix(0x4844_4D52 ^ i as u64) & 1) as u32) << i)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Tensor, TensorData};

    use super::*;
    use crate::quant::scaling::{Scaling, amax, quantize, quantize_scale};

    /// Seeded values over many binades, with signs, zeros and the formats' edges mixed in; seed
    /// 0 adds a huge value, which sends the rest of a tensor-scaled operand below its format's
    /// smallest code.
    fn adversarial(n: usize, seed: u64) -> Vec<f32> {
        let all = [
            0.0,
            -0.0,
            448.0,
            -448.0,
            57344.0,
            6.0,
            1e-9,
            -1e-12,
            2f32.powi(-9),
            3.0e38,
        ];
        let edges = &all[..all.len() - (seed > 0) as usize];
        (0..n)
            .map(|i| match i % 23 {
                0 => edges[(i / 23) % edges.len()],
                _ => {
                    let u = (mix(seed ^ i as u64) >> 11) as f64 / (1u64 << 53) as f64;
                    let sign = if mix(seed + i as u64) & 1 == 0 { 1.0 } else { -1.0 };
                    (sign * 10f64.powf(8.0 * u - 4.0)) as f32
                }
            })
            .collect()
    }

    /// The reference's scaling for `q` on `x`.
    fn reference_scaling(q: Quantizer, x: &[f32]) -> Scaling {
        match q.blocks {
            Blocks::Tensor => Scaling::Tensor {
                quantize_scale: quantize_scale(q.format, amax(x), 0),
            },
            Blocks::Tiles => Scaling::Blocks { rows: 1, cols: TILE },
            Blocks::Squares => Scaling::Blocks { rows: TILE, cols: TILE },
            Blocks::Mx => Scaling::Mx,
            Blocks::Nv { rows } => Scaling::Nv { rows },
        }
    }

    fn tensor(values: &[f32], shape: [usize; 2]) -> Tensor<2> {
        Tensor::from_data(TensorData::new(values.to_vec(), shape), &Device::flex())
    }

    /// Every scaling and format against the scalar reference, bit for bit (signed zeros compare
    /// equal), on ragged shapes with zeros, saturating values, subnormals and a huge value.
    #[test]
    fn nearest_rounding_matches_the_reference() {
        use Minifloat::*;
        let cases = [
            (E4M3, Blocks::Tensor),
            (E5M2, Blocks::Tensor),
            (E4M3, Blocks::Tiles),
            (E5M2, Blocks::Tiles),
            (E4M3, Blocks::Squares),
            (E4M3, Blocks::Mx),
            (E5M2, Blocks::Mx),
            (E2M1, Blocks::Nv { rows: 1 }),
            (E2M1, Blocks::Nv { rows: 16 }),
        ];
        for (seed, shape) in [[3, 70], [130, 300], [17, 33]].into_iter().enumerate() {
            let x = adversarial(shape[0] * shape[1], seed as u64);
            for (format, blocks) in cases {
                let q = Quantizer {
                    format,
                    blocks,
                    rounding: Rounding::Nearest,
                    hadamard: false,
                };
                let reference = quantize(&x, shape, format, reference_scaling(q, &x), None).dequantize();
                let ours: Vec<f32> = fake_quantize(tensor(&x, shape), q, None, None)
                    .into_data()
                    .try_to_vec()
                    .unwrap();
                for (i, (a, b)) in ours.iter().zip(&reference).enumerate() {
                    assert!(
                        a == b,
                        "{format:?} {blocks:?} {shape:?} [{i}]: {} → {a}, reference {b}",
                        x[i]
                    );
                }
            }
        }
    }

    /// Blocks and tensors of values so small that a scale's inverse would overflow f32 (values
    /// near bf16's and f32's subnormals, seen in gradients) scale by 1 and round to zero: finite,
    /// and as the reference.
    #[test]
    fn tiny_blocks_stay_finite() {
        use Minifloat::*;
        let shape = [3, 160];
        let mut x = adversarial(3 * 160, 4);
        // Zeros among them: a zero times an overflowed factor would be NaN.
        let tiny = [1e-41, 0.0, -3e-40];
        x[..160].iter_mut().enumerate().for_each(|(i, v)| *v = tiny[i % 3]);
        let mut all_tiny = vec![2e-41f32; 3 * 160];
        all_tiny[7] = 0.0;
        for values in [&x, &all_tiny] {
            for (format, blocks) in [
                (E4M3, Blocks::Tensor),
                (E4M3, Blocks::Tiles),
                (E4M3, Blocks::Squares),
                (E4M3, Blocks::Mx),
                (E2M1, Blocks::Nv { rows: 1 }),
            ] {
                let q = Quantizer {
                    format,
                    blocks,
                    rounding: Rounding::Nearest,
                    hadamard: false,
                };
                let reference = quantize(values, shape, format, reference_scaling(q, values), None).dequantize();
                let ours: Vec<f32> = fake_quantize(tensor(values, shape), q, None, None)
                    .into_data()
                    .try_to_vec()
                    .unwrap();
                assert!(ours.iter().all(|v| v.is_finite()), "{format:?} {blocks:?}");
                assert!(
                    ours.iter().zip(&reference).all(|(a, b)| a == b),
                    "{format:?} {blocks:?}"
                );
            }
        }
    }

    /// Stochastic rounding against the reference with the same draws: equal but where the f32
    /// sum of value and draw rounds onto a whole step (none expected at this size; at most 1 in
    /// 10⁴ allowed), and each value within one step of the nearest rounding.
    #[test]
    fn stochastic_rounding_matches_the_reference() {
        let shape = [64, 96];
        let x = adversarial(64 * 96, 9);
        let q = Quantizer {
            format: Minifloat::E2M1,
            blocks: Blocks::Nv { rows: 1 },
            rounding: Rounding::Stochastic,
            hadamard: false,
        };
        let u = draws(shape, 5, &Device::flex());
        let u_host: Vec<f32> = u.clone().into_data().try_to_vec().unwrap();
        let reference = quantize(&x, shape, q.format, Scaling::Nv { rows: 1 }, Some(&u_host)).dequantize();
        let ours: Vec<f32> = fake_quantize(tensor(&x, shape), q, Some(u), None)
            .into_data()
            .try_to_vec()
            .unwrap();
        let differ = ours.iter().zip(&reference).filter(|(a, b)| a != b).count();
        assert!(differ * 10_000 <= x.len(), "{differ} of {} differ", x.len());
    }

    /// Stochastic rounding is unbiased: the mean of many roundings of one value is the value,
    /// within the sampling error (a step's standard deviation is at most half a step, so 4 096
    /// draws put the mean within 4 · 0.5 / 64 steps at 4σ).
    #[test]
    fn stochastic_rounding_is_unbiased() {
        let n = 4096;
        let value = 2.4f32; // between FP4's 2 and 3
        let y = Tensor::<2>::full([1, n], value, &Device::flex());
        let mean = round_to(Minifloat::E2M1, y, Some(draws([1, n], 11, &Device::flex())))
            .mean()
            .into_scalar::<f32>();
        assert!((mean - value).abs() < 4.0 * 0.5 / 64.0, "mean {mean}");
    }

    /// The draws are uniform in `[0, 1)`, repeatable from the seed and different across seeds.
    #[test]
    fn draws_are_repeatable() {
        let device = Device::flex();
        let a: Vec<f32> = draws([8, 100], 1, &device).into_data().try_to_vec().unwrap();
        let b: Vec<f32> = draws([8, 100], 1, &device).into_data().try_to_vec().unwrap();
        let c: Vec<f32> = draws([8, 100], 2, &device).into_data().try_to_vec().unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|&u| (0.0..1.0).contains(&u)));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        assert!((mean - 0.5).abs() < 0.05, "mean {mean}");
    }

    /// The fast transform against its closed form: `x · D·H₁₆/4` with `H`'s entries
    /// `(−1)^popcount(i & j)`, a padded ragged width included.
    #[test]
    fn hadamard_is_the_matrix_product() {
        let device = Device::flex();
        let x = Tensor::<2>::random([6, 40], Distribution::Normal(0.0, 1.0), &device);
        let matrix: Vec<f32> = (0..256)
            .map(|at: usize| {
                let (i, j) = (at / 16, at % 16);
                let sign = if hadamard_signs() >> i & 1 == 1 { -1.0 } else { 1.0 };
                let entry = if (i & j).count_ones() % 2 == 0 { 1.0 } else { -1.0 };
                sign * entry / 4.0
            })
            .collect();
        let matrix = Tensor::<2>::from_data(TensorData::new(matrix, [16, 16]), &device);
        let padded = x
            .clone()
            .pad([(0, 0), (0, 8)], burn::tensor::ops::PadMode::Constant(0.0));
        let product = padded.reshape([18, 16]).matmul(matrix).reshape([6, 48]);
        // Sums of 16 unit normals over 4, in f32 either way, in different orders: a few ulps of
        // values below ~4.
        product
            .to_data()
            .assert_approx_eq::<f32>(&hadamard(x).to_data(), burn::tensor::Tolerance::absolute(1e-5));
        assert!(
            hadamard_signs() != 0 && hadamard_signs() != 0xFFFF,
            "the signs are mixed"
        );
    }

    /// The Hadamard transform is orthogonal: two operands transformed alike keep their product
    /// (to f32 rounding), a ragged inner size included; and it spreads a spike over its block.
    #[test]
    fn hadamard_keeps_products() {
        let device = Device::flex();
        let normal = Distribution::Normal(0.0, 1.0);
        let a = Tensor::<2>::random([5, 40], normal, &device);
        let b = Tensor::<2>::random([7, 40], normal, &device);
        let plain = a.clone().matmul(b.clone().transpose());
        let turned = hadamard(a).matmul(hadamard(b).transpose());
        // f32 sums of 40 products of unit normals: a few ulps of values around 6.
        plain
            .to_data()
            .assert_approx_eq::<f32>(&turned.to_data(), burn::tensor::Tolerance::absolute(1e-4));
        let mut spike = vec![0.0f32; 16];
        spike[3] = 8.0;
        let spread: Vec<f32> = hadamard(tensor(&spike, [1, 16])).into_data().try_to_vec().unwrap();
        assert!(spread.iter().all(|v| v.abs() == 2.0), "{spread:?}");
    }
}
