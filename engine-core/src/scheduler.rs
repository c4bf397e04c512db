//! The scheduler: which requests run in the next step, and how many tokens each.
//!
//! How it thinks (as vLLM v1): there are no prefill and decode phases. Each request has a
//! known length (prompt + output, plus tokens sampled by in-flight steps) and a number of
//! computed tokens; a step lets computed tokens catch up. A decoding request needs one token
//! (its input is the token its row sampled last, still on the device); a prefilling or
//! recomputing request needs a chunk of host-known tokens.
//!
//! [`Scheduler::schedule`] is a *pure selector*: it reads state and returns a [`Decision`]
//! without mutating anything. [`Scheduler::apply`] then performs the plan (admissions,
//! preemptions, block allocation, `inflight_refs`) while writing the step's [`ExecBatch`];
//! [`Scheduler::commit`] consumes the step's sampled tokens in FIFO order.
//!
//! Selection order within the token budget (`max_num_batched_tokens`), with the default
//! [`SchedulingPolicy::DecodeFirst`]:
//! 1. running requests that decode, oldest admission first (one token each);
//! 2. running requests in the middle of a chunked prefill (or recompute);
//! 3. waiting requests, strictly FIFO, while a row (`max_num_seqs`, zombies included), token
//!    budget and KV blocks remain.
//!
//! When a running request needs a KV block and none is free, the most recently admitted
//! running request is preempted (recompute: its blocks are freed and it goes back to the head
//! of the waiting queue; its output so far is kept and never re-sent).
//!
//! Run-ahead rules (reference 000 §4.5, §4.7):
//! - a request is dispatchable while `inflight_refs < depth`, it is not finalized, and its
//!   *budgeted* counts (committed + in flight) stay below `max_tokens` and `max_model_len`;
//! - a plan that admits, prefills or preempts requires a drained pipeline (I5); otherwise the
//!   decision is [`Decision::DrainFirst`] and the engine commits in-flight steps first, so a
//!   waiting request starts within two step completions;
//! - finished requests still inside a launched step (zombies) keep their row and blocks until
//!   their last in-flight step is committed; capacity counts them.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use harrier_shared::protocol::{Finish, FinishReason, RequestOutput, SpecDecodeCounts, TokenId};

use crate::batch::{ExecBatch, RowId, RowInit, SeqInput, StepOutput};
use crate::kv::{BlockId, BlockManager, SCRATCH_BLOCK};
use crate::request::{Origin, Request, RequestId, RequestStatus};

#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
    pub max_model_len: u32,
    pub block_size: u32,
    pub num_kv_blocks: u32,
    /// Most in-flight steps a request may be part of (the pipeline depth).
    pub max_inflight_refs: u8,
    pub eos_token_ids: Vec<TokenId>,
    pub enable_prefix_caching: bool,
    pub policy: SchedulingPolicy,
    /// Speculative decoding: tokens proposed per decode round (0: off). See
    /// [`Scheduler::spec_len`] for how a round is booked.
    pub num_speculative_tokens: u32,
    /// Speculation pays only while decode steps are small: with more than this many requests
    /// decoding, rounds propose nothing (vLLM's `speculative_disable_by_batch_size`). The
    /// price: while the rule switches with load, a seeded request's text depends on it.
    pub spec_disable_batch_size: Option<u32>,
    /// Window-sized KV for sliding-window layers (Gemma 3); `None`: one pool for every layer.
    pub local_kv: Option<LocalKvConfig>,
}

/// The sliding-window layers' own block pool (vLLM's hybrid KV cache manager, two groups).
///
/// A request holds two block tables: the full-attention layers' (`Request::blocks`, one block
/// per `block_size` positions as ever) and the sliding layers' (`Request::local_blocks`). A
/// token at position `p` of a sliding layer reads positions `p - window + 1 ..= p` only, so the
/// local table's leading blocks that no token at or after the request's next position can see
/// are given back to the pool when the request's next step is applied (the step before it
/// still reads them, but it runs first on the same stream, and whoever gets the block next
/// writes it in a later step). Such entries become the scratch block. A long request thus holds
/// about `window / block_size + 1` local blocks plus its current chunk's.
///
/// Prefix caching covers both pools with the same chained block hashes: a cache hit of `h`
/// blocks counts only if the local pool still holds the blocks of the window before position
/// `h * block_size` (the local table then starts with scratch entries up to there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalKvConfig {
    pub window: u32,
    /// Blocks of the local pool (block 0 is its scratch block).
    pub num_blocks: u32,
}

impl LocalKvConfig {
    /// The smallest pool that lets one request decode: its window, the block its next token
    /// opens, a misaligned window's extra block, and the scratch block.
    pub fn min_blocks(window: u32, block_size: u32) -> u32 {
        window.div_ceil(block_size) + 3
    }
}

/// Leading blocks of a sliding-window table that no token at a position `>= pos` can see.
pub fn local_dead_blocks(pos: u32, window: u32, block_size: u32) -> u32 {
    (pos + 1).saturating_sub(window) / block_size
}

/// The sliding-window layers' pool with its window ([`LocalKvConfig`]).
#[derive(Debug, Clone)]
struct LocalPool {
    kv: BlockManager,
    window: u32,
}

impl LocalPool {
    /// The first block of the window a token at position `h * block_size` reads: the local
    /// table of a request admitted with `h` cached blocks starts with scratch entries up to it.
    fn hit_window_start(&self, h: u32) -> u32 {
        let bs = self.kv.block_size();
        local_dead_blocks(h * bs, self.window, bs).min(h)
    }

