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
//!   paged cache (positions `0 ..= p` for the token at `p`), and for chunks with `want_logits`
//!   writes the logits of the chunk's last token into the next `vocab_size` row of `logits`.

mod config;
mod cpu;
mod kv_cache;

pub use config::{Architecture, GenerationConfig, ModelConfig, ModelDir, ModelError, RopeScaling};
pub use cpu::{CpuModel, SeqChunk};
pub use kv_cache::KvCache;
