//! Per-request state inside the engine.
//!
//! Two views of a request's length coexist under run-ahead (reference 000 §4.5):
//! - the *committed* view: `prompt` + `output` (tokens the host has seen; used for streaming and
//!   stop decisions);
//! - the *device* view: `num_computed_tokens` (KV written or being written by launched steps) and
//!   `pending_samples` (tokens sampled by launched, uncommitted steps).
//!
//! `known_len() = prompt + output + pending_samples` is the sequence length once every launched
//! step is done; the next step must compute `known_len() - num_computed_tokens` tokens.

use std::time::Instant;

use harrier_shared::protocol::{FinishReason, RequestTiming, SamplingParams, TokenId};

use crate::batch::RowId;
use crate::kv::{BlockHash, BlockId};

/// Engine-internal request id (front ends use strings; see [`crate::engine`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// The front end a request came from (an index the server assigns).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Origin(pub u32);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    /// Not yet admitted (no row, no blocks).
    Waiting,
    /// Admitted: holds a row and KV blocks.
    Running,
    /// Lost its KV to preemption; waits to be recomputed (no row, no blocks).
    Preempted,
    /// Done; may still be referenced by in-flight steps (a zombie) until `inflight_refs == 0`.
    Finished(FinishReason),
}

#[derive(Debug, Clone)]
pub struct Request {
    pub id: RequestId,
    pub origin: Origin,
    pub external_id: String,
    pub prompt: Vec<TokenId>,
    /// Committed output tokens.
    pub output: Vec<TokenId>,
    pub sampling: SamplingParams,
    pub seed: u64,
    pub status: RequestStatus,
    /// Set once the request finished (EOS, stop id, length, abort, error); never cleared.
    pub finalized: bool,
    /// In-flight steps that include this request (I4: `0 <= inflight_refs <= 2`).
    pub inflight_refs: u8,
    /// Tokens sampled by in-flight steps, not yet committed.
    pub pending_samples: u32,
    pub num_computed_tokens: u32,
    pub row: Option<RowId>,
    /// The row sampled this sequence's last token: the next step is a one-token decode whose
    /// input is that token, still on the device. False while (re)computing a prefill.
    pub decoding: bool,
    pub blocks: Vec<BlockId>,
    /// The block table of the sliding-window layers' pool (when the model has them and the
    /// engine keeps their KV window-sized): entries below `local_released` are
    /// [`crate::kv::SCRATCH_BLOCK`], given back once no token could see them.
    pub local_blocks: Vec<BlockId>,
    pub local_released: u32,
    /// Chained hashes of the full blocks of prompt + committed output (prefix caching).
    pub block_hashes: Vec<BlockHash>,
    /// Leading blocks of `blocks` registered in the prefix cache.
    pub num_registered_blocks: u32,
    /// Mixed into the first block's hash so that only requests with the same salt share KV.
    pub cache_salt: u64,
    /// Prompt tokens served from the prefix cache at first admission.
    pub num_cached_tokens: u32,
    /// The first output (which carries `num_cached_tokens`) was sent.
    pub reported_first: bool,
    /// Arrival at the engine, first admission and first committed token: the request's
    /// queue, prefill and decode times ([`Request::timing`]). Read only for reporting.
    pub arrived_at: Instant,
    pub first_scheduled_at: Option<Instant>,
    pub first_token_at: Option<Instant>,
    /// Speculative decoding: proposals verified for this request and those accepted.
    pub spec_draft_tokens: u32,
    pub spec_accepted_tokens: u32,
    /// Structured outputs: the compiled constraint, advanced with every committed token.
    pub grammar: Option<crate::structured::Grammar>,
}

