use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{0}")]
    Invalid(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen3,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenerationConfig {
    pub eos_token_ids: Vec<u32>,
}

#[derive(Debug, Clone)]
pub struct ModelDir {
    pub path: PathBuf,
    /// Served model name (the directory's file name).
    pub name: String,
    pub config: ModelConfig,
    pub generation: GenerationConfig,
}

impl ModelDir {
    pub fn open(path: &Path) -> Result<ModelDir, ModelError> {
        todo!("{path:?}")
    }
}
