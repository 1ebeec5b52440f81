//! FP8 and FP4 quantization: the number formats ([`format`]) and the block scalings of the
//! training recipes ([`scaling`]), each with a scalar reference on host data that the kernels
//! are checked against bit for bit; the recipes of low-precision linear layers ([`recipe`]);
//! quantization emulated in tensor ops on any device ([`fake`]); FP8 in 1×128 tiles on device
//! tensors ([`tiles`]), fused on CUDA; the quantized product of a linear layer with its
//! gradients ([`product`]), on FP8 codes on CUDA ([`kernels`]); delayed scaling's amax histories
//! ([`history`]); the amaxes fused kernels take as they write a tensor ([`notes`]).

pub mod fake;
pub mod format;
pub mod history;
#[cfg(feature = "cuda")]
pub mod kernels;
pub mod notes;
pub mod product;
pub mod recipe;
pub mod scaling;
pub mod tiles;
