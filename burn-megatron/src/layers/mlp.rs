//! The SwiGLU feed-forward block, `w2(silu(w1·x) ⊙ w3·x)`, split over the tensor-parallel
//! group: `w1` and `w3` by columns, `w2` by rows.
//!
//! Legend: `b` batch, `s` sequence, `d` d_model, `f` d_ff.

use std::sync::Arc;

use burn::config::Config;
use burn::module::Module;
use burn::tensor::{Device, Tensor};
use burn_megatron_dist::mappings::{copy_to_tp, gather_from_sp};
use burn_megatron_dist::{ProcessGroup, ProcessGroups};
use burn_megatron_kernels::Gemm;
use burn_megatron_kernels::gated_mlp::{gated_mlp, gated_mlp_onto, swiglu_down};
use burn_megatron_kernels::quant::notes::{AmaxNotes, NoteAmaxes};
use burn_megatron_kernels::quant::recipe::Pass;

use burn_megatron_kernels::swiglu::swiglu_noting;

use super::column::{ColumnInput, ColumnOutput, ColumnParallelLinear, ColumnParallelLinearConfig, SharedInput};
use super::row::{RowInput, RowOutput, RowParallelLinear, RowParallelLinearConfig};
use super::sequence::SequenceLayout;
use crate::error::{LayerError, divisible};
use crate::init::ParamInit;
use crate::layers::residual::{Residual, readers};
use crate::recompute::recompute;

/// Configuration of a [`ParallelMlp`].
#[derive(Config, Debug)]
pub struct ParallelMlpConfig {
    pub d_model: usize,
    pub d_ff: usize,
    /// The input's and output's layout along the sequence (sequence parallelism: shards).
    #[config(default = "SequenceLayout::Whole")]
    pub sequence: SequenceLayout,
    /// The product of the three projections (set by a precision policy).
    #[config(default = "Gemm::Wgmma")]
    pub gemm: Gemm,
    #[config(default = 0.02)]
    pub init_std: f64,
}

/// SwiGLU with its hidden features split over the group.
#[derive(Module, Debug)]
pub struct ParallelMlp {
    /// Gate projection, `[d, f/tp]`.
    pub w1: ColumnParallelLinear,
    /// Down projection, `[f/tp, d]`.
    pub w2: RowParallelLinear,
    /// Up projection, `[d, f/tp]`.
    pub w3: ColumnParallelLinear,
    #[module(skip)]
    pub sequence: SequenceLayout,
    #[module(skip)]
    pub tp: ProcessGroup,
}

impl ParallelMlpConfig {
    /// This rank's hidden features over `groups.tp`; `name` is the layer's path, which seeds it.
    pub fn init(
        &self,
        device: &Device,
        groups: &ProcessGroups,
        init: &ParamInit,
        name: &str,
    ) -> Result<ParallelMlp, LayerError> {
        let tp = &groups.tp;
        divisible("d_ff", self.d_ff, tp.size())?;
        let column = ColumnParallelLinearConfig::new(self.d_model, self.d_ff)
            .with_input(ColumnInput::InRegion)
            .with_output(ColumnOutput::Sharded)
            .with_gemm(self.gemm)
            .with_init_std(self.init_std);
        let output = match self.sequence {
            SequenceLayout::Sharded => RowOutput::SequenceScattered,
            SequenceLayout::Whole => RowOutput::Reduced,
        };
        let w2 = RowParallelLinearConfig::new(self.d_ff, self.d_model)
            .with_input(RowInput::Sharded)
            .with_output(output)
            .with_gemm(self.gemm)
            .with_init_std(self.init_std);
        Ok(ParallelMlp {
            w1: column.init(device, groups, init, &format!("{name}.w1"))?,
            w2: w2.init(device, groups, init, &format!("{name}.w2"))?,
            w3: column.init(device, groups, init, &format!("{name}.w3"))?,
            sequence: self.sequence,
            tp: tp.clone(),
        })
    }
}