    /// Leading entries of `r`'s local table that no token at a position `>= pos` reads.
    fn dead(&self, r: &Request, pos: u32) -> u32 {
        local_dead_blocks(pos, self.window, self.kv.block_size()).min(r.local_blocks.len() as u32)
    }

    /// Blocks to allocate and (unshared) blocks given back when `r` computes positions
    /// `pos .. pos + n`.
    fn step(&self, r: &Request, pos: u32, n: u32) -> (u32, u32) {
        let alloc = self
            .kv
            .blocks_for(pos + n)
            .saturating_sub(r.local_blocks.len() as u32);
        let dead = self.dead(r, pos) as usize;
        let released = (r.local_released as usize).min(dead);
        (
            alloc,
            self.kv.count_unshared(&r.local_blocks[released..dead]),
        )
    }

    /// Gives back the entries no token of `r`'s next step (at its computed length) reads.
    fn release_dead(&mut self, r: &mut Request) {
        let dead = self.dead(r, r.num_computed_tokens);
        for i in r.local_released..dead {
            let b = std::mem::replace(&mut r.local_blocks[i as usize], SCRATCH_BLOCK);
            self.kv.release(b);
        }
        r.local_released = r.local_released.max(dead);
    }
}

/// Which work gets the token budget first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum SchedulingPolicy {
    /// Decodes first, prefill chunks fill the rest of the budget (vLLM v1; the default).
    #[default]
    DecodeFirst,
    /// Prefills first; a step with any prefill carries no decodes (reference 004 §1).
    PrefillFirst,
}

/// One request's share of a planned step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Planned {
    pub id: RequestId,
    pub num_tokens: u32,
    /// Admitted from the waiting queue by this step.
    pub admit: bool,
    /// For admissions: leading blocks served from the prefix cache.
    pub cached_blocks: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub entries: Vec<Planned>,
    /// Running requests to preempt before the step (most recently admitted first).
    pub preempt: Vec<RequestId>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Nothing can run now.
    Idle,
    /// Work is wanted that needs a drained pipeline (admission, prefill, preemption).
    DrainFirst,
    Launch(StepPlan),
}

/// A request's membership in a launched step, in the step's sequence order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepEntry {
    pub id: RequestId,
    pub num_tokens: u32,
    pub sample: bool,
    /// Output tokens booked for the step (`pending_samples` it added): 0 without a sample,
    /// 1 for a plain sample, `1 + draft` for a speculative round (an upper bound).
    pub booked: u32,
}

/// Counters reported in the engine's stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerCounters {
    pub preemptions: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    /// Prompt tokens looked up in the prefix cache at admission, and those found.
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub spec: SpecCounters,
}

/// Speculative decoding counters (vLLM's `spec_decode_*` series).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecCounters {
    /// Rounds that verified at least one proposal.
    pub drafts: u64,
    /// Proposals verified.
    pub draft_tokens: u64,
    /// Proposals accepted.
    pub accepted_tokens: u64,
    /// Proposals accepted at each position of a round (position 0 first).
    pub accepted_per_pos: [u64; MAX_SPECULATIVE_TOKENS],
}

/// The most tokens a round may propose (`--num-speculative-tokens`).
pub const MAX_SPECULATIVE_TOKENS: usize = harrier_shared::protocol::MAX_SPECULATIVE_TOKENS;

#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    requests: HashMap<RequestId, Request>,
    waiting: VecDeque<RequestId>,
    /// Admission order: the tail is preempted first.
    running: Vec<RequestId>,
    kv: BlockManager,
    /// The sliding-window layers' pool (`cfg.local_kv`).
    local: Option<LocalPool>,
    free_rows: Vec<RowId>,
    counters: SchedulerCounters,
    /// Requests with a structured-output grammar (token masks are computed only when some).
    num_constrained: usize,
}

