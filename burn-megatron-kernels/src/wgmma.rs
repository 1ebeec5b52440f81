//! A Hopper GEMM of our own: `wgmma` through inline PTX, fed by TMA through an mbarrier
//! pipeline, one producer warpgroup and two consumer warpgroups (CubeCL 0.11 emits no `wgmma`
//! itself; `docs/perf/wgmma-plan.md`).
//!
//! `C[m, n] = A[m, k] · B[k, n]`, bf16 in, f32 accumulation, bf16 out. A block computes a
//! 128 × 256 tile of C. Each of its `STAGES` shared-memory stages holds a 64-deep slice of A and
//! of B with the 128-byte swizzle, each K-major or MN-major as the operand lies in memory
//! ([`Major`]), so plain and transposed views are read in place; only an operand with neither
//! dim contiguous is copied first ([`gemm`]).

use burn::backend::Cube;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::DType;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::kernel::matmul::init_matmul_output;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::bf16;
use burn_cubecl::cubecl::ir::{ElemType, FloatKind};
use cubecl::zspace::shape;
use cubecl_cpp::cuda::ptx::{generic_to_shared, tensor_map_address};

use crate::hopper::*;

/// Rows of C a block computes: two consumer warpgroups of 64.
const BLOCK_M: u32 = 128;
/// Columns of C a block computes: one `m64n256k16` per consumer and k-step.
const BLOCK_N: u32 = 256;
/// The k extent of a stage: 64 bf16 are one 128-byte swizzle row.
const BLOCK_K: u32 = 64;
/// Pipeline depth: 4 × 48 KiB of the 227 KiB a block may use.
const STAGES: u32 = 4;
const A_STAGE_BYTES: u32 = BLOCK_M * BLOCK_K * 2;
const B_STAGE_BYTES: u32 = BLOCK_N * BLOCK_K * 2;
const STAGE_BYTES: u32 = A_STAGE_BYTES + B_STAGE_BYTES;
/// Tiles, then `STAGES` "full" and `STAGES` "empty" mbarriers, plus 1 KiB to align the tiles to
/// the 1 KiB the 128-byte swizzle repeats over.
const SMEM_BYTES: u32 = STAGES * STAGE_BYTES + 1024 + 1024;
/// One arrival per consumer warp frees a stage.
const CONSUMER_WARPS: u32 = 8;

/// How an operand lies in memory, so in its shared-memory tile.
///
/// - K-major (A as `[m, k]`, B as `[n, k]`, k contiguous): one TMA box of all the tile's rows × 64 k.
/// - MN-major (A as `[k, m]`, B as `[k, n]`, m or n contiguous): one box of 64 k × 64 per 64 rows,
///   8 KiB apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Major {
    K,
    Mn,
}

impl Major {
    const fn tile(self, rows: u32) -> Tile {
        match self {
            Major::K => Tile::KMajor { rows },
            Major::Mn => Tile::MnMajor { box_bytes: 8192 },
        }
    }
}

/// One 64-deep k-slice for one consumer warpgroup: four `m64n256k16` steps.
const fn k_slice(a: Major, b: Major) -> Chain {
    Chain { n: 256, steps: 4, accumulate: true, a: ASource::Smem(a.tile(BLOCK_M)), b: b.tile(BLOCK_N) }
}

/// The blocks of a cluster, `m` along M by `n` along N, and so who loads what.
///
/// The `m` blocks of a column compute the same columns of C, so they need the same B slices:
/// each loads `1 / m` of the slice and TMA multicasts it into all of them. Likewise the `n`
/// blocks of a row share A. Each block then reads `A/n + B/m` of a stage from L2 instead of
/// `A + B`: 128 × 256 tiles fed one block at a time drew ~7.5 TB/s of L2 at 490–650 TFLOP/s
/// (`gemm.md`, session 5), which is where L2 stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cluster {
    pub m: u32,
    pub n: u32,
}

impl Cluster {
    /// One block: plain TMA loads.
    pub const ONE: Cluster = Cluster { m: 1, n: 1 };

    /// Each stage of a block is written by its own row's and column's blocks, and each of
    /// their consumer warps frees it there.
    const fn writers(self) -> u32 {
        self.m + self.n - 1
    }

    /// The rank mask of row 0's blocks (ranks run along N first).
    const fn row_pattern(self) -> u32 {
        (1 << self.n) - 1
    }

    /// The rank mask of column 0's blocks.
    const fn column_pattern(self) -> u32 {
        let mut mask = 0;
        let mut y = 0;
        while y < self.m {
            mask |= 1 << (y * self.n);
            y += 1;
        }
        mask
    }
}

