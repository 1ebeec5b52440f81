//! The model suite on the CPU, ranks as threads, in f32: the tiny Llama at tp = 2 and 4.

use burn_megatron_tests::{Harness, model_suite};

mod tp2 {
    use super::*;

    #[test]
    fn mtp_matches_its_definition() {
        model_suite::mtp_matches_its_definition(&Harness::cpu(2));
    }

    #[test]
    fn tiny_loss_and_gradients() {
        model_suite::tiny_loss_and_gradients(&Harness::cpu(2));
    }

    #[test]
    fn adamw_steps_match() {
        model_suite::adamw_steps_match(&Harness::cpu(2));
    }

    #[test]
    fn fp8_steps_match() {
        model_suite::fp8_steps_match(&Harness::cpu(2));
    }

    #[test]
    fn fp8_delayed_steps_match() {
        model_suite::fp8_delayed_steps_match(&Harness::cpu(2));
    }

    #[test]
    fn delayed_scaling_histories() {
        model_suite::delayed_scaling_histories(&Harness::cpu(2));
    }

    #[test]
    fn delayed_histories_land_on_their_layers() {
        model_suite::delayed_histories_land_on_their_layers(&Harness::cpu(2));
    }

    #[test]
    fn grad_norm_counts_each_parameter_once() {
        model_suite::grad_norm_counts_each_parameter_once(&Harness::cpu(2));
    }

    #[test]
    fn zero1_matches_unsharded() {
        model_suite::zero1_matches_unsharded(&Harness::cpu(2));
    }
}

#[test]
fn quantized_recipes_track_the_curve() {
    for (recipe, plain, ours) in model_suite::quantized_recipes_track_the_curve(&Harness::cpu(1)) {
        for step in (0..plain.len()).step_by(20).chain([plain.len() - 1]) {
            println!(
                "{recipe:?} step {step}: f32 {:.5} quantized {:.5}",
                plain[step], ours[step]
            );
        }
    }
}

mod tp4 {
    use super::*;

    #[test]
    fn tiny_loss_and_gradients() {
        model_suite::tiny_loss_and_gradients(&Harness::cpu(4));
    }
}

#[test]
fn mtp_matches_its_definition_on_one_rank() {
    model_suite::mtp_matches_its_definition(&Harness::cpu(1));
}
