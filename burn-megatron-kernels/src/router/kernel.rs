//! The CUDA kernels of [`router`](crate::router): 256 threads a block, the experts in groups of
//! 32 (a warp's lanes; any count, the last group ragged), every product and sum in f32.
//!
//! - logits: a block takes 32 tokens and a group; its warps' lanes are the group's experts and
//!   each warp four of the tokens; 64 features at a time of the tokens and of the weight pass
//!   through shared memory.
//! - the input's gradient: a block takes 32 tokens by 256 features; each thread holds its
//!   feature's row of the weight a group at a time (32 values) and the tokens' gradients come
//!   through shared memory, its 32 tokens' sums in registers across the groups.
//! - the weight's gradient: a block takes 256 features of a slice of the tokens and a group,
//!   each thread its feature's 32 sums; a second kernel adds the slices' partial sums in slice
//!   order.

use burn::backend::Cube;
use burn::tensor::{DType, FloatDType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use half::{bf16, f16};

use crate::cuda::launch::{compact_input, compact_output, launch_dims, launch_float};
use crate::gemm::f32_matmul::cuda::matmul as f32_matmul;
use crate::router::reference;

/// Threads a block: 8 warps.
const THREADS: u32 = 256;
/// Tokens a block of the logits and of the input's gradient, and a tile of the weight's.
const TOKENS: u32 = 32;
/// Features a step of the logits.
const SLICE: u32 = 64;
/// Experts a group (a warp's lanes).
const EXPERTS: u32 = 32;

/// Grid: a block 32 tokens by a group of experts. `out[t, j] = Σ_i x[t, i] · w[i, j]`.
#[cube(launch_unchecked)]
fn logits_kernel<F: Float>(x: &Tensor<F>, w: &Tensor<f32>, out: &mut Tensor<f32>, t: u32, d: u32, e: u32) {
    let mut xs = Shared::<[f32]>::new_slice((TOKENS * SLICE) as usize);
    let mut ws = Shared::<[f32]>::new_slice((SLICE * EXPERTS) as usize);
    let lane = UNIT_POS % 32;
    let warp = UNIT_POS / 32;
    let first = CUBE_POS_X * TOKENS;
    let g0 = CUBE_POS_Y * EXPERTS;
    let mut acc = Array::<f32>::new(4usize);
    #[unroll]
    for r in 0..4u32 {
        acc[r as usize] = 0.0f32;
    }
    for c in range_stepped(0u32, d, SLICE) {
        #[unroll]
        for q in 0..8u32 {
            let idx = UNIT_POS + q * THREADS;
            let (token, feature) = (idx / SLICE, idx % SLICE);
            let mut v = 0.0f32;
            if first + token < t && c + feature < d {
                v = f32::cast_from(x[((first + token) * d + c + feature) as usize]);
            }
            xs[idx as usize] = v;
            let (row, expert) = (idx / EXPERTS, idx % EXPERTS);
            let mut u = 0.0f32;
            if c + row < d && g0 + expert < e {
                u = w[((c + row) * e + g0 + expert) as usize];
            }
            ws[idx as usize] = u;
        }
        sync_cube();
        for i in 0..SLICE {
            let wv = ws[(i * EXPERTS + lane) as usize];
            #[unroll]
            for r in 0..4u32 {
                acc[r as usize] += xs[((warp + 8 * r) * SLICE + i) as usize] * wv;
            }
        }
        sync_cube();
    }
    #[unroll]
    for r in 0..4u32 {
        let token = first + warp + 8 * r;
        if token < t && g0 + lane < e {
            out[(token * e + g0 + lane) as usize] = acc[r as usize];
        }
    }
}

/// Grid: 32 tokens by 256 features a block. `dx[t, i] = Σ_j grad[t, j] · w[i, j]`, summed a
/// group of experts at a time in expert order.
#[cube(launch_unchecked)]
fn dx_kernel<F: Float>(grad: &Tensor<f32>, w: &Tensor<f32>, dx: &mut Tensor<F>, t: u32, d: u32, e: u32) {
    let mut gs = Shared::<[f32]>::new_slice((TOKENS * EXPERTS) as usize);
    let first = CUBE_POS_X * TOKENS;
    let feature = CUBE_POS_Y * THREADS + UNIT_POS;
    let mut acc = Array::<f32>::new(TOKENS as usize);
    #[unroll]
    for token in 0..TOKENS {
        acc[token as usize] = 0.0f32;
    }
    let mut row = Array::<f32>::new(EXPERTS as usize);
    for g0 in range_stepped(0u32, e, EXPERTS) {
        #[unroll]
        for q in 0..4u32 {
            let idx = UNIT_POS + q * THREADS;
            let (token, expert) = (idx / EXPERTS, idx % EXPERTS);
            let mut v = 0.0f32;
            if first + token < t && g0 + expert < e {
                v = grad[((first + token) * e + g0 + expert) as usize];
            }
            gs[idx as usize] = v;
        }
        #[unroll]
        for j in 0..EXPERTS {
            let mut u = 0.0f32;
            if feature < d && g0 + j < e {
                u = w[(feature * e + g0 + j) as usize];
            }
            row[j as usize] = u;
        }
        sync_cube();
        #[unroll]
        for token in 0..TOKENS {
            let mut sum = acc[token as usize];
            #[unroll]
            for j in 0..EXPERTS {
                sum += gs[(token * EXPERTS + j) as usize] * row[j as usize];
            }
            acc[token as usize] = sum;
        }
        sync_cube();
    }
    if feature < d {
        #[unroll]
        for token in 0..TOKENS {
            if first + token < t {
                dx[((first + token) * d + feature) as usize] = F::cast_from(acc[token as usize]);
            }
        }
    }
}

/// Grid: 256 features by slices of `per_slice` tokens by groups of experts. `partial[s, i, j]
/// = Σ_{t in slice s} x[t, i] · grad[t, j]` (`padded` columns, the groups' whole; those past `e`
/// zero).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn dw_kernel<F: Float>(
    x: &Tensor<F>,
    grad: &Tensor<f32>,
    partial: &mut Tensor<f32>,
    t: u32,
    d: u32,
    e: u32,
    padded: u32,
    per_slice: u32,
) {
    let mut gs = Shared::<[f32]>::new_slice((TOKENS * EXPERTS) as usize);
    let feature = CUBE_POS_X * THREADS + UNIT_POS;
    let slice = CUBE_POS_Y;
    let g0 = CUBE_POS_Z * EXPERTS;
    let begin = min(slice * per_slice, t);
    let end = min(begin + per_slice, t);
    let mut acc = Array::<f32>::new(EXPERTS as usize);
    #[unroll]
    for j in 0..EXPERTS {
        acc[j as usize] = 0.0f32;
    }
    for tile in range_stepped(begin, end, TOKENS) {
        #[unroll]
        for q in 0..4u32 {
            let idx = UNIT_POS + q * THREADS;
            let (token, expert) = (idx / EXPERTS, idx % EXPERTS);
            let mut v = 0.0f32;
            if tile + token < end && g0 + expert < e {
                v = grad[((tile + token) * e + g0 + expert) as usize];
            }
            gs[idx as usize] = v;
        }
        sync_cube();
        if feature < d {
            for token in 0..TOKENS {
                if tile + token < end {
                    let xv = f32::cast_from(x[((tile + token) * d + feature) as usize]);
                    #[unroll]
                    for j in 0..EXPERTS {
                        acc[j as usize] += xv * gs[(token * EXPERTS + j) as usize];
                    }
                }
            }
        }
        sync_cube();
    }
    if feature < d {
        #[unroll]
        for j in 0..EXPERTS {
            partial[((slice * d + feature) * padded + g0 + j) as usize] = acc[j as usize];
        }
    }
}

