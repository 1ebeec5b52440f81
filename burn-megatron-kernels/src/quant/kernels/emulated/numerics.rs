//! The arithmetic the block kernels share, each step as `quant::fake`'s tensor ops do it in f32:
//! powers of two, rounding onto a minifloat grid, MX's E8M0 exponent, NVFP4's two-level scales,
//! the draws of stochastic rounding and the 16-point Hadamard transform.

use cubecl::prelude::*;

use super::VECTOR;
use crate::quant::format::Minifloat;
use crate::quant::kernels::cast::hash32;

/// A format's grid as the rounding needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Grid {
    mantissa: u32,
    /// The smallest normal exponent, `1 − bias`.
    min_exponent: i32,
    max_bits: u32,
}

impl Grid {
    pub(super) fn of(format: Minifloat) -> Self {
        Self {
            mantissa: format.mantissa_bits(),
            min_exponent: 1 - format.bias(),
            max_bits: format.max().to_bits(),
        }
    }
}

/// What a block kernel scales by and how it rounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Plan {
    /// A block's rows and columns (1 × 32 MX; 1 × 16 or 16 × 16 NVFP4), in the operand's own
    /// (logical) layout.
    pub rows: u32,
    pub columns: u32,
    /// NVFP4's two levels, else MX.
    pub nv: bool,
    pub stochastic: bool,
    pub values: Grid,
    /// The signs of the Hadamard transform applied along each block's 16 values first
    /// (bit `i` set: value `i` negated), or `None`.
    pub hadamard: Option<u32>,
    /// The operand is the transpose of the compact tensor the kernel reads.
    pub transposed: bool,
}

/// `2^k` for `k` in `[−149, 127]`, exactly (subnormal below `−126`).
#[cube]
pub(super) fn pow2(k: i32) -> f32 {
    let mut bits = 0u32;
    if k >= -126 {
        bits = u32::cast_from(k + 127) << 23u32;
    } else if k >= -149 {
        bits = 1u32 << u32::cast_from(k + 149);
    }
    f32::reinterpret(bits)
}

/// `y` rounded onto the grid and saturated at its largest value (`quant::fake::round_to`): the
/// binade's power of two from the exponent bits, a whole number of steps of
/// `2^(e − mantissa)`, to nearest (ties to even) or `⌊steps + draw⌋`.
#[cube]
pub(super) fn round_onto(y: f32, draw: f32, #[comptime] grid: Grid, #[comptime] stochastic: bool) -> f32 {
    let max = f32::reinterpret(comptime!(grid.max_bits));
    let a = f32::min(f32::abs(y), max);
    let binade = f32::max(a, pow2(comptime!(grid.min_exponent)));
    let power = f32::reinterpret(u32::reinterpret(binade) & 0x7F80_0000u32);
    let step = power * pow2(comptime!(-(grid.mantissa as i32)));
    let steps = a / step;
    let mut whole = f32::round(steps);
    if comptime!(stochastic) {
        whole = f32::floor(steps + draw);
    }
    let value = f32::min(whole * step, max);
    let mut sign = 0.0f32;
    if y > 0.0f32 {
        sign = 1.0f32;
    } else if y < 0.0f32 {
        sign = -1.0f32;
    }
    value * sign
}

/// The MX exponent: the smallest `k` with `amax ≤ max · 2^k` in `[−127, 127]`; −127 for a zero,
/// subnormal or non-finite amax (whose `k` clamps there, or which the emulation sends there).
#[cube]
fn mx_exponent(amax: f32, #[comptime] grid: Grid) -> i32 {
    let bits = u32::reinterpret(amax);
    let biased = (bits >> 23u32) & 0xFFu32;
    let max_bits = comptime!(grid.max_bits);
    let max_exponent = comptime!(((grid.max_bits >> 23) & 0xFF) as i32 - 127);
    // `amax` and `max · 2^(e − emax)` share the binade `e`: one more where the mantissa is larger.
    let above = (bits & 0x7F_FFFFu32) > (max_bits & 0x7F_FFFFu32);
    let k = i32::cast_from(biased) - 127i32 - max_exponent + select(above, 1i32, 0i32);
    // A normal amax's `k` is at most `127 − emax`: only the floor binds.
    let normal = biased != 0u32 && biased != 0xFFu32 && k > -127i32;
    select(normal, k, -127i32)
}

/// NVFP4's encoding factor from the tensor amax: `448 / amax` (1 where it is not finite) times
/// E2M1's 6.
#[cube]
pub(super) fn nv_encode(tensor_amax: f32) -> f32 {
    let mut encode = 448.0f32 / tensor_amax;
    if !(f32::abs(tensor_amax) <= 3.402_823_5e38f32 && f32::abs(encode) <= 3.402_823_5e38f32) {
        encode = 1.0;
    }
    encode * 6.0f32
}

