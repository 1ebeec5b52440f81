//! A Hopper GEMM of our own: `wgmma` through inline PTX, fed by TMA through an mbarrier
//! pipeline, one producer warpgroup and two consumer warpgroups (CubeCL 0.11 emits no `wgmma`
//! itself; `docs/kernels.md` says what it allows, and the measurements).
//!
//! `C[m, n] = A[m, k] · B[k, n]`, bf16 in, f32 accumulation, bf16 out; or FP8 in ([`fp8_gemm`]:
//! E4M3 or E5M2 codes, both operands K-major, a per-tensor scale applied as the results leave,
//! the partial sums kept in `wgmma`'s accumulator or promoted into f32 every slice
//! ([`Accumulation`])), whose 128-deep slices take the bytes of bf16's 64-deep ones. A block computes 128 × 256
//! tiles of C, one after another ([`Schedule`]), in an L2-friendly order ([`GROUP_M`]). Each of
//! its `STAGES` shared-memory stages holds a 64-deep slice of A and of B with the 128-byte
//! swizzle, each K-major or MN-major as the operand lies in memory ([`Major`]), so plain and
//! transposed views are read in place; only an operand with neither dim contiguous is copied
//! first ([`gemm`]). Results leave through shared memory and TMA stores, which write whole lines
//! while the consumers start the next tile: storing bf16 scalars from registers had held every
//! shape 100–200 TFLOP/s lower.

use burn::backend::Cube;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::DType;
use burn_cubecl::cubecl::ir::{ElemType, FloatKind, UIntKind};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::zspace::metadata::Metadata;
use cubecl::zspace::{shape, strides};
use cubecl_cpp::cuda::ptx::tensor_map_address;
use half::bf16;

use crate::cuda::hopper::*;
use crate::quant::format::Minifloat;

mod blockwise;
mod epilogues;
mod gated;
mod gated_dgrad;
mod loaded;
mod onto;
mod pieces;
mod rotated;
mod tensors;
pub use blockwise::{BScales, fp8_blockwise_gemm};
pub use gated::gated_gemm;
pub use gated_dgrad::gated_dgrad;
pub use onto::gemm_onto;
pub(crate) use pieces::{Pipeline, load_operand, pipeline_smem, produce, send_pass, store_tile, tile_position};
pub use rotated::gemm_rotated;
pub use tensors::{fp8_blockwise_matmul, fp8_matmul, matmul};

/// Rows of C a block computes: two consumer warpgroups of 64.
pub(crate) const BLOCK_M: u32 = 128;
/// Columns of C a block computes: one `m64n256k16` per consumer and k-step.
pub(crate) const BLOCK_N: u32 = 256;
/// The k extent of a bf16 stage: 64 bf16 are one 128-byte swizzle row (128 FP8 codes are).
pub(crate) const BLOCK_K: u32 = 64;

/// The k extent of a stage for `operands`: one 128-byte row.
const fn block_k(operands: Operands) -> u32 {
    match operands {
        Operands::Bf16 => BLOCK_K,
        Operands::Fp8(..) => 2 * BLOCK_K,
    }
}
/// Pipeline depth: 4 × 48 KiB of the 227 KiB a block may use.
pub(crate) const STAGES: u32 = 4;
pub(crate) const A_STAGE_BYTES: u32 = BLOCK_M * BLOCK_K * 2;
const B_STAGE_BYTES: u32 = BLOCK_N * BLOCK_K * 2;
pub(crate) const STAGE_BYTES: u32 = A_STAGE_BYTES + B_STAGE_BYTES;
/// Where a consumer warpgroup stages its results for TMA stores: 128 of its 256 columns at a
/// time, as two 64 × 64 boxes with the 128-byte swizzle (the 33 KiB the stages leave).
pub(crate) const STAGING_BYTES: u32 = 16384;
/// Tiles, the two warpgroups' staging, then `STAGES` "full" and `STAGES` "empty" mbarriers,
/// plus 1 KiB to align the tiles to the 1 KiB the 128-byte swizzle repeats over: 226 KiB of
/// the 227 a block may have.
pub(crate) const SMEM_BYTES: u32 = STAGES * STAGE_BYTES + 2 * STAGING_BYTES + 1024 + 1024;
/// One arrival per consumer warp frees a stage.
pub(crate) const CONSUMER_WARPS: u32 = 8;

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
    pub(crate) const fn tile(self, rows: u32) -> Tile {
        match self {
            Major::K => Tile::KMajor { rows },
            Major::Mn => Tile::MnMajor { box_bytes: 8192 },
        }
    }
}

