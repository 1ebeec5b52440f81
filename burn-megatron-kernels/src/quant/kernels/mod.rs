//! The quantization CUDA kernels: FP8 casts with one scale a tensor ([`cast`]) or in blocks
//! ([`blocks`]), the FP8 products on codes ([`fp8`]), and the emulated MX and NVFP4 blocks
//! quantized and dequantized in one pass ([`emulated`]).

pub(crate) mod blocks;
pub(crate) mod cast;
pub(crate) mod emulated;
pub mod fp8;
