//! The training recipes of low-precision linear layers: for each of a layer's three products
//! (forward, dgrad, wgrad), how each operand is quantized. A product is `q(a) · q(b)ᵀ` of `a`
//! `[m, k]` and `b` `[n, k]`, both K-major, so every block below runs along the product's inner
//! dimension:
//!
//! ```text
//! forward  y  = x · w    a = x    [tokens, in]   b = wᵀ  [out, in]
//! dgrad    dx = dy · wᵀ  a = dy   [tokens, out]  b = w   [in, out]
//! wgrad    dw = xᵀ · dy  a = dyᵀ  [out, tokens]  b = xᵀ  [in, tokens]   (dwᵀ, Burn's layout)
//! ```
//!
//! | recipe | forward x, w | dgrad dy, w | wgrad dy, x |
//! |---|---|---|---|
//! | [`Recipe::Fp8Tensorwise`] | E4M3 tensor, E4M3 tensor | E5M2 tensor, E4M3 tensor | E5M2 tensor, E4M3 tensor |
//! | [`Recipe::Fp8TensorwisePromoted`] | E4M3 tensor, E4M3 tensor | E5M2 tensor, E4M3 tensor | E5M2 tensor, E4M3 tensor |
//! | [`Recipe::Fp8TensorwiseE4m3`] | E4M3 tensor, E4M3 tensor | E4M3 tensor, E4M3 tensor | E4M3 tensor, E4M3 tensor |
//! | [`Recipe::Fp8TensorwiseE4m3Promoted`] | E4M3 tensor, E4M3 tensor | E4M3 tensor, E4M3 tensor | E4M3 tensor, E4M3 tensor |
//! | [`Recipe::Fp8Delayed`] | E4M3 tensor, E4M3 tensor | E5M2 tensor, E4M3 tensor | E5M2 tensor, E4M3 tensor |
//! | [`Recipe::Fp8Blockwise`] | E4M3 1×128, E4M3 128×128 | E4M3 1×128, E4M3 128×128 | E4M3 1×128, E4M3 1×128 |
//! | [`Recipe::Mxfp8`] | E4M3 MX 1×32 both | E4M3 MX both | E4M3 MX both |
//! | [`Recipe::Nvfp4`] | E2M1 NV 1×16, NV 16×16 | E2M1 NV 1×16 stochastic, NV 16×16 | E2M1 NV 1×16 stochastic + RHT, NV 1×16 + RHT |
//!
//! - Tensorwise: Transformer Engine's current scaling (one scale from this call's amax), hybrid
//!   (E5M2 gradients, the default) or E4M3 throughout. Promoted: either of them with the two
//!   gradient products adding their partial sums into f32 after every 128-deep slice of k
//!   ([`Recipe::promotes`]; Transformer Engine's `use_split_accumulator`, torchao's
//!   `use_fast_accum=False` for them), where Hopper's FP8 `wgmma` would accumulate all of k with
//!   its fewer bits; the forward keeps the fast accumulation, as both of those do.
//! - Delayed: Transformer Engine's delayed scaling, hybrid: each tensor's scale from the amax
//!   history its layer keeps (the largest, or the most recent), this call's amax recorded for
//!   later steps. The products quantize as tensorwise does and accumulate as Transformer
//!   Engine's: the gradient products promoted, the forward fast; the history is the layer's
//!   (`burn_megatron::precision::delayed`), reached through the product's [`AmaxGroup`].
//!
//! [`AmaxGroup`]: super::product::AmaxGroup
//! - Blockwise: DeepSeek-V3's (f32 scales; a weight's 128×128 blocks are the same in `w` and
//!   `wᵀ`, so forward and dgrad see one quantized weight).
//! - MXFP8: NVIDIA's MXFP8 recipe (E4M3 everywhere, E8M0 scales rounded up).
//! - NVFP4: NVIDIA's NVFP4 pretraining recipe: 16×16 weight blocks, stochastic rounding of the
//!   gradients, a random Hadamard transform on both wgrad operands along the tokens (it cancels
//!   in the product: `(A·H)(B·H)ᵀ = A·Bᵀ`), the last layers in bf16 (the policy's choice).

