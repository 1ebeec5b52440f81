//! FP8 products on codes, on CUDA: tensorwise (current or delayed scaling, either gradient
//! format), each operand quantized by one amax pass and one cast (`quant_kernels::quantize_tensor`)
//! and multiplied by the FP8 wgmma GEMM with the two dequantization scales in its epilogue; and
//! blockwise (1×128 tiles, 128×128 weight blocks: `quant_blocks`), multiplied by the blockwise
//! FP8 GEMM, which applies each slice's scales as it accumulates.
//!
//! A linear layer's three products read each of its tensors twice: `x` in forward and (as `xᵀ`)
//! in wgrad, `w` in forward (as `wᵀ`) and dgrad, `dy` in dgrad and (as `dyᵀ`) wgrad. Where both
//! reads take the same quantizer, the tensor is quantized once for both layouts (tensorwise: one
//! amax, reduced once over the group, and one pass writing both; a weight's blocks: one pass;
//! 1×128 tiles along either side: one quantization each, since `xᵀ`'s tiles run down `x`'s
//! columns). The forward keeps the codes its gradients read ([`Kept::Codes`], one byte a value
//! where the bf16 operand took two) in place of the operand; every other case keeps the operand
//! and quantizes it again ([`Kept::Values`]), as the emulated recipes do.

use std::sync::{Arc, Mutex};

use burn::backend::Cube;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, Tensor};
use burn_cubecl::tensor::CubeTensor;

use crate::cuda::launch::is_compact;
use crate::cuda::wgmma::{Accumulation, BScales};
use crate::quant::format::Minifloat;
use crate::quant::kernels::blocks::{quantize_row_tiles, quantize_squares, quantize_tiles, quantize_tiles_both};
use crate::quant::kernels::cast::{Fp8Codes, Layouts, quantize_tensor};
use crate::quant::product::{
    Amax, AmaxGroup, Operand, QuantGrads, QuantOps, ScaleAmax, dgrad_of, quantized_operands, wgrad_of,
};
use crate::quant::recipe::{Blocks, Pass, Quantizer, Recipe};

/// How an operand's FP8 codes (`[rows, k]`, K-major) are scaled; each a dequantization factor.
#[derive(Clone, Debug)]
pub enum Scales {
    /// One scale, `[1]`.
    Tensor(CubeTensor),
    /// A scale a row and 128-deep slice of K (1×128 tiles), `[rows, ⌈k/128⌉]`.
    Rows(CubeTensor),
    /// A scale a 128 × 128 block, `[⌈rows/128⌉, ⌈k/128⌉]`.
    Squares(CubeTensor),
}

/// An operand's FP8 codes, u8 `[rows, k]` (K-major), and their scales.
#[derive(Clone, Debug)]
pub struct Codes {
    pub codes: CubeTensor,
    pub scales: Scales,
}

/// What a product keeps of an operand for the other's gradient on CUDA (tensor handles, a
/// few per layer call: their size does not matter).
#[derive(Clone, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Kept {
    /// The operand in its own dtype, quantized again by the gradient's product.
    Values(CubeTensor),
    /// The FP8 codes the gradient's product reads (the operand's transpose, row-major: K-major
    /// there).
    Codes(Codes),
}

