//! Smoothing: a per-channel scale `s` moved from each site's input into the weights that read
//! it (`x · W = (x / s) · (diag(s) · W)`), folded into the layer that made the input so the
//! model computes the same function before quantization:
//!
//! | site | `1 / s` folds into | `s` multiplies the rows of |
//! |---|---|---|
//! | attention input | the attention norm's weight | `wq`, `wk`, `wv` |
//! | heads' outputs | `wv`'s columns (one scale a kv head's channel) | `wo` |
//! | MLP input | the MLP norm's weight | `w1`, `w3` |
//! | SwiGLU output | `w3`'s columns (`silu(a) ⊙ b` is linear in `b`) | `w2` |
//!
//! Under grouped-query attention the query heads that share a kv head read one value vector, so
//! their output channels share a scale: the heads' statistics are pooled over each group (AWQ
//! itself skips this site when heads and kv heads differ).
//!
//! - SmoothQuant (Xiao et al. 2023): `s_j = max|x_j|^α / max|W_j|^(1−α)`, the weights' rows of
//!   every layer of the site, α = 0.5 by default.
//! - AWQ (Lin et al. 2024): `s = mean|x|^α`, normalized to a geometric mean of 1 over its
//!   extremes, α searched on a grid for the least squared error of the site's outputs on the
//!   calibration sample, the weights quantized by the scheme (at its largest-magnitude range);
//!   with [`Clipping::Mse`](crate::precision::ptq::Clipping::Mse) each group's range is then searched for the
//!   least squared error of the outputs too (AWQ's clip search), on the sample divided by `s`.
//!
//! Legend: `c` the site's channels, `n` sampled tokens, `g` kv heads, `r` query heads a kv
//! head, `k` head_dim.

use burn::tensor::{DType, Tensor, TensorData};

use super::Calibration;
use crate::models::llama::{LinearMut, Llama, LlamaBlock, Site};
use crate::precision::ptq::{PtqError, Smoothing, Statistics, WeightScheme};

/// The kv-head layout of the heads' outputs.
#[derive(Clone, Copy, Debug)]
struct Heads {
    kv: usize,
    per_kv: usize,
    dim: usize,
}

impl Heads {
    /// `[r·g·k]` (query head `h` reading kv head `h / r`) → `[g·k]`: the largest or the mean of
    /// each group's channels.
    fn pool(self, x: Tensor<1>, largest: bool) -> Tensor<1> {
        let grouped: Tensor<3> = x.reshape([self.kv, self.per_kv, self.dim]);
        let pooled = match largest {
            true => grouped.max_dim(1),
            false => grouped.mean_dim(1),
        };
        pooled.reshape([self.kv * self.dim])
    }

    /// `[g·k]` → `[r·g·k]`: each kv head's channels for every query head reading it.
    fn expand(self, x: Tensor<1>) -> Tensor<1> {
        let grouped: Tensor<3> = x.reshape([self.kv, 1, self.dim]);
        grouped
            .repeat_dim(1, self.per_kv)
            .reshape([self.kv * self.per_kv * self.dim])
    }
}

/// Each site's scales (`[c]`; its inputs are divided by them), `[block][site]` in
/// [`Site::ALL`]'s order.
pub(super) type SiteScales = Vec<Vec<Tensor<1>>>;

/// `model` with `smoothing`'s scales folded in at every site of every block, and the scales.
pub(super) fn smooth(
    mut model: Llama,
    calibration: &Calibration,
    smoothing: Smoothing,
    weights: WeightScheme,
) -> Result<(Llama, Option<SiteScales>), PtqError> {
    if smoothing == Smoothing::None {
        return Ok((model, None));
    }
    let mut scales = Vec::with_capacity(model.layers.len());
    for (i, block) in model.layers.iter_mut().enumerate() {
        let mut sites = Vec::with_capacity(Site::ALL.len());
        let a = block.attention.as_ref().ok_or(PtqError::LatentAttention)?;
        let heads = Heads {
            kv: a.n_kv_heads,
            per_kv: a.n_heads / a.n_kv_heads,
            dim: a.head_dim,
        };
        for site in Site::ALL {
            let stats = calibration.site(i, site);
            let ws = site
                .linears()
                .iter()
                .map(|path| Ok(linear(block, path)?.weight.val().cast(DType::F32)))
                .collect::<Result<Vec<_>, PtqError>>()?;
            let shared = (site == Site::AttentionOutput).then_some(heads);
            let s = match smoothing {
                Smoothing::SmoothQuant { alpha } => smoothquant(stats, &ws, alpha, shared),
                Smoothing::Awq { grid } => awq(stats, &ws, grid, weights, shared),
                Smoothing::None => unreachable!("returned above"),
            };
            fold(block, site, s.clone(), heads)?;
            sites.push(s);
        }
        scales.push(sites);
    }
    Ok((model, Some(scales)))
}

