//! The CUDA kernels of [`order`](crate::order): a block of 256 threads an expert, the ids read
//! as i32.

use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::cuda::launch::compact_output;
use crate::rows::kernel::index_input;

/// Threads a block: 8 warps.
const THREADS: u32 = 256;

/// The sum of `x` over the block's threads up to this one (in `UNIT_POS` order), or with
/// `total` over all of them: a scan in shared memory, eight rounds of doubling strides.
#[cube]
pub(crate) fn block_scan(x: u32, #[comptime] total: bool) -> u32 {
    let mut scan = Shared::<[u32]>::new_slice(THREADS as usize);
    let unit = UNIT_POS as usize;
    scan[unit] = x;
    sync_cube();
    let mut stride = 1u32;
    #[unroll]
    for _ in 0..8u32 {
        let mut value = scan[unit];
        if UNIT_POS >= stride {
            value += scan[(UNIT_POS - stride) as usize];
        }
        sync_cube();
        scan[unit] = value;
        sync_cube();
        stride *= 2;
    }
    let mut at = unit;
    if comptime!(total) {
        at = (THREADS - 1) as usize;
    }
    scan[at]
}

/// Grid: a block an expert. `copies[expert]`: the ids equal to it.
#[cube(launch_unchecked)]
fn copies_kernel(ids: &Tensor<i32>, copies: &mut Tensor<i32>, n: u32) {
    let expert = CUBE_POS as u32;
    let mut mine = 0u32;
    for i in range_stepped(UNIT_POS, n, THREADS) {
        if u32::cast_from(ids[i as usize]) == expert {
            mine += 1;
        }
    }
    let total = block_scan(mine, true);
    if UNIT_POS == 0 {
        copies[CUBE_POS] = i32::cast_from(total);
    }
}

/// Grid: a block an expert. The expert's rows start after the earlier experts' padded copies;
/// thread `u` places the copies among slots `[u·run, (u+1)·run)` after those of the threads
/// before it, then the block writes the fillers and the expert's start; the last expert's
/// block also the end of its rows and the fillers of no expert after them. `out`: slots
/// `[0, r)`, tokens `[r, 2r)`, rows `[2r, 2r + n)`, starts `[2r + n, 2r + n + e + 1)`.
#[cube(launch_unchecked)]
// Padded counts in plain arithmetic: the form the device ran correctly.
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
fn order_kernel(
    ids: &Tensor<i32>,
    copies: &Tensor<i32>,
    out: &mut Tensor<i32>,
    n: u32,
    k: u32,
    align: u32,
    r: u32,
    run: u32,
) {
    let expert = CUBE_POS as u32;
    let mut start = 0u32;
    for j in 0..expert {
        start += (u32::cast_from(copies[j as usize]) + align - 1) / align * align;
    }
    let begin = min(UNIT_POS * run, n);
    let end = min(begin + run, n);
    let mut mine = 0u32;
    for i in begin..end {
        if u32::cast_from(ids[i as usize]) == expert {
            mine += 1;
        }
    }
    let mut row = start + block_scan(mine, false) - mine;
    for i in begin..end {
        if u32::cast_from(ids[i as usize]) == expert {
            out[row as usize] = i32::cast_from(i);
            out[(r + row) as usize] = i32::cast_from(i / k);
            out[(2 * r + i) as usize] = i32::cast_from(row);
            row += 1;
        }
    }
    // Every copy is placed (and visible to the block) before the fillers read the first.
    sync_cube();
    let c = u32::cast_from(copies[expert as usize]);
    let padded = (c + align - 1) / align * align;
    let mut first = 0i32;
    if c > 0 {
        first = out[(r + start) as usize];
    }
    for j in range_stepped(c + UNIT_POS, padded, THREADS) {
        out[(start + j) as usize] = i32::cast_from(n);
        out[(r + start + j) as usize] = first;
    }
    let starts = 2 * r + n;
    if UNIT_POS == 0 {
        out[(starts + expert) as usize] = i32::cast_from(start);
    }
    if expert + 1 == CUBE_COUNT_X {
        let last = start + padded;
        if UNIT_POS == 0 {
            out[(starts + expert + 1) as usize] = i32::cast_from(last);
        }
        for j in range_stepped(last + UNIT_POS, r, THREADS) {
            out[j as usize] = i32::cast_from(n);
            out[(r + j) as usize] = 0i32;
        }
    }
}

/// `t` as compact i32 (an index tensor always becomes one).
fn ints(t: CubeTensor) -> CubeTensor {
    index_input(t).expect("a contiguous int tensor is compact")
}

pub(crate) fn expert_copies(ids: CubeTensor, e: usize) -> CubeTensor {
    let ids = ints(ids);
    let n = ids.meta.num_elements();
    let out = compact_output(&ids, Shape::from([e]), DType::I32);
    if e == 0 {
        return out;
    }
    // SAFETY: a block an expert writes its own entry of `out` (`e` of them); reads stay below
    // `n`, the ids' length.
    unsafe {
        copies_kernel::launch_unchecked(
            &ids.client,
            CubeCount::Static(e as u32, 1, 1),
            CubeDim::new_1d(THREADS),
            ids.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            n as u32,
        );
    }
    out
}

pub(crate) fn order_by_expert(ids: CubeTensor, copies: CubeTensor, k: usize, align: usize, r: usize) -> CubeTensor {
    let (ids, copies) = (ints(ids), ints(copies));
    let (n, e) = (ids.meta.num_elements(), copies.meta.num_elements());
    let out = compact_output(&ids, Shape::from([2 * r + n + e + 1]), DType::I32);
    if e == 0 {
        return out;
    }
    let run = n.div_ceil(THREADS as usize).max(1);
    // SAFETY: `copies` are the ids' counts (the caller's contract) and `r` at least their padded
    // sum, so every expert's rows lie in `[0, r)`, every write below `2r + n + e + 1`; reads stay
    // below `n` and `e`.
    unsafe {
        order_kernel::launch_unchecked(
            &ids.client,
            CubeCount::Static(e as u32, 1, 1),
            CubeDim::new_1d(THREADS),
            ids.clone().into_tensor_arg(),
            copies.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            n as u32,
            k as u32,
            align as u32,
            r as u32,
            run as u32,
        );
    }
    out
}
