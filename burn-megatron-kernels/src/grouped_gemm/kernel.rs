//! The grouped variant of our Hopper GEMM ([`crate::cuda::wgmma`]): one launch computes every group's
//! product. Every group starts at a multiple of the 128 rows of a tile, so no tile straddles
//! two groups. A first small kernel writes the table of tiles on the device from the groups'
//! starts (a tile's group: the last whose start is at most its first row), so the host needs
//! no count: each tile's A and B slices, where its results go and how many 64-deep slices it
//! sums (wgrad sums over its group's rows only; the tiles past the last group's rows sum none
//! and store zeros). The pipeline, the `wgmma` chains and the TMA stores are the plain
//! GEMM's.
//!
//! | product | A | B | C | tiles |
//! |---|---|---|---|---|
//! | forward `y_g = x_g · w_g` | `x` `[r, k]`, K-major | `w` as `[e·k, n]`, MN-major, from row `g·k` | `[r, n]` | the rows' × `n`'s |
//! | dgrad `dx_g = dy_g · w_gᵀ` | `dy` `[r, n]`, K-major | `w` as `[e·k, n]`, K-major, from row `g·k` | `[r, k]` | the rows' × `k`'s |
//! | wgrad `dw_g = x_gᵀ · dy_g` | `x`, MN-major, from row `start_g` | `dy`, MN-major, from row `start_g` | `[e·k, n]` | `e` × `k`'s × `n`'s |
//!
//! A dgrad tile whose columns run past its group's `k` reads the next group's weight rows
//! into columns the store then drops (C has `k` columns). Shapes the kernel cannot serve (a
//! forward `k` no multiple of 64, a wgrad `k` no multiple of 128, rows not 16-byte aligned) and
//! dtypes other than bf16 take one product a group instead ([`crate::grouped_gemm::reference`]),
//! the starts read to the host.

use burn::backend::Cube;
use burn::tensor::DType;
use burn_cubecl::cubecl::ir::{ElemType, FloatKind};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::zspace::metadata::Metadata;
use cubecl::zspace::{shape, strides};
use cubecl_cpp::cuda::ptx::tensor_map_address;
use half::bf16;

use crate::cuda::hopper::*;
use crate::cuda::wgmma::{
    A_STAGE_BYTES, BLOCK_K, BLOCK_M, BLOCK_N, Major, SMEM_BYTES, STAGE_BYTES, STAGES, STAGING_BYTES, k_slice,
    load_operand, pipeline_smem, store_tile,
};

/// Which product a launch computes: how a tile finds its operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Product {
    Forward,
    Dgrad,
    Wgrad,
}

/// A tile's row of the table: A's row and k offsets, B's row and k offsets, C's row and
/// column, and the 64-deep slices it sums (none: it stores zeros).
const FIELDS: u32 = 7;

/// Threads a block of the table's kernel.
const TABLE_THREADS: u32 = 256;

/// The last of the `e` groups whose start is at most `row` (an empty group shares its start
/// with the next, which is then the one).
#[cube]
fn group_of(starts: &Tensor<i32>, e: u32, row: u32) -> u32 {
    let mut group = 0u32;
    for g in 1..e {
        if u32::cast_from(starts[g as usize]) <= row {
            group = g;
        }
    }
    group
}

