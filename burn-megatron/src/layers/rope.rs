//! Rotary position embedding, rotating the two halves of each head (the Hugging Face Llama and
//! Megatron layout; Burn's `RotaryEncoding` rotates interleaved pairs instead), with the
//! frequency scalings of Hugging Face's `rope_type` that Llama checkpoints use. Scaling only
//! changes the cos/sin tables; the kernel that applies them is the same.

use burn::config::Config;
use burn::tensor::{DType, Device, Int, Tensor};
use burn_megatron_dist::ProcessGroup;
use burn_megatron_kernels::quant::notes::NoteAmaxes;

use super::context::ContextLayout;

/// How the inverse frequencies `θ^(-2i/k)` are scaled for contexts longer than the training
/// one (Hugging Face's `rope_type`, computed as transformers' `ROPE_INIT_FUNCTIONS` do).
#[derive(Config, Debug, Copy, PartialEq)]
pub enum RopeScaling {
    /// YaRN (`yarn`: Qwen's long contexts, DeepSeek-V3): each frequency interpolated by
    /// `factor` or kept, along a linear ramp between the pairs that turn `beta_fast` and
    /// `beta_slow` times over `original_max_position_embeddings` positions (the ramp's ends
    /// rounded out when `truncate`), and the cos/sin tables scaled by
    /// [`attention_factor`](Self::attention_factor).
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        /// The attention factor given, else derived from `factor` with `mscale` and
        /// `mscale_all_dim` (YaRN's `0.1·m·ln(factor) + 1`).
        attention_factor: Option<f64>,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        truncate: bool,
    },
    /// Plain RoPE (`default`).
    None,
    /// Positions divided by `factor` (`linear`): every inverse frequency divided by it.
    Linear { factor: f64 },
    /// Llama 3.1's frequency-dependent scaling (`llama3`): wavelengths longer than
    /// `original_max_position_embeddings / low_freq_factor` are divided by `factor`, shorter
    /// than `original_max_position_embeddings / high_freq_factor` are kept, and the band between
    /// is interpolated smoothly.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
}

impl RopeScaling {
    /// The inverse frequency of pair `i` of `half` (head_dim / 2) for base `theta`.
    pub fn inv_freq(&self, theta: f64, i: usize, half: usize) -> f64 {
        let inv_freq = theta.powf(-((2 * i) as f64) / (2 * half) as f64);
        match *self {
            Self::None => inv_freq,
            Self::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                // transformers' `_compute_yarn_parameters`, one frequency at a time: the pair's
                // share of extrapolation (its own frequency) against interpolation (÷ factor).
                let dim = (2 * half) as f64;
                let positions = original_max_position_embeddings as f64;
                let correction = |rotations: f64| {
                    dim * (positions / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let extrapolation = 1.0 - ramp;
                inv_freq / factor * (1.0 - extrapolation) + inv_freq * extrapolation
            }
            Self::Linear { factor } => inv_freq / factor,
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                // transformers' `_compute_llama3_parameters`, one frequency at a time.
                let old_context = original_max_position_embeddings as f64;
                let (low_freq_wavelen, high_freq_wavelen) =
                    (old_context / low_freq_factor, old_context / high_freq_factor);
                let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
                if wavelen > low_freq_wavelen {
                    inv_freq / factor
                } else if wavelen < high_freq_wavelen {
                    inv_freq
                } else {
                    let smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
                }
            }
        }
    }
}

impl RopeScaling {
    /// What the cos/sin tables are multiplied by (YaRN's attention factor; 1 otherwise), so q·k
    /// of the rotated dims is scaled by its square.
    pub fn attention_factor(&self) -> f64 {
        match *self {
            Self::Yarn {
                factor,
                attention_factor,
                mscale,
                mscale_all_dim,
                ..
            } => attention_factor.unwrap_or_else(|| match (mscale, mscale_all_dim) {
                (Some(m), Some(all)) if m != 0.0 && all != 0.0 => yarn_mscale(factor, m) / yarn_mscale(factor, all),
                _ => yarn_mscale(factor, 1.0),
            }),
            _ => 1.0,
        }
    }
}

/// YaRN's `mscale`: `0.1·m·ln(factor) + 1`, 1 where the factor does not stretch.
pub fn yarn_mscale(factor: f64, m: f64) -> f64 {
    match factor <= 1.0 {
        true => 1.0,
        false => 0.1 * m * factor.ln() + 1.0,
    }
}

