//! Activation quantization: what a linear layer does to its input before the product
//! ([`InputQuantizer`], a field of the column- and row-parallel layers, nothing by default), and
//! the schemes that choose it. Inference only: a quantized input's gradient is not taken.
//!
//! Legend: `n` tokens, `k` input features (of this rank, `k/tp`, for a row-parallel layer).

use burn::tensor::{DType, Tensor};
use burn_megatron_dist::{ProcessGroup, ReduceOp};
use burn_megatron_kernels::quant::fake;
use burn_megatron_kernels::quant::format::Minifloat;
use burn_megatron_kernels::quant::recipe::{Blocks, Quantizer, Rounding};
use burn_megatron_kernels::quant::tiles::TILE;

use super::calibrate::Observer;
use super::codes::{Clipping, Codes};
use crate::error::LayerError;

/// How a block's linear layers quantize their inputs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ActivationScheme {
    /// One scale for the tensor, fixed by calibration (static): the range `clipping` chooses
    /// from what the calibration saw.
    Static { codes: Codes, clipping: Clipping },
    /// One scale a token, from the token's own amax (dynamic).
    PerToken { codes: Codes },
    /// FP8 (E4M3), dynamic: an f32 scale for each 1×128 tile of a token's features, from the
    /// tile's amax (DeepSeek-V3's activation tiles: the FP8 issue's quantizer,
    /// `Blocks::Tiles`); a ragged last tile takes what is left.
    Fp8Tiles,
    /// NVFP4, dynamic: E2M1 in 1×16 blocks along the features, E4M3 block scales and an f32
    /// scale from the tensor's amax (the FP8 issue's quantizer, `Blocks::Nv { rows: 1 }`).
    Nvfp4,
}

impl ActivationScheme {
    /// Its name in a table: `fp8-static-max`, `int8-token`, `nvfp4`.
    pub fn name(&self) -> String {
        match self {
            ActivationScheme::Static { codes, clipping } => format!("{}-static-{}", codes.name(), clipping.name()),
            ActivationScheme::PerToken { codes } => format!("{}-token", codes.name()),
            ActivationScheme::Fp8Tiles => "fp8-tiles".into(),
            ActivationScheme::Nvfp4 => "nvfp4".into(),
        }
    }
}

/// What a linear layer does to its input before the product.
#[derive(Clone, Debug, Default)]
pub enum InputQuantizer {
    /// Nothing.
    #[default]
    None,
    /// Records the input's statistics (calibration) and passes it on unchanged.
    Observe(Observer),
    /// Rounds the input onto `codes` with the fixed range `amax` (static, per tensor).
    Static { codes: Codes, amax: f32 },
    /// Rounds each token onto `codes` with its own amax (dynamic, per token).
    PerToken { codes: Codes },
    /// Rounds each 1×128 tile of a token onto FP8 with its own amax.
    Fp8Tiles,
    /// NVFP4's blocks (dynamic).
    Nvfp4,
}

impl InputQuantizer {
    /// `x` as the product sees it. `tp` is the layer's group and `sharded` whether `x` holds
    /// only this rank's features (a row-parallel layer's input): a token's amax and NVFP4's
    /// tensor amax are then taken over the group, so every rank scales as one device would.
    ///
    /// # Shapes
    /// `[.., k]` → `[.., k]`, in `x`'s dtype
    pub fn apply<const D: usize>(
        &self,
        x: Tensor<D>,
        tp: &ProcessGroup,
        sharded: bool,
    ) -> Result<Tensor<D>, LayerError> {
        let dims = x.dims();
        let k = dims[D - 1];
        let n = dims.iter().product::<usize>() / k.max(1);
        let dtype = x.dtype();
        let flat = || x.clone().detach().cast(DType::F32).reshape([n, k]);
        let quantized: Tensor<2> = match self {
            InputQuantizer::None => return Ok(x),
            InputQuantizer::Observe(observer) => {
                observer.record(flat());
                return Ok(x);
            }
            InputQuantizer::Static { codes, amax } => {
                let range = Tensor::<2>::full([1, 1], *amax, &x.device());
                codes.fake_quantize(flat(), range)
            }
            InputQuantizer::PerToken { codes } => {
                let amax = flat().abs().max_dim(1); // [n, 1]
                let amax = match sharded && tp.size() > 1 {
                    true => tp.all_reduce(amax, ReduceOp::Max)?,
                    false => amax,
                };
                codes.fake_quantize(flat(), amax)
            }
            InputQuantizer::Fp8Tiles => {
                // A row-parallel shard must hold whole tiles for its scales to be one device's.
                if sharded && tp.size() > 1 && !k.is_multiple_of(TILE) {
                    return Err(LayerError::GroupsAcrossShards {
                        features: k,
                        group: TILE,
                    });
                }
                let q = Quantizer {
                    format: Minifloat::E4M3,
                    blocks: Blocks::Tiles,
                    rounding: Rounding::Nearest,
                    hadamard: false,
                };
                fake::fake_quantize(flat(), q, None, None)
            }
            InputQuantizer::Nvfp4 => {
                let q = Quantizer {
                    format: Minifloat::E2M1,
                    blocks: Blocks::Nv { rows: 1 },
                    rounding: Rounding::Nearest,
                    hadamard: false,
                };
                // The tensor amax over the group; a failed collective is returned after.
                let failed = std::cell::RefCell::new(None);
                let reduce = |amax: Tensor<1>| match tp.all_reduce(amax.clone(), ReduceOp::Max) {
                    Ok(max) => max,
                    Err(e) => {
                        *failed.borrow_mut() = Some(LayerError::from(e));
                        amax
                    }
                };
                let values = match sharded && tp.size() > 1 {
                    true => fake::fake_quantize(flat(), q, None, Some(&reduce)),
                    false => fake::fake_quantize(flat(), q, None, None),
                };
                if let Some(e) = failed.into_inner() {
                    return Err(e);
                }
                values
            }
        };
        Ok(quantized.reshape(dims).cast(dtype))
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, TensorData};
    use burn_megatron_dist::ProcessGroups;

