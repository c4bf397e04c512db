//! `harrier gen-model`: writes a Hugging Face model directory with deterministic random weights.

use std::path::PathBuf;

#[derive(Debug, clap::Args)]
pub struct GenModelArgs {
    /// Preset: micro, micro-qwen3, tiny, llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, qwen3-0.6b, qwen3-4b.
    #[arg(long)]
    pub preset: String,
    /// Output directory (created).
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

pub fn run(args: &GenModelArgs) -> anyhow::Result<()> {
    todo!("{args:?}")
}
