//! Chat templates: a conversation rendered as the model was tuned to read it, the Jinja of its
//! tokenizer's `chat_template` (`tokenizer_config.json`, as transformers' `apply_chat_template`
//! renders it: blocks trimmed and left-stripped, the config's special tokens in scope), or
//! ChatML where the tokenizer has none; with the byte spans of the text the loss counts, the
//! assistant's turns.
//!
//! A template does not say where a turn starts, so each assistant turn is located by rendering
//! the conversation up to it with the generation prompt (`add_generation_prompt`) and up to its
//! end: the turn is what the second adds to the first (its trailing whitespace left out; a
//! template without a generation prompt leaves the assistant's header in its turn). A
//! template that does not render a conversation's turns as a prefix of the whole (one that
//! rewrites earlier turns, such as dropping their reasoning) cannot be masked this way, and is
//! an error naming the turn.

use std::ops::Range;
use std::path::Path;

use minijinja::{Environment, ErrorKind, Value, context};
use serde::Serialize;

use super::DataError;

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Turn {
    pub role: String,
    pub content: String,
}

impl Turn {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A rendered conversation: its text and the byte ranges of it the loss counts.
#[derive(Clone, Debug, PartialEq)]
pub struct Rendered {
    pub text: String,
    pub learned: Vec<Range<usize>>,
}

/// ChatML (`<|im_start|>ROLE\nCONTENT<|im_end|>\n` a turn): the template of a tokenizer that has
/// none.
pub const CHATML: &str = "{% for message in messages %}<|im_start|>{{ message.role }}\n\
{{ message.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// A chat template, parsed, with the special tokens it may name.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token` and the like, as the template reads them.
    tokens: Value,
    /// Where the template came from, for errors.
    source: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChatTemplate({})", self.source)
    }
}

impl ChatTemplate {
    /// ChatML.
    pub fn chatml() -> Self {
        Self::with_tokens(CHATML, &[], "ChatML").expect("ChatML parses")
    }

    /// The template `text` (Jinja), `source` naming it in errors, with no special tokens.
    pub fn new(text: &str, source: &str) -> Result<Self, DataError> {
        Self::with_tokens(text, &[], source)
    }

    /// The template `text` (Jinja) with the special tokens it may name (`bos_token`, …: a
    /// `tokenizer_config.json`'s, [`TokenizerConfig`]), `source` naming it in errors.
    pub fn with_tokens(text: &str, tokens: &[(String, String)], source: &str) -> Result<Self, DataError> {
        let tokens: std::collections::BTreeMap<&str, &str> =
            tokens.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        Self::parse(text.to_string(), Value::from_serialize(&tokens), source.into())
    }

    /// The chat template of a `tokenizer_config.json` ([`TokenizerConfig`]); `None` where it
    /// has none.
    pub fn from_tokenizer_config(path: &Path) -> Result<Option<Self>, DataError> {
        let config = TokenizerConfig::read(path)?;
        let source = path.display().to_string();
        config
            .chat_template
            .map(|text| Self::with_tokens(&text, &config.tokens, &source))
            .transpose()
    }

    /// The template beside a `tokenizer.json` (its directory's `tokenizer_config.json`), or
    /// ChatML where there is none or it has no template.
    pub fn beside(tokenizer: &Path) -> Result<Self, DataError> {
        let config = tokenizer.with_file_name("tokenizer_config.json");
        match config.exists() {
            true => Ok(Self::from_tokenizer_config(&config)?.unwrap_or_else(Self::chatml)),
            false => Ok(Self::chatml()),
        }
    }

    /// Where the template came from: a file, or `ChatML`.
    pub fn source(&self) -> &str {
        &self.source
    }

    fn parse(text: String, tokens: Value, source: String) -> Result<Self, DataError> {
        let mut env = Environment::new();
        // transformers renders with jinja2's `trim_blocks` and `lstrip_blocks`.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned("chat", text)
            .map_err(|e| template_error(&source, &e))?;
        Ok(Self { env, tokens, source })
    }

    /// The template's text for `turns`, with the generation prompt after them or not.
    pub fn text(&self, turns: &[Turn], add_generation_prompt: bool) -> Result<String, DataError> {
        let template = self.env.get_template("chat").expect("added in parse");
        let ctx = context! { messages => turns, add_generation_prompt, ..self.tokens.clone() };
        template.render(ctx).map_err(|e| template_error(&self.source, &e))
    }

