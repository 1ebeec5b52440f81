//! FP8 quantization of a 2-D tensor in DeepSeek-V3's blocks, an f32 scale a block: 1×128 tiles
//! along its rows (activations and gradients, [`quantize_tiles`]), 128×1 tiles down its columns
//! written as the codes of its transpose (wgrad's operands, K-major along the tokens,
//! [`quantize_row_tiles`]), and 128×128 blocks in both layouts (weights, [`quantize_squares`]).
//! On CUDA the kernels of the blockwise FP8 products (1×128 tiles: one kernel reads each value
//! once, takes its tile's amax across a warp and writes the codes and the scale; the others: the
//! blocks' scales, then one transposing cast); elsewhere the host reference,
//! [`super::scaling::quantize`] with `Scaling::Blocks`, which the kernels match bit for bit.

use burn::tensor::{DType, Int, Tensor, TensorData};

use super::format::Minifloat;
use super::scaling::{Scaling, quantize};

pub use super::scaling::TILE;

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
        let (codes, scales) = crate::quant::kernels::blocks::quantize_tiles(primitive, format);
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

/// `x`'s values as f32 on the host, with its device.
fn host(x: Tensor<2>) -> (Vec<f32>, burn::tensor::Device) {
    let device = x.device();
    (x.cast(DType::F32).into_data().try_to_vec().expect("f32 values"), device)
}

/// Codes `[r, c]` of a host quantization, transposed to `[c, r]`.
fn transposed(codes: &[u8], [r, c]: [usize; 2]) -> Vec<u8> {
    (0..c * r).map(|i| codes[(i % r) * c + i / r]).collect()
}

/// `x` (`[r, c]`) quantized to `format` (E4M3 or E5M2) in 128×1 tiles down its columns: the
/// codes of `xᵀ` (u8, K-major along `x`'s rows) and each tile's dequantization scale, as `xᵀ`'s
/// 1×128 tiles are indexed.
///
/// # Shapes
/// `[r, c]` → codes `[c, r]`, scales `[c, ⌈r / 128⌉]`
pub fn quantize_row_tiles(x: Tensor<2>, format: Minifloat) -> (Tensor<2, Int>, Tensor<2>) {
    assert!(
        matches!(format, Minifloat::E4M3 | Minifloat::E5M2),
        "tiles are FP8: E4M3 or E5M2, not {format:?}"
    );
    #[cfg(feature = "cuda")]
    if let Ok(primitive) = x.clone().try_into_primitive::<burn::backend::Cube>() {
        let (codes, scales) = crate::quant::kernels::blocks::quantize_row_tiles(primitive, format);
        return (
            Tensor::from_primitive::<burn::backend::Cube>(codes),
            Tensor::from_primitive::<burn::backend::Cube>(scales),
        );
    }
    let [r, c] = x.dims();
    let (values, device) = host(x);
    let q = quantize(&values, [r, c], format, Scaling::Blocks { rows: TILE, cols: 1 }, None);
    (
        Tensor::from_data(
            TensorData::new(transposed(&q.codes, [r, c]), [c, r]),
            (&device, DType::U8),
        ),
        Tensor::<2>::from_data(TensorData::new(q.scales, [r.div_ceil(TILE), c]), (&device, DType::F32)).transpose(),
    )
}

/// Both tilings of `x` (`[r, c]`): [`quantize_tiles`] and [`quantize_row_tiles`]; on CUDA
/// from one read of `x` where `r` and `c` are multiples of 8 (the blockwise recipe's `x` and
/// `dy`, each read by two products).
///
/// # Shapes
/// `[r, c]` → (codes `[r, c]`, scales `[r, ⌈c / 128⌉]`), (codes `[c, r]`, scales `[c, ⌈r / 128⌉]`)
#[allow(clippy::type_complexity)]
pub fn quantize_tiles_both(
    x: Tensor<2>,
    format: Minifloat,
) -> ((Tensor<2, Int>, Tensor<2>), (Tensor<2, Int>, Tensor<2>)) {
    #[cfg(feature = "cuda")]
    if let Ok(primitive) = x.clone().try_into_primitive::<burn::backend::Cube>()
        && let Some(((codes, scales), (transposed, column_scales))) =
            crate::quant::kernels::blocks::quantize_tiles_both(primitive, format)
    {
        let t = |codes| Tensor::from_primitive::<burn::backend::Cube>(codes);
        let f = |scales| Tensor::from_primitive::<burn::backend::Cube>(scales);
        return ((t(codes), f(scales)), (t(transposed), f(column_scales)));
    }
    (quantize_tiles(x.clone(), format), quantize_row_tiles(x, format))
}

