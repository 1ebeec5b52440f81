//! The block kernels. Each reads a compact tensor `x`: the operand itself, or the compact tensor
//! whose transpose the operand is (a GEMM's `wᵀ`, `dyᵀ`, `xᵀ`), so no copy is made of a view.
//!
//! - [`fake_blocks_kernel`]: a thread a block of `x`'s own layout. The operand's blocks where
//!   `x` is the operand, and its square blocks (16 × 16) where `x` is its transpose, a
//!   transpose-invariant set; with the Hadamard transform, the operand's 1 × 16 blocks.
//! - [`fake_columns_kernel`]: where `x` is the operand's transpose, its 1 × k blocks run down
//!   `x`'s columns. A thread takes 8 side by side (16-byte loads, a warp's 32 threads on one
//!   row's 512 bytes) and `k` rows.
//! - [`hadamard_amax_kernel`]: the tensor amax of the transformed operand (NVFP4 scales by it),
//!   a partial a CUDA block.
//!
//! Values are read in the pass that takes the block amax and again in the pass that rounds
//! them (a cache hit), or held in registers where they are transformed.

use cubecl::prelude::*;

use super::VECTOR;
use super::numerics::{Plan, block_scales, draws_key, fake_value, hadamard16, nv_encode};
use crate::cuda::reduce::block_max;
use crate::cuda::reduce::finish_max;

/// The flat index of `x`'s element `(row, column)` in the operand, whose rows are `width` long.
#[cube]
fn operand_index(row: u32, column: u32, width: u32, #[comptime] transposed: bool) -> u32 {
    let mut index = row * width + column;
    if comptime!(transposed) {
        index = column * width + row;
    }
    index
}

/// NVFP4's encoding factor from the tensor amax (`[1]`); MX reads none.
#[cube]
fn encode_of(amax: &Tensor<f32>, #[comptime] plan: Plan) -> f32 {
    let mut encode = 0.0f32;
    if comptime!(plan.nv) {
        encode = nv_encode(amax[0]);
    }
    encode
}

/// The draws' key where the plan rounds stochastically, from the operand (`[r, c]`).
#[cube]
fn key_of<F: Float, N: Size>(x: &Tensor<Vector<F, N>>, r: u32, c: u32, #[comptime] plan: Plan) -> u32 {
    let mut key = 0u32;
    if comptime!(plan.stochastic) {
        key = draws_key(x, r, c, comptime!(plan.transposed));
    }
    key
}

/// Row `row`'s 16 values from `first_column` of `x` (`[·, c]`, `c` a multiple of 8; zeros
/// past it), transformed.
#[cube]
fn load_row16<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    values: &mut Array<f32>,
    row: u32,
    first_column: u32,
    c: u32,
    #[comptime] signs: u32,
) {
    #[unroll]
    for v in 0..2u32 {
        let column = first_column + v * VECTOR;
        let mut loaded = Vector::<f32, N>::new(0.0f32);
        if column < c {
            loaded = Vector::<f32, N>::cast_from(x[((row * c + column) / VECTOR) as usize]);
        }
        #[unroll]
        for e in 0..VECTOR {
            values[(v * VECTOR + e) as usize] = loaded.extract(e as usize);
        }
    }
    hadamard16(values, 1u32, signs);
}

/// Rows `first_row..first_row + 16` of `x` (`[r, c]`; zeros past `r`) at columns
/// `column..column + 8`, each column transformed.
#[cube]
fn load_columns16<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    values: &mut Array<f32>,
    first_row: u32,
    column: u32,
    r: u32,
    c: u32,
    #[comptime] signs: u32,
) {
    #[unroll]
    for i in 0..16u32 {
        let row = first_row + i;
        let mut loaded = Vector::<f32, N>::new(0.0f32);
        if row < r {
            loaded = Vector::<f32, N>::cast_from(x[((row * c + column) / VECTOR) as usize]);
        }
        #[unroll]
        for e in 0..VECTOR {
            values[(i * VECTOR + e) as usize] = loaded.extract(e as usize);
        }
    }
    hadamard16(values, VECTOR, signs);
}