/// One stage's k-slice for one consumer warpgroup: four `m64n256` steps (k16 bf16, k32 FP8).
pub(crate) const fn k_slice(operands: Operands, a: Major, b: Major) -> Chain {
    Chain {
        operands,
        n: 256,
        steps: 4,
        accumulate: true,
        a: ASource::Smem(a.tile(BLOCK_M)),
        b: b.tile(BLOCK_N),
    }
}

/// How an FP8 product adds up its k: `wgmma`'s own accumulator for the whole of k (`Fast`), or
/// each 128-deep slice multiplied into a fresh one whose partial sums are then added into f32
/// registers (`Promoted`: Transformer Engine's split accumulator, cuBLAS without fast
/// accumulation). Hopper's FP8 `wgmma` adds its products with fewer bits than f32 (DeepSeek-V3
/// measured about 14), which over a long k loses what promotion keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Accumulation {
    Fast,
    Promoted,
}

/// Registers a thread of the producer warpgroup keeps when the consumers promote; each consumer
/// takes [`PROMOTING_REGISTERS`]: 128 × 40 + 256 × 232 of the 65 536 an SM has.
const PRODUCER_REGISTERS: u32 = 40;
/// A promoting consumer's registers: its 128-register tile accumulator, the 64 of a half's
/// fresh one, and the addresses and loop state (the fast kernel's consumers need 154 of the 168
/// that 384 threads leave each, so promotion needs the producer's spare ones).
const PROMOTING_REGISTERS: u32 = 232;

/// A fresh 128-column chain over a 128-deep slice of FP8 codes, both operands K-major tiles of
/// 128 rows: the promoted GEMM's halves and the blockwise GEMM's slices.
pub(crate) const fn fresh_slice(operands: Operands) -> Chain {
    Chain {
        operands,
        n: 128,
        steps: 4,
        accumulate: false,
        a: ASource::Smem(Tile::KMajor { rows: 128 }),
        b: Tile::KMajor { rows: 128 },
    }
}

/// `acc` plus one stage's slice, promoted: each 128-column half of B's 256 rows (16 KiB apart
/// in the stage, a whole number of the swizzle's 1 KiB atoms) multiplied into a fresh
/// accumulator, then added into the half's 64 registers of `acc` (`hopper`'s layout: columns
/// `128h..128h+127` are registers `64h..64h+63` of an `m64n256` accumulator).
#[cube]
fn promote_slice(acc: &mut Acc256, desc_a: u64, b_tile: u32, #[comptime] operands: Operands) {
    #[unroll]
    for half in 0..2u32 {
        let desc_b = descriptor(b_tile + half * 16384, comptime!(Tile::KMajor { rows: 128 }));
        let part = chain_128_fresh(desc_a, desc_b, comptime!(fresh_slice(operands)));
        #[unroll]
        for r in 0..64u32 {
            let at = (half * 64 + r) as usize;
            acc.insert(at, acc.extract(at) + part.extract(r as usize));
        }
    }
}

/// How tiles are handed to blocks.
///
/// A block runs its tiles one after another, keeping its pipeline's stage and parity count
/// across them, so its producer loads the next tile's first slices while the consumers store the
/// last one's results. With one block an SM (the stages take 194 KiB), `Persistent` launches one
/// block an SM and so pays the block's start (barriers, descriptor fetch, pipeline fill) once;
/// `TilePerBlock` launches a block a tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Schedule {
    TilePerBlock,
    Persistent,
}

