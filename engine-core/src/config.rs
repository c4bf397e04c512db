//! Engine configuration: a typed struct, validated once when the engine is built.

use thiserror::Error;

/// How many sampled steps may be in flight at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PipelineDepth {
    /// Launch, sample, wait, commit: one step at a time (for comparison and debugging).
    Sync,
    /// Step t+1 is launched before step t is committed (reference 000 §4.6).
    Async,
}

impl PipelineDepth {
    pub fn max_in_flight(self) -> usize {
        match self {
            PipelineDepth::Sync => 1,
            PipelineDepth::Async => 2,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Most requests holding KV rows at once (running, zombies included).
    pub max_num_seqs: u32,
    /// Token budget of one step (decodes plus prefill chunks).
    pub max_num_batched_tokens: u32,
    /// Prompt plus output tokens of one request.
    pub max_model_len: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks in the pool (block 0 is reserved as scratch, see [`crate::kv`]).
    pub num_kv_blocks: u32,
    pub pipeline: PipelineDepth,
    /// Largest `logprobs` a request may ask for.
    pub max_logprobs: u32,
    /// Reuse the KV of full blocks shared with earlier requests (see [`crate::kv`]).
    pub enable_prefix_caching: bool,
    pub policy: crate::scheduler::SchedulingPolicy,
    /// Speculative decoding: tokens proposed per decode round (0: off; the backend proposes
    /// and verifies them, see [`crate::scheduler::Scheduler::spec_len`]).
    pub num_speculative_tokens: u32,
    /// Rounds propose nothing while more requests than this decode (see
    /// [`crate::scheduler::SchedulerConfig::spec_disable_batch_size`]).
    pub spec_disable_batch_size: Option<u32>,
    /// Window-sized KV for the sliding-window layers in a pool of their own (see
    /// [`crate::scheduler::LocalKvConfig`]); `None`: every layer keeps full KV in one pool.
    pub local_kv: Option<crate::scheduler::LocalKvConfig>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: 4096,
            block_size: 16,
            num_kv_blocks: 4096,
            pipeline: PipelineDepth::Async,
            max_logprobs: 20,
            enable_prefix_caching: true,
            policy: crate::scheduler::SchedulingPolicy::DecodeFirst,
            num_speculative_tokens: 0,
            spec_disable_batch_size: None,
            local_kv: None,
        }
    }
}

#[derive(Debug, Error, PartialEq)]
#[error("invalid engine configuration: {0}")]
pub struct ConfigError(pub String);

impl EngineConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |m: String| Err(ConfigError(m));
        if self.max_num_seqs == 0 {
            return err("max_num_seqs must be at least 1".into());
        }
        if self.block_size == 0 || !self.block_size.is_power_of_two() {
            return err(format!(
                "block_size must be a power of two, got {}",
                self.block_size
            ));
        }
        if self.max_model_len < 2 {
            return err("max_model_len must be at least 2".into());
        }
        if self.max_num_batched_tokens < self.max_num_seqs.min(self.max_model_len) {
            return err(format!(
                "max_num_batched_tokens ({}) must cover one decode token per sequence (max_num_seqs {})",
                self.max_num_batched_tokens, self.max_num_seqs
            ));
        }
        if self.num_speculative_tokens as usize > crate::scheduler::MAX_SPECULATIVE_TOKENS {
            return err(format!(
                "num_speculative_tokens must be at most {}, got {}",
                crate::scheduler::MAX_SPECULATIVE_TOKENS,
                self.num_speculative_tokens
            ));
        }
        if self.max_num_batched_tokens < 1 + self.num_speculative_tokens {
            return err(format!(
                "max_num_batched_tokens ({}) must fit one speculative round of 1 + {} tokens",
                self.max_num_batched_tokens, self.num_speculative_tokens
            ));
        }
        if let Some(l) = self.local_kv {
            let least = crate::scheduler::LocalKvConfig::min_blocks(l.window, self.block_size);
            if l.window == 0 || l.num_blocks < least {
                return err(format!(
                    "the sliding-window KV pool needs at least {least} blocks for a window of {} (got {})",
                    l.window, l.num_blocks
                ));
            }
            if self.num_speculative_tokens > 0 {
                return err(
                    "window-sized KV does not combine with speculative decoding yet".into(),
                );
            }
        }
        // A speculative round may write up to `num_speculative_tokens` positions past the
        // model length (see `Scheduler::spec_len`).
        let blocks_for_one =
            (self.max_model_len + self.num_speculative_tokens).div_ceil(self.block_size) + 1;
        if self.num_kv_blocks < blocks_for_one {
            return err(format!(
                "{} KV blocks cannot hold one request of max_model_len {} ({} blocks of {} tokens + 1 scratch needed)",
                self.num_kv_blocks,
                self.max_model_len,
                blocks_for_one - 1,
                self.block_size
            ));
        }
        Ok(())
    }
}