/// Grid: a thread a tile. Writes tile `tile`'s row of the table from the starts. Forward and
/// dgrad: the tiles run over 128 rows × 256 output columns (`columns` tiles a row of tiles),
/// `k` and `n` the weight's; wgrad: over `e` groups × 128 of `k` × 256 of `n`.
#[cube(launch_unchecked)]
// A comptime branch, then a runtime one inside the other arm: kept apart, not `else if`.
#[allow(clippy::too_many_arguments, clippy::collapsible_else_if)]
fn table_kernel(
    starts: &Tensor<i32>,
    table: &mut Tensor<u32>,
    tiles: u32,
    e: u32,
    k: u32,
    n: u32,
    columns: u32,
    #[comptime] product: Product,
) {
    let tile = ABSOLUTE_POS as u32;
    if tile < tiles {
        // Forward and dgrad: a row of tiles' first row; wgrad changes it below.
        let mut a_row = tile / columns * BLOCK_M;
        let mut c_row = a_row;
        let c_col = tile % columns * BLOCK_N;
        let mut a_k0 = 0u32;
        let mut b_row = 0u32;
        let mut b_k0 = 0u32;
        let mut slices = 0u32;
        if comptime!(product == Product::Wgrad) {
            let per_group = k / BLOCK_M * columns;
            let g = tile / per_group;
            let i = tile % per_group / columns * BLOCK_M;
            let start = u32::cast_from(starts[g as usize]);
            a_row = i;
            a_k0 = start;
            b_row = c_col;
            b_k0 = start;
            c_row = g * k + i;
            slices = (u32::cast_from(starts[(g + 1) as usize]) - start) / BLOCK_K;
        } else {
            if a_row < u32::cast_from(starts[e as usize]) {
                let g = group_of(starts, e, a_row);
                if comptime!(product == Product::Forward) {
                    b_row = c_col;
                    b_k0 = g * k;
                    slices = k / BLOCK_K;
                } else {
                    b_row = g * k + c_col;
                    slices = n.div_ceil(BLOCK_K);
                }
            }
        }
        let t = (tile * FIELDS) as usize;
        table[t] = a_row;
        table[t + 1] = a_k0;
        table[t + 2] = b_row;
        table[t + 3] = b_k0;
        table[t + 4] = c_row;
        table[t + 5] = c_col;
        table[t + 6] = slices;
    }
}

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
    let (stages, staging, full, empty) = pipeline_smem(SMEM_BYTES, STAGES, STAGE_BYTES, 2 * STAGING_BYTES);

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
    <Cube as crate::gemm::GemmOps>::gemm(lhs, rhs, crate::Gemm::Wgmma)
}

/// Whether bf16 `x` and `w` run the grouped kernel, and rows of `widths` elements are 16-byte
/// aligned for TMA.
fn fits(tensors: [&CubeTensor; 2], widths: &[usize]) -> bool {
    tensors.iter().all(|t| t.dtype == DType::BF16) && widths.iter().all(|w| w % 8 == 0)
}

/// The starts on the host, for one product a group (waits for the work before it).
fn host_starts(starts: CubeTensor) -> Vec<usize> {
    crate::grouped_gemm::read_starts(burn::tensor::Tensor::from_primitive::<Cube>(starts))
}

/// `starts` as the compact i32 the kernel reads.
fn starts_ready(starts: CubeTensor) -> CubeTensor {
    crate::rows::kernel::index_input(starts).expect("starts are a compact int tensor")
}

/// Output tiles of 256 columns across `width`.
fn columns(width: usize) -> usize {
    width.div_ceil(BLOCK_N as usize)
}

pub(crate) fn grouped_matmul(x: CubeTensor, w: CubeTensor, starts: CubeTensor) -> CubeTensor {
    let [e, k, n] = [w.meta.shape()[0], w.meta.shape()[1], w.meta.shape()[2]];
    if !fits([&x, &w], &[k, n]) || !k.is_multiple_of(BLOCK_K as usize) {
        return crate::grouped_gemm::reference::forward::<Cube>(x, w, &host_starts(starts), per_group);
    }
    let r = x.meta.shape()[0];
    let shape = Sizes::over_rows(r, [e, k, n], n);
    launch(
        (rows_ready(x), Major::K),
        (rows_of(w), Major::Mn),
        [r, n],
        starts,
        shape,
        Product::Forward,
    )
}

pub(crate) fn grouped_matmul_dgrad(dy: CubeTensor, w: CubeTensor, starts: CubeTensor) -> CubeTensor {
    let [e, k, n] = [w.meta.shape()[0], w.meta.shape()[1], w.meta.shape()[2]];
    if !fits([&dy, &w], &[k, n]) {
        return crate::grouped_gemm::reference::dgrad::<Cube>(dy, w, &host_starts(starts), per_group);
    }
    let r = dy.meta.shape()[0];
    let shape = Sizes::over_rows(r, [e, k, n], k);
    launch(
        (rows_ready(dy), Major::K),
        (rows_of(w), Major::K),
        [r, k],
        starts,
        shape,
        Product::Dgrad,
    )
}

