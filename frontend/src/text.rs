//! The model's text side: tokenizer and chat template, run on a bounded blocking pool.
//!
//! Encoding a long prompt or rendering a template takes milliseconds of CPU: it never runs on
//! a tokio worker (which would stall `/health`, `/metrics` and other streams). Jobs go to
//! tokio's blocking threads, at most `pool_size` at once (a semaphore), so a burst of huge
//! prompts queues instead of spawning hundreds of threads.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use harrier_shared::protocol::TokenId;
use tokenizers::Tokenizer;
use tokio::sync::Semaphore;

use crate::error::ApiError;
use crate::template::{ChatInput, ChatTemplate};

pub struct TextModel {
    pub tokenizer: Arc<Tokenizer>,
    /// The tokenizer's vocabulary size, added tokens included.
    pub vocab_size: u32,
    template: Option<ChatTemplate>,
    pool: Arc<Semaphore>,
    /// The tokenizer file, for structured-output checks (`None`: not loaded from a file).
    tokenizer_path: Option<PathBuf>,
    /// Compiles constraints to check them (a 400 that names the problem) before the engine
    /// sees them; built on first use, with the engine's vocabulary size and EOS ids.
    grammar: std::sync::OnceLock<Result<harrier_engine::structured::GrammarCompiler, String>>,
}

/// Where the front end finds its tokenizer and template.
#[derive(Debug, Clone)]
pub struct TextSource {
    pub model_dir: PathBuf,
    pub tokenizer: Option<PathBuf>,
    pub chat_template: Option<PathBuf>,
}

impl TextModel {
    pub fn load(src: &TextSource, pool_size: usize) -> anyhow::Result<Self> {
        let tok_path = src
            .tokenizer
            .clone()
            .unwrap_or_else(|| src.model_dir.join("tokenizer.json"));
        let tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| anyhow::anyhow!("{e}"))
            .with_context(|| format!("loading the tokenizer {}", tok_path.display()))?;
        let template = ChatTemplate::from_model_dir(&src.model_dir, src.chat_template.as_deref())?;
        if template.is_none() {
            tracing::warn!(model = %src.model_dir.display(), "the model has no chat template: /v1/chat/completions will answer 400");
        }
        let mut model = Self::new(tokenizer, template, pool_size);
        model.tokenizer_path = Some(tok_path);
        Ok(model)
    }

    /// Compiles `spec` (as the engine will) and answers a 400 naming `param` and the
    /// problem if it does not compile. Without a tokenizer file the engine checks alone.
    pub fn check_structured(
        &self,
        spec: &harrier_shared::protocol::StructuredOutput,
        param: &'static str,
        vocab_size: u32,
        eos: &[TokenId],
    ) -> Result<(), ApiError> {
        let Some(path) = &self.tokenizer_path else {
            return Ok(());
        };
        let compiler = self.grammar.get_or_init(|| {
            harrier_engine::structured::GrammarCompiler::from_tokenizer_json(
                path,
                (vocab_size as usize).max(self.vocab_size as usize),
                eos,
            )
            .map_err(|e| format!("{e:#}"))
        });
        match compiler {
            Ok(c) => c
                .compile(spec)
                .map(|_| ())
                .map_err(|e| ApiError::invalid(param, format!("Invalid constraint: {e}"))),
            Err(e) => Err(ApiError::invalid(
                param,
                format!("Structured outputs are unavailable for this model: {e}"),
            )),
        }
    }

    pub fn new(tokenizer: Tokenizer, template: Option<ChatTemplate>, pool_size: usize) -> Self {
        let vocab_size = tokenizer.get_vocab_size(true) as u32;
        Self {
            tokenizer: Arc::new(tokenizer),
            vocab_size,
            template,
            pool: Arc::new(Semaphore::new(pool_size.max(1))),
            tokenizer_path: None,
            grammar: std::sync::OnceLock::new(),
        }
    }

    /// Runs `f` on a blocking thread, at most `pool_size` at once.
    pub async fn run<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&TextModel) -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        let _permit = self
            .pool
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ApiError::internal("tokenizer pool closed"))?;
        let this = self.clone();
        tokio::task::spawn_blocking(move || f(&this))
            .await
            .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<TokenId>, ApiError> {
        self.tokenizer
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| ApiError::bad_request(format!("Cannot tokenize the prompt: {e}")))
    }

    pub fn decode(&self, ids: &[TokenId], skip_special_tokens: bool) -> Result<String, ApiError> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| ApiError::bad_request(format!("Cannot decode the tokens: {e}")))
    }

    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    pub fn render_chat(&self, input: &ChatInput<'_>) -> Result<String, ApiError> {
        match &self.template {
            Some(t) => t.render(input),
            None => Err(ApiError::bad_request("This model has no chat template; use /v1/completions or start the server with --chat-template.")),
        }
    }
}

/// The tokenizer file of a model directory (for error messages before loading).
pub fn tokenizer_path(dir: &Path) -> PathBuf {
    dir.join("tokenizer.json")
}
