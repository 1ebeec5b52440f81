//! The parallel model against the plain one, and the command line.

use burn::module::Param;
use burn::tensor::{Device, Gradients, Tensor};
use burn_megatron::init::Shard;
use burn_megatron_dist::ProcessGroup;
use clap::error::ErrorKind;

use super::*;

/// The tests' run: 2 blocks, d_model 16, 4 heads (2 a rank at tp 2); 4 sequences of 8 tokens
/// a step, 6 steps.
fn tiny(tp: usize, dp: usize, tensor: TensorParallel) -> Recipe {
    Recipe {
        model: plain::GptConfig::gpt(Corpus::vocab_size(), 8, 16, 4, 2),
        plan: ParallelPlan::new(ParallelDims::tp_dp(tp, dp)).with_tensor(tensor),
        seq_len: 8,
        batch_size: 4,
        steps: 10,
        lr: 3e-3,
        seed: 7,
    }
}

/// tp 2 × dp 2 with sequence parallelism (4 rank threads) trains as one device does, step by
/// step, from the same plain model and batches.
///
/// Not bit for bit: in f32 the parallel run adds the same terms in another order (each
/// row-parallel product's partial sums over tp, a replicated parameter's gradient summed over
/// the sequence shards, the gradients averaged over dp, the loss's sums over the vocabulary
/// shards), so values differ by a few ulps. Over 30 steps and 7 seeds the losses differed by
/// at most 2 ulps of f32 (1.9e-7 relative); 2e-6 relative is ten times that. A LayerNorm's γ
/// gradient left unsummed over tp under SP moves the second step's loss by 2.6e-5 relative,
/// thirteen times the tolerance (and its gradient by 100% in the one-step test).
#[test]
fn tp2_dp2_sp_trains_as_one_device() {
    let single = train(&tiny(1, 1, TensorParallel::Plain)).unwrap();
    let parallel = train(&tiny(2, 2, TensorParallel::SequenceParallel)).unwrap();
    assert_eq!(single.len(), 10);
    for (step, (a, b)) in parallel.iter().zip(&single).enumerate() {
        assert!(
            (a - b).abs() <= 2e-6 * b.abs(),
            "step {}: {parallel:?} vs {single:?}",
            step + 1
        );
    }
    // The steps move the model by far more than the tolerance: the same batches read by the
    // model as it was at the start give other losses.
    let unchanged = train(&Recipe {
        lr: 1e-12,
        ..tiny(1, 1, TensorParallel::Plain)
    })
    .unwrap();
    assert!(
        (unchanged[9] - single[9]).abs() > 1e-3 * single[9],
        "{unchanged:?} vs {single:?}"
    );
}

/// One step at tp 2 × dp 2 with sequence parallelism against the plain Burn model on the whole
/// batch: the loss, each rank's logits (its sequences, its vocabulary rows) and the gradients
/// of the token embedding (its lookup and the tied output), the position embedding, column
/// layers (query, up), row layers (attention output, down) and LayerNorms. Each rank's
/// gradient averaged over dp, as the optimizer averages it, is its shard of the plain model's.
///
/// The same f32 sums in another order as in the training test: at most 3e-7 of the largest
/// value measured, 1e-5 allowed ([`Check::close`]).
#[test]
fn one_step_matches_the_plain_model() {
    let recipe = tiny(2, 2, TensorParallel::SequenceParallel);
    let (dims, seq_len, batch) = (recipe.plan.dims, recipe.seq_len, recipe.batch_size);
    let config = recipe
        .plan
        .apply(parallel::GptConfig::of(&recipe.model), dims.world_size(), seq_len)
        .unwrap();
    let corpus = Corpus::arithmetic(1 << 12, 1);
    let device = Device::flex().autodiff();
    device.seed(3);
    let plain = recipe.model.init(&device);
    let per_rank = batch / dims.dp;
    launch(
        dims,
        |_| Device::flex(),
        |ctx| {
            let device = ctx.device.clone().autodiff();
            let (ids, targets) = corpus.batch(1, 0, batch, seq_len, &device);
            let twin = plain.clone().fork(&device);
            let twin_logits = twin.forward(ids.clone());
            let twin_loss = twin.loss(ids.clone(), targets.clone());

            let model = config.shard(plain.clone().fork(&device), &ctx.groups).unwrap();
            let first = ctx.groups.dp.group_rank() * per_rank;
            let logits = model.forward(ids.narrow(0, first, per_rank)).unwrap();
            let loss = model
                .cross_entropy
                .forward(logits.clone(), targets.narrow(0, first, per_rank))
                .unwrap();
            let check = Check {
                tp: &ctx.groups.tp,
                dp: ctx.groups.grad_sync(),
                grads: loss.clone().backward(),
                twin_grads: twin_loss.clone().backward(),
            };
            check.close(check.mean(loss), twin_loss, "loss");
            let twin_logits = check.shard(twin_logits.narrow(0, first, per_rank), Some(2));
            check.close(logits, twin_logits, "logits");

            let (ours, theirs) = (&model, &twin);
            check.grad(&ours.token.weight, &theirs.token.weight, Some(0), "token embedding");
            check.grad(
                &ours.position.weight,
                &theirs.position.weight,
                None,
                "position embedding",
            );
            let (block, twin_block) = (&ours.blocks[0], &theirs.blocks[0]);
            let (norm, twin_norm) = (&block.attention_norm, &twin_block.attention_norm);
            check.grad(&norm.gamma, &twin_norm.gamma, None, "attention norm gamma");
            check.grad(bias(&norm.beta), bias(&twin_norm.beta), None, "attention norm beta");
            let (query, twin_query) = (&block.attention.query, &twin_block.attention.query);
            check.grad(&query.weight, &twin_query.weight, Some(1), "query weight");
            check.grad(bias(&query.bias), bias(&twin_query.bias), Some(0), "query bias");
            let (output, twin_output) = (&block.attention.output, &twin_block.attention.output);
            check.grad(&output.weight, &twin_output.weight, Some(0), "attention output weight");
            check.grad(
                bias(&output.bias),
                bias(&twin_output.bias),
                None,
                "attention output bias",
            );
            let (mlp, twin_mlp) = (&ours.blocks[1].mlp, &theirs.blocks[1].mlp);
            check.grad(&mlp.up.weight, &twin_mlp.up.weight, Some(1), "up weight");
            check.grad(bias(&mlp.up.bias), bias(&twin_mlp.up.bias), Some(0), "up bias");
            check.grad(&mlp.down.weight, &twin_mlp.down.weight, Some(0), "down weight");
            check.grad(bias(&mlp.down.bias), bias(&twin_mlp.down.bias), None, "down bias");
            check.grad(&ours.norm.gamma, &theirs.norm.gamma, None, "final norm gamma");
            check.grad(bias(&ours.norm.beta), bias(&theirs.norm.beta), None, "final norm beta");
        },
    )
    .unwrap();
}

