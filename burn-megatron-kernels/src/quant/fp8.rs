//! FP8 tensorwise products on codes, on CUDA (current or delayed scaling, either gradient
//! format): each operand quantized by one amax pass and one cast (`quant_kernels::quantize_tensor`),
//! multiplied by the FP8 wgmma GEMM with the two dequantization scales in its epilogue.
//!
//! A linear layer's three products read each of its tensors twice: `x` in forward and (as `xᵀ`)
//! in wgrad, `w` in forward (as `wᵀ`) and dgrad, `dy` in dgrad and (as `dyᵀ`) wgrad. Where both
//! reads take the same format, the tensor is quantized once: one amax, reduced once over the
//! group, and one pass writing both layouts. The forward keeps the codes its gradients read
//! ([`Kept::Codes`], one byte a value where the bf16 operand took two) in place of the operand;
//! every other case keeps the operand and quantizes it again ([`Kept::Values`]), as the emulated
//! recipes do.

use burn::backend::Cube;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, Tensor};
use burn_cubecl::tensor::CubeTensor;

use super::format::Minifloat;
use super::product::{Amax, Operand, QuantGrads, QuantOps, dgrad_of, quantized_operands, wgrad_of};
use super::recipe::{Pass, Recipe};
use crate::elementwise::is_compact;
use crate::quant_kernels::{Fp8Codes, Layouts, quantize_tensor};

/// What a product keeps of an operand for the other's gradient on CUDA (tensor handles, a
/// few per layer call: their size does not matter).
#[derive(Clone, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Kept {
    /// The operand in its own dtype, quantized again by the gradient's product.
    Values(CubeTensor),
    /// The FP8 codes the gradient's product reads (the operand's transpose, row-major: K-major
    /// there), and their dequantization scale `[1]`.
    Codes { codes: CubeTensor, dequant: CubeTensor },
}

const DIRECT: Layouts = Layouts {
    direct: true,
    transposed: false,
};
const TRANSPOSED: Layouts = Layouts {
    direct: false,
    transposed: true,
};
const BOTH: Layouts = Layouts {
    direct: true,
    transposed: true,
};

/// Whether `recipe`'s products run on FP8 codes here (one scale a tensor) for an inner
/// dimension `k` (the FP8 GEMM's K steps are 16 wide).
fn on_codes(recipe: Recipe, k: usize) -> bool {
    let tensorwise = matches!(
        recipe,
        Recipe::Fp8Tensorwise | Recipe::Fp8TensorwiseE4m3 | Recipe::Fp8Delayed { .. }
    );
    tensorwise && k.is_multiple_of(16)
}

/// The codes of `t` (`[r, c]`) and/or of `tᵀ` (`[c, r]`), as `layouts` asks, and their
/// dequantization scale: one amax, reduced over `amax` as `operand`'s, and one pass over
/// whichever of `t` and `tᵀ` is row-major (a transposed view is read as its row-major source).
fn quantize(t: CubeTensor, format: Minifloat, amax: &Amax, operand: Operand, layouts: Layouts) -> Fp8Codes {
    let cuda = |t: Tensor<1>| t.try_into_primitive::<Cube>().expect("a CUDA tensor");
    let reduce = |local: CubeTensor| match amax {
        Some(group) => {
            let scale = group.max(Tensor::from_primitive::<Cube>(local), operand);
            (cuda(scale.current), scale.kept.map(|kept| cuda(kept.cast(DType::F32))))
        }
        None => (local, None),
    };
    let transpose = Cube::float_transpose(t.clone());
    if is_compact(&t) || !is_compact(&transpose) {
        return quantize_tensor(t, format, layouts, reduce);
    }
    let swapped = Layouts {
        direct: layouts.transposed,
        transposed: layouts.direct,
    };
    let codes = quantize_tensor(transpose, format, swapped, reduce);
    Fp8Codes {
        direct: codes.transposed,
        transposed: codes.direct,
        dequant: codes.dequant,
    }
}

