//! The emulated recipes' operands on CUDA (MX and NVFP4 blocks quantized and dequantized by one
//! kernel, `quant_emulated`, NVFP4's Hadamard transform in it) against the same emulation in
//! tensor ops on the CPU.

use burn::tensor::{DType, Device, Distribution, Tensor, TensorData};
use burn_megatron_kernels::quant::product::{Operand, quantized_operand};
use burn_megatron_kernels::quant::recipe::{Pass, Recipe};

use crate::Harness;

/// MXFP8 and NVFP4 operands of every pass (`quantized_operand` with the pass's quantizers),
/// bf16 and f32 inputs, against the CPU's tensor-op emulation of the same values, bit for bit:
/// E8M0 and two-level scales, nearest and stochastic rounding (the draws' key hashed on the
/// device), NVFP4's wgrad transform (its fast form adds in one fixed order on both devices).
/// Each operand both compact and as the transposed view of a compact tensor (as a GEMM's
/// `wᵀ`, `dyᵀ`, `xᵀ` reach it; the kernel reads it in place where its rows are a multiple of
/// 8, and copies it otherwise). Shapes: ragged 16-row blocks and 16- and 32-wide blocks
/// (37 × 40, 40 × 37), whole blocks, a `c` no multiple of 8 (the tensor ops on CUDA too).
/// Adversarial blocks: all zeros, one whose amax is E4M3's 448 exactly (MX scale 2⁰) and one
/// just above it (2¹), a value far below the block's smallest step.
pub fn emulated_blocks(h: &Harness) {
    let device = h.device(0);
    let cpu = Device::flex();
    for (r, c) in [(37, 40), (40, 37), (64, 96), (300, 520), (20, 13)] {
        let values = |seed: f32| {
            let mut v: Vec<f32> = Tensor::<2>::random([r, c], Distribution::Normal(0.0, 3.0), (&cpu, DType::F32))
                .into_data()
                .try_to_vec()
                .expect("f32");
            v[..c.min(32)].fill(0.0);
            if r > 2 && c >= 32 {
                v[c] = 448.0;
                v[2 * c] = 448.0 * (1.0 + seed * 2f32.powi(-7));
                v[2 * c + 1] = 1e-30;
            }
            v
        };
        for (dtype, view) in [DType::BF16, DType::F32]
            .into_iter()
            .flat_map(|d| [(d, false), (d, true)])
        {
            let operand = |v: Vec<f32>| {
                let x = Tensor::<2>::from_data(TensorData::new(v, [r, c]), (&cpu, DType::F32));
                match view {
                    // The same values, held as `[c, r]`.
                    true => {
                        let held: Vec<f32> = x.transpose().into_data().try_to_vec().expect("f32");
                        Tensor::<2>::from_data(TensorData::new(held, [c, r]), (&device, DType::F32))
                            .cast(dtype)
                            .transpose()
                    }
                    false => x.to_device(&device).cast(dtype),
                }
            };
            let inputs = [operand(values(1.0)), operand(values(2.0))];
            for recipe in [Recipe::Mxfp8, Recipe::Nvfp4] {
                for pass in [Pass::Forward, Pass::Dgrad, Pass::Wgrad] {
                    let (qa, qb) = recipe.operands(pass);
                    for (a, (q, x)) in [(true, (qa, &inputs[0])), (false, (qb, &inputs[1]))] {
                        let side = if a { "a" } else { "b" };
                        let held = if view { "view" } else { "compact" };
                        let case = format!("{r}×{c} {dtype:?} {held} {recipe:?} {pass:?} {side}");
                        let operand = Operand { pass, a };
                        let ours = quantized_operand(x.clone(), q, &None, operand);
                        let theirs = quantized_operand(x.clone().to_device(&cpu).cast(DType::F32), q, &None, operand);
                        // The kernel hands bf16 inputs' values on in bf16, as the GEMM reads them.
                        let host = |t: Tensor<2>| -> Vec<f32> {
                            t.cast(dtype)
                                .cast(DType::F32)
                                .to_device(&cpu)
                                .into_data()
                                .try_to_vec()
                                .expect("f32")
                        };
                        assert_eq!(ours.dims(), theirs.dims(), "{case}: shapes");
                        let (ours, theirs) = (host(ours), host(theirs));
                        let differ: Vec<usize> = (0..ours.len())
                            .filter(|&i| ours[i].to_bits() != theirs[i].to_bits())
                            .collect();
                        let first: Vec<(usize, f32, f32)> =
                            differ.iter().take(4).map(|&i| (i, ours[i], theirs[i])).collect();
                        assert!(
                            differ.is_empty(),
                            "{case}: {} of {} values differ (index, CUDA, CPU): {first:?}",
                            differ.len(),
                            ours.len()
                        );
                    }
                }
            }
        }
    }
}
