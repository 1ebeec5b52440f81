//! GPTQ (Frantar et al. 2023): a layer's weights rounded one input row at a time, each row's
//! rounding error spread over the rows not yet rounded, so the layer's outputs on the
//! calibration inputs move least. With `H = XᵀX + λI` over the calibration tokens and its
//! inverse factored `H⁻¹ = UᵀU` (`U` upper triangular), rounding row `i` to `q_i` moves every
//! later row `j` by `−U_ij · (w_i − q_i) / U_ii` (the optimal-brain-surgeon update restricted to
//! the rows still free).
//!
//! - The grid is the [`WeightScheme`]'s: a channel's or the tensor's scale from the whole weight
//!   before any update; a group's scale and zero point from the group's rows as the updates
//!   have left them when its first row comes (AutoGPTQ's `groupsize`), or, in activation order,
//!   from the weight before any update (its `static_groups`, so a group stays `g` consecutive
//!   rows as the export stores it).
//! - Activation order rounds the rows of the largest `H_ii` (the inputs that carry the most)
//!   first, while the most rows remain to absorb their error.
//! - `λ` is `damp` times the mean of `H`'s diagonal; an input no token reached (`H_ii = 0`) has
//!   its rows zeroed and `H_ii = 1`.
//!
//! Legend: weights are Burn's `[in, out]`, `n` inputs (the rows GPTQ walks), `m` outputs.

use burn::tensor::{DType, Tensor, TensorData};

use super::PtqError;
use super::codes::Codes;
use super::weights::{Granularity, QuantizedWeight, WeightScheme};

/// GPTQ's settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gptq {
    /// `λ`, as a fraction of the mean of `H`'s diagonal (GPTQ's `percdamp`; 0.01 by default).
    pub damp: f64,
    /// Round the rows of the largest `H_ii` first (GPTQ's `act_order` / `desc_act`).
    pub act_order: bool,
}

impl Default for Gptq {
    fn default() -> Self {
        Self {
            damp: 0.01,
            act_order: false,
        }
    }
}

impl Gptq {
    /// Its name in a table: `gptq`, `gptq-act-order`.
    pub fn name(&self) -> &'static str {
        match self.act_order {
            false => "gptq",
            true => "gptq-act-order",
        }
    }
}

/// A site's `H` made ready for GPTQ, shared by the layers that read the site: the order its
/// rows are rounded in, `U` in that order, and the inputs no token reached.
pub struct Factored {
    n: usize,
    /// order[p]: the input row rounded at position p.
    order: Vec<usize>,
    u: Vec<f64>,
    dead: Vec<usize>,
    /// Every group's scale from the weight before any update (activation order).
    static_groups: bool,
}

/// `gram` (`XᵀX` of a site's inputs, `[n, n]`) damped, ordered and factored.
pub fn factor(gram: Tensor<2>, settings: Gptq) -> Result<Factored, PtqError> {
    let [n, _] = gram.dims();
    let mut h: Vec<f64> = gram
        .cast(DType::F32)
        .into_data()
        .try_to_vec::<f32>()
        .expect("f32 Gram matrix")
        .into_iter()
        .map(f64::from)
        .collect();
    assert_eq!(h.len(), n * n, "XᵀX is square");
    let mut dead = Vec::new();
    for i in 0..n {
        if h[i * n + i] == 0.0 {
            h[i * n + i] = 1.0;
            dead.push(i);
        }
    }
    let mean = (0..n).map(|i| h[i * n + i]).sum::<f64>() / n as f64;
    for i in 0..n {
        h[i * n + i] += settings.damp * mean;
    }
    let mut order: Vec<usize> = (0..n).collect();
    if settings.act_order {
        order.sort_by(|a, b| h[b * n + b].total_cmp(&h[a * n + a]));
    }
    let permuted: Vec<f64> = (0..n * n).map(|k| h[order[k / n] * n + order[k % n]]).collect();
    let u = inverse_factor(&permuted, n)?;
    Ok(Factored {
        n,
        order,
        u,
        dead,
        static_groups: settings.act_order,
    })
}