/// `E` the operands' element (bf16, or u8 holding FP8 codes); `scale_a[0] · scale_b[0]`
/// multiplies the results when `scaled`; FP8 codes may promote ([`Accumulation`]); when
/// `rotated`, each 128 columns a head RoPE rotates for position `row % seq` by the `cos` and
/// `sin` tables ([`gemm_rotated`]).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn gemm_kernel<E: Scalar>(
    a: &TensorMap<E, Tiled>,
    b: &TensorMap<E, Tiled>,
    c: &mut TensorMap<bf16, Tiled>,
    scale_a: &Tensor<f32>,
    scale_b: &Tensor<f32>,
    cos: &Tensor<f32>,
    sin: &Tensor<f32>,
    m: u32,
    n: u32,
    k: u32,
    seq: u32,
    #[comptime] a_major: Major,
    #[comptime] b_major: Major,
    #[comptime] operands: Operands,
    #[comptime] scaled: bool,
    #[comptime] accumulation: Accumulation,
    #[comptime] rotated: bool,
) {
    let promoted = comptime!(accumulation == Accumulation::Promoted);
    let depth = comptime!(block_k(operands));
    let (tiles, staging, full, empty) = pipeline_smem(SMEM_BYTES, STAGES, STAGE_BYTES, 2 * STAGING_BYTES);

    let k_tiles = k.div_ceil(depth);
    let (rows, columns) = (m.div_ceil(BLOCK_M), n.div_ceil(BLOCK_N));
    // This block's tiles: CUBE_POS_X, then every CUBE_COUNT_X-th.
    let mine = (rows * columns - CUBE_POS_X).div_ceil(CUBE_COUNT_X);
    let warpgroup = UNIT_POS / 128;

    // Fast, no `setmaxnreg` split between producer and consumers: the consumers need 154
    // registers, under the 168 that 384 threads leave each (measured: the split changed no
    // timing). Promoting, or holding RoPE's table values through the tile, they need more,
    // which the producer hands over.
    let claims = comptime!(promoted || rotated);
    if warpgroup == 0 {
        if comptime!(claims) {
            release_registers(PRODUCER_REGISTERS);
        }
        if UNIT_POS == 0 {
            let pipeline = comptime!(Pipeline::wide(STAGES, depth, a_major, b_major));
            let b = tensor_map_address(b);
            let maps = (tensor_map_address(a), b, b);
            produce(maps, tiles, full, empty, mine, k_tiles, (rows, columns), pipeline);
        }
    } else {
        if comptime!(claims) {
            claim_registers(PROMOTING_REGISTERS);
        }
        let consumer = warpgroup - 1;
        let buffer = staging + consumer * STAGING_BYTES;
        // One thread a warpgroup issues its stores.
        let storer = UNIT_POS.is_multiple_of(128);
        let map_c = store_map_address(c);
        let mut factor = 1.0f32;
        if comptime!(scaled) {
            factor = scale_a[0] * scale_b[0];
        }
        for i in 0..mine {
            let (row, column) = tile_position(CUBE_POS_X + i * CUBE_COUNT_X, rows, columns);
            let (row0, col0) = (row * BLOCK_M + consumer * 64, column * BLOCK_N);
            // Rotating, the tile's table values load now and arrive while it is computed.
            let mut cos_values = Acc64::zeroed();
            let mut sin_values = Acc64::zeroed();
            if comptime!(rotated) {
                cos_values = rotated::table_values(cos, row0, seq);
                sin_values = rotated::table_values(sin, row0, seq);
            }
            let mut acc = Acc256::zeroed();
            for kt in 0..k_tiles {
                let slice = i * k_tiles + kt;
                let stage = slice % STAGES;
                mbarrier_wait(full + stage * 8, (slice / STAGES) & 1);
                let tile = tiles + stage * STAGE_BYTES;
                // This warpgroup's 64 rows of A start 8 KiB into the stage in either layout.
                let desc_a = descriptor(tile + consumer * 8192, comptime!(a_major.tile(BLOCK_M)));
                match comptime!(accumulation) {
                    Accumulation::Fast => {
                        let desc_b = descriptor(tile + A_STAGE_BYTES, comptime!(b_major.tile(BLOCK_N)));
                        acc = chain_256(&acc, desc_a, desc_b, comptime!(k_slice(operands, a_major, b_major)));
                    }
                    Accumulation::Promoted => promote_slice(&mut acc, desc_a, tile + A_STAGE_BYTES, operands),
                }
                if UNIT_POS.is_multiple_of(32) {
                    mbarrier_arrive(empty + stage * 8);
                }
            }
            if comptime!(rotated) {
                #[unroll]
                for pass in 0..2u32 {
                    rotated::stage_rotated(&acc, &cos_values, &sin_values, buffer, 1 + consumer, storer, pass);
                    send_pass(map_c, col0 + pass * 128, row0, buffer, 1 + consumer, storer);
                }
            } else {
                store_tile(&acc, factor, buffer, map_c, row0, col0, 1 + consumer, storer, 2u32);
            }
        }
        if storer {
            bulk_wait();
        }
    }
}

