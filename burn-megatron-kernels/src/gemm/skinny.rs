//! Products of a few rows (`m ≤ 32`: a decoding step's tokens) by a weight, `[m, k] · [k, n]`,
//! bf16 in, f32 accumulation: bound by reading the weight once, which the wgmma GEMM's 128-row
//! tiles do on a handful of blocks (a 2048 × 2048 weight on 8 of 132 SMs).
//!
//! A warp multiplies all 32 rows (padded with zeros) by 64 columns of the weight on the tensor
//! cores (`mma.sync` m16n8k16: two row tiles, eight column tiles), 32 of `k` at a time, the
//! weight loaded straight from global memory into the B fragments, 16 bytes a load. Which `k`
//! and which column a fragment's element stands for is free as long as A and B agree, so each
//! lane loads whole 16-byte pieces:
//!
//! - `k` contiguous (a transposed view, as the tied output layer reads the embedding): lane
//!   `(g, q) = (l / 4, l % 4)` loads `k = 8q..8q+8` of column `8j + g` for each column tile `j`;
//!   its 4 pairs are the B fragments of both 16-deep steps.
//! - `n` contiguous (a linear layer's `[d_in, d_out]` weight): lane `(g, q)` loads rows
//!   `8q..8q+8` of `k` at columns `8g..8g+8`, so column tile `j` holds columns `8f + j` and the
//!   bf16 pairs along `k` are packed from two loaded rows. Eight lanes read each row's 128 bytes.
//!
//! In both, step `s`'s fragment `k` pair `(2q, 2q+1)` is `k = 8q + 4s + {0, 1}` and pair
//! `(2q+8, 2q+9)` is `8q + 4s + {2, 3}`, so A's fragments come from one 16-byte load a row.
//! The next chunk's loads are issued before this chunk's products. A block's 8 warps share its
//! 64 columns and split its range of `k`; their sums meet in shared memory, 16 rows at a time.
//! The ranges split `k` over blocks until the GPU is full; with more than one, each writes f32
//! partial sums and a second kernel adds them up and rounds once.

use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::bf16;

use crate::cuda::hopper::load;
use crate::cuda::launch::{compact_input, compact_output, launch_dims};
use crate::cuda::ptx::mma::MmaChunk;

/// The most rows this product takes; above it the wgmma GEMM's tiles are full enough.
pub(crate) const MAX_ROWS: usize = 32;
/// 8 bf16 a load.
const VECTOR: usize = 8;
/// Warps a block.
const WARPS: u32 = 8;
/// Columns a block (and each of its warps).
const COLUMNS: u32 = 64;
/// `k` a chunk: two 16-deep steps.
const DEPTH: u32 = 32;
/// Blocks to aim for: one an SM of an H200 (a block's 8 warps hold ~170 registers a thread).
const TARGET_BLOCKS: usize = 132;
/// A row of the shared-memory sums, padded against bank conflicts.
const STRIDE: u32 = COLUMNS + 1;
/// The chunk each warp multiplies.
const CHUNK: MmaChunk = MmaChunk {
    m_tiles: 2,
    n_tiles: 8,
    steps: 2,
};

/// Accumulators: 8 column tiles × 2 row tiles × 4.
type Acc = Vector<f32, Const<64>>;
/// A's loads (4 rows × 16 bytes), and its fragments.
type AFrags = Vector<u32, Const<16>>;
/// B's loads (8 × 16 bytes), and its fragments.
type BFrags = Vector<u32, Const<32>>;

/// `acc + A·B` over one chunk.
#[cube]
fn products(acc: &Acc, a: &AFrags, b: &BFrags) -> Acc {
    let body = comptime![CHUNK.ptx()];
    let old = load::<Acc>(acc);
    let a_frags = load::<AFrags>(a);
    let b_frags = load::<BFrags>(b);
    let out: Acc;
    gpu_asm!("{body}", "// {d} {c} {a} {b}", d = out(_) out, c = in(_) old, a = in(_) a_frags, b = in(_) b_frags);
    out
}