/// Outputs produced by scheduler transitions, tagged with the front end to send them to.
pub type OutputSink = Vec<(Origin, RequestOutput)>;

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Self {
        let kv = BlockManager::new(cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching);
        let local = cfg.local_kv.map(|l| LocalPool {
            kv: BlockManager::new(l.num_blocks, cfg.block_size, cfg.enable_prefix_caching),
            window: l.window,
        });
        let free_rows = (0..cfg.max_num_seqs).rev().map(RowId).collect();
        Self {
            cfg,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            kv,
            local,
            free_rows,
            counters: SchedulerCounters::default(),
            num_constrained: 0,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests known to the scheduler, zombies included.
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// Rows held (running requests and zombies): the capacity measure (reference 000 §4.5).
    pub fn num_allocated_rows(&self) -> u32 {
        self.cfg.max_num_seqs - self.free_rows.len() as u32
    }

    pub fn kv(&self) -> &BlockManager {
        &self.kv
    }

    /// The sliding-window layers' pool, when the engine keeps their KV window-sized.
    pub fn local_kv(&self) -> Option<&BlockManager> {
        self.local.as_ref().map(|l| &l.kv)
    }

    /// Local blocks to allocate and given back for `r` computing `pos .. pos + n` (0, 0
    /// without a local pool).
    fn local_step(&self, r: &Request, pos: u32, n: u32) -> (u32, u32) {
        self.local.as_ref().map_or((0, 0), |l| l.step(r, pos, n))
    }

    pub fn counters(&self) -> SchedulerCounters {
        self.counters
    }

    pub fn request(&self, id: RequestId) -> Option<&Request> {
        self.requests.get(&id)
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Forgets every cached block hash (see [`BlockManager::reset_cache`]).
    pub fn reset_prefix_cache(&mut self) {
        self.kv.reset_cache();
        if let Some(local) = &mut self.local {
            local.kv.reset_cache();
        }
    }

    /// Queues a validated request.
    pub fn add(&mut self, mut request: Request) {
        self.num_constrained += request.grammar.is_some() as usize;
        let id = request.id;
        debug_assert!(!self.requests.contains_key(&id), "duplicate request id");
        extend_block_hashes(&self.kv, &mut request);
        self.waiting.push_back(id);
        self.requests.insert(id, request);
    }

    fn can_dispatch(&self, r: &Request) -> bool {
        // A constrained row's mask needs its previous token: no run-ahead for it.
        let depth = if r.grammar.is_some() {
            1
        } else {
            self.cfg.max_inflight_refs
        };
        !r.finalized
            && r.inflight_refs < depth
            && r.known_len() < self.cfg.max_model_len
            && r.budgeted_output() < r.sampling.max_tokens
    }

    /// Proposals in a decode round: always `num_speculative_tokens` (0: plain decoding).
    ///
    /// A round books `1 + k` output tokens and KV positions before anyone knows how many will
    /// be accepted (reference 001: placeholders for a round in flight); `max_tokens` and
    /// `max_model_len` are checked against these upper bounds when a round is dispatched,
    /// and [`Self::commit`] drops whatever a round produced past either limit, so neither is
    /// ever overshot. `k` is *not* shrunk near the limits (reference 003's overflow guard
    /// does that): the host cannot know the exact count while a round is in flight, so a
    /// shrunk `k` would depend on pipeline timing and batch mates, and with it which draw
    /// produces each token: a seeded request's text would change with its batch mates.
    /// With a fixed `k` round boundaries depend on the request alone. The cost: a request's
    /// last round may compute up to `k` positions past its end (their tokens are dropped),
    /// and its KV may reach `k` positions past `max_model_len` (the pool is checked for it).
    /// A row that does not fit the step's token budget waits for the next step instead of
    /// proposing fewer.
    ///
    /// The KV blocks of positions a round leaves unused (rejected proposals) stay with the
    /// request and are written by its next round, so rollback never frees or reallocates a
    /// block and the backend's block tables only grow (reference 003, Risks 5: stale entries
    /// are overwritten).
    pub fn spec_len(&self) -> u32 {
        self.cfg.num_speculative_tokens
    }

    /// Decodes when the row sampled the sequence's last token; otherwise the chunk of
    /// host-known tokens still to compute.
    fn host_tokens_left(r: &Request) -> u32 {
        if r.decoding {
            0
        } else {
            r.host_len() - r.num_computed_tokens
        }
    }

    /// Chooses the next step. Pure: mutates nothing.
    pub fn schedule(&self, drained: bool) -> Decision {
        let mut p = Planner {
            s: self,
            drained,
            budget: self.cfg.max_num_batched_tokens,
            free_blocks: self.kv.num_free(),
            free_local: self.local.as_ref().map_or(0, |l| l.kv.num_free()),
            free_rows: self.free_rows.len() as u32,
            tail: self.running.len(),
            needs_drain: false,
            plan: StepPlan::default(),
        };
        match self.cfg.policy {
            SchedulingPolicy::DecodeFirst => {
                p.decodes();
                p.chunks();
                p.admissions();
            }
            SchedulingPolicy::PrefillFirst => {
                p.chunks();
                p.admissions();
                if p.plan.entries.is_empty() {
                    p.decodes();
                }
            }
        }
        let Planner {
            needs_drain, plan, ..
        } = p;
        if needs_drain && !drained {
            Decision::DrainFirst
        } else if plan.entries.is_empty() && plan.preempt.is_empty() {
            Decision::Idle
        } else {
            Decision::Launch(plan)
        }
    }

    /// Performs `plan`: preemptions, admissions, block allocation and `inflight_refs`, writing
    /// the step's batch and its membership record. Called only with a plan from
    /// [`Self::schedule`] on unchanged state.
    pub fn apply(&mut self, plan: &StepPlan, batch: &mut ExecBatch, record: &mut Vec<StepEntry>) {
        batch.clear();
        record.clear();
        for &victim in &plan.preempt {
            self.preempt(victim);
        }
        // Admissions take their cache hits before any allocation of this step can evict them.
        for p in plan.entries.iter().filter(|p| p.admit) {
            self.admit(p.id, p.cached_blocks, batch);
        }
        // Sliding-window blocks no token of these steps can see go back before anything is
        // allocated (the planner counted them free).
        if let Some(local) = &mut self.local {
            for p in &plan.entries {
                let r = self
                    .requests
                    .get_mut(&p.id)
                    .expect("planned request exists");
                local.release_dead(r);
            }
        }
        for p in &plan.entries {
            let r = self
                .requests
                .get_mut(&p.id)
                .expect("planned request exists");
            let row = r.row.expect("running request has a row");
            let position = r.num_computed_tokens;
            let decode = r.decoding;
            let (host_start, host_len) = if decode {
                debug_assert!(p.num_tokens >= 1);
                (batch.host_tokens.len() as u32, 0)
            } else {
                let start = batch.host_tokens.len() as u32;
                for i in position..position + p.num_tokens {
                    batch.host_tokens.push(r.token_at(i as usize));
                }
                (start, p.num_tokens)
            };
            let blocks_start = batch.new_blocks.len() as u32;
            // A freshly initialised row knows none of its blocks (cache hits included).
            let before = if p.admit { 0 } else { r.blocks.len() };
            let need = self
                .kv
                .blocks_for(position + p.num_tokens)
                .saturating_sub(r.blocks.len() as u32);
            self.kv
                .allocate(need, &mut r.blocks)
                .expect("planned blocks are free");
            batch
                .new_blocks
                .extend(r.blocks[before..].iter().map(|b| b.0));
            let mut local_blocks_len = 0;
            if let Some(local) = &mut self.local {
                let before = if p.admit { 0 } else { r.local_blocks.len() };
                let need = local
                    .kv
                    .blocks_for(position + p.num_tokens)
                    .saturating_sub(r.local_blocks.len() as u32);
                local
                    .kv
                    .allocate(need, &mut r.local_blocks)
                    .expect("planned local blocks are free");
                batch
                    .new_blocks
                    .extend(r.local_blocks[before..].iter().map(|b| b.0));
                local_blocks_len = (r.local_blocks.len() - before) as u32;
            }
            r.num_computed_tokens += p.num_tokens;
            // A decode (plain or speculative) always samples and books 1 + draft outputs; a
            // chunk samples when it reaches the end of the known sequence.
            let sample = decode || r.num_computed_tokens == r.known_len();
            let booked = match (decode, sample) {
                (true, _) => p.num_tokens,
                (false, true) => 1,
                (false, false) => 0,
            };
            if sample {
                r.pending_samples += booked;
                r.decoding = true;
            }
            r.inflight_refs += 1;
            debug_assert!(
                r.inflight_refs <= self.cfg.max_inflight_refs,
                "I4: inflight_refs above depth"
            );
            register_computed_blocks(&mut self.kv, self.local.as_mut().map(|l| &mut l.kv), r);
            batch.seqs.push(SeqInput {
                row,
                position,
                num_tokens: p.num_tokens,
                host_start,
                host_len,
                blocks_start,
                blocks_len: (r.blocks.len() - before) as u32,
                local_blocks_len,
                sample,
                draft: if decode { p.num_tokens - 1 } else { 0 },
            });
            record.push(StepEntry {
                id: p.id,
                num_tokens: p.num_tokens,
                sample,
                booked,
            });
        }
    }

    fn admit(&mut self, id: RequestId, cached_blocks: u32, batch: &mut ExecBatch) {
        let front = self.waiting.pop_front();
        debug_assert_eq!(front, Some(id), "admission is FIFO");
        let row = self.free_rows.pop().expect("planned row is free");
        let r = self.requests.get_mut(&id).expect("waiting request exists");
        debug_assert!(r.blocks.is_empty());
        self.kv
            .acquire_cached(&r.block_hashes[..cached_blocks as usize], &mut r.blocks);
        if let Some(local) = &mut self.local {
            // The window before the hit point, from the local pool (the planner checked it is
            // cached); blocks before it are scratch entries.
            debug_assert!(r.local_blocks.is_empty());
            let lo = local.hit_window_start(cached_blocks);
            r.local_blocks.resize(lo as usize, SCRATCH_BLOCK);
            local.kv.acquire_cached(
                &r.block_hashes[lo as usize..cached_blocks as usize],
                &mut r.local_blocks,
            );
            r.local_released = lo;
        }
        r.num_computed_tokens = cached_blocks * self.cfg.block_size;
        r.num_registered_blocks = cached_blocks;
        if self.cfg.enable_prefix_caching {
            self.counters.prefix_cache_queries += r.host_len() as u64;
            self.counters.prefix_cache_hits += r.num_computed_tokens as u64;
        }
        if r.status == RequestStatus::Waiting {
            self.counters.prompt_tokens += r.prompt.len() as u64;
            r.num_cached_tokens = r.num_computed_tokens;
        }
        r.status = RequestStatus::Running;
        r.first_scheduled_at.get_or_insert_with(Instant::now);
        r.row = Some(row);
        r.decoding = false;
        let mut mask = r.sampling.stop_token_ids.clone();
        if !r.sampling.ignore_eos {
            mask.extend_from_slice(&self.cfg.eos_token_ids);
        }
        batch.row_inits.push(RowInit {
            row,
            sampling: r.sampling.clone(),
            seed: r.seed,
            min_tokens_mask: mask,
            prompt: r.prompt.clone(),
            output: r.output.clone(),
        });
        self.running.push(id);
    }

    fn preempt(&mut self, id: RequestId) {
        let r = self
            .requests
            .get_mut(&id)
            .expect("preempted request exists");
        assert_eq!(
            r.inflight_refs, 0,
            "I5: preemption only on a drained pipeline"
        );
        self.kv.free(&mut r.blocks);
        if let Some(local) = &mut self.local {
            local.kv.free(&mut r.local_blocks);
        }
        r.local_released = 0;
        if let Some(row) = r.row.take() {
            self.free_rows.push(row);
        }
        r.num_computed_tokens = 0;
        r.num_registered_blocks = 0;
        r.decoding = false;
        r.status = RequestStatus::Preempted;
        self.running.retain(|&x| x != id);
        self.waiting.push_front(id);
        self.counters.preemptions += 1;
    }

    /// Consumes one completed step (FIFO): commits sampled tokens, applies stop rules, skips
    /// zombies and releases requests whose last in-flight step this was.
    ///
    /// A speculative round's tokens are committed one by one with the stop rules applied to
    /// each: an EOS, stop id or length limit inside the round ends the request there and the
    /// rest of the round is dropped. The round's booking (`1 + draft` placeholders) is then
    /// replaced by what it produced: positions of rejected proposals are given back to
    /// `num_computed_tokens` (their KV is stale and will be overwritten).
    pub fn commit(&mut self, record: &[StepEntry], out: &StepOutput, sink: &mut OutputSink) {
        let mut k = 0;
        let mut at = 0;
        for e in record {
            let r = self
                .requests
                .get_mut(&e.id)
                .expect("in-flight request exists");
            debug_assert!(
                r.inflight_refs > 0,
                "I4: commit of a step the request is not in"
            );
            r.inflight_refs -= 1;
            if e.sample {
                let n = out.counts[k];
                // Tokens past max_tokens or max_model_len are dropped below (stop_reason).
                let proposed = out.proposed[k];
                let tokens = &out.tokens[at..at + n as usize];
                let logprobs = &out.logprobs[at..at + n as usize];
                k += 1;
                at += n as usize;
                debug_assert!(
                    n >= 1 && n <= e.booked,
                    "{n} tokens for {} booked",
                    e.booked
                );
                r.pending_samples -= e.booked;
                r.num_computed_tokens -= e.booked - n;
                if proposed > 0 {
                    let accepted = n - 1;
                    let c = &mut self.counters.spec;
                    c.drafts += 1;
                    c.draft_tokens += proposed as u64;
                    c.accepted_tokens += accepted as u64;
                    for a in &mut c.accepted_per_pos[..accepted as usize] {
                        *a += 1;
                    }
                    r.spec_draft_tokens += proposed;
                    r.spec_accepted_tokens += accepted;
                }
                if !r.finalized {
                    let mut output = RequestOutput {
                        request_id: r.external_id.clone(),
                        new_token_ids: Vec::with_capacity(n as usize),
                        logprobs: None,
                        finish: None,
                        num_cached_tokens: (!r.reported_first).then_some(r.num_cached_tokens),
                    };
                    let mut finish = None;
                    for (&token, lp) in tokens.iter().zip(logprobs) {
                        r.output.push(token);
                        output.new_token_ids.push(token);
                        if let Some(lp) = lp {
                            output
                                .logprobs
                                .get_or_insert_with(Vec::new)
                                .push(lp.clone());
                        }
                        self.counters.generation_tokens += 1;
                        finish = stop_reason(r, token, &self.cfg);
                        if finish.is_none() {
                            finish = advance_grammar(r, token);
                        }
                        if finish.is_some() {
                            break;
                        }
                    }
                    r.first_token_at.get_or_insert_with(Instant::now);
                    extend_block_hashes(&self.kv, r);
                    register_computed_blocks(
                        &mut self.kv,
                        self.local.as_mut().map(|l| &mut l.kv),
                        r,
                    );
                    r.reported_first = true;
                    sink.push((r.origin, output));
                    if let Some(finish) = finish {
                        self.finish(e.id, finish, sink, true);
                    }
                }
            }
            self.release_if_done(e.id);
        }
        debug_assert_eq!(k, out.counts.len(), "every sampled sequence consumed");
        debug_assert_eq!(at, out.tokens.len(), "every sampled token consumed");
    }

    /// The allowed-token masks of the constrained rows among `record`'s sampled entries (the
    /// step just applied), from their grammars' current states. The masks are computed in
    /// parallel (rayon): one 128k-token mask takes the better part of a millisecond, and the
    /// constrained rows of a batch would otherwise add up on the engine thread. The small
    /// vectors here are allocated only for steps with constrained rows.
    pub fn token_masks(
        &mut self,
        record: &[StepEntry],
        words_per_mask: usize,
        masks: &mut crate::batch::TokenMasks,
    ) {
        use rayon::prelude::*;
        masks.clear();
        masks.words_per_mask = words_per_mask;
        if self.num_constrained == 0 {
            return; // the common step: nothing to look up
        }
        let wanted: Vec<(RequestId, u32)> = record
            .iter()
            .filter(|e| e.sample)
            .enumerate()
            .filter(|(_, e)| {
                self.requests
                    .get(&e.id)
                    .is_some_and(|r| r.grammar.is_some())
            })
            .map(|(i, e)| (e.id, i as u32))
            .collect();
        if wanted.is_empty() {
            return;
        }
        masks.samples.extend(wanted.iter().map(|w| w.1));
        masks.words.resize(wanted.len() * words_per_mask, 0);
        let mut grammars: Vec<(usize, &mut crate::structured::Grammar)> = self
            .requests
            .iter_mut()
            .filter_map(|(id, r)| {
                let k = wanted.iter().position(|w| w.0 == *id)?;
                Some((k, r.grammar.as_mut()?))
            })
            .collect();
        grammars.sort_unstable_by_key(|g| g.0);
        let eos = &self.cfg.eos_token_ids;
        grammars
            .into_par_iter()
            .zip(masks.words.par_chunks_mut(words_per_mask))
            .for_each(|((_, g), words)| g.fill_mask(words, eos));
    }

    /// Undoes [`Self::apply`] for a step the backend rejected before dispatch: its requests
    /// finish with an error (reference 000 §4.8).
    pub fn rollback(&mut self, record: &[StepEntry], message: &str, sink: &mut OutputSink) {
        for e in record {
            let r = self
                .requests
                .get_mut(&e.id)
                .expect("rolled-back request exists");
            r.inflight_refs -= 1;
            r.num_computed_tokens -= e.num_tokens;
            r.pending_samples -= e.booked;
            if !r.finalized {
                self.finish(e.id, error_finish(message), sink, false);
            }
            self.release_if_done(e.id);
        }
    }

    /// Aborts a request (client gone, stop string matched). Returns false if unknown or done.
    pub fn abort(&mut self, id: RequestId, sink: &mut OutputSink) -> bool {
        match self.requests.get(&id) {
            Some(r) if !r.finalized => {
                self.finish(
                    id,
                    Finish {
                        reason: FinishReason::Abort,
                        stop_token: None,
                        message: None,
                        timing: None,
                        spec: None,
                    },
                    sink,
                    false,
                );
                self.release_if_done(id);
                true
            }
            _ => false,
        }
    }

    /// Finishes every unfinished request with `reason` (shutdown or engine-fatal error).
    pub fn finish_all(&mut self, finish: Finish, sink: &mut OutputSink) {
        let mut ids: Vec<RequestId> = self
            .requests
            .values()
            .filter(|r| !r.finalized)
            .map(|r| r.id)
            .collect();
        ids.sort();
        for id in ids {
            self.finish(id, finish.clone(), sink, false);
            self.release_if_done(id);
        }
    }

    /// Forgets in-flight membership (engine-fatal path: the backend is gone) and frees all.
    pub fn release_all(&mut self) {
        let ids: Vec<RequestId> = self.requests.keys().copied().collect();
        for id in ids {
            if let Some(r) = self.requests.get_mut(&id) {
                r.inflight_refs = 0;
                r.finalized = true;
            }
            self.release_if_done(id);
        }
    }

    fn finish(
        &mut self,
        id: RequestId,
        mut finish: Finish,
        sink: &mut OutputSink,
        token_already_sent: bool,
    ) {
        let r = self.requests.get_mut(&id).expect("finished request exists");
        debug_assert!(!r.finalized);
        finish.timing = Some(r.timing(Instant::now()));
        if self.cfg.num_speculative_tokens > 0 {
            finish.spec = Some(SpecDecodeCounts {
                draft_tokens: r.spec_draft_tokens,
                accepted_tokens: r.spec_accepted_tokens,
            });
        }
        r.finalized = true;
        r.status = RequestStatus::Finished(finish.reason);
        match (token_already_sent, sink.last_mut()) {
            (true, Some((_, last))) => last.finish = Some(finish),
            _ => {
                sink.push((
                    r.origin,
                    RequestOutput {
                        request_id: r.external_id.clone(),
                        new_token_ids: Vec::new(),
                        logprobs: None,
                        finish: Some(finish),
                        num_cached_tokens: (!r.reported_first).then_some(r.num_cached_tokens),
                    },
                ));
                r.reported_first = true;
            }
        }
        self.running.retain(|&x| x != id);
        self.waiting.retain(|&x| x != id);
    }

    fn release_if_done(&mut self, id: RequestId) {
        let done = matches!(self.requests.get(&id), Some(r) if r.finalized && r.inflight_refs == 0);
        if done {
            let mut r = self.requests.remove(&id).expect("checked");
            self.num_constrained -= r.grammar.is_some() as usize;
            self.kv.free(&mut r.blocks);
            if let Some(local) = &mut self.local {
                local.kv.free(&mut r.local_blocks);
            }
            if let Some(row) = r.row.take() {
                self.free_rows.push(row);
            }
        }
    }

    /// Debug check of I4 and capacity: `inflight_refs` equals the number of in-flight step
    /// records naming the request; rows and blocks are conserved.
    pub fn check_invariants<'a>(&self, in_flight: impl Iterator<Item = &'a [StepEntry]>) {
        let mut counts: HashMap<RequestId, u8> = HashMap::new();
        for record in in_flight {
            for e in record {
                *counts.entry(e.id).or_default() += 1;
            }
        }
        let mut rows = 0;
        let mut refs: HashMap<BlockId, u32> = HashMap::new();
        let mut local_refs: HashMap<BlockId, u32> = HashMap::new();
        for r in self.requests.values() {
            if let Some(local) = &self.local {
                for (i, b) in r.local_blocks.iter().enumerate() {
                    assert_eq!(
                        *b == SCRATCH_BLOCK,
                        (i as u32) < r.local_released,
                        "{:?}: local entry {i} released iff below {}",
                        r.id,
                        r.local_released
                    );
                    if *b != SCRATCH_BLOCK {
                        *local_refs.entry(*b).or_default() += 1;
                    }
                }
                if r.num_computed_tokens > 0 {
                    assert!(
                        r.local_blocks.len() as u32 >= local.kv.blocks_for(r.num_computed_tokens),
                        "{:?} computed past its local blocks",
                        r.id
                    );
                }
                // Nothing a future token can see was given back.
                let dead =
                    local_dead_blocks(r.num_computed_tokens, local.window, self.cfg.block_size);
                assert!(
                    r.local_released <= dead,
                    "{:?} gave back local blocks a later token reads",
                    r.id
                );
            }
            let c = counts.get(&r.id).copied().unwrap_or(0);
            assert_eq!(
                r.inflight_refs, c,
                "I4: {:?} has inflight_refs {} but is in {} in-flight steps",
                r.id, r.inflight_refs, c
            );
            assert!(r.inflight_refs <= self.cfg.max_inflight_refs);
            assert!(
                !(r.finalized && r.inflight_refs == 0),
                "{:?} finished but not released",
                r.id
            );
            rows += r.row.is_some() as u32;
            for b in &r.blocks {
                *refs.entry(*b).or_default() += 1;
            }
            assert!(
                r.blocks.len() as u32 >= self.kv.blocks_for(r.num_computed_tokens),
                "{:?} computed past its blocks",
                r.id
            );
        }
        assert_eq!(rows, self.num_allocated_rows(), "rows leaked");
        assert_eq!(refs.len() as u32, self.kv.num_used(), "blocks leaked");
        for (b, n) in refs {
            assert_eq!(self.kv.ref_count(b), n, "ref count of {b:?}");
        }
        self.kv.check();
        if let Some(local) = self.local_kv() {
            assert_eq!(
                local_refs.len() as u32,
                local.num_used(),
                "local blocks leaked"
            );
            for (b, n) in local_refs {
                assert_eq!(local.ref_count(b), n, "local ref count of {b:?}");
            }
            local.check();
        }
        for id in counts.keys() {
            assert!(
                self.requests.contains_key(id),
                "in-flight step names released {id:?}"
            );
        }
    }
}

/// The running totals of one [`Scheduler::schedule`] call.
struct Planner<'a> {
    s: &'a Scheduler,
    drained: bool,
    budget: u32,
    free_blocks: u32,
    /// Free blocks of the sliding-window pool (0 without one).
    free_local: u32,
    free_rows: u32,
    /// `running[..tail]` may still run; `running[tail..]` are preempted by this plan.
    tail: usize,
    needs_drain: bool,
    plan: StepPlan,
}