impl ParallelMlp {
    /// # Shapes
    /// `[b, s, d]` → `[b, s, d]`; `[b, s/tp, d]` → `[b, s/tp, d]` with sequence parallelism.
    pub fn forward(&self, x: Tensor<3>) -> Result<Tensor<3>, LayerError> {
        let Some(gemm) = self.gated_product() else {
            let (gate, up) = self.project(x, None)?;
            return down(&self.w2, gate, up, self.notes());
        };
        let ([x1, x3], [w1, w3, w2]) = self.gated_operands(x, None)?;
        let partial = gated_mlp(x1, x3, w1, w3, w2, gemm); // [b, s, d], this rank's f/tp
        self.w2.sum_partials(partial)
    }

    /// `stream + self.forward(x)`, `x` the output of the norm that read `stream`
    /// ([`RmsNorm::pre_norm`](super::RmsNorm::pre_norm)): the gate's and up projection's
    /// gradients and the stream's added by that norm's backward; on one rank with the fused MLP,
    /// the stream added in the down projection's kernel (`gated_mlp_onto`).
    ///
    /// # Shapes
    /// [`forward`](Self::forward)'s, `stream` of the output's
    pub fn forward_onto(&self, x: Tensor<3>, stream: Residual) -> Result<Tensor<3>, LayerError> {
        match self.gated_product() {
            Some(gemm) if self.w2.plain_whole().is_some() => {
                let ([x1, x3], weights) = self.gated_operands(x, Some(&stream))?;
                let (stream, link) = stream.into_parts();
                Ok(gated_mlp_onto(stream, &link, x1, x3, weights, gemm))
            }
            Some(gemm) => {
                let ([x1, x3], [w1, w3, w2]) = self.gated_operands(x, Some(&stream))?;
                let partial = gated_mlp(x1, x3, w1, w3, w2, gemm);
                Ok(stream.add_branch(self.w2.sum_partials(partial)?))
            }
            None => {
                let (gate, up) = self.project(x, Some(&stream))?;
                Ok(stream.add_branch(down(&self.w2, gate, up, self.notes())?))
            }
        }
    }

    /// The fused MLP's two readers of the input (their gradients summed by `stream`'s norm
    /// where it wrote it) and its three weights.
    fn gated_operands(
        &self,
        x: Tensor<3>,
        stream: Option<&Residual>,
    ) -> Result<([Tensor<3>; 2], [Tensor<2>; 3]), LayerError> {
        Ok((
            readers(self.map_input(x)?, stream),
            [self.w1.weight.val(), self.w3.weight.val(), self.w2.weight.val()],
        ))
    }

    /// The three projections' product where all are plain and alike and the SwiGLU notes no
    /// amax: then one op computes this rank's part of the block (`gated_mlp`: on CUDA the gate's
    /// and up projection's products in one GEMM with the SwiGLU in its epilogue, and the down
    /// projection's data gradient with the SwiGLU's backward in its own).
    fn gated_product(&self) -> Option<Gemm> {
        let gemm = self.w1.plain_product()?;
        let alike = self.w3.plain_product() == Some(gemm) && self.w2.plain_product() == Some(gemm);
        (alike && self.notes().is_none()).then_some(gemm)
    }

    /// [`forward`](Self::forward), the SwiGLU and the down projection run again in backward
    /// (selective recomputation, `crate::recompute`): the SwiGLU's output is kept by nobody.
    pub fn forward_recomputed(&self, x: Tensor<3>) -> Result<Tensor<3>, LayerError> {
        self.recomputed(x, None)
    }

    /// [`forward_recomputed`](Self::forward_recomputed) added onto `stream`, as
    /// [`forward_onto`](Self::forward_onto) adds it.
    pub fn forward_recomputed_onto(&self, x: Tensor<3>, stream: Residual) -> Result<Tensor<3>, LayerError> {
        Ok(stream.clone().add_branch(self.recomputed(x, Some(&stream))?))
    }

    fn recomputed(&self, x: Tensor<3>, stream: Option<&Residual>) -> Result<Tensor<3>, LayerError> {
        let (gate, up) = self.project(x, stream)?;
        let notes = self.notes();
        recompute(&self.w2, vec![gate, up], move |w2, mut gate_up| {
            let up = gate_up.pop().expect("gate and up");
            down(w2, gate_up.pop().expect("gate and up"), up, notes.clone())
        })
    }

