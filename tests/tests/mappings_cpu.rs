//! The mapping suite on the CPU, ranks as threads, in f32.

use burn_megatron_tests::{Harness, for_each_mapping_test};

mod tp2 {
    use super::*;
    for_each_mapping_test!(stamp!(Harness::cpu(2)));
}

mod tp4 {
    use super::*;
    for_each_mapping_test!(stamp!(Harness::cpu(4)));
}
