//! Weight quantization: a linear weight replaced by the values its codes dequantize to, with
//! one scale a tensor, an output channel or a group of a channel's input rows, the range chosen
//! by [`Clipping`]: symmetric codes around 0, or unsigned codes with a zero point a group (AWQ's
//! and GPTQ's int4), or with the group's minimum kept as a value (GGUF's Q4_1); or NVFP4's
//! two-level blocks.
//!
//! Legend: weights are Burn's `[in, out]`; a channel is an output column, a group `g`
//! consecutive input rows of one column (the last group shorter where `in` is no multiple).

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_megatron_kernels::quant::fake;
use burn_megatron_kernels::quant::format::Minifloat;
use burn_megatron_kernels::quant::recipe::{Blocks, Quantizer, Rounding};

use super::codes::{Clipping, Codes};

/// Which values share a weight scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Granularity {
    Tensor,
    Channel,
    /// `g` consecutive input rows of one output channel.
    Group(usize),
}

/// How a block's linear weights are quantized.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum WeightScheme {
    /// `codes` with a scale of `granularity`, its range chosen by `clipping`.
    Uniform {
        codes: Codes,
        granularity: Granularity,
        clipping: Clipping,
    },
    /// Unsigned `bits`-bit codes `0..=2^bits − 1` with a zero point and a scale for every
    /// `group` input rows of each output channel, spanning the group's range `[min, max]`
    /// (clipped as `clipping` says: a fraction of both ends, or the percentiles `100 − p` and
    /// `p`), widened to hold 0: `value = (code − zero) · scale`.
    Asymmetric {
        bits: u32,
        group: usize,
        clipping: Clipping,
    },
    /// Unsigned `bits`-bit codes spanning each group's `[min, max]`, the minimum kept as a value
    /// rather than a code: `value = min + code · scale`, `scale = (max − min) / (2^bits − 1)`
    /// (GGUF's Q4_1 in groups of 32, which weights dequantized from Q4_1 sit on exactly).
    Minimum { bits: u32, group: usize },
    /// NVFP4: E2M1 in 1×16 blocks along the input features with E4M3 block scales and an f32
    /// tensor scale (the FP8 issue's quantizer, `Blocks::Nv { rows: 1 }`).
    Nvfp4,
}

/// A quantized weight.
#[derive(Clone, Debug)]
pub struct QuantizedWeight {
    /// The values the codes dequantize to, `[in, out]`, f32.
    pub values: Tensor<2>,
    /// The dequantization scales (`range / codes.max()`), f32: `[1, 1]` for a tensor, `[1, out]`
    /// for channels, `[groups, out]` for groups; `None` for NVFP4, whose scales stay in its
    /// blocks. [`WeightScheme::Minimum`]'s minimums are not codes and stay in the values.
    pub scales: Option<Tensor<2>>,
    /// The zero points of [`WeightScheme::Asymmetric`] (codes, as f32), shaped as `scales`.
    pub zeros: Option<Tensor<2>>,
}

impl WeightScheme {
    /// Its name in a table: `int8-channel-max`, `int4-g128-mse`, `fp8-tensor-max`, `nvfp4`.
    pub fn name(&self) -> String {
        match self {
            WeightScheme::Uniform {
                codes,
                granularity,
                clipping,
            } => {
                let granularity = match granularity {
                    Granularity::Tensor => "tensor".to_string(),
                    Granularity::Channel => "channel".to_string(),
                    Granularity::Group(g) => format!("g{g}"),
                };
                format!("{}-{granularity}-{}", codes.name(), clipping.name())
            }
            WeightScheme::Asymmetric { bits, group, clipping } => {
                format!("int{bits}-asym-g{group}-{}", clipping.name())
            }
            WeightScheme::Minimum { bits, group } => format!("int{bits}-min-g{group}"),
            WeightScheme::Nvfp4 => "nvfp4".into(),
        }
    }

