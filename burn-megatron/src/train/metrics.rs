//! A run's metrics file: one JSON object a line, appended as the run goes (a resumed run adds
//! to its file), each flushed so a reader sees it at once.
//!
//! ```text
//! {"step":3,"loss":4.71,"lr":0.003,"grad_norm":1.9,"tokens_per_s":5120.0,"mfu":null,"memory_bytes":null,"parts":{"aux_loss":0.01},"expert_load":[40,24],"dropped":0}
//! {"step":4,"loss":4.70,"lr":0.003,"grad_norm":null,…,"skipped":true}
//! {"step":9,"loss":14.2,…,"spike":3.1}
//! {"step":3,"eval_loss":4.80}
//! ```

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;

use serde::Serialize;
use serde_json::{Map, Value, json};

use super::report::StepValues;

/// What a step's line adds to its [`StepValues`]: its speed and the device's memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct StepRate {
    pub tokens_per_s: f64,
    /// Model FLOP/s per device over the device's dense bf16 peak, where the peak is known.
    pub mfu: Option<f64>,
    /// Bytes the device's pools hold in tensors, where the device keeps pools.
    pub memory_bytes: Option<u64>,
}

/// Appends metrics lines to a file.
pub struct MetricsLog {
    file: BufWriter<File>,
}

impl MetricsLog {
    /// The log at `path`, created (with its directory) or appended to.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            file: BufWriter::new(file),
        })
    }

    /// A step's line.
    pub fn step(&mut self, values: &StepValues, rate: StepRate) -> std::io::Result<()> {
        let mut line = Map::new();
        line.insert("step".into(), json!(values.step));
        line.insert("loss".into(), json!(values.loss));
        line.insert("lr".into(), json!(values.lr));
        line.insert("grad_norm".into(), json!(values.grad_norm));
        line.insert("tokens_per_s".into(), json!(rate.tokens_per_s));
        line.insert("mfu".into(), json!(rate.mfu));
        line.insert("memory_bytes".into(), json!(rate.memory_bytes));
        if !values.parts.is_empty() {
            let parts: Map<String, Value> = values.parts.iter().map(|(n, v)| (n.clone(), json!(v))).collect();
            line.insert("parts".into(), Value::Object(parts));
        }
        if let Some(load) = &values.expert_load {
            line.insert("expert_load".into(), json!(load.per_expert));
            line.insert("dropped".into(), json!(load.dropped));
        }
        if values.skipped {
            line.insert("skipped".into(), json!(true));
        }
        if let Some(ratio) = values.spike {
            line.insert("spike".into(), json!(ratio));
        }
        self.write(Value::Object(line))
    }

    /// An evaluation's line.
    pub fn eval(&mut self, step: u64, loss: f64) -> std::io::Result<()> {
        self.write(json!({ "step": step, "eval_loss": loss }))
    }

    fn write(&mut self, line: Value) -> std::io::Result<()> {
        serde_json::to_writer(&mut self.file, &line)?;
        self.file.write_all(b"\n")?;
        self.file.flush()
    }
}

/// Reads a metrics file back: every line's object, in order.
pub fn read_metrics(path: &Path) -> std::io::Result<Vec<Map<String, Value>>> {
    let text = std::fs::read_to_string(path)?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| match serde_json::from_str(l) {
            Ok(Value::Object(map)) => Ok(map),
            Ok(_) => Err(std::io::Error::other(format!(
                "{}: a line is not an object",
                path.display()
            ))),
            Err(e) => Err(std::io::Error::other(format!("{}: {e}", path.display()))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::ExpertLoad;

    /// Lines append across opens and read back as written.
    #[test]
    fn lines_append_and_read_back() {
        let path = std::env::temp_dir().join(format!("burn-megatron-metrics-{}/m.jsonl", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let values = StepValues {
            step: 3,
            loss: 4.5,
            lr: 1e-3,
            grad_norm: Some(2.0),
            parts: vec![("aux_loss".into(), 0.25)],
            expert_load: Some(ExpertLoad {
                per_expert: vec![3, 5],
                dropped: 1,
            }),
            timing: None,
            skipped: false,
            spike: Some(3.5),
        };
        let rate = StepRate {
            tokens_per_s: 100.0,
            mfu: None,
            memory_bytes: Some(7),
        };
        MetricsLog::open(&path).unwrap().step(&values, rate).unwrap();
        MetricsLog::open(&path).unwrap().eval(3, 4.75).unwrap();
        let lines = read_metrics(&path).unwrap();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["loss"], json!(4.5));
        assert_eq!(lines[0]["parts"]["aux_loss"], json!(0.25));
        assert_eq!(lines[0]["expert_load"], json!([3, 5]));
        assert_eq!(lines[0]["mfu"], Value::Null);
        assert_eq!(lines[0]["spike"], json!(3.5));
        assert_eq!(lines[0].get("skipped"), None);
        assert_eq!(
            lines[1],
            json!({"step": 3, "eval_loss": 4.75}).as_object().unwrap().clone()
        );
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }
}
