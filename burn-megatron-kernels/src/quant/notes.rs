//! The amaxes fused kernels take as they write a tensor, for the FP8 tensorwise cast that
//! quantizes the same tensor next (on CUDA; the cast then skips its own pass over the tensor),
//! and the amaxes of parameters' new values, which the optimizer's update takes as it writes them.
//!
//! They are kept in an [`AmaxNotes`]: a value a model's layers share, handed to every op that
//! notes an amax ([`NoteAmaxes`] names the results to note and where) and to every product that
//! may take one (its amax group, `quant::product::AmaxGroup::notes`), and to the optimizer that
//! writes the parameters. Nothing is kept in process or thread state. A miss costs only the pass
//! the cast would have run anyway, and the values are the same either way; off CUDA nothing is
//! noted.

use std::sync::{Arc, Mutex};

use burn::tensor::Tensor;

/// Where the amaxes of one model's tensors are kept: see the module docs. Clones share it.
#[derive(Clone, Default)]
pub struct AmaxNotes {
    #[cfg(feature = "cuda")]
    pub(crate) inner: Arc<Mutex<crate::cuda::known_amax::Notes>>,
    #[cfg(not(feature = "cuda"))]
    inner: Arc<Mutex<()>>,
}

impl std::fmt::Debug for AmaxNotes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AmaxNotes")
    }
}

impl AmaxNotes {
    /// Whether `self` and `other` are the same notes (a model's layers share one).
    pub fn same(&self, other: &AmaxNotes) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Keeps `amax` (`[1]`, f32: [`crate::adamw::MasterStep::amax`]) as the largest magnitude of
    /// `value`, the new value of parameter `index` (of the optimizer that writes them), for the FP8
    /// casts that read the parameter until its next value replaces this one (on CUDA; elsewhere
    /// nothing is kept).
    pub fn keep_parameter<const D: usize>(&self, index: usize, value: &Tensor<D>, amax: Tensor<1>) {
        #[cfg(feature = "cuda")]
        {
            use burn::backend::Cube;
            let cuda = |t: Tensor<D>| t.inner().try_into_primitive::<Cube>().ok();
            if let (Some(value), Some(amax)) = (cuda(value.clone()), amax.inner().try_into_primitive::<Cube>().ok()) {
                self.lock().keep_parameter(index, &value, amax);
            }
        }
        #[cfg(not(feature = "cuda"))]
        let _ = (index, value, amax);
    }

    /// The amax noted for `x` (`[1]` f32), taken: a kernel's note is gone after (a parameter's
    /// stays for its next cast). `None` where none is noted.
    pub fn take<const D: usize>(&self, x: &Tensor<D>) -> Option<Tensor<1>> {
        #[cfg(feature = "cuda")]
        {
            use burn::backend::Cube;
            let primitive = x.clone().inner().try_into_primitive::<Cube>().ok()?;
            self.take_primitive(&primitive).map(Tensor::from_primitive::<Cube>)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = x;
            None
        }
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, crate::cuda::known_amax::Notes> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn take_primitive(
        &self,
        x: &burn_cubecl::tensor::CubeTensor,
    ) -> Option<burn_cubecl::tensor::CubeTensor> {
        self.lock().take(x)
    }
}

/// The results of a kernel (SwiGLU, RMSNorm, RoPE, attention) whose amaxes it notes as it writes
/// them, and where: its output (the next product's input) and its inputs' gradients (the
/// previous products' output gradients). `None`: not noted.
#[derive(Clone, Debug, Default)]
pub struct NoteAmaxes {
    pub output: Option<AmaxNotes>,
    pub input_grads: Option<AmaxNotes>,
}

impl NoteAmaxes {
    /// Nothing noted.
    pub fn none() -> Self {
        Self::default()
    }

    /// The output's amax into `notes`, where given.
    pub fn output(notes: Option<AmaxNotes>) -> Self {
        Self {
            output: notes,
            input_grads: None,
        }
    }

    /// Whether nothing is noted.
    pub fn is_none(&self) -> bool {
        self.output.is_none() && self.input_grads.is_none()
    }
}