/// Grid: a thread an entry of `dw` (`[d, e]`): its slices' partial sums, in slice order.
#[cube(launch_unchecked)]
fn dw_sum_kernel(partial: &Tensor<f32>, dw: &mut Tensor<f32>, d: u32, e: u32, padded: u32, slices: u32) {
    let i = ABSOLUTE_POS as u32;
    if i < d * e {
        let (feature, expert) = (i / e, i % e);
        let mut acc = 0.0f32;
        for s in 0..slices {
            acc += partial[((s * d + feature) * padded + expert) as usize];
        }
        dw[i as usize] = acc;
    }
}

/// `t` cast to f32 and compact.
fn f32_input(t: CubeTensor) -> Option<CubeTensor> {
    compact_input(burn_cubecl::kernel::cast(t, DType::F32))
}

/// The experts' columns rounded up to whole groups.
fn padded(e: usize) -> usize {
    e.next_multiple_of(EXPERTS as usize)
}

/// Whether the kernels take `x` (`[t, d]`) and `e` experts: a float dtype they are built for,
/// indices inside u32 (the weight gradient's partial sums, at most a slice a tile of tokens, too).
fn fits(x: &CubeTensor, e: usize) -> bool {
    let [t, d] = [x.meta.shape()[0], x.meta.shape()[1]];
    let slices = t.div_ceil(TOKENS as usize).max(1);
    matches!(x.dtype, DType::BF16 | DType::F16 | DType::F32)
        && (t * d.max(padded(e))) < u32::MAX as usize
        && slices.min(264) * d * padded(e) < u32::MAX as usize
}

