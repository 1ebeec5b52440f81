//! Weight quantization: a linear weight replaced by the values its codes dequantize to, with
//! one scale a tensor, an output channel or a group of a channel's input rows, the range chosen
//! by [`Clipping`]; or NVFP4's two-level blocks.
//!
//! Legend: weights are Burn's `[in, out]`; a channel is an output column, a group `g`
//! consecutive input rows of one column (the last group shorter where `in` is no multiple).

use burn::tensor::{DType, Int, Tensor, TensorData};
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
    /// blocks.
    pub scales: Option<Tensor<2>>,
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
            WeightScheme::Nvfp4 => "nvfp4".into(),
        }
    }

    /// `w` (`[in, out]`, any dtype) quantized.
    pub fn quantize(&self, w: Tensor<2>) -> QuantizedWeight {
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
                QuantizedWeight { values, scales: None }
            }
            WeightScheme::Uniform {
                codes,
                granularity,
                clipping,
            } => uniform(w, codes, granularity, clipping),
        }
    }
}

/// [`WeightScheme::Uniform`].
fn uniform(w: Tensor<2>, codes: Codes, granularity: Granularity, clipping: Clipping) -> QuantizedWeight {
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
            let error = |q: Tensor<3>| {
                let e = (q - grouped.clone()).powi_scalar(2);
                match whole {
                    true => e.sum().reshape([1, 1, 1]),
                    false => e.sum_dim(1),
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
    use burn::tensor::{Device, Distribution, Tensor, TensorData};

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
        let w = Tensor::<2>::random([64, 3], Distribution::Normal(0.0, 1.0), &device);
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
        let w = Tensor::<2>::random([10, 5], Distribution::Normal(0.0, 1.0), &device);
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

    /// FP8 with one scale a tensor: `amax / 448`, and every value on E4M3's grid of that scale.
    #[test]
    fn fp8_per_tensor() {
        let device = Device::flex();
        let w = Tensor::<2>::random([7, 6], Distribution::Normal(0.0, 1.0), &device);
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