impl Request {
    pub fn new(
        id: RequestId,
        origin: Origin,
        external_id: String,
        prompt: Vec<TokenId>,
        sampling: SamplingParams,
        seed: u64,
    ) -> Self {
        Self {
            id,
            origin,
            external_id,
            prompt,
            output: Vec::new(),
            sampling,
            seed,
            status: RequestStatus::Waiting,
            finalized: false,
            inflight_refs: 0,
            pending_samples: 0,
            num_computed_tokens: 0,
            row: None,
            decoding: false,
            blocks: Vec::new(),
            local_blocks: Vec::new(),
            local_released: 0,
            block_hashes: Vec::new(),
            num_registered_blocks: 0,
            cache_salt: 0,
            num_cached_tokens: 0,
            reported_first: false,
            arrived_at: Instant::now(),
            first_scheduled_at: None,
            first_token_at: None,
            spec_draft_tokens: 0,
            spec_accepted_tokens: 0,
            grammar: None,
        }
    }

    /// The request's queue, prefill and decode times as of `now` (a phase not reached is 0).
    pub fn timing(&self, now: Instant) -> RequestTiming {
        let scheduled = self.first_scheduled_at.unwrap_or(now);
        let first_token = self.first_token_at.unwrap_or(now).max(scheduled);
        RequestTiming {
            queue_s: (scheduled - self.arrived_at).as_secs_f32(),
            prefill_s: (first_token - scheduled).as_secs_f32(),
            decode_s: (now.max(first_token) - first_token).as_secs_f32(),
        }
    }

    /// Prompt plus committed output.
    pub fn host_len(&self) -> u32 {
        (self.prompt.len() + self.output.len()) as u32
    }

    /// Length once every launched step has completed.
    pub fn known_len(&self) -> u32 {
        self.host_len() + self.pending_samples
    }

    /// Output tokens committed plus in flight: what `max_tokens` is checked against.
    pub fn budgeted_output(&self) -> u32 {
        self.output.len() as u32 + self.pending_samples
    }

    /// The token at `index` of the committed sequence (prompt then output).
    pub fn token_at(&self, index: usize) -> TokenId {
        if index < self.prompt.len() {
            self.prompt[index]
        } else {
            self.output[index - self.prompt.len()]
        }
    }

    /// Token ids of the sequence's block `i` (prompt then output; must be host-known).
    pub fn block_tokens(&self, i: usize, block_size: usize) -> std::borrow::Cow<'_, [TokenId]> {
        let (start, end) = (i * block_size, (i + 1) * block_size);
        let p = self.prompt.len();
        if end <= p {
            std::borrow::Cow::Borrowed(&self.prompt[start..end])
        } else if start >= p {
            std::borrow::Cow::Borrowed(&self.output[start - p..end - p])
        } else {
            std::borrow::Cow::Owned(
                self.prompt[start..]
                    .iter()
                    .chain(&self.output[..end - p])
                    .copied()
                    .collect(),
            )
        }
    }

    pub fn is_zombie(&self) -> bool {
        self.finalized && self.inflight_refs > 0
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn request() -> Request {
        Request::new(
            RequestId(1),
            Origin(0),
            "r1".into(),
            vec![1, 2, 3],
            SamplingParams::greedy(4),
            0,
        )
    }

    #[test]
    fn timing_splits_queue_prefill_and_decode() {
        let mut r = request();
        let t0 = r.arrived_at;
        let ms = Duration::from_millis;
        // Never admitted (aborted while waiting): all of it is queue time.
        let t = r.timing(t0 + ms(30));
        assert_eq!((t.queue_s, t.prefill_s, t.decode_s), (0.03, 0.0, 0.0));
        r.first_scheduled_at = Some(t0 + ms(10));
        let t = r.timing(t0 + ms(30));
        assert_eq!((t.queue_s, t.prefill_s, t.decode_s), (0.01, 0.02, 0.0));
        r.first_token_at = Some(t0 + ms(25));
        let t = r.timing(t0 + ms(125));
        assert_eq!((t.queue_s, t.prefill_s, t.decode_s), (0.01, 0.015, 0.1));
        // The phases always add up to the time since arrival.
        let total = t.queue_s + t.prefill_s + t.decode_s;
        assert!((total - 0.125).abs() < 1e-6, "{total}");
    }
}