/// A channel vector of the host on `like`'s device, f32.
fn channels(values: &[f32], like: &Tensor<2>) -> Tensor<1> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), &like.device())
}

/// SmoothQuant's `s = max|x|^α / max|W|^(1−α)` (`[c]`), shared over kv groups where `heads`.
fn smoothquant(stats: &Statistics, ws: &[Tensor<2>], alpha: f64, heads: Option<Heads>) -> Tensor<1> {
    let x_max = channels(&stats.amax, &ws[0]);
    let w_max = ws
        .iter()
        .map(|w| w.clone().abs().max_dim(1).reshape([w.dims()[0]]))
        .reduce(|a, b| a.max_pair(b))
        .expect("a site has a layer");
    let scale =
        |x: Tensor<1>, w: Tensor<1>| x.clamp_min(1e-5).powf_scalar(alpha) / w.clamp_min(1e-5).powf_scalar(1.0 - alpha);
    match heads {
        Some(h) => h.expand(scale(h.pool(x_max, true), h.pool(w_max, true))),
        None => scale(x_max, w_max),
    }
}

/// AWQ's scales: `mean|x|^α` for the α of `grid` points in `[0, 1)` whose quantized layers
/// reproduce the site's outputs on the sample best.
fn awq(stats: &Statistics, ws: &[Tensor<2>], grid: usize, weights: WeightScheme, heads: Option<Heads>) -> Tensor<1> {
    let device = ws[0].device();
    let mean = channels(&stats.abs_mean(), &ws[0]);
    let largest = mean.clone().max().into_scalar::<f32>().max(f32::MIN_POSITIVE);
    let mean = mean.clamp_min(1e-4 * largest);
    let mean = match heads {
        Some(h) => h.pool(mean, false),
        None => mean,
    };
    let x = stats.sample_tensor(&device); // [n, c]
    let reference: Vec<Tensor<2>> = ws.iter().map(|w| x.clone().matmul(w.clone())).collect();
    // The search quantizes at the largest magnitude; the scheme's own clipping comes after.
    let search = weights.at_max();
    let mut best: Option<(f64, Tensor<1>)> = None;
    for step in 0..grid.max(1) {
        let alpha = step as f64 / grid.max(1) as f64;
        let s = mean.clone().powf_scalar(alpha);
        let (hi, lo) = (
            s.clone().max().into_scalar::<f32>(),
            s.clone().min().into_scalar::<f32>(),
        );
        let s = s.div_scalar((hi * lo).sqrt().max(f32::MIN_POSITIVE));
        let s = match heads {
            Some(h) => h.expand(s),
            None => s,
        };
        let scaled_x = x.clone() / s.clone().unsqueeze_dim::<2>(0);
        let error: f64 = ws
            .iter()
            .zip(&reference)
            .map(|(w, y)| {
                let q = search.quantize(w.clone() * s.clone().unsqueeze_dim::<2>(1)).values;
                (scaled_x.clone().matmul(q) - y.clone())
                    .powi_scalar(2)
                    .sum()
                    .into_scalar::<f64>()
            })
            .sum();
        if best.as_ref().is_none_or(|(e, _)| error < *e) {
            best = Some((error, s));
        }
    }
    best.expect("a grid point").1
}

/// The linear layer of `block` at `path`; a MoE block's MLP is none.
fn linear<'a>(block: &'a mut LlamaBlock, path: &str) -> Result<LinearMut<'a>, PtqError> {
    crate::models::llama::linear_mut(block, path).ok_or(PtqError::MixtureOfExperts)
}