use burn::config::Config;

use super::format::Minifloat;

/// How an operand's values share scales (the shapes are `rows × cols` of the K-major operand).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Blocks {
    /// One scale from the tensor's amax (current scaling).
    Tensor,
    /// An f32 scale per 1×128 tile along K.
    Tiles,
    /// An f32 scale per 128×128 block.
    Squares,
    /// An E8M0 scale per 1×32 block along K.
    Mx,
    /// NVFP4's f32 tensor scale and an E4M3 scale per `rows × 16` block (1 or 16).
    Nv { rows: usize },
}

/// How an operand's values round onto the format's grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rounding {
    /// To nearest, ties to even.
    Nearest,
    /// Up with probability the fraction of a step above the value below (unbiased).
    Stochastic,
}

/// How one operand of a product is quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Quantizer {
    pub format: Minifloat,
    pub blocks: Blocks,
    pub rounding: Rounding,
    /// Whether the operand is multiplied by the random Hadamard transform along K first (both
    /// operands of a product or neither).
    pub hadamard: bool,
}

impl Quantizer {
    const fn new(format: Minifloat, blocks: Blocks) -> Self {
        Self {
            format,
            blocks,
            rounding: Rounding::Nearest,
            hadamard: false,
        }
    }

    const fn stochastic(self) -> Self {
        Self {
            rounding: Rounding::Stochastic,
            ..self
        }
    }

    const fn hadamard(self) -> Self {
        Self { hadamard: true, ..self }
    }
}

/// Which of a linear layer's products.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pass {
    Forward,
    Dgrad,
    Wgrad,
}

/// How delayed scaling turns a tensor's amax history into the amax it scales by (Transformer
/// Engine's `amax_compute_algo`).
#[derive(Config, Debug, Copy, PartialEq, Eq, Hash)]
pub enum AmaxAlgo {
    /// The largest amax of the history.
    Max,
    /// The newest amax of the history.
    MostRecent,
}

/// A low-precision training recipe for linear layers.
#[derive(Config, Debug, Copy, PartialEq, Eq, Hash)]
pub enum Recipe {
    /// FP8, per-tensor current scaling, E4M3 forward and E5M2 gradients.
    Fp8Tensorwise,
    /// [`Recipe::Fp8Tensorwise`] with the gradient products' partial sums promoted into f32
    /// after every 128-deep slice of k ([`Recipe::promotes`]).
    Fp8TensorwisePromoted,
    /// FP8, per-tensor current scaling, E4M3 forward and gradients.
    Fp8TensorwiseE4m3,
    /// [`Recipe::Fp8TensorwiseE4m3`] with the gradient products promoted as
    /// [`Recipe::Fp8TensorwisePromoted`]'s are (Transformer Engine's and torchao's default
    /// accumulation for E4M3 gradients).
    Fp8TensorwiseE4m3Promoted,
    /// FP8, per-tensor delayed scaling over the last `history` steps' amaxes, E4M3 forward and
    /// E5M2 gradients (Transformer Engine's `DelayedScaling`; its defaults are 1024 and `Max`).
    Fp8Delayed { history: usize, algo: AmaxAlgo },
    /// FP8 E4M3 with DeepSeek-V3's 1×128 tiles and 128×128 weight blocks.
    Fp8Blockwise,
    /// MXFP8: E4M3 in 1×32 blocks with E8M0 scales.
    Mxfp8,
    /// NVFP4: E2M1 in 16-element blocks with E4M3 scales and an f32 tensor scale.
    Nvfp4,
}

impl Recipe {
    /// Delayed scaling with Transformer Engine's defaults: a history of 1024, its largest amax.
    pub const FP8_DELAYED: Recipe = Recipe::Fp8Delayed {
        history: 1024,
        algo: AmaxAlgo::Max,
    };

    /// Every recipe, in the order of the table above.
    pub const ALL: [Recipe; 8] = [
        Recipe::Fp8Tensorwise,
        Recipe::Fp8TensorwisePromoted,
        Recipe::Fp8TensorwiseE4m3,
        Recipe::Fp8TensorwiseE4m3Promoted,
        Recipe::FP8_DELAYED,
        Recipe::Fp8Blockwise,
        Recipe::Mxfp8,
        Recipe::Nvfp4,
    ];