/// Grid: a thread a block of `x` (`[r, c]`, `c` a multiple of 8), `(block row, block column)`
/// from its index, column blocks fastest; `out` has `x`'s layout, rows `width` long (`c`, or
/// `c` padded to 16 with the transform). `amax` is the tensor's (`[1]`, read by NVFP4).
#[cube(launch_unchecked)]
pub(super) fn fake_blocks_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    amax: &Tensor<f32>,
    out: &mut Tensor<Vector<F, N>>,
    r: u32,
    c: u32,
    width: u32,
    #[comptime] plan: Plan,
) {
    let block_rows = comptime!(plan.rows);
    let block_width = comptime!(plan.columns);
    let block_columns = width.div_ceil(block_width);
    let id = ABSOLUTE_POS as u32;
    if id < r.div_ceil(block_rows) * block_columns {
        let first_row = (id / block_columns) * block_rows;
        let first_column = (id % block_columns) * block_width;
        let encode = encode_of(amax, plan);
        // The operand is `[c, r]` where `x` is its transpose.
        let mut operand_rows = r;
        let mut operand_width = c;
        if comptime!(plan.transposed) {
            operand_rows = c;
            operand_width = r;
        }
        let key = key_of(x, operand_rows, operand_width, plan);
        if comptime!(plan.hadamard.is_some()) {
            let signs = comptime!(plan.hadamard.unwrap_or(0));
            let mut values = Array::<f32>::new(16usize);
            load_row16(x, &mut values, first_row, first_column, c, signs);
            let mut block_amax = 0.0f32;
            #[unroll]
            for i in 0..16usize {
                block_amax = f32::max(block_amax, f32::abs(values[i]));
            }
            let both = block_scales(block_amax, encode, plan);
            let factor = both.extract(0usize);
            let scale = both.extract(1usize);
            #[unroll]
            for v in 0..2u32 {
                let at = first_row * width + first_column + v * VECTOR;
                let mut quantized = Vector::<f32, N>::empty();
                #[unroll]
                for e in 0..VECTOR {
                    let value = values[(v * VECTOR + e) as usize];
                    quantized.insert(e as usize, fake_value(value, factor, scale, at + e, key, plan));
                }
                out[(at / VECTOR) as usize] = Vector::cast_from(quantized);
            }
        } else {
            let last_row = u32::min(first_row + block_rows, r);
            let vectors = comptime!(plan.columns / VECTOR);
            // The block's amax; the padding past `r` and `c` is zero, which changes none.
            let mut block_amax = 0.0f32;
            for row in first_row..last_row {
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
            let both = block_scales(block_amax, encode, plan);
            let factor = both.extract(0usize);
            let scale = both.extract(1usize);
            for row in first_row..last_row {
                #[unroll]
                for v in 0..vectors {
                    let column = first_column + v * VECTOR;
                    if column < c {
                        let at = row * c + column;
                        let values = Vector::<f32, N>::cast_from(x[(at / VECTOR) as usize]);
                        let mut quantized = Vector::<f32, N>::empty();
                        #[unroll]
                        for e in 0..VECTOR {
                            let index = operand_index(row, column + e, operand_width, comptime!(plan.transposed));
                            let value = values.extract(e as usize);
                            quantized.insert(e as usize, fake_value(value, factor, scale, index, key, plan));
                        }
                        out[(at / VECTOR) as usize] = Vector::cast_from(quantized);
                    }
                }
            }
        }
    }
}

/// Grid: a thread 8 columns (`x` is `[r, c]`, `c` a multiple of 8) by one block's `plan.columns`
/// rows, columns fastest: 8 of the operand's 1 × k blocks, whose operand (`[c, r]`, `xᵀ`) has
/// rows `width` long (`r`, or `r` padded to 16 with the transform). `out` has `x`'s layout,
/// `[width, c]`. `amax` is the tensor's (`[1]`, read by NVFP4).
#[cube(launch_unchecked)]
pub(super) fn fake_columns_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    amax: &Tensor<f32>,
    out: &mut Tensor<Vector<F, N>>,
    r: u32,
    c: u32,
    width: u32,
    #[comptime] plan: Plan,
) {
    let depth = comptime!(plan.columns);
    let groups = c / VECTOR;
    let id = ABSOLUTE_POS as u32;
    if id < width.div_ceil(depth) * groups {
        let first_row = (id / groups) * depth;
        let column = (id % groups) * VECTOR;
        let encode = encode_of(amax, plan);
        let key = key_of(x, c, r, plan);
        let mut amaxes = Array::<f32>::new(VECTOR as usize);
        #[unroll]
        for e in 0..VECTOR {
            amaxes[e as usize] = 0.0f32;
        }
        if comptime!(plan.hadamard.is_some()) {
            let signs = comptime!(plan.hadamard.unwrap_or(0));
            let mut values = Array::<f32>::new(comptime!(16 * VECTOR) as usize);
            load_columns16(x, &mut values, first_row, column, r, c, signs);
            #[unroll]
            for i in 0..16u32 {
                #[unroll]
                for e in 0..VECTOR {
                    let value = f32::abs(values[(i * VECTOR + e) as usize]);
                    amaxes[e as usize] = f32::max(amaxes[e as usize], value);
                }
            }
            let mut factors = Array::<f32>::new(VECTOR as usize);
            let mut scales = Array::<f32>::new(VECTOR as usize);
            #[unroll]
            for e in 0..VECTOR {
                let both = block_scales(amaxes[e as usize], encode, plan);
                factors[e as usize] = both.extract(0usize);
                scales[e as usize] = both.extract(1usize);
            }
            #[unroll]
            for i in 0..16u32 {
                let row = first_row + i;
                let mut quantized = Vector::<f32, N>::empty();
                #[unroll]
                for e in 0..VECTOR {
                    let value = values[(i * VECTOR + e) as usize];
                    let index = (column + e) * width + row;
                    quantized.insert(
                        e as usize,
                        fake_value(value, factors[e as usize], scales[e as usize], index, key, plan),
                    );
                }
                out[((row * c + column) / VECTOR) as usize] = Vector::cast_from(quantized);
            }
        } else {
            let last_row = u32::min(first_row + depth, r);
            for row in first_row..last_row {
                let values = Vector::<f32, N>::cast_from(x[((row * c + column) / VECTOR) as usize]);
                #[unroll]
                for e in 0..VECTOR {
                    amaxes[e as usize] = f32::max(amaxes[e as usize], f32::abs(values.extract(e as usize)));
                }
            }
            let mut factors = Array::<f32>::new(VECTOR as usize);
            let mut scales = Array::<f32>::new(VECTOR as usize);
            #[unroll]
            for e in 0..VECTOR {
                let both = block_scales(amaxes[e as usize], encode, plan);
                factors[e as usize] = both.extract(0usize);
                scales[e as usize] = both.extract(1usize);
            }
            for row in first_row..last_row {
                let at = row * c + column;
                let values = Vector::<f32, N>::cast_from(x[(at / VECTOR) as usize]);
                let mut quantized = Vector::<f32, N>::empty();
                #[unroll]
                for e in 0..VECTOR {
                    let index = (column + e) * width + row;
                    let value = values.extract(e as usize);
                    quantized.insert(
                        e as usize,
                        fake_value(value, factors[e as usize], scales[e as usize], index, key, plan),
                    );
                }
                out[(at / VECTOR) as usize] = Vector::cast_from(quantized);
            }
        }
    }
}

