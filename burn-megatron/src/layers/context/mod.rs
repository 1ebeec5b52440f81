//! Context parallelism's attention: this rank's load-balanced chunks of queries (`layout.rs`)
//! over the whole sequence's keys and values, causal, with no `s × s` matrix anywhere. Three
//! exchanges ([`ContextParallel`]):
//! - ring and all-gather: block attention merged by log-sum-exp, one autodiff op of its own
//!   (`blocks.rs`, `op.rs`);
//! - all-to-all (Ulysses): the heads scattered and the sequence gathered over cp (the
//!   differentiable `all_to_all` mapping), the whole sequence put in order, causal flash
//!   attention over it, and back.
//!
//! Legend: `b` batch, `h` query heads, `g` kv heads, `L` a chunk (`2L` tokens a rank), `d`
//! head_dim, `s = 2L·cp`.

mod blocks;
mod choice;
pub mod layout;
mod op;

pub use blocks::{BlockAttention, Exchange};
pub use choice::ContextParallel;
pub use layout::ContextLayout;
pub use op::block_attention;

use burn::tensor::{Int, Tensor};
use burn_megatron_dist::ProcessGroup;
use burn_megatron_dist::mappings::all_to_all;

use crate::error::{ConfigError, LayerError};
use crate::layers::heads::repeat_heads;

/// Causal attention of this rank's chunks over the whole sequence split over `cp`.
///
/// # Shapes
/// q `[b, h, 2L, d]`, k and v `[b, g, 2L, d]` → `[b, h, 2L, d]`
pub fn context_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    context: ContextParallel,
    cp: &ProcessGroup,
) -> Result<Tensor<4>, LayerError> {
    let scale = (q.dims()[3] as f32).sqrt().recip();
    let blocks = |exchange| BlockAttention {
        cp: cp.clone(),
        exchange,
        scale,
    };
    Ok(match context {
        ContextParallel::Ring => block_attention(q, k, v, blocks(Exchange::Ring))?,
        ContextParallel::AllGather => block_attention(q, k, v, blocks(Exchange::AllGather))?,
        ContextParallel::AllToAll => ulysses(q, k, v, cp, |q, k, v| {
            burn_megatron_kernels::attention::attention(q, k, v, true)
        })?,
    })
}

/// [`context_attention`] of rows packing several documents: each query sees the keys of its
/// own document up to itself, `starts` `[b, s]` each token's document's first index over the
/// whole row. Through the all-to-all exchange only, which puts the whole sequence on each rank
/// (the masked attention reads it there); ring and all-gather refuse, naming themselves.
///
/// # Shapes
/// q `[b, h, 2L, d]`, k and v `[b, g, 2L, d]`, `[b, s]` → `[b, h, 2L, d]`
pub fn context_document_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    starts: Tensor<2, Int>,
    context: ContextParallel,
    cp: &ProcessGroup,
) -> Result<Tensor<4>, LayerError> {
    if context != ContextParallel::AllToAll {
        return Err(ConfigError::Documents(format!(
            "context parallelism's {} exchange does not split packed documents: all-to-all does",
            context.name()
        ))
        .into());
    }
    ulysses(q, k, v, cp, |q, k, v| {
        burn_megatron_kernels::attention::document_attention(q, k, v, starts)
    })
}

/// Ulysses: `[b, h, 2L, d]` → `[b, h/cp, s, d]` (heads scattered, the sequence gathered in
/// rank order, then put in global order), `attend` over the whole sequence (kv heads
/// repeated), and back.
fn ulysses(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    cp: &ProcessGroup,
    attend: impl FnOnce(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>,
) -> Result<Tensor<4>, LayerError> {
    let layout = ContextLayout::new(cp);
    let s = q.dims()[2] * cp.size();
    let device = q.device();
    let to_global = layout::index(&layout.global_order(s), &device);
    let to_gathered = layout::index(&layout.gathered_positions(s), &device);
    let whole =
        |x: Tensor<4>| -> Result<Tensor<4>, LayerError> { Ok(all_to_all(x, cp, 1, 2)?.select(2, to_global.clone())) };
    let (q, k, v) = (whole(q)?, whole(k)?, whole(v)?);
    let per_kv = q.dims()[1] / k.dims()[1];
    let (k, v) = (repeat_heads(k, per_kv), repeat_heads(v, per_kv));
    let out = attend(q, k, v); // [b, h/cp, s, d]
    Ok(all_to_all(out.select(2, to_gathered), cp, 2, 1)?)
}
