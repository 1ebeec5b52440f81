//! Calibration: what reaches each input of a model's block linears over calibration text,
//! recorded by [`Observer`]s ([`InputQuantizer::Observe`](super::InputQuantizer::Observe)) into
//! [`Statistics`]: each channel's largest and mean magnitude (SmoothQuant, AWQ), a histogram of
//! the magnitudes (a static range's percentile or squared-error optimum, as TensorRT's and
//! ModelOpt's histogram calibrators find it), a uniform sample of whole tokens (AWQ's
//! search) and, when asked, the inputs' Gram matrix `XᵀX` (GPTQ's Hessian).
//!
//! Legend: `n` tokens, `c` channels (the input features).

use std::sync::{Arc, Mutex};

use burn::tensor::Tensor;

use super::codes::{Clipping, Codes};

/// Bins of a [`Histogram`].
const BINS: usize = 2048;

/// What a calibration keeps besides each channel's magnitudes and the histogram.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Collect {
    /// A uniform sample of up to this many tokens a site (AWQ's search).
    pub sample_tokens: usize,
    /// Each site's `XᵀX` over all its tokens (GPTQ).
    pub hessian: bool,
}

impl Collect {
    /// A sample of up to `sample_tokens` tokens a site, no Hessian.
    pub fn sample(sample_tokens: usize) -> Self {
        Self {
            sample_tokens,
            hessian: false,
        }
    }

    /// The same, with each site's `XᵀX`.
    pub fn with_hessian(self) -> Self {
        Self { hessian: true, ..self }
    }
}

/// Records the inputs it sees (shared by the clones a model's copies hold).
#[derive(Clone, Debug)]
pub struct Observer(Arc<Mutex<Statistics>>);

impl Observer {
    /// An observer keeping what `collect` asks for.
    pub fn new(collect: Collect) -> Self {
        Self(Arc::new(Mutex::new(Statistics {
            sample_tokens: collect.sample_tokens,
            hessian: collect.hessian.then_some(Hessian::default()),
            ..Statistics::default()
        })))
    }

    /// Adds `x` (`[n, c]`, f32) to the statistics.
    pub fn record(&self, x: Tensor<2>) {
        let [n, c] = x.dims();
        let mut stats = self.0.lock().expect("not poisoned");
        if let Some(hessian) = &mut stats.hessian {
            hessian.add(x.clone());
        }
        let values: Vec<f32> = x.into_data().try_to_vec().expect("f32 values");
        stats.add(&values, n, c);
    }

    /// What it has recorded.
    pub fn statistics(&self) -> Statistics {
        self.0.lock().expect("not poisoned").clone()
    }
}

/// What one input site saw.
#[derive(Clone, Debug, Default)]
pub struct Statistics {
    pub channels: usize,
    pub tokens: usize,
    /// Each channel's largest magnitude.
    pub amax: Vec<f32>,
    /// Each channel's sum of magnitudes.
    pub abs_sum: Vec<f64>,
    pub histogram: Histogram,
    /// A uniform sample of the tokens seen, `[samples, c]` row-major.
    pub samples: Vec<f32>,
    /// `XᵀX` over every token seen, when collected.
    pub hessian: Option<Hessian>,
    sample_tokens: usize,
    /// Tokens offered to the sample so far (reservoir sampling's count) and its generator.
    offered: u64,
    state: u64,
}

impl Statistics {
    fn add(&mut self, values: &[f32], n: usize, c: usize) {
        if self.channels == 0 {
            self.channels = c;
            self.amax = vec![0.0; c];
            self.abs_sum = vec![0.0; c];
            self.state = 0x9E37_79B9_7F4A_7C15;
        }
        assert_eq!(c, self.channels, "an observer sees one input's channels");
        for row in values.chunks_exact(c) {
            for (j, v) in row.iter().enumerate() {
                let a = v.abs();
                self.amax[j] = self.amax[j].max(a);
                self.abs_sum[j] += a as f64;
            }
            self.sample(row);
        }
        self.histogram.add(values);
        self.tokens += n;
    }

