//! The post-training suite: GGUF files the tests write themselves (`gguf_writer`) loaded at the
//! harness's tp, against transformers' logits (the Hugging Face fixture `llama2` converted as
//! llama.cpp converts it) and against their own dequantized values; the tokenizer a GGUF file
//! carries; and decoding with the KV cache against the full forward pass.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_megatron::init::{InitMode, ParamInit};
use burn_megatron::models::llama::generate::{GenerateConfig, KvCache, Sampling, generate};
use burn_megatron::models::llama::gguf::{self, GgufError};
use burn_megatron::models::llama::hf::{self, HfError};
use burn_megatron::models::llama::{Llama, LlamaConfig};
use burn_megatron::params::{param_infos, param_values};
use burn_megatron::plan::{ParallelPlan, TensorParallel};
use burn_megatron_dist::{ParallelDims, ProcessGroups};

use crate::Harness;
use crate::data::assert_close;
use crate::gguf_writer::{Entry, Meta, Store, llama_metadata, permute, write};
use crate::hf_suite::{batch, expected, fixture};

const VOCAB: usize = 99;

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-megatron-gguf-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The `llama2` fixture's tensors by Hugging Face name: shape and f32 values.
fn fixture_tensors() -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(fixture("llama2").join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (name, (view.shape().to_vec(), values))
        })
        .collect()
}

/// The GGUF name llama.cpp gives a Hugging Face Llama tensor.
pub(crate) fn gguf_name(hf: &str) -> String {
    let fixed = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (i, field) = rest.split_once('.').unwrap();
    let field = match field {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        other => panic!("no GGUF name for {other}"),
    };
    format!("blk.{i}.{field}")
}

/// The fixture (64 wide, 2 blocks of 4 heads of 16, ffn 128, vocabulary 99, θ 1e4, untied)
/// as a GGUF file: matrices in `matrices`, norms in F32, q and k permuted as llama.cpp's
/// converter does. Returns the values each tensor dequantizes to, by Hugging Face name,
/// before the permutation.
fn write_fixture(path: &Path, matrices: Store) -> BTreeMap<String, Vec<f32>> {
    let metadata = llama_metadata(2, 64, 128, (4, 16), 64, VOCAB as u32);
    let mut tensors = BTreeMap::new();
    let mut names = BTreeMap::new();
    for (hf, (shape, values)) in fixture_tensors() {
        let name = gguf_name(&hf);
        let values = match name.ends_with("attn_q.weight") || name.ends_with("attn_k.weight") {
            true => permute(&values, shape[0], 16),
            false => values,
        };
        let store = if shape.len() == 2 { matrices } else { Store::F32 };
        tensors.insert(name.clone(), Entry { shape, values, store });
        names.insert(name, hf);
    }
    write(path, &metadata, &tensors)
        .into_iter()
        .map(|(name, values)| {
            let hf = names[&name].clone();
            let values = match name.ends_with("attn_q.weight") || name.ends_with("attn_k.weight") {
                // Back to halves: the permutation's inverse, by position.
                true => {
                    let rows = values.len() / 64;
                    let order = permute(&(0..rows).map(|r| r as f32).collect::<Vec<_>>(), rows, 16);
                    let mut back = vec![0.0; values.len()];
                    for (at, &row) in order.iter().enumerate() {
                        let row = row as usize;
                        back[row * 64..(row + 1) * 64].copy_from_slice(&values[at * 64..(at + 1) * 64]);
                    }
                    back
                }
                false => values,
            };
            (hf, values)
        })
        .collect()
}

/// The GGUF file's model planned for `groups.tp` (no SP) and loaded, from another seed first.
fn loaded(path: &Path, groups: &ProcessGroups, device: &Device) -> Llama {
    let tp = groups.tp.size();
    let config = ParallelPlan::new(ParallelDims::tp_dp(tp, 1))
        .with_tensor(TensorParallel::Plain)
        .apply(gguf::config(path).unwrap(), tp, 16)
        .unwrap();
    let model = config
        .init(device, groups, &ParamInit::new(11, InitMode::Full))
        .unwrap();
    gguf::load(path, model, groups).unwrap()
}

