//! The optimizer's CUDA kernels against their references: the fused AdamW step (in the
//! parameter's dtype, and of fp32 master weights writing the parameter's copy) and a global
//! gradient norm's sums of squares.

use super::{relative_error, tolerance};
use crate::Harness;
use burn::tensor::{DType, Distribution, Tensor, TensorData};

/// The kernel tests' AdamW step `time`: lr 1e-2, β (0.9, 0.95), weight decay 0.1, the gradient
/// halved (as clipping would).
fn adam_step(time: u32) -> burn_megatron_kernels::adamw::AdamWStep {
    burn_megatron_kernels::adamw::AdamWStep {
        lr: 1e-2,
        beta_1: 0.9,
        beta_2: 0.95,
        epsilon: 1e-8,
        weight_decay: 0.1,
        time,
        grad_scale: 0.5,
    }
}

/// Three fused AdamW steps against the update written in f32 tensor ops, for f32 and bf16
/// parameters, on lengths that take vectors of 4 and one that takes none. Step 1 writes new
/// tensors (the twin holds the same zero moments); steps 2 and 3 update the parameter and the
/// moments in place (the previous step's outputs, held by nothing else).
pub fn adamw(h: &Harness) {
    use burn_megatron_kernels::adamw::adamw_step;
    let device = h.device(0);
    for dtype in [DType::F32, DType::BF16] {
        for dims in [[1000, 37], [7, 13]] {
            let start = Tensor::<2>::random(dims, Distribution::Normal(0.0, 1.0), (&device, dtype));
            let (mut p, mut m, mut v) = (
                start.clone(),
                start.zeros_like().cast(DType::F32),
                start.zeros_like().cast(DType::F32),
            );
            let (mut p32, mut m32, mut v32) = (start.cast(DType::F32), m.clone(), v.clone());
            for time in 1..=3u32 {
                let step = adam_step(time);
                let grad = Tensor::<2>::random(dims, Distribution::Normal(0.0, 1.0), (&device, dtype));
                (p, m, v) = adamw_step(p, grad.clone(), m, v, step);
                let g = grad.cast(DType::F32) * 0.5;
                m32 = m32 * 0.9 + g.clone() * 0.1;
                v32 = v32 * 0.95 + g.square() * 0.05;
                let update = (m32.clone() / (1.0 - 0.9f32.powi(time as i32)))
                    / ((v32.clone() / (1.0 - 0.95f32.powi(time as i32))).sqrt() + 1e-8);
                p32 = p32 * (1.0 - 1e-2 * 0.1) - update * 1e-2;
            }
            let case = format!("{dtype:?} {dims:?}");
            // f32: the same formula (ulps). bf16: the parameter is rounded each step (2⁻⁹ of
            // values of order 1), the f32 twin is not.
            let error = relative_error(p, p32);
            assert!(error < tolerance(dtype), "{case}: parameter relative error {error}");
            let error = relative_error(m, m32);
            assert!(error < 1e-4, "{case}: first moment relative error {error}");
        }
    }
}