/// An operand's codes in the layouts a quantization was asked for: `t`'s own (`[r, c]`) and
/// its transpose's (`[c, r]`), each K-major along its rows.
#[derive(Clone, Debug)]
struct Quantized {
    direct: Option<Codes>,
    transposed: Option<Codes>,
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

/// Whether `recipe`'s products run on FP8 codes here for an inner dimension `k` (the FP8 GEMMs'
/// K steps are 16 wide): the tensorwise recipes and blockwise.
fn on_codes(recipe: Recipe, k: usize) -> bool {
    let fp8 = matches!(
        recipe,
        Recipe::Fp8Tensorwise
            | Recipe::Fp8TensorwisePromoted
            | Recipe::Fp8TensorwiseE4m3
            | Recipe::Fp8TensorwiseE4m3Promoted
            | Recipe::Fp8Delayed { .. }
            | Recipe::Fp8Blockwise
    );
    fp8 && k.is_multiple_of(16)
}

/// `t` (`[r, c]`) in `quantizer`'s codes in each of `layouts`: tensorwise with one amax, reduced
/// over `amax` as `operand`'s; in blocks (local scales) otherwise. Each pass reads whichever of
/// `t` and `tᵀ` is row-major (a transposed view is read as its row-major source).
fn quantize(t: CubeTensor, quantizer: Quantizer, amax: &Amax, operand: Operand, layouts: Layouts) -> Quantized {
    let transpose = Cube::float_transpose(t.clone());
    let swapped = !is_compact(&t) && is_compact(&transpose);
    let (source, wanted) = match swapped {
        false => (t, layouts),
        true => (
            transpose,
            Layouts {
                direct: layouts.transposed,
                transposed: layouts.direct,
            },
        ),
    };
    let format = quantizer.format;
    let (direct, transposed) = match quantizer.blocks {
        Blocks::Tensor => tensorwise(source, format, amax, operand, wanted),
        Blocks::Tiles => {
            let both = (wanted.direct && wanted.transposed)
                .then(|| quantize_tiles_both(source.clone(), format))
                .flatten();
            match both {
                Some((direct, transposed)) => (Some(rows(direct)), Some(rows(transposed))),
                None => (
                    wanted.direct.then(|| rows(quantize_tiles(source.clone(), format))),
                    wanted.transposed.then(|| rows(quantize_row_tiles(source, format))),
                ),
            }
        }
        Blocks::Squares => {
            let (direct, transposed, scales) = quantize_squares(source, format, wanted.direct);
            let transposed_scales = Cube::float_transpose(scales.clone());
            (
                direct.map(|codes| Codes {
                    codes,
                    scales: Scales::Squares(scales),
                }),
                wanted.transposed.then(|| Codes {
                    codes: transposed,
                    scales: Scales::Squares(transposed_scales),
                }),
            )
        }
        Blocks::Mx | Blocks::Nv { .. } => unreachable!("{quantizer:?} is emulated, never on codes"),
    };
    match swapped {
        false => Quantized { direct, transposed },
        true => Quantized {
            direct: transposed,
            transposed: direct,
        },
    }
}

/// The largest magnitude of `x` (NaN ignored; 0 for an empty `x`), `[1]` f32, as current
/// scaling takes it on CUDA: one launch, however many blocks reduce it.
pub fn amax(x: Tensor<2>) -> Tensor<1> {
    let primitive = x.inner().try_into_primitive::<Cube>().expect("a CUDA tensor");
    Tensor::from_primitive::<Cube>(crate::cuda::reduce::tensor_amax(primitive))
}

/// Codes in 1×128 tiles along their rows, with their scales.
fn rows((codes, scales): (CubeTensor, CubeTensor)) -> Codes {
    Codes {
        codes,
        scales: Scales::Rows(scales),
    }
}

/// The tensorwise codes of the row-major `x` in `layouts`: one amax, reduced over `amax`.
fn tensorwise(
    x: CubeTensor,
    format: Minifloat,
    amax: &Amax,
    operand: Operand,
    layouts: Layouts,
) -> (Option<Codes>, Option<Codes>) {
    let cuda = |t: Tensor<1>| t.try_into_primitive::<Cube>().expect("a CUDA tensor");
    let reduce = |local: CubeTensor| match amax {
        Some(group) => {
            let scale = group.max(Tensor::from_primitive::<Cube>(local), operand);
            (cuda(scale.current), scale.kept.map(|kept| cuda(kept.cast(DType::F32))))
        }
        None => (local, None),
    };
    let Fp8Codes {
        direct,
        transposed,
        dequant,
    } = quantize_tensor(
        x,
        format,
        layouts,
        amax.as_ref().and_then(|group| group.notes()),
        reduce,
    );
    let scaled = |codes: CubeTensor| Codes {
        codes,
        scales: Scales::Tensor(dequant.clone()),
    };
    (direct.map(scaled), transposed.map(scaled))
}

/// `q(a) · q(b)ᵀ` from the codes (`[m, k]`, `[n, k]`) and their scales, in `dtype`: the
/// tensorwise GEMM for one scale each (accumulating as asked), the blockwise GEMM for 1×128
/// tiles of `a`.
fn gemm(a: Codes, b: Codes, formats: (Minifloat, Minifloat), accumulation: Accumulation, dtype: DType) -> CubeTensor {
    let schedule = crate::cuda::wgmma::Schedule::Persistent;
    let out = match (a.scales, b.scales) {
        (Scales::Tensor(sa), Scales::Tensor(sb)) => {
            crate::cuda::wgmma::fp8_gemm(a.codes, b.codes, formats, [sa, sb], schedule, accumulation)
        }
        (Scales::Rows(sa), Scales::Squares(sb)) => {
            crate::cuda::wgmma::fp8_blockwise_gemm((a.codes, sa), (b.codes, sb), BScales::Squares, formats)
        }
        (Scales::Rows(sa), Scales::Rows(sb)) => {
            crate::cuda::wgmma::fp8_blockwise_gemm((a.codes, sa), (b.codes, sb), BScales::Rows, formats)
        }
        (a, b) => unreachable!("no recipe multiplies codes scaled as {a:?} by {b:?}"),
    }
    .expect("FP8 codes of a k that is a multiple of 16, with scales of their shapes");
    match dtype {
        DType::BF16 => out,
        other => Cube::float_cast(out, other.into()),
    }
}

/// [`gemm`] of `recipe`'s `pass` product: tensorwise codes promote their partial sums where the
/// recipe says so ([`Recipe::promotes`]); block scales change every slice, so the blockwise GEMM
/// always promotes.
fn gemm_in(
    pass: Pass,
    recipe: Recipe,
    a: Codes,
    b: Codes,
    formats: (Minifloat, Minifloat),
    dtype: DType,
) -> CubeTensor {
    let accumulation = match recipe.promotes(pass) {
        true => Accumulation::Promoted,
        false => Accumulation::Fast,
    };
    gemm(a, b, formats, accumulation, dtype)
}

/// A forward input's codes as [`SharedInput`](crate::quant::product::SharedInput) keeps them, with
/// the amax they were scaled from (for the products that reuse them to record).
#[derive(Clone, Debug)]
struct SharedCodes {
    quantizer: Quantizer,
    layouts: Layouts,
    codes: Quantized,
    current: Option<Tensor<1>>,
}

/// A product's amax group that keeps the current amax its product scaled from: the shared
/// input's, handed to the products that reuse its codes.
#[derive(Debug)]
struct Capturing {
    group: Arc<dyn AmaxGroup>,
    current: Mutex<Option<Tensor<1>>>,
}

impl AmaxGroup for Capturing {
    fn max(&self, amax: Tensor<1>, operand: Operand) -> ScaleAmax {
        let scale = self.group.max(amax, operand);
        *self.current.lock().expect("the captured amax") = Some(scale.current.clone());
        scale
    }
}

/// A weight's codes as [`WeightCodes`](crate::quant::product::WeightCodes) keeps them, with the
/// weight they quantize (held, so its memory stays its own).
#[derive(Clone, Debug)]
struct KeptWeight {
    weight: CubeTensor,
    quantizer: Quantizer,
    layouts: Layouts,
    codes: Quantized,
}

/// Whether `a` and `b` are the same tensor: the same memory, offset, shape and strides.
fn same_tensor(a: &CubeTensor, b: &CubeTensor) -> bool {
    std::ptr::eq(a.handle.memory.descriptor(), b.handle.memory.descriptor())
        && a.handle.offset_start == b.handle.offset_start
        && a.meta.shape() == b.meta.shape()
        && a.meta.strides() == b.meta.strides()
        && a.dtype == b.dtype
}

/// The codes of a layout that was asked for.
fn asked(codes: Option<Codes>) -> Codes {
    codes.expect("quantize writes every layout it is asked for")
}

/// `QuantOps::quantized_product` on CUDA: on FP8 codes where the recipe's formats and the inner
/// size allow, emulated (quantized and dequantized values multiplied in the operands' dtype)
/// elsewhere.
pub(crate) fn quantized_product(a: CubeTensor, b: CubeTensor, recipe: Recipe, pass: Pass, amax: Amax) -> CubeTensor {
    if !on_codes(recipe, a.meta.shape()[1]) {
        // Emulated; bf16 operands multiplied in bf16 on our GEMM (MX and NVFP4 values are
        // exact in bf16; f32 block scales round to its 8 bits, inside the format's step).
        let t = |x| Tensor::<2>::from_primitive::<Cube>(x);
        let dtype = a.dtype;
        let (a, b) = quantized_operands(t(a), t(b), recipe, pass, &amax);
        let out = match dtype {
            DType::BF16 => crate::gemm(a.cast(DType::BF16), b.cast(DType::BF16).transpose(), crate::Gemm::Wgmma),
            other => crate::gemm::f32_matmul::matmul(a, b.transpose()).cast(other),
        };
        return out.try_into_primitive::<Cube>().expect("a CUDA tensor");
    }
    let (qa, qb) = recipe.operands(pass);
    let dtype = a.dtype;
    let a = quantize(a, qa, &amax, Operand { pass, a: true }, DIRECT);
    let b = quantize(b, qb, &amax, Operand { pass, a: false }, DIRECT);
    gemm_in(
        pass,
        recipe,
        asked(a.direct),
        asked(b.direct),
        (qa.format, qb.format),
        dtype,
    )
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
        // those products quantize them as the forward's quantizer does the other layout and
        // their K suits the FP8 GEMM.
        let a_codes = keep[0] && recipe.operands(Pass::Wgrad).1 == qa && on_codes(recipe, m);
        let b_codes = keep[1] && recipe.operands(Pass::Dgrad).1 == qb && on_codes(recipe, n);
        let values = |keep: bool, codes: bool, t: &CubeTensor| (keep && !codes).then(|| Kept::Values(t.clone()));
        let (a_values, b_values) = (values(keep[0], a_codes, &a), values(keep[1], b_codes, &b));
        let dtype = a.dtype;
        let layouts = |codes: bool| Layouts {
            direct: true,
            transposed: codes,
        };
        let pass = Pass::Forward;
        let quantize_a = || quantize(a.clone(), qa, &amax, Operand { pass, a: true }, layouts(a_codes));
        let shared = amax.as_ref().and_then(|group| group.shared_input().map(|s| (group, s)));
        let qa_codes = match shared {
            Some((group, shared)) => {
                let fits = |kept: &SharedCodes| {
                    kept.quantizer == qa
                        && kept.layouts == layouts(a_codes)
                        && kept
                            .codes
                            .direct
                            .as_ref()
                            .is_some_and(|d| d.codes.meta.shape() == a.meta.shape())
                };
                let made = std::cell::Cell::new(false);
                let make = || {
                    made.set(true);
                    let capturing = Arc::new(Capturing {
                        group: group.clone(),
                        current: Mutex::new(None),
                    });
                    let captured: Amax = Some(capturing.clone());
                    let codes = quantize(a.clone(), qa, &captured, Operand { pass, a: true }, layouts(a_codes));
                    SharedCodes {
                        quantizer: qa,
                        layouts: layouts(a_codes),
                        codes,
                        current: capturing.current.lock().expect("the captured amax").take(),
                    }
                };
                let kept = shared.reuse_or(fits, make);
                if let (false, Some(current)) = (made.get(), kept.current) {
                    group.reused_input(current, Operand { pass, a: true });
                }
                kept.codes
            }
            None => quantize_a(),
        };
        let quantize_b = || quantize(b.clone(), qb, &amax, Operand { pass, a: false }, layouts(b_codes));
        let weight = amax.as_ref().and_then(|group| group.weight_codes());
        let qb_codes = match weight {
            Some(slot) if !matches!(recipe, Recipe::Fp8Delayed { .. }) => {
                let fits = |kept: &KeptWeight| {
                    kept.quantizer == qb && kept.layouts == layouts(b_codes) && same_tensor(&kept.weight, &b)
                };
                let make = || KeptWeight {
                    weight: b.clone(),
                    quantizer: qb,
                    layouts: layouts(b_codes),
                    codes: quantize_b(),
                };
                slot.reuse_or(fits, make).codes
            }
            _ => quantize_b(),
        };
        let kept = |codes: &Quantized, values: Option<Kept>| match &codes.transposed {
            Some(transposed) => Some(Kept::Codes(transposed.clone())),
            None => values,
        };
        let kept = [kept(&qa_codes, a_values), kept(&qb_codes, b_values)];
        let out = gemm_in(
            Pass::Forward,
            recipe,
            asked(qa_codes.direct),
            asked(qb_codes.direct),
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
        // `grad` is dgrad's `a`, `gradᵀ` wgrad's: one quantization writes both where both read
        // codes of one quantizer.
        let codes = |kept: &Option<Kept>| matches!(kept, Some(Kept::Codes(..)));
        let shared = (codes(&a) && codes(&b) && dgrad_a == wgrad_a)
            .then(|| quantize(grad.clone(), dgrad_a, &amax, dgrad_operand, BOTH));
        let da = b.map(|b| match b {
            Kept::Values(b) => dgrad_of::<Cube>(grad.clone(), b, recipe, amax.clone()),
            Kept::Codes(b) => {
                let g = match &shared {
                    Some(shared) => asked(shared.direct.clone()),
                    None => asked(quantize(grad.clone(), dgrad_a, &amax, dgrad_operand, DIRECT).direct),
                };
                gemm_in(Pass::Dgrad, recipe, g, b, (dgrad_a.format, dgrad_b.format), dtype)
            }
        });
        let db = a.map(|a| match a {
            Kept::Values(a) => wgrad_of::<Cube>(grad.clone(), a, recipe, amax.clone()),
            Kept::Codes(a) => {
                let g = match shared {
                    Some(shared) => asked(shared.transposed),
                    None => asked(quantize(grad.clone(), wgrad_a, &amax, wgrad_operand, TRANSPOSED).transposed),
                };
                // `dbᵀ = aᵀ · grad`, `[k, m] · [m, n]`: the product in a weight's own layout
                // (`b` is `wᵀ`), handed back as the `[n, k]` view, so the transpose taking it
                // to the weight costs no copy (ncu: 53 µs a layer for llama-1b's).
                let transposed = gemm_in(Pass::Wgrad, recipe, a, g, (wgrad_b.format, wgrad_a.format), dtype);
                Cube::float_transpose(transposed)
            }
        });
        [da, db]
    }
}