    /// `w` (`[in, out]`, any dtype) quantized.
    pub fn quantize(&self, w: Tensor<2>) -> QuantizedWeight {
        self.quantize_on(w, None)
    }

    /// [`quantize`](Self::quantize); with `inputs` (`[n, in]`, a sample of what the layer
    /// reads), [`Clipping::Mse`] picks each group's range for the least squared error of the
    /// layer's outputs on them rather than of the weights (AWQ's clip search).
    pub fn quantize_on(&self, w: Tensor<2>, inputs: Option<&Tensor<2>>) -> QuantizedWeight {
        let w = w.cast(DType::F32);
        match *self {
            WeightScheme::Nvfp4 => {
                let q = Quantizer {
                    format: Minifloat::E2M1,
                    blocks: Blocks::Nv { rows: 1 },
                    rounding: Rounding::Nearest,
                    hadamard: false,
                };
                // K-major, as the FP8 issue's quantizer reads an operand: `[out, in]`.
                let values = fake::fake_quantize(w.transpose(), q, None, None).transpose();
                QuantizedWeight {
                    values,
                    scales: None,
                    zeros: None,
                }
            }
            WeightScheme::Uniform {
                codes,
                granularity,
                clipping,
            } => uniform(w, codes, granularity, clipping, inputs),
            WeightScheme::Asymmetric { bits, group, clipping } => asymmetric(w, bits, group, clipping, inputs),
            WeightScheme::Minimum { bits, group } => minimum(w, bits, group),
        }
    }

    /// How its ranges are chosen (none for NVFP4, whose blocks take their largest magnitudes,
    /// nor for [`WeightScheme::Minimum`], whose groups take their extremes).
    pub fn clipping(&self) -> Option<Clipping> {
        match self {
            WeightScheme::Uniform { clipping, .. } | WeightScheme::Asymmetric { clipping, .. } => Some(*clipping),
            WeightScheme::Minimum { .. } | WeightScheme::Nvfp4 => None,
        }
    }

    /// The same scheme with its range at the largest magnitudes (what AWQ's scale search
    /// quantizes with).
    pub fn at_max(self) -> Self {
        match self {
            WeightScheme::Uniform { codes, granularity, .. } => WeightScheme::Uniform {
                codes,
                granularity,
                clipping: Clipping::Max,
            },
            WeightScheme::Asymmetric { bits, group, .. } => WeightScheme::Asymmetric {
                bits,
                group,
                clipping: Clipping::Max,
            },
            fixed => fixed,
        }
    }
}

/// `inputs` (`[n, in]`) cut into the weight's groups of input rows, `[groups, n, g]` (zeros for
/// the padding rows, which then add nothing).
fn grouped_inputs(inputs: &Tensor<2>, groups: usize, group: usize) -> Tensor<3> {
    let [n, k] = inputs.dims();
    let padded = inputs.clone().cast(DType::F32).pad(
        [(0, 0), (0, groups * group - k)],
        burn::tensor::ops::PadMode::Constant(0.0),
    );
    padded.reshape([n, groups, group]).swap_dims(0, 1)
}

/// Each group's squared error (`[groups, 1, out]`) of quantized values `q` against `w` (both
/// `[groups, g, out]`): of the weights, or with `inputs` (`[groups, n, g]`) of the outputs.
fn group_error(q: Tensor<3>, w: Tensor<3>, inputs: Option<&Tensor<3>>) -> Tensor<3> {
    let d = q - w;
    match inputs {
        None => d.powi_scalar(2).sum_dim(1),
        Some(x) => x.clone().matmul(d).powi_scalar(2).sum_dim(1),
    }
}

