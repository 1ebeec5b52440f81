//! The scalings of the FP8 and FP4 training recipes: how the values of a 2-D tensor share
//! scales before they are encoded in a [`Minifloat`], as a scalar reference on host data.
//!
//! A quantized tensor is codes and, per block of its grid, a dequantization scale:
//! `value ≈ decode(code) · scale`. Blocks run along rows and columns from the top left; the last
//! block of a ragged edge is partial.
//!
//! - [`Scaling::Tensor`]: one scale for the whole tensor, given by the caller (FP8 current
//!   scaling takes it from this tensor's amax, delayed scaling from an amax history):
//!   `x · scale_q` encoded, `scale = 1 / scale_q` (Transformer Engine's `scale` and
//!   `scale_inv`).
//! - [`Scaling::Blocks`]: an f32 scale per `rows × cols` block from its amax, `amax / max`
//!   (DeepSeek-V3: 1×128 activations and gradients, 128×128 weights).
//! - [`Scaling::Mx`]: a power-of-two E8M0 scale per 1×32 block: the smallest `2^k ≥ amax / max`,
//!   rounded up so no element saturates (NVIDIA's MXFP8 recipe; the OCP specification rounds
//!   down and lets the block's largest elements clip).
//! - [`Scaling::Nv`]: NVFP4's two levels: an f32 tensor scale mapping the tensor's amax to
//!   `6 · 448`, and per `rows × 16` block an E4M3 scale `amax_block / 6` in those units.
//!
//! Legend: `r`, `c` the tensor's rows and columns; `br`, `bc` a block's.

use super::format::{Minifloat, e8m0, e8m0_value};

/// How a tensor's values share scales.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scaling {
    /// One scale for the whole tensor: values are multiplied by `quantize_scale` (finite,
    /// above 0) before encoding.
    Tensor { quantize_scale: f32 },
    /// An f32 scale per block of `rows × cols`.
    Blocks { rows: usize, cols: usize },
    /// An E8M0 scale per 1×32 block.
    Mx,
    /// An f32 tensor scale and an E4M3 scale per block of `rows × 16` (1 for activations and
    /// gradients, 16 for weights).
    Nv { rows: usize },
}

/// Values a DeepSeek-V3 tile holds along a row (the blockwise FP8 recipe's 1×128 tiles and
/// 128×128 squares).
pub const TILE: usize = 128;

/// Elements an MX block holds along a row.
pub const MX_BLOCK: usize = 32;
/// Elements an NVFP4 block holds along a row.
pub const NV_BLOCK: usize = 16;

impl Scaling {
    /// The block shape `[br, bc]` of a tensor of `[r, c]`.
    pub fn block(self, [r, c]: [usize; 2]) -> [usize; 2] {
        match self {
            Scaling::Tensor { .. } => [r.max(1), c.max(1)],
            Scaling::Blocks { rows, cols } => [rows, cols],
            Scaling::Mx => [1, MX_BLOCK],
            Scaling::Nv { rows } => [rows, NV_BLOCK],
        }
    }
}

/// A tensor quantized on the host: the reference result.
#[derive(Clone, Debug, PartialEq)]
pub struct Quantized {
    pub format: Minifloat,
    pub scaling: Scaling,
    /// `[r, c]`.
    pub shape: [usize; 2],
    /// One code a value, row-major.
    pub codes: Vec<u8>,
    /// The dequantization scale of each block, row-major over the block grid, in f32.
    pub scales: Vec<f32>,
    /// The scales' own codes where the recipe stores them narrow: E8M0 (MX), E4M3 (NVFP4).
    pub scale_codes: Option<Vec<u8>>,
}

impl Quantized {
    /// The blocks along each dimension.
    pub fn grid(&self) -> [usize; 2] {
        let [br, bc] = self.scaling.block(self.shape);
        [self.shape[0].div_ceil(br), self.shape[1].div_ceil(bc)]
    }

