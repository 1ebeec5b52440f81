//! RMSNorm that knows about sequence parallelism.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor};
use burn_megatron_dist::{ProcessGroup, ProcessGroups};
use burn_megatron_kernels::quant::notes::{AmaxNotes, NoteAmaxes};
use burn_megatron_kernels::rms_norm::link::NormLink;

use super::residual::Residual;
use burn_megatron_kernels::rms_norm::{rms_norm_linked, rms_norm_noting};

use super::sequence::SequenceLayout;

use crate::error::LayerError;
use crate::init::ParamInit;

/// Configuration of an [`RmsNorm`].
#[derive(Config, Debug)]
pub struct RmsNormConfig {
    pub d_model: usize,
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// The input's layout along the sequence (sequence parallelism: shards).
    #[config(default = "SequenceLayout::Whole")]
    pub sequence: SequenceLayout,
}

/// `y = x / √(mean(x²) + ε) · w`.
///
/// With sequence parallelism each rank normalizes its own tokens, so the weight's gradient on a
/// rank is a partial sum; it is all-reduced over the tensor-parallel group in the backward pass.
#[derive(Module, Debug)]
pub struct RmsNorm {
    /// `[d_model]`, whole on every rank.
    pub weight: Param<Tensor<1>>,
    pub epsilon: f64,
    #[module(skip)]
    pub sequence: SequenceLayout,
    #[module(skip)]
    pub tp: ProcessGroup,
}

impl RmsNormConfig {
    /// A whole weight on every rank; with sequence shards its gradient is summed over `groups.tp`.
    pub fn init(&self, device: &Device, groups: &ProcessGroups, init: &ParamInit) -> RmsNorm {
        RmsNorm {
            weight: Param::from_tensor(init.ones([self.d_model], device)),
            epsilon: self.epsilon,
            sequence: self.sequence,
            tp: groups.tp.clone(),
        }
    }
}

impl RmsNorm {
    /// # Shapes
    /// `[.., d_model]` → `[.., d_model]`
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Result<Tensor<D>, LayerError> {
        self.forward_noting(x, None)
    }

    /// [`forward`](Self::forward); with `note`, the output's amax taken into it as it is written
    /// on CUDA, for the FP8 tensorwise products that read it next
    /// (`ParallelAttention::notes_input`).
    pub fn forward_noting<const D: usize>(
        &self,
        x: Tensor<D>,
        note: Option<AmaxNotes>,
    ) -> Result<Tensor<D>, LayerError> {
        Ok(rms_norm_noting(
            x,
            self.weight()?,
            self.epsilon as f32,
            NoteAmaxes::output(note),
        ))
    }

    /// The norm of the residual stream `x` a pre-norm branch reads, and the stream it adds back
    /// into ([`Residual`]): the backward adds the stream's gradient into `x`'s, and the branch's
    /// readers' into the output's, as its kernel reads and writes them. On CUDA it takes the
    /// amaxes FP8 tensorwise products read next as it writes, into the notes given: the output's
    /// with `note_output` (`ParallelAttention::notes_input`), the input gradient's with
    /// `note_stream_grad` (the stream's, which the previous block's products read).
    ///
    /// # Shapes
    /// `[b, s, d]` → `[b, s, d]`, the stream `[b, s, d]`
    pub fn pre_norm(
        &self,
        x: Tensor<3>,
        note_output: Option<AmaxNotes>,
        note_stream_grad: Option<AmaxNotes>,
    ) -> Result<(Tensor<3>, Residual), LayerError> {
        let link = NormLink::default();
        let notes = NoteAmaxes {
            output: note_output,
            input_grads: note_stream_grad,
        };
        let y = rms_norm_linked(x.clone(), self.weight()?, self.epsilon as f32, notes, &link);
        Ok((y, Residual::new(x, link)))
    }

    /// The weight as this rank's rows see it (sequence parallelism: its gradient summed over tp).
    fn weight(&self) -> Result<Tensor<1>, LayerError> {
        Ok(self.sequence.replicated(self.weight.val(), &self.tp)?)
    }
}

#[cfg(test)]
mod tests {
    use burn::nn::RmsNormConfig as BurnRmsNormConfig;
    use burn::tensor::Device;

    use super::*;

    /// Without sequence parallelism the layer is Burn's RmsNorm.
    #[test]
    fn matches_burn_rms_norm() {
        let dev = Device::flex();
        let ours = RmsNormConfig::new(8).init(
            &dev,
            &ProcessGroups::single(),
            &ParamInit::new(0, crate::init::InitMode::Full),
        );
        let theirs = BurnRmsNormConfig::new(8).with_epsilon(1e-5).init(&dev);
        let x = crate::init::normal([3, 4, 8], 2, 1.0, &dev);
        let (a, b) = (ours.forward(x.clone()).unwrap(), theirs.forward(x));
        let diff = (a - b).abs().max().into_scalar::<f32>();
        // Both compute in f32, in a slightly different order: a few ulps.
        assert!(diff < 1e-6, "{diff}");
    }
}