/// `w` (`[rows, out]`) cut into groups of `group` rows, `[groups, group, out]`: the last group
/// padded with copies of the weight's last row, which lie inside that group's range (no min or
/// max moves); callers cut them off again.
fn groups_of_rows(w: Tensor<2>, group: usize) -> Tensor<3> {
    let [rows, cols] = w.dims();
    let last = w.clone().narrow(0, rows - 1, 1);
    let padded = match rows.div_ceil(group) * group - rows {
        0 => w,
        n => Tensor::cat(vec![w, last.repeat_dim(0, n)], 0),
    };
    padded.reshape([rows.div_ceil(group), group, cols])
}

/// 1 for each of `rows` real rows cut into groups of `group`, 0 for the padding that
/// [`groups_of_rows`] adds: `[groups, group, 1]`.
fn real_rows(rows: usize, group: usize, device: &Device) -> Tensor<3> {
    let groups = rows.div_ceil(group);
    let mask: Vec<f32> = (0..groups * group).map(|r| (r < rows) as u8 as f32).collect();
    Tensor::<1>::from_data(TensorData::new(mask, [groups * group]), device).reshape([groups, group, 1])
}

/// [`WeightScheme::Minimum`].
fn minimum(w: Tensor<2>, bits: u32, group: usize) -> QuantizedWeight {
    let [rows, cols] = w.dims();
    let group = group.clamp(1, rows);
    let groups = rows.div_ceil(group);
    let levels = ((1u32 << bits) - 1) as f32;
    let g = groups_of_rows(w, group);
    let (lo, hi) = (g.clone().min_dim(1), g.clone().max_dim(1)); // [groups, 1, out]
    let scale = ((hi - lo.clone()) / levels).clamp_min(f32::MIN_POSITIVE);
    let codes = ((g - lo.clone()) / scale.clone()).round().clamp(0.0, levels);
    let values = lo + codes * scale.clone();
    QuantizedWeight {
        values: values.reshape([groups * group, cols]).narrow(0, 0, rows),
        scales: Some(scale.reshape([groups, cols])),
        zeros: None,
    }
}

/// [`WeightScheme::Asymmetric`].
fn asymmetric(
    w: Tensor<2>,
    bits: u32,
    group: usize,
    clipping: Clipping,
    inputs: Option<&Tensor<2>>,
) -> QuantizedWeight {
    let [rows, cols] = w.dims();
    let group = group.clamp(1, rows);
    let levels = ((1u32 << bits) - 1) as f32;
    let g = groups_of_rows(w, group); // [groups, g, out]
    let quantize = |lo: Tensor<3>, hi: Tensor<3>| {
        // The range holds 0 (GPTQ's choice), so the zero point is a code and nothing past the
        // range's ends is clipped for want of one.
        let (lo, hi) = (lo.clamp_max(0.0), hi.clamp_min(0.0));
        let scale = ((hi - lo.clone()) / levels).clamp_min(f32::MIN_POSITIVE);
        let zero = (lo.neg() / scale.clone()).round().clamp(0.0, levels);
        let codes = ((g.clone() / scale.clone()).round() + zero.clone()).clamp(0.0, levels);
        ((codes - zero.clone()) * scale.clone(), scale, zero)
    };
    let (min, max) = (g.clone().min_dim(1), g.clone().max_dim(1)); // [groups, 1, out]
    let (values, scale, zero) = match clipping {
        Clipping::Max => quantize(min, max),
        Clipping::Percentile(p) => {
            let sorted = g.clone().sort(1);
            let at = |q: f64| ((q / 100.0 * group as f64).ceil().clamp(1.0, group as f64) as usize) - 1;
            quantize(sorted.clone().narrow(1, at(100.0 - p), 1), sorted.narrow(1, at(p), 1))
        }
        Clipping::Mse => {
            // Both ends shrunk by 1, 0.975, … 0.5; the first best kept, a group at a time.
            let x = inputs.map(|x| grouped_inputs(x, rows.div_ceil(group), group));
            // The padding rows (copies of the last row) must not weigh in the choice.
            let real = real_rows(rows, group, &g.device());
            // (error, values, scale, zero)
            let mut best: Option<(Tensor<3>, Tensor<3>, Tensor<3>, Tensor<3>)> = None;
            for k in 0..=20 {
                let r = 1.0 - 0.025 * k as f64;
                let (v, s, z) = quantize(min.clone().mul_scalar(r), max.clone().mul_scalar(r));
                let e = group_error(v.clone() * real.clone(), g.clone() * real.clone(), x.as_ref());
                best = Some(match best {
                    None => (e, v, s, z),
                    Some((be, bv, bs, bz)) => {
                        let better = e.clone().lower(be.clone());
                        let wide = better.clone().expand(bv.dims());
                        (
                            be.mask_where(better.clone(), e),
                            bv.mask_where(wide, v),
                            bs.mask_where(better.clone(), s),
                            bz.mask_where(better, z),
                        )
                    }
                });
            }
            let (_, v, s, z) = best.expect("candidates");
            (v, s, z)
        }
    };
    let groups = rows.div_ceil(group);
    QuantizedWeight {
        values: values.reshape([groups * group, cols]).narrow(0, 0, rows),
        scales: Some(scale.reshape([groups, cols])),
        zeros: Some(zero.reshape([groups, cols])),
    }
}