/// Lane `(g, q)`'s 16-byte pieces of A for the chunk at `kb`: rows `g + 8i`, `k = kb + 8q..+8`
/// (zeros past the rows or `end`), piece `i` in registers `4i..4i+4`.
#[cube]
fn load_a<F: Float, N: Size>(a: &Tensor<Vector<F, N>>, rows: u32, depth: u32, kb: u32, end: u32) -> AFrags {
    let g = UNIT_POS_X / 4;
    let q = UNIT_POS_X % 4;
    let mut raw = AFrags::empty();
    #[unroll]
    for i in 0..4u32 {
        let row = g + 8 * i;
        let k = kb + 8 * q;
        let mut piece = Vector::<u32, Const<4>>::new(0u32);
        if row < rows && k < end {
            piece = Vector::<u32, Const<4>>::reinterpret(a[((row * depth + k) / 8) as usize]);
        }
        #[unroll]
        for w in 0..4u32 {
            raw.insert((4 * i + w) as usize, piece.extract(w as usize));
        }
    }
    raw
}

/// The A fragments of a chunk from [`load_a`]'s pieces: row tile `i / 2`, `e` = `i % 2` (rows
/// `g`, `g + 8`) plus 2 for the step's second pair.
#[cube]
fn a_fragments(raw: &AFrags) -> AFrags {
    let mut frags = AFrags::empty();
    #[unroll]
    for i in 0..4u32 {
        #[unroll]
        for s in 0..2u32 {
            #[unroll]
            for p in 0..2u32 {
                let at = (s * 2 + i / 2) * 4 + i % 2 + 2 * p;
                frags.insert(at as usize, raw.extract((4 * i + 2 * s + p) as usize));
            }
        }
    }
    frags
}

/// Lane `(g, q)`'s 16-byte pieces of the weight for the chunk at `kb` (see the module docs):
/// `k` contiguous, column tile `j`'s in registers `4j..4j+4`; `n` contiguous, row `kb + 8q + i`'s.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_b<F: Float, N: Size>(
    b: &Tensor<Vector<F, N>>,
    first_column: u32,
    columns: u32,
    ldb: u32,
    kb: u32,
    end: u32,
    #[comptime] k_contiguous: bool,
) -> BFrags {
    let g = UNIT_POS_X / 4;
    let q = UNIT_POS_X % 4;
    let mut raw = BFrags::empty();
    #[unroll]
    for i in 0..8u32 {
        let mut piece = Vector::<u32, Const<4>>::new(0u32);
        if comptime!(k_contiguous) {
            let column = first_column + 8 * i + g;
            let k = kb + 8 * q;
            if column < columns && k < end {
                piece = Vector::<u32, Const<4>>::reinterpret(b[(column * ldb + k / 8) as usize]);
            }
        } else {
            let column = first_column + 8 * g;
            let k = kb + 8 * q + i;
            if column < columns && k < end {
                piece = Vector::<u32, Const<4>>::reinterpret(b[(k * ldb + column / 8) as usize]);
            }
        }
        #[unroll]
        for w in 0..4u32 {
            raw.insert((4 * i + w) as usize, piece.extract(w as usize));
        }
    }
    raw
}

