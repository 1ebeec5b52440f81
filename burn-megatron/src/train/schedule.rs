//! Learning-rate schedules over a run's steps, built from Burn's `lr_scheduler` (its linear,
//! cosine, constant and sequential schedulers), so a plain loop and Burn's Learner step the same
//! scheduler. Step `t` counts from 1; `lr` is the peak, `T` the run's steps, `W` the warm-up:
//!
//! - `constant`: `lr`.
//! - `warmup-cosine`: `lr·t/W` for `t ≤ W`, then `min + ½(lr − min)(1 + cos(π·(t − W − 1)/(T − W)))`
//!   (PyTorch's `CosineAnnealingLR` over the `T − W` steps after the warm-up; the last step
//!   stays just above `min`).
//! - `warmup-stable-decay` (WSD): the warm-up, `lr` until the last `D` steps, then
//!   `lr − (j + 1)(lr − min)/D` at the `j`-th of them (`min` at the last step).
//!
//! A warm-up of 0 or 1 step starts at `lr`. [`LrSchedule::lr_at`] is that closed form, which the
//! tests hold Burn's schedulers to.

use burn::lr_scheduler::LrSchedulerConfig;
use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::lr_scheduler::module_lr_scheduler::{ModuleLrScheduler, ModuleLrSchedulerConfig};
use burn::lr_scheduler::sequential::SequentialLrSchedulerConfig;
use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

/// How the learning rate moves over a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum LrSchedule {
    #[default]
    Constant,
    /// Linear warm-up over `warmup` steps, then cosine decay to `min_lr`.
    WarmupCosine {
        #[serde(default)]
        warmup: usize,
        #[serde(default)]
        min_lr: f64,
    },
    /// Linear warm-up over `warmup` steps, `lr` held, then linear decay to `min_lr` over the
    /// last `decay` steps.
    WarmupStableDecay {
        #[serde(default)]
        warmup: usize,
        decay: usize,
        #[serde(default)]
        min_lr: f64,
    },
}

impl LrSchedule {
    /// The scheduler of a run of `steps` steps peaking at `lr`: each `step()` gives the next
    /// step's rate. Every number is checked here, before any tensor.
    pub fn scheduler(&self, lr: f64, steps: usize) -> Result<ModuleLrScheduler, ConfigError> {
        self.check(lr, steps)?;
        let warmup = self.warmup();
        let config = match *self {
            LrSchedule::Constant => LrSchedulerConfig::Constant(lr),
            LrSchedule::WarmupCosine { min_lr, .. } => {
                let cosine = CosineAnnealingLrSchedulerConfig::new(lr, (steps - warmup).max(1)).with_min_lr(min_lr);
                warmed(lr, warmup, cosine.into())
            }
            LrSchedule::WarmupStableDecay { decay, min_lr, .. } => {
                let falling = match decay {
                    1 => LrSchedulerConfig::Constant(min_lr),
                    _ => {
                        let first = lr - (lr - min_lr) / decay as f64;
                        LinearLrSchedulerConfig::new(first, min_lr, decay - 1).into()
                    }
                };
                let after = match steps - warmup - decay {
                    0 => falling,
                    stable => {
                        let phases = vec![LrSchedulerConfig::Constant(lr), falling];
                        SequentialLrSchedulerConfig::new(phases, vec![stable]).into()
                    }
                };
                warmed(lr, warmup, after)
            }
        };
        ModuleLrSchedulerConfig::new(config)
            .init()
            .map_err(|detail| ConfigError::Schedule { detail })
    }

    /// The rate at step `step` (from 1) of a run of `steps` peaking at `lr`: the closed form
    /// of the module docs.
    pub fn lr_at(&self, lr: f64, steps: usize, step: usize) -> f64 {
        let warmup = self.warmup();
        if step <= warmup {
            return lr * step as f64 / warmup as f64;
        }
        match *self {
            LrSchedule::Constant => lr,
            LrSchedule::WarmupCosine { min_lr, .. } => {
                let (j, decay) = ((step - warmup - 1) as f64, (steps - warmup) as f64);
                min_lr + 0.5 * (lr - min_lr) * (1.0 + (std::f64::consts::PI * j / decay).cos())
            }
            LrSchedule::WarmupStableDecay { decay, min_lr, .. } => match step + decay > steps {
                true => lr - (step + decay - steps) as f64 * (lr - min_lr) / decay as f64,
                false => lr,
            },
        }
    }

    /// The warm-up's steps (one step of warm-up is none: the first step runs at `lr`).
    fn warmup(&self) -> usize {
        match *self {
            LrSchedule::Constant => 0,
            LrSchedule::WarmupCosine { warmup, .. } | LrSchedule::WarmupStableDecay { warmup, .. } => match warmup {
                0 | 1 => 0,
                w => w,
            },
        }
    }