    /// The recipe's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Recipe::Fp8Tensorwise => "fp8-tensorwise",
            Recipe::Fp8TensorwisePromoted => "fp8-tensorwise-promoted",
            Recipe::Fp8TensorwiseE4m3 => "fp8-tensorwise-e4m3",
            Recipe::Fp8TensorwiseE4m3Promoted => "fp8-tensorwise-e4m3-promoted",
            Recipe::Fp8Delayed { .. } => "fp8-delayed",
            Recipe::Fp8Blockwise => "fp8-blockwise",
            Recipe::Mxfp8 => "mxfp8",
            Recipe::Nvfp4 => "nvfp4",
        }
    }

    /// The quantizers of `a` and `b` in `pass`'s product.
    pub fn operands(self, pass: Pass) -> (Quantizer, Quantizer) {
        use Blocks::*;
        use Minifloat::{E2M1, E4M3, E5M2};
        let q = Quantizer::new;
        match (self, pass) {
            (Recipe::Fp8Tensorwise | Recipe::Fp8TensorwisePromoted, Pass::Forward) => {
                (q(E4M3, Tensor), q(E4M3, Tensor))
            }
            (Recipe::Fp8Tensorwise | Recipe::Fp8TensorwisePromoted, _) => (q(E5M2, Tensor), q(E4M3, Tensor)),
            (Recipe::Fp8TensorwiseE4m3 | Recipe::Fp8TensorwiseE4m3Promoted, _) => (q(E4M3, Tensor), q(E4M3, Tensor)),
            (Recipe::Fp8Delayed { .. }, Pass::Forward) => (q(E4M3, Tensor), q(E4M3, Tensor)),
            (Recipe::Fp8Delayed { .. }, _) => (q(E5M2, Tensor), q(E4M3, Tensor)),
            (Recipe::Fp8Blockwise, Pass::Wgrad) => (q(E4M3, Tiles), q(E4M3, Tiles)),
            (Recipe::Fp8Blockwise, _) => (q(E4M3, Tiles), q(E4M3, Squares)),
            (Recipe::Mxfp8, _) => (q(E4M3, Mx), q(E4M3, Mx)),
            (Recipe::Nvfp4, Pass::Forward) => (q(E2M1, Nv { rows: 1 }), q(E2M1, Nv { rows: 16 })),
            (Recipe::Nvfp4, Pass::Dgrad) => (q(E2M1, Nv { rows: 1 }).stochastic(), q(E2M1, Nv { rows: 16 })),
            (Recipe::Nvfp4, Pass::Wgrad) => (
                q(E2M1, Nv { rows: 1 }).stochastic().hadamard(),
                q(E2M1, Nv { rows: 1 }).hadamard(),
            ),
        }
    }
}

impl Recipe {
    /// Whether `pass`'s product adds its partial sums into f32 after every 128-deep slice of k
    /// rather than accumulating all of k in the tensor cores' accumulator (blockwise: every
    /// product, each slice scaled apart; the promoted tensorwise recipes and delayed scaling:
    /// the gradient products, as Transformer Engine's `_2X_ACC_DGRAD` and `_2X_ACC_WGRAD`). The
    /// CPU's products are f32 throughout either way.
    pub fn promotes(self, pass: Pass) -> bool {
        match self {
            Recipe::Fp8Blockwise => true,
            Recipe::Fp8TensorwisePromoted | Recipe::Fp8TensorwiseE4m3Promoted | Recipe::Fp8Delayed { .. } => {
                pass != Pass::Forward
            }
            _ => false,
        }
    }
}

impl Recipe {
    /// The recipe as [`FromStr`](std::str::FromStr) reads it: its name, delayed scaling with its
    /// history and algorithm (`fp8-delayed:16:max`).
    pub fn spec(self) -> String {
        match self {
            Recipe::Fp8Delayed { history, algo } => {
                let algo = match algo {
                    AmaxAlgo::Max => "max",
                    AmaxAlgo::MostRecent => "most-recent",
                };
                format!("fp8-delayed:{history}:{algo}")
            }
            other => other.name().to_string(),
        }
    }
}

