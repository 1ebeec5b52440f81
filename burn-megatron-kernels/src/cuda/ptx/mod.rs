//! PTX text the Hopper kernels bind through `gpu_asm!`, as plain Rust so its operand numbering
//! is unit-tested on any machine: `wgmma` chains ([`wgmma`]) and a warp's `mma.sync` ([`mma`]).

pub(crate) mod mma;
pub(crate) mod wgmma;
