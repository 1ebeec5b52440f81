//! Every matrix-multiply routine by name, on Burn's CUDA tensors, for the GEMM study
//! (`bench --gemm`, `docs/kernels.md`): cubek's routines and our wgmma kernel's two schedules.
//!
//! Burn runs one routine for every matmul (`Auto`: a single-stage WMMA kernel, or autotune
//! over a subset when Burn's `autotune` feature is on). [`GemmKernel`] names each routine
//! cubek has, so the llama shapes can be measured against cuBLAS. The library ships only our
//! wgmma GEMM with Burn's matmul as its fallback (`burn_megatron_kernels::Gemm`).

use burn::backend::Cube;
use burn::tensor::{DType, Tensor};
use burn_cubecl::cubecl::ir::{ElemType, FloatKind};
use burn_cubecl::kernel::matmul::init_matmul_output;
use burn_cubecl::tensor::CubeTensor;
use burn_megatron_kernels::cuda::wgmma::{self, Schedule};
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
    /// Our own `wgmma` kernel ([`crate::wgmma`]), bf16 only, one block an SM running its
    /// tiles in turn ([`Schedule::Persistent`]).
    Wgmma,
    /// The same kernel with a block a tile ([`Schedule::TilePerBlock`]).
    WgmmaTilePerBlock,
}

impl GemmKernel {
    pub const ALL: [GemmKernel; 19] = [
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
        Self::Wgmma,
        Self::WgmmaTilePerBlock,
    ];

    /// cubek's strategy for the routine; `None` for our own kernels.
    fn strategy(self) -> Option<Strategy> {
        use BlueprintStrategy::Inferred;
        let ml = |s: MultiLevel| Strategy::MultiLevel(s);
        Some(match self {
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
            Self::Wgmma | Self::WgmmaTilePerBlock => return None,
        })
    }

    /// How our `wgmma` kernel hands out its tiles; `None` for cubek's routines.
    fn schedule(self) -> Option<Schedule> {
        match self {
            Self::Wgmma => Some(Schedule::Persistent),
            Self::WgmmaTilePerBlock => Some(Schedule::TilePerBlock),
            _ => None,
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
    let lhs: CubeTensor = lhs
        .try_into_primitive::<Cube>()
        .map_err(|_| "gemm runs on CUDA tensors without autodiff")?;
    let rhs: CubeTensor = rhs
        .try_into_primitive::<Cube>()
        .map_err(|_| "gemm runs on CUDA tensors without autodiff")?;
    if let Some(schedule) = kernel.schedule() {
        let out = wgmma::gemm(lhs, rhs, schedule).map_err(|e| e.to_string())?;
        return Ok(Tensor::from_primitive::<Cube>(out));
    }
    let strategy = kernel.strategy().expect("every routine but ours is cubek's");
    let out = init_matmul_output(&lhs, &rhs, dtype);
    let globals = MatmulGlobalElems {
        lhs: elem(lhs.dtype)?,
        rhs: elem(rhs.dtype)?,
        out: elem(out.dtype)?,
    };
    let mut dtypes = MatmulElems::from_globals(&globals);
    let client = out.client.clone();
    let (lhs_elem, rhs_elem) = (globals.lhs, globals.rhs);
    launch_ref(
        &strategy,
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

impl core::str::FromStr for GemmKernel {
    type Err = String;

    /// A routine by its name, as `Debug` prints it (`SpecializedTmaMma`, `Wgmma`), any case.
    fn from_str(name: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|k| format!("{k:?}").eq_ignore_ascii_case(name))
            .ok_or_else(|| format!("no GEMM routine named {name:?}; the routines are {:?}", Self::ALL))
    }
}
