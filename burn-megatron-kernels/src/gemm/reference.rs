//! The products of [`GemmOps`](super::GemmOps) in plain tensor ops: Burn's matmul, and a
//! product's heads rotated by RoPE after it (what the CUDA kernels fuse into the product's
//! epilogue): the CPU path and the fallback for what those kernels do not take.

use burn::backend::TensorMetadata;
use burn::backend::tensor::FloatTensor;

use crate::quant::notes::NoteAmaxes;
use crate::rope::RopeOps;

/// `y`'s heads (`[m, n]`, each `d = 2 · cos.dims[1]` columns one, rows `[m/seq, seq]`) rotated
/// by RoPE's kernel or twin: a product's rotation where its epilogue does not.
pub fn rotate_heads<B: RopeOps>(
    y: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    seq: usize,
) -> FloatTensor<B> {
    let [m, n] = [y.shape()[0], y.shape()[1]];
    let d = 2 * cos.shape()[1];
    let heads = B::float_swap_dims(B::float_reshape(y, [m / seq, seq, n / d, d].into()), 1, 2);
    let rotated = B::rope(heads, cos, sin, false, NoteAmaxes::default());
    B::float_reshape(B::float_swap_dims(rotated, 1, 2), [m, n].into())
}
