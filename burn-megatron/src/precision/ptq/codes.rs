//! The grids post-training quantization rounds onto, and how a clipping range is chosen.
//!
//! A value `x` quantized with range `r` on grid `c` is `q(x / s) · s` with the scale
//! `s = r / c.max()`: `q` rounds to the nearest code, ties to even (integers: Burn's `round`;
//! minifloats: the FP8 issue's rounding) and saturates at `±max`, so a
//! range below the largest magnitude clips.

use burn::tensor::Tensor;
use burn_megatron_kernels::quant::fake::round_to;
use burn_megatron_kernels::quant::format::Minifloat;

/// The codes of a quantized value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Codes {
    /// Symmetric int8: `−127..=127`.
    Int8,
    /// Symmetric int4: `−7..=7`.
    Int4,
    /// FP8 E4M3 (largest 448).
    Fp8,
}

impl Codes {
    /// The largest code's magnitude.
    pub fn max(self) -> f32 {
        match self {
            Codes::Int8 => 127.0,
            Codes::Int4 => 7.0,
            Codes::Fp8 => Minifloat::E4M3.max(),
        }
    }

    /// Its name in a table: `int8`, `int4`, `fp8`.
    pub fn name(self) -> &'static str {
        match self {
            Codes::Int8 => "int8",
            Codes::Int4 => "int4",
            Codes::Fp8 => "fp8",
        }
    }

    /// `y` (already divided by its scale) rounded onto the grid and saturated.
    pub fn round<const D: usize>(self, y: Tensor<D>) -> Tensor<D> {
        match self {
            Codes::Fp8 => round_to(Minifloat::E4M3, y, None),
            int => {
                let max = int.max();
                y.round().clamp(-max, max)
            }
        }
    }

    /// One value `y` (divided by its scale) rounded onto the grid, on the host: what
    /// [`round`](Self::round) computes for it.
    pub fn round_value(self, y: f32) -> f32 {
        match self {
            Codes::Fp8 => Minifloat::E4M3.decode(Minifloat::E4M3.encode(y)),
            int => {
                let max = int.max();
                y.round_ties_even().clamp(-max, max)
            }
        }
    }

    /// `x` quantized with ranges `range` (broadcast against `x`; a zero range keeps zeros) and
    /// dequantized.
    pub fn fake_quantize<const D: usize>(self, x: Tensor<D>, range: Tensor<D>) -> Tensor<D> {
        let scale = range.div_scalar(self.max()).clamp_min(f32::MIN_POSITIVE);
        self.round(x / scale.clone()) * scale
    }
}

/// How the range of a group of values (a channel, a group of a channel's inputs, a whole
/// tensor, an activation) is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Clipping {
    /// The largest magnitude: nothing is clipped.
    Max,
    /// This percentile (0–100) of the magnitudes: larger ones are clipped.
    Percentile(f64),
    /// The range, among fractions of the largest magnitude, whose quantized values lie closest
    /// to the values in squared error.
    Mse,
}

impl Clipping {
    /// Its name in a table: `max`, `p99.9`, `mse`.
    pub fn name(self) -> String {
        match self {
            Clipping::Max => "max".into(),
            Clipping::Percentile(p) => format!("p{p}"),
            Clipping::Mse => "mse".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, TensorData};

    use super::*;

    /// Each grid's device rounding is its host rounding, value by value, inside the range and
    /// past it (saturated).
    #[test]
    fn device_and_host_rounding_agree() {
        let device = Device::flex();
        // Steps of 0.25 hit every tie.
        let values: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.25).collect();
        for codes in [Codes::Int8, Codes::Int4, Codes::Fp8] {
            let y = Tensor::<1>::from_data(TensorData::new(values.clone(), [values.len()]), &device);
            let got: Vec<f32> = codes.round(y).into_data().try_to_vec().unwrap();
            for (g, v) in got.iter().zip(&values) {
                assert_eq!(*g, codes.round_value(*v), "{codes:?} at {v}");
                assert!(g.abs() <= codes.max());
            }
        }
    }
}
