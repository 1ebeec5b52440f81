//! Chat templates (`burn_megatron::data::chat`) against transformers': each conversation's text
//! and the spans of it the loss counts, as `render_jinja_template` gave them for the same
//! templates (`tests/fixtures/chat`, `make_chat.py`).

use burn_megatron::data::{ChatTemplate, Turn};
use serde_json::Value;

fn fixture() -> Value {
    let path = crate::data_suite::fixtures().with_file_name("chat").join("chat.json");
    serde_json::from_slice(&std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

/// A template of the fixture's, with its special tokens, read as a `tokenizer_config.json`.
fn template(tokens: &Value, text: &str, dir: &std::path::Path) -> ChatTemplate {
    let mut config = tokens.clone();
    config["chat_template"] = Value::String(text.into());
    let path = dir.join("tokenizer_config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    ChatTemplate::from_tokenizer_config(&path).unwrap().expect("a template")
}

/// Character offsets (Python's) into `text` as byte offsets (ours).
fn byte_at(text: &str, chars: u64) -> usize {
    text.char_indices().nth(chars as usize).map_or(text.len(), |(at, _)| at)
}

pub fn templates_render_as_transformers() {
    let fixture = fixture();
    let dir = std::env::temp_dir().join(format!("burn-megatron-chat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in fixture["templates"].as_array().unwrap() {
        let name = entry["name"].as_str().unwrap();
        let ours = template(&fixture["tokens"], entry["template"].as_str().unwrap(), &dir);
        for case in entry["cases"].as_array().unwrap() {
            let turns: Vec<Turn> = case["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| Turn::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
                .collect();
            let rendered = ours.render(&turns).unwrap();
            let text = case["text"].as_str().unwrap();
            assert_eq!(rendered.text, text, "{name}: the text");
            let spans: Vec<_> = case["spans"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| byte_at(text, s[0].as_u64().unwrap())..byte_at(text, s[1].as_u64().unwrap()))
                .collect();
            assert_eq!(rendered.learned, spans, "{name}: the assistant's spans in {text:?}");
            let prompt = ours.text(&turns[..1], true).unwrap();
            assert_eq!(
                prompt,
                case["prompt"].as_str().unwrap(),
                "{name}: the generation prompt"
            );
        }
    }
    // Roles that do not alternate: the template's own exception, as the template's error.
    let inst = &fixture["templates"][2];
    let ours = template(&fixture["tokens"], inst["template"].as_str().unwrap(), &dir);
    let e = ours
        .render(&[Turn::new("user", "a"), Turn::new("user", "b")])
        .unwrap_err()
        .to_string();
    assert!(e.contains(fixture["raises"].as_str().unwrap()), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
