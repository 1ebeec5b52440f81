//! Launching the flash kernels on Burn's CUDA tensors, and the checks that send anything they
//! do not take to the reference.

use burn::backend::Cube;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, Int, Shape, Tensor};
use burn_cubecl::cubecl::ir::{ElemType, FloatKind};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use cubecl::zspace::shape;

use super::flash::{self, HEAD_DIM};
use super::reference::{self, Mask};
use crate::quant::notes::{AmaxNotes, NoteAmaxes};

/// Why a call runs on the reference instead of the flash kernels ([`supports`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unsupported {
    DType(DType),
    HeadDim(usize),
    /// q, k and v must share `[b, h, s, d]` (no cross-attention lengths yet).
    Shapes(Vec<usize>, Vec<usize>, Vec<usize>),
}

/// `t` with a contiguous head dim and 16-byte aligned strides (what TMA reads), else a copy.
fn tma_ready(t: CubeTensor) -> CubeTensor {
    let strides = t.meta.strides();
    let ok = strides[3] == 1 && strides[..3].iter().all(|s| (s * 2).is_multiple_of(16));
    if ok { t } else { into_contiguous(t) }
}

/// Whether the flash kernels take these q, k, v (else the reference runs): bf16, one shape,
/// head dim at most 128 (below it, zero-padded to 128: [`widen`]).
pub fn supports(q: &CubeTensor, k: &CubeTensor, v: &CubeTensor) -> Result<(), Unsupported> {
    match check(q, k, v) {
        Err(Unsupported::HeadDim(d)) if d < HEAD_DIM => Ok(()),
        checked => checked.map(|_| ()),
    }
}

/// A `[b, h, s, d]` tensor zero-padded to the kernels' head dim. Padded q and k add nothing to
/// any score, padded v nothing to the outputs' first `d` columns, and the caller's scale is the
/// real head dim's: the kernels' results narrowed back to `d` columns are exactly the unpadded
/// attention's, at the cost of 128-wide products (2× for head dim 64) and O(s) copies.
fn widen(t: CubeTensor) -> CubeTensor {
    let t = tensor::<4>(t);
    let [b, h, s, d] = t.dims();
    let zeros = Tensor::<4>::zeros([b, h, s, HEAD_DIM - d], (&t.device(), t.dtype()));
    primitive(Tensor::cat(vec![t, zeros], 3))
}

/// The first `d` columns of a widened result.
fn narrow(t: CubeTensor, d: usize) -> CubeTensor {
    primitive(tensor::<4>(t).narrow(3, 0, d))
}

fn check(q: &CubeTensor, k: &CubeTensor, v: &CubeTensor) -> Result<[usize; 4], Unsupported> {
    for t in [q, k, v] {
        if t.dtype != DType::BF16 {
            return Err(Unsupported::DType(t.dtype));
        }
    }
    let dims = |t: &CubeTensor| t.meta.shape().iter().copied().collect::<Vec<_>>();
    if dims(q) != dims(k) || dims(q) != dims(v) || dims(q).len() != 4 {
        return Err(Unsupported::Shapes(dims(q), dims(k), dims(v)));
    }
    let [b, h, s, d] = [dims(q)[0], dims(q)[1], dims(q)[2], dims(q)[3]];
    if d != HEAD_DIM {
        return Err(Unsupported::HeadDim(d));
    }
    Ok([b, h, s, d])
}

/// A compact (unpitched) tensor of `dims`, which the kernels index as laid out.
fn compact(like: &CubeTensor, dims: &[usize], dtype: DType) -> CubeTensor {
    let handle = like.client.empty(dims.iter().product::<usize>() * dtype.size());
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        Shape::from(dims.to_vec()),
        handle,
        dtype,
    )
}

/// A compact bf16 tensor's memory as `u32` bf16 pairs (its last dim halved), for the kernels'
/// 4-byte stores.
fn pairs(t: &CubeTensor) -> CubeTensor {
    let mut dims = t.meta.shape().to_vec();
    *dims.last_mut().expect("a tensor of results") /= 2;
    CubeTensor::new_contiguous(
        t.client.clone(),
        t.device.clone(),
        Shape::from(dims),
        t.handle.clone(),
        DType::U32,
    )
}

/// A TMA map of `rows` × 64 boxes over a `[b, h, s, 128]` view.
fn map(t: &CubeTensor, rows: usize) -> TensorMapArg<Tiled> {
    TensorMapArg::new(
        TiledArgs {
            tile_size: shape![1, 1, rows, 64],
        },
        t.clone().into_tensor_arg(),
        ElemType::Float(FloatKind::BF16),
    )
    .with_swizzle(TensorMapSwizzle::B128)
}

