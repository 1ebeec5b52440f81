//! The product of a low-precision linear layer, as a backend extension, [`QuantOps`], with its
//! own backward. The primitive is `a · bᵀ` of `a` `[m, k]` and `b` `[n, k]` (both K-major, as FP8
//! `wgmma` reads them), each operand quantized as the [`Recipe`] says for the [`Pass`]; f32
//! accumulation; the result in `a`'s dtype. Its gradients are products of the same kind:
//!
//! ```text
//! forward  y  = x · w   = product(x, wᵀ)        Pass::Forward
//! dgrad    dx = dy · wᵀ = product(dy, w)         Pass::Dgrad
//! wgrad    dw = xᵀ · dy = product(xᵀ, dyᵀ)ᵀ      Pass::Wgrad
//! ```
//!
//! On CUDA, FP8 tensorwise (either gradient format, current or delayed scaling) runs on FP8 codes
//! ([`super::fp8`]): each tensor quantized once for the products it enters, the forward keeping
//! the codes its gradients read ([`QuantGrads`]), and so does FP8 blockwise. Every other recipe,
//! and every recipe elsewhere, is emulated: each operand quantized and dequantized
//! ([`quantized_operands`]: in tensor ops, [`super::fake`]; MX and NVFP4 blocks on CUDA by one
//! kernel with the same values, `quant_emulated`), the values multiplied in f32 ([`emulate`], the CPU path) or, bf16 on CUDA,
//! in bf16 on our GEMM (the dequantized values of MX and NVFP4 blocks are exact in bf16; those of
//! f32 block scales round to bf16's 8 bits, far inside the format's own step).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::{DType, Tensor};

use super::fake::{draws, fake_quantize, hadamard};
use super::recipe::{Pass, Quantizer, Recipe, Rounding};
use crate::quant::notes::AmaxNotes;

/// Which operand of which product a tensor-level amax belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Operand {
    pub pass: Pass,
    /// `a` (true) or `b` of `a · bᵀ`.
    pub a: bool,
}

/// The tensors of a linear layer whose amaxes its products take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerTensor {
    Input,
    Weight,
    /// The gradient of the layer's output.
    OutputGrad,
}

impl Operand {
    /// The layer's tensor this operand is (the module docs' table: forward `x`, `wᵀ`; dgrad
    /// `dy`, `w`; wgrad `dyᵀ`, `xᵀ`).
    pub fn tensor(self) -> LayerTensor {
        match (self.pass, self.a) {
            (Pass::Forward, true) | (Pass::Wgrad, false) => LayerTensor::Input,
            (Pass::Forward, false) | (Pass::Dgrad, false) => LayerTensor::Weight,
            (Pass::Dgrad, true) | (Pass::Wgrad, true) => LayerTensor::OutputGrad,
        }
    }
}

/// What an operand's tensor-level amax becomes before its scale is taken: under tensor
/// parallelism the maximum over the group holding pieces of the same tensors, so each rank
/// scales its piece as one device holding the whole tensor would (Megatron's amax reduction over
/// tp; a rank holding the whole tensor takes the maximum of equal values); under delayed scaling
/// the amax of the history the layer keeps, this one recorded for later steps.
pub trait AmaxGroup: Send + Sync + std::fmt::Debug {
    /// The amax `operand` scales by, from this call's own (`[1]`, f32).
    fn max(&self, amax: Tensor<1>, operand: Operand) -> ScaleAmax;

    /// Where this product's forward input is quantized once for the other products of the
    /// layer call that read it too ([`SharedInput`]); none: the product quantizes its own.
    fn shared_input(&self) -> Option<&SharedInput> {
        None
    }

    /// Where this product's weight (the forward's `b`) stays quantized for later calls on the
    /// same weight ([`WeightCodes`]); none: each call quantizes it.
    fn weight_codes(&self) -> Option<&WeightCodes> {
        None
    }

