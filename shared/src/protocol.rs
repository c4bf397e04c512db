//! Messages exchanged between front ends and the engine core.
//!
//! Every frame on the wire is one of two enums, MessagePack-encoded with
//! `rmp-serde` (see [`crate::codec`]): [`FrontendMessage`] (front end -> engine)
//! and [`EngineMessage`] (engine -> front end). Both are tagged enums of typed
//! structs; nothing is dispatched by strings.
//!
//! The start-up handshake is `FrontendMessage::Hello` answered by
//! `EngineMessage::Welcome` (or `Rejected` on a protocol-version mismatch).
//! The engine never sees text: requests and outputs carry token ids only.

use serde::{Deserialize, Serialize};

/// Bumped on every incompatible change of the types in this module.
pub const PROTOCOL_VERSION: u32 = 5;

/// The most tokens a speculative decoding round may propose (`--num-speculative-tokens`).
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

/// Token id as the model sees it (model vocabularies may exceed the tokenizer's).
pub type TokenId = u32;

/// A front end -> engine frame.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum FrontendMessage {
    /// First frame from every front end; the engine answers `Welcome` or `Rejected`.
    Hello(Hello),
    /// Submit a request.
    Request(EngineCoreRequest),
    /// Abort requests (by the front end's ids); their KV blocks are freed at once.
    Abort(Abort),
    /// A utility call; answered by `EngineMessage::UtilityReply` with the same `call_id`.
    Utility(UtilityRequest),
    /// Sent periodically by a live front end; an engine that hears nothing from a front end
    /// for a few seconds treats it as dead and aborts its requests.
    Heartbeat,
    /// The front end is going away: abort everything it sent.
    Goodbye,
}

/// An engine -> front end frame.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum EngineMessage {
    Welcome(EngineInfo),
    Rejected(Rejected),
    /// All outputs of one engine step for this front end (never one frame per token).
    Outputs(EngineCoreOutputs),
    UtilityReply(UtilityReply),
    /// Sent periodically (and when idle) so a front end can tell a live engine from a dead one.
    Heartbeat(EngineStats),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    pub protocol_version: u32,
    /// Human-readable name for logs (e.g. `frontend-0/pid-1234`).
    pub name: String,
}

/// What a front end needs to know about the engine it talks to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineInfo {
    pub protocol_version: u32,
    pub engine_version: String,
    pub model_name: String,
    pub max_model_len: u32,
    /// The model's vocabulary size (may be larger than the tokenizer's: padded vocabularies).
    pub vocab_size: u32,
    pub eos_token_ids: Vec<TokenId>,
    pub limits: EngineLimits,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EngineLimits {
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
    pub max_logprobs: u32,
    pub block_size: u32,
    pub num_kv_blocks: u32,
    /// Tokens proposed per speculative decoding round (0: speculation off).
    pub num_speculative_tokens: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rejected {
    pub engine_protocol_version: u32,
    pub reason: String,
}

/// One generation request, in token ids.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineCoreRequest {
    /// Unique among the requests of the front end that sent it.
    pub request_id: String,
    pub prompt_token_ids: Vec<TokenId>,
    pub sampling: SamplingParams,
    /// Seconds since the Unix epoch when the front end received the request.
    pub arrival_time: f64,
    /// Only requests with the same salt share prefix-cache blocks (e.g. one salt per tenant).
    #[serde(default)]
    pub cache_salt: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Abort {
    pub request_ids: Vec<String>,
}

/// Sampling and stopping parameters of one request. Defaults are OpenAI's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// In (0, 1]; 1 disables.
    pub top_p: f32,
    /// `None` disables.
    pub top_k: Option<u32>,
    /// In [0, 1]; 0 disables.
    pub min_p: f32,
    /// Same seed, same tokens, whatever the request's batch mates. `None`: the engine picks one.
    pub seed: Option<u64>,
    /// OpenAI presence penalty in [-2, 2], applied over output tokens.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty in [-2, 2], applied over output tokens.
    pub frequency_penalty: f32,
    /// HF/vLLM repetition penalty (> 0; 1 disables), over prompt and output tokens.
    pub repetition_penalty: f32,
    /// Maximum number of generated tokens (>= 1).
    pub max_tokens: u32,
    /// EOS and stop ids are ignored until this many tokens were generated.
    pub min_tokens: u32,
    pub stop_token_ids: Vec<TokenId>,
    pub ignore_eos: bool,
    /// Return the log-probability of each sampled token and this many top alternatives.
    pub logprobs: Option<u32>,
    /// OpenAI `logit_bias`: (token id, bias in [-100, 100]) added to the logits before
    /// sampling; sorted by token id, each id once.
    #[serde(default)]
    pub logit_bias: Vec<(TokenId, f32)>,
    /// Constrain the output to a JSON schema, a regex, one of several strings or a grammar.
    /// (Boxed: rare, and it would double the size of every request message.)
    #[serde(default)]
    pub structured: Option<Box<StructuredOutput>>,
}