/// `w` (`[n, m]`) quantized on `scheme`'s grid by GPTQ with its inputs' [`factor`].
pub fn quantize(scheme: WeightScheme, w: Tensor<2>, f: &Factored) -> Result<QuantizedWeight, PtqError> {
    let grid = Grid::of(scheme)?;
    let [n, m] = w.dims();
    assert_eq!(n, f.n, "the layer reads the factored site's {} inputs", f.n);
    let device = w.device();
    let original: Vec<f32> = w.cast(DType::F32).into_data().try_to_vec().expect("f32 weights");
    let mut rows = original;
    for &i in &f.dead {
        rows[i * m..(i + 1) * m].fill(0.0);
    }
    let (order, u) = (&f.order, &f.u);
    let mut work: Vec<f32> = order.iter().flat_map(|&r| rows[r * m..(r + 1) * m].to_vec()).collect();

    // Scales (and zero points) a scale group of input rows; computed up front or when the
    // group's first row comes.
    let group = grid.group(n);
    let groups = n.div_ceil(group);
    let whole = |values: &[f32], r0: usize, len: usize| {
        let slice = Tensor::<2>::from_data(
            TensorData::new(values[r0 * m..(r0 + len) * m].to_vec(), [len, m]),
            &device,
        );
        grid.params(slice, m)
    };
    let mut params: Vec<Option<Params>> = vec![None; groups];
    if f.static_groups || group == n {
        for (g, p) in params.iter_mut().enumerate() {
            let r0 = g * group;
            *p = Some(whole(&rows, r0, group.min(n - r0)));
        }
    }
    let mut quantized = vec![0.0f32; n * m];
    let mut error = vec![0.0f32; m];
    for p in 0..n {
        let r = order[p];
        let g = r / group;
        if params[g].is_none() {
            // Natural order: the group's rows are work's rows r0.. as the updates left them.
            let r0 = g * group;
            params[g] = Some(whole(&work, r0, group.min(n - r0)));
        }
        let params = params[g].as_ref().expect("set above");
        let d = u[p * n + p];
        let row = &work[p * m..(p + 1) * m];
        let out = &mut quantized[r * m..(r + 1) * m];
        for j in 0..m {
            out[j] = grid.round(row[j], params.scales[j], params.zeros.as_ref().map(|z| z[j]));
            error[j] = ((row[j] - out[j]) as f64 / d) as f32;
        }
        for q in p + 1..n {
            let f = u[p * n + q] as f32;
            if f != 0.0 {
                for (x, e) in work[q * m..(q + 1) * m].iter_mut().zip(&error) {
                    *x -= f * e;
                }
            }
        }
    }

    let stack = |pick: &dyn Fn(&Params) -> Option<Vec<f32>>| -> Option<Tensor<2>> {
        let all: Option<Vec<f32>> = params
            .iter()
            .map(|p| pick(p.as_ref().expect("every group rounded")))
            .collect::<Option<Vec<Vec<f32>>>>()
            .map(|v| v.concat());
        all.map(|v| Tensor::from_data(TensorData::new(v, [groups, m]), &device))
    };
    let scales = match grid.granularity {
        Granularity::Tensor => Some(Tensor::from_data(
            TensorData::new(vec![params[0].as_ref().expect("one group").scales[0]], [1, 1]),
            &device,
        )),
        _ => stack(&|p| Some(p.scales.clone())),
    };
    Ok(QuantizedWeight {
        values: Tensor::from_data(TensorData::new(quantized, [n, m]), &device),
        scales,
        zeros: stack(&|p| p.zeros.clone()),
    })
}

/// One scale group's scale and zero point for each output channel.
#[derive(Clone, Debug)]
struct Params {
    scales: Vec<f32>,
    zeros: Option<Vec<f32>>,
}

