//! FP8 and FP4 quantization: the number formats ([`format`]) and the block scalings of the
//! training recipes ([`scaling`]), each with a scalar reference on host data that the kernels
//! are checked against bit for bit; FP8 in 1×128 tiles on device tensors ([`tiles`]), fused on
//! CUDA; the FP8 product of a linear layer with its gradients ([`fp8`]).

pub mod format;
pub mod fp8;
pub mod scaling;
pub mod tiles;
