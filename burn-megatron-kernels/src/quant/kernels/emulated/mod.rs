//! MX and NVFP4 blocks quantized and dequantized in one pass on CUDA: the emulated recipes'
//! operands (`quant::fake::fake_quantize`, ~25 tensor ops an operand, and NVFP4's Hadamard
//! transform before it) from one kernel, in the operand's dtype, read where it lies: a GEMM's
//! transposed views (`wᵀ`, `dyᵀ`, `xᵀ`) are read as the compact tensors they view and written
//! back as the same view. The same f32 arithmetic as the tensor ops, in the same order, so the
//! values are theirs bit for bit:
//!
//! - MX (1×32, E4M3): the E8M0 scale `2^k`, `k` the smallest with `amax ≤ 448 · 2^k` (from the
//!   amax's exponent and mantissa bits), each value times `2^−k` rounded onto E4M3, times `2^k`.
//! - NVFP4 (1×16 or 16×16, E2M1): the tensor's amax (one more pass, reduced over the group
//!   first) gives `encode = 448 / amax · 6`; a block's E4M3 scale `stored` is `amax_b / 6 ·
//!   encode` rounded onto E4M3; each value times `encode / stored` rounded onto E2M1 (to
//!   nearest, or stochastically), times `stored / encode`.
//!
//! - The Hadamard transform (NVFP4's wgrad operands, 1 × 16 blocks, which its 16-point
//!   blocks coincide with): sign flips, four butterfly stages and a quarter, as
//!   `quant::fake::hadamard` adds them; the tensor amax of the transformed operand is one more
//!   pass, transforming too.
//!
//! Stochastic rounding draws `quant::fake::draws`'s values from the key `quant::product` hashes
//! from the operand's shape and four of its values; the kernel hashes them itself, so no value
//! goes to the host.

use burn::backend::Cube;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::{bf16, f16};

use crate::cuda::launch::{compact_input, compact_output, is_compact, launch_float};
use crate::quant::format::Minifloat;
use crate::quant::recipe::{Blocks, Quantizer, Rounding};
use kernels::{fake_blocks_kernel, fake_columns_kernel, hadamard_amax_kernel};
use numerics::{Grid, Plan};

mod kernels;
mod numerics;

/// Values a load: 8.
const VECTOR: u32 = 8;
/// Threads a CUDA block.
const THREADS: u32 = 256;

/// How the kernels find an operand `[r, c]` in memory.
enum Source {
    /// Compact: the operand itself.
    Direct(CubeTensor),
    /// The compact `[c, r]` tensor whose transposed view the operand is.
    Transposed(CubeTensor),
}

impl Source {
    /// `x` as it lies where a kernel reads it (`r` a multiple of 8 for a transposed view),
    /// else a compact copy (`c` a multiple of 8); `None` where neither fits.
    fn of(x: CubeTensor) -> Option<Self> {
        let [r, c] = [x.meta.shape()[0], x.meta.shape()[1]];
        if is_compact(&x) && c.is_multiple_of(VECTOR as usize) {
            return Some(Self::Direct(x));
        }
        let swapped = Cube::float_swap_dims(x.clone(), 0, 1);
        if !is_compact(&x) && is_compact(&swapped) && r.is_multiple_of(VECTOR as usize) {
            return Some(Self::Transposed(swapped));
        }
        c.is_multiple_of(VECTOR as usize)
            .then(|| compact_input(x).map(Self::Direct))
            .flatten()
    }

    fn tensor(&self) -> &CubeTensor {
        match self {
            Self::Direct(x) | Self::Transposed(x) => x,
        }
    }
}