/// An output constraint (OpenAI's `response_format`, vLLM's `structured_outputs`). The engine
/// compiles it with llguidance and masks every step's logits to the tokens it allows.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StructuredOutput {
    /// Text matching a JSON schema (the schema's JSON text).
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    /// Text matching a regular expression (Rust `regex` syntax), whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// Text of a grammar in llguidance's Lark dialect.
    Grammar(String),
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            max_tokens: 16,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            logit_bias: Vec::new(),
            structured: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of `max_tokens` tokens.
    pub fn greedy(max_tokens: u32) -> Self {
        Self {
            temperature: 0.0,
            max_tokens,
            ..Self::default()
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature < 1e-5
    }

    /// Checks the ranges both the engine and the front end enforce.
    pub fn validate(&self, max_logprobs: u32) -> Result<(), ParamError> {
        let Self {
            temperature,
            top_p,
            top_k,
            min_p,
            seed: _,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            max_tokens,
            min_tokens,
            stop_token_ids: _,
            ignore_eos: _,
            logprobs,
            logit_bias,
            structured,
        } = self;
        let bad = |param: &'static str, message: String| Err(ParamError { param, message });
        if let Some(StructuredOutput::Choice(c)) = structured.as_deref() {
            if c.is_empty() {
                return bad(
                    "structured_outputs",
                    "a choice constraint needs at least one choice".into(),
                );
            }
        }
        if !(temperature.is_finite() && *temperature >= 0.0) {
            return bad(
                "temperature",
                format!("temperature must be >= 0, got {temperature}"),
            );
        }
        if !(top_p.is_finite() && *top_p > 0.0 && *top_p <= 1.0) {
            return bad("top_p", format!("top_p must be in (0, 1], got {top_p}"));
        }
        if *top_k == Some(0) {
            return bad(
                "top_k",
                "top_k must be >= 1 (or -1 to disable), got 0".into(),
            );
        }
        if !(min_p.is_finite() && (0.0..=1.0).contains(min_p)) {
            return bad("min_p", format!("min_p must be in [0, 1], got {min_p}"));
        }
        if !(presence_penalty.is_finite() && (-2.0..=2.0).contains(presence_penalty)) {
            return bad(
                "presence_penalty",
                format!("presence_penalty must be in [-2, 2], got {presence_penalty}"),
            );
        }
        if !(frequency_penalty.is_finite() && (-2.0..=2.0).contains(frequency_penalty)) {
            return bad(
                "frequency_penalty",
                format!("frequency_penalty must be in [-2, 2], got {frequency_penalty}"),
            );
        }
        if !(repetition_penalty.is_finite() && *repetition_penalty > 0.0) {
            return bad(
                "repetition_penalty",
                format!("repetition_penalty must be > 0, got {repetition_penalty}"),
            );
        }
        if *max_tokens < 1 {
            return bad("max_tokens", "max_tokens must be at least 1".into());
        }
        if min_tokens > max_tokens {
            return bad(
                "min_tokens",
                format!("min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})"),
            );
        }
        if logit_bias.len() > MAX_LOGIT_BIAS {
            return bad(
                "logit_bias",
                format!(
                    "at most {MAX_LOGIT_BIAS} logit_bias entries are allowed, got {}",
                    logit_bias.len()
                ),
            );
        }
        if let Some((t, b)) = logit_bias
            .iter()
            .find(|(_, b)| !(b.is_finite() && (-100.0..=100.0).contains(b)))
        {
            return bad(
                "logit_bias",
                format!("logit_bias values must be in [-100, 100], got {b} for token {t}"),
            );
        }
        if logit_bias.windows(2).any(|w| w[0].0 >= w[1].0) {
            return bad(
                "logit_bias",
                "logit_bias must be sorted by token id, each id once".into(),
            );
        }
        if let Some(n) = logprobs {
            if *n > max_logprobs {
                return bad(
                    "logprobs",
                    format!("at most {max_logprobs} logprobs may be requested, got {n}"),
                );
            }
        }
        Ok(())
    }
}

/// Most `logit_bias` entries one request may carry.
pub const MAX_LOGIT_BIAS: usize = 1024;

/// A sampling parameter out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ParamError {
    pub param: &'static str,
    pub message: String,
}

/// All outputs of one engine step for one front end.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineCoreOutputs {
    /// Engine step counter (monotonic); lets a front end see that outputs are batched per step.
    /// 0 on the `abort` the engine core's socket side sends for a request that arrives during
    /// its shutdown (no step produced it).
    pub step: u64,
    pub outputs: Vec<RequestOutput>,
    pub stats: EngineStats,
}