/// A block's `(factor, scale)`: its values are multiplied by `factor`, rounded, and multiplied
/// by `scale`. NVFP4: the block's E4M3 scale `stored = amax / 6 · encode` rounded, `encode /
/// stored` and `stored / encode` (both 0 for an all-zero block); MX: `2^−k` and `2^k`.
#[cube]
pub(super) fn block_scales(block_amax: f32, encode: f32, #[comptime] plan: Plan) -> Vector<f32, Const<2>> {
    let mut scales = Vector::<f32, Const<2>>::new(0.0f32);
    if comptime!(plan.nv) {
        let stored = round_onto(
            block_amax / 6.0f32 * encode,
            0.0,
            comptime!(Grid::of(Minifloat::E4M3)),
            false,
        );
        if stored != 0.0 {
            scales.insert(0usize, encode / stored);
            scales.insert(1usize, stored / encode);
        }
    } else {
        let scale = pow2(mx_exponent(block_amax, comptime!(plan.values)));
        scales.insert(0usize, 1.0f32 / scale);
        scales.insert(1usize, scale);
    }
    scales
}

/// `value` quantized and dequantized with a block's factor and scale; stochastic rounding draws value
/// `index` (the flat index in the quantized operand) of `quant::fake::draws` for `key`.
#[cube]
pub(super) fn fake_value(value: f32, factor: f32, scale: f32, index: u32, key: u32, #[comptime] plan: Plan) -> f32 {
    let mut draw = 0.0f32;
    if comptime!(plan.stochastic) {
        draw = f32::cast_from(hash32(index ^ key) >> 8u32) * (1.0f32 / 16_777_216.0f32);
    }
    round_onto(value * factor, draw, comptime!(plan.values), comptime!(plan.stochastic)) * scale
}

/// `quant::fake`'s SplitMix64 finalizer.
#[cube]
fn mix(z: u64) -> u64 {
    let mut z = z + 0x9E37_79B9_7F4A_7C15u64;
    z = (z ^ (z >> 30u64)) * 0xBF58_476D_1CE4_E5B9u64;
    z = (z ^ (z >> 27u64)) * 0x94D0_49BB_1331_11EBu64;
    z ^ (z >> 31u64)
}

/// The draws' key `quant::product` derives for `x` (`[r, c]`, read from the compact tensor the
/// kernel takes: `x` itself, or `xᵀ` where `transposed`): its shape and the f32 bits of the
/// values at `(0, 0)`, `(r/2, c/3)`, `(r/3, c/2)`, `(r−1, c−1)`, folded, then mixed.
#[cube]
// `rotate_left` has no CubeCL expansion.
#[allow(clippy::manual_rotate)]
pub(super) fn draws_key<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    r: u32,
    c: u32,
    #[comptime] transposed: bool,
) -> u32 {
    let mut h = (u64::cast_from(r) << 32u64) ^ u64::cast_from(c);
    let mut at = Array::<u32>::new(8usize);
    at[0] = 0;
    at[1] = 0;
    at[2] = r / 2;
    at[3] = c / 3;
    at[4] = r / 3;
    at[5] = c / 2;
    at[6] = r - 1;
    at[7] = c - 1;
    #[unroll]
    for i in 0..4u32 {
        let row = at[(2 * i) as usize];
        let column = at[(2 * i + 1) as usize];
        let mut index = row * c + column;
        if comptime!(transposed) {
            index = column * r + row;
        }
        let v = f32::cast_from(x[(index / VECTOR) as usize].extract_dynamic((index % VECTOR) as usize));
        h = ((h << 17u64) | (h >> 47u64)) ^ u64::cast_from(u32::reinterpret(v));
    }
    u32::cast_from(mix(h) & 0xFFFF_FFFFu64)
}

/// The Hadamard transform of `quant::fake::hadamard` along 16 values, `lanes` transforms side
/// by side (value `i` of lane `l` at `i · lanes + l`): each value negated where its sign bit is
/// set, Sylvester's butterflies over strides 1, 2, 4, 8 (`(a, b) → (a + b, a − b)`), times ¼.
#[cube]
pub(super) fn hadamard16(values: &mut Array<f32>, #[comptime] lanes: u32, #[comptime] signs: u32) {
    #[unroll]
    for i in 0..16u32 {
        let negate = ((comptime!(signs) >> i) & 1u32) == 1u32;
        #[unroll]
        for l in 0..lanes {
            let at = (i * lanes + l) as usize;
            values[at] = select(negate, -values[at], values[at]);
        }
    }
    #[unroll]
    for s in 0..4u32 {
        let h = 1u32 << s;
        #[unroll]
        for p in 0..8u32 {
            // The `p`-th index whose bit `s` is clear, and its partner.
            let i = (p / h) * 2 * h + p % h;
            #[unroll]
            for l in 0..lanes {
                let at = (i * lanes + l) as usize;
                let partner = ((i + h) * lanes + l) as usize;
                let a = values[at];
                let b = values[partner];
                values[at] = a + b;
                values[partner] = a - b;
            }
        }
    }
    #[unroll]
    for i in 0..16 * lanes {
        values[i as usize] *= 0.25f32;
    }
}
