//! The grouped variant of our Hopper GEMM ([`crate::wgmma`]): one launch computes every group's
//! product. Each group's rows are padded to a multiple of the 128 rows of a tile, so no tile
//! straddles two groups; a table gives each tile where its A and B slices start, where its
//! results go and how many 64-deep slices it sums (wgrad sums over its group's rows only).
//! The pipeline, the `wgmma` chains and the TMA stores are the plain GEMM's.
//!
//! | product | A | B | C |
//! |---|---|---|---|
//! | forward `y_g = x_g · w_g` | `x` `[r, k]`, K-major | `w` as `[e·k, n]`, MN-major, from row `g·k` | `[r, n]` |
//! | dgrad `dx_g = dy_g · w_gᵀ` | `dy` `[r, n]`, K-major | `w` as `[e·k, n]`, K-major, from row `g·k` | `[r, k]` |
//! | wgrad `dw_g = x_gᵀ · dy_g` | `x`, MN-major, from row `start_g` | `dy`, MN-major, from row `start_g` | `[e·k, n]` |
//!
//! A dgrad tile whose columns run past its group's `k` reads the next group's weight rows
//! into columns the store then drops (C has `k` columns). Shapes the table cannot serve (a
//! forward `k` no multiple of 64, a wgrad `k` no multiple of 128, rows not 16-byte aligned) and
//! dtypes other than bf16 take one product a group instead ([`crate::grouped::reference`]).
//!
//! Padding here costs a gather of the rows in and one out (measured: about as long as the
//! product itself on moe-4b's shapes), so callers lay their rows out in whole tiles already
//! ([`crate::grouped::row_alignment`]): the MoE dispatch does, and then nothing is copied.

use burn::backend::Cube;
use burn::backend::ops::{FloatTensorOps, IntTensorOps};
use burn::tensor::{DType, FloatDType, TensorData};
use burn_cubecl::cubecl::ir::{ElemType, FloatKind};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::zspace::metadata::Metadata;
use cubecl::zspace::{shape, strides};
use cubecl_cpp::cuda::ptx::tensor_map_address;
use half::bf16;

use crate::hopper::*;
use crate::wgmma::{
    A_STAGE_BYTES, BLOCK_K, BLOCK_M, BLOCK_N, Major, SMEM_BYTES, STAGE_BYTES, STAGES, STAGING_BYTES, k_slice,
    load_operand, pipeline_smem, store_tile,
};

/// A tile's row of the table: A's row and k offsets, B's row and k offsets, C's row and
/// column, and the 64-deep slices it sums.
const FIELDS: u32 = 7;

