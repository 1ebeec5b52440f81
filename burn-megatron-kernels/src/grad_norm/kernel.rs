//! The CUDA kernel of a global gradient norm's sums of squares: one partial sum a block of 256
//! threads, every load of a chunk in flight at once.

use burn::backend::Cube;
use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::{bf16, f16};

use super::reference;
use crate::cuda::launch::{compact_input, compact_output, launch_float};
use crate::cuda::reduce::{block_sum, hsum};
/// Vectors one block of [`partials_kernel`] reduces: 256 threads, 8 vectors each.
const CHUNK: u32 = 2048;

/// Block `b` writes `Σ x²` over vectors `[b·CHUNK, (b+1)·CHUNK)` of `x`'s first `vectors` to
/// `partials[b]` (a gradient norm's). The length is an argument: `x` may be a view into a longer
/// buffer (a parameter's shard of a reduce-scattered bucket), whose `len()` runs to the buffer's
/// end. A whole chunk is read in one unrolled sweep, so a thread has all its loads in flight at
/// once; the last, partial chunk in a loop.
#[cube(launch_unchecked)]
fn partials_kernel<F: Float, N: Size>(x: &Tensor<Vector<F, N>>, partials: &mut Tensor<f32>, vectors: u32) {
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
        partials[CUBE_POS] = total;
    }
}
/// `Σ x²` over `x` as partial sums, one a block of [`partials_kernel`]: `[blocks]` in f32.
pub(crate) fn partial_sums_of_squares(x: CubeTensor) -> CubeTensor {
    partials(x.clone()).unwrap_or_else(|| reference::sum_of_squares::<Cube>(x))
}

/// `Σ x²` as one partial a block of [`partials_kernel`]: `[blocks]` in f32; `None` for a dtype
/// the kernel is not built for or an empty tensor.
fn partials(x: CubeTensor) -> Option<CubeTensor> {
    let n = x.meta.num_elements();
    let x = matches!(x.dtype, DType::BF16 | DType::F16 | DType::F32)
        .then(|| compact_input(x))
        .flatten()
        .filter(|_| n > 0)?;
    let vector = [8, 4, 2, 1]
        .into_iter()
        .find(|v| n.is_multiple_of(*v))
        .expect("1 divides");
    let blocks = ((n / vector) as u32).div_ceil(CHUNK);
    // Every block writes its partial: nothing to zero.
    let partials = compact_output(&x, Shape::new([blocks as usize]), DType::F32);
    launch_float!(
        x.dtype,
        partials_kernel,
        &x.client,
        CubeCount::Static(blocks, 1, 1),
        CubeDim::new_1d(256),
        vector,
        x.clone().into_tensor_arg(),
        partials.clone().into_tensor_arg(),
        (n / vector) as u32,
    );
    Some(partials)
}