/// `q(a) · q(b)ᵀ` from the codes (`[m, k]`, `[n, k]`) and their dequantization scales, in `dtype`.
fn gemm(
    a: (CubeTensor, CubeTensor),
    b: (CubeTensor, CubeTensor),
    formats: (Minifloat, Minifloat),
    dtype: DType,
) -> CubeTensor {
    let out = crate::wgmma::fp8_gemm(a.0, b.0, formats, [a.1, b.1], crate::wgmma::Schedule::Persistent)
        .expect("FP8 codes of a k that is a multiple of 16");
    match dtype {
        DType::BF16 => out,
        other => Cube::float_cast(out, other.into()),
    }
}

/// A forward input's codes as [`SharedInput`](super::product::SharedInput) keeps them.
#[derive(Clone, Debug)]
struct SharedCodes {
    format: Minifloat,
    layouts: Layouts,
    codes: Fp8Codes,
}

/// The codes of a layout that was asked for.
fn asked(codes: Option<CubeTensor>) -> CubeTensor {
    codes.expect("quantize writes every layout it is asked for")
}

impl QuantOps for Cube {
    fn quantized_product(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        recipe: Recipe,
        pass: Pass,
        amax: Amax,
    ) -> FloatTensor<Self> {
        if !on_codes(recipe, a.meta.shape()[1]) {
            // Emulated; bf16 operands multiplied in bf16 on our GEMM (MX and NVFP4 values are
            // exact in bf16; f32 block scales round to its 8 bits, inside the format's step).
            let t = |x| Tensor::<2>::from_primitive::<Cube>(x);
            let dtype = a.dtype;
            let (a, b) = quantized_operands(t(a), t(b), recipe, pass, &amax);
            let out = match dtype {
                DType::BF16 => crate::gemm(a.cast(DType::BF16), b.cast(DType::BF16).transpose(), crate::Gemm::Wgmma),
                other => crate::f32_matmul::matmul(a, b.transpose()).cast(other),
            };
            return out.try_into_primitive::<Cube>().expect("a CUDA tensor");
        }
        let (qa, qb) = recipe.operands(pass);
        let dtype = a.dtype;
        let a = quantize(a, qa.format, &amax, Operand { pass, a: true }, DIRECT);
        let b = quantize(b, qb.format, &amax, Operand { pass, a: false }, DIRECT);
        gemm(
            (asked(a.direct), a.dequant),
            (asked(b.direct), b.dequant),
            (qa.format, qb.format),
            dtype,
        )
    }
}

impl QuantGrads for Cube {
    type Kept = Kept;

    fn forward_keeping(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        recipe: Recipe,
        amax: Amax,
        keep: [bool; 2],
    ) -> (FloatTensor<Self>, [Option<Kept>; 2]) {
        let ([m, k], n) = ([a.meta.shape()[0], a.meta.shape()[1]], b.meta.shape()[0]);
        if !on_codes(recipe, k) {
            let kept = [
                keep[0].then(|| Kept::Values(a.clone())),
                keep[1].then(|| Kept::Values(b.clone())),
            ];
            return (Self::quantized_product(a, b, recipe, Pass::Forward, amax), kept);
        }
        let (qa, qb) = recipe.operands(Pass::Forward);
        // `aᵀ` is wgrad's `b` (K = m), `bᵀ` dgrad's `b` (K = n): their codes are kept where
        // those products read the forward's format and their K suits the FP8 GEMM.
        let a_codes = keep[0] && recipe.operands(Pass::Wgrad).1.format == qa.format && on_codes(recipe, m);
        let b_codes = keep[1] && recipe.operands(Pass::Dgrad).1.format == qb.format && on_codes(recipe, n);
        let values = |keep: bool, codes: bool, t: &CubeTensor| (keep && !codes).then(|| Kept::Values(t.clone()));
        let (a_values, b_values) = (values(keep[0], a_codes, &a), values(keep[1], b_codes, &b));
        let dtype = a.dtype;
        let layouts = |codes: bool| Layouts {
            direct: true,
            transposed: codes,
        };
        let pass = Pass::Forward;
        let quantize_a = || quantize(a.clone(), qa.format, &amax, Operand { pass, a: true }, layouts(a_codes));
        let shared = amax.as_ref().and_then(|group| group.shared_input());
        let qa_codes = match shared {
            // Delayed scaling scales each layer by its own history: nothing to share.
            Some(shared) if !matches!(recipe, Recipe::Fp8Delayed { .. }) => {
                let fits = |kept: &SharedCodes| {
                    kept.format == qa.format
                        && kept.layouts == layouts(a_codes)
                        && kept
                            .codes
                            .direct
                            .as_ref()
                            .is_some_and(|d| d.meta.shape() == a.meta.shape())
                };
                let make = || SharedCodes {
                    format: qa.format,
                    layouts: layouts(a_codes),
                    codes: quantize_a(),
                };
                shared.reuse_or(fits, make).codes
            }
            _ => quantize_a(),
        };
        let qb_codes = quantize(b, qb.format, &amax, Operand { pass, a: false }, layouts(b_codes));
        let kept = |codes: &Fp8Codes, values: Option<Kept>| match &codes.transposed {
            Some(transposed) => Some(Kept::Codes {
                codes: transposed.clone(),
                dequant: codes.dequant.clone(),
            }),
            None => values,
        };
        let kept = [kept(&qa_codes, a_values), kept(&qb_codes, b_values)];
        let out = gemm(
            (asked(qa_codes.direct), qa_codes.dequant),
            (asked(qb_codes.direct), qb_codes.dequant),
            (qa.format, qb.format),
            dtype,
        );
        (out, kept)
    }