/// The cos/sin tables for positions `0..max_seq_len`.
#[derive(Clone, Debug)]
pub struct Rope {
    /// `[max_seq_len, head_dim/2]`
    cos: Tensor<2>,
    sin: Tensor<2>,
    theta: f64,
    scaling: RopeScaling,
}

impl Rope {
    /// `head_dim` must be even (checked by the attention config).
    pub fn new(head_dim: usize, max_seq_len: usize, theta: f64, scaling: RopeScaling, device: &Device) -> Self {
        let half = head_dim / 2;
        let inv_freqs: Vec<f64> = (0..half).map(|i| scaling.inv_freq(theta, i, half)).collect();
        let factor = scaling.attention_factor();
        let mut cos = Vec::with_capacity(max_seq_len * half);
        let mut sin = Vec::with_capacity(max_seq_len * half);
        for pos in 0..max_seq_len {
            for inv_freq in &inv_freqs {
                let angle = pos as f64 * inv_freq;
                cos.push((angle.cos() * factor) as f32);
                sin.push((angle.sin() * factor) as f32);
            }
        }
        let table = |v: Vec<f32>| Tensor::<1>::from_floats(v.as_slice(), device).reshape([max_seq_len, half]);
        Self {
            cos: table(cos),
            sin: table(sin),
            theta,
            scaling,
        }
    }

    /// The base θ of the inverse frequencies.
    pub fn theta(&self) -> f64 {
        self.theta
    }

    pub fn scaling(&self) -> RopeScaling {
        self.scaling
    }

    /// Rotates `x` for positions `0..s`.
    ///
    /// # Shapes
    /// `[b, heads, s, head_dim]` → the same
    pub fn apply(&self, x: Tensor<4>) -> Tensor<4> {
        self.apply_noting(x, NoteAmaxes::default())
    }

    /// [`apply`](Self::apply), the amaxes `notes` names taken as they are written on CUDA (the
    /// input gradient's, for an FP8 tensorwise projection before it).
    pub fn apply_noting(&self, x: Tensor<4>, notes: NoteAmaxes) -> Tensor<4> {
        // One kernel each way on CUDA (burn_megatron_kernels::rope), f32 rotation.
        burn_megatron_kernels::rope::rope_noting(x, self.cos.clone(), self.sin.clone(), notes)
    }

    /// Rotates `x` for positions `start..start + s` (decoding after a cache of `start`).
    ///
    /// # Shapes
    /// `[b, heads, s, head_dim]` → the same
    pub fn apply_from(&self, x: Tensor<4>, start: usize) -> Tensor<4> {
        let [max, _] = self.cos.dims();
        let rows = max - start.min(max);
        let table = |t: &Tensor<2>| t.clone().narrow(0, start.min(max), rows);
        burn_megatron_kernels::rope::rope(x, table(&self.cos), table(&self.sin))
    }

    /// Rotates `x` for each token's own position (`positions`, e.g. a packed document's,
    /// restarting at 0 with each document), in f32 tensor ops.
    ///
    /// # Shapes
    /// `[b, heads, s, head_dim]`, `[b, s]` → the same
    pub fn apply_at(&self, x: Tensor<4>, positions: Tensor<2, Int>) -> Tensor<4> {
        let [b, _, s, d] = x.dims();
        let half = d / 2;
        let dtype = x.dtype();
        let flat = positions.reshape([b * s]);
        let table = |t: &Tensor<2>| t.clone().select(0, flat.clone()).reshape([b, 1, s, half]);
        let (cos, sin) = (table(&self.cos), table(&self.sin));
        let x = x.cast(DType::F32);
        let (x1, x2) = (x.clone().narrow(3, 0, half), x.narrow(3, half, half));
        let rotated_1 = x1.clone() * cos.clone() - x2.clone() * sin.clone();
        let rotated_2 = x2 * cos + x1 * sin;
        Tensor::cat(vec![rotated_1, rotated_2], 3).cast(dtype)
    }

    /// Rotates `x`, a context-parallel rank's two chunks of each sequence side by side, each for
    /// the positions its chunk holds (`context/layout.rs`).
    ///
    /// # Shapes
    /// `[b, heads, 2L, head_dim]` → the same
    pub fn apply_chunks(&self, x: Tensor<4>, cp: &ProcessGroup) -> Tensor<4> {
        let layout = ContextLayout::new(cp);
        let l = x.dims()[2] / 2;
        let [a, b] = layout.chunks_of(layout.rank);
        let early = self.apply_from(x.clone().narrow(2, 0, l), a * l);
        let late = self.apply_from(x.narrow(2, l, l), b * l);
        Tensor::cat(vec![early, late], 2)
    }