/// Grid: a thread one 1 × 16 block of the operand (`x` `[r, c]` is the operand, or its
/// transpose with 8 such blocks a thread, as the quantizing kernels take them), transformed;
/// the largest |value| to `out[0]` ([`finish_max`]: one launch).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(super) fn hadamard_amax_kernel<F: Float, N: Size>(
    x: &Tensor<Vector<F, N>>,
    state: &mut Tensor<Atomic<u32>>,
    out: &mut Tensor<f32>,
    r: u32,
    c: u32,
    #[comptime] transposed: bool,
    #[comptime] signs: u32,
) {
    let id = ABSOLUTE_POS as u32;
    let mut amax = 0.0f32;
    if comptime!(transposed) {
        let groups = c / VECTOR;
        if id < r.div_ceil(16u32) * groups {
            let mut values = Array::<f32>::new(comptime!(16 * VECTOR) as usize);
            load_columns16(x, &mut values, (id / groups) * 16, (id % groups) * VECTOR, r, c, signs);
            #[unroll]
            for i in 0..comptime!(16 * VECTOR) {
                amax = f32::max(amax, f32::abs(values[i as usize]));
            }
        }
    } else {
        let blocks = c.div_ceil(16u32);
        if id < r * blocks {
            let mut values = Array::<f32>::new(16usize);
            load_row16(x, &mut values, id / blocks, (id % blocks) * 16, c, signs);
            #[unroll]
            for i in 0..16usize {
                amax = f32::max(amax, f32::abs(values[i]));
            }
        }
    }
    finish_max(block_max(amax), state, out);
}