impl Planner<'_> {
    /// Frees blocks for `running[i]` by preempting from the tail (never `running[i]` itself
    /// or anything admitted before it); true if `need` blocks are then available.
    fn reserve(&mut self, need: u32, need_local: u32, i: usize) -> bool {
        while (need > self.free_blocks || need_local > self.free_local) && self.tail > i + 1 {
            self.tail -= 1;
            let victim = &self.s.requests[&self.s.running[self.tail]];
            self.plan.preempt.push(victim.id);
            // Only blocks the victim holds alone come free: a prefix-cache block it shares
            // with another running request stays in use (counting it made a plan the pool
            // could not honour).
            self.free_blocks += self.s.kv.count_unshared(&victim.blocks);
            self.free_local += self
                .s
                .local_kv()
                .map_or(0, |l| l.count_unshared(&victim.local_blocks));
            self.needs_drain = true;
        }
        need <= self.free_blocks && need_local <= self.free_local
    }

    /// Running requests that decode, oldest admission first: one token each.
    fn decodes(&mut self) {
        let spec_off = self.s.cfg.spec_disable_batch_size.is_some_and(|max| {
            self.s.running[..self.tail]
                .iter()
                .filter(|id| self.s.requests[*id].decoding)
                .count() as u32
                > max
        });
        let mut i = 0;
        while i < self.tail && self.budget > 0 {
            let r = &self.s.requests[&self.s.running[i]];
            if r.decoding && self.s.can_dispatch(r) {
                // Constrained rows do not speculate (their proposals would need the grammar).
                let n = if r.grammar.is_some() || spec_off {
                    1
                } else {
                    1 + self.s.spec_len()
                };
                if n > self.budget {
                    break;
                }
                let need = self
                    .s
                    .kv
                    .blocks_for(r.num_computed_tokens + n)
                    .saturating_sub(r.blocks.len() as u32);
                let (alloc_l, freed_l) = self.s.local_step(r, r.num_computed_tokens, n);
                if self.reserve(need, alloc_l.saturating_sub(freed_l), i) {
                    self.free_blocks -= need;
                    self.free_local = self.free_local + freed_l - alloc_l;
                    self.budget -= n;
                    self.plan.entries.push(Planned {
                        id: r.id,
                        num_tokens: n,
                        admit: false,
                        cached_blocks: 0,
                    });
                } else if self.drained {
                    // Every later request is already a victim: preempt the request itself.
                    debug_assert_eq!(self.tail, i + 1);
                    self.plan.preempt.push(r.id);
                    self.tail = i;
                    self.needs_drain = true;
                    break;
                } else {
                    // Draining may release zombies' blocks.
                    self.needs_drain = true;
                }
            }
            i += 1;
        }
    }

    /// Chunked prefills and recomputes of running requests.
    fn chunks(&mut self) {
        let bs = self.s.cfg.block_size;
        for &id in &self.s.running[..self.tail] {
            if self.budget == 0 {
                break;
            }
            let r = &self.s.requests[&id];
            let left = Scheduler::host_tokens_left(r);
            if left == 0 || !self.s.can_dispatch(r) {
                continue;
            }
            let held = r.blocks.len() as u32;
            let fit = (held + self.free_blocks) * bs - r.num_computed_tokens;
            let mut chunk = left.min(self.budget).min(fit);
            let (_, freed_l) = self.s.local_step(r, r.num_computed_tokens, 0);
            if self.s.local.is_some() {
                // The chunk's KV is written to the local pool before its window is read.
                let room = (r.local_blocks.len() as u32 + self.free_local + freed_l) * bs;
                chunk = chunk.min(room.saturating_sub(r.num_computed_tokens));
            }
            if chunk == 0 {
                self.needs_drain |= !self.drained;
                continue;
            }
            self.free_blocks -= self
                .s
                .kv
                .blocks_for(r.num_computed_tokens + chunk)
                .saturating_sub(held);
            let (alloc_l, _) = self.s.local_step(r, r.num_computed_tokens, chunk);
            self.free_local = self.free_local + freed_l - alloc_l;
            self.budget -= chunk;
            self.needs_drain = true;
            self.plan.entries.push(Planned {
                id,
                num_tokens: chunk,
                admit: false,
                cached_blocks: 0,
            });
        }
    }

    /// Waiting requests, strictly FIFO, with their prefix-cache hits; none in a step that
    /// preempts.
    fn admissions(&mut self) {
        if !self.plan.preempt.is_empty() {
            return;
        }
        let bs = self.s.cfg.block_size;
        for &id in &self.s.waiting {
            if self.budget == 0 || self.free_rows == 0 {
                break;
            }
            let r = &self.s.requests[&id];
            let host = r.host_len();
            let hits = self.s.kv.lookup(&r.block_hashes, |i, stored| {
                *r.block_tokens(i, bs as usize) == *stored
            });
            // At least one token is computed, to produce the next token's logits.
            let mut hits = hits.min((host - 1) / bs);
            let mut need_local = 0;
            if let Some(local) = &self.s.local {
                // A hit counts only with the window before it in the local pool.
                let window_cached = |h: u32| {
                    let lo = local.hit_window_start(h);
                    local
                        .kv
                        .lookup(&r.block_hashes[lo as usize..h as usize], |i, stored| {
                            *r.block_tokens(lo as usize + i, bs as usize) == *stored
                        })
                        == h - lo
                };
                while hits > 0 && !window_cached(hits) {
                    hits -= 1;
                }
                let lo = local.hit_window_start(hits) as usize;
                let chunk = (host - hits * bs).min(self.budget);
                need_local = local.kv.blocks_for(hits * bs + chunk) - hits
                    + local.kv.count_free_hits(&r.block_hashes[lo..hits as usize]);
            }
            let cached = hits * bs;
            let mut chunk = (host - cached).min(self.budget);
            // The local pool may bound the first chunk too (its KV is written there).
            if self.s.local.is_some() && need_local > self.free_local {
                let over = (need_local - self.free_local) * bs;
                chunk = chunk.saturating_sub(over);
                need_local = self.free_local;
                if chunk == 0 {
                    break;
                }
            }
            let need = self.s.kv.blocks_for(cached + chunk) - hits
                + self.s.kv.count_free_hits(&r.block_hashes[..hits as usize]);
            if need > self.free_blocks {
                break;
            }
            self.free_blocks -= need;
            self.free_local -= need_local;
            self.free_rows -= 1;
            self.budget -= chunk;
            self.needs_drain = true;
            self.plan.entries.push(Planned {
                id,
                num_tokens: chunk,
                admit: true,
                cached_blocks: hits,
            });
        }
    }
}