/// `x` (`[r, c]`) quantized with `q` and dequantized, in `x`'s dtype, where the kernels take it:
/// MX or NVFP4 blocks of a bf16 or f32 `x`, compact with `c` a multiple of 8 or a transposed
/// view with `r` one (any other view is copied first), and NVFP4's transform only with 1 × 16
/// blocks. The result is `[r, c]` (`[r, ⌈c/16⌉·16]` transformed) in `x`'s layout. `amax` gives
/// NVFP4's tensor amax (`[1]`, f32) from the operand's own (its group's reduction). `None`
/// otherwise.
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
    let width = match q.hadamard {
        true => dims[1].div_ceil(16) * 16,
        false => dims[1],
    };
    let fits = dims.num_dims() == 2
        && matches!(x.dtype, DType::BF16 | DType::F32)
        && (!q.hadamard || [rows, columns] == [1, 16])
        && dims[0] * dims[1] > 0
        && dims[0] * width < u32::MAX as usize;
    if !fits {
        return None;
    }
    let (r, c) = (dims[0], dims[1]);
    let source = Source::of(x)?;
    let nv = matches!(q.blocks, Blocks::Nv { .. });
    let hadamard = q.hadamard.then(crate::quant::fake::hadamard_signs);
    let plan = Plan {
        rows: rows as u32,
        columns: columns as u32,
        nv,
        stochastic: q.rounding == Rounding::Stochastic,
        values: Grid::of(q.format),
        hadamard,
        transposed: matches!(source, Source::Transposed(_)),
    };
    let tensor_amax = match (nv, hadamard) {
        (true, Some(signs)) => amax(transformed_amax(&source, signs)),
        (true, None) => amax(crate::cuda::reduce::tensor_amax(source.tensor().clone())),
        (false, _) => compact_output(source.tensor(), Shape::new([1]), DType::F32),
    };
    Some(match source {
        Source::Direct(x) => launch_blocks(x, tensor_amax, plan, [r, c], width),
        Source::Transposed(s) if rows == columns => {
            Cube::float_swap_dims(launch_blocks(s, tensor_amax, plan, [c, r], r), 0, 1)
        }
        Source::Transposed(s) => Cube::float_swap_dims(launch_columns(s, tensor_amax, plan, [c, r], width), 0, 1),
    })
}

/// [`kernels::fake_blocks_kernel`] on compact `x` (`[r, c]`), writing rows `width` long.
fn launch_blocks(x: CubeTensor, amax: CubeTensor, plan: Plan, [r, c]: [usize; 2], width: usize) -> CubeTensor {
    let out = compact_output(&x, Shape::new([r, width]), x.dtype);
    let blocks = (r.div_ceil(plan.rows as usize) * width.div_ceil(plan.columns as usize)) as u32;
    // SAFETY (`launch_float!`): a thread a block, checked against the block count; every load
    // is a whole vector of a row below `r` at a column below `c` (a multiple of 8), every store
    // one of a row below `r` at a column below `width` (a multiple of 8), of compact tensors;
    // `amax` holds one value.
    launch_float!(
        x.dtype,
        fake_blocks_kernel,
        &x.client,
        CubeCount::Static(blocks.div_ceil(THREADS), 1, 1),
        CubeDim::new_1d(THREADS),
        VECTOR as usize,
        x.clone().into_tensor_arg(),
        amax.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        r as u32,
        c as u32,
        width as u32,
        plan,
    );
    out
}

/// [`kernels::fake_columns_kernel`] on compact `x` (`[r, c]`, the operand's transpose), writing
/// `[width, c]`.
fn launch_columns(x: CubeTensor, amax: CubeTensor, plan: Plan, [r, c]: [usize; 2], width: usize) -> CubeTensor {
    let out = compact_output(&x, Shape::new([width, c]), x.dtype);
    let units = (width.div_ceil(plan.columns as usize) * c / VECTOR as usize) as u32;
    // SAFETY (`launch_float!`): a thread a unit, checked against the unit count; every load is
    // a whole vector (`c` a multiple of 8) of a row below `r`, every store one of a row below
    // `width`, of compact tensors; `amax` holds one value.
    launch_float!(
        x.dtype,
        fake_columns_kernel,
        &x.client,
        CubeCount::Static(units.div_ceil(THREADS), 1, 1),
        CubeDim::new_1d(THREADS),
        VECTOR as usize,
        x.clone().into_tensor_arg(),
        amax.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        r as u32,
        c as u32,
        width as u32,
        Plan {
            transposed: true,
            ..plan
        },
    );
    out
}

/// The largest |value| of the operand transformed (`[1]`, f32), in one launch.
fn transformed_amax(source: &Source, signs: u32) -> CubeTensor {
    let x = source.tensor();
    let [r, c] = [x.meta.shape()[0], x.meta.shape()[1]];
    let transposed = matches!(source, Source::Transposed(_));
    let units = match transposed {
        true => r.div_ceil(16) * c / VECTOR as usize,
        false => r * c.div_ceil(16),
    } as u32;
    let cubes = units.div_ceil(THREADS);
    let out = compact_output(x, Shape::new([1]), DType::F32);
    // SAFETY (`launch_float!`): every thread joins the block's reduction, and only those below
    // the unit count load: whole vectors of rows below `r`, at columns below `c` (a multiple of
    // 8); one thread of the last block writes `out`, and the state holds two words.
    launch_float!(
        x.dtype,
        hadamard_amax_kernel,
        &x.client,
        CubeCount::Static(cubes, 1, 1),
        CubeDim::new_1d(THREADS),
        VECTOR as usize,
        x.clone().into_tensor_arg(),
        crate::cuda::reduce::state(x).into_tensor_arg(),
        out.clone().into_tensor_arg(),
        r as u32,
        c as u32,
        transposed,
        signs,
    );
    out
}