    /// Where the kernels that wrote this product's operands noted their amaxes, and the
    /// optimizer its weight's ([`AmaxNotes`]): a tensorwise cast takes one there before it runs
    /// an amax pass of its own. None: every cast takes its own.
    fn notes(&self) -> Option<&AmaxNotes> {
        None
    }

    /// This product reused the [`SharedInput`]'s quantization instead of quantizing its input:
    /// `current` is the amax (`[1]`, f32, reduced over the group) the quantizing product scaled
    /// it from, for a group that records what its products see (delayed scaling's histories).
    fn reused_input(&self, _current: Tensor<1>, _operand: Operand) {}
}

/// One quantization kept for the products that read the same tensor again. A backend keeps
/// what its products need in its own type; one that keeps nothing here (the CPU's emulation)
/// quantizes each time, to the same values.
#[derive(Debug, Default)]
pub struct CodesSlot(std::sync::Mutex<Option<Box<dyn std::any::Any + Send + Sync>>>);

/// The input several products of one layer call read (q, k and v's; the gate's and the up
/// projection's), quantized by the first of them and reused by the others: one amax and one cast
/// where each product would run its own, and one copy of the codes kept for the gradients.
/// Every product handed the same `SharedInput` must read the same tensor and scale it alike:
/// per-tensor current scaling with amaxes reduced over the same group, or delayed scaling by
/// histories whose input rows are equal (each layer records the same amax of the same input:
/// the products that reuse the codes record the quantizing product's, [`AmaxGroup::reused_input`]).
pub type SharedInput = CodesSlot;

/// A layer's weight as its forward product last quantized it, reused by the calls that read
/// the same weight tensor: the microbatches of one step (gradient accumulation) quantize each
/// weight once, and the optimizer's step, which makes a new tensor, starts afresh. The slot
/// holds the weight it quantized, so that memory cannot become another tensor's while it is
/// kept. Current scaling (the amax reduced over tp once, by the first call) and blocks; delayed
/// scaling records every call's amax in the layer's history, so it quantizes each call.
pub type WeightCodes = CodesSlot;

impl CodesSlot {
    /// Whether a product has kept its quantization here.
    pub fn holds(&self) -> bool {
        self.0.lock().expect("a codes slot's lock").is_some()
    }

    /// The quantization kept here if it is a `T` that `fits`, else `make()`'s, then kept.
    pub fn reuse_or<T: Clone + Send + Sync + 'static>(&self, fits: impl Fn(&T) -> bool, make: impl FnOnce() -> T) -> T {
        let mut slot = self.0.lock().expect("a codes slot's lock");
        if let Some(kept) = slot.as_ref().and_then(|k| k.downcast_ref::<T>()).filter(|k| fits(k)) {
            return kept.clone();
        }
        let made = make();
        *slot = Some(Box::new(made.clone()));
        made
    }
}

/// The amax an operand scales by: `kept` (a delayed-scaling history's) where it is above zero,
/// else `current` (this call's own, reduced over the group). The CUDA casts choose between the
/// two in the kernel; elsewhere [`resolve`](Self::resolve) does, in tensor ops.
#[derive(Clone, Debug)]
pub struct ScaleAmax {
    /// `[1]`, f32.
    pub current: Tensor<1>,
    /// `[1]`, f32; 0 for an empty history.
    pub kept: Option<Tensor<1>>,
}

impl ScaleAmax {
    /// This call's own amax.
    pub fn current(amax: Tensor<1>) -> Self {
        Self {
            current: amax,
            kept: None,
        }
    }

    /// The chosen amax as one tensor (`[1]`).
    pub fn resolve(self) -> Tensor<1> {
        match self.kept {
            None => self.current,
            Some(kept) => {
                let kept = kept.cast(self.current.dtype());
                let empty = kept.clone().lower_equal_elem(0.0);
                kept.mask_where(empty, self.current)
            }
        }
    }
}

