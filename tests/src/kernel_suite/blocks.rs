//! FP8 in DeepSeek-V3's blocks on CUDA against the host reference, bit for bit: 1×128 tiles,
//! 128×1 tiles and 128×128 blocks, and the blockwise FP8 GEMM on their codes.

use crate::Harness;
use burn::tensor::{DType, Distribution, Tensor};

/// The blockwise recipe's other quantizers on CUDA against the host reference, bit for bit:
/// 128×1 tiles down the columns (the codes of `xᵀ`), 128×128 blocks (both layouts), and both
/// tilings from one read. Shapes ragged for the blocks and for the cast's vectors of 8 (37 × 13,
/// 300 × 520), multiples of 8 filling the last blocks partly (264 × 136), then multiples of both
/// (256 × 384); an all-zero 128×1 tile, a NaN, an infinity (its block's scale 1, its values
/// saturated), values far below the scaled format's smallest subnormal; E4M3 and E5M2, bf16 and
/// f32 inputs.
pub fn fp8_blocks(h: &Harness) {
    use burn::tensor::{Device, TensorData};
    use burn_megatron_kernels::quant::format::Minifloat;
    use burn_megatron_kernels::quant::tiles::{quantize_row_tiles, quantize_squares, quantize_tiles_both};
    let device = h.device(0);
    let cpu = Device::flex();
    for (r, c) in [(37, 13), (300, 520), (264, 136), (256, 384)] {
        let mut values: Vec<f32> = Tensor::<2>::random([r, c], Distribution::Normal(0.0, 3.0), (&cpu, DType::F32))
            .into_data()
            .try_to_vec()
            .expect("f32");
        for row in 0..r.min(128) {
            values[row * c] = 0.0; // column 0's first tile, the first block's column 0
        }
        values[c + 5] = f32::NAN;
        values[(r - 1) * c + c - 1] = f32::INFINITY;
        values[2 * c + 7] = 1e-30;
        for format in [Minifloat::E4M3, Minifloat::E5M2] {
            for dtype in [DType::BF16, DType::F32] {
                let case = format!("{r}×{c} {format:?} from {dtype:?}");
                let x = |d: &Device| {
                    Tensor::<2>::from_data(TensorData::new(values.clone(), [r, c]), (d, DType::F32)).cast(dtype)
                };
                let same = |what: &str, ours: burn::tensor::TensorData, theirs: burn::tensor::TensorData| {
                    assert_eq!(ours.shape(), theirs.shape(), "{case} {what}: shapes");
                    let (ours, theirs) = (
                        ours.try_to_vec::<u8>().expect("u8 codes"),
                        theirs.try_to_vec::<u8>().expect("u8 codes"),
                    );
                    let first = ours.iter().zip(&theirs).position(|(a, b)| a != b);
                    assert_eq!(first, None, "{case} {what}: the first differing code");
                };
                let scales = |what: &str, ours: Tensor<2>, theirs: Tensor<2>| {
                    let (ours, theirs): (Vec<f32>, Vec<f32>) = (
                        ours.to_device(&cpu).into_data().try_to_vec().expect("f32"),
                        theirs.into_data().try_to_vec().expect("f32"),
                    );
                    assert_eq!(ours, theirs, "{case} {what}: scales");
                };
                let (codes, tile_scales) = quantize_row_tiles(x(&device), format);
                let (ref_codes, ref_scales) = quantize_row_tiles(x(&cpu).cast(DType::F32), format);
                same("row tiles", codes.to_device(&cpu).into_data(), ref_codes.into_data());
                scales("row tiles", tile_scales, ref_scales);
                let (direct, transposed, block_scales) = quantize_squares(x(&device), format);
                let (ref_direct, ref_transposed, ref_scales) = quantize_squares(x(&cpu).cast(DType::F32), format);
                same("squares", direct.to_device(&cpu).into_data(), ref_direct.into_data());
                same(
                    "squares, transposed",
                    transposed.to_device(&cpu).into_data(),
                    ref_transposed.into_data(),
                );
                scales("squares", block_scales, ref_scales);
                let ((codes, tile_scales), (transposed, column_scales)) = quantize_tiles_both(x(&device), format);
                let ((ref_codes, ref_tiles), (ref_transposed, ref_columns)) =
                    quantize_tiles_both(x(&cpu).cast(DType::F32), format);
                same(
                    "both tilings, rows",
                    codes.to_device(&cpu).into_data(),
                    ref_codes.into_data(),
                );
                scales("both tilings, rows", tile_scales, ref_tiles);
                same(
                    "both tilings, columns",
                    transposed.to_device(&cpu).into_data(),
                    ref_transposed.into_data(),
                );
                scales("both tilings, columns", column_scales, ref_columns);
            }
        }
    }
}

