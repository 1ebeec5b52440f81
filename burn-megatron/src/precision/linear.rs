//! How one linear layer multiplies, [`LinearPrecision`]: the GEMM a precision policy set, what
//! its input goes through first (post-training quantization), delayed scaling's amax history
//! with this step's record, and where a quantized product keeps its weight's codes across a
//! step's microbatches. The column- and row-parallel layers each hold one, and run their
//! product of a weight sharded over tp through it ([`LinearPrecision::product`]): a quantized
//! product's tensor-level amaxes reduced over tp (Megatron's amax reduction), or scaled by the
//! layer's history under delayed scaling.

use std::sync::Arc;

use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor};
use burn_megatron_dist::{CommError, ProcessGroup, ProcessGroups, ReduceOp};
use burn_megatron_kernels::quant::history;
use burn_megatron_kernels::quant::notes::AmaxNotes;
use burn_megatron_kernels::quant::product::{Amax, AmaxGroup, Operand, ScaleAmax, SharedInput, WeightCodes};
use burn_megatron_kernels::{Gemm, linear_over};

use super::amax::TensorParallelAmax;
use super::delayed::{self, AmaxRecorder, DelayedAmax, DelayedState};
use super::ptq::InputQuantizer;
use crate::error::LayerError;

/// How one linear layer multiplies: see the module docs.
#[derive(Module, Debug)]
pub struct LinearPrecision {
    /// The matrix product, forward and backward.
    #[module(skip)]
    pub gemm: Gemm,
    /// What the input goes through before the product (post-training quantization); nothing
    /// by default.
    #[module(skip)]
    pub input_quantizer: InputQuantizer,
    /// Delayed FP8 scaling's amax history (`[3, history]`, not trained), with
    /// `Gemm::Quantized(Recipe::Fp8Delayed)` (`precision::delayed`).
    pub amax_history: Option<Param<Tensor<2>>>,
    /// This step's amaxes, for the history.
    #[module(skip)]
    pub amax_recorder: AmaxRecorder,
    /// Where a quantized product keeps its weight's codes for the step's later microbatches
    /// (set by [`keep_weight_codes`](crate::models::llama::sites::keep_weight_codes)); none by
    /// default.
    #[module(skip)]
    pub weight_codes: Option<Arc<WeightCodes>>,
    /// Where the kernels that write its input and output gradient note their amaxes, and the
    /// optimizer its weight's, for its FP8 tensorwise casts: the notes its model shares.
    #[module(skip)]
    pub notes: AmaxNotes,
}

impl LinearPrecision {
    /// Multiplying with `gemm`, nothing else: no input quantizer, no history, no kept codes (a
    /// product computed with another layer's weight, as a tied output layer's).
    pub fn plain(gemm: Gemm) -> Self {
        Self {
            gemm,
            input_quantizer: InputQuantizer::None,
            amax_history: None,
            amax_recorder: AmaxRecorder::default(),
            weight_codes: None,
            notes: AmaxNotes::default(),
        }
    }

    /// Multiplying with `gemm` (with delayed scaling, a zeroed history of its own on `device`,
    /// or the one this precision held if it has the right length).
    pub fn with_gemm(self, gemm: Gemm, device: &Device) -> Self {
        let amax_history = delayed::history_of(gemm, device, self.amax_history);
        Self {
            gemm,
            amax_history,
            ..self
        }
    }

    /// The GEMM, where the product is exactly `x · weight`: no input quantizer and no quantized
    /// recipe (which quantizes its operands first). Another op may then compute it, fused with
    /// what comes before or after.
    pub fn plain_gemm(&self) -> Option<Gemm> {
        let plain = matches!(self.input_quantizer, InputQuantizer::None) && !matches!(self.gemm, Gemm::Quantized(_));
        plain.then_some(self.gemm)
    }

    /// Whether the input reaches the product as it came (no quantizer, or one that only
    /// observes it), so a quantization of it shared with other layers is this layer's too.
    pub fn keeps_input(&self) -> bool {
        matches!(self.input_quantizer, InputQuantizer::None | InputQuantizer::Observe(_))
    }

    /// `x · weight + bias` for a weight sharded over `tp`: `x` through the input quantizer
    /// first (`input_sharded`: `x` holds this rank's input features only), then the product,
    /// its quantization of `x` shared with the other layers given the same `shared` in one call
    /// where [`Self::keeps_input`].
    ///
    /// # Shapes
    /// `[.., k]`, `[k, n]`, `[n]` → `[.., n]`
    pub fn product<const D: usize>(
        &self,
        x: Tensor<D>,
        weight: Tensor<2>,
        bias: Option<Tensor<1>>,
        input_sharded: bool,
        shared: Option<&Arc<SharedInput>>,
        tp: &ProcessGroup,
    ) -> Result<Tensor<D>, LayerError> {
        let x = self.input_quantizer.apply(x, tp, input_sharded)?;
        let delayed = delayed::state_of(self.gemm, &self.amax_history, &self.amax_recorder, &weight);
        let reuse = Reuse {
            input: shared.filter(|_| self.keeps_input()).cloned(),
            weight: self.weight_codes.clone(),
            notes: self.notes.clone(),
        };
        Ok(sharded_linear(x, weight, bias, self.gemm, delayed, reuse, tp)?)
    }
}