/// Where a product's tensor-level amaxes are reduced: `None` on one device.
pub type Amax = Option<std::sync::Arc<dyn AmaxGroup>>;

/// Notes alone as a product's amax group: each tensor-level amax the call's own (one device
/// holds the whole tensor), a noted one taken before an amax pass of its own.
impl AmaxGroup for AmaxNotes {
    fn max(&self, amax: Tensor<1>, _operand: Operand) -> ScaleAmax {
        ScaleAmax::current(amax)
    }

    fn notes(&self) -> Option<&AmaxNotes> {
        Some(self)
    }
}

extension! {
    /// The backend extension behind [`product`].
    pub trait QuantOps, cuda: on_cuda;

    /// `q(a) · q(b)ᵀ` with `recipe`'s quantizers for `pass`, tensor-level amaxes reduced over
    /// `amax`: `[m, k]`, `[n, k]` → `[m, n]` in `a`'s dtype.
    fn quantized_product(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        recipe: Recipe,
        pass: Pass,
        amax: Amax,
    ) -> FloatTensor<Self> {
        let t = |x| Tensor::<2>::from_primitive::<Flex>(x);
        emulate(t(a), t(b), recipe, pass, &amax)
            .try_into_primitive::<Flex>()
            .expect("a CPU tensor")
    }
}

/// CUDA's product: on FP8 codes ([`crate::quant::kernels::fp8`]).
#[cfg(feature = "cuda")]
use crate::quant::kernels::fp8 as on_cuda;

/// The plain backends' side of the product's backward ([`QuantOps`] on `Autodiff`): what the
/// forward keeps of each operand, and the gradients from what it kept. Keeping the operand in
/// its own dtype, to be quantized again by the gradient's product, is always right
/// ([`dgrad_of`], [`wgrad_of`]); CUDA's FP8 tensorwise path keeps FP8 codes instead, quantized
/// once in the forward (half the bytes kept, one amax and one cast a tensor, not two).
pub trait QuantGrads: QuantOps {
    /// What the forward keeps of one operand for the other's gradient.
    type Kept: Clone + Send + std::fmt::Debug + 'static;

    /// The forward product `q(a) · q(b)ᵀ`, and what it keeps of `a` (for b's gradient) and of
    /// `b` (for a's), where `keep` asks.
    fn forward_keeping(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        recipe: Recipe,
        amax: Amax,
        keep: [bool; 2],
    ) -> (FloatTensor<Self>, [Option<Self::Kept>; 2]);

    /// The gradients of `a` and `b` from the output's, `grad` `[m, n]`: a's from what was kept
    /// of `b`, b's from what was kept of `a` (none where nothing was kept).
    fn gradients(
        grad: FloatTensor<Self>,
        kept: [Option<Self::Kept>; 2],
        recipe: Recipe,
        amax: Amax,
    ) -> [Option<FloatTensor<Self>>; 2];
}

/// `d a = d out · b`: `[m, n] · [n, k]`, as `product(d out, bᵀ)` (the dgrad quantizers).
pub fn dgrad_of<B: QuantOps>(grad: FloatTensor<B>, b: FloatTensor<B>, recipe: Recipe, amax: Amax) -> FloatTensor<B> {
    B::quantized_product(grad, B::float_transpose(b), recipe, Pass::Dgrad, amax)
}

/// `d b = d outᵀ · a`: `[n, m] · [m, k]`, as `product(d outᵀ, aᵀ)` (the wgrad quantizers).
pub fn wgrad_of<B: QuantOps>(grad: FloatTensor<B>, a: FloatTensor<B>, recipe: Recipe, amax: Amax) -> FloatTensor<B> {
    B::quantized_product(
        B::float_transpose(grad),
        B::float_transpose(a),
        recipe,
        Pass::Wgrad,
        amax,
    )
}

