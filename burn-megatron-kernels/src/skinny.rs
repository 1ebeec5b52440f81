//! Products of a few rows (`m ≤ 32`: a decoding step's tokens) by a weight, `[m, k] · [k, n]`,
//! bf16 in, f32 accumulation: bound by reading the weight once, which the wgmma GEMM's 128-row
//! tiles do on a handful of blocks (a 2048 × 2048 weight on 8 of 132 SMs). Two layouts of the
//! weight, both read in place:
//!
//! - `n` contiguous (a linear layer's `[d_in, d_out]` weight): a block takes 256 columns (8 a
//!   thread, 16-byte loads, a warp a whole 512-byte row) and a range of `k` shared by its 8
//!   warps; the ranges split `k` over enough blocks to fill the GPU twice, each writes f32
//!   partial sums, and a second kernel adds them up and rounds once.
//! - `k` contiguous (a transposed view, as the tied output layer reads the embedding): a warp a
//!   column, its lanes along `k`, the row sums from shuffles.
//!
//! Rows come 8 at a time (a block's registers hold 8 rows' sums); a third grid dimension takes
//! the next 8.

use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::{bf16, f16};

use crate::elementwise::{compact_input, compact_output, launch_dims, launch_float};

/// The most rows this product takes; above it the wgmma GEMM's tiles are full enough.
pub(crate) const MAX_ROWS: usize = 32;
/// Rows a block's registers hold.
const ROW_TILE: u32 = 8;
/// 8 bf16 a load.
const VECTOR: usize = 8;
/// Rows of the weight a warp has in flight.
const UNROLL: u32 = 4;
/// Blocks to aim for: two an SM of an H200.
const TARGET_BLOCKS: usize = 264;

/// Grid: (n / 256, splits of k, m / 8); block (32, 8). `partial` is `[splits, m, n]` f32.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rows_by_columns_kernel<F: Float, N: Size>(
    a: &Tensor<F>,
    b: &Tensor<Vector<F, N>>,
    partial: &mut Tensor<Vector<f32, N>>,
    rows: u32,
    depth: u32,
    columns: u32,
    ldb: u32,
    per_split: u32,
    #[comptime] tile: u32,
) {
    let column = CUBE_POS_X * 32 + UNIT_POS_X;
    let warp = UNIT_POS_Y;
    let split = CUBE_POS_Y;
    let first_row = CUBE_POS_Z * tile;
    let begin = split * per_split;
    let end = u32::min(begin + per_split, depth);
    let mut sums = Array::<Vector<f32, N>>::new(tile as usize);
    #[unroll]
    for i in 0..tile {
        sums[i as usize] = Vector::new(0.0f32);
    }
    if column < columns {
        // Four rows of the weight a warp loads before it uses them: four loads in flight.
        let mut k = begin + warp;
        loop {
            if k >= end {
                break;
            }
            let mut w = Array::<Vector<f32, N>>::new(UNROLL as usize);
            #[unroll]
            for u in 0..UNROLL {
                let row_k = k + u * 8;
                w[u as usize] = Vector::new(0.0f32);
                if row_k < end {
                    w[u as usize] = Vector::<f32, N>::cast_from(b[(row_k * ldb + column) as usize]);
                }
            }
            #[unroll]
            for u in 0..UNROLL {
                let row_k = k + u * 8;
                #[unroll]
                for i in 0..tile {
                    let row = first_row + i;
                    if row < rows && row_k < end {
                        let x = f32::cast_from(a[(row * depth + row_k) as usize]);
                        sums[i as usize] += w[u as usize] * Vector::new(x);
                    }
                }
            }
            k += 8 * UNROLL;
        }
    }
    let mut warps = Shared::<[Vector<f32, N>]>::new_slice(256usize);
    #[unroll]
    for i in 0..tile {
        warps[(warp * 32 + UNIT_POS_X) as usize] = sums[i as usize];
        sync_cube();
        let row = first_row + i;
        if warp == 0 && column < columns && row < rows {
            let mut total = warps[UNIT_POS_X as usize];
            for w in 1..8u32 {
                total += warps[(w * 32 + UNIT_POS_X) as usize];
            }
            partial[((split * rows + row) * columns + column) as usize] = total;
        }
        sync_cube();
    }
}

/// `out = Σ_splits partial`, rounded once. Grid: a thread a vector of `out`.
#[cube(launch_unchecked)]
fn split_sum_kernel<F: Float, N: Size>(partial: &Tensor<Vector<f32, N>>, out: &mut Tensor<Vector<F, N>>, splits: u32) {
    let i = ABSOLUTE_POS;
    let len = out.len();
    if i < len {
        let mut total = partial[i];
        for s in 1..splits {
            total += partial[s as usize * len + i];
        }
        out[i] = Vector::cast_from(total);
    }
}

