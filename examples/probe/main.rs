use burn::tensor::{DType, Device, Tensor};
use burn_megatron_dist::{ParallelDims, ReduceOp, launch};

fn main() {
    launch(ParallelDims::tp_dp(2, 1), Device::cuda, |ctx| {
        let g = &ctx.groups.tp;
        let dev = &ctx.device;
        for n in [256usize, 4096, 16384, 65536, 131072, 262144, 524288, 1 << 20] {
            let s = g.all_reduce(Tensor::<1>::ones([n], (dev, DType::F32)), ReduceOp::Sum).unwrap();
            let v = s.into_data().convert::<f32>().try_into_vec::<f32>().unwrap();
            let good = v.iter().filter(|&&x| x == 2.0).count();
            if g.group_rank() == 0 { println!("n={n}: {good} of {n} correct, first {:?}", &v[..4]); }
            let b = g.broadcast(Tensor::<1>::ones([n], (dev, DType::F32)).mul_scalar(g.group_rank() as f32 + 5.0), 1).unwrap();
            let v = b.into_data().convert::<f32>().try_into_vec::<f32>().unwrap();
            let good = v.iter().filter(|&&x| x == 6.0).count();
            if g.group_rank() == 0 { println!("  broadcast n={n}: {good} of {n} correct, first {:?}", &v[..4]); }
        }
    }).unwrap();
}