    use super::*;

    /// A static range rounds every value with one scale and clips past it; per token, each row
    /// has its own.
    #[test]
    fn static_and_per_token() {
        let device = Device::flex();
        let tp = ProcessGroups::single().tp;
        let x = Tensor::<2>::from_data(
            TensorData::new(vec![1.0f32, -0.5, 3.0, 0.25, 0.1, -0.2], [2, 3]),
            &device,
        );
        let fixed = InputQuantizer::Static {
            codes: Codes::Int8,
            amax: 2.0,
        };
        let got: Vec<f32> = fixed
            .apply(x.clone(), &tp, false)
            .unwrap()
            .into_data()
            .try_to_vec()
            .unwrap();
        let step = 2.0 / 127.0;
        let expect = |v: f32, step: f32| (v / step).round_ties_even().clamp(-127.0, 127.0) * step;
        for (g, v) in got.iter().zip([1.0f32, -0.5, 3.0, 0.25, 0.1, -0.2]) {
            assert!((g - expect(v, step)).abs() < 1e-6, "{g} for {v}");
        }
        assert!((got[2] - 2.0).abs() < 1e-6, "3 clips to the range");
        let token = InputQuantizer::PerToken { codes: Codes::Int8 };
        let got: Vec<f32> = token.apply(x, &tp, false).unwrap().into_data().try_to_vec().unwrap();
        for (i, (g, v)) in got.iter().zip([1.0f32, -0.5, 3.0, 0.25, 0.1, -0.2]).enumerate() {
            let amax = if i < 3 { 3.0 } else { 0.25 };
            assert!((g - expect(v, amax / 127.0)).abs() < 1e-6, "{g} for {v}");
        }
    }

    /// FP8 tiles: each token's 1×128 tiles scaled by their own amax (`amax / 448`), a ragged
    /// last tile included, so a tile beside an outlier's keeps its own range.
    #[test]
    fn fp8_tiles_scale_each_tile() {
        let device = Device::flex();
        let tp = ProcessGroups::single().tp;
        let k = 200; // a tile of 128 and a ragged one of 72
        let values: Vec<f32> = (0..2 * k)
            .map(|i| match i {
                5 => 300.0, // an outlier in the first tile of token 0
                _ => ((i * 37) % 101) as f32 / 101.0 - 0.5,
            })
            .collect();
        let x = Tensor::<2>::from_data(TensorData::new(values.clone(), [2, k]), &device);
        let got: Vec<f32> = InputQuantizer::Fp8Tiles
            .apply(x, &tp, false)
            .unwrap()
            .into_data()
            .try_to_vec()
            .unwrap();
        for token in 0..2 {
            for tile in [0..128, 128..k] {
                let row = &values[token * k..(token + 1) * k];
                let amax = row[tile.clone()].iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let scale = amax / 448.0;
                for i in tile.clone() {
                    let expected = Codes::Fp8.round_value(row[i] * scale.recip()) * scale;
                    assert_eq!(got[token * k + i], expected, "token {token} feature {i}");
                }
            }
        }
        // The outlier's tile is coarse; the next tile of the same token is not.
        assert!((got[130] - values[130]).abs() <= values[130].abs() / 16.0 + 1e-6);
    }
}