/// Grid: (n / 8, 1, m / 8); block (32, 8): a warp a column, its lanes along `k` (in vectors).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rows_by_rows_kernel<F: Float, N: Size>(
    a: &Tensor<Vector<F, N>>,
    bt: &Tensor<Vector<F, N>>,
    out: &mut Tensor<F>,
    rows: u32,
    depth: u32,
    columns: u32,
    ldb: u32,
    #[comptime] tile: u32,
) {
    let column = CUBE_POS_X * 8 + UNIT_POS_Y;
    let lane = UNIT_POS_X;
    let first_row = CUBE_POS_Z * tile;
    if column < columns {
        let mut sums = Array::<f32>::new(tile as usize);
        #[unroll]
        for i in 0..tile {
            sums[i as usize] = 0.0f32;
        }
        for k in range_stepped(lane, depth, 32u32) {
            let w = Vector::<f32, N>::cast_from(bt[(column * ldb + k) as usize]);
            #[unroll]
            for i in 0..tile {
                let row = first_row + i;
                if row < rows {
                    let x = Vector::<f32, N>::cast_from(a[(row * depth + k) as usize]);
                    sums[i as usize] += crate::row_kernels::hsum(w * x);
                }
            }
        }
        #[unroll]
        for i in 0..tile {
            let total = plane_sum(sums[i as usize]);
            let row = first_row + i;
            if lane == 0 && row < rows {
                out[(row * columns + column) as usize] = F::cast_from(total);
            }
        }
    }
}

/// `lhs · rhs` when `lhs` has at most [`MAX_ROWS`] rows and `rhs` has a contiguous dim the
/// kernels read (with whole 16-byte vectors); `None` otherwise.
pub(crate) fn gemm(lhs: &CubeTensor, rhs: &CubeTensor) -> Option<CubeTensor> {
    let (ls, rs) = (lhs.meta.shape(), rhs.meta.shape());
    let fits = ls.num_dims() == 2
        && rs.num_dims() == 2
        && matches!(lhs.dtype, DType::BF16 | DType::F16)
        && rhs.dtype == lhs.dtype
        && ls[0] >= 1
        && ls[0] <= MAX_ROWS
        && ls[1] == rs[0]
        && rs[1] > 0;
    if !fits {
        return None;
    }
    let (m, k, n) = (ls[0], ls[1], rs[1]);
    let strides = rhs.meta.strides();
    let row_tiles = m.div_ceil(ROW_TILE as usize) as u32;
    if strides[1] == 1 && n.is_multiple_of(VECTOR) && strides[0].is_multiple_of(VECTOR) {
        let a = compact_input(lhs.clone())?;
        let vectors = n / VECTOR;
        let column_blocks = vectors.div_ceil(32);
        let splits = (TARGET_BLOCKS / (column_blocks * row_tiles as usize)).clamp(1, k.div_ceil(64));
        let per_split = k.div_ceil(splits);
        let splits = k.div_ceil(per_split);
        let partial = compact_output(&a, Shape::from(vec![splits, m, n]), DType::F32);
        let out = compact_output(&a, Shape::from(vec![m, n]), a.dtype);
        launch_float!(
            a.dtype,
            rows_by_columns_kernel,
            &a.client,
            CubeCount::Static(column_blocks as u32, splits as u32, row_tiles),
            CubeDim::new_2d(32, 8),
            VECTOR,
            a.clone().into_tensor_arg(),
            rhs.clone().into_tensor_arg(),
            partial.clone().into_tensor_arg(),
            m as u32,
            k as u32,
            vectors as u32,
            (strides[0] / VECTOR) as u32,
            per_split as u32,
            ROW_TILE,
        );
        let (count, dim) = launch_dims(m * n, VECTOR);
        launch_float!(
            a.dtype,
            split_sum_kernel,
            &a.client,
            count,
            dim,
            VECTOR,
            partial.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            splits as u32,
        );
        return Some(out);
    }
    if strides[0] == 1 && k.is_multiple_of(VECTOR) && strides[1].is_multiple_of(VECTOR) {
        let a = compact_input(lhs.clone())?;
        let out = compact_output(&a, Shape::from(vec![m, n]), a.dtype);
        launch_float!(
            a.dtype,
            rows_by_rows_kernel,
            &a.client,
            CubeCount::Static(n.div_ceil(8) as u32, 1, row_tiles),
            CubeDim::new_2d(32, 8),
            VECTOR,
            a.clone().into_tensor_arg(),
            rhs.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            m as u32,
            (k / VECTOR) as u32,
            n as u32,
            (strides[1] / VECTOR) as u32,
            ROW_TILE,
        );
        return Some(out);
    }
    None
}