/// The fixture as an F32 GGUF file, loaded at the harness's tp: transformers' loss and logits.
/// The only difference from loading its safetensors is the file's rms ε, stored as f32
/// (9.99999975e-6 for 1e-5), which moves nothing measurable; the tolerance is the Hugging Face
/// suite's (reordered f32 sums: 1e-5).
pub fn gguf_matches_transformers(h: &Harness) {
    let dir = scratch(&format!("f32-tp{}", h.world));
    let path = dir.join("llama2.gguf");
    write_fixture(&path, Store::F32);
    let expected = expected("llama2");
    h.run(h.tp_world(), |ctx| {
        let dev = ctx.device.clone();
        let model = loaded(&path, &ctx.groups, &dev);
        let (ids, targets) = batch(&expected, &dev);
        let logits = model.forward(ids).unwrap();
        let loss = model
            .loss
            .forward(logits.clone(), targets)
            .unwrap()
            .into_scalar::<f64>();
        let want = expected["loss"].as_f64().unwrap();
        assert!((loss - want).abs() <= 1e-5 * want, "loss {loss} vs {want}");
        let logits = ctx.groups.tp.all_gather(logits, 2).unwrap().narrow(2, 0, VOCAB);
        let theirs: Vec<f32> = expected["logits"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|b| b.as_array().unwrap().iter())
            .flat_map(|s| s.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32))
            .collect();
        let theirs = Tensor::<3>::from_data(TensorData::new(theirs, logits.dims()), &dev);
        assert_close(&logits, &theirs, 1e-5, "GGUF logits against transformers'");
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// The fixture with Q8_0 and Q4_1 matrices: at tp 1 every parameter holds exactly the values
/// its blocks dequantize to (transposed into Burn's layout), and at the harness's tp the model
/// gives tp 1's logits (products split over ranks: the harness's product tolerance).
pub fn gguf_dequantizes_every_block(h: &Harness) {
    for store in [Store::Q8_0, Store::Q4_1] {
        let dir = scratch(&format!("{store:?}-tp{}", h.world));
        let path = dir.join("llama2.gguf");
        let want = write_fixture(&path, store);
        let dev = h.device(0);
        let one = loaded(&path, &ProcessGroups::single(), &dev);
        for (info, value) in param_infos(&one).iter().zip(param_values(&one)) {
            let hf_name = fixture_tensors()
                .keys()
                .find(|n| hf::our_path(hf::Family::Llama, n).as_deref() == Some(info.path.as_str()))
                .cloned()
                .unwrap();
            let stored = &want[&hf_name];
            // The whole parameter as ours holds it: matrices [in, out] from the file's
            // [out, in] (the embedding as it is), zeros in the padded vocabulary.
            let expected: Vec<f32> = match value.dims.as_slice() {
                [rows, cols] if info.path == "embedding.weight" => (0..rows * cols)
                    .map(|i| stored.get(i).copied().unwrap_or(0.0))
                    .collect(),
                [rows, cols] => {
                    let real = stored.len() / rows; // the file's out features, unpadded
                    (0..rows * cols)
                        .map(|i| match i % cols < real {
                            true => stored[(i % cols) * rows + i / cols],
                            false => 0.0,
                        })
                        .collect()
                }
                _ => stored.clone(),
            };
            let n = expected.len();
            let expected = Tensor::<1>::from_data(TensorData::new(expected, [n]), &dev);
            crate::data::assert_exact(&value.value, &expected, &format!("{store:?} {}", info.path));
        }
        let ids = Tensor::<2, Int>::from_data(
            TensorData::new((0..32i64).map(|i| i * 3 % 99).collect::<Vec<_>>(), [2, 16]),
            &dev,
        );
        let reference = one.forward(ids.clone()).unwrap().narrow(2, 0, VOCAB);
        h.run(h.tp_world(), |ctx| {
            let model = loaded(&path, &ctx.groups, &ctx.device);
            let logits = model.forward(ids.clone().to_device(&ctx.device)).unwrap();
            let logits = ctx.groups.tp.all_gather(logits, 2).unwrap().narrow(2, 0, VOCAB);
            let reference = reference.clone().to_device(&ctx.device);
            assert_close(&logits, &reference, h.matmul_tolerance, &format!("{store:?} logits"));
        });
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// What a GGUF file cannot hold for this model is a typed error, and nothing is loaded: a
/// truncated file, another architecture, a model of another size.
pub fn bad_gguf_files(h: &Harness) {
    let dir = scratch("bad");
    let path = dir.join("llama2.gguf");
    write_fixture(&path, Store::F32);
    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    assert!(matches!(gguf::config(&cut), Err(GgufError::Format { .. })), "truncated");
    let other = dir.join("other.gguf");
    let renamed = String::from_utf8_lossy(&bytes).contains("llama");
    assert!(renamed);
    let swapped: Vec<u8> = {
        // "llama" as the architecture's value is the first occurrence after its key.
        let key = b"general.architecture";
        let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 4 + 8;
        let mut b = bytes.clone();
        b[at..at + 5].copy_from_slice(b"gemma");
        b
    };
    std::fs::write(&other, swapped).unwrap();
    assert!(matches!(gguf::config(&other), Err(GgufError::Unsupported { .. })));
    let groups = ProcessGroups::single();
    let small = LlamaConfig::llama(VOCAB, 64, 1, 4, 4, 128, 16)
        .init(&h.device(0), &groups, &ParamInit::new(1, InitMode::Full))
        .unwrap();
    match gguf::load(&path, small, &groups) {
        Err(GgufError::Model(HfError::Mismatch { field, .. })) => assert_eq!(field, "num_hidden_layers"),
        other => panic!("a model of 1 block: {:?}", other.err()),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The tokenizer of a GGUF file: byte-level BPE from its vocabulary and merges, digits split
/// one by one (`smollm`), control tokens whole; decoding gives the text back. Its chat template
/// with the texts of its BOS and EOS tokens.
pub fn gguf_tokenizer(_h: &Harness) {
    let dir = scratch("tokenizer");
    let path = dir.join("tokenizer.gguf");
    let tokens: Vec<String> = [
        "<|endoftext|>",
        "<|im_start|>",
        "h",
        "e",
        "l",
        "o",
        "Ġ",
        "w",
        "r",
        "d",
        "1",
        "2",
        "he",
        "ll",
        "hell",
        "hello",
        "Ġw",
        "Ġwo",
        "or",
        "Ġwor",
        "ld",
        "Ġworld",
        "12",
    ]
    .map(String::from)
    .to_vec();
    let merges = [
        "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2",
    ]
    .map(String::from)
    .to_vec();
    let types: Vec<i32> = (0..tokens.len()).map(|i| if i < 2 { 3 } else { 1 }).collect();
    let metadata: BTreeMap<String, Meta> = [
        ("general.architecture", Meta::Text("llama".into())),
        ("tokenizer.ggml.model", Meta::Text("gpt2".into())),
        ("tokenizer.ggml.pre", Meta::Text("smollm".into())),
        ("tokenizer.ggml.tokens", Meta::Texts(tokens.clone())),
        ("tokenizer.ggml.merges", Meta::Texts(merges)),
        ("tokenizer.ggml.token_type", Meta::I32s(types)),
        ("tokenizer.ggml.bos_token_id", Meta::U32(1)),
        ("tokenizer.ggml.eos_token_id", Meta::U32(0)),
        (
            "tokenizer.chat_template",
            Meta::Text("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}".into()),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    write(&path, &metadata, &BTreeMap::new());
    // The chat template it carries, with its BOS and EOS tokens' texts.
    let carried = gguf::chat_template(&path).unwrap().expect("a template");
    let rendered = burn_megatron::data::ChatTemplate::with_tokens(&carried.template, &carried.tokens, "gguf")
        .unwrap()
        .text(&[burn_megatron::data::Turn::new("user", "hello")], false)
        .unwrap();
    assert_eq!(rendered, "<|im_start|>hello<|endoftext|>");
    let tokenizer = gguf::tokenizer(&path).unwrap();
    let ids = |text: &str| tokenizer.encode(text, false).unwrap().get_ids().to_vec();
    let id = |t: &str| tokens.iter().position(|x| x == t).unwrap() as u32;
    assert_eq!(ids("hello world"), [id("hello"), id("Ġworld")]);
    // `12` is a token, but digits are split one by one before the merges.
    assert_eq!(ids("12"), [id("1"), id("2")]);
    assert_eq!(ids("<|im_start|>hello"), [id("<|im_start|>"), id("hello")]);
    assert_eq!(tokenizer.decode(&ids("hello world"), false).unwrap(), "hello world");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tiny random Llama (GQA, 3 blocks) at the harness's tp without SP.
fn tiny(groups: &ProcessGroups, device: &Device) -> Llama {
    let tp = groups.tp.size();
    let config = ParallelPlan::new(ParallelDims::tp_dp(tp, 1))
        .with_tensor(TensorParallel::Plain)
        .apply(LlamaConfig::llama(50, 32, 3, 4, 2, 64, 32), tp, 32)
        .unwrap();
    config.init(device, groups, &ParamInit::new(9, InitMode::Full)).unwrap()
}

/// Two prompts of 5 and 3 tokens, prefilled left-padded into the cache and then fed 4 more
/// tokens one at a time: at every position each row's logits are those of the full forward
/// pass over that row's own tokens alone (no padding, no cache), at tp 1 and the harness's tp.
/// The same f32 products over another number of keys: the harness's tolerance. Greedy
/// generation then gives the same tokens at every tp.
pub fn cached_decoding_matches_full_forward(h: &Harness) {
    let rows: [Vec<u32>; 2] = [vec![3, 14, 15, 9, 26, 5, 35, 8, 9], vec![27, 18, 28, 1, 41, 4, 2]];
    let prompt = [5, 3];
    let mut generated = Vec::new();
    for dims in [ParallelDims::single(), h.tp_world()] {
        let results = h.run(dims, |ctx| {
            let dev = ctx.device.clone();
            let model = tiny(&ctx.groups, &dev);
            let full = |row: &[u32]| {
                let ids: Vec<i64> = row.iter().map(|&t| t as i64).collect();
                let n = ids.len();
                let logits = model
                    .forward(Tensor::from_data(TensorData::new(ids, [1, n]), &dev))
                    .unwrap();
                ctx.groups.tp.all_gather(logits, 2).unwrap().narrow(2, 0, 50) // [1, n, v]
            };
            let mut cache = KvCache::new(&model, 2, 12, &dev).unwrap();
            // Prefill: row 1 left-padded by 2.
            let ids = [
                rows[0][..5].to_vec(),
                [0, 0].into_iter().chain(rows[1][..3].iter().copied()).collect(),
            ];
            let flat: Vec<i64> = ids.iter().flatten().map(|&t| t as i64).collect();
            let padding = vec![vec![false; 5], vec![true, true, false, false, false]];
            let logits = model
                .forward_cached(
                    Tensor::from_data(TensorData::new(flat, [2, 5]), &dev),
                    &padding,
                    &mut cache,
                )
                .unwrap();
            let logits = ctx.groups.tp.all_gather(logits, 2).unwrap().narrow(2, 0, 50);
            for (r, row) in rows.iter().enumerate() {
                let ours = logits.clone().narrow(0, r, 1).narrow(1, 5 - prompt[r], prompt[r]);
                let theirs = full(&row[..prompt[r]]);
                assert_close(&ours, &theirs, h.matmul_tolerance, &format!("prefill row {r}"));
            }
            for step in 0..4 {
                let next: Vec<i64> = (0..2).map(|r| rows[r][prompt[r] + step] as i64).collect();
                let logits = model
                    .forward_cached(
                        Tensor::from_data(TensorData::new(next, [2, 1]), &dev),
                        &[vec![false], vec![false]],
                        &mut cache,
                    )
                    .unwrap();
                let logits = ctx.groups.tp.all_gather(logits, 2).unwrap().narrow(2, 0, 50);
                for (r, row) in rows.iter().enumerate() {
                    let n = prompt[r] + step + 1;
                    let theirs = full(&row[..n]).narrow(1, n - 1, 1);
                    let ours = logits.clone().narrow(0, r, 1);
                    assert_close(
                        &ours,
                        &theirs,
                        h.matmul_tolerance,
                        &format!("decode step {step} row {r}"),
                    );
                }
            }
            let config = GenerateConfig {
                max_new_tokens: 6,
                sampling: Sampling::Greedy,
                stop: vec![],
                pad: 0,
                seed: 1,
                graphs: true,
            };
            let prompts = [rows[0][..5].to_vec(), rows[1][..3].to_vec()];
            generate(&model, &ctx.groups.tp, &prompts, &config, &dev)
                .unwrap()
                .tokens
        });
        assert!(
            results.windows(2).all(|w| w[0] == w[1]),
            "every tp rank draws the same tokens"
        );
        generated.push(results[0].clone());
    }
    assert_eq!(generated[0], generated[1], "greedy tokens at tp 1 and tp {}", h.world);
    assert!(generated[0].iter().all(|t| t.len() == 6));
}

/// Generation with the decoding step replayed as a CUDA graph gives the tokens of the eager
/// steps, greedy and sampled (the same draws from the same seed), for prompts of different
/// lengths: on CUDA the graph serves every step after the warm-up; elsewhere the steps stay
/// eager and say why. Prefill plus 9 steps: 2 eager, the warm-up, then 6 replays.
pub fn graph_decoding_matches_eager(h: &Harness) {
    use burn_megatron::models::llama::generate::{EAGER_BEFORE_GRAPH, Stepping};
    let results = h.run(ParallelDims::single(), |ctx| {
        let dev = ctx.device.clone();
        let model = tiny(&ctx.groups, &dev);
        let on_cuda = burn_megatron_kernels::cuda::graph::Recorder::on(&Tensor::<1>::zeros([1], &dev)).is_ok();
        let prompts = [vec![3, 14, 15, 9, 26], vec![27, 18, 28]];
        let sampled = Sampling::Sample {
            temperature: 0.8,
            top_k: Some(20),
            top_p: Some(0.9),
        };
        let run = |sampling, graphs| {
            let config = GenerateConfig {
                max_new_tokens: 10,
                sampling,
                stop: vec![],
                pad: 0,
                seed: 7,
                graphs,
            };
            generate(&model, &ctx.groups.tp, &prompts, &config, &dev).unwrap()
        };
        for sampling in [Sampling::Greedy, sampled] {
            let (graphed, eager) = (run(sampling, true), run(sampling, false));
            assert_eq!(graphed.tokens, eager.tokens, "{sampling:?}: the graph's tokens");
            assert_eq!(eager.stepping, Stepping::Eager("CUDA graphs turned off".into()));
            match (on_cuda, &graphed.stepping) {
                (true, stepping) => assert_eq!(
                    *stepping,
                    Stepping::Graphed {
                        from: EAGER_BEFORE_GRAPH + 1
                    },
                    "{sampling:?}"
                ),
                (false, Stepping::Eager(why)) => assert!(why.contains("CUDA"), "{why}"),
                (false, other) => panic!("a graph off CUDA: {other:?}"),
            }
        }
    });
    assert_eq!(results.len(), 1);
}

/// A cache made for one model and used with another (here one block fewer) is a typed error
/// before anything runs, for a prefill and for a decoding step alike.
pub fn cache_serves_its_own_model(h: &Harness) {
    use burn_megatron::error::{ConfigError, LayerError};
    h.run(ParallelDims::single(), |ctx| {
        let dev = ctx.device.clone();
        let model = tiny(&ctx.groups, &dev);
        let other = ParallelPlan::new(ParallelDims::single())
            .with_tensor(TensorParallel::Plain)
            .apply(LlamaConfig::llama(50, 32, 2, 4, 2, 64, 32), 1, 32)
            .unwrap()
            .init(&dev, &ctx.groups, &ParamInit::new(9, InitMode::Full))
            .unwrap();
        let mut cache = KvCache::new(&model, 1, 8, &dev).unwrap();
        for n in [3, 1] {
            let ids = Tensor::<2, Int>::from_data(TensorData::new(vec![1i64; n], [1, n]), &dev);
            let refused = other.forward_cached(ids, &[vec![false; n]], &mut cache);
            assert!(
                matches!(
                    refused,
                    Err(LayerError::Config(ConfigError::CacheUnusable { layers: 3, blocks: 2 }))
                ),
                "{n} positions: {refused:?}"
            );
        }
        assert!(cache.is_empty(), "nothing was cached");
    });
}
