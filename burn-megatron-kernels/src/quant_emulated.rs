//! MX and NVFP4 blocks quantized and dequantized in one pass on CUDA: the emulated recipes'
//! operands (`quant::fake::fake_quantize`, ~25 tensor ops an operand) from one kernel reading
//! the operand twice (its block's amax, then its values), in the operand's dtype. The same f32
//! arithmetic as the tensor ops, in the same order, so the values are theirs bit for bit:
//!
//! - MX (1×32, E4M3): the E8M0 scale `2^k`, `k` the smallest with `amax ≤ 448 · 2^k` (from the
//!   amax's exponent and mantissa bits), each value times `2^−k` rounded onto E4M3, times `2^k`.
//! - NVFP4 (1×16 or 16×16, E2M1): the tensor's amax (one more pass, reduced over the group
//!   first) gives `encode = 448 / amax · 6`; a block's E4M3 scale `stored` is `amax_b / 6 ·
//!   encode` rounded onto E4M3; each value times `encode / stored` rounded onto E2M1 (to
//!   nearest, or stochastically), times `stored / encode`.
//!
//! Stochastic rounding draws `quant::fake::draws`'s values from the key `quant::product` hashes
//! from the operand's shape and four of its values; the kernel hashes them itself, so no value
//! goes to the host.

use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::{bf16, f16};

use crate::elementwise::{compact_input, compact_output, launch_float};
use crate::quant::format::Minifloat;
use crate::quant::recipe::{Blocks, Quantizer, Rounding};
use crate::quant_kernels::hash32;

/// Values a load: 8.
const VECTOR: u32 = 8;

/// A format's grid as the rounding needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Grid {
    mantissa: u32,
    /// The smallest normal exponent, `1 − bias`.
    min_exponent: i32,
    max_bits: u32,
}

impl Grid {
    fn of(format: Minifloat) -> Self {
        Self {
            mantissa: format.mantissa_bits(),
            min_exponent: 1 - format.bias(),
            max_bits: format.max().to_bits(),
        }
    }
}

/// `2^k` for `k` in `[−149, 127]`, exactly (subnormal below `−126`).
#[cube]
fn pow2(k: i32) -> f32 {
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
fn round_onto(y: f32, draw: f32, #[comptime] grid: Grid, #[comptime] stochastic: bool) -> f32 {
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

/// `quant::fake`'s SplitMix64 finalizer.
#[cube]
fn mix(z: u64) -> u64 {
    let mut z = z + 0x9E37_79B9_7F4A_7C15u64;
    z = (z ^ (z >> 30u64)) * 0xBF58_476D_1CE4_E5B9u64;
    z = (z ^ (z >> 27u64)) * 0x94D0_49BB_1331_11EBu64;
    z ^ (z >> 31u64)
}

/// The draws' key `quant::product` derives for `x` (`[r, c]`): its shape and the f32 bits of
/// the values at `(0, 0)`, `(r/2, c/3)`, `(r/3, c/2)`, `(r−1, c−1)`, folded, then mixed.
#[cube]
// `rotate_left` has no CubeCL expansion.
#[allow(clippy::manual_rotate)]
fn draws_key<F: Float, N: Size>(x: &Tensor<Vector<F, N>>, r: u32, c: u32) -> u32 {
    let mut h = (u64::cast_from(r) << 32u64) ^ u64::cast_from(c);
    let mut at = Array::<u32>::new(4usize);
    at[0] = 0;
    at[1] = (r / 2) * c + c / 3;
    at[2] = (r / 3) * c + c / 2;
    at[3] = r * c - 1;
    #[unroll]
    for i in 0..4 {
        let index = at[i];
        let v = f32::cast_from(x[(index / VECTOR) as usize].extract_dynamic((index % VECTOR) as usize));
        h = ((h << 17u64) | (h >> 47u64)) ^ u64::cast_from(u32::reinterpret(v));
    }
    u32::cast_from(mix(h) & 0xFFFF_FFFFu64)
}

/// What the kernel scales by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Plan {
    /// A block's rows and columns (1 × 32 MX; 1 × 16 or 16 × 16 NVFP4).
    rows: u32,
    columns: u32,
    /// NVFP4's two levels, else MX.
    nv: bool,
    stochastic: bool,
    values: Grid,
}

/// Grid: a thread a block, `(block row, block column)` from its index, column blocks fastest.
/// `amax` is the tensor's (`[1]`, read by NVFP4). `x` and `out` are compact `[r, c]`, `c` a
/// multiple of 8.
#[cube(launch_unchecked)]
fn fake_blocks_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    amax: &Tensor<f32>,
    out: &mut Tensor<Vector<F, N>>,
    r: u32,
    c: u32,
    #[comptime] plan: Plan,
) {
    let block_columns = c.div_ceil(comptime!(plan.columns));
    let blocks = r.div_ceil(comptime!(plan.rows)) * block_columns;
    let id = ABSOLUTE_POS as u32;
    if id < blocks {
        quantize_block(x, amax, out, r, c, id, block_columns, plan);
    }
}