/// Appends the hashes of the request's newly full, host-known blocks.
fn extend_block_hashes(kv: &BlockManager, r: &mut Request) {
    if !kv.caching() {
        return;
    }
    let bs = kv.block_size() as usize;
    let full = r.host_len() as usize / bs;
    while r.block_hashes.len() < full {
        let i = r.block_hashes.len();
        let parent = r.block_hashes.last().copied();
        let salt = if i == 0 { r.cache_salt } else { 0 };
        let h = (kv.hash_fn())(parent, &r.block_tokens(i, bs), salt);
        r.block_hashes.push(h);
    }
}

/// Registers the request's full blocks whose KV is computed (or being computed by a launched
/// step: any later reader runs after it on the same stream).
/// Sliding-window blocks are registered in their own pool under the same hashes (entries
/// already given back are skipped: a hit then ends before them).
fn register_computed_blocks(
    kv: &mut BlockManager,
    mut local: Option<&mut BlockManager>,
    r: &mut Request,
) {
    if !kv.caching() {
        return;
    }
    let bs = kv.block_size() as usize;
    let ready = (r.num_computed_tokens as usize / bs)
        .min(r.block_hashes.len())
        .min(r.blocks.len());
    for i in r.num_registered_blocks as usize..ready {
        let tokens = r.block_tokens(i, bs);
        kv.register(r.blocks[i], r.block_hashes[i], &tokens);
        if let Some(local) = local.as_deref_mut() {
            match r.local_blocks.get(i) {
                Some(&b) if b != SCRATCH_BLOCK => local.register(b, r.block_hashes[i], &tokens),
                _ => {}
            }
        }
    }
    r.num_registered_blocks = r.num_registered_blocks.max(ready as u32);
}

