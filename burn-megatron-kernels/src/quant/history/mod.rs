//! Delayed scaling's amax histories (`[3, len]`, newest first: a linear layer's input, weight
//! and output gradient) as one backend extension, [`HistoryOps`]: a step's amaxes pushed in
//! front, and the amax each row scales by. One kernel each on CUDA, where Burn's own ops took
//! about a dozen launches a layer a step (two `cat`s, slices, a general reduction of 30 µs) and
//! delayed scaling's steps were host-bound on them; tensor ops elsewhere (the reference). The
//! histories are not differentiated: on `Autodiff` the inner backend's op, as a constant.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, AutodiffBackend};
use burn::tensor::Tensor;

#[cfg(feature = "cuda")]
pub(crate) mod kernel;
pub mod reference;

extension! {
    /// The backend extension behind [`push`] and [`kept`].
    pub trait HistoryOps, cuda: kernel;

    /// `history` `[3, len]` with the step's amaxes (`[1]` each, by row) in front and its oldest
    /// column dropped.
    fn amax_push(
        history: FloatTensor<Self>,
        input: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let row = |t| Tensor::<1>::from_primitive::<Self>(t);
        reference::push(
            Tensor::<2>::from_primitive::<Self>(history),
            [row(input), row(weight), row(output_grad)],
        )
        .try_into_primitive::<Self>()
        .expect("a CPU tensor")
    }

    /// The amax each row of `history` scales by, `[3]`: its largest, or with `most_recent` its
    /// newest.
    fn amax_kept(history: FloatTensor<Self>, most_recent: bool) -> FloatTensor<Self> {
        reference::kept(Tensor::<2>::from_primitive::<Self>(history), most_recent)
            .try_into_primitive::<Self>()
            .expect("a CPU tensor")
    }
}

impl<B: HistoryOps, C: burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy> HistoryOps
    for Autodiff<B, C>
{
    fn amax_push(
        history: FloatTensor<Self>,
        input: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let inner = |t: FloatTensor<Self>| t.into_parts().0;
        <Self as AutodiffBackend>::from_inner(B::amax_push(
            inner(history),
            inner(input),
            inner(weight),
            inner(output_grad),
        ))
    }

    fn amax_kept(history: FloatTensor<Self>, most_recent: bool) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::amax_kept(history.into_parts().0, most_recent))
    }
}

/// `history` (`[3, len]`, newest first) with `rows` (the step's amaxes, `[1]` each: input,
/// weight, output gradient) pushed in front and its oldest column dropped.
pub fn push(history: Tensor<2>, rows: [Tensor<1>; 3]) -> Tensor<2> {
    let [input, weight, output_grad] = rows.map(|r| r.cast(history.dtype()).into_dispatch());
    Tensor::from_dispatch(<burn::backend::Dispatch as HistoryOps>::amax_push(
        history.into_dispatch(),
        input,
        weight,
        output_grad,
    ))
}

/// The amax each row of `history` scales by (`[3]`): its largest, or with `most_recent` its newest.
pub fn kept(history: Tensor<2>, most_recent: bool) -> Tensor<1> {
    Tensor::from_dispatch(<burn::backend::Dispatch as HistoryOps>::amax_kept(
        history.into_dispatch(),
        most_recent,
    ))
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, TensorData};

    use super::*;

    /// A push puts the rows in front and drops the oldest column; the kept amaxes are each
    /// row's largest or newest; a history of one column is replaced.
    #[test]
    fn push_and_kept_on_the_cpu() {
        let device = Device::flex();
        let history = Tensor::<2>::from_data(TensorData::new(vec![2.0f32, 5.0, 1.0, 1.0, 0.0, 0.0], [3, 2]), &device);
        let row = |v: f32| Tensor::<1>::from_floats([v], &device);
        let pushed = push(history.clone(), [row(9.0), row(0.5), row(3.0)]);
        let values: Vec<f32> = pushed.clone().into_data().try_to_vec().unwrap();
        assert_eq!(values, vec![9.0, 2.0, 0.5, 1.0, 3.0, 0.0]);
        let kept_values = |h: Tensor<2>, recent| -> Vec<f32> { kept(h, recent).into_data().try_to_vec().unwrap() };
        assert_eq!(kept_values(history.clone(), false), vec![5.0, 1.0, 0.0]);
        assert_eq!(kept_values(history, true), vec![2.0, 1.0, 0.0]);
        assert_eq!(kept_values(pushed, false), vec![9.0, 1.0, 3.0]);
        let single = Tensor::<2>::zeros([3, 1], &device);
        let values: Vec<f32> = push(single, [row(1.0), row(2.0), row(3.0)])
            .into_data()
            .try_to_vec()
            .unwrap();
        assert_eq!(values, vec![1.0, 2.0, 3.0]);
    }
}