/// The emulation's operands on any device: both Hadamard-transformed if the recipe says so,
/// quantized and dequantized ([`quantized_operand`]).
pub fn quantized_operands(
    a: Tensor<2>,
    b: Tensor<2>,
    recipe: Recipe,
    pass: Pass,
    amax: &Amax,
) -> (Tensor<2>, Tensor<2>) {
    let (qa, qb) = recipe.operands(pass);
    let operand = |a| Operand { pass, a };
    (
        quantized_operand(a, qa, amax, operand(true)),
        quantized_operand(b, qb, amax, operand(false)),
    )
}

/// `q(a) · q(b)ᵀ` emulated, multiplied in f32 and cast to `a`'s dtype: the CPU path.
pub fn emulate(a: Tensor<2>, b: Tensor<2>, recipe: Recipe, pass: Pass, amax: &Amax) -> Tensor<2> {
    let dtype = a.dtype();
    let (a, b) = quantized_operands(a, b, recipe, pass, amax);
    crate::gemm::f32_matmul::matmul(a, b.transpose()).cast(dtype)
}

/// `x` (`operand`) Hadamard-transformed where `q` says so, quantized with `q` and dequantized:
/// f32 in tensor ops, or in `x`'s dtype and layout where a CUDA kernel does it all (MX and
/// NVFP4 blocks: `quant_emulated`, the same values). Stochastic rounding draws from a seed
/// hashed from `x`'s shape and a few of its values (before the transform), exact on every
/// device, so a run repeats and the CPU and CUDA emulations draw alike.
pub fn quantized_operand(x: Tensor<2>, q: Quantizer, amax: &Amax, operand: Operand) -> Tensor<2> {
    #[cfg(feature = "cuda")]
    if let Some(out) = quantize_on_cuda(&x, q, amax, operand) {
        return out;
    }
    let seed = (q.rounding == Rounding::Stochastic).then(|| seed(&x));
    let x = match q.hadamard {
        true => hadamard(x),
        false => x,
    };
    let draws = seed.map(|seed| draws(x.dims(), seed, &x.device()));
    let reduce = amax
        .as_ref()
        .map(|group| move |t: Tensor<1>| group.max(t, operand).resolve());
    fake_quantize(
        x,
        q,
        draws,
        reduce.as_ref().map(|f| f as &dyn Fn(Tensor<1>) -> Tensor<1>),
    )
}

/// [`quantized_operand`] by one kernel where `x` is on CUDA and the kernel takes `q` and `x`.
#[cfg(feature = "cuda")]
fn quantize_on_cuda(x: &Tensor<2>, q: Quantizer, amax: &Amax, operand: Operand) -> Option<Tensor<2>> {
    use burn::backend::Cube;
    let cube = x.clone().try_into_primitive::<Cube>().ok()?;
    let reduce = |t| match amax {
        Some(group) => group
            .max(Tensor::<1>::from_primitive::<Cube>(t), operand)
            .resolve()
            .try_into_primitive::<Cube>()
            .expect("the amax on the operand's device"),
        None => t,
    };
    crate::quant::kernels::emulated::fake_quantize(cube, q, reduce).map(Tensor::<2>::from_primitive::<Cube>)
}

/// A seed from `x`'s shape and the bits of four of its values (first, two inner, last).
fn seed(x: &Tensor<2>) -> u64 {
    let [r, c] = x.dims();
    let at = [(0, 0), (r / 2, c / 3), (r / 3, c / 2), (r - 1, c - 1)];
    let picked = Tensor::cat(
        at.iter()
            .map(|&(i, j)| x.clone().cast(DType::F32).slice([i..i + 1, j..j + 1]).reshape([1]))
            .collect(),
        0,
    );
    let values: Vec<f32> = picked.into_data().try_to_vec().expect("f32 values");
    values.iter().fold(((r as u64) << 32) ^ c as u64, |h, v| {
        h.rotate_left(17) ^ v.to_bits() as u64
    })
}