/// [`WeightScheme::Uniform`].
fn uniform(
    w: Tensor<2>,
    codes: Codes,
    granularity: Granularity,
    clipping: Clipping,
    inputs: Option<&Tensor<2>>,
) -> QuantizedWeight {
    let [rows, cols] = w.dims();
    let group = match granularity {
        Granularity::Group(g) => g.clamp(1, rows),
        Granularity::Tensor | Granularity::Channel => rows,
    };
    let groups = rows.div_ceil(group);
    // Zeros pad the last group (they change no magnitude) and are cut off again.
    let padded = w.pad(
        [(0, groups * group - rows), (0, 0)],
        burn::tensor::ops::PadMode::Constant(0.0),
    );
    let grouped: Tensor<3> = padded.reshape([groups, group, cols]); // [groups, g, out]
    let whole = granularity == Granularity::Tensor;
    // The largest magnitude of each scale's values: [groups, 1, out], or [1, 1, 1].
    let amax = match whole {
        true => grouped.clone().abs().max().reshape([1, 1, 1]),
        false => grouped.clone().abs().max_dim(1),
    };
    let range = match clipping {
        Clipping::Max => amax,
        Clipping::Percentile(p) => percentile(grouped.clone(), rows, whole, p),
        Clipping::Mse => {
            let x = inputs.map(|x| grouped_inputs(x, groups, group));
            let error = |q: Tensor<3>| {
                let e = group_error(q, grouped.clone(), x.as_ref());
                match whole {
                    true => e.sum().reshape([1, 1, 1]),
                    false => e,
                }
            };
            // The fractions 1, 0.975, … 0.5 of the largest magnitude; the first best kept.
            let mut best: Option<(Tensor<3>, Tensor<3>)> = None; // (error, range)
            for k in 0..=20 {
                let range = amax.clone().mul_scalar(1.0 - 0.025 * k as f64);
                let e = error(codes.fake_quantize(grouped.clone(), range.clone()));
                best = Some(match best {
                    None => (e, range),
                    Some((best_e, best_range)) => {
                        let better = e.clone().lower(best_e.clone());
                        (
                            best_e.mask_where(better.clone(), e),
                            best_range.mask_where(better, range),
                        )
                    }
                });
            }
            best.expect("candidates").1
        }
    };
    let values = codes
        .fake_quantize(grouped, range.clone())
        .reshape([groups * group, cols])
        .narrow(0, 0, rows);
    let scales = match whole {
        true => range.reshape([1, 1]),
        false => range.reshape([groups, cols]),
    }
    .div_scalar(codes.max());
    QuantizedWeight {
        values,
        scales: Some(scales),
        zeros: None,
    }
}