/// The grid a scheme rounds onto, one value at a time.
struct Grid {
    scheme: WeightScheme,
    granularity: Granularity,
    /// Symmetric codes, or the largest unsigned code of an asymmetric grid.
    codes: Option<Codes>,
    levels: f32,
}

impl Grid {
    fn of(scheme: WeightScheme) -> Result<Self, PtqError> {
        match scheme {
            WeightScheme::Uniform { codes, granularity, .. } => Ok(Self {
                scheme,
                granularity,
                codes: Some(codes),
                levels: 0.0,
            }),
            WeightScheme::Asymmetric { bits, group, .. } => Ok(Self {
                scheme,
                granularity: Granularity::Group(group),
                codes: None,
                levels: ((1u32 << bits) - 1) as f32,
            }),
            WeightScheme::Minimum { .. } | WeightScheme::Nvfp4 => Err(PtqError::GptqScheme { scheme: scheme.name() }),
        }
    }

    /// The rows a scale covers.
    fn group(&self, n: usize) -> usize {
        match self.granularity {
            Granularity::Group(g) => g.clamp(1, n),
            Granularity::Tensor | Granularity::Channel => n,
        }
    }

    /// The scheme's scale (and zero point) for each of the `m` channels of `rows`, as its
    /// clipping picks them: the scheme quantizing the rows as one group.
    fn params(&self, rows: Tensor<2>, m: usize) -> Params {
        let q = self.scheme.quantize(rows);
        let to_vec = |t: Tensor<2>| t.into_data().try_to_vec::<f32>().expect("f32 scales");
        let mut scales = to_vec(q.scales.expect("a uniform or asymmetric scheme has scales"));
        if scales.len() == 1 {
            scales = vec![scales[0]; m];
        }
        Params {
            scales,
            zeros: q.zeros.map(to_vec),
        }
    }

    /// `x` rounded onto the grid of `scale` (and `zero`), dequantized: what the scheme's own
    /// rounding gives it (ties to even, saturating).
    fn round(&self, x: f32, scale: f32, zero: Option<f32>) -> f32 {
        let scale = scale.max(f32::MIN_POSITIVE);
        match (self.codes, zero) {
            (Some(codes), _) => codes.round_value(x / scale) * scale,
            (None, Some(zero)) => (((x / scale).round_ties_even() + zero).clamp(0.0, self.levels) - zero) * scale,
            (None, None) => unreachable!("an asymmetric grid has zero points"),
        }
    }
}

/// `U`, upper triangular with `UᵀU = H⁻¹`, of a symmetric positive definite `h` (`[n, n]`,
/// row-major): `H = RRᵀ` with `R` upper (a Cholesky factorization from the last row up), and
/// `U = R⁻¹`, since `H⁻¹ = R⁻ᵀR⁻¹`.
fn inverse_factor(h: &[f64], n: usize) -> Result<Vec<f64>, PtqError> {
    let mut r = vec![0.0f64; n * n];
    for j in (0..n).rev() {
        let tail = |a: usize, b: usize, r: &[f64]| dot(&r[a * n + j + 1..(a + 1) * n], &r[b * n + j + 1..(b + 1) * n]);
        let pivot = h[j * n + j] - tail(j, j, &r);
        if pivot.is_nan() || pivot <= 0.0 {
            return Err(PtqError::GptqHessian { row: j });
        }
        let d = pivot.sqrt();
        r[j * n + j] = d;
        for i in 0..j {
            r[i * n + j] = (h[i * n + j] - tail(i, j, &r)) / d;
        }
    }
    // U = R⁻¹ by back substitution, a column c at a time, kept transposed (ut[c·n + i] = U_ic)
    // so both dot products run along rows.
    let mut ut = vec![0.0f64; n * n];
    for c in 0..n {
        ut[c * n + c] = 1.0 / r[c * n + c];
        for i in (0..c).rev() {
            let s = dot(&r[i * n + i + 1..i * n + c + 1], &ut[c * n + i + 1..c * n + c + 1]);
            ut[c * n + i] = -s / r[i * n + i];
        }
    }
    Ok((0..n * n).map(|k| ut[(k % n) * n + k / n]).collect())
}

