//! AdamW's CUDA kernels: the update of a parameter in its own dtype, or of fp32 master weights
//! writing the parameter's copy in the same pass (its square sum and amax taken as it goes).

use burn::backend::Cube;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, FloatDType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::{bf16, f16};

use super::reference;
use super::step::AdamWStep;
use crate::cuda::launch::{compact_input, compact_output, launch_dims, launch_float};
use crate::cuda::reduce::{block_max, block_sum, hsum, last_block, vector_max};

/// The new moments at `i` from their values `m` and `v`, written to `m_out` and `v_out`; returns
/// the new parameter `p`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn adam<N: Size>(
    i: usize,
    p: Vector<f32, N>,
    g: Vector<f32, N>,
    m: Vector<f32, N>,
    v: Vector<f32, N>,
    m_out: &mut Tensor<Vector<f32, N>>,
    v_out: &mut Tensor<Vector<f32, N>>,
    s: &AdamScalars,
) -> Vector<f32, N> {
    let g = g * Vector::new(s.grad_scale);
    let m_new = m * Vector::new(s.beta_1) + g * Vector::new(1.0f32 - s.beta_1);
    let v_new = v * Vector::new(s.beta_2) + g * g * Vector::new(1.0f32 - s.beta_2);
    m_out[i] = m_new;
    v_out[i] = v_new;
    let update = (m_new / Vector::new(s.bias_1)) / ((v_new / Vector::new(s.bias_2)).sqrt() + Vector::new(s.epsilon));
    p * Vector::new(s.decay) - update * Vector::new(s.lr)
}

/// A step's scalars as the kernels take them: `decay = 1 − lr·λ`, the bias corrections
/// precomputed.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
struct AdamScalars {
    lr: f32,
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    decay: f32,
    bias_1: f32,
    bias_2: f32,
    grad_scale: f32,
}

impl AdamScalars {
    fn of(step: AdamWStep) -> Self {
        let (bias_1, bias_2) = step.bias();
        Self {
            lr: step.lr,
            beta_1: step.beta_1,
            beta_2: step.beta_2,
            epsilon: step.epsilon,
            decay: 1.0 - step.lr * step.weight_decay,
            bias_1,
            bias_2,
            grad_scale: step.grad_scale,
        }
    }
}

/// An [`AdamScalars`] as a kernel argument.
macro_rules! adam_scalars {
    ($step:expr) => {{
        let s = AdamScalars::of($step);
        AdamScalarsLaunch::new(
            s.lr,
            s.beta_1,
            s.beta_2,
            s.epsilon,
            s.decay,
            s.bias_1,
            s.bias_2,
            s.grad_scale,
        )
    }};
}

/// One AdamW step: parameter and gradient in `F`, moments in f32; new tensors out.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn adamw_kernel<F: Float, N: Size>(
    param: &Tensor<Vector<F, N>>,
    grad: &Tensor<Vector<F, N>>,
    m: &Tensor<Vector<f32, N>>,
    v: &Tensor<Vector<f32, N>>,
    param_out: &mut Tensor<Vector<F, N>>,
    m_out: &mut Tensor<Vector<f32, N>>,
    v_out: &mut Tensor<Vector<f32, N>>,
    s: AdamScalars,
) {
    let i = ABSOLUTE_POS;
    if i < param_out.len() {
        let p = Vector::<f32, N>::cast_from(param[i]);
        let g = Vector::<f32, N>::cast_from(grad[i]);
        param_out[i] = Vector::cast_from(adam(i, p, g, m[i], v[i], m_out, v_out, &s));
    }
}

