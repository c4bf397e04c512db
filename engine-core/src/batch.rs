//! The batch description that crosses the executor seam.
//!
//! An [`ExecBatch`] is what the scheduler hands a backend for one step. It is plain data with
//! no backend types, laid out flat (a few vectors, not one allocation per sequence) so that a
//! backend can copy it into per-slot host buffers and then upload it (the CUDA backend's pinned
//! metadata) with a handful of copies. The engine owns one `ExecBatch` per ping-pong slot and
//! refills it each step (`clear()` keeps the capacity), so steady-state steps allocate nothing
//! here.
//!
//! Rows: every admitted request holds a backend *row* (an index below `max_num_seqs`) for its
//! whole life in the running set. Per-row state lives in the backend: the block table, the
//! sampling parameters, penalty counters and, crucially, the last sampled token. A decode entry
//! carries no token: its input is the row's device-side pending token written by the previous
//! step's sampling, so the host is never on the path between two decode steps.

use harrier_shared::protocol::{SamplingParams, TokenId};

/// A backend row: per-request state slot, stable while the request holds KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RowId(pub u32);

/// One sequence's part of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqInput {
    pub row: RowId,
    /// Tokens of this sequence already in (or being written to) the KV cache before this step.
    pub position: u32,
    /// Tokens computed in this step.
    pub num_tokens: u32,
    /// `host_tokens[start..start + len]` are the chunk's first tokens. If `len < num_tokens`
    /// the remaining one token (`num_tokens - len == 1`) is the row's pending sampled token.
    pub host_start: u32,
    pub host_len: u32,
    /// `new_blocks[start..start + len]` are appended to the row's block table before the step.
    pub blocks_start: u32,
    pub blocks_len: u32,
    /// The next `local_blocks_len` entries of `new_blocks` (after the row's `blocks_len`) are
    /// appended to its sliding-window block table (0 unless the engine keeps window-sized KV
    /// for sliding layers; then a row starts with its whole table, released entries as the
    /// scratch block 0).
    pub local_blocks_len: u32,
    /// Sample a token after this chunk (its last position reaches the end of the sequence).
    pub sample: bool,
    /// Speculative decoding (decode entries only, `host_len == 0`): tokens to propose and
    /// verify after the pending token; `num_tokens == 1 + draft`. The backend proposes up to
    /// `draft` tokens (a draft model, n-gram lookup), scores the pending token and its
    /// proposals in one target forward and emits 1 to `draft + 1` tokens. `position` is then an
    /// upper bound: rounds still in flight may accept fewer tokens than the host booked, and
    /// the backend, which knows, places the round at the row's true length.
    pub draft: u32,
}

impl SeqInput {
    pub fn uses_pending_token(&self) -> bool {
        self.host_len < self.num_tokens
    }
}

/// (Re)initialises a row when a request is admitted or resumed after preemption.
#[derive(Debug, Clone, PartialEq)]
pub struct RowInit {
    pub row: RowId,
    pub sampling: SamplingParams,
    /// The request's effective seed (the engine picks one when the request gave none).
    pub seed: u64,
    /// Token ids masked out while fewer than `min_tokens` tokens were generated
    /// (EOS unless `ignore_eos`, plus `stop_token_ids`).
    pub min_tokens_mask: Vec<TokenId>,
    /// Prompt tokens (for the repetition penalty).
    pub prompt: Vec<TokenId>,
    /// Tokens generated before a preemption (penalties and the RNG counter resume from them).
    pub output: Vec<TokenId>,
}

/// One step's work for a backend. Sequence order is the order of the step's outputs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExecBatch {
    /// Rows (re)initialised before this step runs; applied before `seqs`.
    pub row_inits: Vec<RowInit>,
    pub seqs: Vec<SeqInput>,
    pub host_tokens: Vec<TokenId>,
    pub new_blocks: Vec<u32>,
}

