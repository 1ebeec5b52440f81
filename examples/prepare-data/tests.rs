use burn_megatron::data::{IndexedDataset, indexed};

use super::*;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-megatron-prepare-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A word-level tokenizer: [UNK] 0, hello 1, world 2, there 3, <|endoftext|> 4, <|im_start|> 5,
/// <|im_end|> 6, user 7, assistant 8.
fn tokenizer(dir: &Path) -> PathBuf {
    let path = dir.join("tokenizer.json");
    std::fs::write(
        &path,
        r#"{"version":"1.0","truncation":null,"padding":null,
           "added_tokens":[{"id":4,"content":"<|endoftext|>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true},
                           {"id":5,"content":"<|im_start|>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true},
                           {"id":6,"content":"<|im_end|>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],
           "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
           "model":{"type":"WordLevel","vocab":{"[UNK]":0,"hello":1,"world":2,"there":3,"<|endoftext|>":4,"<|im_start|>":5,"<|im_end|>":6,"user":7,"assistant":8},"unk_token":"[UNK]"}}"#,
    )
    .unwrap();
    path
}

fn args(dir: &Path, inputs: &[&str]) -> Args {
    Args {
        input: inputs.iter().map(|i| dir.join(i)).collect(),
        tokenizer: tokenizer(dir),
        output: dir.join("out/data"),
        json_key: "text".into(),
        eod: None,
        chat_template: None,
        batch: 2,
    }
}

/// JSON lines (a document a line) and a text file (a document) in path order, each document's
/// ids then the end-of-document token, as uint16 ids.
#[test]
fn documents_in_order_each_ended() {
    let dir = scratch("ok");
    std::fs::create_dir_all(dir.join("in")).unwrap();
    std::fs::write(
        dir.join("in/a.jsonl"),
        "{\"text\": \"hello world\"}\n\n{\"text\": \"there\", \"id\": 7}\n{\"text\": \"world world hello\"}\n",
    )
    .unwrap();
    std::fs::write(dir.join("in/b.txt"), "hello\nthere friend").unwrap();
    let summary = prepare(&args(&dir, &["in"]), false).unwrap();
    assert!(summary.contains("4 documents, 13 tokens"), "{summary}");
    let data = IndexedDataset::open(&dir.join("out/data")).unwrap();
    assert_eq!(data.dtype(), TokenType::U16);
    let docs: Vec<Vec<u32>> = (0..data.documents()).map(|d| data.sequence(d, 5).unwrap()).collect();
    assert_eq!(docs, [vec![1, 2, 4], vec![3, 4], vec![2, 2, 1, 4], vec![1, 3, 0, 4]]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Each bad input is an error naming it, and nothing is left at the output.
#[test]
fn bad_inputs_name_the_file_and_leave_nothing() {
    let dir = scratch("bad");
    let cases: [(&str, &[u8], &str); 5] = [
        ("empty.txt", b"", "empty.txt: an empty file"),
        ("latin.txt", b"caf\xe9", "latin.txt: not UTF-8 at byte 3"),
        (
            "keyless.jsonl",
            b"{\"text\": \"hello\"}\n{\"body\": \"x\"}\n",
            "keyless.jsonl:2: no string under \"text\"",
        ),
        ("broken.jsonl", b"{\"text\": \"hello\"\n", "broken.jsonl:1:"),
        (
            "chat.jsonl",
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n",
            "chat.jsonl:1: a chat without an assistant turn",
        ),
    ];
    for (name, bytes, want) in cases {
        std::fs::write(dir.join("good.txt"), "hello world").unwrap();
        std::fs::write(dir.join(name), bytes).unwrap();
        let err = prepare(&args(&dir, &["good.txt", name]), false).unwrap_err();
        assert!(err.contains(want), "{name}: {err}");
        let (bin, idx) = indexed::paths(&dir.join("out/data"));
        assert!(!bin.exists() && !idx.exists(), "{name}: output left behind");
        let left: Vec<_> = std::fs::read_dir(dir.join("out")).unwrap().collect();
        assert!(left.is_empty(), "{name}: {left:?}");
        std::fs::remove_file(dir.join(name)).unwrap();
    }
    let missing = prepare(&args(&dir, &["nowhere.txt"]), false).unwrap_err();
    assert!(missing.contains("nowhere.txt"), "{missing}");
    let mut no_eod = args(&dir, &["good.txt"]);
    no_eod.eod = Some("<|nope|>".into());
    assert!(prepare(&no_eod, false).unwrap_err().contains("no token \"<|nope|>\""));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Chat lines in ChatML: each conversation a sequence, no end-of-document token after its last
/// `<|im_end|>`, and a loss mask beside it (`-mask`) counting the assistant's content and its
/// `<|im_end|>` only; text and chats in one dataset are refused.
#[test]
fn chats_with_their_loss_masks() {
    let dir = scratch("chat");
    std::fs::write(
        dir.join("chat.jsonl"),
        concat!(
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hello\"}, {\"role\": \"assistant\", \"content\": \"world there\"}]}\n",
            "{\"messages\": [{\"role\": \"assistant\", \"content\": \"hello\"}, {\"role\": \"user\", \"content\": \"there\"}]}\n",
        ),
    )
    .unwrap();
    prepare(&args(&dir, &["chat.jsonl"]), false).unwrap();
    let data = IndexedDataset::open(&dir.join("out/data")).unwrap();
    let mask = IndexedDataset::open(&dir.join("out/data-mask")).unwrap();
    assert_eq!(mask.dtype(), TokenType::U8);
    let read = |d: &IndexedDataset, i| d.sequence(i, 9).unwrap();
    assert_eq!(read(&data, 0), [5, 7, 1, 6, 5, 8, 2, 3, 6]);
    assert_eq!(read(&mask, 0), [0, 0, 0, 0, 0, 0, 1, 1, 1]);
    assert_eq!(read(&data, 1), [5, 8, 1, 6, 5, 7, 3, 6]);
    assert_eq!(read(&mask, 1), [0, 0, 1, 1, 0, 0, 0, 0]);
    std::fs::write(dir.join("text.jsonl"), "{\"text\": \"hello\"}\n").unwrap();
    let mixed = prepare(&args(&dir, &["chat.jsonl", "text.jsonl"]), false).unwrap_err();
    assert!(mixed.contains("text and chats"), "{mixed}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Parquet files as pyarrow writes them (`tests/fixtures/data/make_parquet.py`): a row a document
/// (snappy, two row groups) and chats from a list of structs (zstd), as their JSON lines give.
#[test]
fn parquet_rows_are_documents() {
    let dir = scratch("parquet");
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/data");
    for name in ["text.parquet", "chat.parquet"] {
        std::fs::copy(fixtures.join(name), dir.join(name)).unwrap();
    }
    prepare(&args(&dir, &["text.parquet"]), false).unwrap();
    let data = IndexedDataset::open(&dir.join("out/data")).unwrap();
    let read = |d: &IndexedDataset, i| d.sequence(i, 9).unwrap();
    assert_eq!(
        (0..3).map(|i| read(&data, i)).collect::<Vec<_>>(),
        [vec![1, 2, 4], vec![3, 4], vec![2, 1, 3, 4]]
    );
    let mut chats = args(&dir, &["chat.parquet"]);
    chats.output = dir.join("out/chat");
    prepare(&chats, false).unwrap();
    let (data, mask) = (
        IndexedDataset::open(&dir.join("out/chat")).unwrap(),
        IndexedDataset::open(&dir.join("out/chat-mask")).unwrap(),
    );
    assert_eq!(read(&data, 0), [5, 7, 1, 6, 5, 8, 2, 3, 6]);
    assert_eq!(read(&mask, 0), [0, 0, 0, 0, 0, 0, 1, 1, 1]);
    let mut keyed = args(&dir, &["text.parquet"]);
    keyed.json_key = "body".into();
    let e = prepare(&keyed, false).unwrap_err();
    assert!(e.contains("text.parquet: row 0: no string under \"body\""), "{e}");
    std::fs::write(dir.join("fake.parquet"), "PAR1 not really").unwrap();
    let e = prepare(&args(&dir, &["fake.parquet"]), false).unwrap_err();
    assert!(e.contains("fake.parquet: not a Parquet file"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The template of the `tokenizer_config.json` beside the tokenizer, its `bos_token` in scope,
/// unless `--chat-template` names another; a template's own exception names the file and line.
#[test]
fn chats_take_the_tokenizers_template() {
    let dir = scratch("template");
    let chat = "{\"messages\": [{\"role\": \"user\", \"content\": \"hello\"}, {\"role\": \"assistant\", \"content\": \"world there\"}]}\n";
    std::fs::write(dir.join("chat.jsonl"), chat).unwrap();
    let mut with = args(&dir, &["chat.jsonl"]);
    let config = serde_json::json!({
        "bos_token": {"content": "<|endoftext|>", "special": true},
        "chat_template": "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}",
    });
    std::fs::write(
        with.tokenizer.with_file_name("tokenizer_config.json"),
        config.to_string(),
    )
    .unwrap();
    let line = prepare(&with, false).unwrap();
    assert!(line.contains("tokenizer_config.json"), "{line}");
    let read = |name: &str| IndexedDataset::open(&dir.join(name)).unwrap().sequence(0, 10).unwrap();
    assert_eq!(read("out/data"), [4, 5, 7, 1, 6, 5, 8, 2, 3, 6]);
    assert_eq!(read("out/data-mask"), [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]);
    with.chat_template = Some("chatml".into());
    prepare(&with, false).unwrap();
    assert_eq!(read("out/data"), [5, 7, 1, 6, 5, 8, 2, 3, 6]);
    let jinja = dir.join("strict.jinja");
    std::fs::write(&jinja, "{{ bos_token }}\n{{ raise_exception('system turn required') }}").unwrap();
    with.chat_template = Some(jinja);
    let e = prepare(&with, false).unwrap_err();
    assert!(
        e.contains("strict.jinja") && e.contains("line 2") && e.contains("system turn required"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A GGUF file's vocabulary tokenizes as its own tokenizer does (the fuzz corpus's small
/// model: `tests/fuzz/gguf`).
#[test]
fn a_gguf_files_vocabulary_tokenizes() {
    let dir = scratch("gguf");
    let gguf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fuzz/gguf/wide-f32.gguf");
    let tokenizer = burn_megatron::models::llama::gguf::tokenizer(&gguf).unwrap();
    std::fs::write(dir.join("a.txt"), "hello world 12").unwrap();
    let mut gguf_args = args(&dir, &["a.txt"]);
    gguf_args.tokenizer = gguf;
    let eod = EOD_CANDIDATES.iter().find_map(|t| tokenizer.token_to_id(t));
    gguf_args.eod = eod.is_none().then(|| tokenizer.id_to_token(0).unwrap());
    prepare(&gguf_args, false).unwrap();
    let data = IndexedDataset::open(&dir.join("out/data")).unwrap();
    let want = tokenizer.encode("hello world 12", false).unwrap().get_ids().to_vec();
    let read = data.sequence(0, 1 << 20).unwrap();
    assert_eq!(&read[..read.len() - 1], &want[..]);
    let _ = std::fs::remove_dir_all(&dir);
}