impl std::str::FromStr for Recipe {
    type Err = String;

    /// A recipe by name; delayed scaling as `fp8-delayed[:HISTORY[:max|most-recent]]`.
    fn from_str(name: &str) -> Result<Self, String> {
        if let Some(rest) = name.strip_prefix("fp8-delayed:") {
            let (history, algo) = rest.split_once(':').unwrap_or((rest, "max"));
            let history = match history.parse::<usize>() {
                Ok(n) if n > 0 => n,
                _ => return Err(format!("{name:?}: the amax history must be a length of at least 1")),
            };
            let algo = match algo {
                "max" => AmaxAlgo::Max,
                "most-recent" => AmaxAlgo::MostRecent,
                other => return Err(format!("{name:?}: {other:?} is no amax algorithm (max or most-recent)")),
            };
            return Ok(Recipe::Fp8Delayed { history, algo });
        }
        Recipe::ALL.into_iter().find(|r| r.name() == name).ok_or_else(|| {
            let names: Vec<_> = Recipe::ALL.iter().map(|r| r.name()).collect();
            format!("unknown recipe {name:?}: one of {}", names.join(", "))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each recipe's table: the Hadamard transform on both wgrad operands or neither, stochastic
    /// rounding on gradients only, and the names round-trip.
    #[test]
    fn recipes_are_consistent() {
        for recipe in Recipe::ALL {
            for pass in [Pass::Forward, Pass::Dgrad, Pass::Wgrad] {
                let (a, b) = recipe.operands(pass);
                assert_eq!(a.hadamard, b.hadamard, "{recipe:?} {pass:?}");
                assert_eq!(
                    b.rounding,
                    Rounding::Nearest,
                    "{recipe:?} {pass:?}: b is never a gradient"
                );
                if pass == Pass::Forward {
                    assert_eq!(a.rounding, Rounding::Nearest, "{recipe:?}: x is not a gradient");
                }
            }
            assert_eq!(recipe.name().parse::<Recipe>(), Ok(recipe));
            assert_eq!(recipe.spec().parse::<Recipe>(), Ok(recipe));
        }
        assert!("fp9".parse::<Recipe>().unwrap_err().contains("nvfp4"));
        assert_eq!(
            "fp8-delayed:16:most-recent".parse::<Recipe>(),
            Ok(Recipe::Fp8Delayed {
                history: 16,
                algo: AmaxAlgo::MostRecent
            })
        );
        assert!("fp8-delayed:0".parse::<Recipe>().is_err() && "fp8-delayed:4:mean".parse::<Recipe>().is_err());
    }

    /// Each promoted tensorwise recipe quantizes every operand as its fast twin does and promotes
    /// exactly its gradient products, as delayed scaling does; blockwise promotes every product,
    /// the others none.
    #[test]
    fn promotion_is_the_gradient_products_of_promoted_tensorwise() {
        let twins = [
            (Recipe::Fp8TensorwisePromoted, Recipe::Fp8Tensorwise),
            (Recipe::Fp8TensorwiseE4m3Promoted, Recipe::Fp8TensorwiseE4m3),
        ];
        for pass in [Pass::Forward, Pass::Dgrad, Pass::Wgrad] {
            for (promoted, fast) in twins {
                assert_eq!(promoted.operands(pass), fast.operands(pass));
                assert_eq!(promoted.promotes(pass), pass != Pass::Forward);
            }
            assert_eq!(Recipe::FP8_DELAYED.promotes(pass), pass != Pass::Forward);
            assert!(Recipe::Fp8Blockwise.promotes(pass));
            for recipe in Recipe::ALL {
                let promoting = twins.iter().any(|(promoted, _)| *promoted == recipe)
                    || matches!(recipe, Recipe::Fp8Blockwise | Recipe::Fp8Delayed { .. });
                if !promoting {
                    assert!(!recipe.promotes(pass), "{recipe:?} {pass:?}");
                }
            }
        }
    }
}