/// `x` (`[r, c]`) quantized to `format` (E4M3 or E5M2) in 128×128 blocks: the codes of `x` and
/// of `xᵀ` (the same blocks), and each block's dequantization scale.
///
/// # Shapes
/// `[r, c]` → codes `[r, c]` and `[c, r]`, scales `[⌈r / 128⌉, ⌈c / 128⌉]`
pub fn quantize_squares(x: Tensor<2>, format: Minifloat) -> (Tensor<2, Int>, Tensor<2, Int>, Tensor<2>) {
    assert!(
        matches!(format, Minifloat::E4M3 | Minifloat::E5M2),
        "blocks are FP8: E4M3 or E5M2, not {format:?}"
    );
    #[cfg(feature = "cuda")]
    if let Ok(primitive) = x.clone().try_into_primitive::<burn::backend::Cube>() {
        let (direct, transposed, scales) = crate::quant::kernels::blocks::quantize_squares(primitive, format, true);
        let t = |codes| Tensor::from_primitive::<burn::backend::Cube>(codes);
        return (
            t(direct.expect("the direct codes it was asked for")),
            t(transposed),
            Tensor::from_primitive::<burn::backend::Cube>(scales),
        );
    }
    let [r, c] = x.dims();
    let (values, device) = host(x);
    let q = quantize(
        &values,
        [r, c],
        format,
        Scaling::Blocks { rows: TILE, cols: TILE },
        None,
    );
    let codes =
        |codes: Vec<u8>, shape: [usize; 2]| Tensor::from_data(TensorData::new(codes, shape), (&device, DType::U8));
    (
        codes(q.codes.clone(), [r, c]),
        codes(transposed(&q.codes, [r, c]), [c, r]),
        Tensor::from_data(
            TensorData::new(q.scales, [r.div_ceil(TILE), c.div_ceil(TILE)]),
            (&device, DType::F32),
        ),
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

    /// 128×1 tiles of `x` are the 1×128 tiles of `xᵀ`: the codes and scales of the transposed
    /// copy's tiles, on a ragged shape (a last tile of 44 rows, 3 columns of a vector short).
    #[test]
    fn row_tiles_are_the_tiles_of_the_transpose() {
        let x = Tensor::<2>::random([300, 13], Distribution::Normal(0.0, 2.0), (&Device::flex(), DType::F32));
        let (codes, scales) = quantize_row_tiles(x.clone(), Minifloat::E4M3);
        let (expected_codes, expected_scales) = quantize_tiles(x.transpose(), Minifloat::E4M3);
        assert_eq!(codes.dims(), [13, 300]);
        assert_eq!(scales.dims(), [13, 3]);
        codes.into_data().assert_eq(&expected_codes.into_data(), true);
        scales.into_data().assert_eq(&expected_scales.into_data(), true);
    }

    /// A 128×128 block is one block in `x` and `xᵀ`: the transposed codes are the direct codes
    /// transposed, and the scales those of `xᵀ`'s blocks transposed; the scales are per block
    /// (a block of large values does not scale its neighbours).
    #[test]
    fn squares_are_the_same_in_both_layouts() {
        let device = Device::flex();
        let x = Tensor::<2>::random([200, 300], Distribution::Normal(0.0, 1.0), (&device, DType::F32));
        let x = x
            .clone()
            .slice_assign([0..128, 128..256], x.slice([0..128, 128..256]) * 1000.0);
        let (direct, transposed, scales) = quantize_squares(x.clone(), Minifloat::E4M3);
        assert_eq!(
            (direct.dims(), transposed.dims(), scales.dims()),
            ([200, 300], [300, 200], [2, 3])
        );
        transposed.into_data().assert_eq(&direct.transpose().into_data(), true);
        let (_, _, theirs) = quantize_squares(x.transpose(), Minifloat::E4M3);
        scales
            .clone()
            .into_data()
            .assert_eq(&theirs.transpose().into_data(), true);
        let scales: Vec<f32> = scales.into_data().try_to_vec().unwrap();
        assert!(
            scales[1] > 500.0 * scales[0],
            "block (0, 1)'s scale {} beside {}",
            scales[1],
            scales[0]
        );
    }
}