/// Loads part `part` of `parts` of one operand's 64-deep slice for the block into `tile`, and
/// into the same place in every block of `blocks` (a cluster rank mask; just this block when
/// `parts` is 1). K-major: one box of `rows / parts` × 64 k. MN-major: the part's boxes of
/// 64 k × 64, 8 KiB apart.
#[cube]
fn load_part(
    tile: u32,
    map: u64,
    k0: u32,
    row0: u32,
    bar: u32,
    part: u32,
    blocks: u32,
    #[comptime] rows: u32,
    #[comptime] parts: u32,
    #[comptime] major: Major,
) {
    let part_rows = comptime!(rows / parts);
    match comptime!(major) {
        Major::K => {
            let (dst, row) = (tile + part * part_rows * 128, row0 + part * part_rows);
            load_box(dst, map, k0, row, bar, blocks, parts);
        }
        Major::Mn => {
            #[unroll]
            for j in 0..part_rows / 64 {
                let b = part * comptime!(part_rows / 64) + j;
                load_box(tile + b * 8192, map, row0 + b * 64, k0, bar, blocks, parts);
            }
        }
    }
}

#[cube]
fn load_box(dst: u32, map: u64, inner: u32, outer: u32, bar: u32, blocks: u32, #[comptime] parts: u32) {
    if comptime!(parts == 1) {
        tma_load_2d(dst, map, inner, outer, bar);
    } else {
        tma_load_2d_multicast(dst, map, inner, outer, bar, blocks);
    }
}

#[cube(launch_unchecked, cluster_dim = CubeDim::new_3d(cluster.n, cluster.m, 1))]
fn gemm_kernel(
    a: &TensorMap<bf16, Tiled>,
    b: &TensorMap<bf16, Tiled>,
    c: &mut Tensor<bf16>,
    m: u32,
    n: u32,
    k: u32,
    #[comptime] a_major: Major,
    #[comptime] b_major: Major,
    #[comptime] cluster: Cluster,
) {
    let smem = Shared::<[u32]>::new_aligned_slice(comptime!((SMEM_BYTES / 4) as usize), 1024usize);
    let raw = generic_to_shared::<u32>(smem.as_ptr());
    let tiles = (raw + 1023) & !1023u32;
    let full = tiles + STAGES * STAGE_BYTES;
    let empty = full + STAGES * 8;

    if UNIT_POS == 0 {
        #[unroll]
        for s in 0..STAGES {
            mbarrier_init(full + s * 8, 1u32);
            mbarrier_init(empty + s * 8, comptime!(CONSUMER_WARPS * cluster.writers()));
        }
        mbarrier_init_fence();
    }
    // The peers' barriers must be initialized before any multicast or remote arrival.
    cluster_sync();

    // This block's place in its cluster; the blocks of its row share A, those of its column B.
    let rank = cluster_rank();
    let row_blocks = comptime!(cluster.row_pattern()) << (rank - rank % cluster.n);
    let column_blocks = comptime!(cluster.column_pattern()) << (rank % cluster.n);
    // The blocks whose loads land in this block's stages, so whose stages it frees.
    let writers = row_blocks | column_blocks;

    let k_tiles = k.div_ceil(BLOCK_K);
    let m0 = CUBE_POS_Y * BLOCK_M;
    let n0 = CUBE_POS_X * BLOCK_N;
    let warpgroup = UNIT_POS / 128;

    // No `setmaxnreg` split between producer and consumers: the consumers need 154 registers,
    // under the 168 that 384 threads leave each (measured: the split changed no timing).
    if warpgroup == 0 {
        if UNIT_POS == 0 {
            let map_a = tensor_map_address(a);
            let map_b = tensor_map_address(b);
            // A block past the edge (the grid is whole clusters) still loads its share for its
            // peers: real rows, whose products its masked stores drop.
            let a_row0 = select(m0 < m, m0, 0);
            let b_row0 = select(n0 < n, n0, 0);
            for kt in 0..k_tiles {
                let stage = kt % STAGES;
                let round = kt / STAGES;
                if round > 0 {
                    mbarrier_wait(empty + stage * 8, (round - 1) & 1);
                }
                let bar = full + stage * 8;
                // The whole stage lands here: this block's parts and its peers'.
                mbarrier_expect(bar, STAGE_BYTES);
                let tile = tiles + stage * STAGE_BYTES;
                let k0 = kt * BLOCK_K;
                load_part(tile, map_a, k0, a_row0, bar, rank % cluster.n, row_blocks, BLOCK_M, cluster.n, a_major);
                load_part(tile + A_STAGE_BYTES, map_b, k0, b_row0, bar, rank / cluster.n, column_blocks, BLOCK_N, cluster.m, b_major);
            }
        }
    } else {
        let consumer = warpgroup - 1;
        let mut acc = Acc256::zeroed();
        for kt in 0..k_tiles {
            let stage = kt % STAGES;
            mbarrier_wait(full + stage * 8, (kt / STAGES) & 1);
            let tile = tiles + stage * STAGE_BYTES;
            // This warpgroup's 64 rows of A start 8 KiB into the stage in either layout.
            let desc_a = descriptor(tile + consumer * 8192, comptime!(a_major.tile(BLOCK_M)));
            let desc_b = descriptor(tile + A_STAGE_BYTES, comptime!(b_major.tile(BLOCK_N)));
            acc = chain_256(&acc, desc_a, desc_b, comptime!(k_slice(a_major, b_major)));
            if UNIT_POS.is_multiple_of(32) {
                let bar = empty + stage * 8;
                if comptime!(cluster.writers() == 1) {
                    mbarrier_arrive(bar);
                } else {
                    #[unroll]
                    for r in 0..comptime!(cluster.m * cluster.n) {
                        if (writers >> r) & 1 == 1 {
                            mbarrier_arrive_cluster(bar, r);
                        }
                    }
                }
            }
        }

        // The accumulator layout of `hopper`'s module docs.
        let lane = UNIT_POS % 32;
        let warp = (UNIT_POS % 128) / 32;
        let row0 = m0 + consumer * 64 + warp * 16 + lane / 4;
        let col0 = n0 + 2 * (lane % 4);
        let stride = c.stride(0);
        #[unroll]
        for j in 0..32u32 {
            #[unroll]
            for half in 0..2u32 {
                let row = row0 + half * 8;
                #[unroll]
                for e in 0..2u32 {
                    let col = col0 + j * 8 + e;
                    if row < m && col < n {
                        let value = acc.extract((4 * j + 2 * half + e) as usize);
                        c[row as usize * stride + col as usize] = bf16::cast_from(value);
                    }
                }
            }
        }
    }
    // No block may leave while its peers can still write into it or arrive on its barriers.
    cluster_sync();
}