    /// The values the codes and scales stand for, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let [r, c] = self.shape;
        let [br, bc] = self.scaling.block(self.shape);
        let grid_cols = c.div_ceil(bc);
        (0..r * c)
            .map(|i| {
                let (row, col) = (i / c, i % c);
                let scale = self.scales[(row / br) * grid_cols + col / bc];
                self.format.decode(self.codes[i]) * scale
            })
            .collect()
    }
}

/// The largest |x| of the block at grid position `(gr, gc)`, NaN ignored.
fn block_amax(x: &[f32], [r, c]: [usize; 2], [br, bc]: [usize; 2], (gr, gc): (usize, usize)) -> f32 {
    let mut amax = 0.0f32;
    for row in gr * br..((gr + 1) * br).min(r) {
        for col in gc * bc..((gc + 1) * bc).min(c) {
            amax = amax.max(x[row * c + col].abs());
        }
    }
    amax
}

/// The largest |x| of the whole tensor, NaN ignored: what a current-scaling recipe scales by.
pub fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// The scale that maps `amax` onto `format`'s largest value, `max / amax / 2^margin`
/// (Transformer Engine's); 1 for a zero or non-finite amax, and for an amax so small the scale
/// would overflow f32.
pub fn quantize_scale(format: Minifloat, amax: f32, margin: i32) -> f32 {
    let scale = format.max() / amax / 2f32.powi(margin);
    match amax.is_finite() && amax > 0.0 && scale.is_finite() {
        true => scale,
        false => 1.0,
    }
}

/// `x` (`[r, c]`, row-major) quantized to `format` with `scaling`, rounding to nearest; with
/// `uniform` (one draw in `[0, 1)` a value), rounding stochastically instead.
pub fn quantize(
    x: &[f32],
    shape: [usize; 2],
    format: Minifloat,
    scaling: Scaling,
    uniform: Option<&[f32]>,
) -> Quantized {
    let [r, c] = shape;
    assert_eq!(x.len(), r * c, "{} values for a [{r}, {c}] tensor", x.len());
    let [br, bc] = scaling.block(shape);
    let grid = [r.div_ceil(br), c.div_ceil(bc)];
    // Per block: the factor values are multiplied by before encoding, the dequantization
    // scale, and the scale's own code.
    let tensor_encode = match scaling {
        // NVFP4's first level: the tensor's amax maps to 6 · 448.
        Scaling::Nv { .. } => quantize_scale(Minifloat::E4M3, amax(x), 0) * format.max(),
        _ => 1.0,
    };
    let mut factors = Vec::with_capacity(grid[0] * grid[1]);
    let mut scales = Vec::with_capacity(grid[0] * grid[1]);
    let mut scale_codes = Vec::new();
    for gr in 0..grid[0] {
        for gc in 0..grid[1] {
            let block_amax = block_amax(x, shape, [br, bc], (gr, gc));
            let (factor, scale) = match scaling {
                Scaling::Tensor { quantize_scale } => (quantize_scale, 1.0 / quantize_scale),
                Scaling::Blocks { .. } => {
                    // 1 for a zero or non-finite amax, and for one so small that the scale is
                    // below f32's normal range (its inverse would overflow).
                    let scale = block_amax / format.max();
                    let scale = match block_amax.is_finite() && scale >= f32::MIN_POSITIVE {
                        true => scale,
                        false => 1.0,
                    };
                    (1.0 / scale, scale)
                }
                Scaling::Mx => {
                    let k = mx_exponent(block_amax, format);
                    scale_codes.push(e8m0(k));
                    let scale = e8m0_value(e8m0(k));
                    (1.0 / scale, scale)
                }
                Scaling::Nv { .. } => {
                    // The block scale in the tensor scale's units, stored as E4M3.
                    let code = Minifloat::E4M3.encode(block_amax / format.max() * tensor_encode);
                    scale_codes.push(code);
                    let stored = Minifloat::E4M3.decode(code);
                    match stored > 0.0 {
                        true => (tensor_encode / stored, stored / tensor_encode),
                        false => (0.0, 0.0),
                    }
                }
            };
            factors.push(factor);
            scales.push(scale);
        }
    }
    let codes = (0..r * c)
        .map(|i| {
            let (row, col) = (i / c, i % c);
            let scaled = x[i] * factors[(row / br) * grid[1] + col / bc];
            match uniform {
                Some(u) => format.encode_stochastic(scaled, u[i]),
                None => format.encode(scaled),
            }
        })
        .collect();
    Quantized {
        format,
        scaling,
        shape,
        codes,
        scales,
        scale_codes: matches!(scaling, Scaling::Mx | Scaling::Nv { .. }).then_some(scale_codes),
    }
}

