//! compressed-tensors' layout of a quantized checkpoint (what llm-compressor writes and vLLM
//! serves): each block linear's weight stored as its 8-bit codes (`F8_E4M3` for FP8, `I8` for
//! int8), `[out, in]`, beside `weight_scale` (f32, `[out, 1]` a channel or `[1]` a tensor) and,
//! for static activations, `input_scale` (f32, `[1]`); dequantized, `value = code · scale`. The
//! scheme is `config.json`'s `quantization_config` (`quant_method: compressed-tensors`,
//! `format: float-quantized | int-quantized`, one group targeting `Linear`, `lm_head` ignored).
//! Inputs are static per tensor (`input_scale`), dynamic per token, or (FP8) dynamic in 1×128
//! tiles of a token's features (`strategy: group`, `group_size: 128`, DeepSeek-V3's activation
//! tiles), whose scales each call finds itself.

use burn_megatron_kernels::quant::format::Minifloat;
use burn_megatron_kernels::quant::tiles::TILE;
use safetensors::tensor::Dtype;
use serde_json::{Value, json};

use super::HfError;
use crate::precision::ptq::{ActivationScheme, Codes, Granularity, InputQuantizer, PtqConfig, WeightScheme};

/// How the block linears of a compressed checkpoint are stored and run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Compression {
    /// int8 or FP8, weights and activations alike.
    pub codes: Codes,
    /// One weight scale a tensor (`false`) or an output channel (`true`).
    pub per_channel: bool,
    pub input: Input,
}

/// How a compressed layer's inputs are quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Input {
    /// Not at all (weight-only).
    None,
    /// With the stored `input_scale` (static, per tensor).
    Static,
    /// With each token's own scale (dynamic).
    PerToken,
    /// FP8 with a scale for each 1×128 tile of a token's features (dynamic).
    Tiles,
}

fn unsupported(detail: impl ToString) -> HfError {
    HfError::Unsupported {
        field: "quantization_config",
        value: "compressed-tensors".into(),
        detail: detail.to_string(),
    }
}

impl Compression {
    /// The layout of `config`'s quantization: int8 or FP8 weights per tensor or channel, their
    /// inputs as they are or in the same codes, static per tensor, dynamic per token, or (FP8)
    /// dynamic in 1×128 tiles.
    pub fn of(config: &PtqConfig) -> Result<Self, HfError> {
        let WeightScheme::Uniform { codes, granularity, .. } = config.weights else {
            return Err(unsupported("NVFP4 weights have no 8-bit layout here"));
        };
        let per_channel = match granularity {
            Granularity::Tensor => false,
            Granularity::Channel => true,
            Granularity::Group(_) => return Err(unsupported("group scales are not written (pack-quantized)")),
        };
        if codes == Codes::Int4 {
            return Err(unsupported("int4 codes are not written (pack-quantized)"));
        }
        let input = match config.activations {
            None => Input::None,
            Some(ActivationScheme::Static { codes: a, .. }) if a == codes => Input::Static,
            Some(ActivationScheme::PerToken { codes: a }) if a == codes => Input::PerToken,
            Some(ActivationScheme::Fp8Tiles) if codes == Codes::Fp8 => Input::Tiles,
            Some(other) => {
                return Err(unsupported(format!(
                    "activations {} with {} weights",
                    other.name(),
                    codes.name()
                )));
            }
        };
        Ok(Self {
            codes,
            per_channel,
            input,
        })
    }

    /// The stored codes' dtype.
    pub fn dtype(&self) -> Dtype {
        match self.codes {
            Codes::Fp8 => Dtype::F8_E4M3,
            _ => Dtype::I8,
        }
    }