/// Folds `s` (`[c]`) into `block` at `site`: the weights' rows times `s`, the input's maker
/// divided by it.
fn fold(block: &mut LlamaBlock, site: Site, s: Tensor<1>, heads: Heads) -> Result<(), PtqError> {
    let rows = |w: Tensor<2>, s: &Tensor<1>| {
        let dtype = w.dtype();
        (w.cast(DType::F32) * s.clone().unsqueeze_dim::<2>(1)).cast(dtype)
    };
    let columns = |w: Tensor<2>, s: &Tensor<1>| {
        let dtype = w.dtype();
        (w.cast(DType::F32) / s.clone().unsqueeze_dim::<2>(0)).cast(dtype)
    };
    let divide = |g: Tensor<1>, s: &Tensor<1>| {
        let dtype = g.dtype();
        (g.cast(DType::F32) / s.clone()).cast(dtype)
    };
    for path in site.linears() {
        let linear = linear(block, path)?;
        *linear.weight = linear.weight.clone().map(|w| rows(w, &s));
    }
    match site {
        Site::AttentionInput => {
            let norm = &mut block.attention_norm.weight;
            *norm = norm.clone().map(|g| divide(g, &s));
        }
        Site::MlpInput => {
            let norm = &mut block.mlp_norm.weight;
            *norm = norm.clone().map(|g| divide(g, &s));
        }
        Site::AttentionOutput => {
            // Every query head of a group holds its kv head's scales: take the first's.
            let s_kv: Tensor<3> = s.reshape([heads.kv, heads.per_kv, heads.dim]);
            let s_kv = s_kv.narrow(1, 0, 1).reshape([heads.kv * heads.dim]);
            let wv = linear(block, "attention.wv")?.weight;
            *wv = wv.clone().map(|w| columns(w, &s_kv));
        }
        Site::MlpHidden => {
            let w3 = linear(block, "mlp.w3")?.weight;
            *w3 = w3.clone().map(|w| columns(w, &s));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Int, Tensor, TensorData};
    use burn_megatron_dist::ProcessGroups;

    use super::*;
    use crate::init::{InitMode, ParamInit};
    use crate::models::llama::LlamaConfig;
    use crate::posttrain::ptq::calibrate;
    use crate::precision::ptq::{Clipping, Codes, Collect, Granularity};

    /// Folding either smoothing's scales leaves the model's function as it was (before any
    /// quantization), grouped-query attention included: the logits agree to f32 rounding.
    #[test]
    fn folded_scales_keep_the_function() {
        let device = Device::flex();
        // 4 query heads over 2 kv heads of 8, so the heads' outputs share scales in pairs.
        let config = LlamaConfig::llama(40, 32, 2, 4, 2, 48, 12);
        let model = config
            .init(&device, &ProcessGroups::single(), &ParamInit::new(3, InitMode::Full))
            .unwrap();
        let ids: Vec<i64> = (0..24).map(|i| (i * 7 + 3) % 40).collect();
        let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [2, 12]), &device);
        let calibration = calibrate(&model, std::slice::from_ref(&ids), Collect::sample(16)).unwrap();
        let before: Vec<f32> = model.forward(ids.clone()).unwrap().into_data().try_to_vec().unwrap();
        let weights = WeightScheme::Uniform {
            codes: Codes::Int4,
            granularity: Granularity::Group(16),
            clipping: Clipping::Max,
        };
        for smoothing in [Smoothing::SmoothQuant { alpha: 0.5 }, Smoothing::Awq { grid: 5 }] {
            let (smoothed, _) = smooth(model.clone(), &calibration, smoothing, weights).unwrap();
            let norm: Vec<f32> = smoothed.layers[0]
                .attention_norm
                .weight
                .val()
                .into_data()
                .try_to_vec()
                .unwrap();
            assert!(
                norm.iter().any(|g| (g - 1.0).abs() > 1e-3),
                "{smoothing:?} moved no scale"
            );
            let after: Vec<f32> = smoothed.forward(ids.clone()).unwrap().into_data().try_to_vec().unwrap();
            let worst = before
                .iter()
                .zip(&after)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            // The same products with each term scaled and unscaled once more: a few f32 ulps of
            // logits of magnitude ~1.
            assert!(worst < 1e-5, "{smoothing:?}: logits moved by {worst}");
        }
    }
}
