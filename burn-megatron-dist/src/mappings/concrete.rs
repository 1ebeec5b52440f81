//! The concrete backends' side of [`MappingOps`]: a primitive becomes a `Tensor` of its rank,
//! goes through the group's collectives, and comes back as a primitive.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, DispatchKindConversion, Flex};
use burn::tensor::{BackendPrimitive, DispatchTensor, Float, Tensor};

use super::{Mapping, MappingOps, rank_of, run_step};

/// Runs the mapping's step on a primitive of backend `B`, leaving the outcome in the mapping.
fn run_primitive<B: Backend>(x: FloatTensor<B>, mapping: &Mapping) -> FloatTensor<B>
where
    Float: BackendPrimitive<B, Primitive = FloatTensor<B>>,
    DispatchTensor: DispatchKindConversion<B>,
{
    macro_rules! at_rank {
        ($($d:literal)*) => {
            match rank_of(&x) {
                $($d => {
                    let input = Tensor::<$d>::from_primitive::<B>(x);
                    let fallback = input.clone();
                    let (out, splits) = match run_step(input, &mapping.group, &mapping.step) {
                        Ok(done) => done,
                        Err(error) => {
                            mapping.outcome.lock().expect("outcome").error = Some(error);
                            (fallback, Vec::new())
                        }
                    };
                    mapping.outcome.lock().expect("outcome").recv_splits = splits;
                    out.try_into_primitive::<B>().expect("the tensor stays on its backend")
                })*
                rank => panic!("collectives support tensors of rank 1 to 6, not {rank}"),
            }
        };
    }
    at_rank!(1 2 3 4 5 6)
}

impl MappingOps for Flex {
    fn mapping(x: FloatTensor<Self>, mapping: Mapping) -> FloatTensor<Self> {
        run_primitive::<Self>(x, &mapping)
    }
}

#[cfg(feature = "cuda")]
impl MappingOps for burn::backend::Cube {
    fn mapping(x: FloatTensor<Self>, mapping: Mapping) -> FloatTensor<Self> {
        run_primitive::<Self>(x, &mapping)
    }
}
