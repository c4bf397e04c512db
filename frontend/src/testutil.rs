//! Test helpers: the Llama 3 tokenizer installed by `scripts/setup.sh`.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use tokenizers::Tokenizer;

/// `$HARRIER_HOME/llama3/tokenizer.json` (HARRIER_HOME defaults to `~/.cache/harrier`).
pub fn llama3_tokenizer_path() -> PathBuf {
    let home = std::env::var_os("HARRIER_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/harrier")
        });
    home.join("llama3/tokenizer.json")
}

/// The real Llama 3 tokenizer, loaded once per test binary.
pub fn llama3_tokenizer() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let path = llama3_tokenizer_path();
        let tok = Tokenizer::from_file(&path).unwrap_or_else(|e| {
            panic!(
                "cannot load {} ({e}); run scripts/setup.sh first",
                path.display()
            )
        });
        Arc::new(tok)
    })
    .clone()
}