    /// Algorithm R: token `t` replaces a uniformly chosen sample with probability `k / t`.
    fn sample(&mut self, row: &[f32]) {
        self.offered += 1;
        let held = self.samples.len() / self.channels.max(1);
        if held < self.sample_tokens {
            self.samples.extend_from_slice(row);
            return;
        }
        // xorshift64*: a fixed stream, so a calibration repeats.
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        let draw = self.state.wrapping_mul(0x2545_F491_4F6C_DD1D) % self.offered;
        if (draw as usize) < self.sample_tokens {
            let c = self.channels;
            self.samples[draw as usize * c..(draw as usize + 1) * c].copy_from_slice(row);
        }
    }

    /// Each channel's mean magnitude.
    pub fn abs_mean(&self) -> Vec<f32> {
        let n = self.tokens.max(1) as f64;
        self.abs_sum.iter().map(|s| (s / n) as f32).collect()
    }

    /// The largest magnitude of any channel.
    pub fn tensor_amax(&self) -> f32 {
        self.amax.iter().fold(0.0f32, |m, a| m.max(*a))
    }

    /// The sampled tokens, `[samples, c]`.
    pub fn sample_tensor(&self, device: &burn::tensor::Device) -> Tensor<2> {
        let n = self.samples.len() / self.channels.max(1);
        Tensor::from_data(
            burn::tensor::TensorData::new(self.samples.clone(), [n, self.channels]),
            device,
        )
    }

    /// The range of one static scale for the whole input on `codes`, as `clipping` chooses it.
    pub fn range(&self, codes: Codes, clipping: Clipping) -> f32 {
        let amax = self.tensor_amax();
        match clipping {
            Clipping::Max => amax,
            Clipping::Percentile(p) => self.histogram.percentile(p).min(amax),
            Clipping::Mse => self.histogram.mse_range(codes, amax),
        }
    }
}

/// The Gram matrix `XᵀX` (`[c, c]`, f32, on the inputs' device) of the tokens it has added:
/// twice GPTQ's layer-wise Hessian of the squared output error, times the token count (neither
/// factor moves its solution).
#[derive(Clone, Debug, Default)]
pub struct Hessian {
    pub gram: Option<Tensor<2>>,
}

impl Hessian {
    fn add(&mut self, x: Tensor<2>) {
        let product = x.clone().transpose().matmul(x);
        self.gram = Some(match self.gram.take() {
            None => product,
            Some(gram) => gram + product,
        });
    }
}

/// Counts of magnitudes in [`BINS`] bins of equal width, from 0; when a larger magnitude
/// arrives, neighbouring bins merge (the width doubles) until it fits.
#[derive(Clone, Debug, Default)]
pub struct Histogram {
    width: f32,
    counts: Vec<u64>,
}

impl Histogram {
    fn add(&mut self, values: &[f32]) {
        let max = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        if self.counts.is_empty() {
            self.counts = vec![0; BINS];
            self.width = (max / BINS as f32).max(f32::MIN_POSITIVE);
        }
        while max >= self.width * BINS as f32 {
            let merged: Vec<u64> = self.counts.chunks_exact(2).map(|p| p[0] + p[1]).collect();
            self.counts = merged;
            self.counts.resize(BINS, 0);
            self.width *= 2.0;
        }
        for v in values {
            let bin = ((v.abs() / self.width) as usize).min(BINS - 1);
            self.counts[bin] += 1;
        }
    }

    fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The upper edge of the first bin at which `p` percent of the magnitudes are counted.
    pub fn percentile(&self, p: f64) -> f32 {
        let target = (p / 100.0 * self.total() as f64).ceil() as u64;
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= target.max(1) {
                return (i + 1) as f32 * self.width;
            }
        }
        self.counts.len() as f32 * self.width
    }

    /// The range among `k/128 · amax` (`k` = 1..=128) whose rounding onto `codes` moves the
    /// counted magnitudes least in squared error, each bin standing at its centre.
    pub fn mse_range(&self, codes: Codes, amax: f32) -> f32 {
        if amax <= 0.0 {
            return amax;
        }
        let error = |range: f32| {
            let scale = range / codes.max();
            self.counts
                .iter()
                .enumerate()
                .filter(|(_, c)| **c > 0)
                .map(|(i, c)| {
                    let v = (i as f32 + 0.5) * self.width;
                    let q = codes.round_value(v / scale) * scale;
                    *c as f64 * ((q - v) as f64).powi(2)
                })
                .sum::<f64>()
        };
        (1..=128)
            .map(|k| amax * k as f32 / 128.0)
            .map(|r| (r, error(r)))
            .fold(
                (amax, f64::INFINITY),
                |best, (r, e)| if e < best.1 { (r, e) } else { best },
            )
            .0
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, TensorData};

    use super::*;

    fn observe(values: Vec<f32>, c: usize, sample: usize) -> Statistics {
        let n = values.len() / c;
        let observer = Observer::new(Collect::sample(sample).with_hessian());
        let device = Device::flex();
        // In two calls, the second with larger magnitudes: the histogram widens.
        let half = n / 2 * c;
        for part in [values[..half].to_vec(), values[half..].to_vec()] {
            let rows = part.len() / c;
            observer.record(Tensor::from_data(TensorData::new(part, [rows, c]), &device));
        }
        observer.statistics()
    }

    /// Per-channel amax and mean magnitude are exact; the histogram counts every value once
    /// across a widening; its percentile and MSE range sit where the closed forms put them.
    #[test]
    fn statistics_of_known_values() {
        // 1000 tokens of 2 channels: channel 0 is t/1000, channel 1 is −2·t/1000.
        let values: Vec<f32> = (0..1000)
            .flat_map(|t| [t as f32 / 1000.0, -2.0 * t as f32 / 1000.0])
            .collect();
        let stats = observe(values, 2, 16);
        assert_eq!(stats.tokens, 1000);
        assert_eq!(stats.amax, vec![0.999, 1.998]);
        let mean = stats.abs_mean();
        assert!(
            (mean[0] - 0.4995).abs() < 1e-6 && (mean[1] - 0.999).abs() < 1e-6,
            "{mean:?}"
        );
        assert_eq!(stats.histogram.total(), 2000);
        assert_eq!(stats.samples.len(), 32, "16 whole tokens");
        // XᵀX in closed form: Σ t² / 10⁶ = 332 833 500 / 10⁶ on the diagonal's first entry,
        // −2 and 4 times it elsewhere (f32 sums of 500 products a call: relative 1e-5).
        let gram = stats.hessian.as_ref().and_then(|h| h.gram.clone()).expect("collected");
        let sum = 332.8335f32;
        let want = [sum, -2.0 * sum, -2.0 * sum, 4.0 * sum];
        for (g, w) in gram.into_data().try_to_vec::<f32>().unwrap().iter().zip(want) {
            assert!((g - w).abs() <= 1e-5 * w.abs(), "{g} against {w}");
        }
        // Below t ≤ 1 lie t of channel 0's magnitudes (uniform on [0, 1)) and t/2 of channel
        // 1's (on [0, 2)): half of them below 2/3. The percentile's bin edge is within two bins.
        let width = stats.histogram.width;
        assert!((stats.histogram.percentile(50.0) - 2.0 / 3.0).abs() <= 2.0 * width + 1e-6);
        assert_eq!(stats.range(Codes::Int8, Clipping::Max), 1.998);
        // Magnitudes spread evenly: int8's step is tiny, so clipping anything costs more than
        // it saves and the optimum is the largest magnitude.
        let mse = stats.range(Codes::Int8, Clipping::Mse);
        assert!(mse > 0.98 * 1.998, "{mse}");
    }

    /// One outlier of 8 among 3999 values spread over [−1, 1]: at its range int4's step (8/7)
    /// rounds most values to 0 (a squared error of about 400 in all); clipping it near 1.25
    /// costs (8 − 1.25)² ≈ 46 for it and ~11 for the rest, so the squared-error range clips.
    /// A lone outlier of 40 costs more clipped than the others lose: it is kept.
    #[test]
    fn mse_clips_an_outlier_when_it_pays() {
        let spread: Vec<f32> = (0..4000).map(|t| ((t % 100) as f32 - 50.0) / 50.0).collect();
        for (outlier, clipped) in [(8.0, true), (40.0, false)] {
            let mut values = spread.clone();
            values[3999] = outlier;
            let range = observe(values, 1, 4).range(Codes::Int4, Clipping::Mse);
            assert_eq!(range < 2.0, clipped, "outlier {outlier}: range {range}");
        }
    }
}