    fn gradients(
        grad: FloatTensor<Self>,
        [a, b]: [Option<Kept>; 2],
        recipe: Recipe,
        amax: Amax,
    ) -> [Option<FloatTensor<Self>>; 2] {
        let (dgrad_a, dgrad_b) = recipe.operands(Pass::Dgrad);
        let (wgrad_a, wgrad_b) = recipe.operands(Pass::Wgrad);
        let dtype = grad.dtype;
        let dgrad_operand = Operand {
            pass: Pass::Dgrad,
            a: true,
        };
        let wgrad_operand = Operand {
            pass: Pass::Wgrad,
            a: true,
        };
        // `grad` is dgrad's `a`, `gradᵀ` wgrad's: one pass writes both where both read codes
        // of one format.
        let codes = |kept: &Option<Kept>| matches!(kept, Some(Kept::Codes { .. }));
        let shared = (codes(&a) && codes(&b) && dgrad_a.format == wgrad_a.format)
            .then(|| quantize(grad.clone(), dgrad_a.format, &amax, dgrad_operand, BOTH));
        let da = b.map(|b| match b {
            Kept::Values(b) => dgrad_of::<Cube>(grad.clone(), b, recipe, amax.clone()),
            Kept::Codes { codes, dequant } => {
                let g = match &shared {
                    Some(shared) => (asked(shared.direct.clone()), shared.dequant.clone()),
                    None => {
                        let g = quantize(grad.clone(), dgrad_a.format, &amax, dgrad_operand, DIRECT);
                        (asked(g.direct), g.dequant)
                    }
                };
                gemm(g, (codes, dequant), (dgrad_a.format, dgrad_b.format), dtype)
            }
        });
        let db = a.map(|a| match a {
            Kept::Values(a) => wgrad_of::<Cube>(grad.clone(), a, recipe, amax.clone()),
            Kept::Codes { codes, dequant } => {
                let g = match shared {
                    Some(shared) => (asked(shared.transposed), shared.dequant),
                    None => {
                        let g = quantize(grad.clone(), wgrad_a.format, &amax, wgrad_operand, TRANSPOSED);
                        (asked(g.transposed), g.dequant)
                    }
                };
                // `dbᵀ = aᵀ · grad`, `[k, m] · [m, n]`: the product in a weight's own layout
                // (`b` is `wᵀ`), handed back as the `[n, k]` view, so the transpose taking it
                // to the weight costs no copy (ncu: 53 µs a layer for llama-1b's).
                let transposed = gemm((codes, dequant), g, (wgrad_b.format, wgrad_a.format), dtype);
                Cube::float_transpose(transposed)
            }
        });
        [da, db]
    }
}
