//! [`super::packed`] on Burn's CUDA tensors: RoPE in place on the packed row's q and k heads,
//! the flash kernels on views of it, and the gradient written into one packed tensor. Anything
//! the flash kernels do not take runs on the reference.

use burn::backend::Cube;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, Slice, Tensor};
use burn_cubecl::tensor::CubeTensor;

use super::flash::HEAD_DIM;
use super::launch::{self, Dest};
use super::packed::reference;
use crate::elementwise::{compact_input, compact_output, is_compact, rope_into};

/// `[b, s]` and the head dim where the flash kernels take this packed input and these tables
/// (bf16, head dim 128, f32 tables covering `s`), else `None`.
fn fits(y: &CubeTensor, cos: &CubeTensor, sin: &CubeTensor, heads: usize, kv_heads: usize) -> Option<[usize; 2]> {
    let dims = y.meta.shape();
    let n = heads + 2 * kv_heads;
    let ok = y.dtype == DType::BF16
        && dims.num_dims() == 3
        && kv_heads > 0
        && heads.is_multiple_of(kv_heads)
        && dims[2] == n * HEAD_DIM
        && [cos, sin]
            .iter()
            .all(|t| t.dtype == DType::F32 && t.meta.shape().num_dims() == 2)
        && cos.meta.shape()[0] >= dims[1]
        && cos.meta.shape()[1] == HEAD_DIM / 2
        && sin.meta.shape() == cos.meta.shape();
    ok.then(|| [dims[0], dims[1]])
}

/// Heads `first..first + count` of packed `[b, s, n·d]` memory, as a `[b, count, s, d]` view.
fn heads_of(y: &CubeTensor, [b, s]: [usize; 2], n: usize, first: usize, count: usize) -> CubeTensor {
    let rows = Cube::float_reshape(y.clone(), Shape::from(vec![b, s, n, HEAD_DIM]));
    let heads = Cube::float_swap_dims(rows, 1, 2);
    let range = |end| Slice::from(0..end);
    Cube::float_slice(
        heads,
        &[range(b), Slice::from(first..first + count), range(s), range(HEAD_DIM)],
    )
}

/// Each kv head `repeat` times in a row (a compact copy), as the query heads read them.
fn repeat_heads(x: CubeTensor, repeat: usize) -> CubeTensor {
    match repeat {
        1 => x,
        _ => prim(reference::repeat_heads(tensor(x), repeat)),
    }
}

fn tensor<const D: usize>(t: CubeTensor) -> Tensor<D> {
    Tensor::from_primitive::<Cube>(t)
}

fn prim<const D: usize>(t: Tensor<D>) -> CubeTensor {
    t.try_into_primitive::<Cube>().expect("a CUDA tensor")
}

