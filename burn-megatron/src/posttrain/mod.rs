//! After training: post-training quantization ([`ptq`]: calibrate, smooth and quantize a model's
//! blocks to the schemes of `precision::ptq`), Minitron-style structured pruning ([`prune`]) and
//! knowledge distillation ([`distill`]).

pub mod distill;
pub mod prune;
pub mod ptq;