/// The B fragments of a chunk from [`load_b`]'s pieces, register `(s · 8 + j) · 2 + e`: `k`
/// contiguous, word `2s + e` of column tile `j`'s piece; `n` contiguous, element `j` of rows
/// `4s + 2e` and `4s + 2e + 1` packed into one pair.
#[cube]
fn b_fragments(raw: &BFrags, #[comptime] k_contiguous: bool) -> BFrags {
    let mut frags = BFrags::empty();
    #[unroll]
    for s in 0..2u32 {
        #[unroll]
        for j in 0..8u32 {
            #[unroll]
            for e in 0..2u32 {
                let at = ((s * 8 + j) * 2 + e) as usize;
                if comptime!(k_contiguous) {
                    frags.insert(at, raw.extract((4 * j + 2 * s + e) as usize));
                } else {
                    let lo = raw.extract((4 * (4 * s + 2 * e) + j / 2) as usize);
                    let hi = raw.extract((4 * (4 * s + 2 * e + 1) + j / 2) as usize);
                    // Element `j` is the low half of word `j / 2` for even `j`.
                    let mut pair = (lo & 0xFFFFu32) | (hi << 16u32);
                    if j % 2 == 1 {
                        pair = (lo >> 16u32) | (hi & 0xFFFF0000u32);
                    }
                    frags.insert(at, pair);
                }
            }
        }
    }
    frags
}