/// One AdamW step of fp32 master weights: gradient in `G`, master weights and moments in f32,
/// the model's copy of the new value written in `P` in the same pass; the gradient multiplied by
/// `clip[0]` first (a global norm's clipping factor, computed on the device; negative, the
/// step is skipped: master weights and moments stay, the copy is written from them). A grid of
/// [`master_blocks`] blocks strides over the vectors; each block's `Σ g²` (before clipping) goes to
/// `partials`, and the largest |parameter| it wrote (as written, NaN ignored) to `peaks`; the
/// launch's last block (by `ticket`: [`last_block`]) writes `squares_out[0] = squares[0] +
/// Σ partials`, summed in one order every run, and `amax[0] = max peaks`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn adamw_master_kernel<G: Float, P: Float, N: Size>(
    master: &Tensor<Vector<f32, N>>,
    grad: &Tensor<Vector<G, N>>,
    clip: &Tensor<f32>,
    m: &Tensor<Vector<f32, N>>,
    v: &Tensor<Vector<f32, N>>,
    master_out: &mut Tensor<Vector<f32, N>>,
    m_out: &mut Tensor<Vector<f32, N>>,
    v_out: &mut Tensor<Vector<f32, N>>,
    param_out: &mut Tensor<Vector<P, N>>,
    squares: &Tensor<f32>,
    squares_out: &mut Tensor<f32>,
    partials: &mut Tensor<f32>,
    peaks: &mut Tensor<f32>,
    amax: &mut Tensor<f32>,
    ticket: &mut Tensor<Atomic<u32>>,
    s: AdamScalars,
) {
    let vectors = master_out.len() as u32;
    let stride = CUBE_COUNT as u32 * 256u32;
    let zero = Vector::<f32, N>::new(0.0f32);
    let mut sum = 0.0f32;
    let mut peak = 0.0f32;
    // Two vectors a turn, `a` and `b` a stride apart, both loaded before either is written: the
    // stores (in place, maybe over the inputs) keep a turn's loads from moving past them, so
    // this doubles the bytes a thread has in flight.
    for a in range_stepped(ABSOLUTE_POS as u32, vectors, 2 * stride) {
        let has_b = a + stride < vectors;
        let b = (a + stride) as usize;
        let a = a as usize;
        let raw_a = Vector::<f32, N>::cast_from(grad[a]);
        let master_a = master[a];
        let m_a = m[a];
        let v_a = v[a];
        let mut raw_b = zero;
        let mut master_b = zero;
        let mut m_b = zero;
        let mut v_b = zero;
        if has_b {
            raw_b = Vector::<f32, N>::cast_from(grad[b]);
            master_b = master[b];
            m_b = m[b];
            v_b = v[b];
        }
        let factor = Vector::new(clip[0]);
        sum += hsum(raw_a * raw_a) + hsum(raw_b * raw_b);
        // A negative factor (a gradient somewhere not finite): every output as its input.
        let keep = clip[0] < 0.0f32;
        let mut p = master_a;
        if keep {
            m_out[a] = m_a;
            v_out[a] = v_a;
        } else {
            p = adam(a, master_a, raw_a * factor, m_a, v_a, m_out, v_out, &s);
        }
        master_out[a] = p;
        let written = Vector::<P, N>::cast_from(p);
        param_out[a] = written;
        peak = vector_max(peak, written);
        if has_b {
            let mut p = master_b;
            if keep {
                m_out[b] = m_b;
                v_out[b] = v_b;
            } else {
                p = adam(b, master_b, raw_b * factor, m_b, v_b, m_out, v_out, &s);
            }
            master_out[b] = p;
            let written = Vector::<P, N>::cast_from(p);
            param_out[b] = written;
            peak = vector_max(peak, written);
        }
    }
    let total = block_sum(sum);
    let top = block_max(peak);
    if UNIT_POS == 0 {
        partials[CUBE_POS] = total;
        peaks[CUBE_POS] = top;
    }
    if last_block(ticket) {
        let mut all = 0.0f32;
        let mut highest = 0.0f32;
        for b in range_stepped(UNIT_POS, CUBE_COUNT as u32, 256u32) {
            all += partials[b as usize];
            highest = f32::max(highest, peaks[b as usize]);
        }
        let all = block_sum(all);
        let highest = block_max(highest);
        if UNIT_POS == 0 {
            squares_out[0] = squares[0] + all;
            amax[0] = highest;
        }
    }
}

/// The blocks of [`adamw_master_kernel`] for `vectors`: one a [`MASTER_SWEEP`] vectors, at most
/// [`MASTER_BLOCKS`]. Many short blocks, not one wave of long ones: a grid of equal shares that
/// does not fit the SMs at once (1 024 blocks where the kernel's registers leave room for 4 or
/// 6 an SM) runs its last blocks as a second, mostly idle wave, while short blocks queue and keep
/// every SM busy to the end. With two vectors a turn: 8.12 → 7.22 ms a llama-1b step on an H200
/// (`docs/kernels.md`).
fn master_blocks(vectors: usize) -> u32 {
    (vectors as u32).div_ceil(MASTER_SWEEP).min(MASTER_BLOCKS)
}

