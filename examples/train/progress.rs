//! A progress bar with an ETA for the plain driver in a terminal (indicatif): each step's line
//! printed above it.

use burn_megatron::train::{Lines, Reporter, StepRate, StepValues};
use indicatif::{ProgressBar, ProgressStyle};

/// The bar over a run's steps, `done` of `steps` taken before it starts.
pub struct Bar {
    bar: ProgressBar,
}

impl Bar {
    pub fn new(done: usize, steps: usize) -> Self {
        let bar = ProgressBar::new(steps as u64).with_position(done as u64);
        let style = ProgressStyle::with_template("{bar:40} {pos}/{len} steps, {elapsed} elapsed, ETA {eta} {msg}")
            .expect("a valid template");
        bar.set_style(style);
        Self { bar }
    }
}

impl Reporter for Bar {
    fn step(&mut self, values: &StepValues, rate: &StepRate) {
        self.bar.suspend(|| Lines.step(values, rate));
        self.bar.set_position(values.step);
        self.bar.set_message(format!("loss {:.4}", values.loss));
    }

    fn eval(&mut self, step: u64, loss: f64) {
        self.bar.suspend(|| Lines.eval(step, loss));
    }

    fn note(&mut self, text: &str) {
        self.bar.suspend(|| Lines.note(text));
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}
