//! What a MoE model's step prints: each router loss averaged over dp × cp and summed over the
//! MoE blocks, each expert's token copies and the copies dropped, summed over the blocks and
//! the whole batch.

use burn::tensor::Tensor;
use burn_megatron::models::llama::MoeReport;
use burn_megatron_dist::{CommError, ProcessGroups, ReduceOp};

/// ` aux_loss X … load [n₀ n₁ …] dropped D`, or nothing for a dense model. Every rank calls it.
pub fn summary(report: &MoeReport, groups: &ProcessGroups) -> Result<String, CommError> {
    let Some(load) = report.load() else {
        return Ok(String::new());
    };
    let batch = groups.grad_sync();
    let mut line = String::new();
    let mut names: Vec<&str> = Vec::new();
    let mut sums: Vec<Tensor<1>> = Vec::new();
    for (name, loss) in report.losses.iter().flat_map(|l| l.named()) {
        match names.iter().position(|n| *n == name) {
            Some(i) => sums[i] = sums[i].clone() + loss.detach(),
            None => {
                names.push(name);
                sums.push(loss.detach());
            }
        }
    }
    for (name, sum) in names.iter().zip(sums) {
        let value = batch.all_reduce(sum, ReduceOp::Avg)?.into_scalar::<f64>();
        line += &format!(" {name} {value:.6}");
    }
    // The dropped copies beside the experts', in the counts' own int type.
    let dropped = load
        .per_expert
        .clone()
        .narrow(0, 0, 1)
        .zeros_like()
        .add_scalar(load.dropped as i64);
    let counts = Tensor::cat(vec![load.per_expert.clone(), dropped], 0);
    let n = counts.dims()[0];
    let total: Vec<i64> = batch
        .all_reduce(counts, ReduceOp::Sum)?
        .into_data()
        .convert::<i64>()
        .try_to_vec()
        .expect("counts");
    let (per_expert, dropped) = total.split_at(n - 1);
    let per_expert: Vec<String> = per_expert.iter().map(i64::to_string).collect();
    line += &format!(" load [{}] dropped {}", per_expert.join(" "), dropped[0]);
    Ok(line)
}