/// The MX block exponent: the smallest `k` with `amax / 2^k ≤ max`, clamped to E8M0's range;
/// −127 for an all-zero block.
fn mx_exponent(amax: f32, format: Minifloat) -> i32 {
    if !(amax > 0.0 && amax.is_finite()) {
        return -127;
    }
    let ratio = amax as f64 / format.max() as f64;
    let mut k = ratio.log2().ceil() as i32;
    // log2 rounded onto a neighbouring integer: settle on the smallest k that fits.
    while ratio > 2f64.powi(k) {
        k += 1;
    }
    while k > -127 && ratio <= 2f64.powi(k - 1) {
        k -= 1;
    }
    k.clamp(-127, 127)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seeded values spread over many binades, with signs.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = (state >> 11) as f64 / (1u64 << 53) as f64;
                let sign = if state & 1 == 0 { 1.0 } else { -1.0 };
                (sign * 10f64.powf(6.0 * u - 3.0)) as f32
            })
            .collect()
    }

    /// Each block's largest magnitude becomes the format's largest code under block scaling
    /// (exactly, bar rounding of the division) and the error of every value is within half a
    /// step of its binade, relative to the block's scale.
    #[test]
    fn block_scaling_maps_each_amax_to_the_top() {
        let shape = [130, 300]; // ragged against 128 both ways
        let x = values(130 * 300, 1);
        for (format, scaling) in [
            (Minifloat::E4M3, Scaling::Blocks { rows: 1, cols: 128 }),
            (Minifloat::E4M3, Scaling::Blocks { rows: 128, cols: 128 }),
            (Minifloat::E5M2, Scaling::Blocks { rows: 1, cols: 128 }),
        ] {
            let q = quantize(&x, shape, format, scaling, None);
            assert_eq!(q.scales.len(), q.grid()[0] * q.grid()[1]);
            let back = q.dequantize();
            let [br, bc] = scaling.block(shape);
            for (i, (&v, &b)) in x.iter().zip(&back).enumerate() {
                let (row, col) = (i / shape[1], i % shape[1]);
                let block = (row / br) * q.grid()[1] + col / bc;
                let step = 2f32.powi(-(format.mantissa_bits() as i32) - 1);
                let bound = (v.abs() * step).max(q.scales[block] * format.decode(1) / 2.0) * 1.0001;
                assert!(
                    (v - b).abs() <= bound,
                    "{scaling:?} {format:?} [{row}, {col}]: {v} → {b}"
                );
            }
            for block in 0..q.scales.len() {
                let top = (0..x.len())
                    .filter(|&i| (i / shape[1] / br) * q.grid()[1] + (i % shape[1]) / bc == block)
                    .map(|i| q.codes[i] & 0x7F)
                    .max()
                    .expect("a block has values");
                assert_eq!(top, format.max_code(), "{scaling:?} block {block}");
            }
        }
    }

    /// MX scales are powers of two no element saturates against, the smallest such; an all-zero
    /// block gets the smallest scale and zero codes.
    #[test]
    fn mx_scales_are_the_smallest_powers_of_two_that_fit() {
        let mut x = values(4 * 70, 2);
        x[..32].fill(0.0);
        let q = quantize(&x, [4, 70], Minifloat::E4M3, Scaling::Mx, None);
        let codes = q.scale_codes.clone().expect("E8M0 codes");
        assert_eq!(codes.len(), 4 * 3);
        assert_eq!((codes[0], q.scales[0]), (0, 2f32.powi(-127)));
        assert!(q.codes[..32].iter().all(|&c| c == 0));
        for (block, &scale) in q.scales.iter().enumerate().skip(1) {
            let (row, gc) = (block / 3, block % 3);
            let amax = block_amax(&x, [4, 70], [1, 32], (row, gc));
            assert!(
                amax / scale <= 448.0 && amax / (scale / 2.0) > 448.0,
                "block {block}: {amax} / {scale}"
            );
        }
    }

    /// NVFP4: the tensor scale maps the amax to 6 · 448; each block scale is the E4M3 code of
    /// `amax_block / 6` in its units; the dequantized values stay within FP4's half step of the
    /// block's range.
    #[test]
    fn nvfp4_two_level_scales() {
        let shape = [32, 40];
        let x = values(32 * 40, 3);
        for rows in [1, 16] {
            let q = quantize(&x, shape, Minifloat::E2M1, Scaling::Nv { rows }, None);
            let tensor_encode = 6.0 * 448.0 / amax(&x);
            let codes = q.scale_codes.clone().expect("E4M3 codes");
            assert_eq!(codes.len(), q.grid()[0] * q.grid()[1]);
            let back = q.dequantize();
            for (block, &code) in codes.iter().enumerate() {
                let (gr, gc) = (block / q.grid()[1], block % q.grid()[1]);
                let amax = block_amax(&x, shape, [rows, 16], (gr, gc));
                assert_eq!(
                    code,
                    Minifloat::E4M3.encode(amax / 6.0 * tensor_encode),
                    "block {block}"
                );
                assert_eq!(q.scales[block], Minifloat::E4M3.decode(code) / tensor_encode);
            }
            for (i, (&v, &b)) in x.iter().zip(&back).enumerate() {
                let block = (i / 40 / rows) * q.grid()[1] + (i % 40) / 16;
                // FP4's coarsest step is 2 (between 4 and 6): half of it in the block's scale,
                // plus E4M3's rounding of the scale itself (2⁻⁴ relative) on the largest value.
                let bound = q.scales[block] * (1.0 + 6.0 * 0.0625) * 1.0001;
                assert!(
                    (v - b).abs() <= bound,
                    "rows {rows} [{}, {}]: {v} → {b}",
                    i / 40,
                    i % 40
                );
            }
        }
    }

    /// Tensorwise scaling multiplies by the given scale and encodes; the current-scaling scale
    /// maps the amax to the top code; zero and non-finite amaxes scale by 1.
    #[test]
    fn tensorwise_current_scaling() {
        let x = values(50, 4);
        let scale = quantize_scale(Minifloat::E4M3, amax(&x), 0);
        let q = quantize(
            &x,
            [5, 10],
            Minifloat::E4M3,
            Scaling::Tensor { quantize_scale: scale },
            None,
        );
        assert_eq!(q.scales, vec![1.0 / scale]);
        let expected: Vec<u8> = x.iter().map(|&v| Minifloat::E4M3.encode(v * scale)).collect();
        assert_eq!(q.codes, expected);
        assert_eq!(q.codes.iter().map(|c| c & 0x7F).max(), Some(0x7E));
        assert_eq!(quantize_scale(Minifloat::E4M3, 0.0, 0), 1.0);
        assert_eq!(quantize_scale(Minifloat::E4M3, f32::INFINITY, 0), 1.0);
        assert_eq!(quantize_scale(Minifloat::E4M3, 448.0, 1), 0.5);
    }
}