/// Grid: (column blocks of 64, splits of `k`); block (32, 8). `out` is `[splits, m, n]` (f32
/// partial sums, or the result itself when there is one split). `ldb` and `per_split` are in
/// vectors of 8 and in elements (a multiple of 32).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn few_rows_kernel<F: Float, N: Size, O: Float>(
    a: &Tensor<Vector<F, N>>,
    b: &Tensor<Vector<F, N>>,
    out: &mut Tensor<O>,
    rows: u32,
    depth: u32,
    columns: u32,
    ldb: u32,
    per_split: u32,
    #[comptime] k_contiguous: bool,
) {
    let warp = UNIT_POS_Y;
    let first_column = CUBE_POS_X * COLUMNS;
    let split = CUBE_POS_Y;
    let begin = split * per_split;
    let end = u32::min(begin + per_split, depth);
    let mut acc = Acc::new(0.0f32);
    let mut kb = begin + warp * DEPTH;
    let mut a_raw = load_a(a, rows, depth, kb, end);
    let mut b_raw = load_b(b, first_column, columns, ldb, kb, end, k_contiguous);
    loop {
        if kb >= end {
            break;
        }
        let next = kb + WARPS * DEPTH;
        let a_next = load_a(a, rows, depth, next, end);
        let b_next = load_b(b, first_column, columns, ldb, next, end, k_contiguous);
        let a_frags = a_fragments(&a_raw);
        let b_frags = b_fragments(&b_raw, k_contiguous);
        acc = products(&acc, &a_frags, &b_frags);
        a_raw = a_next;
        b_raw = b_next;
        kb = next;
    }

    // The warps' sums, one 16-row tile at a time: element `e` of (column tile `j`, row tile
    // `t`) is row `g + 8 (e / 2)`, fragment column `f = 2q + e % 2`.
    let g = UNIT_POS_X / 4;
    let q = UNIT_POS_X % 4;
    let thread = warp * 32 + UNIT_POS_X;
    let mut sums = Shared::<[f32]>::new_slice((WARPS * 16 * STRIDE) as usize);
    #[unroll]
    for t in 0..2u32 {
        if t * 16 < rows {
            #[unroll]
            for j in 0..8u32 {
                #[unroll]
                for e in 0..4u32 {
                    let row = g + 8 * (e / 2);
                    let f = 2 * q + e % 2;
                    let column = if comptime!(k_contiguous) { 8 * j + f } else { 8 * f + j };
                    sums[((warp * 16 + row) * STRIDE + column) as usize] = acc.extract(((j * 2 + t) * 4 + e) as usize);
                }
            }
            sync_cube();
            #[unroll]
            for o in 0..(16 * COLUMNS / (32 * WARPS)) {
                let at = o * 32 * WARPS + thread;
                let row = at / COLUMNS;
                let column = at % COLUMNS;
                let mut total = 0.0f32;
                #[unroll]
                for w in 0..WARPS {
                    total += sums[((w * 16 + row) * STRIDE + column) as usize];
                }
                let row = t * 16 + row;
                let column = first_column + column;
                if row < rows && column < columns {
                    out[((split * rows + row) * columns + column) as usize] = O::cast_from(total);
                }
            }
            sync_cube();
        }
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

/// `lhs · rhs` when `lhs` is bf16 with at most [`MAX_ROWS`] rows, `k` a multiple of 8 and
/// `rhs` a bf16 weight with one contiguous dim read in 16-byte pieces; `None` otherwise.
pub(crate) fn gemm(lhs: &CubeTensor, rhs: &CubeTensor) -> Option<CubeTensor> {
    let (ls, rs) = (lhs.meta.shape(), rhs.meta.shape());
    let fits = ls.num_dims() == 2
        && rs.num_dims() == 2
        && lhs.dtype == DType::BF16
        && rhs.dtype == DType::BF16
        && ls[0] >= 1
        && ls[0] <= MAX_ROWS
        && ls[1] == rs[0]
        && ls[1].is_multiple_of(VECTOR)
        && rs[1] > 0;
    if !fits {
        return None;
    }
    let (m, k, n) = (ls[0], ls[1], rs[1]);
    let strides = rhs.meta.strides();
    let (k_contiguous, ldb) = if strides[1] == 1 && n.is_multiple_of(VECTOR) && strides[0].is_multiple_of(VECTOR) {
        (false, strides[0])
    } else if strides[0] == 1 && strides[1].is_multiple_of(VECTOR) {
        (true, strides[1])
    } else {
        return None;
    };
    let a = compact_input(lhs.clone())?;
    let column_blocks = n.div_ceil(COLUMNS as usize);
    let chunks = k.div_ceil(DEPTH as usize);
    // Every split keeps each warp at least one chunk.
    let splits = TARGET_BLOCKS
        .div_ceil(column_blocks)
        .clamp(1, chunks.div_ceil(WARPS as usize).max(1));
    let per_split = chunks.div_ceil(splits) * DEPTH as usize;
    let splits = k.div_ceil(per_split);
    let out = compact_output(&a, Shape::from(vec![m, n]), DType::BF16);
    let launch = |target: &CubeTensor| {
        // SAFETY: every load is checked against the rows, `k` and the columns, every store
        // against the rows and columns of `target`, which is compact `[splits, m, n]`.
        let args = (
            a.clone().into_tensor_arg(),
            rhs.clone().into_tensor_arg(),
            target.clone().into_tensor_arg(),
        );
        let count = CubeCount::Static(column_blocks as u32, splits as u32, 1);
        let dim = CubeDim::new_2d(32, WARPS);
        let scalars = (m as u32, k as u32, n as u32, (ldb / VECTOR) as u32, per_split as u32);
        macro_rules! launch {
            ($out:ty) => {
                unsafe {
                    few_rows_kernel::launch_unchecked::<bf16, $out>(
                        &a.client,
                        count,
                        dim,
                        VECTOR,
                        args.0,
                        args.1,
                        args.2,
                        scalars.0,
                        scalars.1,
                        scalars.2,
                        scalars.3,
                        scalars.4,
                        k_contiguous,
                    )
                }
            };
        }
        match target.dtype {
            DType::F32 => launch!(f32),
            _ => launch!(bf16),
        }
    };
    if splits == 1 {
        launch(&out);
        return Some(out);
    }
    let partial = compact_output(&a, Shape::from(vec![splits, m, n]), DType::F32);
    launch(&partial);
    let vector = if n.is_multiple_of(VECTOR) { VECTOR } else { 1 };
    let (count, dim) = launch_dims(m * n, vector);
    // SAFETY: a thread a vector of `out`, checked against its length; `partial` holds `splits`
    // of them.
    unsafe {
        split_sum_kernel::launch_unchecked::<bf16>(
            &a.client,
            count,
            dim,
            vector,
            partial.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            splits as u32,
        )
    };
    Some(out)
}