/// A TMA map of 64-row × 32-column boxes over dQ's f32 sums `[b·h·s, 128]`, which the backward
/// adds its partials into.
fn sums_map(sums: &CubeTensor) -> TensorMapArg<Tiled> {
    TensorMapArg::new(
        TiledArgs {
            tile_size: shape![64, 32],
        },
        sums.clone().into_tensor_arg(),
        ElemType::Float(FloatKind::F32),
    )
    .with_swizzle(TensorMapSwizzle::B128)
}

/// The keys the kernels hide from each query: those after it (causal) or none, or those
/// outside its document (`starts` `[b, s]`, each query's document's first position; causal).
#[derive(Clone)]
pub(super) enum Masking {
    Causal(bool),
    /// Boxed: a tensor handle is some 550 bytes, the causal flag one.
    Documents(Box<CubeTensor>),
}

impl Masking {
    fn causal(&self) -> bool {
        !matches!(self, Self::Causal(false))
    }

    /// The starts as the kernels read them (compact f32, exact below 2²⁴) and whether there
    /// are any: else one unused word beside `like`.
    fn starts(&self, like: &CubeTensor) -> (CubeTensor, bool) {
        match self {
            Self::Documents(starts) => {
                let starts = Tensor::<2, Int>::from_primitive::<Cube>(starts.as_ref().clone())
                    .float()
                    .cast(DType::F32);
                (into_contiguous(primitive(starts)), true)
            }
            Self::Causal(_) => (compact(like, &[1], DType::F32), false),
        }
    }

    /// The f32 reference's forward under this mask.
    fn reference_forward(&self, q: CubeTensor, k: CubeTensor, v: CubeTensor, scale: f32) -> (CubeTensor, CubeTensor) {
        let (out, lse) = match self {
            Self::Causal(causal) => reference::forward(tensor(q), tensor(k), tensor(v), *causal, scale),
            Self::Documents(starts) => {
                let starts = Tensor::<2, Int>::from_primitive::<Cube>(starts.as_ref().clone());
                reference::forward_masked(tensor(q), tensor(k), tensor(v), Mask::Documents(&starts), scale)
            }
        };
        (primitive(out), primitive(lse))
    }

    /// The f32 reference's backward under this mask.
    #[allow(clippy::too_many_arguments)]
    fn reference_backward(
        &self,
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        out: CubeTensor,
        lse: CubeTensor,
        grad: CubeTensor,
        scale: f32,
    ) -> (CubeTensor, CubeTensor, CubeTensor) {
        let (q, k, v, out, lse, grad) = (tensor(q), tensor(k), tensor(v), tensor(out), tensor(lse), tensor(grad));
        let (dq, dk, dv) = match self {
            Self::Causal(causal) => reference::backward(q, k, v, out, lse, grad, *causal, scale),
            Self::Documents(starts) => {
                let starts = Tensor::<2, Int>::from_primitive::<Cube>(starts.as_ref().clone());
                reference::backward_masked(q, k, v, out, lse, grad, Mask::Documents(&starts), scale)
            }
        };
        (primitive(dq), primitive(dk), primitive(dv))
    }
}

/// Attention inside each query's document (`AttentionOps::document_attention_forward`).
pub(super) fn document_attention_forward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    starts: CubeTensor,
    scale: f32,
) -> (CubeTensor, CubeTensor) {
    forward(q, k, v, Masking::Documents(Box::new(starts)), scale, None)
}

/// [`document_attention_forward`]'s backward.
#[allow(clippy::too_many_arguments)]
pub(super) fn document_attention_backward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    out: CubeTensor,
    lse: CubeTensor,
    grad: CubeTensor,
    starts: CubeTensor,
    scale: f32,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let masking = Masking::Documents(Box::new(starts));
    backward(q, k, v, out, lse, grad, masking, scale, None)
}

/// `[b, s, h, d]` storage seen as `[b, h, s, d]`.
fn heads_view(t: CubeTensor) -> CubeTensor {
    Cube::float_swap_dims(t, 1, 2)
}

fn tensor<const D: usize>(t: CubeTensor) -> Tensor<D> {
    Tensor::from_primitive::<Cube>(t)
}

fn primitive<const D: usize>(t: Tensor<D>) -> CubeTensor {
    t.try_into_primitive::<Cube>().expect("a CUDA tensor")
}

