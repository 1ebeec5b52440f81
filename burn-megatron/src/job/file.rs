//! A job read from its file and the command line: the file's sections, then each [`Override`]
//! (a dotted path into them, `optimizer.lr = 3e-4`) in order, every one checked as it lands so
//! an error names the override that made it. A resumed job is held to the checkpoint's in what
//! a checkpoint cannot change ([`JobConfig::check_resume`]).

use std::path::{Path, PathBuf};

use serde::Serialize;
use toml::{Table, Value};

use super::{DataSection, JobConfig, ModelSection, PrecisionSection};
use crate::error::ConfigError;

/// Why a job cannot run.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum JobError {
    /// The job file could not be read or parsed (`detail` names the line and the field).
    #[error("{path}: {detail}", path = path.display())]
    File { path: PathBuf, detail: String },
    /// An override that names no field, or gives it a value it cannot take.
    #[error("--{key}: {detail}")]
    Override { key: String, detail: String },
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A field that does not fit the rest of the job.
    #[error("{field}: {detail}")]
    Field { field: &'static str, detail: String },
    /// The model's files could not be read.
    #[error("model: {detail}")]
    Source { detail: String },
    /// The job's estimated peak memory a rank passes the device's.
    #[error(
        "the job needs about {peak_gib:.1} GiB a rank ({state_gib:.1} GiB of parameters, gradients and optimizer state, {micro} sequences a microbatch at {sequence_gib:.2} GiB each), the device has {capacity_gib:.1} GiB: {advice}"
    )]
    Memory {
        peak_gib: f64,
        state_gib: f64,
        micro: usize,
        sequence_gib: f64,
        capacity_gib: f64,
        /// The largest microbatch that fits, 0 where not even the state does.
        largest: usize,
        advice: String,
    },
    /// A resumed job that changes what its checkpoint fixed.
    #[error(
        "--load: the checkpoint was trained with {field} = {saved}, this job has {asked}: a resumed run keeps its model, data, batch, precision and seed (its layout, optimizer, schedule and steps may change)"
    )]
    Resume {
        field: String,
        saved: String,
        asked: String,
    },
}

/// One field of a job set from the command line: its dotted path (`optimizer.lr`) and value.
#[derive(Clone, Debug, PartialEq)]
pub struct Override {
    pub key: String,
    pub value: Value,
}

impl Override {
    pub fn new(key: impl Into<String>, value: impl Into<Value>) -> Self {
        Self {
            key: key.into(),
            value: value.into(),
        }
    }

    /// `key` set to `text` read as a TOML value (`3e-4`, `true`, `[0, 1]`), or else as the
    /// string itself (`fp8-tensorwise`, a path).
    pub fn parse(key: &str, text: &str) -> Self {
        let value = toml::from_str::<Table>(&format!("v = {text}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| Value::String(text.to_string()));
        Self::new(key, value)
    }

    /// Sets the field in `table`, making the sections on the way.
    fn apply(&self, table: &mut Table) -> Result<(), JobError> {
        let fail = |detail: String| JobError::Override {
            key: self.key.clone(),
            detail,
        };
        let parts: Vec<&str> = self.key.split('.').collect();
        if parts.iter().any(|p| p.is_empty()) {
            return Err(fail("expected SECTION.FIELD (as `optimizer.lr`)".into()));
        }
        let (last, sections) = parts.split_last().expect("split gives one part at least");
        let mut at = table;
        for section in sections {
            let entry = at
                .entry(section.to_string())
                .or_insert_with(|| Value::Table(Table::new()));
            at = match entry {
                Value::Table(inner) => inner,
                _ => return Err(fail(format!("{section} is a field, not a section"))),
            };
        }
        at.insert(last.to_string(), self.value.clone());
        Ok(())
    }
}

impl JobConfig {
    /// The job in `file` (the defaults without one), then `overrides` in order.
    pub fn parse(file: Option<&Path>, overrides: &[Override]) -> Result<Self, JobError> {
        let mut table = match file {
            None => Table::new(),
            Some(path) => {
                let fail = |detail: String| JobError::File {
                    path: path.to_path_buf(),
                    detail,
                };
                let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
                // Read whole first: the error then quotes the file's own line.
                toml::from_str::<JobConfig>(&text).map_err(|e| fail(e.to_string()))?;
                toml::from_str::<Table>(&text).map_err(|e| fail(e.to_string()))?
            }
        };
        let mut job = Value::Table(table.clone())
            .try_into::<JobConfig>()
            .map_err(|e| JobError::Field {
                field: "job",
                detail: e.to_string(),
            })?;
        for o in overrides {
            o.apply(&mut table)?;
            job = Value::Table(table.clone())
                .try_into::<JobConfig>()
                .map_err(|e| JobError::Override {
                    key: o.key.clone(),
                    detail: e.to_string().trim().to_string(),
                })?;
        }
        Ok(job)
    }

    /// The job in `text`, a job file's contents (as a checkpoint keeps it).
    pub fn from_toml(text: &str) -> Result<Self, JobError> {
        toml::from_str(text).map_err(|e| JobError::Field {
            field: "job",
            detail: e.to_string(),
        })
    }

    /// The job as a TOML file, which [`parse`](Self::parse) reads back.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a job serializes")
    }

    /// Refuses to resume with this job from a checkpoint trained with `saved` where the two
    /// differ in what a checkpoint fixes: the model, the data and its sequence length, the
    /// global batch, the precision and the seed (both resolved, every default filled in). The
    /// layout, optimizer, schedule, steps, checkpoints, evaluation and logging may change: a
    /// checkpoint reshards to any layout.
    pub fn check_resume(&self, saved: &JobConfig) -> Result<(), JobError> {
        match first_difference("", &Fixed::of(saved), &Fixed::of(self)) {
            None => Ok(()),
            Some((field, saved, asked)) => Err(JobError::Resume { field, saved, asked }),
        }
    }
}

/// What a checkpoint fixes of the job that trained it.
#[derive(Serialize)]
struct Fixed<'a> {
    seed: u64,
    model: &'a ModelSection,
    data: &'a DataSection,
    precision: &'a PrecisionSection,
    batch: GlobalBatch,
}

#[derive(Serialize)]
struct GlobalBatch {
    #[serde(skip_serializing_if = "Option::is_none")]
    global: Option<usize>,
}

impl Fixed<'_> {
    fn of(job: &JobConfig) -> Table {
        let fixed = Fixed {
            seed: job.seed,
            model: &job.model,
            data: &job.data,
            precision: &job.precision,
            batch: GlobalBatch {
                global: job.batch.global,
            },
        };
        let value = Value::try_from(fixed).expect("a job's fields serialize");
        value.as_table().cloned().expect("a struct serializes to a table")
    }
}

/// The first field (a dotted path) where `a` and `b` differ, with each side's value (`unset`
/// where one has none).
fn first_difference(prefix: &str, a: &Table, b: &Table) -> Option<(String, String, String)> {
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    for key in keys {
        let path = match prefix {
            "" => key.clone(),
            _ => format!("{prefix}.{key}"),
        };
        match (a.get(key), b.get(key)) {
            (Some(Value::Table(x)), Some(Value::Table(y))) => {
                if let Some(found) = first_difference(&path, x, y) {
                    return Some(found);
                }
            }
            (x, y) if x != y => {
                let show = |v: Option<&Value>| v.map_or("unset".to_string(), Value::to_string);
                return Some((path, show(x), show(y)));
            }
            _ => {}
        }
    }
    None
}
