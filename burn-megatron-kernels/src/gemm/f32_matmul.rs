//! Matrix products of f32 operands computed in f32. Burn's CUDA matmul rounds f32 operands to
//! TF32 (10-bit mantissa) whenever it picks a tensor-core routine: cubek's `adjust_dtypes`
//! (`cubek-matmul-0.3.1/src/multi_level/definition/blueprint.rs:89`) switches f32 stages to
//! TF32 on any device that has it, with no setting to refuse it. A 256×256 product was off by
//! 6e-3 relative on an H200. PyTorch keeps f32 products in f32 by default
//! (`allow_tf32 = False`); so do the linear layers ([`crate::gemm`]) and the attention
//! reference here. On CUDA the product runs cubek's unit routine (FMA on the CUDA cores);
//! elsewhere Burn's matmul, which is f32 already.

use burn::tensor::{DType, Tensor};

/// `lhs · rhs`, in f32 without TF32 rounding when both are f32 CUDA tensors outside autodiff;
/// Burn's matmul otherwise.
///
/// # Shapes
/// `[..., m, k]`, `[..., k, n]` → `[..., m, n]`
pub fn matmul<const D: usize>(lhs: Tensor<D>, rhs: Tensor<D>) -> Tensor<D> {
    #[cfg(feature = "cuda")]
    if lhs.dtype() == DType::F32 && rhs.dtype() == DType::F32 {
        use burn::backend::Cube;
        let primitives = (
            lhs.clone().try_into_primitive::<Cube>(),
            rhs.clone().try_into_primitive::<Cube>(),
        );
        if let (Ok(lhs), Ok(rhs)) = primitives {
            return Tensor::from_primitive::<Cube>(cuda::matmul(lhs, rhs));
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = DType::F32;
    lhs.matmul(rhs)
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use burn::tensor::DType;
    use burn_cubecl::cubecl::ir::{ElemType, FloatKind};
    use burn_cubecl::kernel::matmul::init_matmul_output;
    use burn_cubecl::tensor::CubeTensor;
    use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
    use cubek::matmul::launch::launch_ref;
    use cubek::matmul::multi_level::Strategy as MultiLevel;
    use cubek::matmul::strategy::Strategy;

    /// `lhs · rhs` of f32 CUDA tensors through cubek's unit routine, falling back to its naive
    /// one for layouts the unit routine refuses: never TF32. Operands may be transposed views.
    pub(crate) fn matmul(lhs: CubeTensor, rhs: CubeTensor) -> CubeTensor {
        assert!(
            lhs.dtype == DType::F32 && rhs.dtype == DType::F32,
            "the f32 product takes f32 operands"
        );
        let out = init_matmul_output(&lhs, &rhs, DType::F32);
        let f32 = ElemType::Float(FloatKind::F32);
        let globals = MatmulGlobalElems {
            lhs: f32,
            rhs: f32,
            out: f32,
        };
        let client = out.client.clone();
        let run = |strategy: Strategy| {
            launch_ref(
                &strategy,
                &client,
                cubek::std::InputBinding::new(lhs.clone().binding(), f32),
                cubek::std::InputBinding::new(rhs.clone().binding(), f32),
                out.clone().binding(),
                &mut MatmulElems::from_globals(&globals),
            )
        };
        run(Strategy::MultiLevel(MultiLevel::SimpleUnit(Default::default())))
            .or_else(|_| run(Strategy::MultiLevel(MultiLevel::Naive)))
            .unwrap_or_else(|error| panic!("cubek's f32 routines refused a product: {error:?}"));
        out
    }
}
