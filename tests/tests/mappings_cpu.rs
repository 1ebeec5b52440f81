//! The mapping suite on the CPU, ranks as threads, in f32.

use burn_megatron_tests::{Harness, stamp};

mod tp2 {
    use super::*;
    stamp!(Harness::cpu(2); mapping_suite:
        copy_to_tp_grads, reduce_from_tp_grads, scatter_to_sp_grads, gather_from_sp_grads,
        gather_from_tp_grads, reduce_scatter_to_sp_grads, all_to_all_grads,
        all_to_all_uneven_grads, mapping_errors_are_typed);
}

mod tp4 {
    use super::*;
    stamp!(Harness::cpu(4); mapping_suite:
        copy_to_tp_grads, reduce_from_tp_grads, scatter_to_sp_grads, gather_from_sp_grads,
        gather_from_tp_grads, reduce_scatter_to_sp_grads, all_to_all_grads,
        all_to_all_uneven_grads, mapping_errors_are_typed);
}
