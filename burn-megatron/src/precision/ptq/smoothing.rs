//! The choice of how scales move between a model's activations and its weights before they are
//! quantized (SmoothQuant, AWQ); `posttrain::ptq` folds them into a model.

/// How scales move between activations and weights before quantization.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Smoothing {
    None,
    /// SmoothQuant's scales, with migration strength `alpha`.
    SmoothQuant {
        alpha: f64,
    },
    /// AWQ's activation-aware scales, the exponent searched over `grid` points of `[0, 1)`.
    Awq {
        grid: usize,
    },
}

impl Smoothing {
    /// Its name in a table: `smoothquant0.5`, `awq`; empty for none.
    pub fn name(&self) -> String {
        match self {
            Smoothing::None => String::new(),
            Smoothing::SmoothQuant { alpha } => format!("smoothquant{alpha}"),
            Smoothing::Awq { .. } => "awq".into(),
        }
    }
}
