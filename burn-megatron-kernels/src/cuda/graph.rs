//! A run of CUDA launches captured into a graph once and replayed, its inputs rewritten in place
//! between replays: CubeCL 0.11's capture (`Client::graph_prepare`, `start_capture`,
//! `stop_capture`, `Graph::replay`; `cubecl-runtime-0.11.3/src/client.rs`). A replay costs one
//! launch whatever the run held, which is what a decoding step bound by launching its kernels
//! one by one needs.
//!
//! The order is CubeCL's: [`Recorder::prepare`] before a warm-up run of the same code (whose
//! allocations the recording then reuses: the window allocates nothing), then
//! [`Recorder::record`] around a second run, which is recorded, not executed. Inside the window
//! nothing may read a tensor to the host or write one from it; a run that does fails the
//! recording with [`GraphError::Runtime`], and nothing ran. Launch arguments are frozen into
//! the graph, so whatever changes between replays must live in a device tensor the kernels
//! read, rewritten with [`overwrite`].

use std::fmt;

use burn::tensor::{Int, Tensor, TensorData};

/// Why a capture, a replay or an in-place write was refused.
#[derive(Clone, Debug, PartialEq)]
pub enum GraphError {
    /// Graphs are captured on CUDA tensors outside autodiff (this build or this tensor has none).
    NotCuda,
    /// The runtime refused a step: what it said.
    Runtime(String),
    /// An in-place write that does not fit its tensor.
    Write { expected: usize, got: usize },
    /// An in-place write into a view or padded tensor, whose buffer is not its values in order.
    NotCompact,
}

impl fmt::Display for GraphError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GraphError::NotCuda => write!(f, "CUDA graphs need CUDA tensors outside autodiff"),
            GraphError::Runtime(reason) => write!(f, "the CUDA runtime refused the graph: {reason}"),
            GraphError::Write { expected, got } => {
                write!(f, "an in-place write of {got} values into a tensor of {expected}")
            }
            GraphError::NotCompact => write!(f, "an in-place write into a view or a padded tensor"),
        }
    }
}

impl std::error::Error for GraphError {}

/// Captures the launches of the thread that calls it on the device of the tensor it was made
/// from (CubeCL's stream is the calling thread's).
pub struct Recorder {
    #[cfg(feature = "cuda")]
    client: cubecl::client::Client,
    #[cfg(not(feature = "cuda"))]
    never: std::convert::Infallible,
}

/// A recorded run, replayed as one launch on the stream it was recorded on.
pub struct Graph {
    #[cfg(feature = "cuda")]
    inner: cubecl::client::Graph,
    #[cfg(not(feature = "cuda"))]
    never: std::convert::Infallible,
}

impl Recorder {
    /// A recorder for the device `like` lives on.
    pub fn on<const D: usize>(like: &Tensor<D>) -> Result<Self, GraphError> {
        #[cfg(feature = "cuda")]
        {
            let cube = like.clone().try_into_primitive::<burn::backend::Cube>();
            match cube {
                Ok(t) if matches!(t.device, cubecl::Device::Cuda(_)) => Ok(Self { client: t.client }),
                _ => Err(GraphError::NotCuda),
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = like;
            Err(GraphError::NotCuda)
        }
    }

    /// Arms the stream for a capture: call it before the warm-up run.
    pub fn prepare(&self) -> Result<(), GraphError> {
        #[cfg(feature = "cuda")]
        return self.client.graph_prepare().map_err(runtime);
        #[cfg(not(feature = "cuda"))]
        match self.never {}
    }

    /// Records `run`'s launches (they do not execute) and returns its outputs, whose buffers
    /// each replay writes, with the graph.
    pub fn record<R>(&self, run: impl FnOnce() -> R) -> Result<(R, Graph), GraphError> {
        #[cfg(feature = "cuda")]
        {
            self.client.start_capture().map_err(runtime)?;
            let out = run();
            let inner = self.client.stop_capture().map_err(runtime)?;
            Ok((out, Graph { inner }))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = run;
            match self.never {}
        }
    }
}

impl Graph {
    /// Enqueues the recorded run (returns before it finishes; a read of an output waits).
    ///
    /// # Safety
    /// Every tensor the recorded run read or wrote that is still meant to be read or written
    /// (its inputs, its outputs, state such as a KV cache it updates in place) must be alive
    /// and not rewritten elsewhere until the replay is done, and its inputs rewritten only
    /// with [`overwrite`] from the thread that recorded it: the graph re-runs against the raw
    /// buffers it was recorded with. (The intermediates the run dropped are kept for the
    /// graph by CubeCL.)
    pub unsafe fn replay(&self) -> Result<(), GraphError> {
        #[cfg(feature = "cuda")]
        // SAFETY: the caller's contract above is CubeCL's for `Graph::replay`.
        return unsafe { self.inner.replay() }.map_err(runtime);
        #[cfg(not(feature = "cuda"))]
        match self.never {}
    }
}

#[cfg(feature = "cuda")]
fn runtime(error: cubecl::server::ServerError) -> GraphError {
    GraphError::Runtime(format!("{error:?}"))
}

/// Writes `values` into `tensor`'s own buffer (compact, on CUDA), converted to its dtype:
/// a graph's input rewritten for its next replay. Ordered on the calling thread's stream.
pub fn overwrite<const D: usize>(tensor: &Tensor<D>, values: &[f32]) -> Result<(), GraphError> {
    #[cfg(feature = "cuda")]
    let cube = tensor.clone().try_into_primitive::<burn::backend::Cube>().ok();
    #[cfg(not(feature = "cuda"))]
    let cube: Option<Primitive> = {
        let _ = tensor;
        None
    };
    write(cube, TensorData::new(values.to_vec(), [values.len()]))
}

/// [`overwrite`] for an integer tensor.
pub fn overwrite_int<const D: usize>(tensor: &Tensor<D, Int>, values: &[i64]) -> Result<(), GraphError> {
    #[cfg(feature = "cuda")]
    let cube = tensor.clone().try_into_primitive::<burn::backend::Cube>().ok();
    #[cfg(not(feature = "cuda"))]
    let cube: Option<Primitive> = {
        let _ = tensor;
        None
    };
    write(cube, TensorData::new(values.to_vec(), [values.len()]))
}

/// A CUDA tensor's primitive (none exists without the `cuda` feature).
#[cfg(feature = "cuda")]
type Primitive = burn_cubecl::tensor::CubeTensor;
#[cfg(not(feature = "cuda"))]
type Primitive = std::convert::Infallible;

fn write(t: Option<Primitive>, data: TensorData) -> Result<(), GraphError> {
    let t = t.ok_or(GraphError::NotCuda)?;
    #[cfg(feature = "cuda")]
    {
        let expected = t.meta.num_elements();
        if data.num_elements() != expected {
            return Err(GraphError::Write {
                expected,
                got: data.num_elements(),
            });
        }
        if !crate::cuda::launch::is_compact(&t) {
            return Err(GraphError::NotCompact);
        }
        let bytes = data.convert_dtype(t.dtype).into_bytes();
        t.client.write(&t.handle, bytes);
        Ok(())
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = data;
        match t {}
    }
}