/// Why [`gemm`] cannot run a product.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WgmmaError {
    /// Only bf16 operands ([`gemm`]), or u8 FP8 codes of E4M3 or E5M2 ([`fp8_gemm`]).
    DType(DType, DType),
    /// TMA needs 16-byte aligned rows: k must be a multiple of 8 (bf16) or 16 (FP8), and
    /// FP8's two operands must agree on it.
    Unaligned { k: usize },
    /// The operands are not CUDA tensors (or are autodiff tensors).
    NotCuda,
    /// A block scale tensor ([`fp8_blockwise_gemm`]) is not f32 of the shape its operand needs.
    Scales { expected: [usize; 2], found: Vec<usize> },
}

impl core::fmt::Display for WgmmaError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::DType(l, r) => write!(
                f,
                "the wgmma GEMM takes bf16 operands, or u8 codes of E4M3 or E5M2, not {l:?} · {r:?}"
            ),
            Self::Unaligned { k } => write!(
                f,
                "the wgmma GEMM needs k a multiple of 8 (bf16) or 16 (FP8), the same in both operands, not {k}"
            ),
            Self::NotCuda => write!(f, "the wgmma GEMM runs on CUDA tensors without autodiff"),
            Self::Scales { expected, found } => write!(
                f,
                "the blockwise FP8 GEMM needs f32 block scales of shape {expected:?}, not {found:?}"
            ),
        }
    }
}

impl std::error::Error for WgmmaError {}

/// Whether TMA reads a bf16 matrix's rows in place: contiguous, their stride 16-byte aligned.
pub(crate) fn tma_rows(t: &CubeTensor) -> bool {
    let strides = t.meta.strides();
    strides[1] == 1 && (strides[0] * 2).is_multiple_of(16)
}

/// An operand as the kernel reads it: `t` itself or its transpose, whichever has contiguous
/// rows with 16-byte aligned row strides (TMA's rule), else a K-major copy. `k_last` says
/// whether `t`'s last dim is k (A, `[m, k]`) or its first (B, `[k, n]`).
fn operand(t: CubeTensor, k_last: bool) -> (CubeTensor, Major) {
    let (k_major, mn_major) = match k_last {
        true => (t.clone(), Cube::float_transpose(t)),
        false => (Cube::float_transpose(t.clone()), t),
    };
    if tma_rows(&k_major) {
        (k_major, Major::K)
    } else if tma_rows(&mn_major) {
        (mn_major, Major::Mn)
    } else {
        (into_contiguous(k_major), Major::K)
    }
}

/// `lhs · rhs` on the wgmma kernel, its tiles handed to blocks as `schedule` says.
///
/// # Shapes
/// `[m, k]`, `[k, n]` → `[m, n]`; operands may be transposed views.
pub fn gemm(lhs: CubeTensor, rhs: CubeTensor, schedule: Schedule) -> Result<CubeTensor, WgmmaError> {
    if lhs.dtype != DType::BF16 || rhs.dtype != DType::BF16 {
        return Err(WgmmaError::DType(lhs.dtype, rhs.dtype));
    }
    let (m, k) = (lhs.meta.shape()[0], lhs.meta.shape()[1]);
    let n = rhs.meta.shape()[1];
    if k % 8 != 0 {
        return Err(WgmmaError::Unaligned { k });
    }
    let (a, a_major) = operand(lhs, true);
    let (b, b_major) = operand(rhs, false);
    Ok(launch(
        [(a, a_major), (b, b_major)],
        [m, n, k],
        Operands::Bf16,
        None,
        schedule,
        None,
    ))
}

