//! Mixture of experts (Megatron Core's MoE stack), planned by `plan/expert.rs`. Built so far: the
//! router ([`router`]) and its load-balancing losses ([`balance`]).

pub mod balance;
pub mod router;

pub use balance::RouterLosses;
pub use router::{GroupLimit, Router, RouterConfig, Routing, Scoring};
