//! The plain tensor-op twin: the CPU path and the kernels' oracle.

use burn::tensor::{DType, Int, Tensor};

pub fn row_max(logits: Tensor<2>, valid: usize) -> Tensor<1> {
    let [n, _] = logits.dims();
    match valid {
        0 => Tensor::full([n], f32::NEG_INFINITY, (&logits.device(), DType::F32)),
        _ => logits.narrow(1, 0, valid).max_dim(1).cast(DType::F32).reshape([n]),
    }
}

/// The row's max, then the sums shifted by it.
pub fn partials(logits: Tensor<2>, target: Tensor<1>, valid: usize) -> Tensor<2> {
    let max = row_max(logits.clone().detach(), valid);
    let sums = shifted(logits, max.clone(), target, valid);
    Tensor::cat(vec![max.unsqueeze_dim::<2>(1), sums], 1)
}

/// `(Σ exp x̃, x̃ at the target or 0, Σ x̃)` with `x̃ = x − shift`.
fn shifted(logits: Tensor<2>, shift: Tensor<1>, target: Tensor<1>, valid: usize) -> Tensor<2> {
    let [n, _] = logits.dims();
    if valid == 0 {
        return Tensor::zeros([n, 3], (&logits.device(), DType::F32));
    }
    let x = logits.cast(DType::F32).narrow(1, 0, valid) - shift.unsqueeze_dim::<2>(1); // [n, valid]
    let sum_exp = x.clone().exp().sum_dim(1);
    let real = x.clone().sum_dim(1);
    let elsewhere = target.clone().lower_elem(0.0).unsqueeze_dim::<2>(1);
    let column = target.clamp_min(0.0).int().unsqueeze_dim::<2>(1);
    let picked = x.gather(1, column).mask_fill(elsewhere, 0.0);
    Tensor::cat(vec![sum_exp, picked, real], 1)
}

pub fn backward(logits: Tensor<2>, shift: Tensor<1>, target: Tensor<1>, valid: usize, grad: Tensor<2>) -> Tensor<2> {
    let [n, c] = logits.dims();
    let dtype = logits.dtype();
    let device = logits.device();
    let x = logits.cast(DType::F32) - shift.unsqueeze_dim::<2>(1); // [n, c]
    let columns = Tensor::<1, Int>::arange(0..c as i64, &device)
        .unsqueeze::<2>()
        .expand([n, c]);
    let padded = columns.clone().greater_equal_elem(valid as i64);
    let is_target = columns.equal(target.int().unsqueeze_dim::<2>(1).expand([n, c]));
    let g = |i: usize| grad.clone().narrow(1, i + 1, 1);
    let d = x.exp() * g(0) + is_target.float().cast(DType::F32) * g(1) + g(2);
    d.mask_fill(padded, 0.0).cast(dtype)
}