/// The blockwise FP8 GEMM against the CPU's f32 product of the dequantized operands: A in
/// 1×128 tiles, B in 128×128 blocks (forward, dgrad) or 1×128 tiles (wgrad), E4M3 · E4M3 and
/// E4M3 · E5M2, on shapes that fill no tile (m and n ragged for 128 × 128 tiles, a k that ends
/// in a part slice, a k shorter than one slice, more tiles than SMs). Rows of A and of B are
/// scaled by powers of two from 2⁻⁸ to 2⁸, and the error is checked row by row and column by
/// column, so a scale read from the wrong row, column or slice shows. One case reads B's scales
/// through a transposed view.
pub fn fp8_blockwise_gemm(h: &Harness) {
    use burn::tensor::{Device, Int, TensorData};
    use burn_megatron_kernels::cuda::wgmma::{BScales, fp8_blockwise_matmul};
    use burn_megatron_kernels::quant::format::Minifloat;
    use burn_megatron_kernels::quant::scaling::{Scaling, quantize};
    let device = h.device(0);
    let cpu = Device::flex();
    let host = |rows: usize, cols: usize| -> Vec<f32> {
        let values: Vec<f32> = Tensor::<2>::random([rows, cols], Distribution::Normal(0.0, 1.0), (&cpu, DType::F32))
            .into_data()
            .try_to_vec()
            .expect("f32");
        let magnitude = |row: usize| 2f32.powi((row * 7 % 17) as i32 - 8);
        values
            .iter()
            .enumerate()
            .map(|(i, v)| v * magnitude(i / cols))
            .collect()
    };
    for formats in [(Minifloat::E4M3, Minifloat::E4M3), (Minifloat::E4M3, Minifloat::E5M2)] {
        for b_blocks in [BScales::Squares, BScales::Rows] {
            for (m, k, n) in [(300, 256, 520), (129, 2064, 257), (64, 32, 40), (4100, 384, 2000)] {
                let (a, b) = (host(m, k), host(n, k));
                let quantized = |x: &[f32], rows: usize, format: Minifloat, block_rows: usize| {
                    let q = quantize(
                        x,
                        [rows, k],
                        format,
                        Scaling::Blocks {
                            rows: block_rows,
                            cols: 128,
                        },
                        None,
                    );
                    let codes =
                        Tensor::<2, Int>::from_data(TensorData::new(q.codes.clone(), [rows, k]), (&device, DType::U8));
                    let grid = [rows.div_ceil(block_rows), k.div_ceil(128)];
                    let scales = Tensor::<2>::from_data(TensorData::new(q.scales.clone(), grid), (&device, DType::F32));
                    let values = Tensor::<2>::from_data(TensorData::new(q.dequantize(), [rows, k]), &cpu);
                    (codes, scales, values)
                };
                let (a_codes, a_scales, a_values) = quantized(&a, m, formats.0, 1);
                let block_rows = if b_blocks == BScales::Squares { 128 } else { 1 };
                let (b_codes, b_scales, b_values) = quantized(&b, n, formats.1, block_rows);
                // The scales' transpose made compact, viewed back: strides (1, rows).
                let b_scales = match m == 300 {
                    true => (b_scales.transpose() * 1.0).transpose(),
                    false => b_scales,
                };
                let out = fp8_blockwise_matmul((a_codes, a_scales), (b_codes, b_scales), b_blocks, formats)
                    .expect("a blockwise FP8 product");
                let expected = a_values.matmul(b_values.transpose());
                let out = out.to_device(&cpu).cast(DType::F32);
                // Products of FP8 values are exact in f32, each slice's sum is scaled in f32 and
                // the sums reorder within ulps; the output is rounded to bf16 (2⁻⁹ relative each):
                // about 2e-3 in a line's norm. A wrong scale is off by powers of two.
                let line_error = |dim: usize| {
                    let diff = (out.clone() - expected.clone()).square().sum_dim(dim).sqrt();
                    let norm = expected.clone().square().sum_dim(dim).sqrt();
                    (diff / norm).max().into_scalar::<f32>()
                };
                let (rows, columns) = (line_error(1), line_error(0));
                assert!(
                    rows < 1e-2 && columns < 1e-2,
                    "{formats:?} {b_blocks:?} {m}×{k}×{n}: worst relative error of a row {rows}, of a column {columns}"
                );
            }
        }
    }
}