/// Vectors a block of [`adamw_master_kernel`] updates, eight a thread, short of the cap.
const MASTER_SWEEP: u32 = 8 * 256;

/// The most blocks of [`adamw_master_kernel`]: the last block sums their partials, 64 a thread
/// at most; past it (tensors over 2²⁵ vectors) each thread takes more than eight.
const MASTER_BLOCKS: u32 = 16384;

/// f32 moments: vectors of 4 are 16-byte loads.
fn moment_vector(len: usize) -> usize {
    if len.is_multiple_of(4) { 4 } else { 1 }
}

/// Whether `t` is a float dtype the kernels are built for.
fn float(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16 | DType::F32)
}

/// An output's kernel argument: updating in place, an alias of the kernel's input `input` (which
/// `t` is); else its own memory.
fn output_arg(t: &CubeTensor, in_place: bool, input: usize) -> TensorArg {
    match in_place {
        true => t.as_tensor_alias(input),
        false => t.clone().into_tensor_arg(),
    }
}

/// The new parameter and moments; in place where nothing else holds the parameter and both
/// moments, as [`adamw_master_update`]'s state is.
pub(crate) fn adamw_update(
    param: CubeTensor,
    grad: CubeTensor,
    m: CubeTensor,
    v: CubeTensor,
    step: AdamWStep,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    // Asked before the clones below; sound for the reason `adamw_master_update` gives.
    let in_place = param.can_mut() && m.can_mut() && v.can_mut();
    let fits = float(param.dtype)
        && m.dtype == DType::F32
        && v.dtype == DType::F32
        && [&grad, &m, &v].iter().all(|t| t.meta.shape() == param.meta.shape());
    let grad = match fits && grad.dtype != param.dtype {
        true => Cube::float_cast(grad, param.dtype.into()),
        false => grad,
    };
    let inputs = (
        compact_input(param.clone()),
        compact_input(grad.clone()),
        compact_input(m.clone()),
        compact_input(v.clone()),
    );
    let (true, Some(pc), Some(gc), Some(mc), Some(vc)) = (fits, inputs.0, inputs.1, inputs.2, inputs.3) else {
        return reference::update::<Cube>(param, grad, m, v, step);
    };
    let shape = pc.meta.shape().clone();
    // The outputs' arguments: aliases of the kernel's inputs 0 (the parameter), 2 and 3 (the
    // moments) in place, else new tensors.
    let (param_out, m_out, v_out) = match in_place {
        true => (pc.clone(), mc.clone(), vc.clone()),
        false => (
            compact_output(&pc, shape.clone(), pc.dtype),
            compact_output(&pc, shape.clone(), DType::F32),
            compact_output(&pc, shape, DType::F32),
        ),
    };
    let len = pc.meta.num_elements();
    let vector = moment_vector(len);
    let (count, dim) = launch_dims(len, vector);
    launch_float!(
        pc.dtype,
        adamw_kernel,
        &pc.client,
        count,
        dim,
        vector,
        pc.clone().into_tensor_arg(),
        gc.into_tensor_arg(),
        mc.clone().into_tensor_arg(),
        vc.clone().into_tensor_arg(),
        output_arg(&param_out, in_place, 0),
        output_arg(&m_out, in_place, 2),
        output_arg(&v_out, in_place, 3),
        adam_scalars!(step),
    );
    (param_out, m_out, v_out)
}

/// Runs `$kernel::launch_unchecked::<G, P>` for the gradient's and the parameter's float dtypes.
macro_rules! launch_grad_param {
    ($grad:expr, $param:expr, $kernel:ident, $($arg:expr),* $(,)?) => {
        // SAFETY: the kernel checks every index against its outputs' length, and every tensor
        // is compact with the one shape.
        unsafe {
            match ($grad, $param) {
                (DType::BF16, DType::BF16) => $kernel::launch_unchecked::<bf16, bf16>($($arg),*),
                (DType::BF16, DType::F16) => $kernel::launch_unchecked::<bf16, f16>($($arg),*),
                (DType::BF16, _) => $kernel::launch_unchecked::<bf16, f32>($($arg),*),
                (DType::F16, DType::BF16) => $kernel::launch_unchecked::<f16, bf16>($($arg),*),
                (DType::F16, DType::F16) => $kernel::launch_unchecked::<f16, f16>($($arg),*),
                (DType::F16, _) => $kernel::launch_unchecked::<f16, f32>($($arg),*),
                (_, DType::BF16) => $kernel::launch_unchecked::<f32, bf16>($($arg),*),
                (_, DType::F16) => $kernel::launch_unchecked::<f32, f16>($($arg),*),
                (_, _) => $kernel::launch_unchecked::<f32, f32>($($arg),*),
            }
        }
    };
}