    /// `turns` rendered whole, and each assistant turn's span (what rendering it adds to the
    /// conversation before it and the generation prompt, less trailing whitespace).
    pub fn render(&self, turns: &[Turn]) -> Result<Rendered, DataError> {
        let text = self.text(turns, false)?;
        let mut learned = Vec::new();
        for (i, turn) in turns.iter().enumerate().filter(|(_, t)| t.role == "assistant") {
            let prompt = self.text(&turns[..i], true)?;
            let upto = self.text(&turns[..=i], false)?;
            if !upto.starts_with(&prompt) || !text.starts_with(&upto) {
                return Err(DataError::Template {
                    template: self.source.clone(),
                    detail: format!(
                        "message {i} ({}) is not rendered after the messages before it as the whole \
                         conversation renders them: its loss mask cannot be found",
                        turn.role
                    ),
                });
            }
            let end = prompt.len() + upto[prompt.len()..].trim_end().len();
            learned.push(prompt.len()..end);
        }
        Ok(Rendered { text, learned })
    }
}

/// What a chat template takes from a `tokenizer_config.json`: its `chat_template` (a string, or
/// of a list of named ones the `default`) and its `*_token` entries (a token's text, or an added
/// token's record with its `content`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenizerConfig {
    pub chat_template: Option<String>,
    pub tokens: Vec<(String, String)>,
}

impl TokenizerConfig {
    pub fn read(path: &Path) -> Result<Self, DataError> {
        let bytes = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
        let config: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| DataError::format(path, e.column() as u64, e.to_string()))?;
        let chat_template = match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(text)) => Some(text.clone()),
            Some(serde_json::Value::Array(named)) => Some(
                named
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template")?.as_str())
                    .ok_or_else(|| {
                        DataError::format(path, 0, "`chat_template` is a list without a `default` template")
                    })?
                    .to_string(),
            ),
            Some(_) => {
                return Err(DataError::format(
                    path,
                    0,
                    "`chat_template` is neither a string nor a list",
                ));
            }
        };
        let tokens = config
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(key, _)| key.ends_with("_token"))
            .filter_map(|(key, value)| {
                let text = value.as_str().or_else(|| value.get("content")?.as_str())?;
                Some((key.clone(), text.to_string()))
            })
            .collect();
        Ok(Self { chat_template, tokens })
    }
}

fn template_error(source: &str, e: &minijinja::Error) -> DataError {
    let mut detail = e.to_string();
    if let Some(line) = e.line() {
        detail = format!("line {line}: {detail}");
    }
    DataError::Template {
        template: source.into(),
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat() -> Vec<Turn> {
        vec![
            Turn::new("system", "Be brief."),
            Turn::new("user", "Who speaks first?"),
            Turn::new("assistant", "Bernardo."),
            Turn::new("user", "And then?"),
            Turn::new("assistant", "Francisco."),
        ]
    }

    /// ChatML: each assistant content with its `<|im_end|>` is learned, nothing else.
    #[test]
    fn chatml_spans_are_the_assistant_turns() {
        let rendered = ChatTemplate::chatml().render(&chat()).unwrap();
        let spans: Vec<&str> = rendered.learned.iter().map(|r| &rendered.text[r.clone()]).collect();
        assert_eq!(spans, ["Bernardo.<|im_end|>", "Francisco.<|im_end|>"]);
        assert!(rendered.text.starts_with("<|im_start|>system\nBe brief.<|im_end|>\n"));
    }

    /// A template that rewrites earlier turns cannot be masked: a typed error naming the turn.
    #[test]
    fn a_template_rewriting_history_is_refused() {
        let text = "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[old]\
                    {% else %}{{ m.content }}{% endif %}{% endfor %}";
        let e = ChatTemplate::new(text, "t").unwrap().render(&chat()).unwrap_err();
        assert!(e.to_string().contains("message 2 (assistant)"), "{e}");
    }

    /// `raise_exception` and syntax errors are the template's errors, naming it.
    #[test]
    fn template_errors_name_the_template() {
        let raising = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "t.jinja").unwrap();
        let e = raising.render(&chat()).unwrap_err().to_string();
        assert!(e.contains("t.jinja") && e.contains("roles must alternate"), "{e}");
        let e = ChatTemplate::new("{% for %}", "bad.jinja").unwrap_err().to_string();
        assert!(e.contains("bad.jinja"), "{e}");
    }
}