    /// Whether its input's amax is worth noting where it is written (the gate's and up
    /// projection's products scale it by its tensor's amax: FP8 tensorwise), and the input
    /// reaches them as it is (whole sequences: a sequence-parallel input is gathered first).
    pub fn notes_input(&self) -> Option<AmaxNotes> {
        let worth =
            self.sequence == SequenceLayout::Whole && self.w1.precision.gemm.scales_by_tensor_amax(Pass::Forward);
        worth.then(|| self.w1.precision.notes.clone())
    }

    /// Whether its output's gradient is worth noting where it is written: the down projection's
    /// gradient products scale it by its tensor's amax, and it reaches them as it is (whole
    /// sequences).
    pub fn notes_output_grad(&self) -> Option<AmaxNotes> {
        let worth = self.sequence == SequenceLayout::Whole && self.w2.precision.gemm.scales_by_tensor_amax(Pass::Dgrad);
        worth.then(|| self.w2.precision.notes.clone())
    }

    /// The SwiGLU results whose amaxes its kernels take for the FP8 casts that quantize them
    /// next: the down projection's input, the gate's and up projection's output gradients.
    fn notes(&self) -> NoteAmaxes {
        let output = self.w2.precision.gemm.scales_by_tensor_amax(Pass::Forward);
        let input_grads = [&self.w1, &self.w3]
            .iter()
            .all(|w| w.precision.gemm.scales_by_tensor_amax(Pass::Dgrad));
        NoteAmaxes {
            output: output.then(|| self.w2.precision.notes.clone()),
            input_grads: input_grads.then(|| self.w1.precision.notes.clone()),
        }
    }

    /// The input as every rank's products read it: gathered from sequence shards, or entering
    /// the tensor-parallel region.
    fn map_input(&self, x: Tensor<3>) -> Result<Tensor<3>, LayerError> {
        Ok(match self.sequence {
            SequenceLayout::Sharded => gather_from_sp(x, &self.tp, 1)?,
            SequenceLayout::Whole => copy_to_tp(x, &self.tp)?,
        })
    }

    /// The gate and up projections, each `[b, s, f/tp]`.
    fn project(&self, x: Tensor<3>, stream: Option<&Residual>) -> Result<(Tensor<3>, Tensor<3>), LayerError> {
        let x = self.map_input(x)?;
        // Both read one input: quantized once where their products quantize it, their gradients
        // summed by `stream`'s norm where it wrote it.
        let shared = Some(Arc::new(SharedInput::default()));
        let [x1, x3]: [Tensor<3>; 2] = readers(x, stream);
        Ok((
            self.w1.forward_sharing(x1, shared.as_ref())?,
            self.w3.forward_sharing(x3, shared.as_ref())?,
        ))
    }
}