    /// Everything the schedule needs of `lr` and `steps`, as a typed error.
    fn check(&self, lr: f64, steps: usize) -> Result<(), ConfigError> {
        crate::optim::check_lr(lr)?;
        let bad = |detail: String| Err(ConfigError::Schedule { detail });
        let (min_lr, decay) = match *self {
            LrSchedule::Constant => return Ok(()),
            LrSchedule::WarmupCosine { min_lr, .. } => (min_lr, 0),
            LrSchedule::WarmupStableDecay { decay, min_lr, .. } => (min_lr, decay),
        };
        if !(min_lr.is_finite() && (0.0..=lr).contains(&min_lr)) {
            return bad(format!(
                "min_lr {min_lr} must be at least 0 and at most the peak lr {lr}"
            ));
        }
        // Burn's linear and cosine schedulers take rates in (0, 1].
        if lr > 1.0 {
            return bad(format!("a warm-up or decay takes a peak lr of at most 1, not {lr}"));
        }
        if matches!(self, LrSchedule::WarmupStableDecay { .. }) && decay == 0 {
            return bad("warmup-stable-decay needs a decay of at least 1 step".into());
        }
        if self.warmup() + decay > steps {
            return bad(format!(
                "a warm-up of {} and a decay of {decay} steps do not fit a run of {steps}",
                self.warmup()
            ));
        }
        Ok(())
    }
}

/// `after`, preceded by the linear warm-up from `lr / warmup` to `lr` over `warmup` steps
/// (none for a warm-up of 0 or 1 step).
fn warmed(lr: f64, warmup: usize, after: LrSchedulerConfig) -> LrSchedulerConfig {
    if warmup <= 1 {
        return after;
    }
    let rise = LinearLrSchedulerConfig::new(lr / warmup as f64, lr, warmup - 1);
    SequentialLrSchedulerConfig::new(vec![rise.into(), after], vec![warmup]).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Burn's schedulers, composed, give the closed form at every step: each schedule over
    /// runs with and without warm-up, a one-step decay, a schedule that is all warm-up. Both
    /// compute the same f64 arithmetic in another order: 1e-12 relative.
    #[test]
    fn every_step_is_the_closed_form() {
        let cases = [
            (LrSchedule::Constant, 7),
            (LrSchedule::WarmupCosine { warmup: 0, min_lr: 0.0 }, 9),
            (
                LrSchedule::WarmupCosine {
                    warmup: 1,
                    min_lr: 1e-4,
                },
                9,
            ),
            (
                LrSchedule::WarmupCosine {
                    warmup: 4,
                    min_lr: 3e-4,
                },
                20,
            ),
            (LrSchedule::WarmupCosine { warmup: 6, min_lr: 0.0 }, 6),
            (
                LrSchedule::WarmupStableDecay {
                    warmup: 3,
                    decay: 5,
                    min_lr: 1e-4,
                },
                20,
            ),
            (
                LrSchedule::WarmupStableDecay {
                    warmup: 0,
                    decay: 1,
                    min_lr: 0.0,
                },
                4,
            ),
            (
                LrSchedule::WarmupStableDecay {
                    warmup: 2,
                    decay: 3,
                    min_lr: 0.0,
                },
                5,
            ),
        ];
        for (schedule, steps) in cases {
            let lr = 3e-3;
            let mut scheduler = schedule.scheduler(lr, steps).unwrap();
            for step in 1..=steps {
                let (ours, closed) = (scheduler.step().base(), schedule.lr_at(lr, steps, step));
                assert!(
                    (ours - closed).abs() <= 1e-12 * lr,
                    "{schedule:?} over {steps}: step {step} runs at {ours}, the closed form {closed}"
                );
            }
        }
        // Spot values: the warm-up's first step, the peak, the decay's end.
        let wsd = LrSchedule::WarmupStableDecay {
            warmup: 4,
            decay: 2,
            min_lr: 0.0,
        };
        assert_eq!(wsd.lr_at(1.0, 10, 1), 0.25);
        assert_eq!(wsd.lr_at(1.0, 10, 8), 1.0);
        assert_eq!(wsd.lr_at(1.0, 10, 10), 0.0);
        let cosine = LrSchedule::WarmupCosine { warmup: 0, min_lr: 0.0 };
        assert!((cosine.lr_at(1.0, 4, 3) - 0.5).abs() < 1e-15);
    }

    /// A schedule that cannot run is a typed error naming what is wrong, before any step.
    #[test]
    fn bad_schedules_are_errors() {
        let error = |schedule: LrSchedule, lr, steps| schedule.scheduler(lr, steps).err().unwrap().to_string();
        let cosine = |warmup, min_lr| LrSchedule::WarmupCosine { warmup, min_lr };
        assert!(error(cosine(0, 1e-2), 1e-3, 10).contains("min_lr 0.01 must be"));
        assert!(error(cosine(0, -1.0), 1e-3, 10).contains("min_lr -1 must be"));
        assert!(error(cosine(20, 0.0), 1e-3, 10).contains("do not fit a run of 10"));
        assert!(error(cosine(2, 0.0), 2.0, 10).contains("at most 1"));
        assert!(error(cosine(2, 0.0), f64::NAN, 10).contains("learning rate"));
        let wsd = |warmup, decay| LrSchedule::WarmupStableDecay {
            warmup,
            decay,
            min_lr: 0.0,
        };
        assert!(error(wsd(2, 0), 1e-3, 10).contains("decay of at least 1"));
        assert!(error(wsd(6, 5), 1e-3, 10).contains("do not fit"));
        // A constant rate takes any finite rate above 0 (1e30 included, for the overflow test).
        assert!(LrSchedule::Constant.scheduler(1e30, 3).is_ok());
    }
}
