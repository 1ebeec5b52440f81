//! The tensor-op twin on any backend's primitives: the CPU path and the kernels' oracle.

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, Scalar, TensorMetadata, get_device_settings};
use burn::tensor::FloatDType;
use burn::tensor::IndexingUpdateOp;

/// `ids` with every id outside `[0, n)` replaced by `n`.
fn clamped<B: Backend>(ids: IntTensor<B>, n: usize) -> IntTensor<B> {
    let bools = get_device_settings::<B>(&ids.device()).bool_dtype;
    let below = B::int_lower_elem(ids.clone(), Scalar::from(0i64), bools);
    let above = B::int_greater_equal_elem(ids.clone(), Scalar::from(n as i64), bools);
    B::int_mask_fill(ids, B::bool_or(below, above), Scalar::from(n as i64))
}

pub fn forward<B: Backend>(weight: FloatTensor<B>, ids: IntTensor<B>) -> FloatTensor<B> {
    let n = weight.shape()[0];
    crate::rows::reference::gather::<B>(weight, clamped::<B>(ids, n))
}

/// The positions' rows added into an f32 table with one spare row (ids outside the table's
/// land there), in position order; the spare row dropped.
pub fn backward<B: Backend>(grad: FloatTensor<B>, ids: IntTensor<B>, n: usize) -> FloatTensor<B> {
    let dtype = FloatDType::from(grad.dtype());
    let d = grad.shape()[1];
    let table = B::float_zeros([n + 1, d].into(), &grad.device(), FloatDType::F32);
    let grad = B::float_cast(grad, FloatDType::F32);
    let sums = B::float_select_assign(table, 0, clamped::<B>(ids, n), grad, IndexingUpdateOp::Add);
    B::float_cast(B::float_slice(sums, &[(0..n).into(), (..).into()]), dtype)
}
