//! Tokenizer files of a generated model: `tokenizer.json` copied as is, and a
//! `tokenizer_config.json` as Llama 3.1 Instruct's (special tokens taken from the copied
//! tokenizer's `added_tokens`, bos `<|begin_of_text|>`, eos `<|eot_id|>`, and the chat template
//! verbatim: Llama 3.1's, or Gemma 3's for the Gemma presets, whose turns then render around
//! the stand-in tokenizer's bos).

use std::path::Path;

use anyhow::Context;
use serde_json::{json, Map, Value};

/// The `chat_template` of Llama 3.1 Instruct's `tokenizer_config.json`, byte for byte.
pub const LLAMA31_CHAT_TEMPLATE: &str = include_str!("llama31_chat_template.jinja");

/// The `chat_template` of Gemma 3 instruct releases' `tokenizer_config.json` (user/model turns
/// between `<start_of_turn>` and `<end_of_turn>`, the system message prefixed to the first user
/// turn).
pub const GEMMA3_CHAT_TEMPLATE: &str = include_str!("gemma3_chat_template.jinja");

/// The chat templates built into Harrier, by the names `--chat-template` accepts.
pub const BUILTIN_CHAT_TEMPLATES: &[(&str, &str)] = &[
    ("llama3.1", LLAMA31_CHAT_TEMPLATE),
    ("gemma3", GEMMA3_CHAT_TEMPLATE),
];

/// The built-in chat template called `name`.
pub fn builtin_chat_template(name: &str) -> Option<&'static str> {
    BUILTIN_CHAT_TEMPLATES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, t)| *t)
}

pub fn write_tokenizer_files(
    out: &Path,
    tokenizer: &Path,
    model_max_length: usize,
    chat_template: &str,
) -> anyhow::Result<()> {
    let bytes =
        std::fs::read(tokenizer).with_context(|| format!("reading {}", tokenizer.display()))?;
    let parsed: Value = serde_json::from_slice(&bytes).with_context(|| {
        format!(
            "{}: not a tokenizer.json (invalid JSON)",
            tokenizer.display()
        )
    })?;
    let mut decoder = Map::new();
    if let Some(added) = parsed.get("added_tokens").and_then(Value::as_array) {
        for t in added {
            let (Some(id), Some(content)) = (t.get("id").and_then(Value::as_u64), t.get("content"))
            else {
                continue;
            };
            let flag = |k: &str| t.get(k).cloned().unwrap_or(json!(false));
            decoder.insert(
                id.to_string(),
                json!({
                    "content": content,
                    "lstrip": flag("lstrip"),
                    "normalized": flag("normalized"),
                    "rstrip": flag("rstrip"),
                    "single_word": flag("single_word"),
                    "special": flag("special"),
                }),
            );
        }
    }
    let config = json!({
        "added_tokens_decoder": decoder,
        "bos_token": "<|begin_of_text|>",
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": true,
        "eos_token": "<|eot_id|>",
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    });
    let dst = out.join("tokenizer.json");
    std::fs::write(&dst, &bytes).with_context(|| format!("writing {}", dst.display()))?;
    let dst = out.join("tokenizer_config.json");
    std::fs::write(&dst, serde_json::to_string_pretty(&config)? + "\n")
        .with_context(|| format!("writing {}", dst.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_config_with_template_and_specials() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tok = dir.path().join("src.json");
        let src = json!({"added_tokens": [
            {"id": 128000, "content": "<|begin_of_text|>", "single_word": false, "lstrip": false,
             "rstrip": false, "normalized": false, "special": true}]});
        std::fs::write(&tok, src.to_string()).expect("write");
        let out = dir.path().join("m");
        std::fs::create_dir(&out).expect("mkdir");
        write_tokenizer_files(&out, &tok, 8192, LLAMA31_CHAT_TEMPLATE).expect("write files");
        let cfg: Value = serde_json::from_slice(
            &std::fs::read(out.join("tokenizer_config.json")).expect("read"),
        )
        .expect("json");
        assert_eq!(cfg["eos_token"], "<|eot_id|>");
        assert_eq!(
            cfg["added_tokens_decoder"]["128000"]["content"],
            "<|begin_of_text|>"
        );
        let t = cfg["chat_template"].as_str().expect("template");
        assert!(t.starts_with("{{- bos_token }}") && t.contains("Cutting Knowledge Date"));
        assert!(out.join("tokenizer.json").is_file());
    }
}