/// `a · b`, summed in eight lanes so the compiler can keep them in vector registers (a single
/// running sum must add in order, one product at a time).
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut lanes = [0.0f64; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f64 = a8.remainder().iter().zip(b8.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in a8.zip(b8) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f64>() + tail
}

#[cfg(test)]
mod tests {
    use burn::tensor::Device;

    use super::super::codes::Clipping;
    use super::*;

    fn values(x: Tensor<2>) -> Vec<f32> {
        x.into_data().try_to_vec().unwrap()
    }

    fn gptq(scheme: WeightScheme, w: Tensor<2>, gram: Tensor<2>, settings: Gptq) -> Result<QuantizedWeight, PtqError> {
        quantize(scheme, w, &factor(gram, settings)?)
    }

    fn int8_channel() -> WeightScheme {
        WeightScheme::Uniform {
            codes: Codes::Int8,
            granularity: Granularity::Channel,
            clipping: Clipping::Max,
        }
    }

    fn asym(group: usize) -> WeightScheme {
        WeightScheme::Asymmetric {
            bits: 4,
            group,
            clipping: Clipping::Max,
        }
    }

    /// `UᵀU · H` is the identity on a random well-conditioned `H` (f64: 1e-9 leaves room for
    /// n = 24's rounding and H's condition number of ~10).
    #[test]
    fn the_factor_inverts_h() {
        let n = 24;
        let device = Device::flex();
        let x = crate::init::normal([64, n], 1, 1.0, &device);
        let h: Vec<f64> = values(x.clone().transpose().matmul(x))
            .into_iter()
            .map(f64::from)
            .collect();
        let u = inverse_factor(&h, n).unwrap();
        for i in 0..n {
            for j in 0..i {
                assert_eq!(u[i * n + j], 0.0, "upper triangular");
            }
        }
        for i in 0..n {
            for j in 0..n {
                let uu_h: f64 = (0..n)
                    .map(|k| (0..n).map(|l| u[l * n + i] * u[l * n + k]).sum::<f64>() * h[k * n + j])
                    .sum();
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((uu_h - want).abs() < 1e-9, "({i}, {j}): {uu_h}");
            }
        }
        let not_definite = vec![1.0, 2.0, 2.0, 1.0];
        assert_eq!(
            inverse_factor(&not_definite, 2).unwrap_err(),
            PtqError::GptqHessian { row: 0 }
        );
    }

    /// Uncorrelated inputs (`H` diagonal) leave nothing to compensate: GPTQ rounds to the
    /// nearest code, exactly what the scheme does on its own, in groups too.
    #[test]
    fn diagonal_h_rounds_to_nearest() {
        let device = Device::flex();
        let w = crate::init::normal([40, 6], 2, 1.0, &device);
        let h = Tensor::<2>::eye(40, &device).mul_scalar(3.0);
        for scheme in [int8_channel(), asym(16)] {
            for act_order in [false, true] {
                let settings = Gptq { damp: 0.01, act_order };
                let got = gptq(scheme, w.clone(), h.clone(), settings).unwrap();
                let want = scheme.quantize(w.clone());
                assert_eq!(values(got.values), values(want.values), "{scheme:?}");
                assert_eq!(values(got.scales.unwrap()), values(want.scales.unwrap()));
            }
        }
    }

    /// Rows 0 and 1 coupled (`H`'s block `[[4, 2], [2, 3]]`), row 2 alone at the channel's
    /// largest magnitude (range 1, int8 step 1/127; no damping): after rounding `w0` to `q0`
    /// the closed form moves `w1` by `(w0 − q0) · H01 / H11` (the output error least with `w0`
    /// fixed), which here takes it across a rounding boundary (code 38.61 → 38.45); row 2 is on
    /// the grid and untouched.
    #[test]
    fn coupled_rows_match_the_closed_form() {
        let device = Device::flex();
        let w = Tensor::<2>::from_data(TensorData::new(vec![0.5021f32, 0.3040, 1.0], [3, 1]), &device);
        let h = vec![4.0f32, 2.0, 0.0, 2.0, 3.0, 0.0, 0.0, 0.0, 1.0];
        let h = Tensor::<2>::from_data(TensorData::new(h, [3, 3]), &device);
        let settings = Gptq {
            damp: 0.0,
            act_order: false,
        };
        let got = values(gptq(int8_channel(), w, h, settings).unwrap().values);
        let step = 1.0f32 / 127.0;
        let q0 = (0.5021f32 / step).round_ties_even() * step;
        let w1 = 0.3040 + (0.5021 - q0) * 2.0 / 3.0;
        assert_eq!((w1 / step).round_ties_even(), 38.0, "the update crosses 38.5");
        assert_eq!(got[0], q0);
        assert!((got[1] - 38.0 * step).abs() < 1e-7, "{} against 38 steps", got[1]);
        assert_eq!(got[2], 1.0);
    }

    /// On correlated inputs GPTQ's outputs are closer to the float layer's than round to
    /// nearest's, every value is a code of its group's grid, and activation order stays on the
    /// same groups' grids.
    #[test]
    fn correlated_inputs_lose_less_than_rounding() {
        let device = Device::flex();
        let [t, n, m] = [256, 64, 24];
        let base = crate::init::normal([t, 8], 3, 1.0, &device);
        let mix = crate::init::normal([8, n], 4, 1.0, &device);
        let noise = crate::init::normal([t, n], 5, 0.1, &device);
        let x = base.matmul(mix) + noise;
        let w = crate::init::normal([n, m], 6, 1.0, &device);
        let gram = x.clone().transpose().matmul(x.clone());
        let output_error = |q: Tensor<2>| {
            let d = x.clone().matmul(q - w.clone());
            d.powi_scalar(2).sum().into_scalar::<f32>()
        };
        for scheme in [int8_channel(), asym(16)] {
            let nearest = output_error(scheme.quantize(w.clone()).values);
            for act_order in [false, true] {
                let settings = Gptq { damp: 0.01, act_order };
                let got = gptq(scheme, w.clone(), gram.clone(), settings).unwrap();
                let gptq = output_error(got.values.clone());
                assert!(gptq < 0.7 * nearest, "{scheme:?} {act_order}: {gptq} against {nearest}");
                // On the grid: (value / scale) + zero is a whole code within range.
                let q = values(got.values);
                let scales = values(got.scales.unwrap());
                let zeros = got.zeros.map(values);
                for (k, v) in q.iter().enumerate() {
                    let (row, col) = (k / m, k % m);
                    let g = match scheme {
                        WeightScheme::Asymmetric { group, .. } => row / group,
                        _ => 0,
                    };
                    let code = v / scales[g * m + col] + zeros.as_ref().map_or(0.0, |z| z[g * m + col]);
                    assert!((code - code.round()).abs() < 1e-3, "{scheme:?}: code {code}");
                    assert!((-127.0..=127.0).contains(&code.round()));
                }
            }
        }
    }

    /// NVFP4's blocks have no GPTQ grid here: a typed error, before any rounding.
    #[test]
    fn nvfp4_is_refused() {
        let device = Device::flex();
        let w = Tensor::<2>::zeros([16, 4], &device);
        let err = gptq(WeightScheme::Nvfp4, w, Tensor::eye(16, &device), Gptq::default()).unwrap_err();
        assert_eq!(err, PtqError::GptqScheme { scheme: "nvfp4".into() });
    }
}