/// `scale_a · scale_b · A · Bᵀ` of FP8 codes on the wgmma kernel, in bf16: `a` holds `[m, k]`
/// codes of `formats.0`, `b` `[n, k]` codes of `formats.1` (both K-major, as FP8 `wgmma` reads
/// them), as u8; `scales` (each `[1]`, f32, on the device: the operands' dequantization
/// scales) multiply the f32 accumulators as they leave (per-tensor scaling), so their product
/// costs no launch of its own; `accumulation` says how the partial sums along k add up.
///
/// # Shapes
/// `[m, k]`, `[n, k]`, `[1]` and `[1]` → `[m, n]`
pub fn fp8_gemm(
    a: CubeTensor,
    b: CubeTensor,
    formats: (Minifloat, Minifloat),
    scales: [CubeTensor; 2],
    schedule: Schedule,
    accumulation: Accumulation,
) -> Result<CubeTensor, WgmmaError> {
    let fp8 = |f: Minifloat| matches!(f, Minifloat::E4M3 | Minifloat::E5M2);
    if a.dtype != DType::U8 || b.dtype != DType::U8 || !fp8(formats.0) || !fp8(formats.1) {
        return Err(WgmmaError::DType(a.dtype, b.dtype));
    }
    let (m, k) = (a.meta.shape()[0], a.meta.shape()[1]);
    let n = b.meta.shape()[0];
    if k % 16 != 0 || b.meta.shape()[1] != k {
        return Err(WgmmaError::Unaligned { k });
    }
    let (a, b) = (into_contiguous(a), into_contiguous(b));
    let scales = scales.map(into_contiguous);
    Ok(launch(
        [(a, Major::K), (b, Major::K)],
        [m, n, k],
        Operands::Fp8(formats.0, formats.1),
        Some((scales, accumulation)),
        schedule,
        None,
    ))
}

/// The bf16 `[m, n]` result of a product of `a`'s device. TMA stores need 16-byte rows: an n
/// that is no multiple of 8 gets padded rows, and the result is the `[m, n]` view of them.
pub(crate) fn output(a: &CubeTensor, m: usize, n: usize) -> CubeTensor {
    let padded = n.next_multiple_of(8);
    let client = a.client.clone();
    let handle = client.empty(m * padded * DType::BF16.size());
    CubeTensor::new(
        client,
        handle,
        Metadata::new(shape![m, n], strides![padded, 1]),
        a.device.clone(),
        DType::BF16,
    )
}

/// The TMA map the consumers store `out` through: 64 × 64 boxes with the 128-byte swizzle.
pub(crate) fn store_map(out: &CubeTensor) -> TensorMapArg<Tiled> {
    TensorMapArg::new(
        TiledArgs {
            tile_size: shape![64, 64],
        },
        out.clone().into_tensor_arg(),
        ElemType::Float(FloatKind::BF16),
    )
    .with_swizzle(TensorMapSwizzle::B128)
}

/// The TMA map an operand's slices are loaded through, with the 128-byte swizzle: boxes of
/// `rows` × `depth` (K-major) or `depth` k × 64 (MN-major, [`load_operand`]).
pub(crate) fn operand_map(t: CubeTensor, major: Major, rows: u32, depth: u32, elem: ElemType) -> TensorMapArg<Tiled> {
    let tile_size = match major {
        Major::K => shape![rows as usize, depth as usize],
        Major::Mn => shape![depth as usize, 64],
    };
    TensorMapArg::new(TiledArgs { tile_size }, t.into_tensor_arg(), elem).with_swizzle(TensorMapSwizzle::B128)
}