fn bias(bias: &Option<Param<Tensor<1>>>) -> &Param<Tensor<1>> {
    bias.as_ref().expect("GPT-2's layers have biases")
}

/// How a rank compares its results with the twin's.
struct Check<'a> {
    tp: &'a ProcessGroup,
    dp: &'a ProcessGroup,
    grads: Gradients,
    twin_grads: Gradients,
}

impl Check<'_> {
    /// The mean over the data-parallel ranks.
    fn mean<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.dp.all_reduce(x, ReduceOp::Avg).unwrap()
    }

    /// This tp rank's shard of `x` along `split`, or all of it.
    fn shard<const D: usize>(&self, x: Tensor<D>, split: Option<usize>) -> Tensor<D> {
        match split {
            Some(dim) => Shard::new(dim, self.tp.group_rank(), self.tp.size()).slice(x),
            None => x,
        }
    }

    /// `param`'s gradient, averaged over dp, against the shard of `twin`'s along `split`.
    fn grad<const D: usize>(
        &self,
        param: &Param<Tensor<D>>,
        twin: &Param<Tensor<D>>,
        split: Option<usize>,
        what: &str,
    ) {
        let ours = param.val().grad(&self.grads).expect("a gradient");
        let theirs = twin.val().grad(&self.twin_grads).expect("a gradient");
        self.close(self.mean(ours), self.shard(theirs, split), &format!("{what} gradient"));
    }

    /// Equal within 1e-5 of `expected`'s largest magnitude (f32 sums in another order).
    fn close<const D: usize>(&self, actual: Tensor<D>, expected: Tensor<D>, what: &str) {
        assert_eq!(actual.dims(), expected.dims(), "{what}: shapes");
        let scale = expected.clone().abs().max().into_scalar::<f64>().max(1e-12);
        let worst = (actual - expected).abs().max().into_scalar::<f64>();
        assert!(
            worst <= 1e-5 * scale,
            "{what}: max |difference| {worst:e} against {scale:e}"
        );
    }
}

/// `--help` explains every flag; a malformed flag is clap's error, and a layout the model
/// cannot take is a typed error before any tensor exists.
#[test]
fn help_and_bad_layouts() {
    let help = Args::try_parse_from(["own-model", "--help"]).unwrap_err();
    assert_eq!(help.kind(), ErrorKind::DisplayHelp);
    for flag in ["--tp", "--dp", "--sp", "--steps", "--lr", "--seed"] {
        assert!(help.to_string().contains(flag), "{flag} in {help}");
    }
    assert_eq!(
        Args::try_parse_from(["own-model", "--tp", "two"]).unwrap_err().kind(),
        ErrorKind::ValueValidation
    );
    let refused = |recipe: Recipe| train(&recipe).unwrap_err().to_string();
    let plain = TensorParallel::Plain;
    assert_eq!(refused(tiny(3, 1, plain)), "n_heads = 4 is not divisible by tp = 3");
    assert_eq!(
        refused(tiny(1, 3, plain)),
        "a global batch of 4 sequences does not split evenly over dp = 3"
    );
    assert_eq!(
        refused(tiny(0, 1, plain)),
        "parallel axis tp has size 0; every axis needs at least one rank"
    );
    assert_eq!(
        refused(Recipe {
            seq_len: 6,
            ..tiny(4, 1, TensorParallel::SequenceParallel)
        }),
        "sequence length 6 is not divisible by tp = 4, which sequence parallelism needs"
    );
    assert_eq!(
        refused(Recipe {
            steps: 0,
            ..tiny(1, 1, plain)
        }),
        "steps must be at least 1"
    );
}