/// New tokens (and possibly the end) of one request in one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestOutput {
    pub request_id: String,
    pub new_token_ids: Vec<TokenId>,
    /// One entry per new token when the request asked for logprobs.
    pub logprobs: Option<Vec<TokenLogprobs>>,
    pub finish: Option<Finish>,
    /// Prompt tokens served from the prefix cache; set on the request's first output.
    pub num_cached_tokens: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Finish {
    pub reason: FinishReason,
    /// The EOS or stop token that ended the request (it is also the last of `new_token_ids`).
    pub stop_token: Option<TokenId>,
    /// For `FinishReason::Error`: what went wrong.
    pub message: Option<String>,
    /// Where the request's time went inside the engine core (set by the engine when it
    /// finishes a request it had queued).
    pub timing: Option<RequestTiming>,
    /// With speculative decoding on: the request's proposals and accepted proposals.
    pub spec: Option<SpecDecodeCounts>,
}

/// One request's speculative decoding (reference 003, D9): proposals verified for it and
/// proposals accepted (the acceptance rate is their ratio).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SpecDecodeCounts {
    pub draft_tokens: u32,
    pub accepted_tokens: u32,
}

/// A finished request's time inside the engine core, in seconds (vLLM's request queue, prefill
/// and decode times): arrival at the engine to first admission, first admission to the first
/// committed output token, first output token to the finish. A phase the request never
/// reached counts 0.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct RequestTiming {
    pub queue_s: f32,
    pub prefill_s: f32,
    pub decode_s: f32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FinishReason {
    Stop,
    Length,
    Abort,
    Error,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }
}

/// Log-probability of the sampled token and the top alternatives, from the raw model logits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    pub token_id: TokenId,
    pub logprob: f32,
    /// Rank of the sampled token among all tokens (1 = most likely).
    pub rank: u32,
    /// The top-n tokens, most likely first.
    pub top: Vec<(TokenId, f32)>,
}

/// A snapshot of the engine's state, sent with every step's outputs and in heartbeats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    pub num_running: u32,
    pub num_waiting: u32,
    pub kv_blocks_used: u32,
    pub kv_blocks_total: u32,
    /// The sliding-window layers' own pool, when the engine keeps their KV window-sized
    /// (both 0 otherwise; `kv_blocks_*` are then the full-attention layers' pool).
    pub sliding_kv_blocks_used: u32,
    pub sliding_kv_blocks_total: u32,
    /// Duration of the last engine step (host launch to commit), in microseconds.
    pub last_step_us: u32,
    pub steps_total: u64,
    pub preemptions_total: u64,
    pub prefix_cache_queries_total: u64,
    pub prefix_cache_hits_total: u64,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    /// Decode steps replayed from a CUDA graph.
    pub graph_replays_total: u64,
    /// Decode-only steps launched eagerly (too large for every graph, or graphs off).
    pub eager_decode_steps_total: u64,
    /// Speculative decoding: rounds that verified at least one proposal, proposals verified,
    /// proposals accepted, and accepted proposals by position in the round.
    pub spec_drafts_total: u64,
    pub spec_draft_tokens_total: u64,
    pub spec_accepted_tokens_total: u64,
    pub spec_accepted_per_pos_total: [u64; MAX_SPECULATIVE_TOKENS],
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UtilityRequest {
    pub call_id: u64,
    pub call: UtilityCall,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum UtilityCall {
    Health,
    Stats,
    /// Stop launching steps; the reply comes once every in-flight step is committed.
    Pause,
    Resume,
    /// Forget every cached block hash (safe at any time: blocks in use keep their KV).
    ResetPrefixCache,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UtilityReply {
    pub call_id: u64,
    pub result: UtilityResult,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum UtilityResult {
    Health {
        healthy: bool,
    },
    Stats(Box<EngineStats>),
    /// The call (pause, resume, reset) took effect.
    Done,
    Error(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logit_bias_is_checked() {
        let with = |b: Vec<(TokenId, f32)>| {
            SamplingParams {
                logit_bias: b,
                ..SamplingParams::default()
            }
            .validate(20)
            .map_err(|e| e.param)
        };
        assert_eq!(with(vec![(1, -100.0), (5, 100.0)]), Ok(()));
        assert_eq!(with(vec![(1, 100.5)]), Err("logit_bias"));
        assert_eq!(with(vec![(1, f32::NAN)]), Err("logit_bias"));
        assert_eq!(with(vec![(5, 1.0), (1, 1.0)]), Err("logit_bias"));
        assert_eq!(with(vec![(1, 1.0), (1, 2.0)]), Err("logit_bias"));
        let many = (0..=MAX_LOGIT_BIAS as u32).map(|t| (t, 0.0)).collect();
        assert_eq!(with(many), Err("logit_bias"));
    }
}