pub(super) fn forward(
    y: CubeTensor,
    cos: CubeTensor,
    sin: CubeTensor,
    heads: usize,
    kv_heads: usize,
    causal: bool,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let tables = (compact_input(cos.clone()), compact_input(sin.clone()));
    let (Some(bs), Some(cos_c), Some(sin_c)) = (fits(&y, &cos, &sin, heads, kv_heads), tables.0, tables.1) else {
        let (out, lse, rotated) = reference::forward(tensor(y), tensor(cos), tensor(sin), heads, kv_heads, causal);
        return (prim(out), prim(lse), prim(rotated));
    };
    // RoPE rotates in place: the input must be this op's alone (a tensor someone else still
    // holds, a recomputation's kept input, is copied first).
    let y = match is_compact(&y) && y.can_mut() {
        true => y,
        false => y.copy(),
    };
    let n = heads + 2 * kv_heads;
    let (q, k, v) = (
        heads_of(&y, bs, n, 0, heads),
        heads_of(&y, bs, n, heads, kv_heads),
        heads_of(&y, bs, n, heads + kv_heads, kv_heads),
    );
    rope_into(&q, cos_c.clone(), sin_c.clone(), false, &q);
    rope_into(&k, cos_c, sin_c, false, &k);
    let repeat = heads / kv_heads;
    let (out, lse) = launch::forward(
        q,
        repeat_heads(k, repeat),
        repeat_heads(v, repeat),
        causal,
        reference::scale(HEAD_DIM),
    );
    // The output's `[b, h, s, d]` is a view of `[b, s, h, d]` memory: its rows as they are.
    let [b, s] = bs;
    let out = Cube::float_reshape(
        Cube::float_swap_dims(out, 1, 2),
        Shape::from(vec![b, s, heads * HEAD_DIM]),
    );
    (out, lse, y)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    rotated: CubeTensor,
    out: CubeTensor,
    lse: CubeTensor,
    grad: CubeTensor,
    cos: CubeTensor,
    sin: CubeTensor,
    heads: usize,
    kv_heads: usize,
    causal: bool,
) -> CubeTensor {
    let tables = (compact_input(cos.clone()), compact_input(sin.clone()));
    let (Some(bs), Some(cos_c), Some(sin_c)) = (fits(&rotated, &cos, &sin, heads, kv_heads), tables.0, tables.1) else {
        let dy = reference::backward(
            tensor(rotated),
            tensor(out),
            tensor(lse),
            tensor(grad),
            tensor(cos),
            tensor(sin),
            heads,
            kv_heads,
            causal,
        );
        return prim(dy);
    };
    let [b, s] = bs;
    let n = heads + 2 * kv_heads;
    let repeat = heads / kv_heads;
    let (q, k, v) = (
        heads_of(&rotated, bs, n, 0, heads),
        heads_of(&rotated, bs, n, heads, kv_heads),
        heads_of(&rotated, bs, n, heads + kv_heads, kv_heads),
    );
    let per_head = |t: CubeTensor| {
        let rows = Cube::float_reshape(t, Shape::from(vec![b, s, heads, HEAD_DIM]));
        Cube::float_swap_dims(rows, 1, 2)
    };
    let (out, grad) = (per_head(out), per_head(grad));
    let dy = compact_output(&rotated, Shape::from(vec![b, s, n * HEAD_DIM]), DType::BF16);
    let scratch = || compact_output(&rotated, Shape::from(vec![b, s, heads, HEAD_DIM]), DType::BF16);
    let own = |t: &CubeTensor| Dest {
        tensor: t.clone(),
        heads,
        first: 0,
    };
    let (dq, dk) = (scratch(), scratch());
    let dy = match repeat {
        // dV straight into its heads of the packed gradient.
        1 => {
            let dv = Dest {
                tensor: dy.clone(),
                heads: n,
                first: heads + kv_heads,
            };
            launch::backward_into(
                [b, heads, s],
                q,
                k,
                v,
                out,
                lse,
                grad,
                causal,
                reference::scale(HEAD_DIM),
                [own(&dq), own(&dk), dv],
            );
            dy
        }
        // Each kv head's gradient is the sum of its query heads'; dV then goes in by a copy.
        _ => {
            let dv = scratch();
            launch::backward_into(
                [b, heads, s],
                q,
                repeat_heads(k, repeat),
                repeat_heads(v, repeat),
                out,
                lse,
                grad,
                causal,
                reference::scale(HEAD_DIM),
                [own(&dq), own(&dk), own(&dv)],
            );
            let dv = reference::sum_heads(tensor(launch::heads_view(dv)), repeat);
            let dy_heads = Cube::float_swap_dims(Cube::float_reshape(dy, Shape::from(vec![b, s, n, HEAD_DIM])), 1, 2);
            let range = |end| Slice::from(0..end);
            let v_heads = [range(b), Slice::from(heads + kv_heads..n), range(s), range(HEAD_DIM)];
            let dy_heads = Cube::float_slice_assign(dy_heads, &v_heads, prim(dv));
            let rows = Cube::float_swap_dims(dy_heads, 1, 2);
            Cube::float_reshape(rows, Shape::from(vec![b, s, n * HEAD_DIM]))
        }
    };
    let dk = match repeat {
        1 => launch::heads_view(dk),
        _ => prim(reference::sum_heads(tensor(launch::heads_view(dk)), repeat)),
    };
    // A rotation's transpose is its inverse: dQ and dK rotated back into their heads.
    rope_into(
        &launch::heads_view(dq),
        cos_c.clone(),
        sin_c.clone(),
        true,
        &heads_of(&dy, bs, n, 0, heads),
    );
    rope_into(&dk, cos_c, sin_c, true, &heads_of(&dy, bs, n, heads, kv_heads));
    dy
}