pub(crate) fn router_logits(x: CubeTensor, w: CubeTensor) -> CubeTensor {
    let e = w.meta.shape()[1];
    let (true, Some(xc), Some(wc)) = (fits(&x, e), compact_input(x.clone()), f32_input(w.clone())) else {
        return reference::logits::<Cube>(x, w, f32_matmul);
    };
    let [t, d] = [xc.meta.shape()[0], xc.meta.shape()[1]];
    let out = compact_output(&xc, Shape::from([t, e]), DType::F32);
    if t == 0 || e == 0 {
        return out;
    }
    launch_float!(
        xc.dtype,
        logits_kernel,
        &xc.client,
        CubeCount::Static((t as u32).div_ceil(TOKENS), (e as u32).div_ceil(EXPERTS), 1),
        CubeDim::new_1d(THREADS),
        xc.clone().into_tensor_arg(),
        wc.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        t as u32,
        d as u32,
        e as u32
    );
    out
}

pub(crate) fn router_logits_dx(grad: CubeTensor, w: CubeTensor, dtype: FloatDType) -> CubeTensor {
    let ([t, e], d) = ([grad.meta.shape()[0], grad.meta.shape()[1]], w.meta.shape()[0]);
    let dtype = DType::from(dtype);
    let (Some(gc), Some(wc)) = (f32_input(grad.clone()), f32_input(w.clone())) else {
        return reference::dx::<Cube>(grad, w, dtype.into(), f32_matmul);
    };
    let fits = matches!(dtype, DType::BF16 | DType::F16 | DType::F32) && t * d.max(e) < u32::MAX as usize;
    if !fits {
        return reference::dx::<Cube>(grad, w, dtype.into(), f32_matmul);
    }
    let out = compact_output(&gc, Shape::from([t, d]), dtype);
    if t == 0 || d == 0 {
        return out;
    }
    let count = CubeCount::Static((t as u32).div_ceil(TOKENS), (d as u32).div_ceil(THREADS), 1);
    launch_float!(
        dtype,
        dx_kernel,
        &gc.client,
        count,
        CubeDim::new_1d(THREADS),
        gc.clone().into_tensor_arg(),
        wc.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        t as u32,
        d as u32,
        e as u32
    );
    out
}

pub(crate) fn router_logits_dw(x: CubeTensor, grad: CubeTensor, dtype: FloatDType) -> CubeTensor {
    let e = grad.meta.shape()[1];
    let (true, Some(xc), Some(gc)) = (fits(&x, e), compact_input(x.clone()), f32_input(grad.clone())) else {
        return reference::dw::<Cube>(x, grad, dtype, f32_matmul);
    };
    let [t, d] = [xc.meta.shape()[0], xc.meta.shape()[1]];
    let out = compact_output(&xc, Shape::from([d, e]), DType::F32);
    if d == 0 || e == 0 {
        return burn_cubecl::kernel::cast(out, DType::from(dtype));
    }
    // Enough slices of the tokens to give every SM two blocks, each at least a tile.
    let columns = (d as u32).div_ceil(THREADS);
    let slices = (264u32.div_ceil(columns)).min((t as u32).div_ceil(TOKENS)).max(1);
    let per_slice = (t as u32).div_ceil(slices).next_multiple_of(TOKENS);
    let padded = padded(e);
    let partial = compact_output(&xc, Shape::from([slices as usize * d * padded]), DType::F32);
    let groups = (e as u32).div_ceil(EXPERTS);
    launch_float!(
        xc.dtype,
        dw_kernel,
        &xc.client,
        CubeCount::Static(columns, slices, groups),
        CubeDim::new_1d(THREADS),
        xc.clone().into_tensor_arg(),
        gc.into_tensor_arg(),
        partial.clone().into_tensor_arg(),
        t as u32,
        d as u32,
        e as u32,
        padded as u32,
        per_slice
    );
    let (count, dim) = launch_dims(d * e, 1);
    // SAFETY: a thread an entry of `out` (`d·e`, checked), reading the `slices · d · padded`
    // partial sums.
    unsafe {
        dw_sum_kernel::launch_unchecked(
            &xc.client,
            count,
            dim,
            partial.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            d as u32,
            e as u32,
            padded as u32,
            slices,
        );
    }
    burn_cubecl::kernel::cast(out, DType::from(dtype))
}
