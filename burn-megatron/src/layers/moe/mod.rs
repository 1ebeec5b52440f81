//! Mixture of experts (Megatron Core's MoE stack), planned by `plan/expert.rs`: the router
//! ([`router`]) with its load-balancing losses ([`balance`]), the dispatch of token copies by
//! expert and back ([`dispatch`]), expert capacity with token dropping ([`capacity`]), the copies'
//! exchange over the expert-parallel group ([`exchange`]), the SwiGLU experts ([`experts`]) and
//! the layer that joins them ([`layer`]).

pub mod balance;
pub mod capacity;
pub mod dispatch;
pub mod exchange;
pub mod experts;
pub mod layer;
pub mod router;

pub use balance::RouterLosses;
pub use capacity::{Capacity, DropPolicy};
pub use exchange::ExpertParallel;
pub use experts::{Experts, ExpertsConfig};
pub use layer::{Load, Moe, MoeConfig};
pub use router::{GroupLimit, Router, RouterConfig, Routing, Scoring};
