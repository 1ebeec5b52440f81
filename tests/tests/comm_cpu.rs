//! The communicator suite on the CPU, ranks as threads (in-process transport).

use burn_megatron_tests::{Harness, stamp};

mod tp2 {
    use super::*;
    stamp!(Harness::cpu(2); comm_suite:
        all_reduce_floats, all_reduce_ints, all_gather_every_dim, reduce_scatter_every_dim,
        all_to_all_even_and_uneven, broadcast_send_recv_barrier,
        mismatches_are_errors_on_every_rank, a_missing_rank_times_out_with_its_name);
}

mod tp4 {
    use super::*;
    stamp!(Harness::cpu(4); comm_suite:
        all_reduce_floats, all_reduce_ints, all_gather_every_dim, reduce_scatter_every_dim,
        all_to_all_even_and_uneven, broadcast_send_recv_barrier,
        mismatches_are_errors_on_every_rank, a_missing_rank_times_out_with_its_name);
}
