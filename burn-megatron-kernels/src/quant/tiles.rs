//! FP8 quantization of a 2-D tensor in 1×128 tiles along its rows, an f32 scale a tile
//! (DeepSeek-V3's activations and gradients): on CUDA one kernel reads each value once, takes its
//! tile's amax across a warp and writes the codes and the scale (the fused cast + amax); elsewhere
//! the host reference, [`super::scaling::quantize`] with `Scaling::Blocks { rows: 1, cols: 128 }`,
//! which the kernel matches bit for bit.

use burn::tensor::{DType, Int, Tensor, TensorData};

use super::format::Minifloat;
use super::scaling::{Scaling, quantize};

/// Values a tile holds along a row.
pub const TILE: usize = 128;

/// `x` quantized to `format` (E4M3 or E5M2) in 1×[`TILE`] tiles: codes (u8) and each tile's
/// dequantization scale `amax / max` (1 for an all-zero or non-finite tile).
///
/// # Shapes
/// `[r, c]` → codes `[r, c]`, scales `[r, ⌈c / 128⌉]`
pub fn quantize_tiles(x: Tensor<2>, format: Minifloat) -> (Tensor<2, Int>, Tensor<2>) {
    assert!(
        matches!(format, Minifloat::E4M3 | Minifloat::E5M2),
        "tiles are FP8: E4M3 or E5M2, not {format:?}"
    );
    #[cfg(feature = "cuda")]
    if let Ok(primitive) = x.clone().try_into_primitive::<burn::backend::Cube>() {
        let (codes, scales) = crate::quant_kernels::quantize_tiles(primitive, format);
        return (
            Tensor::from_primitive::<burn::backend::Cube>(codes),
            Tensor::from_primitive::<burn::backend::Cube>(scales),
        );
    }
    let [r, c] = x.dims();
    let device = x.device();
    let values: Vec<f32> = x.cast(DType::F32).into_data().try_to_vec().expect("f32 values");
    let q = quantize(&values, [r, c], format, Scaling::Blocks { rows: 1, cols: TILE }, None);
    let tiles = c.div_ceil(TILE);
    (
        Tensor::from_data(TensorData::new(q.codes, [r, c]), (&device, DType::U8)),
        Tensor::from_data(TensorData::new(q.scales, [r, tiles]), (&device, DType::F32)),
    )
}

#[cfg(test)]
mod tests {
    use burn::tensor::{DType, Device, Distribution, Tensor};

    use super::*;

    /// On the CPU: the codes' and scales' shapes and dtypes, and values back within E4M3's half
    /// step (2⁻⁴ relative) or, below its normal range, half the smallest subnormal step.
    #[test]
    fn quantizes_in_row_tiles() {
        let x = Tensor::<2>::random([5, 300], Distribution::Normal(0.0, 2.0), (&Device::flex(), DType::F32));
        let (codes, scales) = quantize_tiles(x.clone(), Minifloat::E4M3);
        assert_eq!((codes.dims(), codes.dtype()), ([5, 300], DType::U8));
        assert_eq!((scales.dims(), scales.dtype()), ([5, 3], DType::F32));
        let codes: Vec<u8> = codes.into_data().try_to_vec().unwrap();
        let scales: Vec<f32> = scales.into_data().try_to_vec().unwrap();
        let values: Vec<f32> = x.into_data().try_to_vec().unwrap();
        for (i, (&v, &code)) in values.iter().zip(&codes).enumerate() {
            let scale = scales[(i / 300) * 3 + (i % 300) / TILE];
            let back = Minifloat::E4M3.decode(code) * scale;
            let bound = (v.abs() / 16.0).max(scale * 2f32.powi(-10)) * 1.0001;
            assert!((v - back).abs() <= bound, "{i}: {v} → {back}");
        }
    }
}