/// `w2(silu(gate) ⊙ up)`: where `w2` is a plain product and the SwiGLU notes no amax, one op
/// whose backward runs the SwiGLU's in the down projection's data gradient (`swiglu_down`).
fn down(w2: &RowParallelLinear, gate: Tensor<3>, up: Tensor<3>, notes: NoteAmaxes) -> Result<Tensor<3>, LayerError> {
    match w2.plain_product() {
        Some(gemm) if notes.is_none() => {
            w2.sum_partials(swiglu_down(gate, up, w2.weight.val(), gemm)) // this rank's f/tp
        }
        _ => w2.forward(swiglu_noting(gate, up, notes)), // [b, s, f/tp] → [b, s, d]
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::activation::silu;
    use burn::tensor::{Device, Tensor};

    use super::*;
    use crate::init::{InitMode, ParamInit};

    /// SwiGLU notes its amaxes only for FP8 tensorwise products, and the block's norm its output's
    /// only where the input reaches the products as it is (not gathered from sequence shards).
    #[test]
    fn notes_only_for_tensorwise_products() {
        use burn_megatron_kernels::quant::recipe::Recipe;
        let dev = Device::flex();
        let init = ParamInit::new(1, InitMode::Full);
        let mlp = |gemm: Gemm, sequence: SequenceLayout| {
            ParallelMlpConfig::new(16, 24)
                .with_gemm(gemm)
                .with_sequence(sequence)
                .init(&dev, &ProcessGroups::single(), &init, "m")
                .unwrap()
        };
        let fp8 = Gemm::Quantized(Recipe::Fp8TensorwisePromoted);
        let all = mlp(fp8, SequenceLayout::Whole).notes();
        assert!(all.output.is_some() && all.input_grads.is_some());
        assert!(mlp(fp8, SequenceLayout::Whole).notes_input().is_some());
        assert!(mlp(fp8, SequenceLayout::Sharded).notes_input().is_none());
        for gemm in [
            Gemm::Wgmma,
            Gemm::Quantized(Recipe::Fp8Blockwise),
            Gemm::Quantized(Recipe::Mxfp8),
        ] {
            assert!(mlp(gemm, SequenceLayout::Whole).notes().is_none(), "{gemm:?}");
            assert!(mlp(gemm, SequenceLayout::Whole).notes_input().is_none(), "{gemm:?}");
        }
    }

    /// How the block runs in [`check_written_out`].
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Path {
        Forward,
        Recomputed,
        /// Onto a residual stream (`forward_onto`: at tp = 1 the down projection adds it).
        Onto,
    }

    /// At tp = 1 the block is `w2(silu(x·w1) ⊙ x·w3)` written out: the same output and the same
    /// gradients of the input and of every weight, with and without selective recomputation, and
    /// added onto a residual stream (whose gradient is then checked too).
    #[test]
    fn matches_swiglu_written_out() {
        for path in [Path::Forward, Path::Recomputed, Path::Onto] {
            check_written_out(path);
        }
    }

    fn check_written_out(path: Path) {
        let dev = Device::flex().autodiff();
        let (b, s, d, f) = (2, 5, 16, 24);
        let mlp = ParallelMlpConfig::new(d, f)
            .init(&dev, &ProcessGroups::single(), &ParamInit::new(1, InitMode::Full), "m")
            .unwrap();
        let x = crate::init::normal([b, s, d], 9, 1.0, &dev).require_grad();
        let stream = crate::init::normal([b, s, d], 11, 1.0, &dev).require_grad();
        let out = match path {
            Path::Recomputed => mlp.forward_recomputed(x.clone()).unwrap(),
            Path::Forward => mlp.forward(x.clone()).unwrap(),
            Path::Onto => mlp.forward_onto(x.clone(), Residual::unlinked(stream.clone())).unwrap(),
        };
        let project = |w: &ColumnParallelLinear| x.clone().matmul(w.weight.val().unsqueeze());
        let hidden = silu(project(&mlp.w1)) * project(&mlp.w3);
        let mut expected = hidden.matmul(mlp.w2.weight.val().unsqueeze());
        if path == Path::Onto {
            expected = stream.clone() + expected;
        }
        let probe = crate::init::normal([b, s, d], 10, 1.0, &dev);
        let (ours, theirs) = (
            (out.clone() * probe.clone()).sum().backward(),
            (expected.clone() * probe).sum().backward(),
        );
        let values = |t: Tensor<3>| t.into_data().try_to_vec::<f32>().unwrap();
        let matrix = |t: Tensor<2>| t.into_data().try_to_vec::<f32>().unwrap();
        let mut pairs = vec![
            ("output", values(out), values(expected)),
            ("dx", values(x.grad(&ours).unwrap()), values(x.grad(&theirs).unwrap())),
        ];
        if path == Path::Onto {
            let d_stream = |g| values(stream.grad(g).unwrap());
            pairs.push(("d stream", d_stream(&ours), d_stream(&theirs)));
        }
        for (name, w) in [("w1", &mlp.w1.weight), ("w3", &mlp.w3.weight), ("w2", &mlp.w2.weight)] {
            pairs.push((
                name,
                matrix(w.val().grad(&ours).unwrap()),
                matrix(w.val().grad(&theirs).unwrap()),
            ));
        }
        for (what, a, e) in pairs {
            let worst = a.iter().zip(&e).map(|(a, e)| (a - e).abs()).fold(0.0, f32::max);
            // The same f32 arithmetic in another order (the derivative written out): ~1e-6.
            assert!(worst < 1e-5, "{what} ({path:?}): max |difference| {worst}");
        }
    }
}
