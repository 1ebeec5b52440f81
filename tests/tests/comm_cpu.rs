//! The communicator suite on the CPU, ranks as threads (in-process transport).

use burn_megatron_tests::{Harness, for_each_comm_test};

mod tp2 {
    use super::*;
    for_each_comm_test!(stamp!(Harness::cpu(2)));
}

mod tp4 {
    use super::*;
    for_each_comm_test!(stamp!(Harness::cpu(4)));
}
