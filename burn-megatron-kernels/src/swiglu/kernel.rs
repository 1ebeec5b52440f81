//! SwiGLU's CUDA kernels, on vectors of elements: one each way (the backward reads `a`, `b` and
//! the gradient once and writes both input gradients), each with a twin that also takes the
//! amax of what it writes, for the FP8 cast that quantizes it next.

use burn::backend::Cube;
use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::{bf16, f16};

use super::reference;
use crate::cuda::launch::{compact_input, compact_output, launch_dims, launch_float, vector_size};
use crate::cuda::reduce::{amax_output, block_max, finish_max, noting_dims, state, state_at, vector_max};
use crate::quant::notes::{AmaxNotes, NoteAmaxes};

#[cube]
fn sigmoid<N: Size>(x: Vector<f32, N>) -> Vector<f32, N> {
    Vector::new(1.0f32) / (Vector::new(1.0f32) + (-x).exp())
}

/// `silu(a) ∘ b`, computed in f32 and rounded once.
#[cube]
fn swiglu_value<F: Float, N: Size>(a: Vector<F, N>, b: Vector<F, N>) -> Vector<F, N> {
    let x = Vector::<f32, N>::cast_from(a);
    Vector::cast_from(x * sigmoid(x) * Vector::<f32, N>::cast_from(b))
}

/// SwiGLU's input gradients `(da, db)` from `a`, `b` and the output's gradient `g`.
#[cube]
fn swiglu_grads<F: Float, N: Size>(a: Vector<F, N>, b: Vector<F, N>, g: Vector<F, N>) -> (Vector<F, N>, Vector<F, N>) {
    let x = Vector::<f32, N>::cast_from(a);
    let y = Vector::<f32, N>::cast_from(b);
    let g = Vector::<f32, N>::cast_from(g);
    let s = sigmoid(x);
    let one = Vector::new(1.0f32);
    (
        Vector::cast_from(g * y * s * (one + x * (one - s))),
        Vector::cast_from(g * x * s),
    )
}

#[cube(launch_unchecked)]
fn swiglu_kernel<F: Float, N: Size>(
    a: &Tensor<Vector<F, N>>,
    b: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        out[i] = swiglu_value(a[i], b[i]);
    }
}

#[cube(launch_unchecked)]
fn swiglu_backward_kernel<F: Float, N: Size>(
    a: &Tensor<Vector<F, N>>,
    b: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    da: &mut Tensor<Vector<F, N>>,
    db: &mut Tensor<Vector<F, N>>,
) {
    let i = ABSOLUTE_POS;
    if i < da.len() {
        let (ga, gb) = swiglu_grads(a[i], b[i], grad[i]);
        da[i] = ga;
        db[i] = gb;
    }
}

/// [`swiglu_kernel`] strided over the grid, the largest magnitude of what it writes (as
/// written, NaN ignored) into `amax` ([`finish_max`]).
#[cube(launch_unchecked)]
fn swiglu_noting_kernel<F: Float, N: Size>(
    a: &Tensor<Vector<F, N>>,
    b: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
    state: &mut Tensor<Atomic<u32>>,
    amax: &mut Tensor<f32>,
) {
    let mut acc = 0.0f32;
    for i in range_stepped(ABSOLUTE_POS as u32, out.len() as u32, CUBE_COUNT as u32 * 256) {
        let o = swiglu_value(a[i as usize], b[i as usize]);
        out[i as usize] = o;
        acc = vector_max(acc, o);
    }
    finish_max(block_max(acc), state, amax);
}

/// [`swiglu_backward_kernel`] strided over the grid, the largest magnitudes of `da` and `db`
/// (as written, NaN ignored) into `amax_a` and `amax_b` ([`finish_max`]).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn swiglu_backward_noting_kernel<F: Float, N: Size>(
    a: &Tensor<Vector<F, N>>,
    b: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    da: &mut Tensor<Vector<F, N>>,
    db: &mut Tensor<Vector<F, N>>,
    state_a: &mut Tensor<Atomic<u32>>,
    amax_a: &mut Tensor<f32>,
    state_b: &mut Tensor<Atomic<u32>>,
    amax_b: &mut Tensor<f32>,
) {
    let mut acc_a = 0.0f32;
    let mut acc_b = 0.0f32;
    for i in range_stepped(ABSOLUTE_POS as u32, da.len() as u32, CUBE_COUNT as u32 * 256) {
        let (ga, gb) = swiglu_grads(a[i as usize], b[i as usize], grad[i as usize]);
        da[i as usize] = ga;
        db[i as usize] = gb;
        acc_a = vector_max(acc_a, ga);
        acc_b = vector_max(acc_b, gb);
    }
    finish_max(block_max(acc_a), state_a, amax_a);
    finish_max(block_max(acc_b), state_b, amax_b);
}

