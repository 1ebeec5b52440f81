//! [`AfterStep`]: what a rank's model moves outside the gradient after each optimizer step
//! under [`MegatronStrategy`](super::MegatronStrategy), as the plain loop does after its own
//! step: DeepSeek-V3's expert biases (from the step's loads), delayed FP8 scaling's amax
//! histories. Burn's Learner has no such call, and its strategies are generic over the model,
//! so the model's own update comes in as a function of the model and the step's output.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use burn_megatron_dist::ProcessGroups;

type Update = dyn Fn(Box<dyn Any>, &dyn Any, &ProcessGroups) -> Result<Box<dyn Any>, String> + Send + Sync;

/// A model's update after each optimizer step: `M` the model the Learner trains, `O` its
/// `TrainStep::Output`.
#[derive(Clone)]
pub struct AfterStep {
    update: Arc<Update>,
    model: &'static str,
    output: &'static str,
}

impl AfterStep {
    /// `update(model, the step's output, the rank's groups)` after each optimizer step. Every
    /// rank calls it at the same point (it may run collectives).
    pub fn new<M: 'static, O: 'static>(
        update: impl Fn(M, &O, &ProcessGroups) -> Result<M, String> + Send + Sync + 'static,
    ) -> Self {
        let (model, output) = (std::any::type_name::<M>(), std::any::type_name::<O>());
        let update = move |m: Box<dyn Any>, o: &dyn Any, groups: &ProcessGroups| -> Result<Box<dyn Any>, String> {
            let m = *m.downcast::<M>().map_err(|_| format!("an update for {model}"))?;
            let o = o
                .downcast_ref::<O>()
                .ok_or_else(|| format!("an update for outputs {output}"))?;
            Ok(Box::new(update(m, o, groups)?))
        };
        Self {
            update: Arc::new(update),
            model,
            output,
        }
    }

    /// `model` after the update, given the step's `output`; a model or output of other types
    /// than the update's is an error naming both.
    pub fn apply<M: 'static, O: 'static>(&self, model: M, output: &O, groups: &ProcessGroups) -> Result<M, String> {
        let mismatch = |what: String| {
            format!(
                "{what}: the strategy's after-step update takes {} and {}, the Learner trains {} with {}",
                self.model,
                self.output,
                std::any::type_name::<M>(),
                std::any::type_name::<O>()
            )
        };
        let updated =
            (self.update)(Box::new(model), output, groups).map_err(|e| match e.starts_with("an update for") {
                true => mismatch(e),
                false => e,
            })?;
        Ok(*updated.downcast::<M>().map_err(|_| mismatch("an update".into()))?)
    }
}

impl fmt::Debug for AfterStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AfterStep({} with {})", self.model, self.output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The update runs on its own types and refuses others by name.
    #[test]
    fn typed_updates() {
        let groups = ProcessGroups::single();
        let add = AfterStep::new(|m: u32, o: &u32, _: &ProcessGroups| Ok(m + o));
        assert_eq!(add.apply(2u32, &3u32, &groups), Ok(5));
        let error = add.apply(2u64, &3u32, &groups).unwrap_err();
        assert!(
            error.contains("takes u32 and u32") && error.contains("trains u64"),
            "{error}"
        );
        let error = add.apply(2u32, &"three", &groups).unwrap_err();
        assert!(error.contains("with &str"), "{error}");
        let failing = AfterStep::new(|_: u32, _: &u32, _: &ProcessGroups| Err::<u32, _>("lost a peer".to_string()));
        assert_eq!(failing.apply(1u32, &1u32, &groups), Err("lost a peer".to_string()));
    }
}
