//! The low-precision number formats of FP8 and FP4 training, as scalar codecs: the reference
//! every quantizer is checked against, bit for bit.
//!
//! - [`Minifloat::E4M3`]: OCP FP8 E4M3 ("E4M3FN"): bias 7, largest 448, no infinities, NaN
//!   `S.1111.111`.
//! - [`Minifloat::E5M2`]: OCP FP8 E5M2: bias 15, largest 57344, IEEE-style infinities and NaNs.
//! - [`Minifloat::E2M1`]: OCP FP4 E2M1 (MXFP4, NVFP4): bias 1, the values 0, 0.5, 1, 1.5, 2, 3, 4,
//!   6, no infinities or NaNs.
//! - [`e8m0`]: OCP E8M0, the MX block scale: a power of two 2^(code − 127), code 255 NaN.
//!
//! Encoding rounds to the nearest value, ties to even mantissa, and saturates: any finite value
//! or infinity beyond the largest magnitude encodes as that magnitude (CUDA's `__NV_SATFINITE`,
//! what Transformer Engine casts with). NaN encodes as the format's NaN (E2M1 has none: 0).
//! Codes are the format's bits in the low bits of a `u8`, sign highest.

/// A sign-exponent-mantissa format narrower than f16.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Minifloat {
    E4M3,
    E5M2,
    E2M1,
}

impl Minifloat {
    /// Exponent bits.
    pub const fn exponent_bits(self) -> u32 {
        match self {
            Self::E4M3 => 4,
            Self::E5M2 => 5,
            Self::E2M1 => 2,
        }
    }

    /// Mantissa bits.
    pub const fn mantissa_bits(self) -> u32 {
        match self {
            Self::E4M3 => 3,
            Self::E5M2 => 2,
            Self::E2M1 => 1,
        }
    }

    /// The exponent bias.
    pub const fn bias(self) -> i32 {
        (1 << (self.exponent_bits() - 1)) - 1
    }

    /// Bits a code takes: sign, exponent and mantissa.
    pub const fn bits(self) -> u32 {
        1 + self.exponent_bits() + self.mantissa_bits()
    }

    /// The code of the largest finite magnitude (sign clear).
    pub const fn max_code(self) -> u8 {
        match self {
            // 1111.110: 1.75 · 2⁸; 1111.111 is NaN.
            Self::E4M3 => 0x7E,
            // 11110.11: 1.75 · 2¹⁵; exponent 11111 is infinity and NaN.
            Self::E5M2 => 0x7B,
            // 11.1: 1.5 · 2².
            Self::E2M1 => 0x07,
        }
    }

    /// The largest finite magnitude: 448, 57344 or 6.
    pub fn max(self) -> f32 {
        self.decode(self.max_code())
    }

    /// The exponent of the largest finite magnitude: 8, 15 or 2 (the MX scale's `emax`).
    pub const fn max_exponent(self) -> i32 {
        match self {
            Self::E4M3 => 8,
            Self::E5M2 => 15,
            Self::E2M1 => 2,
        }
    }

    /// The sign bit of a code.
    const fn sign_bit(self) -> u8 {
        1 << (self.bits() - 1)
    }

    /// The value of `code` (its low [`bits`](Self::bits) bits).
    pub fn decode(self, code: u8) -> f32 {
        let m_bits = self.mantissa_bits();
        let code = code & ((1u16 << self.bits()) - 1) as u8;
        let sign = if code & self.sign_bit() != 0 { -1.0 } else { 1.0 };
        let magnitude = code & !self.sign_bit();
        let exponent = (magnitude >> m_bits) as i32;
        let mantissa = (magnitude & ((1 << m_bits) - 1)) as f64;
        match self {
            Self::E4M3 if magnitude == 0x7F => return f32::NAN,
            Self::E5M2 if exponent == 0x1F && mantissa == 0.0 => return sign as f32 * f32::INFINITY,
            Self::E5M2 if exponent == 0x1F => return f32::NAN,
            _ => {}
        }
        let scale = (1u32 << m_bits) as f64;
        let value = match exponent {
            0 => mantissa / scale * 2f64.powi(1 - self.bias()),
            e => (1.0 + mantissa / scale) * 2f64.powi(e - self.bias()),
        };
        (sign * value) as f32
    }

    /// The code of `x`, rounded to nearest (ties to even) and saturated.
    pub fn encode(self, x: f32) -> u8 {
        self.encode_with(x, |scaled| scaled.round_ties_even())
    }

