//! Which blocks of a model keep the compute dtype's product under a low-precision recipe: the
//! first and last blocks are the most sensitive to quantization (NVIDIA's NVFP4 recipe keeps
//! about 15% of the linear layers in bf16, most of them at the end).

use burn::config::Config;
use burn_megatron_kernels::Gemm;
use burn_megatron_kernels::quant::recipe::Recipe;

/// A policy's choice of blocks that keep its `kept` product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeptBlocks {
    /// The first `first` and the last `last` blocks.
    Count { first: usize, last: usize },
    /// The last ⌈`percent` % of the blocks⌉.
    LastPercent(usize),
}

impl KeptBlocks {
    /// No block.
    pub const NONE: Self = Self::Count { first: 0, last: 0 };

    /// What `recipe` keeps: NVFP4 its last 15%, the FP8 recipes nothing.
    pub fn of(recipe: Recipe) -> Self {
        match recipe {
            Recipe::Nvfp4 => Self::LastPercent(15),
            _ => Self::NONE,
        }
    }

    /// The blocks of a model of `n` blocks, run with `gemm`; `None` when there are none.
    pub fn edges(self, n: usize, gemm: Gemm) -> Option<EdgeBlocks> {
        let (first, last) = match self {
            Self::Count { first, last } => (first.min(n), last.min(n)),
            Self::LastPercent(percent) => (0, (n * percent).div_ceil(100).min(n)),
        };
        (first + last > 0).then_some(EdgeBlocks { first, last, gemm })
    }
}

/// The blocks at a model's edges whose linear layers run `gemm` instead of the configured
/// product: part of the model's configuration, set by a precision policy.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub struct EdgeBlocks {
    pub first: usize,
    pub last: usize,
    pub gemm: Gemm,
}

impl EdgeBlocks {
    /// Whether block `i` of `n` is an edge block.
    pub fn holds(&self, i: usize, n: usize) -> bool {
        i < self.first || i + self.last >= n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edges_count_from_both_ends() {
        let edges = KeptBlocks::Count { first: 1, last: 2 }.edges(6, Gemm::Wgmma).unwrap();
        let held: Vec<bool> = (0..6).map(|i| edges.holds(i, 6)).collect();
        assert_eq!(held, [true, false, false, false, true, true]);
        assert_eq!(KeptBlocks::NONE.edges(6, Gemm::Wgmma), None);
        assert_eq!(
            KeptBlocks::LastPercent(15).edges(2, Gemm::Wgmma).map(|e| e.last),
            Some(1)
        );
        assert_eq!(
            KeptBlocks::LastPercent(15).edges(32, Gemm::Wgmma).map(|e| e.last),
            Some(5)
        );
        assert_eq!(
            KeptBlocks::Count { first: 9, last: 9 }
                .edges(4, Gemm::Wgmma)
                .map(|e| (e.first, e.last)),
            Some((4, 4))
        );
    }
}
