//! Rotary position embedding, rotating the two halves of each head (the Hugging Face Llama and
//! Megatron layout; Burn's `RotaryEncoding` rotates interleaved pairs instead).

use burn::tensor::{Device, Tensor};

/// The cos/sin tables for positions `0..max_seq_len`.
#[derive(Clone, Debug)]
pub struct Rope {
    /// `[max_seq_len, head_dim/2]`
    cos: Tensor<2>,
    sin: Tensor<2>,
}

impl Rope {
    /// `head_dim` must be even (checked by the attention config).
    pub fn new(head_dim: usize, max_seq_len: usize, theta: f64, device: &Device) -> Self {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(max_seq_len * half);
        let mut sin = Vec::with_capacity(max_seq_len * half);
        for pos in 0..max_seq_len {
            for i in 0..half {
                let inv_freq = theta.powf(-((2 * i) as f64) / head_dim as f64);
                let angle = pos as f64 * inv_freq;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let table = |v: Vec<f32>| Tensor::<1>::from_floats(v.as_slice(), device).reshape([max_seq_len, half]);
        Self {
            cos: table(cos),
            sin: table(sin),
        }
    }

    /// Rotates `x` for positions `0..s`.
    ///
    /// # Shapes
    /// `[b, heads, s, head_dim]` → the same
    pub fn apply(&self, x: Tensor<4>) -> Tensor<4> {
        // One kernel each way on CUDA (burn_megatron_kernels::rope), f32 rotation.
        burn_megatron_kernels::rope::rope(x, self.cos.clone(), self.sin.clone())
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
        let rope = Rope::new(4, 2, 10000.0, &dev);
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
}