    /// The `(cos, sin)` tables, `[max_seq_len, head_dim/2]` f32 each (for kernels that rotate
    /// at a position they read from the device, `burn_megatron_kernels::decode`).
    pub fn tables(&self) -> (Tensor<2>, Tensor<2>) {
        (self.cos.clone(), self.sin.clone())
    }

    /// Positions the tables cover.
    pub fn max_seq_len(&self) -> usize {
        self.cos.dims()[0]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-computed: head_dim 4, position 1, θ = 10000. Frequencies 1 and 10000^(-1/2) = 0.01;
    /// x = [1, 2, 3, 4] has halves (1, 2) and (3, 4), so the output is
    /// [1·cos1 − 3·sin1, 2·cos.01 − 4·sin.01, 3·cos1 + 1·sin1, 4·cos.01 + 2·sin.01].
    #[test]
    fn rotates_halves_as_hugging_face_llama() {
        let dev = Device::flex();
        let rope = Rope::new(4, 2, 10000.0, RopeScaling::None, &dev);
        let x = Tensor::<1>::from_floats([0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0], &dev).reshape([1, 1, 2, 4]);
        let out = rope
            .apply(x)
            .narrow(2, 1, 1)
            .reshape([4])
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        let (c1, s1, c2, s2) = (1f32.cos(), 1f32.sin(), 0.01f32.cos(), 0.01f32.sin());
        let expected = [c1 - 3.0 * s1, 2.0 * c2 - 4.0 * s2, 3.0 * c1 + s1, 4.0 * c2 + 2.0 * s2];
        for (a, e) in out.iter().zip(expected) {
            // f32 trigonometry of the same angles: a few ulps.
            assert!((a - e).abs() < 1e-5, "{out:?} vs {expected:?}");
        }
    }

    /// Llama 3 scaling by hand for head_dim 8 (frequencies θ^0, θ^-1/4, θ^-1/2, θ^-3/4 with
    /// θ = 10000: 1, 0.1, 0.01, 0.001; wavelengths 2π/f ≈ 6.28, 62.8, 628, 6283), factor 8,
    /// low 1, high 4, original context 100: wavelengths under 25 are kept, over 100 divided by
    /// 8, and 62.8 in between is interpolated with smooth = (100/62.83 − 1)/3.
    #[test]
    fn llama3_scaling_keeps_high_divides_low_and_smooths_between() {
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 100,
        };
        let got: Vec<f64> = (0..4).map(|i| scaling.inv_freq(10000.0, i, 4)).collect();
        let smooth = (100.0 / (2.0 * std::f64::consts::PI / 0.1) - 1.0) / 3.0;
        let expected = [1.0, (1.0 - smooth) * 0.1 / 8.0 + smooth * 0.1, 0.01 / 8.0, 0.001 / 8.0];
        for (g, e) in got.iter().zip(expected) {
            // f64 powers of 10000: exact to a few ulps.
            assert!((g - e).abs() <= 1e-12 * e, "{got:?} vs {expected:?}");
        }
        let linear = RopeScaling::Linear { factor: 4.0 };
        assert!((linear.inv_freq(10000.0, 1, 4) - 0.1 / 4.0).abs() < 1e-15);
    }

    /// YaRN by hand for head_dim 8 (frequencies 1, 0.1, 0.01, 0.001 at θ = 10⁴), factor 4 over
    /// 16 original positions, β 32 and 1: the correction dims are
    /// `8·ln(16 / (β·2π)) / (2·ln 10⁴)`, −1.10 and 0.41, truncated to 0 and 1, so pair 0 keeps
    /// its frequency, pairs 1.. are divided by 4; the tables scale by `0.1·ln 4 + 1`.
    #[test]
    fn yarn_interpolates_past_the_ramp_and_scales_the_tables() {
        let scaling = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 16,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
        };
        let got: Vec<f64> = (0..4).map(|i| scaling.inv_freq(10000.0, i, 4)).collect();
        let expected = [1.0, 0.1 / 4.0, 0.01 / 4.0, 0.001 / 4.0];
        for (g, e) in got.iter().zip(expected) {
            // f64 powers of 10000: exact to a few ulps.
            assert!((g - e).abs() <= 1e-12 * e, "{got:?} vs {expected:?}");
        }
        assert!((scaling.attention_factor() - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-15);
    }
}
