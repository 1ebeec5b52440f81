//! What a run does with a step that went wrong without failing: gradients that are not finite
//! (the update skipped them on the device, [`FiniteCheck`](crate::optim::FiniteCheck)) stop the
//! run or are skipped, up to a number in a row; a loss far above its running mean is reported.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;
use crate::optim::NonFiniteGradient;

/// What a step whose gradients are not all finite does to the run. The step itself updates
/// nothing either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NonFinite {
    /// The run stops, naming the parameter, the rank and the step.
    #[default]
    Stop,
    /// The step is skipped and counted; more than `max_skips` in a row stop the run.
    Skip,
    /// No check (no pass over the gradients before the update): a NaN reaches the weights.
    Off,
}

/// How a run guards its steps: see the module docs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GuardConfig {
    pub nonfinite: NonFinite,
    /// Under `skip`, the steps skipped in a row a run survives.
    pub max_skips: usize,
    /// A loss over this many times the mean of the last `window` steps' is reported as a spike
    /// (none: never).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spike_factor: Option<f64>,
    /// The steps the running mean covers; a spike is looked for once it is full.
    pub window: usize,
    /// Refuse a job whose estimated peak memory a rank passes the device's before any tensor
    /// exists (`Job::check_memory`); off where the estimate errs too high for a job known to fit.
    pub memory: bool,
}

impl Default for GuardConfig {
    fn default() -> Self {
        Self {
            nonfinite: NonFinite::Stop,
            max_skips: 3,
            spike_factor: Some(3.0),
            window: 20,
            memory: true,
        }
    }
}

impl GuardConfig {
    /// The config, checked: a window of at least 1, a spike factor above 1.
    pub fn checked(self) -> Result<Self, ConfigError> {
        if self.window == 0 {
            return Err(ConfigError::Zero {
                what: "the loss spikes' window",
            });
        }
        if let Some(factor) = self.spike_factor
            && !(factor.is_finite() && factor > 1.0)
        {
            return Err(ConfigError::SpikeFactor { factor });
        }
        Ok(self)
    }
}

/// A run's guard between steps: the config, the skips in a row and in all, the recent losses.
#[derive(Clone, Debug)]
pub struct Guard {
    config: GuardConfig,
    in_a_row: usize,
    skipped: u64,
    recent: VecDeque<f64>,
}

/// What the guard made of a step that updated nothing.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum Stopped {
    #[error("{0}")]
    NonFinite(NonFiniteGradient),
    #[error("{count} steps in a row skipped (the last: {found}), more than {max} allowed")]
    TooManySkips {
        count: usize,
        max: usize,
        found: NonFiniteGradient,
    },
}

impl Guard {
    pub fn new(config: GuardConfig) -> Self {
        Self {
            config,
            in_a_row: 0,
            skipped: 0,
            recent: VecDeque::new(),
        }
    }

    pub fn config(&self) -> &GuardConfig {
        &self.config
    }

    /// Steps skipped so far.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// A step whose gradients were not all finite: skipped and counted, or the run stops.
    pub fn skip(&mut self, found: NonFiniteGradient) -> Result<(), Stopped> {
        if self.config.nonfinite != NonFinite::Skip {
            return Err(Stopped::NonFinite(found));
        }
        self.in_a_row += 1;
        self.skipped += 1;
        match self.in_a_row > self.config.max_skips {
            true => Err(Stopped::TooManySkips {
                count: self.in_a_row,
                max: self.config.max_skips,
                found,
            }),
            false => Ok(()),
        }
    }

    /// A step that updated the weights, its loss `loss`: the loss over the running mean where
    /// it passes the spike factor (the mean then goes on without it).
    pub fn kept(&mut self, loss: f64) -> Option<f64> {
        self.in_a_row = 0;
        let full = self.recent.len() == self.config.window;
        let mean = self.recent.iter().sum::<f64>() / self.recent.len().max(1) as f64;
        let spike = match (self.config.spike_factor, full) {
            (Some(factor), true) if loss > factor * mean => Some(loss / mean),
            _ => None,
        };
        if spike.is_none() {
            if full {
                self.recent.pop_front();
            }
            self.recent.push_back(loss);
        }
        spike
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found() -> NonFiniteGradient {
        NonFiniteGradient {
            first: Some((1, "w".into())),
            ranks: vec![1],
        }
    }

    /// Under `skip`, `max_skips` in a row pass and one more stops; a kept step resets the run
    /// of skips but not their count. Under `stop`, the first stops.
    #[test]
    fn skips_up_to_the_limit_in_a_row() {
        let config = GuardConfig {
            nonfinite: NonFinite::Skip,
            max_skips: 2,
            ..GuardConfig::default()
        };
        let mut guard = Guard::new(config.clone());
        assert_eq!(guard.skip(found()), Ok(()));
        assert_eq!(guard.skip(found()), Ok(()));
        guard.kept(1.0);
        assert_eq!(guard.skip(found()), Ok(()));
        assert_eq!(guard.skip(found()), Ok(()));
        let stopped = guard.skip(found()).expect_err("a third in a row");
        assert!(
            matches!(stopped, Stopped::TooManySkips { count: 3, max: 2, .. }),
            "{stopped}"
        );
        assert_eq!(guard.skipped(), 5);
        let mut stop = Guard::new(GuardConfig::default());
        assert_eq!(stop.skip(found()), Err(Stopped::NonFinite(found())));
    }

    /// A spike is a loss over factor × the mean of the window's losses, looked for once the
    /// window is full, and kept out of the mean.
    #[test]
    fn reports_a_loss_over_the_running_mean() {
        let mut guard = Guard::new(GuardConfig {
            spike_factor: Some(2.0),
            window: 3,
            ..GuardConfig::default()
        });
        assert_eq!(guard.kept(10.0), None, "the window is not full yet");
        assert_eq!(guard.kept(2.0), None);
        assert_eq!(guard.kept(3.0), None);
        // The mean of 10, 2, 3 is 5: 9 is under twice that, and it pushes 10 out.
        assert_eq!(guard.kept(9.0), None);
        // The mean of 2, 3, 9 is 14/3: 12 is over twice it.
        assert_eq!(guard.kept(12.0), Some(12.0 / (14.0 / 3.0)));
        // The spike stayed out of the mean.
        assert_eq!(guard.kept(9.0), None);
    }

    /// A window of 0 and a factor of 1 or less (or not a number) are refused.
    #[test]
    fn refuses_a_bad_config() {
        let bad = [
            GuardConfig {
                window: 0,
                ..GuardConfig::default()
            },
            GuardConfig {
                spike_factor: Some(1.0),
                ..GuardConfig::default()
            },
            GuardConfig {
                spike_factor: Some(f64::NAN),
                ..GuardConfig::default()
            },
        ];
        for config in bad {
            assert!(config.clone().checked().is_err(), "{config:?}");
        }
        assert!(GuardConfig::default().checked().is_ok());
    }
}
