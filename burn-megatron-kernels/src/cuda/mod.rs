//! What the CUDA kernels share: compact tensors and launches ([`launch`]), block reductions and
//! a tensor's amax in one launch ([`reduce`]), the amaxes kernels take as they write
//! ([`known_amax`]), Hopper's pieces as inline PTX ([`hopper`]: mbarriers, TMA, `wgmma`
//! descriptors; the PTX text itself in `ptx`, unit-tested on any machine), our Hopper GEMM
//! ([`wgmma`]), and CUDA graphs ([`graph`], on every build: it refuses where CUDA is not).

pub mod graph;
#[cfg(feature = "cuda")]
pub(crate) mod hopper;
#[cfg(feature = "cuda")]
pub(crate) mod known_amax;
#[cfg(feature = "cuda")]
pub(crate) mod launch;
#[cfg(any(feature = "cuda", test))]
pub(crate) mod ptx;
#[cfg(feature = "cuda")]
pub(crate) mod reduce;
#[cfg(feature = "cuda")]
pub mod wgmma;