pub(crate) fn grouped_matmul_wgrad(x: CubeTensor, dy: CubeTensor, starts: CubeTensor) -> CubeTensor {
    let (k, n) = (x.meta.shape()[1], dy.meta.shape()[1]);
    let e = starts.meta.shape()[0] - 1;
    if !fits([&x, &dy], &[k, n]) || !k.is_multiple_of(BLOCK_M as usize) {
        return crate::grouped_gemm::reference::wgrad::<Cube>(x, dy, &host_starts(starts), per_group);
    }
    let tiles = e * (k / BLOCK_M as usize) * columns(n);
    let shape = Sizes {
        e,
        k,
        n,
        columns: columns(n),
        tiles,
    };
    let dw = launch(
        (rows_ready(x), Major::Mn),
        (rows_ready(dy), Major::Mn),
        [e * k, n],
        starts,
        shape,
        Product::Wgrad,
    );
    CubeTensor::new(
        dw.client.clone(),
        dw.handle.clone(),
        Metadata::new(shape![e, k, n], strides![k * n, n, 1]),
        dw.device.clone(),
        dw.dtype,
    )
}

/// A launch's sizes: the groups, the weight's `k` and `n`, output tiles a row of tiles, and
/// the tiles.
struct Sizes {
    e: usize,
    k: usize,
    n: usize,
    columns: usize,
    tiles: usize,
}

impl Sizes {
    /// Forward's and dgrad's: tiles over `r` rows and `width` output columns.
    fn over_rows(r: usize, [e, k, n]: [usize; 3], width: usize) -> Self {
        let columns = columns(width);
        let tiles = r.div_ceil(BLOCK_M as usize) * columns;
        Sizes {
            e,
            k,
            n,
            columns,
            tiles,
        }
    }
}

/// The table of `shape`'s tiles (`[tiles · FIELDS]` u32), written on the device from the
/// starts.
fn tile_table(starts: CubeTensor, shape: &Sizes, product: Product) -> CubeTensor {
    let count = shape.tiles * FIELDS as usize;
    let table = CubeTensor::new_contiguous(
        starts.client.clone(),
        starts.device.clone(),
        shape![count],
        starts.client.empty(count * DType::U32.size()),
        DType::U32,
    );
    let blocks = (shape.tiles as u32).div_ceil(TABLE_THREADS);
    // SAFETY: a thread a tile writes its own `FIELDS` entries, below `tiles · FIELDS`; it reads
    // starts `[0, e]` (`[e + 1]` of them, the caller's contract).
    unsafe {
        table_kernel::launch_unchecked(
            &starts.client,
            CubeCount::Static(blocks, 1, 1),
            CubeDim::new_1d(TABLE_THREADS),
            starts.clone().into_tensor_arg(),
            table.clone().into_tensor_arg(),
            shape.tiles as u32,
            shape.e as u32,
            shape.k as u32,
            shape.n as u32,
            shape.columns as u32,
            product,
        );
    }
    table
}

/// Launches the grouped kernel over `shape`'s tiles; the bf16 `[m, n]` result.
fn launch(
    (a, a_major): (CubeTensor, Major),
    (b, b_major): (CubeTensor, Major),
    [m, n]: [usize; 2],
    starts: CubeTensor,
    shape: Sizes,
    product: Product,
) -> CubeTensor {
    let (client, device) = (a.client.clone(), a.device.clone());
    let out = CubeTensor::new_contiguous(
        client.clone(),
        device.clone(),
        shape![m, n],
        client.empty(m * n * DType::BF16.size()),
        DType::BF16,
    );
    let tiles = shape.tiles as u32;
    if tiles == 0 {
        return out;
    }
    let table = tile_table(starts_ready(starts), &shape, product);
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
    // with zeros when loading and drops out-of-range parts when storing). The starts are the
    // caller's contract (`GroupedOps`: `[e + 1]`, non-decreasing from 0, multiples of the tile,
    // the last at most the rows), so every tile of the table lies inside them, and `tiles`
    // rows of `FIELDS` u32 are in `table`.
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