/// The new master weights, moments and the parameter's copy in `dtype`. Where nothing else
/// holds the master weights and both moments (the optimizer hands its state over), they are
/// updated in place, as PyTorch's fused AdamW does: the state keeps its memory from step to
/// step, rather than 12 bytes a parameter allocated and freed each step among the activations'.
#[allow(clippy::too_many_arguments)]
pub(crate) fn adamw_master_update(
    master: CubeTensor,
    grad: CubeTensor,
    m: CubeTensor,
    v: CubeTensor,
    step: AdamWStep,
    clip: CubeTensor,
    dtype: FloatDType,
    squares: CubeTensor,
) -> crate::adamw::MasterUpdate<Cube> {
    let param_dtype = DType::from(dtype);
    // Asked before the clones below. In place is sound: each thread reads an element's state
    // before it writes the element, and no other thread touches it.
    let in_place = master.can_mut() && m.can_mut() && v.can_mut();
    let fits = float(grad.dtype)
        && float(param_dtype)
        && [&clip, &squares]
            .iter()
            .all(|t| t.dtype == DType::F32 && t.meta.num_elements() == 1)
        && [&master, &m, &v].iter().all(|t| t.dtype == DType::F32)
        && [&grad, &m, &v].iter().all(|t| t.meta.shape() == master.meta.shape())
        && master.meta.num_elements() > 0;
    let inputs = (
        compact_input(master.clone()),
        compact_input(grad.clone()),
        compact_input(m.clone()),
        compact_input(v.clone()),
        compact_input(squares.clone()),
    );
    let (true, Some(pc), Some(gc), Some(mc), Some(vc), Some(sc)) =
        (fits, inputs.0, inputs.1, inputs.2, inputs.3, inputs.4)
    else {
        return crate::adamw::reference::master_update::<Cube>(master, grad, m, v, step, clip, dtype, squares);
    };
    let shape = pc.meta.shape().clone();
    let param_out = compact_output(&pc, shape.clone(), param_dtype);
    // The outputs' arguments: aliases of the kernel's inputs 0 (master), 3 and 4 (the moments)
    // in place, else new tensors.
    let (master_out, m_out, v_out) = match in_place {
        true => (pc.clone(), mc.clone(), vc.clone()),
        false => (
            compact_output(&pc, shape.clone(), DType::F32),
            compact_output(&pc, shape.clone(), DType::F32),
            compact_output(&pc, shape, DType::F32),
        ),
    };
    let len = pc.meta.num_elements();
    let vector = moment_vector(len);
    let blocks = master_blocks(len / vector);
    let (squares_out, amax) = (
        compact_output(&pc, Shape::new([1]), DType::F32),
        compact_output(&pc, Shape::new([1]), DType::F32),
    );
    // Every block writes its partial and peak: nothing to zero.
    let partials = compact_output(&pc, Shape::new([blocks as usize]), DType::F32);
    let peaks = compact_output(&pc, Shape::new([blocks as usize]), DType::F32);
    launch_grad_param!(
        gc.dtype,
        param_dtype,
        adamw_master_kernel,
        &pc.client,
        CubeCount::Static(blocks, 1, 1),
        CubeDim::new_1d(256),
        vector,
        pc.clone().into_tensor_arg(),
        gc.clone().into_tensor_arg(),
        clip.into_tensor_arg(),
        mc.clone().into_tensor_arg(),
        vc.clone().into_tensor_arg(),
        output_arg(&master_out, in_place, 0),
        output_arg(&m_out, in_place, 3),
        output_arg(&v_out, in_place, 4),
        param_out.clone().into_tensor_arg(),
        sc.into_tensor_arg(),
        squares_out.clone().into_tensor_arg(),
        partials.into_tensor_arg(),
        peaks.into_tensor_arg(),
        amax.clone().into_tensor_arg(),
        crate::cuda::reduce::state(&pc).into_tensor_arg(),
        adam_scalars!(step),
    );
    crate::adamw::MasterUpdate {
        master: master_out,
        moment_1: m_out,
        moment_2: v_out,
        param: param_out,
        squares: squares_out,
        amax,
    }
}