    /// The code of `x` rounded stochastically: up with probability equal to the fraction of the
    /// step `x` lies above the value below it, for a `uniform` draw in `[0, 1)`; saturated.
    /// Unbiased: the code's expected value is `x` (within the finite range).
    pub fn encode_stochastic(self, x: f32, uniform: f32) -> u8 {
        self.encode_with(x, |scaled| (scaled + uniform as f64).floor())
    }

    /// Encodes `x` with `round` taking `|x|` in units of its step to a whole number of steps.
    fn encode_with(self, x: f32, round: impl Fn(f64) -> f64) -> u8 {
        if x.is_nan() {
            return match self {
                Self::E4M3 => 0x7F,
                Self::E5M2 => 0x7F,
                Self::E2M1 => 0,
            };
        }
        let sign = if x.is_sign_negative() { self.sign_bit() } else { 0 };
        let magnitude = (x as f64).abs();
        if magnitude.is_infinite() {
            return sign | self.max_code();
        }
        let m_bits = self.mantissa_bits() as i32;
        let min_normal_exponent = 1 - self.bias();
        // The exponent of the binade holding |x|, read from the f64 exponent field (exact: an
        // f32 is a normal f64), at least the smallest normal's, where the subnormal step takes
        // over.
        let binade = match magnitude {
            0.0 => min_normal_exponent,
            m => (((m.to_bits() >> 52) & 0x7FF) as i32 - 1023).max(min_normal_exponent),
        };
        let step = 2f64.powi(binade - m_bits);
        // Whole steps: within a binade above the subnormals, 2^m ..= 2^(m+1) (the top one
        // rolls into the next binade, which the code arithmetic below does by itself).
        let steps = round(magnitude / step) as u64;
        let code = match magnitude < 2f64.powi(min_normal_exponent) {
            // Subnormal (or rounding up onto the smallest normal): the steps are the code.
            true => steps,
            false => {
                let exponent_field = (binade - min_normal_exponent + 1) as u64;
                (exponent_field << m_bits) + (steps - (1 << m_bits))
            }
        };
        sign | code.min(self.max_code() as u64) as u8
    }
}

/// The E8M0 code of the power of two `2^exponent`, clamped to the representable −127 ..= 127.
pub fn e8m0(exponent: i32) -> u8 {
    (exponent.clamp(-127, 127) + 127) as u8
}