/// One row of the table (host side).
type TileRow = [usize; FIELDS as usize];

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn grouped_kernel(
    a: &TensorMap<bf16, Tiled>,
    b: &TensorMap<bf16, Tiled>,
    c: &mut TensorMap<bf16, Tiled>,
    table: &Tensor<u32>,
    tiles: u32,
    #[comptime] a_major: Major,
    #[comptime] b_major: Major,
) {
    let (stages, staging, full, empty) = pipeline_smem(SMEM_BYTES, STAGES, STAGE_BYTES);

    // This block's tiles: CUBE_POS_X, then every CUBE_COUNT_X-th.
    let mine = (tiles - CUBE_POS_X).div_ceil(CUBE_COUNT_X);
    let warpgroup = UNIT_POS / 128;
    if warpgroup == 0 {
        if UNIT_POS == 0 {
            let map_a = tensor_map_address(a);
            let map_b = tensor_map_address(b);
            // The block's slice count so far picks the stage and its round.
            let mut slice = 0u32;
            for i in 0..mine {
                let t = ((CUBE_POS_X + i * CUBE_COUNT_X) * FIELDS) as usize;
                let (a_row, a_k0, b_row, b_k0) = (table[t], table[t + 1], table[t + 2], table[t + 3]);
                for kt in 0..table[t + 6] {
                    let stage = slice % STAGES;
                    let round = slice / STAGES;
                    if round > 0 {
                        mbarrier_wait(empty + stage * 8, (round - 1) & 1);
                    }
                    let bar = full + stage * 8;
                    mbarrier_expect(bar, STAGE_BYTES);
                    let tile = stages + stage * STAGE_BYTES;
                    load_operand(tile, map_a, a_k0 + kt * BLOCK_K, a_row, bar, BLOCK_M, a_major);
                    load_operand(
                        tile + A_STAGE_BYTES,
                        map_b,
                        b_k0 + kt * BLOCK_K,
                        b_row,
                        bar,
                        BLOCK_N,
                        b_major,
                    );
                    slice += 1;
                }
            }
        }
    } else {
        let consumer = warpgroup - 1;
        let buffer = staging + consumer * STAGING_BYTES;
        // One thread a warpgroup issues its stores.
        let storer = UNIT_POS.is_multiple_of(128);
        let map_c = store_map_address(c);
        let mut slice = 0u32;
        for i in 0..mine {
            let t = ((CUBE_POS_X + i * CUBE_COUNT_X) * FIELDS) as usize;
            let mut acc = Acc256::zeroed();
            for _ in 0..table[t + 6] {
                let stage = slice % STAGES;
                mbarrier_wait(full + stage * 8, (slice / STAGES) & 1);
                let tile = stages + stage * STAGE_BYTES;
                // This warpgroup's 64 rows of A start 8 KiB into the stage in either layout.
                let desc_a = descriptor(tile + consumer * 8192, comptime!(a_major.tile(BLOCK_M)));
                let desc_b = descriptor(tile + A_STAGE_BYTES, comptime!(b_major.tile(BLOCK_N)));
                acc = chain_256(
                    &acc,
                    desc_a,
                    desc_b,
                    comptime!(k_slice(Operands::Bf16, a_major, b_major)),
                );
                if UNIT_POS.is_multiple_of(32) {
                    mbarrier_arrive(empty + stage * 8);
                }
                slice += 1;
            }
            store_tile(
                &acc,
                1.0f32,
                buffer,
                map_c,
                table[t + 4] + consumer * 64,
                table[t + 5],
                1 + consumer,
                storer,
                2u32,
            );
        }
        if storer {
            bulk_wait();
        }
    }
}

/// Each group's rows padded to whole tiles: the padded counts, and where each padded row comes
/// from (`None`: a zero row).
struct Padding {
    counts: Vec<usize>,
    source: Vec<Option<usize>>,
}

impl Padding {
    fn of(counts: &[usize]) -> Self {
        let tile = BLOCK_M as usize;
        let mut source = Vec::new();
        let mut start = 0;
        let padded = counts
            .iter()
            .map(|&n| {
                let p = n.next_multiple_of(tile);
                source.extend((0..p).map(|j| (j < n).then_some(start + j)));
                start += n;
                p
            })
            .collect();
        Self { counts: padded, source }
    }

    /// Whether every group already fills whole tiles.
    fn none(&self) -> bool {
        self.source.iter().enumerate().all(|(i, s)| *s == Some(i))
    }

    /// `x` (`[r, w]`) with its rows padded.
    fn pad(&self, x: CubeTensor) -> CubeTensor {
        if self.none() {
            return rows_ready(x);
        }
        let (r, w) = (x.meta.shape()[0], x.meta.shape()[1]);
        let zero = Cube::float_zeros([1, w].into(), &x.device, FloatDType::from(x.dtype));
        let index = ints(self.source.iter().map(|s| s.unwrap_or(r) as i32).collect(), &x);
        let extended = Cube::float_cat(vec![x, zero], 0);
        into_contiguous(Cube::float_select(extended, 0, index))
    }

