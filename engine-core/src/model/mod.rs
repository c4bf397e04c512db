//! Hugging Face model directories and the CPU forward pass.
//!
//! CONTRACT (used by the executor; keep these signatures):
//! - [`ModelDir::open`] reads `config.json` and `generation_config.json` and validates them.
//! - [`CpuModel::load`] memory-maps the safetensors (single file or sharded index), checks every
//!   tensor's presence and shape, and converts bf16/f16/f32 to f32.
//! - [`KvCache`] is the paged KV store: per layer, K and V of shape
//!   `[num_blocks, block_size, num_kv_heads, head_dim]`. The KV of position `p` of a sequence
//!   lives in block `block_table[p / block_size]` at offset `p % block_size`.
//! - [`CpuModel::forward`] runs one batch of chunks: for each [`SeqChunk`] it writes the K/V of
//!   positions `position .. position + tokens.len()` into the cache, attends causally over the
//!   paged cache (positions `0 ..= p` for the token at `p`), and writes the logits of the
//!   chunk's last `logit_rows` tokens into the next `vocab_size` rows of `logits`.
//!
//! Module map: `config` (the JSON files, [`ModelDir`]) -> `weights` (safetensors; the expected
//! tensor names and shapes, also used by the generator) -> `cpu` (the forward pass) over
//! `linear` (gemm-backed products over packed weights), `fp8` (FP8 checkpoints and quantization), `ops` (norms, activations), `rope`,
//! `attention` (paged, GQA) and `kv_cache`. `reference_tests` checks `cpu` against a plain
//! f64 reference; `tests/parity.rs` checks it against transformers.

mod attention;
mod config;
mod cpu;
pub mod fp8;
mod kv_cache;
mod linear;
mod ops;
pub(crate) mod rope;
mod weights;

#[cfg(test)]
mod fuzz_tests;
#[cfg(test)]
mod reference_tests;

pub use config::{
    Activation, Architecture, GenerationConfig, LayerAttention, Llama3Scaling, ModelConfig,
    ModelDir, ModelError, RopeScaling, SlidingWindow, WeightDtype,
};
pub use cpu::{CpuModel, LoadOptions, SeqChunk};
pub use kv_cache::KvCache;
pub(crate) use weights::check_data_offsets;
pub use weights::{
    expected_tensors, Checkpoint, LayerTensor, TensorRef, WeightRef, EMBED, FINAL_NORM, INDEX_FILE,
    LM_HEAD, SINGLE_FILE,
};