/// CUDA: decode steps of up to this many tokens take the fused small-batch path
/// (`--fused-decode-max-rows`; docs/cuda.md, "Fused small-batch decode"). Measured on the H200
/// (session 12, docs/benchmarks.md, ms per step, fused vs unfused): 1B 1.177 vs 1.316 at 1
/// row, 1.230 vs 1.251 at 2, 1.279 vs 1.351 at 4, 1.459 vs 1.522 at 8; 3B 2.615 vs 2.832,
/// 2.906 vs 2.891, 3.206 vs 3.221, 3.348 vs 3.374; models wider than the 3B's 3,072 stay at
/// one row (the 8B loses 2-3% at 2-8 rows: `fused_width_max_rows` in the CUDA model).
/// Steps of 9-16 rows take it on models up to 2,048 wide, 9-12 up to 3,072
/// (the same function: since session 39 the 16-row skinny instances have the
/// 8-row ones' 8-warp, two-block and cluster split-K twins and deferred norms; the 1B gains
/// 3-4%, Qwen3-0.6B 17%, the 3B 1-5% at 9-12 rows and loses from 14). Past 16 rows the
/// fused path loses badly (H100, session 8: 5.18 vs 2.19 ms at 64; H200, session 39: 1B
/// 2.50 vs 1.37 at 32): every block re-reads the input rows.
pub const FUSED_DECODE_MAX_ROWS: usize = 16;

/// The fused path's row limit that `harrier-cuda-tool bench` and `check-fused` use when not
/// told: where the skinny GEMMs are expected to stop beating cuBLAS's tiled ones.
pub const FUSED_TRIAL_ROWS: usize = FUSED_DECODE_MAX_ROWS;

/// The default CUDA-graph batch sizes: 1, 2, 4, 8, 16, 24, 32, then steps of 16 up to
/// `max_batch` (always included), as vLLM spaces its defaults. Small batches get dense buckets
/// (padding 3 to 4 costs little); large ones are compute-heavy enough that 16 rows of padding
/// are a small fraction.
pub fn default_graph_sizes(max_batch: usize) -> Vec<usize> {
    let mut v: Vec<usize> = [1, 2, 4, 8, 16, 24, 32]
        .into_iter()
        .filter(|&s| s < max_batch)
        .collect();
    let mut n = 48;
    while n < max_batch {
        v.push(n);
        n += 16;
    }
    v.push(max_batch);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid() {
        EngineConfig::default().validate().unwrap();
    }

    #[test]
    fn rejects_bad_values() {
        let base = EngineConfig::default();
        for bad in [
            EngineConfig {
                max_num_seqs: 0,
                ..base.clone()
            },
            EngineConfig {
                block_size: 12,
                ..base.clone()
            },
            EngineConfig {
                max_model_len: 1,
                ..base.clone()
            },
            EngineConfig {
                max_num_batched_tokens: 8,
                ..base.clone()
            },
            EngineConfig {
                num_kv_blocks: 10,
                ..base.clone()
            },
            EngineConfig {
                max_num_seqs: 2,
                max_num_batched_tokens: 4,
                num_speculative_tokens: 4,
                ..base.clone()
            },
            EngineConfig {
                num_speculative_tokens: 17,
                ..base.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
