//! cubek's matrix-multiply routines by name, on Burn's CUDA tensors.
//!
//! Burn runs one routine for every matmul (`Auto`: a single-stage WMMA kernel, or autotune
//! over a subset when Burn's `autotune` feature is on). [`GemmKernel`] names each routine
//! cubek has, so the llama shapes can be measured against cuBLAS and the best chosen.

use burn::backend::Cube;
use burn::tensor::{DType, Tensor};
use burn_cubecl::cubecl::ir::{ElemType, FloatKind};
use burn_cubecl::kernel::matmul::init_matmul_output;
use burn_cubecl::tensor::CubeTensor;
use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
use cubek::matmul::launch::launch_ref;
use cubek::matmul::multi_level::Strategy as MultiLevel;
use cubek::matmul::routine::BlueprintStrategy;
use cubek::matmul::strategy::Strategy;
use cubek::matmul::tiled::{self, cmma::CmmaStrategy};

/// A cubek matmul routine. `*Cmma` compute with WMMA fragments, `*Mma` with `mma.sync`
/// m16n8k16 and `ldmatrix`; `Tma` routines load tiles with Hopper's bulk tensor copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmKernel {
    /// What Burn runs without autotune.
    Auto,
    SimpleCyclicCmma,
    SimpleCyclicMma,
    SimpleTmaCmma,
    SimpleTmaMma,
    DoubleCyclicCmma,
    DoubleCyclicMma,
    DoubleTmaCmma,
    DoubleTmaMma,
    DoubleAsyncCyclicMma,
    SpecializedCyclicMma,
    SpecializedTmaCmma,
    SpecializedTmaMma,
    OrderedDoubleCmma,
    OrderedDoubleMma,
    /// The tile-DSL WMMA routine, 2-stage, plain loads.
    TiledCmma,
    /// The tile-DSL WMMA routine with TMA loads (unbatched shapes that divide its stage).
    TiledCmmaTma,
}

impl GemmKernel {
    pub const ALL: [GemmKernel; 17] = [
        Self::Auto,
        Self::SimpleCyclicCmma,
        Self::SimpleCyclicMma,
        Self::SimpleTmaCmma,
        Self::SimpleTmaMma,
        Self::DoubleCyclicCmma,
        Self::DoubleCyclicMma,
        Self::DoubleTmaCmma,
        Self::DoubleTmaMma,
        Self::DoubleAsyncCyclicMma,
        Self::SpecializedCyclicMma,
        Self::SpecializedTmaCmma,
        Self::SpecializedTmaMma,
        Self::OrderedDoubleCmma,
        Self::OrderedDoubleMma,
        Self::TiledCmma,
        Self::TiledCmmaTma,
    ];

    fn strategy(self) -> Strategy {
        use BlueprintStrategy::Inferred;
        let ml = |s: MultiLevel| Strategy::MultiLevel(s);
        match self {
            Self::Auto => Strategy::Auto,
            Self::SimpleCyclicCmma => ml(MultiLevel::SimpleCyclicCmma(Inferred(Default::default()))),
            Self::SimpleCyclicMma => ml(MultiLevel::SimpleCyclicMma(Inferred(Default::default()))),
            Self::SimpleTmaCmma => ml(MultiLevel::SimpleTmaCmma(Inferred(Default::default()))),
            Self::SimpleTmaMma => ml(MultiLevel::SimpleTmaMma(Inferred(Default::default()))),
            Self::DoubleCyclicCmma => ml(MultiLevel::DoubleCyclicCmma(Inferred(Default::default()))),
            Self::DoubleCyclicMma => ml(MultiLevel::DoubleCyclicMma(Inferred(Default::default()))),
            Self::DoubleTmaCmma => ml(MultiLevel::DoubleTmaCmma(Inferred(Default::default()))),
            Self::DoubleTmaMma => ml(MultiLevel::DoubleTmaMma(Inferred(Default::default()))),
            Self::DoubleAsyncCyclicMma => ml(MultiLevel::DoubleAsyncCyclicMma(Inferred(Default::default()))),
            Self::SpecializedCyclicMma => ml(MultiLevel::SpecializedCyclicMma(Inferred(Default::default()))),
            Self::SpecializedTmaCmma => ml(MultiLevel::SpecializedTmaCmma(Inferred(Default::default()))),
            Self::SpecializedTmaMma => ml(MultiLevel::SpecializedTmaMma(Inferred(Default::default()))),
            Self::OrderedDoubleCmma => ml(MultiLevel::OrderedDoubleCmma(Inferred(Default::default()))),
            Self::OrderedDoubleMma => ml(MultiLevel::OrderedDoubleMma(Inferred(Default::default()))),
            Self::TiledCmma => Strategy::Tiled(tiled::Strategy::Cmma(Inferred(CmmaStrategy::default()))),
            Self::TiledCmmaTma => Strategy::Tiled(tiled::Strategy::Cmma(Inferred(CmmaStrategy::tma()))),
        }
    }
}