/// [`fake_blocks_kernel`]'s block `id`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn quantize_block<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    amax: &Tensor<f32>,
    out: &mut Tensor<Vector<F, N>>,
    r: u32,
    c: u32,
    id: u32,
    block_columns: u32,
    #[comptime] plan: Plan,
) {
    let block_rows = comptime!(plan.rows);
    let first_row = (id / block_columns) * block_rows;
    let first_column = (id % block_columns) * comptime!(plan.columns);
    let vectors = comptime!(plan.columns / VECTOR);
    // The block's amax; the padding past `r` and `c` is zero, which changes none.
    let mut block_amax = 0.0f32;
    for row in first_row..u32::min(first_row + block_rows, r) {
        #[unroll]
        for v in 0..vectors {
            let column = first_column + v * VECTOR;
            if column < c {
                let values = Vector::<f32, N>::cast_from(x[((row * c + column) / VECTOR) as usize]);
                #[unroll]
                for e in 0..VECTOR {
                    block_amax = f32::max(block_amax, f32::abs(values.extract(e as usize)));
                }
            }
        }
    }
    let mut factor = 0.0f32;
    let mut scale = 0.0f32;
    if comptime!(plan.nv) {
        // `448 / amax`, 1 where it is not finite, times E2M1's 6.
        let t = amax[0];
        let mut encode = 448.0f32 / t;
        if !(f32::abs(t) <= 3.402_823_5e38f32 && f32::abs(encode) <= 3.402_823_5e38f32) {
            encode = 1.0;
        }
        encode *= 6.0f32;
        let stored = round_onto(
            block_amax / 6.0f32 * encode,
            0.0,
            comptime!(Grid::of(Minifloat::E4M3)),
            false,
        );
        if stored != 0.0 {
            factor = encode / stored;
            scale = stored / encode;
        }
    } else {
        let k = mx_exponent(block_amax, comptime!(plan.values));
        scale = pow2(k);
        factor = 1.0f32 / scale;
    }
    let mut key = 0u32;
    if comptime!(plan.stochastic) {
        key = draws_key(x, r, c);
    }
    for row in first_row..u32::min(first_row + block_rows, r) {
        #[unroll]
        for v in 0..vectors {
            let column = first_column + v * VECTOR;
            if column < c {
                let at = row * c + column;
                let values = Vector::<f32, N>::cast_from(x[(at / VECTOR) as usize]);
                let mut quantized = Vector::<f32, N>::empty();
                #[unroll]
                for e in 0..VECTOR {
                    let mut draw = 0.0f32;
                    if comptime!(plan.stochastic) {
                        draw = f32::cast_from(hash32((at + e) ^ key) >> 8u32) * (1.0f32 / 16_777_216.0f32);
                    }
                    let scaled = values.extract(e as usize) * factor;
                    quantized.insert(
                        e as usize,
                        round_onto(scaled, draw, comptime!(plan.values), comptime!(plan.stochastic)) * scale,
                    );
                }
                out[(at / VECTOR) as usize] = Vector::cast_from(quantized);
            }
        }
    }
}

/// `x` (`[r, c]`) quantized with `q` and dequantized, in `x`'s dtype, where the kernel takes it:
/// MX or NVFP4 blocks, a bf16 or f32 `x` with `c` a multiple of 8. `amax` gives NVFP4's
/// tensor amax (`[1]`, f32) from the operand's own (its group's reduction). `None` otherwise.
pub(crate) fn fake_quantize(
    x: CubeTensor,
    q: Quantizer,
    amax: impl FnOnce(CubeTensor) -> CubeTensor,
) -> Option<CubeTensor> {
    let [rows, columns] = match q.blocks {
        Blocks::Mx if q.format == Minifloat::E4M3 => [1, crate::quant::scaling::MX_BLOCK],
        Blocks::Nv { rows } if q.format == Minifloat::E2M1 && matches!(rows, 1 | 16) => {
            [rows, crate::quant::scaling::NV_BLOCK]
        }
        _ => return None,
    };
    let dims = x.meta.shape().clone();
    let fits = dims.num_dims() == 2
        && matches!(x.dtype, DType::BF16 | DType::F32)
        && dims[1].is_multiple_of(VECTOR as usize)
        && dims[0] * dims[1] > 0
        && dims[0] * dims[1] < u32::MAX as usize;
    if !fits {
        return None;
    }
    let x = compact_input(x)?;
    let (r, c) = (dims[0], dims[1]);
    let nv = matches!(q.blocks, Blocks::Nv { .. });
    let tensor_amax = match nv {
        true => amax(crate::quant_kernels::tensor_amax(x.clone())),
        false => compact_output(&x, Shape::new([1]), DType::F32),
    };
    let plan = Plan {
        rows: rows as u32,
        columns: columns as u32,
        nv,
        stochastic: q.rounding == Rounding::Stochastic,
        values: Grid::of(q.format),
    };
    let out = compact_output(&x, Shape::new([r, c]), x.dtype);
    let blocks = (r.div_ceil(rows) * c.div_ceil(columns)) as u32;
    let count = CubeCount::Static(blocks.div_ceil(256), 1, 1);
    let dim = CubeDim::new_1d(256);
    // SAFETY (`launch_float!`): a thread a block, checked against the block count; every load
    // and store is a whole vector of a row below `r`, at a column below `c` (a multiple of 8),
    // of compact `[r, c]` tensors; `amax` holds one value.
    launch_float!(
        x.dtype,
        fake_blocks_kernel,
        &x.client,
        count,
        dim,
        VECTOR as usize,
        x.clone().into_tensor_arg(),
        tensor_amax.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        r as u32,
        c as u32,
        plan,
    );
    Some(out)
}
