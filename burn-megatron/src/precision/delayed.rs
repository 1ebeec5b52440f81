//! FP8 delayed scaling ([`Recipe::Fp8Delayed`], Transformer Engine's `DelayedScaling`): each
//! linear layer keeps the amax history of its input, its weight and its output's gradient, a
//! non-trainable parameter `[3, history]` (newest first) saved in checkpoints; its products scale
//! each tensor by the history's amax (the largest, or the newest) and record this step's own
//! amax; after the optimizer step [`advance`] pushes the step's amaxes onto every history, each
//! the maximum over the ranks of dp × cp (and already over tp), so every rank scales alike.
//!
//! A history with nothing in it yet (the first step) scales by the tensor's own amax, as current
//! scaling does; Transformer Engine starts from a scale of 1 instead.
//!
//! Legend: rows of a history are [`LayerTensor`]s in the order input, weight, output gradient.

use std::sync::{Arc, Mutex};

use burn::module::Param;
use burn::tensor::{DType, Device, Tensor};
use burn_megatron_kernels::Gemm;
use burn_megatron_kernels::quant::history;
use burn_megatron_kernels::quant::notes::AmaxNotes;
use burn_megatron_kernels::quant::product::{AmaxGroup, LayerTensor, Operand, ScaleAmax, SharedInput};
use burn_megatron_kernels::quant::recipe::{AmaxAlgo, Recipe};

use super::amax::TensorParallelAmax;

/// The history rows, by the tensor each holds.
fn row(tensor: LayerTensor) -> usize {
    match tensor {
        LayerTensor::Input => 0,
        LayerTensor::Weight => 1,
        LayerTensor::OutputGrad => 2,
    }
}

/// This step's amaxes of one layer, recorded by its products (the largest of several calls: the
/// weight's in forward and dgrad, the input's in forward and wgrad, microbatches).
#[derive(Clone, Debug, Default)]
pub struct AmaxRecorder(Arc<Mutex<[Option<Tensor<1>>; 3]>>);

impl AmaxRecorder {
    fn record(&self, tensor: LayerTensor, amax: Tensor<1>) {
        let mut slots = self.0.lock().expect("not poisoned");
        let slot = &mut slots[row(tensor)];
        *slot = Some(match slot.take() {
            Some(seen) => seen.max_pair(amax.detach()),
            None => amax.detach(),
        });
    }

    /// This step's amaxes by row (`[1]` each, 0 where a tensor was not seen), emptying the
    /// record: plain tensors of the backend the products ran on (beneath autodiff) on `device`.
    pub fn take(&self, device: &Device) -> [Tensor<1>; 3] {
        let slots = std::mem::take(&mut *self.0.lock().expect("not poisoned"));
        slots.map(|s| {
            let zero = || Tensor::zeros([1], (device, DType::F32)).without_autodiff();
            s.map(Tensor::without_autodiff).unwrap_or_else(zero).cast(DType::F32)
        })
    }
}

/// A layer's delayed-scaling state for one call.
#[derive(Clone, Debug)]
pub struct DelayedState {
    /// The amax each tensor scales by, `[3]` (0 where its history is empty): the history's
    /// largest or newest, taken once a call for the three rows.
    pub kept: Tensor<1>,
    /// Where the call's amaxes go: none for a model that does not train (inference, the
    /// Learner's validation), whose forwards must not move the histories.
    pub recorder: Option<AmaxRecorder>,
}

impl DelayedState {
    /// The state of a call scaling by `history` (`[3, len]`, newest first) as `algo` says.
    pub fn new(history: Tensor<2>, algo: AmaxAlgo, recorder: Option<AmaxRecorder>) -> Self {
        // The products run on the backend beneath autodiff: the history as a plain tensor there.
        let kept = history::kept(history.without_autodiff(), algo == AmaxAlgo::MostRecent);
        Self { kept, recorder }
    }
}

/// The amax source of one delayed-scaling layer call: the history's amax for the scale, the
/// call's own (the maximum over tp) recorded.
#[derive(Debug)]
pub struct DelayedAmax {
    pub state: DelayedState,
    /// The reduction over the ranks holding pieces of the layer's tensors (none at tp = 1),
    /// which keeps a forward failure for the layer to return.
    pub tp: Option<Arc<TensorParallelAmax>>,
    /// The input's quantization, shared with the call's other layers that read the same input
    /// (q, k and v; the gate and up projections). Their histories' input rows are equal: each
    /// records the same amax of the same input every call (the layers reusing the codes
    /// record the quantizing layer's), so they scale it alike.
    pub input: Option<Arc<SharedInput>>,
    /// The amaxes noted where the operands were written (each call's own, which it records).
    pub notes: AmaxNotes,
}

impl AmaxGroup for DelayedAmax {
    fn max(&self, amax: Tensor<1>, operand: Operand) -> ScaleAmax {
        let current = match &self.tp {
            Some(tp) => tp.max(amax, operand).current,
            None => amax,
        };
        let tensor = operand.tensor();
        if let Some(recorder) = &self.state.recorder {
            recorder.record(tensor, current.clone());
        }
        // An empty history (the first step) scales by the call's own amax.
        ScaleAmax {
            current,
            kept: Some(self.state.kept.clone().narrow(0, row(tensor), 1)),
        }
    }

    fn shared_input(&self) -> Option<&SharedInput> {
        self.input.as_deref()
    }

    fn notes(&self) -> Option<&AmaxNotes> {
        Some(&self.notes)
    }