fn float_like(a: &CubeTensor, b: &CubeTensor) -> bool {
    a.dtype == b.dtype && matches!(a.dtype, DType::BF16 | DType::F16 | DType::F32) && a.meta.shape() == b.meta.shape()
}

/// SwiGLU's output; with `note`, its amax noted for the cast that quantizes it ([`AmaxNotes`]).
pub(crate) fn swiglu(a: CubeTensor, b: CubeTensor, notes: NoteAmaxes) -> CubeTensor {
    let note = notes.output.as_ref();
    let (Some(a), Some(b)) = (
        float_like(&a, &b).then(|| compact_input(a.clone())).flatten(),
        compact_input(b.clone()),
    ) else {
        return reference::forward::<Cube>(a, b);
    };
    let out = compact_output(&a, a.meta.shape().clone(), a.dtype);
    let len = a.meta.num_elements();
    let vector = vector_size(len);
    if let Some(notes) = note {
        let amax = amax_output(&a);
        let (count, dim) = noting_dims(&a, len, vector);
        // SAFETY (`launch_float!`): every vector is checked against the length;
        // one unit of the last block writes `amax`, and the state holds two words.
        launch_float!(
            a.dtype,
            swiglu_noting_kernel,
            &a.client,
            count,
            dim,
            vector,
            a.clone().into_tensor_arg(),
            b.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            state(&a).into_tensor_arg(),
            amax.clone().into_tensor_arg(),
        );
        notes.lock().record(&out, amax);
        return out;
    }
    let (count, dim) = launch_dims(len, vector);
    launch_float!(
        a.dtype,
        swiglu_kernel,
        &a.client,
        count,
        dim,
        vector,
        a.clone().into_tensor_arg(),
        b.into_tensor_arg(),
        out.clone().into_tensor_arg()
    );
    out
}

/// SwiGLU's input gradients; with `note`, their amaxes noted for the casts that quantize them
/// ([`AmaxNotes`]).
pub(crate) fn swiglu_backward(
    a: CubeTensor,
    b: CubeTensor,
    grad: CubeTensor,
    note: Option<AmaxNotes>,
) -> (CubeTensor, CubeTensor) {
    let note = note.as_ref();
    let fits = float_like(&a, &b) && float_like(&a, &grad);
    let (Some(a), Some(b), Some(grad)) = (
        fits.then(|| compact_input(a.clone())).flatten(),
        compact_input(b.clone()),
        compact_input(grad.clone()),
    ) else {
        return reference::backward::<Cube>(a, b, grad);
    };
    let (da, db) = (
        compact_output(&a, a.meta.shape().clone(), a.dtype),
        compact_output(&a, a.meta.shape().clone(), a.dtype),
    );
    let len = a.meta.num_elements();
    let vector = vector_size(len);
    if let Some(notes) = note {
        let (amax_a, amax_b) = (amax_output(&a), amax_output(&a));
        let (count, dim) = noting_dims(&a, len, vector);
        // SAFETY (`launch_float!`): as `swiglu`'s noting launch, with two states and amaxes.
        launch_float!(
            a.dtype,
            swiglu_backward_noting_kernel,
            &a.client,
            count,
            dim,
            vector,
            a.clone().into_tensor_arg(),
            b.into_tensor_arg(),
            grad.into_tensor_arg(),
            da.clone().into_tensor_arg(),
            db.clone().into_tensor_arg(),
            state_at(&a, 0).into_tensor_arg(),
            amax_a.clone().into_tensor_arg(),
            state_at(&a, 1).into_tensor_arg(),
            amax_b.clone().into_tensor_arg(),
        );
        let mut notes = notes.lock();
        notes.record(&da, amax_a);
        notes.record(&db, amax_b);
        return (da, db);
    }
    let (count, dim) = launch_dims(len, vector);
    launch_float!(
        a.dtype,
        swiglu_backward_kernel,
        &a.client,
        count,
        dim,
        vector,
        a.clone().into_tensor_arg(),
        b.into_tensor_arg(),
        grad.into_tensor_arg(),
        da.clone().into_tensor_arg(),
        db.clone().into_tensor_arg(),
    );
    (da, db)
}