impl ExecBatch {
    pub fn clear(&mut self) {
        let Self {
            row_inits,
            seqs,
            host_tokens,
            new_blocks,
        } = self;
        row_inits.clear();
        seqs.clear();
        host_tokens.clear();
        new_blocks.clear();
    }

    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.num_tokens as usize).sum()
    }

    pub fn num_samples(&self) -> usize {
        self.seqs.iter().filter(|s| s.sample).count()
    }

    /// True when any sequence reads tokens from the host (a prefill or recompute chunk).
    pub fn has_prefill(&self) -> bool {
        self.seqs.iter().any(|s| s.host_len > 0)
    }

    /// Checks internal consistency (ranges in bounds, at most one pending token per sequence).
    pub fn check(&self) -> Result<(), String> {
        for (i, s) in self.seqs.iter().enumerate() {
            if s.draft > 0 && (s.host_len > 0 || !s.sample || s.num_tokens != s.draft + 1) {
                return Err(format!(
                    "seq {i}: a speculative entry must be a sampled decode of 1 + {} tokens",
                    s.draft
                ));
            }
            if s.num_tokens == 0
                || s.num_tokens - s.host_len.min(s.num_tokens) > 1 + s.draft
                || s.host_len > s.num_tokens
            {
                return Err(format!(
                    "seq {i}: {} tokens with {} from the host",
                    s.num_tokens, s.host_len
                ));
            }
            if (s.host_start + s.host_len) as usize > self.host_tokens.len() {
                return Err(format!("seq {i}: host token range out of bounds"));
            }
            if (s.blocks_start + s.blocks_len + s.local_blocks_len) as usize > self.new_blocks.len()
            {
                return Err(format!("seq {i}: block range out of bounds"));
            }
        }
        Ok(())
    }
}

/// What a step returns, filled into a caller-owned buffer by `Executor::wait`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOutput {
    /// The tokens of every sequence with `sample`, in sequence order: `counts[j]` tokens for
    /// the `j`-th (1 without speculation; 1 to `draft + 1` for a speculative entry).
    pub tokens: Vec<TokenId>,
    /// Parallel to `tokens`; `Some` for rows whose request asked for logprobs.
    pub logprobs: Vec<Option<harrier_shared::protocol::TokenLogprobs>>,
    /// Tokens emitted per sampled sequence.
    pub counts: Vec<u32>,
    /// Proposals verified per sampled sequence (0 without speculation; at most `draft`: an
    /// n-gram lookup may find fewer). Of them `counts[j] - 1` were accepted.
    pub proposed: Vec<u32>,
}

impl StepOutput {
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.logprobs.clear();
        self.counts.clear();
        self.proposed.clear();
    }

    /// Appends one plain sample.
    pub fn push_one(
        &mut self,
        token: TokenId,
        logprobs: Option<harrier_shared::protocol::TokenLogprobs>,
    ) {
        self.tokens.push(token);
        self.logprobs.push(logprobs);
        self.counts.push(1);
        self.proposed.push(0);
    }
}

/// Allowed-token bitmasks of a step's constrained rows (structured outputs), set between
/// `launch_forward` and `finalize_sampling`: bit `t % 32` of word `t / 32` of a mask allows
/// token `t`; every other token's logit becomes -inf before sampling.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenMasks {
    /// Index among the step's sampled sequences, per mask.
    pub samples: Vec<u32>,
    pub words_per_mask: usize,
    /// `samples.len() * words_per_mask` words.
    pub words: Vec<u32>,
}

impl TokenMasks {
    pub fn clear(&mut self) {
        self.samples.clear();
        self.words.clear();
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The mask of the `i`-th entry.
    pub fn mask(&self, i: usize) -> &[u32] {
        &self.words[i * self.words_per_mask..(i + 1) * self.words_per_mask]
    }

    /// Sets every disallowed logit of `logits` to -inf.
    pub fn apply(mask: &[u32], logits: &mut [f32]) {
        for (t, l) in logits.iter_mut().enumerate() {
            let allowed = mask.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1);
            if !allowed {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}
