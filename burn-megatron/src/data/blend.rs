//! Several datasets of samples (packed, or chats) mixed by weight, as Megatron's blended dataset
//! mixes them
//! (`blended_dataset.py`, `build_blending_indices`): sample `i` comes from the dataset whose
//! share of the first `i` samples lags its weight most, which keeps every prefix of the stream
//! within one sample of the weights.

use super::DataError;

/// A dataset of numbered samples a blend draws from.
pub trait Samples {
    /// One sample.
    type Sample;
    /// Samples it holds.
    fn count(&self) -> u64;
    /// Sample `i`, its tokens checked against `vocab`.
    fn get(&self, i: u64, vocab: usize) -> Result<Self::Sample, DataError>;
}

/// Datasets and the sample each of the blend's samples is.
pub struct Blend<D: Samples> {
    parts: Vec<D>,
    /// Sample `i`: (dataset, its sample).
    index: Vec<(u16, u64)>,
}

impl<D: Samples> Blend<D> {
    /// `samples` samples drawn from `parts` by `weights` (normalized here; each part must hold
    /// its share: [`shares`]).
    pub fn new(parts: Vec<D>, weights: &[f64], samples: u64) -> Result<Self, DataError> {
        let weights = normalized(weights)?;
        assert_eq!(parts.len(), weights.len(), "a weight a dataset");
        let mut taken = vec![0u64; parts.len()];
        let mut index = Vec::with_capacity(samples as usize);
        for i in 0..samples {
            let at = (i as f64).max(1.0);
            let (d, _) = weights
                .iter()
                .enumerate()
                .map(|(d, w)| (d, w * at - taken[d] as f64))
                .fold(
                    (0, f64::NEG_INFINITY),
                    |best, (d, e)| if e > best.1 { (d, e) } else { best },
                );
            index.push((d as u16, taken[d]));
            taken[d] += 1;
        }
        for (d, (part, &n)) in parts.iter().zip(&taken).enumerate() {
            if part.count() < n {
                return Err(DataError::Config(format!(
                    "dataset {d} of the blend holds {} samples; {n} are drawn from it",
                    part.count()
                )));
            }
        }
        Ok(Self { parts, index })
    }

    pub fn len(&self) -> u64 {
        self.index.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Sample `i` and the dataset it came from.
    pub fn sample(&self, i: u64, vocab: usize) -> Result<(usize, D::Sample), DataError> {
        let (d, j) = self.index[i as usize];
        Ok((d as usize, self.parts[d as usize].get(j, vocab)?))
    }
}

/// The samples each of `weights`' datasets must hold for `samples` of the blend: its share and
/// half a percent more, as Megatron asks, and at least one.
pub fn shares(weights: &[f64], samples: u64) -> Result<Vec<u64>, DataError> {
    Ok(normalized(weights)?
        .iter()
        .map(|w| ((samples as f64 * w * 1.005).ceil() as u64).max(1) + 1)
        .collect())
}

/// The weights summing to 1; none, a negative or a non-finite one, or all zero is an error.
fn normalized(weights: &[f64]) -> Result<Vec<f64>, DataError> {
    let total: f64 = weights.iter().sum();
    if weights.is_empty() || weights.iter().any(|w| !w.is_finite() || *w < 0.0) || total <= 0.0 {
        return Err(DataError::Config(format!(
            "blend weights {weights:?}: each finite and not negative, not all zero"
        )));
    }
    Ok(weights.iter().map(|w| w / total).collect())
}

/// Megatron's `--data-path` list read: prefixes alone (no weights: each dataset's share is its
/// size), or weight and prefix pairs.
pub fn data_path(items: &[String]) -> Result<Vec<(Option<f64>, std::path::PathBuf)>, DataError> {
    let weighted = items.first().is_some_and(|first| first.parse::<f64>().is_ok());
    if !weighted {
        return Ok(items.iter().map(|p| (None, p.into())).collect());
    }
    if !items.len().is_multiple_of(2) {
        return Err(DataError::Config(format!(
            "{items:?}: weights and prefixes come in pairs"
        )));
    }
    let pairs: Vec<(f64, std::path::PathBuf)> = items
        .chunks_exact(2)
        .map(|pair| {
            let weight = pair[0]
                .parse::<f64>()
                .map_err(|_| DataError::Config(format!("{:?} is no weight (in {items:?})", pair[0])))?;
            Ok((weight, pair[1].clone().into()))
        })
        .collect::<Result<_, DataError>>()?;
    normalized(&pairs.iter().map(|p| p.0).collect::<Vec<_>>())?;
    Ok(pairs.into_iter().map(|(w, p)| (Some(w), p)).collect())
}