/// 1 / √d · log₂(e): the kernels' softmax runs in base 2.
fn scale_log2(scale: f32) -> f32 {
    scale * core::f32::consts::LOG2_E
}

/// `AttentionOps::attention_forward`: [`forward`] with the causal mask or none.
pub(super) fn attention_forward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    causal: bool,
    scale: f32,
    notes: Option<AmaxNotes>,
) -> (CubeTensor, CubeTensor) {
    forward(q, k, v, Masking::Causal(causal), scale, notes)
}

/// The output and `lse₂`; with `note`, the output's amax is noted for the FP8 cast that
/// quantizes it next (`known_amax`, on its memory as one row: the output projection reads it
/// `[b·s, h·d]`).
fn forward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    masking: Masking,
    scale: f32,
    notes: Option<AmaxNotes>,
) -> (CubeTensor, CubeTensor) {
    let note = notes.is_some();
    let [b, h, s, d] = match check(&q, &k, &v) {
        Ok(dims) => dims,
        Err(Unsupported::HeadDim(d)) if d < HEAD_DIM => {
            // Padded columns are zeros: the output's amax is the cast's to find, not noted.
            let (out, lse) = forward(widen(q), widen(k), widen(v), masking, scale, None);
            return (narrow(out, d), lse);
        }
        Err(_) => return masking.reference_forward(q, k, v, scale),
    };
    let (starts, documents) = masking.starts(&q);
    let (q, k, v) = (tma_ready(q), tma_ready(k), tma_ready(v));
    let out = compact(&q, &[b, s, h, d], DType::BF16);
    let lse = compact(&q, &[b, h, s], DType::F32);
    let blocks = s.div_ceil(128) * h * b;
    // A maximum a warp (8 a block); one unused word without a note.
    let maxima = compact(&q, &[if note { 8 * blocks } else { 1 }], DType::F32);
    let count = CubeCount::Static(s.div_ceil(128) as u32, h as u32, b as u32);
    // SAFETY: the maps cover exactly q, k and v (TMA fills rows past s with zeros); every store
    // is checked against s; with a note each warp writes its own of the `8 · blocks` maxima.
    unsafe {
        flash::forward_kernel::launch_unchecked(
            &q.client,
            count,
            CubeDim::new_1d(256),
            map(&q, 128),
            map(&k, 128),
            map(&v, 128),
            pairs(&out).into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            maxima.clone().into_tensor_arg(),
            starts.into_tensor_arg(),
            s as u32,
            h as u32,
            scale_log2(scale),
            masking.causal(),
            note,
            documents,
        );
    }
    if let Some(notes) = notes {
        notes.lock().record_maxima(&crate::cuda::known_amax::flat(&out), maxima);
    }
    (heads_view(out), lse)
}

/// RoPE's `[≥ s, d/2]` f32 tables, whose rotation the backward undoes on dQ and dK as it writes
/// them (`super::rotary`).
pub(super) struct Tables {
    pub cos: CubeTensor,
    pub sin: CubeTensor,
}

impl Tables {
    /// Compact tables of 64 columns covering `s` positions, which the kernels index as laid out;
    /// `None` where they are not (the caller rotates apart).
    fn for_kernels(&self, s: usize) -> Option<(CubeTensor, CubeTensor)> {
        let fits = |t: &CubeTensor| {
            t.dtype == DType::F32
                && t.meta.shape().num_dims() == 2
                && t.meta.shape()[0] >= s
                && t.meta.shape()[1] == HEAD_DIM / 2
                && t.meta.strides()[0] == HEAD_DIM / 2
                && t.meta.strides()[1] == 1
        };
        (fits(&self.cos) && fits(&self.sin)).then(|| (self.cos.clone(), self.sin.clone()))
    }
}

/// `AttentionOps::attention_backward`: [`backward`] of heads the op did not rotate.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_backward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    out: CubeTensor,
    lse: CubeTensor,
    grad: CubeTensor,
    causal: bool,
    scale: f32,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    backward(q, k, v, out, lse, grad, Masking::Causal(causal), scale, None)
}