/// Advances a constrained request's grammar past `token`; a finished grammar ends the
/// request ("stop"), a token the grammar refuses (cannot happen with the mask applied) ends
/// it with an error.
fn advance_grammar(r: &mut Request, token: TokenId) -> Option<Finish> {
    let g = r.grammar.as_mut()?;
    match g.consume(token) {
        Err(e) => Some(error_finish(&format!(
            "the output left its structured-output constraint: {e}"
        ))),
        Ok(()) if g.is_finished() => Some(Finish {
            reason: FinishReason::Stop,
            stop_token: None,
            message: None,
            timing: None,
            spec: None,
        }),
        Ok(()) => None,
    }
}

fn error_finish(message: &str) -> Finish {
    Finish {
        reason: FinishReason::Error,
        stop_token: None,
        message: Some(message.to_string()),
        timing: None,
        spec: None,
    }
}

/// Stop rules applied to a newly committed token, in vLLM's order.
fn stop_reason(r: &Request, token: TokenId, cfg: &SchedulerConfig) -> Option<Finish> {
    let n = r.output.len() as u32;
    let past_min = n >= r.sampling.min_tokens;
    let stop = |t| {
        Some(Finish {
            reason: FinishReason::Stop,
            stop_token: Some(t),
            message: None,
            timing: None,
            spec: None,
        })
    };
    if past_min && !r.sampling.ignore_eos && cfg.eos_token_ids.contains(&token) {
        return stop(token);
    }
    if past_min && r.sampling.stop_token_ids.contains(&token) {
        return stop(token);
    }
    if n >= r.sampling.max_tokens || r.host_len() >= cfg.max_model_len {
        return Some(Finish {
            reason: FinishReason::Length,
            stop_token: None,
            message: None,
            timing: None,
            spec: None,
        });
    }
    None
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