/// The `p`th percentile of the magnitudes of each group (`[groups, 1, out]`) or of the whole
/// weight (`[1, 1, 1]`), over its `rows` real rows: the padding zeros sort first and are
/// stepped over.
fn percentile(grouped: Tensor<3>, rows: usize, whole: bool, p: f64) -> Tensor<3> {
    let [groups, group, cols] = grouped.dims();
    let rank = |n: usize| ((p / 100.0) * n as f64).ceil().clamp(1.0, n as f64) as usize - 1;
    if whole {
        let sorted = grouped.abs().reshape([groups * group * cols]).sort(0);
        let padding = (groups * group - rows) * cols;
        return sorted.narrow(0, padding + rank(rows * cols), 1).reshape([1, 1, 1]);
    }
    let sorted = grouped.clone().abs().sort(1);
    let at: Vec<i64> = (0..groups)
        .flat_map(|g| {
            let real = group.min(rows - g * group);
            std::iter::repeat_n(((group - real) + rank(real)) as i64, cols)
        })
        .collect();
    let at = Tensor::<3, Int>::from_data(TensorData::new(at, [groups, 1, cols]), &grouped.device());
    sorted.gather(1, at)
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Tensor, TensorData};

    use super::*;

    fn values(x: Tensor<2>) -> Vec<f32> {
        x.into_data().try_to_vec::<f32>().unwrap()
    }

    fn int(codes: Codes, granularity: Granularity, clipping: Clipping) -> WeightScheme {
        WeightScheme::Uniform {
            codes,
            granularity,
            clipping,
        }
    }

    /// Values on the int8 grid of their channel come back exactly; others move by at most half
    /// a step; each channel has its own scale, `amax / 127`.
    #[test]
    fn int8_per_channel_round_trips_its_grid() {
        let device = Device::flex();
        // Column 0 on the grid of step 1/127 (its max 1), column 1 of step 100/127.
        let grid: Vec<f32> = (0..8)
            .flat_map(|i| [i as f32 / 127.0, 100.0 * (i as f32 - 4.0) / 127.0])
            .chain([1.0, 100.0])
            .collect();
        let w = Tensor::<2>::from_data(TensorData::new(grid.clone(), [9, 2]), &device);
        let q = int(Codes::Int8, Granularity::Channel, Clipping::Max).quantize(w);
        for (a, b) in values(q.values).iter().zip(&grid) {
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{a} vs {b}");
        }
        let scales = values(q.scales.unwrap());
        assert!((scales[0] - 1.0 / 127.0).abs() < 1e-9 && (scales[1] - 100.0 / 127.0).abs() < 1e-6);
        let w = crate::init::normal([64, 3], 1, 1.0, &device);
        let step = values(w.clone().abs().max_dim(0))
            .iter()
            .map(|m| m / 127.0)
            .collect::<Vec<_>>();
        let q = int(Codes::Int8, Granularity::Channel, Clipping::Max).quantize(w.clone());
        for (i, (a, b)) in values(q.values).iter().zip(values(w)).enumerate() {
            assert!((a - b).abs() <= step[i % 3] / 2.0 + 1e-6, "element {i}: {a} vs {b}");
        }
    }

    /// Int4 groups of 4 over 10 rows (a last group of 2): within half a step of the weights;
    /// MSE clipping never does worse than no clipping, and a percentile never exceeds the
    /// largest magnitude. The 50th percentile of a group is its middle magnitude, the padding
    /// of the last group stepped over.
    #[test]
    fn int4_groups_and_clipping() {
        let device = Device::flex();
        let w = crate::init::normal([10, 5], 2, 1.0, &device);
        let g4 = Granularity::Group(4);
        let max = int(Codes::Int4, g4, Clipping::Max).quantize(w.clone());
        let (wv, qv) = (values(w.clone()), values(max.values.clone()));
        for g in 0..3 {
            let rows = (4 * g)..(4 * g + 4).min(10);
            for c in 0..5 {
                let group: Vec<f32> = rows.clone().map(|r| wv[r * 5 + c]).collect();
                let step = group.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 7.0;
                for r in rows.clone() {
                    assert!((qv[r * 5 + c] - wv[r * 5 + c]).abs() <= step / 2.0 + 1e-6);
                }
            }
        }
        let error = |q: Tensor<2>| (q - w.clone()).powi_scalar(2).sum().into_scalar::<f64>();
        let mse = int(Codes::Int4, g4, Clipping::Mse).quantize(w.clone());
        assert!(error(mse.values) <= error(max.values.clone()) + 1e-9);
        let p = int(Codes::Int4, g4, Clipping::Percentile(50.0)).quantize(w.clone());
        let scales = values(p.scales.unwrap()); // [3, 5]
        for c in 0..5 {
            // The last group holds rows 8 and 9: its median magnitude is the smaller one.
            let smaller = wv[8 * 5 + c].abs().min(wv[9 * 5 + c].abs());
            assert!((scales[2 * 5 + c] * 7.0 - smaller).abs() < 1e-6, "column {c}");
        }
        let clipped = values(p.values).iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(clipped <= values(max.values).iter().fold(0.0f32, |m, v| m.max(v.abs())) + 1e-6);
    }

    /// Asymmetric int4 in groups of 4 over 10 rows (a last group of 2): every value within half
    /// a step (`(max − min) / 15` of the range widened to hold 0) plus the zero point's rounding; a group of values on its own
    /// 16-level grid comes back exactly; MSE clipping does no worse than none.
    #[test]
    fn asymmetric_int4_groups() {
        let device = Device::flex();
        // 30 evenly spaced values over [-1, 3], scrambled over the rows (7 is prime to 30).
        let spread: Vec<f32> = (0..30).map(|i| -1.0 + 4.0 * ((i * 7) % 30) as f32 / 29.0).collect();
        let w = Tensor::<2>::from_data(TensorData::new(spread, [10, 3]), &device);
        let q = WeightScheme::Asymmetric {
            bits: 4,
            group: 4,
            clipping: Clipping::Max,
        }
        .quantize(w.clone());
        let (wv, qv) = (values(w.clone()), values(q.values.clone()));
        for g in 0..3 {
            let rows = (4 * g)..(4 * g + 4).min(10);
            for c in 0..3 {
                let group: Vec<f32> = rows.clone().map(|r| wv[r * 3 + c]).collect();
                // The range widened to hold 0.
                let (lo, hi) = group.iter().fold((0.0f32, 0.0f32), |(a, b), v| (a.min(*v), b.max(*v)));
                let step = (hi - lo) / 15.0;
                for r in rows.clone() {
                    // Half a step from rounding the value, half from rounding the zero point.
                    assert!(
                        (qv[r * 3 + c] - wv[r * 3 + c]).abs() <= step + 1e-5,
                        "row {r} column {c}"
                    );
                }
            }
        }
        // 0.1 · (0..16) − 0.3: a 16-level grid from −0.3 that holds 0, zero point 3.
        let grid: Vec<f32> = (0..16).map(|i| 0.1 * i as f32 - 0.3).collect();
        let on_grid = Tensor::<2>::from_data(TensorData::new(grid.clone(), [16, 1]), &device);
        let exact = |clipping| {
            WeightScheme::Asymmetric {
                bits: 4,
                group: 16,
                clipping,
            }
            .quantize(on_grid.clone())
            .values
        };
        for (a, b) in values(exact(Clipping::Max)).iter().zip(&grid) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        let error = |q: Tensor<2>| (q - w.clone()).powi_scalar(2).sum().into_scalar::<f64>();
        let mse = WeightScheme::Asymmetric {
            bits: 4,
            group: 4,
            clipping: Clipping::Mse,
        }
        .quantize(w.clone());
        assert!(error(mse.values) <= error(q.values) + 1e-9);
    }

    /// Weights on a Q4_1 grid (groups of 32 rows: a minimum and a step each, codes 0 and 15
    /// present, as GGUF's quantizer leaves them) come back from `int4-min-g32` to f32's
    /// rounding (2⁻²⁰ of the group's span: a few ulps of `min + code · step`), and not from the
    /// zero-point scheme, whose zero is a whole code (and whose range holds 0).
    #[test]
    fn minimum_groups_hold_a_q4_1_grid() {
        let device = Device::flex();
        let (rows, cols) = (64, 3);
        let mut w = vec![0.0f32; rows * cols];
        for g in 0..2 {
            for c in 0..cols {
                let (min, step) = (0.37 - 0.9 * (g + c) as f32 / 7.0, 0.011 + 0.003 * c as f32);
                for r in 0..32 {
                    let code = match r {
                        0 => 0,
                        1 => 15,
                        r => (r * 7 + c * 3 + g) % 16,
                    };
                    w[(g * 32 + r) * cols + c] = min + code as f32 * step;
                }
            }
        }
        let w = Tensor::<2>::from_data(TensorData::new(w.clone(), [rows, cols]), &device);
        let worst = |scheme: WeightScheme| {
            let q = values(scheme.quantize(w.clone()).values);
            q.iter()
                .zip(values(w.clone()))
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max)
        };
        let span = 15.0 * 0.017;
        assert!(worst(WeightScheme::Minimum { bits: 4, group: 32 }) <= span / (1 << 20) as f32);
        let zero_point = WeightScheme::Asymmetric {
            bits: 4,
            group: 32,
            clipping: Clipping::Max,
        };
        assert!(worst(zero_point) > 1e-3);
    }

    /// Given the layer's inputs, MSE clipping picks each group's range for the outputs' error:
    /// it does no worse there than the largest magnitude, for symmetric and zero-point codes,
    /// with one input channel 30 times the others.
    #[test]
    fn mse_on_inputs_weighs_the_outputs() {
        let device = Device::flex();
        let w = crate::init::normal([32, 4], 4, 1.0, &device);
        // Input channel 0 is 30 times the others: its weight row matters most.
        let scale: Vec<f32> = (0..32).map(|i| if i == 0 { 30.0 } else { 1.0 }).collect();
        let scale = Tensor::<1>::from_data(TensorData::new(scale, [32]), &device).unsqueeze_dim::<2>(0);
        let x = crate::init::normal([64, 32], 5, 1.0, &device) * scale;
        let out_error = |q: Tensor<2>| {
            (x.clone().matmul(q - w.clone()))
                .powi_scalar(2)
                .sum()
                .into_scalar::<f64>()
        };
        for scheme in [
            int(Codes::Int4, Granularity::Group(16), Clipping::Mse),
            WeightScheme::Asymmetric {
                bits: 4,
                group: 16,
                clipping: Clipping::Mse,
            },
        ] {
            let on_inputs = scheme.quantize_on(w.clone(), Some(&x)).values;
            let at_max = scheme.at_max().quantize(w.clone()).values;
            assert!(out_error(on_inputs) <= out_error(at_max) + 1e-6, "{scheme:?}");
        }
    }

    /// FP8 with one scale a tensor: `amax / 448`, and every value on E4M3's grid of that scale.
    #[test]
    fn fp8_per_tensor() {
        let device = Device::flex();
        let w = crate::init::normal([7, 6], 6, 1.0, &device);
        let amax = w.clone().abs().max().into_scalar::<f32>();
        let q = int(Codes::Fp8, Granularity::Tensor, Clipping::Max).quantize(w);
        let scale = values(q.scales.unwrap());
        assert_eq!(scale.len(), 1);
        assert!((scale[0] - amax / 448.0).abs() <= 1e-7 * amax);
        for v in values(q.values) {
            let code = v / scale[0];
            assert!(
                (Codes::Fp8.round_value(code) - code).abs() <= 1e-4 * code.abs().max(1.0),
                "{v}"
            );
        }
    }
}