/// Three AdamW steps of f32 master weights, the model's copy written in the same pass, against
/// the f32 twin: gradients in bf16 and f32, copies in bf16 and f32, lengths that take vectors of
/// 4 (over 5 and 513 blocks, each thread sweeping up to eight), one that takes none (one block);
/// the bf16 gradients scaled by a
/// clipping factor other than 1. The running sum of squares against the f64 sum of the
/// gradients (before clipping) on the host; the copy's amax, taken as it is written, against the
/// amax pass over the copy, bit for bit (a NaN in the copy ignored by both).
pub fn adamw_master(h: &Harness) {
    use burn::tensor::FloatDType;
    use burn_megatron_kernels::adamw::{adamw_master_step, reference};
    use burn_megatron_kernels::quant::kernels::fp8::amax;
    let device = h.device(0);
    let bits = |t: Tensor<1>| t.into_scalar::<f32>().to_bits();
    let amax_pass = |t: &Tensor<1>| amax(t.clone().reshape([1, t.dims()[0]]));
    for (grad_dtype, param_dtype) in [
        (DType::BF16, DType::BF16),
        (DType::F32, DType::BF16),
        (DType::F32, DType::F32),
    ] {
        for n in [37_000, 91, 4_200_000] {
            let master = Tensor::<1>::random([n], Distribution::Normal(0.0, 1.0), (&device, DType::F32));
            let zeros = master.zeros_like();
            let mut ours = (master.clone(), zeros.clone(), zeros.clone(), master.clone());
            let mut twin = (master, zeros.clone(), zeros);
            let mut squares = Tensor::<1>::zeros([1], (&device, DType::F32));
            let mut copy_amax = squares.clone();
            let mut expected = 0.0f64;
            // A factor that is no power of two, so that a factor left out or applied twice shows.
            let clip = (grad_dtype == DType::BF16).then_some(0.3f32);
            for time in 1..=3u32 {
                let step = adam_step(time);
                let grad = Tensor::<1>::random([n], Distribution::Normal(0.0, 1.0), (&device, grad_dtype));
                expected += grad
                    .clone()
                    .cast(DType::F32)
                    .into_data()
                    .iter::<f32>()
                    .map(|g| (g as f64).powi(2))
                    .sum::<f64>();
                let new = adamw_master_step(
                    ours.0,
                    grad.clone(),
                    ours.1,
                    ours.2,
                    step,
                    Tensor::<1>::full([1], clip.unwrap_or(1.0), (&device, DType::F32)),
                    FloatDType::from(param_dtype),
                    squares,
                );
                ours = (new.master, new.moment_1, new.moment_2, new.param);
                (squares, copy_amax) = (new.squares, new.amax);
                let grad = grad.cast(DType::F32).mul_scalar(clip.unwrap_or(1.0));
                let (p, m, v) = reference::update::<burn::backend::Dispatch>(
                    twin.0.into_dispatch(),
                    grad.into_dispatch(),
                    twin.1.into_dispatch(),
                    twin.2.into_dispatch(),
                    step,
                );
                twin = (
                    Tensor::from_dispatch(p),
                    Tensor::from_dispatch(m),
                    Tensor::from_dispatch(v),
                );
            }
            let case = format!("grad {grad_dtype:?} param {param_dtype:?} n {n} clip {clip:?}");
            assert_eq!(bits(copy_amax), bits(amax_pass(&ours.3)), "{case}: the copy's amax");
            // The same f32 formula in both: a few ulps of values of order 1.
            for (what, a, b) in [
                ("master", &ours.0, &twin.0),
                ("m", &ours.1, &twin.1),
                ("v", &ours.2, &twin.2),
            ] {
                let error = relative_error(a.clone(), b.clone());
                assert!(error < 1e-5, "{case}: {what} relative error {error}");
            }
            assert_eq!(ours.3.dtype(), param_dtype, "{case}: the copy's dtype");
            // The copy is the new master value rounded once to its dtype: exactly the cast.
            let exact = ours.0.clone().cast(param_dtype).cast(DType::F32);
            let error = relative_error(ours.3.clone(), exact);
            assert!(error == 0.0, "{case}: the copy differs from the cast master by {error}");
            // f32 partial sums of up to ~1e6 squares of order 1, summed in another order than
            // f64's: well inside 1e-5 relative.
            let squares = squares.into_scalar::<f64>();
            assert!(
                (squares - expected).abs() <= 1e-5 * expected,
                "{case}: sum of squares {squares} against {expected}"
            );
        }
        // A NaN gradient makes a NaN parameter: the amax leaves it out, as the pass does.
        let n = 4_200_000;
        let master = Tensor::<1>::random([n], Distribution::Normal(0.0, 1.0), (&device, DType::F32));
        let nan = Tensor::<1>::from_data(TensorData::new(vec![f32::NAN], [1]), (&device, DType::F32));
        let grad = master.clone().slice_assign(1234..1235, nan).cast(grad_dtype);
        let new = adamw_master_step(
            master.clone(),
            grad,
            master.zeros_like(),
            master.zeros_like(),
            adam_step(1),
            Tensor::<1>::ones([1], (&device, DType::F32)),
            FloatDType::from(param_dtype),
            Tensor::<1>::zeros([1], (&device, DType::F32)),
        );
        let case = format!("grad {grad_dtype:?} param {param_dtype:?}, a NaN");
        assert!(
            new.param.clone().is_nan().any().into_scalar::<bool>(),
            "{case}: a NaN copy"
        );
        assert_eq!(bits(new.amax), bits(amax_pass(&new.param)), "{case}: the copy's amax");
    }
}

/// The sum of squares of many tensors against the f32 sum on the CPU: lengths split into many
/// blocks, into one partial block, into no vectors of 8, empty, and a view into a longer
/// buffer; bf16 and f32.
pub fn sum_of_squares(h: &Harness) {
    use burn::tensor::Device;
    use burn_megatron_kernels::grad_norm::sum_of_squares;
    let device = h.device(0);
    let lengths = [3 * 2048 * 8 + 5 * 8, 1000, 7, 0, 2_000_003];
    for dtype in [DType::BF16, DType::F32] {
        let mut xs: Vec<Tensor<1>> = lengths
            .iter()
            .map(|&n| Tensor::random([n], Distribution::Normal(0.0, 1.0), (&device, dtype)))
            .collect();
        // A view into the middle of a longer buffer, as a parameter's shard of a bucket.
        let long = Tensor::<1>::random([50_000], Distribution::Normal(0.0, 1.0), (&device, dtype));
        xs.push(long.narrow(0, 16_000, 20_000));
        let cpu: f64 = xs
            .iter()
            .map(|x| {
                let x = x.clone().cast(DType::F32).to_device(&Device::flex());
                x.clone().mul(x).sum().into_scalar::<f64>()
            })
            .sum();
        let ours = sum_of_squares(xs, &device).into_scalar::<f64>();
        // f32 sums of ~2M squares in another order: well under 1e-5 relative.
        assert!((ours - cpu).abs() <= 1e-5 * cpu, "{dtype:?}: {ours} against {cpu}");
    }
    let empty = sum_of_squares(Vec::<Tensor<1>>::new(), &device).into_scalar::<f64>();
    assert_eq!(empty, 0.0, "no tensors sum to zero");
}