    /// The rows of `y` (padded, `[p, w]`) that hold real rows, in their order.
    fn unpad(&self, y: CubeTensor) -> CubeTensor {
        if self.none() {
            return y;
        }
        let index = self
            .source
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_some())
            .map(|(i, _)| i as i32)
            .collect();
        let index = ints(index, &y);
        Cube::float_select(y, 0, index)
    }

    /// The padded rows, all groups.
    fn rows(&self) -> usize {
        self.counts.iter().sum()
    }

    /// The table of a product whose tiles are 128 padded rows of a group by 256 of `columns`
    /// output columns, in group order: `entry(group, first row, first column)` gives a tile's.
    fn row_tiles(&self, columns: usize, entry: impl Fn(usize, usize, usize) -> TileRow) -> Vec<TileRow> {
        let mut table = Vec::new();
        for (g, (&p, start)) in self.counts.iter().zip(self.starts()).enumerate() {
            for i in (0..p).step_by(BLOCK_M as usize) {
                for j in (0..columns).step_by(BLOCK_N as usize) {
                    table.push(entry(g, start + i, j));
                }
            }
        }
        table
    }

    /// Each group's first padded row.
    fn starts(&self) -> Vec<usize> {
        self.counts
            .iter()
            .scan(0, |at, &n| {
                let start = *at;
                *at += n;
                Some(start)
            })
            .collect()
    }
}

/// `values` as an int tensor on `like`'s device.
fn ints(values: Vec<i32>, like: &CubeTensor) -> CubeTensor {
    let n = values.len();
    Cube::int_from_data(TensorData::new(values, [n]), &like.device)
}

/// `w` (`[e, k, n]`) seen as the `[e·k, n]` matrix of its rows, in place when its rows are
/// contiguous and evenly spaced, whatever their pitch: CubeCL pads rows of some widths
/// (moe-4b's 1408 bf16), and `into_contiguous` would copy those (0.34 ms for moe-4b's w1).
fn rows_of(w: CubeTensor) -> CubeTensor {
    let [e, k, n] = [w.meta.shape()[0], w.meta.shape()[1], w.meta.shape()[2]];
    let s = w.meta.strides();
    let in_place = s[2] == 1 && s[0] == k * s[1] && (s[1] * w.dtype.size()).is_multiple_of(16);
    let (w, pitch) = match in_place {
        true => {
            let pitch = s[1];
            (w, pitch)
        }
        false => (into_contiguous(w), n),
    };
    CubeTensor::new(
        w.client.clone(),
        w.handle.clone(),
        Metadata::new(shape![e * k, n], strides![pitch, 1]),
        w.device.clone(),
        w.dtype,
    )
}

/// `t` (`[r, w]`) as TMA reads it: as it is when its rows are contiguous and 16-byte aligned
/// (any pitch), else a contiguous copy.
fn rows_ready(t: CubeTensor) -> CubeTensor {
    let s = t.meta.strides();
    match s[1] == 1 && (s[0] * t.dtype.size()).is_multiple_of(16) {
        true => t,
        false => into_contiguous(t),
    }
}

/// One product a group on Cube: bf16 through the wgmma GEMM, f32 in f32.
fn per_group(lhs: CubeTensor, rhs: CubeTensor) -> CubeTensor {
    <Cube as crate::linear::GemmOps>::gemm(lhs, rhs, crate::Gemm::Wgmma)
}

/// Whether bf16 `x` and `w` run the grouped kernel, and rows of `widths` elements are 16-byte
/// aligned for TMA.
fn fits(tensors: [&CubeTensor; 2], widths: &[usize]) -> bool {
    tensors.iter().all(|t| t.dtype == DType::BF16) && widths.iter().all(|w| w % 8 == 0)
}

pub(crate) fn forward(x: CubeTensor, w: CubeTensor, counts: &[usize]) -> CubeTensor {
    let [k, n] = [w.meta.shape()[1], w.meta.shape()[2]];
    if !fits([&x, &w], &[k, n]) || !k.is_multiple_of(BLOCK_K as usize) {
        return crate::grouped::reference::forward::<Cube>(x, w, counts, per_group);
    }
    let padding = Padding::of(counts);
    let x = padding.pad(x);
    let table = padding.row_tiles(n, |g, row, j| [row, 0, j, g * k, row, j, k / BLOCK_K as usize]);
    let y = launch((x, Major::K), (rows_of(w), Major::Mn), [padding.rows(), n], table);
    padding.unpad(y)
}