impl QuantGrads for Flex {
    type Kept = FloatTensor<Flex>;

    fn forward_keeping(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        recipe: Recipe,
        amax: Amax,
        keep: [bool; 2],
    ) -> (FloatTensor<Self>, [Option<Self::Kept>; 2]) {
        let kept = [keep[0].then(|| a.clone()), keep[1].then(|| b.clone())];
        (Self::quantized_product(a, b, recipe, Pass::Forward, amax), kept)
    }

    fn gradients(
        grad: FloatTensor<Self>,
        [a, b]: [Option<Self::Kept>; 2],
        recipe: Recipe,
        amax: Amax,
    ) -> [Option<FloatTensor<Self>>; 2] {
        [
            b.map(|b| dgrad_of::<Self>(grad.clone(), b, recipe, amax.clone())),
            a.map(|a| wgrad_of::<Self>(grad, a, recipe, amax)),
        ]
    }
}

#[derive(Debug)]
struct QuantBackward;

impl<B: QuantGrads> Backward<B, 2> for QuantBackward {
    type State = ([Option<B::Kept>; 2], Recipe, Amax);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (kept, recipe, amax) = ops.state;
        let [a_parent, b_parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let [da, db] = B::gradients(grad, kept, recipe, amax);
        for (parent, grad) in [(a_parent, da), (b_parent, db)] {
            if let (Some(parent), Some(grad)) = (parent, grad) {
                grads.register::<B>(parent.id, grad);
            }
        }
    }
}

impl<B: QuantGrads, C: CheckpointStrategy> QuantOps for Autodiff<B, C> {
    fn quantized_product(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        recipe: Recipe,
        pass: Pass,
        amax: Amax,
    ) -> FloatTensor<Self> {
        let (a_tracked, b_tracked) = (a.is_tracked(), b.is_tracked());
        match QuantBackward
            .prepare::<C>([a.node(), b.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                // What is kept of each operand serves the other's gradient.
                let (out, kept) = B::forward_keeping(
                    a.into_parts().0,
                    b.into_parts().0,
                    recipe,
                    amax.clone(),
                    [b_tracked, a_tracked],
                );
                prep.finish((kept, recipe, amax), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::quantized_product(
                a.into_parts().0,
                b.into_parts().0,
                recipe,
                pass,
                amax,
            )),
        }
    }
}

/// `q(a) · q(b)ᵀ` through [`QuantOps`] with `recipe`'s forward quantizers, differentiable (the
/// gradients with its dgrad and wgrad quantizers); tensor-level amaxes, forward and backward,
/// reduced over `amax`.
///
/// # Shapes
/// `[m, k]`, `[n, k]` → `[m, n]`
pub fn product(a: Tensor<2>, b: Tensor<2>, recipe: Recipe, amax: Amax) -> Tensor<2> {
    Tensor::from_dispatch(<burn::backend::Dispatch as QuantOps>::quantized_product(
        a.into_dispatch(),
        b.into_dispatch(),
        recipe,
        Pass::Forward,
        amax,
    ))
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Distribution, Tensor};

    use super::*;

    /// ‖a − b‖ / ‖b‖.
    fn relative(a: Tensor<2>, b: Tensor<2>) -> f32 {
        let norm = |t: Tensor<2>| t.square().sum().sqrt().into_scalar::<f32>();
        norm(a - b.clone()) / norm(b)
    }

    /// The worst relative error of one operand's rounding, half a step of its format at a
    /// normal value: 2⁻⁴ (E4M3), 2⁻³ (E5M2), 2⁻² (E2M1, whose step at 1 is ½), plus NVFP4's
    /// E4M3 block scale (2⁻⁴). A product's relative error in norm is at most the sum of its
    /// operands' to first order (sums of errors do not grow relative to the result's norm).
    fn bound(recipe: Recipe, pass: Pass) -> f32 {
        let one = |q: Quantizer| match (q.format, q.blocks) {
            (super::super::format::Minifloat::E2M1, _) => 0.25 + 0.0625,
            (super::super::format::Minifloat::E5M2, _) => 0.125,
            _ => 0.0625,
        };
        let (a, b) = recipe.operands(pass);
        one(a) + one(b)
    }