    fn kind(&self) -> &'static str {
        match self.codes {
            Codes::Fp8 => "float",
            _ => "int",
        }
    }

    /// The stored code of `value / scale`.
    pub fn encode(&self, scaled: f32) -> u8 {
        match self.codes {
            Codes::Fp8 => Minifloat::E4M3.encode(scaled),
            _ => (scaled.round_ties_even().clamp(-127.0, 127.0) as i8) as u8,
        }
    }

    /// The value of a stored code (before its scale).
    pub fn decode(codes: Codes, code: u8) -> f32 {
        match codes {
            Codes::Fp8 => Minifloat::E4M3.decode(code),
            _ => code as i8 as f32,
        }
    }

    /// What a layer's input goes through, `input_scale` given for static inputs.
    pub fn input_quantizer(&self, input_scale: Option<f32>) -> InputQuantizer {
        match (self.input, input_scale) {
            (Input::Static, Some(scale)) => InputQuantizer::Static {
                codes: self.codes,
                amax: scale * self.codes.max(),
            },
            (Input::PerToken, _) => InputQuantizer::PerToken { codes: self.codes },
            (Input::Tiles, _) => InputQuantizer::Fp8Tiles,
            _ => InputQuantizer::None,
        }
    }

    /// `config.json`'s `quantization_config`.
    pub fn to_json(&self) -> Value {
        let args = |strategy: &str, dynamic: bool, group: Option<usize>| {
            json!({
                "num_bits": 8, "type": self.kind(), "symmetric": true, "strategy": strategy,
                "dynamic": dynamic, "group_size": group, "block_structure": null, "actorder": null,
                "observer": if dynamic { Value::Null } else { json!("minmax") }, "observer_kwargs": {},
            })
        };
        let weights = args(if self.per_channel { "channel" } else { "tensor" }, false, None);
        let input = match self.input {
            Input::None => Value::Null,
            Input::Static => args("tensor", false, None),
            Input::PerToken => args("token", true, None),
            Input::Tiles => args("group", true, Some(TILE)),
        };
        json!({
            "quant_method": "compressed-tensors",
            "format": format!("{}-quantized", self.kind()),
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": weights,
                "input_activations": input, "output_activations": null,
            }},
            "ignore": ["lm_head"],
            "kv_cache_scheme": null,
        })
    }

    /// The scheme of `config.json`'s `quantization_config` (`None` without one), refusing what
    /// this layout does not hold.
    pub fn from_json(config: &Value) -> Result<Option<Self>, HfError> {
        let Some(q) = config.get("quantization_config").filter(|q| !q.is_null()) else {
            return Ok(None);
        };
        let text = |v: &Value, key: &str| v.get(key).and_then(Value::as_str).unwrap_or("").to_string();
        if text(q, "quant_method") != "compressed-tensors" {
            return Err(HfError::Unsupported {
                field: "quantization_config",
                value: text(q, "quant_method"),
                detail: "only compressed-tensors' 8-bit layouts load".into(),
            });
        }
        let codes = match text(q, "format").as_str() {
            "float-quantized" => Codes::Fp8,
            "int-quantized" => Codes::Int8,
            other => {
                return Err(unsupported(format!(
                    "format {other:?}: float-quantized or int-quantized"
                )));
            }
        };
        let groups = q.get("config_groups").and_then(Value::as_object);
        let group = match groups.map(|g| g.values().collect::<Vec<_>>()).as_deref() {
            Some([group]) => *group,
            _ => return Err(unsupported("one config group is read")),
        };
        let targets = group.get("targets").and_then(Value::as_array);
        if targets.is_none_or(|t| t.len() != 1 || t[0] != "Linear") {
            return Err(unsupported("the group must target [\"Linear\"]"));
        }
        let kind = match codes {
            Codes::Fp8 => "float",
            _ => "int",
        };
        let read = |args: &Value, strategies: &[&str]| -> Result<(String, bool), HfError> {
            let bits = args.get("num_bits").and_then(Value::as_u64);
            let symmetric = args.get("symmetric").and_then(Value::as_bool).unwrap_or(false);
            let strategy = text(args, "strategy");
            if bits != Some(8) || text(args, "type") != kind || !symmetric || !strategies.contains(&strategy.as_str()) {
                return Err(unsupported(format!(
                    "{args}: 8-bit symmetric {kind} codes, strategy one of {strategies:?}"
                )));
            }
            let dynamic = args.get("dynamic").and_then(Value::as_bool).unwrap_or(false);
            Ok((strategy, dynamic))
        };
        let (strategy, dynamic) = read(&group["weights"], &["tensor", "channel"])?;
        if dynamic {
            return Err(unsupported("weights with dynamic scales"));
        }
        let input = match group.get("input_activations").filter(|a| !a.is_null()) {
            None => Input::None,
            Some(args) => match read(args, &["tensor", "token", "group"])? {
                (s, false) if s == "tensor" => Input::Static,
                (s, true) if s == "token" => Input::PerToken,
                (s, true) if s == "group" && codes == Codes::Fp8 => {
                    let size = args.get("group_size").and_then(Value::as_u64);
                    if size != Some(TILE as u64) {
                        return Err(unsupported(format!(
                            "dynamic input groups of {size:?} features: FP8 tiles of {TILE}"
                        )));
                    }
                    Input::Tiles
                }
                (s, d) => return Err(unsupported(format!("inputs of strategy {s} with dynamic = {d}"))),
            },
        };
        let ignored = q.get("ignore").and_then(Value::as_array);
        let keeps_head = ignored.is_some_and(|i| i.iter().any(|n| n.as_str().is_some_and(|n| n.ends_with("lm_head"))));
        let tied = config
            .get("tie_word_embeddings")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        if !keeps_head && !tied {
            return Err(unsupported(
                "lm_head must be ignored: the output layer is not quantized",
            ));
        }
        Ok(Some(Self {
            codes,
            per_channel: strategy == "channel",
            input,
        }))
    }
}

