//! The MoE suite on the CPU, ranks as threads, in f32: ep = 2 and 4 (both dispatchers) and
//! tp = 2 × ep = 2 against ep = 1.

use burn_megatron_tests::{Harness, for_each_moe_layer_test, for_each_moe_model_test};

for_each_moe_layer_test!(stamp!(Harness::cpu(4)));
for_each_moe_model_test!(stamp!(Harness::cpu(4)));