/// Why [`gemm`] cannot run a product.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WgmmaError {
    /// Only bf16 operands, both the same dtype.
    DType(DType, DType),
    /// TMA needs 16-byte aligned rows: k must be a multiple of 8.
    Unaligned { k: usize },
}

impl core::fmt::Display for WgmmaError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::DType(l, r) => write!(f, "the wgmma GEMM takes bf16 operands, not {l:?} · {r:?}"),
            Self::Unaligned { k } => write!(f, "the wgmma GEMM needs k to be a multiple of 8, not {k}"),
        }
    }
}

impl std::error::Error for WgmmaError {}

/// An operand as the kernel reads it: `t` itself or its transpose, whichever has contiguous
/// rows with 16-byte aligned row strides (TMA's rule), else a K-major copy. `k_last` says
/// whether `t`'s last dim is k (A, `[m, k]`) or its first (B, `[k, n]`).
fn operand(t: CubeTensor, k_last: bool) -> (CubeTensor, Major) {
    let rows_fit = |t: &CubeTensor| {
        let strides = t.meta.strides();
        strides[1] == 1 && (strides[0] * 2).is_multiple_of(16)
    };
    let (k_major, mn_major) = match k_last {
        true => (t.clone(), Cube::float_transpose(t)),
        false => (Cube::float_transpose(t.clone()), t),
    };
    if rows_fit(&k_major) {
        (k_major, Major::K)
    } else if rows_fit(&mn_major) {
        (mn_major, Major::Mn)
    } else {
        (into_contiguous(k_major), Major::K)
    }
}

/// `lhs · rhs` on the wgmma kernel, its blocks sharing loads in clusters of `cluster`.
///
/// # Shapes
/// `[m, k]`, `[k, n]` → `[m, n]`; operands may be transposed views.
pub fn gemm(lhs: CubeTensor, rhs: CubeTensor, cluster: Cluster) -> Result<CubeTensor, WgmmaError> {
    if lhs.dtype != DType::BF16 || rhs.dtype != DType::BF16 {
        return Err(WgmmaError::DType(lhs.dtype, rhs.dtype));
    }
    let (m, k) = (lhs.meta.shape()[0], lhs.meta.shape()[1]);
    let n = rhs.meta.shape()[1];
    if k % 8 != 0 {
        return Err(WgmmaError::Unaligned { k });
    }
    let out = init_matmul_output(&lhs, &rhs, DType::BF16);
    let (a, a_major) = operand(lhs, true);
    let (b, b_major) = operand(rhs, false);
    let client = out.client.clone();
    let elem = ElemType::Float(FloatKind::BF16);
    let map = |t: CubeTensor, major: Major, rows: u32| {
        let tile_size = match major {
            Major::K => shape![rows as usize, BLOCK_K as usize],
            Major::Mn => shape![BLOCK_K as usize, 64],
        };
        TensorMapArg::new(TiledArgs { tile_size }, t.into_tensor_arg(), elem).with_swizzle(TensorMapSwizzle::B128)
    };
    // Whole clusters: the blocks past the edge feed their peers and store nothing.
    let blocks = |len: usize, block: u32, per: u32| (len as u32).div_ceil(block).next_multiple_of(per);
    let count = CubeCount::Static(blocks(n, BLOCK_N, cluster.n), blocks(m, BLOCK_M, cluster.m), 1);
    // SAFETY: the maps cover exactly the operands (TMA fills out-of-range boxes with zeros) and
    // every store to `c` is checked against m and n.
    unsafe {
        gemm_kernel::launch_unchecked(
            &client,
            count,
            CubeDim::new_1d(384),
            map(a, a_major, BLOCK_M / cluster.n),
            map(b, b_major, BLOCK_N / cluster.m),
            out.clone().into_tensor_arg(),
            m as u32,
            n as u32,
            k as u32,
            a_major,
            b_major,
            cluster,
        );
    }
    Ok(out)
}