/// Blocks for `tiles` tiles run persistently: one an SM fits (shared memory), so more would
/// only queue.
pub(crate) fn persistent_blocks(client: &cubecl::client::Client, tiles: u32) -> u32 {
    tiles.min(
        client
            .properties()
            .hardware
            .num_streaming_multiprocessors
            .unwrap_or(tiles),
    )
}

/// RoPE's tables (`[≥ seq, 64]` f32, contiguous) and the sequence length for a product whose
/// heads leave rotated ([`gemm_rotated`]).
pub(crate) struct Rotation {
    pub(crate) cos: CubeTensor,
    pub(crate) sin: CubeTensor,
    pub(crate) seq: usize,
}

/// Launches the kernel on operands already laid out for it; the bf16 `[m, n]` result. FP8
/// codes come with their scales and accumulation; bf16 results may leave rotated.
fn launch(
    [(a, a_major), (b, b_major)]: [(CubeTensor, Major); 2],
    [m, n, k]: [usize; 3],
    operands: Operands,
    scales: Option<([CubeTensor; 2], Accumulation)>,
    schedule: Schedule,
    rotation: Option<Rotation>,
) -> CubeTensor {
    let out = output(&a, m, n);
    let client = out.client.clone();
    let depth = block_k(operands);
    let elem = match operands {
        Operands::Bf16 => ElemType::Float(FloatKind::BF16),
        Operands::Fp8(..) => ElemType::UInt(UIntKind::U8),
    };
    let map = |t: CubeTensor, major: Major, rows: u32| operand_map(t, major, rows, depth, elem);
    let tiles = (m as u32).div_ceil(BLOCK_M) * (n as u32).div_ceil(BLOCK_N);
    let blocks = match schedule {
        Schedule::TilePerBlock => tiles,
        Schedule::Persistent => persistent_blocks(&client, tiles),
    };
    let scaled = scales.is_some();
    let (scales, accumulation) = match scales {
        Some((scales, accumulation)) => (Some(scales), accumulation),
        None => (None, Accumulation::Fast),
    };
    // Unscaled, the kernel reads no scale, unrotated no table: an empty one-element buffer
    // stands in for each.
    let empty = CubeTensor::new_contiguous(
        client.clone(),
        out.device.clone(),
        shape![1],
        client.empty(4),
        DType::F32,
    );
    let [scale_a, scale_b] = scales.unwrap_or_else(|| [empty.clone(), empty.clone()]);
    let rotated = rotation.is_some();
    let (cos, sin, seq) = match rotation {
        Some(Rotation { cos, sin, seq }) => (cos, sin, seq as u32),
        None => (empty.clone(), empty, 1),
    };
    let c = store_map(&out);
    let (count, dim) = (CubeCount::Static(blocks, 1, 1), CubeDim::new_1d(384));
    let (a, b) = (map(a, a_major, BLOCK_M), map(b, b_major, BLOCK_N));
    let args = (m as u32, n as u32, k as u32);
    // One launch for bf16 or FP8 codes: the kernel is generic over the operands' element.
    macro_rules! launch {
        ($element:ty) => {
            // SAFETY: the maps cover exactly the operands and the output (TMA fills
            // out-of-range boxes with zeros when loading and drops their out-of-range parts
            // when storing); each scale holds one f32, read only when `scaled`; the tables are
            // read only when `rotated`, at rows below `seq` (which they cover) and columns
            // below 64.
            unsafe {
                gemm_kernel::launch_unchecked::<$element>(
                    &client,
                    count,
                    dim,
                    a,
                    b,
                    c,
                    scale_a.into_tensor_arg(),
                    scale_b.into_tensor_arg(),
                    cos.into_tensor_arg(),
                    sin.into_tensor_arg(),
                    args.0,
                    args.1,
                    args.2,
                    seq,
                    a_major,
                    b_major,
                    operands,
                    scaled,
                    accumulation,
                    rotated,
                )
            }
        };
    }
    match operands {
        Operands::Bf16 => launch!(bf16),
        Operands::Fp8(..) => launch!(u8),
    }
    out
}