/// Whether our parameter `path` is a block linear's weight (what a compressed checkpoint holds
/// as codes).
pub fn is_block_linear(path: &str) -> bool {
    let Some(rest) = path.strip_prefix("layers.") else {
        return false;
    };
    [
        "attention.wq",
        "attention.wk",
        "attention.wv",
        "attention.wo",
        "mlp.w1",
        "mlp.w2",
        "mlp.w3",
    ]
    .iter()
    .any(|w| rest.ends_with(&format!(".{w}.weight")))
}

/// The Hugging Face names of a compressed weight's scales: `….weight_scale`, `….input_scale`.
pub fn scale_names(weight: &str) -> (String, String) {
    let stem = weight.strip_suffix(".weight").unwrap_or(weight);
    (format!("{stem}.weight_scale"), format!("{stem}.input_scale"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::precision::ptq::Clipping;

    /// Every exportable scheme writes a `quantization_config` that reads back as itself;
    /// int4, groups and NVFP4 are refused by name.
    #[test]
    fn schemes_round_trip_through_json() {
        let weights = |codes, granularity| WeightScheme::Uniform {
            codes,
            granularity,
            clipping: Clipping::Max,
        };
        for codes in [Codes::Fp8, Codes::Int8] {
            for granularity in [Granularity::Tensor, Granularity::Channel] {
                for activations in [
                    None,
                    Some(ActivationScheme::Static {
                        codes,
                        clipping: Clipping::Mse,
                    }),
                    Some(ActivationScheme::PerToken { codes }),
                    (codes == Codes::Fp8).then_some(ActivationScheme::Fp8Tiles),
                ] {
                    let config = PtqConfig {
                        activations,
                        ..PtqConfig::weight_only(weights(codes, granularity))
                    };
                    let scheme = Compression::of(&config).unwrap();
                    let file = json!({"quantization_config": scheme.to_json()});
                    let back = Compression::from_json(&file).unwrap();
                    assert_eq!(back, Some(scheme));
                }
            }
        }
        for refused in [
            PtqConfig::weight_only(weights(Codes::Int4, Granularity::Group(128))),
            PtqConfig::weight_only(weights(Codes::Int8, Granularity::Group(128))),
            PtqConfig::weight_only(WeightScheme::Nvfp4),
            PtqConfig::weight_only(weights(Codes::Fp8, Granularity::Tensor)).with_activations(ActivationScheme::Nvfp4),
            PtqConfig::weight_only(weights(Codes::Int8, Granularity::Channel))
                .with_activations(ActivationScheme::Fp8Tiles),
        ] {
            let error = Compression::of(&refused).unwrap_err();
            assert!(
                matches!(
                    error,
                    HfError::Unsupported {
                        field: "quantization_config",
                        ..
                    }
                ),
                "{error}"
            );
        }
        // Dynamic input groups of another size than the tiles' are refused by name.
        let tiles = PtqConfig::weight_only(weights(Codes::Fp8, Granularity::Channel))
            .with_activations(ActivationScheme::Fp8Tiles);
        let mut file = json!({"quantization_config": Compression::of(&tiles).unwrap().to_json()});
        file["quantization_config"]["config_groups"]["group_0"]["input_activations"]["group_size"] = json!(64);
        let error = Compression::from_json(&file).unwrap_err();
        assert!(error.to_string().contains("tiles of 128"), "{error}");
        let gptq = json!({"quantization_config": {"quant_method": "gptq"}});
        let error = Compression::from_json(&gptq).unwrap_err();
        assert!(error.to_string().contains("gptq"), "{error}");
    }

    #[test]
    fn int8_codes_round_trip() {
        let c = Compression {
            codes: Codes::Int8,
            per_channel: true,
            input: Input::None,
        };
        for v in -127..=127 {
            assert_eq!(Compression::decode(Codes::Int8, c.encode(v as f32)), v as f32);
        }
        assert_eq!(Compression::decode(Codes::Int8, c.encode(300.0)), 127.0);
    }
}