/// Pushes each delayed-scaling layer's recorded amaxes onto its history (the maximum over
/// `groups.grad_sync()`, so every rank's history is the same), for `layers` (a model's linear
/// layers, or a pipeline stage's). Every rank calls it after each optimizer step, in the same
/// order; layers without a history are passed over. The step's amaxes of every layer are
/// reduced in one collective, as Transformer Engine reduces its one buffer of them.
pub fn advance_histories<'a>(
    layers: impl IntoIterator<Item = &'a mut LinearPrecision>,
    groups: &ProcessGroups,
) -> Result<(), CommError> {
    let mut layers: Vec<&mut LinearPrecision> = layers.into_iter().filter(|l| l.amax_history.is_some()).collect();
    // This step's amaxes, three a delayed layer, in the layers' order.
    let mut rows = Vec::new();
    for layer in &layers {
        let device = layer.amax_history.as_ref().expect("a history").val().device();
        rows.extend(layer.amax_recorder.take(&device));
    }
    let sync = groups.grad_sync();
    if sync.size() > 1 && !rows.is_empty() {
        let reduced = sync.all_reduce(Tensor::cat(rows.clone(), 0), ReduceOp::Max)?;
        rows = (0..rows.len()).map(|i| reduced.clone().narrow(0, i, 1)).collect();
    }
    let mut rows = rows.into_iter();
    for layer in layers.iter_mut() {
        let history = layer.amax_history.as_mut().expect("a history");
        let step = [(); 3].map(|_| rows.next().expect("three amaxes a delayed layer"));
        let old = history.val();
        let autodiff = old.is_autodiff();
        let new = history::push(old.without_autodiff(), step);
        let new = if autodiff { new.autodiff() } else { new };
        *history = history.clone().map(|_| new);
    }
    Ok(())
}

/// What a quantized product reuses of earlier work: its input's quantization, shared with the
/// layer call's other products of the same input ([`SharedInput`]), its weight's, kept across
/// the calls that read the same weight ([`WeightCodes`]: the microbatches of a step), and the
/// amaxes noted where its operands were written ([`AmaxNotes`]).
#[derive(Clone, Debug, Default)]
struct Reuse {
    input: Option<Arc<SharedInput>>,
    weight: Option<Arc<WeightCodes>>,
    notes: AmaxNotes,
}

/// A product's amax group with what it reuses ([`Reuse`]): the amaxes reduced over tp (none at
/// tp = 1) as [`TensorParallelAmax`] does.
#[derive(Debug)]
struct Sharing {
    tp: Option<Arc<TensorParallelAmax>>,
    reuse: Reuse,
}

impl AmaxGroup for Sharing {
    fn max(&self, amax: Tensor<1>, operand: Operand) -> ScaleAmax {
        match &self.tp {
            Some(tp) => tp.max(amax, operand),
            None => ScaleAmax::current(amax),
        }
    }

    fn shared_input(&self) -> Option<&SharedInput> {
        self.reuse.input.as_deref()
    }

    fn weight_codes(&self) -> Option<&WeightCodes> {
        self.reuse.weight.as_deref()
    }

    fn notes(&self) -> Option<&AmaxNotes> {
        Some(&self.reuse.notes)
    }
}

/// `x · weight + bias` of a layer whose weight is sharded over `tp`, a quantized product's
/// tensor-level amaxes reduced over tp (forward here, backward when the gradients run); under
/// delayed scaling each scaled by the layer's history instead (`delayed`). It reuses what
/// `reuse` holds: its quantization of `x` shared with the other products given it, its weight's
/// kept for later calls on the same weight (current scaling and blocks only: under delayed
/// scaling each call scales by the layer's history and records its amaxes).
fn sharded_linear<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    gemm: Gemm,
    delayed: Option<DelayedState>,
    reuse: Reuse,
    tp: &ProcessGroup,
) -> Result<Tensor<D>, burn_megatron_dist::CommError> {
    let amax = match gemm {
        Gemm::Quantized(_) => TensorParallelAmax::over(tp),
        _ => None,
    };
    let group: Amax = match (gemm, delayed) {
        (Gemm::Quantized(_), Some(state)) => Some(Arc::new(DelayedAmax {
            state,
            tp: amax.clone(),
            input: reuse.input.clone(),
            notes: reuse.notes.clone(),
        })),
        (Gemm::Quantized(_), None) => Some(Arc::new(Sharing {
            tp: amax.clone(),
            reuse,
        })),
        _ => None,
    };
    let y = linear_over(x, weight, bias, gemm, group);
    match amax {
        Some(amax) => amax.finish_forward().map(|()| y),
        None => Ok(y),
    }
}