    fn reused_input(&self, current: Tensor<1>, operand: Operand) {
        if let Some(recorder) = &self.state.recorder {
            recorder.record(operand.tensor(), current);
        }
    }
}

/// Whether the parameter at `path` is a layer's amax history: training state, which checkpoints
/// of weights (Hugging Face's, GGUF files) neither hold nor overwrite.
pub fn is_history(path: &str) -> bool {
    path.ends_with(".amax_history")
}

/// The history of a layer whose product is `gemm`: `kept` if it is already one of the right
/// length, else a zeroed one (a parameter gradients do not train); none for a product that
/// scales by no history.
pub fn history_of(gemm: Gemm, device: &Device, kept: Option<Param<Tensor<2>>>) -> Option<Param<Tensor<2>>> {
    match gemm {
        Gemm::Quantized(Recipe::Fp8Delayed { history, .. }) => {
            let len = history.max(1);
            Some(kept.filter(|h| h.dims() == [3, len]).unwrap_or_else(|| {
                Param::from_tensor(Tensor::zeros([3, len], (device, DType::F32))).set_require_grad(false)
            }))
        }
        _ => None,
    }
}

/// The delayed-scaling state of a layer multiplying with `gemm`, holding `history`; its calls
/// record into `recorder` when the layer trains (its `weight` on an autodiff device).
pub fn state_of(
    gemm: Gemm,
    history: &Option<Param<Tensor<2>>>,
    recorder: &AmaxRecorder,
    weight: &Tensor<2>,
) -> Option<DelayedState> {
    match (gemm, history) {
        (Gemm::Quantized(Recipe::Fp8Delayed { algo, .. }), Some(history)) => Some(DelayedState::new(
            history.val(),
            algo,
            weight.is_autodiff().then(|| recorder.clone()),
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;

    use super::*;

    fn state(history: Vec<f32>, len: usize, algo: AmaxAlgo) -> DelayedState {
        DelayedState::new(
            Tensor::from_data(TensorData::new(history, [3, len]), &Device::flex()),
            algo,
            Some(AmaxRecorder::default()),
        )
    }

    fn call(amax: &DelayedAmax, value: f32, operand: Operand) -> f32 {
        amax.max(Tensor::from_floats([value], &Device::flex()), operand)
            .resolve()
            .into_scalar::<f32>()
    }

    /// A product scales by the history's amax, not its own (the largest, or the newest), and
    /// records its own; an empty history scales by the call's own; the record keeps each
    /// tensor's largest over calls, the weight's from forward and dgrad alike, and the input's
    /// handed over by a call that reused a shared quantization.
    #[test]
    fn the_history_scales_and_the_call_is_recorded() {
        use burn_megatron_kernels::quant::recipe::Pass;
        let x = Operand {
            pass: Pass::Forward,
            a: true,
        };
        let w = Operand {
            pass: Pass::Forward,
            a: false,
        };
        let w_dgrad = Operand {
            pass: Pass::Dgrad,
            a: false,
        };
        let dy = Operand {
            pass: Pass::Wgrad,
            a: true,
        };
        // Input history 2, 5, 3 (newest first); weight 1, 1, 1; output gradient empty.
        let rows = vec![2.0, 5.0, 3.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0];
        let max = DelayedAmax {
            notes: AmaxNotes::default(),
            state: state(rows.clone(), 3, AmaxAlgo::Max),
            tp: None,
            input: None,
        };
        assert_eq!(call(&max, 9.0, x), 5.0, "the history's largest, not this call's 9");
        assert_eq!(call(&max, 0.5, w), 1.0);
        assert_eq!(call(&max, 4.0, w_dgrad), 1.0);
        assert_eq!(call(&max, 0.25, dy), 0.25, "an empty history: the call's own");
        let recent = DelayedAmax {
            notes: AmaxNotes::default(),
            state: state(rows, 3, AmaxAlgo::MostRecent),
            tp: None,
            input: None,
        };
        assert_eq!(call(&recent, 9.0, x), 2.0, "the newest");
        // A call that reused a shared input's quantization records the amax it was scaled from.
        max.reused_input(Tensor::from_floats([11.0], &Device::flex()), x);
        let take = || -> Vec<f32> {
            let recorder = max.state.recorder.as_ref().expect("a recorder");
            recorder.take(&Device::flex()).map(|t| t.into_scalar::<f32>()).to_vec()
        };
        assert_eq!(take(), vec![11.0, 4.0, 0.25]);
        assert_eq!(take(), vec![0.0, 0.0, 0.0], "taking empties the recorder");
    }

    /// A layer records its calls' amaxes only when it trains: its weight on an autodiff device
    /// (the Learner's validation model, inference, are not).
    #[test]
    fn only_a_training_layer_records() {
        let gemm = Gemm::Quantized(Recipe::Fp8Delayed {
            history: 2,
            algo: AmaxAlgo::Max,
        });
        let device = Device::flex();
        let history = history_of(gemm, &device, None);
        let recorder = AmaxRecorder::default();
        let weight = Tensor::<2>::zeros([2, 2], &device);
        let plain = state_of(gemm, &history, &recorder, &weight).expect("a delayed layer");
        assert!(plain.recorder.is_none(), "inference records nothing");
        let trained = state_of(gemm, &history, &recorder, &weight.autodiff()).expect("a delayed layer");
        assert!(trained.recorder.is_some(), "a training layer records");
    }
}
