//! Choosing the next token from one row's logits: greedy, or sampled at a temperature from the
//! top k and the top p of the distribution, from a seeded generator (every tp rank draws the
//! same token).

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sampling {
    /// The most likely token (the first of equals).
    Greedy,
    /// Drawn from `softmax(logits / temperature)`, kept to the `top_k` most likely tokens
    /// (all if `None`), then to the fewest whose probabilities add up to `top_p` (all if
    /// `None`), renormalized.
    Sample {
        temperature: f64,
        top_k: Option<usize>,
        top_p: Option<f64>,
    },
}

/// A SplitMix64 stream: what a seed draws, the same on every rank.
#[derive(Clone, Debug)]
pub struct Draws(u64);

impl Draws {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

impl Sampling {
    /// Whether the choice is the most likely token (greedy, or sampling at temperature 0).
    pub fn is_greedy(&self) -> bool {
        match *self {
            Sampling::Greedy => true,
            Sampling::Sample { temperature, .. } => temperature <= 0.0,
        }
    }

    /// The token `logits` (one row, the whole vocabulary) choose.
    pub fn choose(&self, logits: &[f32], draws: &mut Draws) -> u32 {
        let greedy = || {
            let best = logits.iter().enumerate().fold(
                (0, f32::NEG_INFINITY),
                |(bi, bv), (i, &v)| if v > bv { (i, v) } else { (bi, bv) },
            );
            best.0 as u32
        };
        let Sampling::Sample {
            temperature,
            top_k,
            top_p,
        } = *self
        else {
            return greedy();
        };
        if temperature <= 0.0 {
            return greedy();
        }
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        order.truncate(top_k.unwrap_or(order.len()).max(1));
        let top = logits[order[0]] as f64;
        let mut probs: Vec<f64> = order
            .iter()
            .map(|&i| ((logits[i] as f64 - top) / temperature).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if let Some(p) = top_p {
            let mut sum = 0.0;
            let keep = probs
                .iter()
                .position(|q| {
                    sum += q;
                    sum >= p
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let mut u = draws.uniform() * total;
        for (&i, q) in order.iter().zip(&probs) {
            if u < *q {
                return i as u32;
            }
            u -= q;
        }
        order[probs.len() - 1] as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_top_k_and_top_p() {
        let logits = [0.0f32, 3.0, 1.0, 2.9];
        let mut draws = Draws::new(1);
        assert_eq!(Sampling::Greedy.choose(&logits, &mut draws), 1);
        // Top 1 is greedy at any temperature.
        let top1 = Sampling::Sample {
            temperature: 5.0,
            top_k: Some(1),
            top_p: None,
        };
        assert!((0..20).all(|_| top1.choose(&logits, &mut draws) == 1));
        // Top p 0.5 keeps tokens 1 and 3 (≈ 0.46 + 0.42), never 0 or 2.
        let nucleus = Sampling::Sample {
            temperature: 1.0,
            top_k: None,
            top_p: Some(0.5),
        };
        let drawn: Vec<u32> = (0..200).map(|_| nucleus.choose(&logits, &mut draws)).collect();
        assert!(drawn.iter().all(|t| [1, 3].contains(t)) && drawn.contains(&1) && drawn.contains(&3));
        // At temperature 1 over all four, the frequencies follow the softmax (±0.05 over 4000
        // draws: several standard deviations).
        let all = Sampling::Sample {
            temperature: 1.0,
            top_k: None,
            top_p: None,
        };
        let n = 4000;
        let ones = (0..n).filter(|_| all.choose(&logits, &mut draws) == 1).count() as f64 / n as f64;
        let expected = 3f64.exp() / [0.0f64, 3.0, 1.0, 2.9].iter().map(|x| x.exp()).sum::<f64>();
        assert!((ones - expected).abs() < 0.05, "{ones} vs {expected}");
    }
}