pub(crate) fn dgrad(dy: CubeTensor, w: CubeTensor, counts: &[usize]) -> CubeTensor {
    let [k, n] = [w.meta.shape()[1], w.meta.shape()[2]];
    if !fits([&dy, &w], &[k, n]) {
        return crate::grouped::reference::dgrad::<Cube>(dy, w, counts, per_group);
    }
    let padding = Padding::of(counts);
    let dy = padding.pad(dy);
    let slices = n.div_ceil(BLOCK_K as usize);
    let table = padding.row_tiles(k, |g, row, j| [row, 0, g * k + j, 0, row, j, slices]);
    let dx = launch((dy, Major::K), (rows_of(w), Major::K), [padding.rows(), k], table);
    padding.unpad(dx)
}

pub(crate) fn wgrad(x: CubeTensor, dy: CubeTensor, counts: &[usize]) -> CubeTensor {
    let (k, n) = (x.meta.shape()[1], dy.meta.shape()[1]);
    let e = counts.len();
    if !fits([&x, &dy], &[k, n]) || !k.is_multiple_of(BLOCK_M as usize) {
        return crate::grouped::reference::wgrad::<Cube>(x, dy, counts, per_group);
    }
    let padding = Padding::of(counts);
    let (x, dy) = (padding.pad(x), padding.pad(dy));
    let mut table = Vec::new();
    for (g, (&p, start)) in padding.counts.iter().zip(padding.starts()).enumerate() {
        for i in (0..k).step_by(BLOCK_M as usize) {
            for j in (0..n).step_by(BLOCK_N as usize) {
                table.push([i, start, j, start, g * k + i, j, p / BLOCK_K as usize]);
            }
        }
    }
    let dw = launch((x, Major::Mn), (dy, Major::Mn), [e * k, n], table);
    CubeTensor::new(
        dw.client.clone(),
        dw.handle.clone(),
        Metadata::new(shape![e, k, n], strides![k * n, n, 1]),
        dw.device.clone(),
        dw.dtype,
    )
}

/// Launches the grouped kernel over `table`'s tiles; the bf16 `[m, n]` result.
fn launch(
    (a, a_major): (CubeTensor, Major),
    (b, b_major): (CubeTensor, Major),
    [m, n]: [usize; 2],
    table: Vec<TileRow>,
) -> CubeTensor {
    let (client, device) = (a.client.clone(), a.device.clone());
    let out = CubeTensor::new_contiguous(
        client.clone(),
        device.clone(),
        shape![m, n],
        client.empty(m * n * DType::BF16.size()),
        DType::BF16,
    );
    let tiles = table.len() as u32;
    if tiles == 0 {
        return out;
    }
    let values: Vec<u32> = table.into_iter().flatten().map(|v| v as u32).collect();
    let count = values.len();
    let table = Cube::int_from_data(TensorData::new(values, [count]), &device);
    let elem = ElemType::Float(FloatKind::BF16);
    let map = |t: CubeTensor, major: Major, rows: u32| {
        let tile_size = match major {
            Major::K => shape![rows as usize, BLOCK_K as usize],
            Major::Mn => shape![BLOCK_K as usize, 64],
        };
        TensorMapArg::new(TiledArgs { tile_size }, t.into_tensor_arg(), elem).with_swizzle(TensorMapSwizzle::B128)
    };
    let c = TensorMapArg::new(
        TiledArgs {
            tile_size: shape![64, 64],
        },
        out.clone().into_tensor_arg(),
        elem,
    )
    .with_swizzle(TensorMapSwizzle::B128);
    // One block an SM fits (shared memory), so more would only queue.
    let sms = client
        .properties()
        .hardware
        .num_streaming_multiprocessors
        .unwrap_or(tiles);
    let blocks = tiles.min(sms).max(1);
    // SAFETY: the maps cover exactly the operands and the output (TMA fills out-of-range boxes
    // with zeros when loading and drops out-of-range parts when storing); every tile of the
    // table lies inside them, and `tiles` rows of `FIELDS` u32 are in `table`.
    unsafe {
        grouped_kernel::launch_unchecked(
            &client,
            CubeCount::Static(blocks, 1, 1),
            CubeDim::new_1d(384),
            map(a, a_major, BLOCK_M),
            map(b, b_major, BLOCK_N),
            c,
            table.into_tensor_arg(),
            tiles,
            a_major,
            b_major,
        );
    }
    out
}
