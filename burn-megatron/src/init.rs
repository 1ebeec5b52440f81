//! Parameter initialization, deterministic and shard-aware.
//!
//! Every parameter has a name (its path in the model) and a seed derived from it. Two modes:
//! - [`InitMode::Full`]: the whole tensor is generated from the seed and this rank keeps its
//!   slice. Every layout gets the same model, so a tp = 2 model is the exact shard of the
//!   tp = 1 model: the parity tests rely on it.
//! - [`InitMode::PerShard`]: only this rank's shard is generated, from a seed that also names
//!   the shard's mesh coordinate. No rank ever holds a full copy: large models need this.

use burn::tensor::{DType, Device, Tensor, TensorData};

/// How parameters get their first values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitMode {
    /// Generate the full tensor and keep this rank's slice (same model at every layout).
    Full,
    /// Generate only this rank's slice (no full copy anywhere).
    PerShard,
}

/// Which slice of a tensor this rank holds: `count` equal parts of `dim`, part `index`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub dim: usize,
    pub index: usize,
    pub count: usize,
}

impl Shard {
    /// The whole tensor.
    pub const WHOLE: Shard = Shard {
        dim: 0,
        index: 0,
        count: 1,
    };

    pub fn new(dim: usize, index: usize, count: usize) -> Self {
        Self { dim, index, count }
    }

    /// This rank's slice of `full`.
    pub fn slice<const D: usize>(&self, full: Tensor<D>) -> Tensor<D> {
        if self.count == 1 {
            return full;
        }
        let part = full.dims()[self.dim] / self.count;
        full.narrow(self.dim, self.index * part, part)
    }

    /// The shape of this rank's slice of a tensor of shape `full`.
    pub fn shape<const D: usize>(&self, mut full: [usize; D]) -> [usize; D] {
        if self.count > 1 {
            full[self.dim] /= self.count;
        }
        full
    }
}

/// Initializes parameters from a base seed, in one dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParamInit {
    pub seed: u64,
    pub mode: InitMode,
    /// The dtype parameters are made in (f32 unless told otherwise).
    pub dtype: DType,
}

impl ParamInit {
    pub fn new(seed: u64, mode: InitMode) -> Self {
        Self {
            seed,
            mode,
            dtype: DType::F32,
        }
    }

    pub fn with_dtype(self, dtype: DType) -> Self {
        Self { dtype, ..self }
    }

    /// Zeros (biases).
    pub fn zeros<const D: usize>(&self, shape: [usize; D], device: &Device) -> Tensor<D> {
        Tensor::zeros(shape, (device, self.dtype))
    }

    /// Ones (norm weights).
    pub fn ones<const D: usize>(&self, shape: [usize; D], device: &Device) -> Tensor<D> {
        Tensor::ones(shape, (device, self.dtype))
    }

    /// Normal(0, std) values for `shard` of the parameter `name` of shape `full`.
    pub fn normal<const D: usize>(
        &self,
        name: &str,
        full: [usize; D],
        shard: Shard,
        std: f64,
        device: &Device,
    ) -> Tensor<D> {
        self.normal_in(name, full, &[shard], std, device)
    }

    /// [`normal`](Self::normal) for a tensor split along several dims at once (an expert's
    /// weights: experts over ep, hidden features over tp): the block `shards` name together.
    pub fn normal_in<const D: usize>(
        &self,
        name: &str,
        full: [usize; D],
        shards: &[Shard],
        std: f64,
        device: &Device,
    ) -> Tensor<D> {
        let seed = hash(self.seed, name);
        let split: Vec<&Shard> = shards.iter().filter(|s| s.count > 1).collect();
        let values = match self.mode {
            InitMode::Full => split
                .iter()
                .fold(normal(full, seed, std, device), |x, shard| shard.slice(x)),
            InitMode::PerShard => {
                let shape = split.iter().fold(full, |shape, shard| shard.shape(shape));
                // The block's name, from every shard given (one of one included): a single
                // shard is named `dim/index`, as before several could be given.
                let block = shards
                    .iter()
                    .map(|s| format!("{}/{}", s.dim, s.index))
                    .collect::<Vec<_>>()
                    .join(",");
                normal(shape, hash(seed, &block), std, device)
            }
        };
        values.cast(self.dtype)
    }
}