/// The gradients of q, k and v; with `tables`, of q and k before the rotation the tables give
/// (q and k are the rotated ones the forward read).
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    out: CubeTensor,
    lse: CubeTensor,
    grad: CubeTensor,
    masking: Masking,
    scale: f32,
    tables: Option<&Tables>,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let fused = tables.map(|t| t.for_kernels(q.meta.shape()[2]));
    if let Some(None) = fused {
        // Tables the kernels cannot index: the plain backward, then the inverse rotation apart.
        let tables = tables.expect("tables");
        let (dq, dk, dv) = backward(q, k, v, out, lse, grad, masking, scale, None);
        let unrotate =
            |x| crate::rope::kernel::rope(x, tables.cos.clone(), tables.sin.clone(), true, NoteAmaxes::none());
        return (unrotate(dq), unrotate(dk), dv);
    }
    let rotation = fused.flatten();
    let [b, h, s, d] = match check(&q, &k, &v).and_then(|dims| check(&out, &grad, &out).map(|_| dims)) {
        Ok(dims) => dims,
        Err(failed) => {
            let (dq, dk, dv) = match failed {
                Unsupported::HeadDim(d) if d < HEAD_DIM => {
                    let (dq, dk, dv) = backward(
                        widen(q),
                        widen(k),
                        widen(v),
                        widen(out),
                        lse,
                        widen(grad),
                        masking,
                        scale,
                        None,
                    );
                    (narrow(dq, d), narrow(dk, d), narrow(dv, d))
                }
                _ => masking.reference_backward(q, k, v, out, lse, grad, scale),
            };
            return match tables {
                Some(t) => {
                    let unrotate =
                        |x| crate::rope::kernel::rope(x, t.cos.clone(), t.sin.clone(), true, NoteAmaxes::none());
                    (unrotate(dq), unrotate(dk), dv)
                }
                None => (dq, dk, dv),
            };
        }
    };
    let (q, k, v, grad, out) = (
        tma_ready(q),
        tma_ready(k),
        tma_ready(v),
        tma_ready(grad),
        tma_ready(out),
    );
    let delta = compact(&q, &[b, h, s], DType::F32);
    let (dq, dk, dv) = (
        compact(&q, &[b, s, h, d], DType::BF16),
        compact(&q, &[b, s, h, d], DType::BF16),
        compact(&q, &[b, s, h, d], DType::BF16),
    );
    // dQ's f32 sums, which every key block of a query row adds into (zeroed by the delta kernel).
    let sums = compact(&q, &[b * h * s, d], DType::F32);
    let rows = (b * h * s) as u32;
    let client = q.client.clone();
    // Without a rotation the kernels never read the tables: the sums stand in.
    let unrotate = rotation.is_some();
    let (cos, sin) = rotation.unwrap_or_else(|| (sums.clone(), sums.clone()));
    let (starts, documents) = masking.starts(&q);
    // SAFETY: every kernel checks its rows against s (the delta kernel, which zeroes the sums
    // before the backward adds into them, against b·h·s; the dQ conversion against the sums'
    // length; their inputs' strides are multiples of their vectors, `tma_ready`, and the sums
    // are compact); the maps cover exactly their tensors, and TMA leaves what a box reaches
    // past the sums alone.
    unsafe {
        flash::delta_kernel::launch_unchecked(
            &client,
            CubeCount::Static((rows * flash::DELTA_LANES).div_ceil(256), 1, 1),
            CubeDim::new_1d(256),
            flash::DELTA_VECTOR,
            out.into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            sums.clone().into_tensor_arg(),
            s as u32,
            h as u32,
        );
        flash::dqkv_kernel::launch_unchecked(
            &client,
            CubeCount::Static(s.div_ceil(128) as u32, h as u32, b as u32),
            CubeDim::new_1d(256),
            map(&k, 128),
            map(&v, 128),
            map(&q, 64),
            map(&grad, 64),
            lse.into_tensor_arg(),
            delta.into_tensor_arg(),
            sums_map(&sums),
            pairs(&dk).into_tensor_arg(),
            pairs(&dv).into_tensor_arg(),
            cos.clone().into_tensor_arg(),
            sin.clone().into_tensor_arg(),
            starts.into_tensor_arg(),
            s as u32,
            h as u32,
            scale_log2(scale),
            scale,
            masking.causal(),
            unrotate,
            documents,
        );
        flash::dq_out_kernel::launch_unchecked(
            &client,
            CubeCount::Static((rows * (d / 2 / flash::DQ_VECTOR) as u32).div_ceil(256), 1, 1),
            CubeDim::new_1d(256),
            flash::DQ_VECTOR,
            sums.into_tensor_arg(),
            cos.into_tensor_arg(),
            sin.into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            s as u32,
            h as u32,
            scale,
            unrotate,
        );
    }
    (heads_view(dq), heads_view(dk), heads_view(dv))
}
