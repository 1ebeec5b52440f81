//! The layer suite on the CPU, ranks as threads, in f32: tp = 2 and tp = 4 against tp = 1.

use burn_megatron_tests::{Harness, for_each_layer_test};

mod tp2 {
    use super::*;
    for_each_layer_test!(stamp!(Harness::cpu(2)));
}

mod tp4 {
    use super::*;
    for_each_layer_test!(stamp!(Harness::cpu(4)));
}