/// `Tensor` of Normal(0, std) values from `seed`, generated on the host.
///
/// SplitMix64 is a counter-based stream (draw `j` is a mix of `seed + j·γ`), so disjoint
/// stretches of it fill disjoint chunks on as many threads as the host has, with the very
/// values one thread would draw: a 4 B-parameter shard took 100 s on one.
pub fn normal<const D: usize>(shape: [usize; D], seed: u64, std: f64, device: &Device) -> Tensor<D> {
    /// Below this many values one thread is quicker than starting more.
    const PER_THREAD: usize = 1 << 20;
    let n: usize = shape.iter().product();
    let mut values = vec![0f32; n];
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .min(n.div_ceil(PER_THREAD))
        .max(1);
    // Whole pairs a chunk: each Box–Muller pair takes two consecutive draws.
    let chunk = n.div_ceil(threads).next_multiple_of(2).max(2);
    std::thread::scope(|scope| {
        for (i, part) in values.chunks_mut(chunk).enumerate() {
            scope.spawn(move || fill_normal(part, seed, (i * chunk) as u64, std));
        }
    });
    Tensor::<1>::from_data(TensorData::new(values, [n]), device).reshape(shape)
}

/// Fills `out` with the normals that start at draw `first` (even) of `seed`'s stream.
fn fill_normal(out: &mut [f32], seed: u64, first: u64, std: f64) {
    let mut rng = SplitMix64(seed.wrapping_add(first.wrapping_mul(SplitMix64::GAMMA)));
    for pair in out.chunks_mut(2) {
        // Box–Muller: two normals from two uniforms in (0, 1].
        let u1 = 1.0 - rng.unit();
        let u2 = rng.unit();
        let r = (-2.0 * u1.ln()).sqrt() * std;
        let theta = std::f64::consts::TAU * u2;
        pair[0] = (r * theta.cos()) as f32;
        if let Some(second) = pair.get_mut(1) {
            *second = (r * theta.sin()) as f32;
        }
    }
}

/// A 64-bit hash of a seed and a name (FNV-1a, then SplitMix's finalizer).
pub fn hash(seed: u64, name: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    SplitMix64(h).next()
}

struct SplitMix64(u64);

impl SplitMix64 {
    /// The stream's step: draw `j` (from 1) mixes `seed + j·GAMMA`.
    const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(Self::GAMMA);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_mode_shards_are_slices_of_the_whole() {
        let dev = Device::flex();
        let init = ParamInit::new(7, InitMode::Full);
        let whole = init.normal("w", [4, 6], Shard::WHOLE, 0.02, &dev);
        let part = init.normal("w", [4, 6], Shard::new(1, 1, 2), 0.02, &dev);
        whole.narrow(1, 3, 3).into_data().assert_eq(&part.into_data(), true);
    }

    /// A single shard's seed is named `dim/index`, whole or not: runs initialized per shard
    /// before several shards could be given draw the same values.
    #[test]
    fn per_shard_seeds_keep_their_names() {
        let dev = Device::flex();
        let init = ParamInit::new(7, InitMode::PerShard);
        for shard in [Shard::new(1, 0, 1), Shard::new(1, 1, 2), Shard::WHOLE] {
            let ours = init.normal("w", [4, 6], shard, 0.02, &dev);
            let name = format!("{}/{}", shard.dim, shard.index);
            let theirs = normal(shard.shape([4, 6]), hash(hash(7, "w"), &name), 0.02, &dev);
            ours.into_data().assert_eq(&theirs.into_data(), true);
        }
    }

    #[test]
    fn per_shard_mode_makes_only_the_shard_and_shards_differ() {
        let dev = Device::flex();
        let init = ParamInit::new(7, InitMode::PerShard);
        let a = init.normal("w", [4, 6], Shard::new(1, 0, 2), 0.02, &dev);
        let b = init.normal("w", [4, 6], Shard::new(1, 1, 2), 0.02, &dev);
        assert_eq!(a.dims(), [4, 3]);
        assert_ne!(a.into_data(), b.into_data());
    }

    /// The threaded fill draws exactly the values of one sequential stream.
    #[test]
    fn threaded_normals_are_one_stream() {
        let n = 3 * (1 << 20) + 5;
        let x = normal([n], 11, 1.0, &Device::flex())
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        let mut one = vec![0f32; n];
        fill_normal(&mut one, 11, 0, 1.0);
        assert_eq!(x, one);
        let mut stretch = vec![0f32; 7];
        fill_normal(&mut stretch, 11, 2_000_000, 1.0);
        assert_eq!(stretch[..], one[2_000_000..2_000_007]);
    }

    #[test]
    fn normal_has_the_asked_spread() {
        let x = normal([100_000], 3, 0.02, &Device::flex());
        let mean = x.clone().mean().into_scalar::<f32>();
        let std = x.var(0).sqrt().into_scalar::<f32>();
        // 100k samples: the mean's standard error is 0.02/√1e5 ≈ 6e-5, the std's ≈ 4.5e-5.
        assert!(mean.abs() < 3e-4 && (std - 0.02).abs() < 3e-4, "mean {mean} std {std}");
    }
}
