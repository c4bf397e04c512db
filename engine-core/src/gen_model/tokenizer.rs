//! Tokenizer files of a generated model: `tokenizer.json` copied as is, and a
//! `tokenizer_config.json` as Llama 3.1 Instruct's (special tokens taken from the copied
//! tokenizer's `added_tokens`, bos `<|begin_of_text|>`, eos `<|eot_id|>`, and the Llama 3.1
//! chat template verbatim).

use std::path::Path;

use anyhow::Context;
use serde_json::{json, Map, Value};

/// The `chat_template` of Llama 3.1 Instruct's `tokenizer_config.json`, byte for byte.
pub const LLAMA31_CHAT_TEMPLATE: &str = include_str!("llama31_chat_template.jinja");

pub fn write_tokenizer_files(
    out: &Path,
    tokenizer: &Path,
    model_max_length: usize,
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
        "chat_template": LLAMA31_CHAT_TEMPLATE,
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
        write_tokenizer_files(&out, &tok, 8192).expect("write files");
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