/// `lhs · rhs` with `kernel`, in the inputs' dtype (bf16 and f16 accumulate in f32). Operands
/// may be transposed views.
///
/// # Shapes
/// `[m, k]`, `[k, n]` → `[m, n]`
pub fn matmul(lhs: Tensor<2>, rhs: Tensor<2>, kernel: GemmKernel) -> Result<Tensor<2>, String> {
    let dtype = lhs.dtype();
    let lhs: CubeTensor = lhs.try_into_primitive::<Cube>().map_err(|_| "gemm runs on CUDA tensors without autodiff")?;
    let rhs: CubeTensor = rhs.try_into_primitive::<Cube>().map_err(|_| "gemm runs on CUDA tensors without autodiff")?;
    let out = init_matmul_output(&lhs, &rhs, dtype);
    let globals = MatmulGlobalElems { lhs: elem(lhs.dtype)?, rhs: elem(rhs.dtype)?, out: elem(out.dtype)? };
    let mut dtypes = MatmulElems::from_globals(&globals);
    let client = out.client.clone();
    let (lhs_elem, rhs_elem) = (globals.lhs, globals.rhs);
    launch_ref(
        &kernel.strategy(),
        &client,
        cubek::std::InputBinding::new(lhs.binding(), lhs_elem),
        cubek::std::InputBinding::new(rhs.binding(), rhs_elem),
        out.clone().binding(),
        &mut dtypes,
    )
    .map_err(|e| format!("{kernel:?}: {e:?}"))?;
    Ok(Tensor::from_primitive::<Cube>(out))
}

/// cubek's name for a float dtype the tensor-core routines take.
fn elem(dtype: DType) -> Result<ElemType, String> {
    Ok(match dtype {
        DType::BF16 => ElemType::Float(FloatKind::BF16),
        DType::F16 => ElemType::Float(FloatKind::F16),
        DType::F32 => ElemType::Float(FloatKind::F32),
        other => return Err(format!("gemm takes bf16, f16 or f32, not {other:?}")),
    })
}

/// The routine the linear layers run: the fastest on every llama shape measured
/// (`docs/perf/gemm.md`), for bf16 and f16; f32 keeps Burn's matmul (its precision is what the
/// f32 parity suites expect). A shape the routine refuses falls back to Burn's matmul.
pub const FASTEST: GemmKernel = GemmKernel::SpecializedTmaMma;

/// `lhs · rhs` on primitives with [`FASTEST`].
pub(crate) fn fastest(lhs: CubeTensor, rhs: CubeTensor) -> CubeTensor {
    use burn::backend::ops::FloatTensorOps;
    if !matches!(lhs.dtype, DType::BF16 | DType::F16) || lhs.dtype != rhs.dtype {
        return Cube::float_matmul(lhs, rhs);
    }
    let (l, r) = (Tensor::<2>::from_primitive::<Cube>(lhs.clone()), Tensor::<2>::from_primitive::<Cube>(rhs.clone()));
    match matmul(l, r, FASTEST) {
        Ok(out) => out.try_into_primitive::<Cube>().expect("a CUDA tensor"),
        Err(_) => Cube::float_matmul(lhs, rhs),
    }
}