    /// On the CPU, every recipe's product and both gradients against the f32 product, within
    /// [`bound`], and not exact (above 1e-3: the operands were quantized).
    #[test]
    fn product_and_gradients_within_the_formats_bounds() {
        let device = Device::flex().autodiff();
        let normal = Distribution::Normal(0.0, 1.0);
        for recipe in Recipe::ALL {
            let x = Tensor::<2>::random([48, 160], normal, &device).require_grad();
            let w = Tensor::<2>::random([160, 40], normal, &device).require_grad();
            let dy = Tensor::<2>::random([48, 40], normal, &device);
            let ours = product(x.clone(), w.clone().transpose(), recipe, None);
            let exact = x.clone().matmul(w.clone());
            let forward = relative(ours.clone().detach(), exact.clone().detach());
            let (g1, g2) = ((ours * dy.clone()).sum().backward(), (exact * dy).sum().backward());
            let dx = relative(x.grad(&g1).unwrap(), x.grad(&g2).unwrap());
            let dw = relative(w.grad(&g1).unwrap(), w.grad(&g2).unwrap());
            for (what, error, pass) in [
                ("forward", forward, Pass::Forward),
                ("dx", dx, Pass::Dgrad),
                ("dw", dw, Pass::Wgrad),
            ] {
                let bound = bound(recipe, pass);
                assert!(
                    error < bound && error > 1e-3,
                    "{recipe:?} {what}: relative error {error}, bound {bound}"
                );
            }
        }
    }

    /// The forward product of every recipe is the f32 product of the operands as the scalar
    /// reference quantizes them (to f32 summation order), on a ragged shape.
    #[test]
    fn forward_is_the_product_of_the_reference_quantizations() {
        use crate::quant::scaling::{Scaling, amax, quantize, quantize_scale};
        let device = Device::flex();
        let normal = Distribution::Normal(0.0, 3.0);
        let (a, b) = (
            Tensor::<2>::random([20, 200], normal, &device),
            Tensor::<2>::random([30, 200], normal, &device),
        );
        let host = |t: &Tensor<2>| -> Vec<f32> { t.clone().into_data().try_to_vec().unwrap() };
        let reference = |t: &Tensor<2>, q: Quantizer| {
            let values = host(t);
            let scaling = match q.blocks {
                super::super::recipe::Blocks::Tensor => Scaling::Tensor {
                    quantize_scale: quantize_scale(q.format, amax(&values), 0),
                },
                super::super::recipe::Blocks::Tiles => Scaling::Blocks { rows: 1, cols: 128 },
                super::super::recipe::Blocks::Squares => Scaling::Blocks { rows: 128, cols: 128 },
                super::super::recipe::Blocks::Mx => Scaling::Mx,
                super::super::recipe::Blocks::Nv { rows } => Scaling::Nv { rows },
            };
            let q = quantize(&values, t.dims(), q.format, scaling, None);
            Tensor::<2>::from_data(burn::tensor::TensorData::new(q.dequantize(), t.dims()), &device)
        };
        for recipe in Recipe::ALL {
            let (qa, qb) = recipe.operands(Pass::Forward);
            let expected = reference(&a, qa).matmul(reference(&b, qb).transpose());
            let ours = product(a.clone(), b.clone(), recipe, None);
            // Sums of 200 products of values up to ~10: f32 reordering, a few ulps of ~100.
            ours.to_data()
                .assert_approx_eq::<f32>(&expected.to_data(), burn::tensor::Tolerance::absolute(1e-3));
        }
    }
}