/// The power of two an E8M0 code stands for; NaN for 255.
pub fn e8m0_value(code: u8) -> f32 {
    match code {
        255 => f32::NAN,
        c => 2f64.powi(c as i32 - 127) as f32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Minifloat; 3] = [Minifloat::E4M3, Minifloat::E5M2, Minifloat::E2M1];

    /// The formats' defining values, from the OCP 8-bit and MX specifications.
    #[test]
    fn decodes_the_specified_values() {
        use Minifloat::*;
        assert_eq!((E4M3.max(), E5M2.max(), E2M1.max()), (448.0, 57344.0, 6.0));
        // Smallest normals and subnormals.
        assert_eq!((E4M3.decode(0x08), E4M3.decode(0x01)), (2f32.powi(-6), 2f32.powi(-9)));
        assert_eq!((E5M2.decode(0x04), E5M2.decode(0x01)), (2f32.powi(-14), 2f32.powi(-16)));
        let fp4: Vec<f32> = (0..8).map(|c| E2M1.decode(c)).collect();
        assert_eq!(fp4, [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]);
        assert_eq!(E2M1.decode(0x0F), -6.0);
        assert!(E4M3.decode(0x7F).is_nan() && E4M3.decode(0xFF).is_nan());
        assert_eq!(E4M3.decode(0x7E), 448.0);
        assert_eq!(
            (E5M2.decode(0x7C), E5M2.decode(0xFC)),
            (f32::INFINITY, f32::NEG_INFINITY)
        );
        assert!(E5M2.decode(0x7D).is_nan());
        assert_eq!((E4M3.decode(0x38), E5M2.decode(0x3C)), (1.0, 1.0));
        assert_eq!(
            (e8m0_value(127), e8m0_value(0), e8m0_value(254)),
            (1.0, 2f32.powi(-127), 2f32.powi(127))
        );
        assert!(e8m0_value(255).is_nan());
        assert_eq!((e8m0(0), e8m0(-200), e8m0(300)), (127, 0, 254));
    }

    /// Every finite code encodes back from its value, both zeros included: the codec is exact on
    /// the format's own grid.
    #[test]
    fn every_finite_code_round_trips() {
        for format in ALL {
            for code in 0..(1u16 << format.bits()) {
                let code = code as u8;
                let value = format.decode(code);
                if value.is_finite() {
                    assert_eq!(format.encode(value), code, "{format:?} code {code:#04x} = {value}");
                }
            }
        }
    }

    /// Halfway between two neighbours rounds to the even mantissa; just off halfway rounds to
    /// the nearer one; the subnormal and binade boundaries behave alike.
    #[test]
    fn rounds_to_nearest_ties_to_even() {
        use Minifloat::*;
        // E4M3 around 1: step 1/8. 1 + 1/16 ties between 1.0 (even) and 1.125.
        assert_eq!(E4M3.decode(E4M3.encode(1.0625)), 1.0);
        assert_eq!(E4M3.decode(E4M3.encode(1.1875)), 1.25); // between 1.125 (odd) and 1.25
        assert_eq!(E4M3.decode(E4M3.encode(1.0626)), 1.125);
        // Rolling over into the next binade: 1.9375 ties between 1.875 (odd) and 2.0.
        assert_eq!(E4M3.decode(E4M3.encode(1.9375)), 2.0);
        // Subnormals: step 2⁻⁹; half of the smallest rounds to zero (even), more rounds up.
        assert_eq!(E4M3.encode(2f32.powi(-10)), 0);
        assert_eq!(E4M3.encode(2f32.powi(-10) * 1.01), 0x01);
        // The largest subnormal rounding onto the smallest normal.
        assert_eq!(E4M3.encode(7.5 * 2f32.powi(-9)), 0x08);
        // FP4: 2.5 ties between 2 (even) and 3; 5 between 4 (even) and 6.
        assert_eq!(
            (E2M1.encode(2.5), E2M1.encode(5.0), E2M1.encode(0.25)),
            (0x04, 0x06, 0x00)
        );
        assert_eq!(E2M1.encode(0.26), 0x01);
        assert_eq!(E5M2.decode(E5M2.encode(1.125)), 1.0);
        assert_eq!(E5M2.decode(E5M2.encode(1.375)), 1.5);
    }

    /// Beyond the largest magnitude saturates; NaN stays NaN where the format has one; signs
    /// are kept, negative zero included.
    #[test]
    fn saturates_and_keeps_signs() {
        use Minifloat::*;
        for format in ALL {
            let max = format.max();
            for big in [max * 1.01, max * 1e6, f32::MAX, f32::INFINITY] {
                assert_eq!(format.encode(big), format.max_code(), "{format:?} {big}");
                assert_eq!(format.decode(format.encode(-big)), -max, "{format:?} -{big}");
            }
            assert_eq!(format.encode(-0.0), format.sign_bit(), "{format:?} -0");
            assert_eq!(format.encode(1e-30), 0, "{format:?}: far below the smallest subnormal");
        }
        // Just below halfway to the (absent) next step above 448 rounds down to 448 anyway.
        assert_eq!(E4M3.encode(463.0), 0x7E);
        assert!(E4M3.decode(E4M3.encode(f32::NAN)).is_nan());
        assert!(E5M2.decode(E5M2.encode(f32::NAN)).is_nan());
        assert_eq!(E2M1.encode(f32::NAN), 0);
    }

    /// Every f32 on a fine grid encodes to the code whose value is nearest (ties to the even
    /// code), found by search over all codes: the encoder against the definition.
    #[test]
    fn encoding_is_the_nearest_code() {
        for format in ALL {
            let codes: Vec<(u8, f32)> = (0..(1u16 << (format.bits() - 1)))
                .map(|c| (c as u8, format.decode(c as u8)))
                .filter(|(_, v)| v.is_finite())
                .collect();
            let top = format.max() as f64 * 1.2;
            for i in 0..20_000 {
                let x = (top * (i as f64 / 20_000.0).powi(3)) as f32;
                let nearest = codes
                    .iter()
                    .map(|&(c, v)| (c, ((v as f64) - x as f64).abs()))
                    .min_by(|a, b| a.1.total_cmp(&b.1).then((a.0 & 1).cmp(&(b.0 & 1))))
                    .expect("codes")
                    .0;
                assert_eq!(format.encode(x), nearest, "{format:?} x = {x}");
            }
        }
    }

    /// Stochastic rounding picks the two neighbours only, in proportion: the mean of many
    /// draws is the value.
    #[test]
    fn stochastic_rounding_is_unbiased() {
        let x = 2.3f32; // between FP4's 2 and 3
        let draws = 10_000;
        let mean: f64 = (0..draws)
            .map(|i| {
                let u = (i as f32 + 0.5) / draws as f32;
                let v = Minifloat::E2M1.decode(Minifloat::E2M1.encode_stochastic(x, u));
                assert!(v == 2.0 || v == 3.0, "{v}");
                v as f64
            })
            .sum::<f64>()
            / draws as f64;
        // Evenly spaced draws: the mean is exact to the draws' resolution.
        assert!((mean - 2.3).abs() < 1e-3, "{mean}");
    }
}
