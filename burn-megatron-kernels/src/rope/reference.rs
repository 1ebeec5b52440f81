//! The plain tensor-op twin: the CPU path and the kernel's oracle.

use burn::tensor::{DType, Tensor};

pub fn rope(x: Tensor<4>, cos: Tensor<2>, sin: Tensor<2>, inverse: bool) -> Tensor<4> {
    let [_, _, s, d] = x.dims();
    let half = d / 2;
    let dtype = x.dtype();
    let x = x.cast(DType::F32);
    let cos = cos.narrow(0, 0, s).cast(DType::F32).unsqueeze::<4>();
    let sin = sin.narrow(0, 0, s).cast(DType::F32).unsqueeze::<4>();
    let sin = if inverse { sin.neg() } else { sin };
    let x1 = x.clone().narrow(3, 0, half);
    let x2 = x.narrow(3, half, half);
    let rotated_1 = x1.clone() * cos.clone() - x2.clone() * sin.clone();
    let rotated_2 = x2 * cos + x1 * sin;
    Tensor::cat(vec![rotated_1, rotated_2], 3).cast(dtype)
}
