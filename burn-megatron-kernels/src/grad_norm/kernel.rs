//! The CUDA kernel of a global gradient norm's sums of squares: one partial sum a block of 256
//! threads, every load of a chunk in flight at once.

use burn::backend::Cube;
use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::{bf16, f16};

use super::{CHUNK as CHUNK_VECTORS, partials_count, reference, vector};
use crate::cuda::launch::{compact_input, launch_float};
use crate::cuda::reduce::{block_sum, hsum};
/// Vectors one block of [`partials_kernel`] reduces: 256 threads, 8 vectors each.
const CHUNK: u32 = CHUNK_VECTORS as u32;

/// Block `b` writes `Σ x²` over vectors `[b·CHUNK, (b+1)·CHUNK)` of `x`'s first `vectors` to
/// `partials[offset + b]` (a gradient norm's). The length is an argument: `x` may be a view into a longer
/// buffer (a parameter's shard of a reduce-scattered bucket), whose `len()` runs to the buffer's
/// end. A whole chunk is read in one unrolled sweep, so a thread has all its loads in flight at
/// once; the last, partial chunk in a loop.
#[cube(launch_unchecked)]
fn partials_kernel<F: Float, N: Size>(x: &Tensor<Vector<F, N>>, partials: &mut Tensor<f32>, vectors: u32, offset: u32) {
    let start = CUBE_POS as u32 * CHUNK;
    let mut acc = 0.0f32;
    if start + CHUNK <= vectors {
        #[unroll]
        for i in 0..CHUNK / 256 {
            let value = Vector::<f32, N>::cast_from(x[(start + UNIT_POS + i * 256) as usize]);
            acc += hsum(value * value);
        }
    } else {
        for i in range_stepped(start + UNIT_POS, vectors, 256u32) {
            let value = Vector::<f32, N>::cast_from(x[i as usize]);
            acc += hsum(value * value);
        }
    }
    let total = block_sum(acc);
    if UNIT_POS == 0 {
        partials[offset as usize + CUBE_POS] = total;
    }
}
/// `out` with `x`'s partial sums of squares written from `offset`, one a block of
/// [`partials_kernel`] ([`partials_count`] of them), in place where nothing else holds `out`.
pub(crate) fn square_partials_into(x: CubeTensor, out: CubeTensor, offset: usize) -> CubeTensor {
    let n = x.meta.num_elements();
    let fits = matches!(x.dtype, DType::BF16 | DType::F16 | DType::F32)
        && out.dtype == DType::F32
        && out.can_mut()
        && n > 0
        && offset + partials_count(n) <= out.meta.num_elements();
    let (true, Some(x), Some(out)) = (
        fits,
        compact_input(x.clone()).filter(|_| fits),
        compact_input(out.clone()),
    ) else {
        return reference::partials_into::<Cube>(x, out, offset);
    };
    let vector = vector(n);
    let blocks = partials_count(n) as u32;
    launch_float!(
        x.dtype,
        partials_kernel,
        &x.client,
        CubeCount::Static(blocks, 1, 1),
        CubeDim::new_1d(256),
        vector,
        x.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        (n / vector) as u32,
        offset as u32,
    );
    out
}
