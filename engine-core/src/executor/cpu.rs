//! The CPU backend: a dedicated compute thread plays the role of the CUDA stream.
//!
//! ```text
//!  engine thread                         compute thread (FIFO work queue = the stream)
//!  launch_forward(batch, slot) ──copy──► slot.batch   ─► Forward{slot}: rows, blocks, model → slot logits
//!  finalize_sampling(handle) ──────────────────────────► Sample{slot}:  sample → row.pending, slot output; signal
//!  wait(step) ◄─────────────── slot.done (completion flag + condvar) ◄──┘
//! ```
//!
//! The same properties as the CUDA design hold: work runs in submission order (I1); a slot's
//! host buffers (its copy of the batch, its output) are not reused until the engine committed
//! the step (I6, enforced by the pipeline); each step signals its own completion (I3); and a
//! decode's input token is the row's `pending` token written by the previous sampling on the
//! compute thread, never routed through the engine loop.
//!
//! Steady-state cost per step on the engine thread: one `clone_from` of the batch into the
//! slot (no allocation once capacities settle), two channel sends, one condvar wait.
//!
//! Speculative decoding (see [`crate::spec`]): a decode entry with `draft > 0` is a round.
//! The forward work proposes first (the draft model's forwards, sampled on this thread, or an
//! n-gram lookup in the row's tokens), then runs the target over the pending token and its
//! proposals with logits for every position; the sample work verifies
//! ([`RowSampler::verify`]) and moves the row on by the 1 to `k + 1` tokens it emitted. The row's
//! true length (`kv_len`) lives here: the host only knows an upper bound until it reads the
//! round's output, and never needs more to launch the next round.

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use anyhow::{anyhow, Context};

use super::{ExecError, Executor, InFlightStep, LaunchHandle};
use crate::batch::{ExecBatch, StepOutput};
use crate::model::{CpuModel, KvCache, SeqChunk};
use crate::pipeline::{SlotId, NUM_SLOTS};
use crate::sampling::spec::{AcceptRule, Proposals};
use crate::sampling::{RowSampler, SamplerScratch};
use crate::spec::ngram_propose;

#[derive(Debug, Clone)]
pub struct CpuExecutorConfig {
    pub num_kv_blocks: u32,
    /// Blocks of the sliding-window layers' own pool (a hybrid cache), if any.
    pub num_local_kv_blocks: Option<u32>,
    pub block_size: u32,
    pub max_rows: u32,
}

/// How the CPU backend proposes tokens for speculative decoding.
pub enum CpuProposer {
    /// A draft model (same vocabulary); its KV cache has the target's block count and block
    /// size and is indexed by the same block tables.
    Draft(Box<CpuModel>),
    /// N-gram prompt lookup over the row's tokens ([`ngram_propose`]).
    Ngram { min: usize, max: usize },
}

/// A draft model's state on the compute thread.
struct DraftState {
    model: CpuModel,
    cache: KvCache,
    logits: Vec<f32>,
    tokens: Vec<u32>,
    /// The first draft forward's chunks, and the rows still drafting (kept across steps so
    /// that a round allocates nothing once capacities settle).
    spans: Vec<DraftSpan>,
    live: Vec<usize>,
}

/// One chunk of the first draft forward of a step.
struct DraftSpan {
    /// Index of the sequence in the step's batch.
    seq: usize,
    position: usize,
    /// `tokens[start..end]` are the chunk's.
    start: usize,
    end: usize,
    /// A speculative row (logits of its last token) rather than a prefill chunk.
    drafts: bool,
}

/// The proposer with its state on the compute thread.
enum Proposer {
    Draft(Box<DraftState>),
    Ngram { min: usize, max: usize },
}

/// A slot's host-side buffers, shared with the compute thread.
#[derive(Default)]
struct Slot {
    batch: Mutex<ExecBatch>,
    /// Token masks of the step's constrained rows (empty for most steps).
    masks: Mutex<crate::batch::TokenMasks>,
    done: Mutex<SlotDone>,
    signal: Condvar,
}

#[derive(Default)]
struct SlotDone {
    completed_step: Option<u64>,
    output: StepOutput,
    error: Option<String>,
}

enum Work {
    Forward { slot: usize },
    Sample { slot: usize, step: u64 },
}

pub struct CpuExecutor {
    work: Option<mpsc::Sender<Work>>,
    slots: Arc<[Slot; NUM_SLOTS]>,
    thread: Option<JoinHandle<()>>,
    next_step: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock means the compute thread panicked; its guard already recorded an error.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl CpuExecutor {
    /// Starts the compute thread with `model` and a KV cache of `cfg.num_kv_blocks` blocks.
    pub fn new(
        model: CpuModel,
        kv_config: &crate::model::ModelConfig,
        cfg: CpuExecutorConfig,
        proposer: Option<CpuProposer>,
    ) -> anyhow::Result<Self> {
        Self::start(model, kv_config, cfg, proposer, AcceptRule::default())
    }

    /// [`Self::new`] with another acceptance rule (tests show that a wrong one is caught).
    #[cfg(test)]
    pub(crate) fn with_accept_rule(
        model: CpuModel,
        kv_config: &crate::model::ModelConfig,
        cfg: CpuExecutorConfig,
        proposer: Option<CpuProposer>,
        rule: AcceptRule,
    ) -> anyhow::Result<Self> {
        Self::start(model, kv_config, cfg, proposer, rule)
    }

    fn start(
        model: CpuModel,
        kv_config: &crate::model::ModelConfig,
        cfg: CpuExecutorConfig,
        proposer: Option<CpuProposer>,
        accept_rule: AcceptRule,
    ) -> anyhow::Result<Self> {
        let cache = match cfg.num_local_kv_blocks {
            Some(local) => KvCache::hybrid(
                kv_config,
                cfg.num_kv_blocks as usize,
                local as usize,
                cfg.block_size as usize,
            ),
            None => KvCache::new(
                kv_config,
                cfg.num_kv_blocks as usize,
                cfg.block_size as usize,
            ),
        };
        anyhow::ensure!(
            proposer.is_none() || cfg.num_local_kv_blocks.is_none(),
            "speculative decoding does not combine with window-sized KV yet"
        );
        let proposer = match proposer {
            None => None,
            Some(CpuProposer::Draft(model)) => {
                anyhow::ensure!(
                    model.config().vocab_size == kv_config.vocab_size,
                    "the draft's vocabulary ({}) differs from the target's ({})",
                    model.config().vocab_size,
                    kv_config.vocab_size
                );
                let cache = KvCache::new(
                    model.config(),
                    cfg.num_kv_blocks as usize,
                    cfg.block_size as usize,
                );
                Some(Proposer::Draft(Box::new(DraftState {
                    model: *model,
                    cache,
                    logits: Vec::new(),
                    tokens: Vec::new(),
                    spans: Vec::new(),
                    live: Vec::new(),
                })))
            }
            Some(CpuProposer::Ngram { min, max }) => Some(Proposer::Ngram { min, max }),
        };
        let slots: Arc<[Slot; NUM_SLOTS]> = Arc::new(Default::default());
        let (tx, rx) = mpsc::channel();
        let stream = Stream {
            model,
            cache,
            vocab: kv_config.vocab_size,
            rows: (0..cfg.max_rows).map(|_| None).collect(),
            logits: Default::default(),
            logit_rows: Default::default(),
            tokens: Vec::new(),
            spans: Vec::new(),
            proposer,
            accept_rule,
            scratch: SamplerScratch::default(),
            failed: None,
            slots: slots.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("harrier-cpu-stream".into())
            .spawn(move || stream.run(rx))
            .context("spawning the CPU compute thread")?;
        Ok(Self {
            work: Some(tx),
            slots,
            thread: Some(thread),
            next_step: 0,
        })
    }

    fn submit(&self, work: Work) -> Result<(), ExecError> {
        self.work
            .as_ref()
            .and_then(|w| w.send(work).ok())
            .ok_or_else(|| ExecError::Fatal(anyhow!("the CPU compute thread has exited")))
    }
}

impl Executor for CpuExecutor {
    fn launch_forward(
        &mut self,
        batch: &ExecBatch,
        slot: SlotId,
    ) -> Result<LaunchHandle, ExecError> {
        batch.check().map_err(ExecError::Rejected)?;
        let s = &self.slots[slot.0 as usize];
        lock(&s.batch).clone_from(batch);
        lock(&s.masks).clear();
        self.submit(Work::Forward {
            slot: slot.0 as usize,
        })?;
        let step = self.next_step;
        self.next_step += 1;
        Ok(LaunchHandle { slot, step })
    }

    fn supports_token_masks(&self) -> bool {
        true
    }

    fn set_token_masks(
        &mut self,
        slot: SlotId,
        masks: &crate::batch::TokenMasks,
    ) -> Result<(), ExecError> {
        lock(&self.slots[slot.0 as usize].masks).clone_from(masks);
        Ok(())
    }

    fn finalize_sampling(&mut self, handle: LaunchHandle) -> Result<InFlightStep, ExecError> {
        let LaunchHandle { slot, step } = handle;
        self.submit(Work::Sample {
            slot: slot.0 as usize,
            step,
        })?;
        Ok(InFlightStep { slot, step })
    }

    fn wait(&mut self, step: InFlightStep, out: &mut StepOutput) -> Result<(), ExecError> {
        let s = &self.slots[step.slot.0 as usize];
        let mut done = lock(&s.done);
        loop {
            if let Some(e) = &done.error {
                return Err(ExecError::Fatal(anyhow!("{e}")));
            }
            if done.completed_step == Some(step.step) {
                break;
            }
            done = s.signal.wait(done).unwrap_or_else(|p| p.into_inner());
        }
        out.clear();
        std::mem::swap(&mut done.output, out);
        Ok(())
    }
}

impl Drop for CpuExecutor {
    fn drop(&mut self) {
        self.work = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Per-row state on the "device".
struct RowState {
    block_table: Vec<u32>,
    /// The sliding-window layers' table (a hybrid cache; see `SeqInput::local_blocks_len`).
    local_block_table: Vec<u32>,
    /// The last token sampled for this row: the input of its next decode.
    pending: Option<u32>,
    sampler: RowSampler,
    /// Positions whose target KV is written: where the next decode's input goes.
    kv_len: u32,
    /// Speculative decoding only (empty otherwise): the sequence's tokens, `tokens[p]` at
    /// position `p`; from row init the prompt and output, then kept in step with the computed
    /// positions (`tokens.len() == kv_len` while decoding; `pending` comes after).
    tokens: Vec<u32>,
    /// Positions whose draft KV is written (a draft model proposer).
    draft_len: u32,
    /// This round's proposals, and for sampled rows with a draft model the distributions
    /// they were drawn from (`proposals.len()` rows of the vocabulary).
    proposals: Vec<u32>,
    q: Vec<f32>,
}

/// The compute thread's state: model, KV cache, rows, per-slot logits.
struct Stream {
    model: CpuModel,
    cache: KvCache,
    vocab: usize,
    rows: Vec<Option<RowState>>,
    logits: [Vec<f32>; NUM_SLOTS],
    /// Logits rows of each sequence of the slot's batch (in sequence order).
    logit_rows: [Vec<u32>; NUM_SLOTS],
    tokens: Vec<u32>,
    /// Each sequence's (position, start in `tokens`, token count) in the step being built.
    spans: Vec<(usize, usize, usize)>,
    scratch: SamplerScratch,
    proposer: Option<Proposer>,
    accept_rule: AcceptRule,
    /// Once a step failed, every later step fails too (the state is unknown).
    failed: Option<String>,
    slots: Arc<[Slot; NUM_SLOTS]>,
}

/// Marks every slot failed if the compute thread unwinds, so no `wait` hangs.
struct PanicGuard(Arc<[Slot; NUM_SLOTS]>);

impl Drop for PanicGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for s in self.0.iter() {
                lock(&s.done).error = Some("the CPU compute thread panicked".into());
                s.signal.notify_all();
            }
        }
    }
}

impl Stream {
    fn run(mut self, rx: mpsc::Receiver<Work>) {
        let _guard = PanicGuard(self.slots.clone());
        while let Ok(work) = rx.recv() {
            match work {
                Work::Forward { slot } => {
                    if self.failed.is_none() {
                        if let Err(e) = self.forward(slot) {
                            tracing::error!("CPU forward failed: {e:#}");
                            self.failed = Some(format!("{e:#}"));
                        }
                    }
                }
                Work::Sample { slot, step } => {
                    let result = match &self.failed {
                        Some(e) => Err(anyhow!("{e}")),
                        None => self.sample(slot),
                    };
                    let s = &self.slots[slot];
                    let mut done = lock(&s.done);
                    match result {
                        Ok(()) => done.completed_step = Some(step),
                        Err(e) => {
                            self.failed.get_or_insert_with(|| format!("{e:#}"));
                            done.error = Some(format!("{e:#}"));
                        }
                    }
                    s.signal.notify_all();
                }
            }
        }
    }

    fn forward(&mut self, slot: usize) -> anyhow::Result<()> {
        // The slot table is shared with the engine thread; holding our own handle (an atomic
        // increment per step) lets the batch stay locked while `self` is borrowed mutably.
        let slots = self.slots.clone();
        let batch = lock(&slots[slot].batch);
        let spec_on = self.proposer.is_some();
        for init in &batch.row_inits {
            let row = self
                .rows
                .get_mut(init.row.0 as usize)
                .ok_or_else(|| anyhow!("row {} out of range", init.row.0))?;
            let mut tokens = Vec::new();
            if spec_on {
                tokens.extend_from_slice(&init.prompt);
                tokens.extend_from_slice(&init.output);
            }
            *row = Some(RowState {
                block_table: Vec::new(),
                local_block_table: Vec::new(),
                pending: None,
                sampler: RowSampler::new(init),
                kv_len: 0,
                tokens,
                draft_len: 0,
                proposals: Vec::new(),
                q: Vec::new(),
            });
        }
        for s in &batch.seqs {
            let row = self
                .rows
                .get_mut(s.row.0 as usize)
                .and_then(Option::as_mut)
                .ok_or_else(|| anyhow!("step names uninitialised row {}", s.row.0))?;
            let (start, mid) = (
                s.blocks_start as usize,
                (s.blocks_start + s.blocks_len) as usize,
            );
            row.block_table
                .extend_from_slice(&batch.new_blocks[start..mid]);
            row.local_block_table
                .extend_from_slice(&batch.new_blocks[mid..mid + s.local_blocks_len as usize]);
            row.proposals.clear();
            if s.uses_pending_token() {
                anyhow::ensure!(
                    row.pending.is_some(),
                    "decode on row {} without a sampled token",
                    s.row.0
                );
            }
            if s.host_len == 0 {
                anyhow::ensure!(
                    row.kv_len <= s.position,
                    "row {} is at {} but the host placed its decode at {}",
                    s.row.0,
                    row.kv_len,
                    s.position
                );
            }
        }
        if self.proposer.is_some() {
            self.propose(&batch)?;
        }
        let Self {
            model,
            cache,
            vocab,
            rows,
            logits,
            logit_rows,
            tokens,
            spans,
            ..
        } = self;
        tokens.clear();
        spans.clear();
        let logit_rows = &mut logit_rows[slot];
        logit_rows.clear();
        for s in &batch.seqs {
            let row = rows[s.row.0 as usize].as_mut().expect("checked above");
            let start = tokens.len();
            let (position, n_logits) = if s.host_len == 0 {
                // A decode: the pending token, then the round's proposals (if any), at the
                // row's true length.
                tokens.push(row.pending.expect("checked above"));
                tokens.extend_from_slice(&row.proposals);
                (row.kv_len as usize, 1 + row.proposals.len())
            } else {
                let host = &batch.host_tokens[s.host_start as usize..][..s.host_len as usize];
                tokens.extend_from_slice(host);
                if s.uses_pending_token() {
                    tokens.push(row.pending.expect("checked above"));
                }
                let position = s.position as usize;
                if spec_on {
                    row.tokens.truncate(position);
                    row.tokens.extend_from_slice(&tokens[start..]);
                }
                row.kv_len = s.position + s.num_tokens;
                (position, s.sample as usize)
            };
            logit_rows.push(n_logits as u32);
            spans.push((position, start, tokens.len() - start));
        }
        let mut chunks = Vec::with_capacity(batch.seqs.len());
        for (s, &(position, start, n)) in batch.seqs.iter().zip(spans.iter()) {
            let row = rows[s.row.0 as usize].as_ref().expect("checked above");
            chunks.push(SeqChunk {
                tokens: &tokens[start..start + n],
                position,
                block_table: &row.block_table,
                local_block_table: &row.local_block_table,
                logit_rows: logit_rows[chunks.len()] as usize,
            });
        }
        let n_logits: usize = logit_rows.iter().map(|&n| n as usize).sum();
        let out = &mut logits[slot];
        out.resize(n_logits * *vocab, 0.0);
        model.forward(&chunks, cache, out)
    }

    /// The proposal phase of a step: fills `proposals` (and `q`) of every row with a
    /// speculative entry; a draft model also computes the KV of every prefill chunk of the
    /// step (beside the target's).
    fn propose(&mut self, batch: &crate::batch::ExecBatch) -> anyhow::Result<()> {
        let Self {
            rows,
            proposer,
            scratch,
            vocab,
            ..
        } = self;
        let vocab = *vocab;
        match proposer.as_mut().expect("checked by the caller") {
            Proposer::Ngram { min, max } => {
                for s in batch.seqs.iter().filter(|s| s.draft > 0) {
                    let row = rows[s.row.0 as usize].as_mut().expect("checked");
                    // The context is the computed tokens and the pending one: pushed for the
                    // lookup and taken back, rather than copied.
                    debug_assert_eq!(row.tokens.len(), row.kv_len as usize);
                    row.tokens.push(row.pending.expect("checked"));
                    ngram_propose(
                        &row.tokens,
                        *min,
                        *max,
                        s.draft as usize,
                        &mut row.proposals,
                    );
                    row.tokens.pop();
                }
                Ok(())
            }
            Proposer::Draft(draft) => {
                let DraftState {
                    model,
                    cache,
                    logits,
                    tokens,
                    spans,
                    live,
                } = &mut **draft;
                // First forward: every speculative row catches up (the tokens the draft has
                // not seen, ending with the pending token; logits of the last) and every
                // prefill chunk runs as in the target (no logits).
                tokens.clear();
                spans.clear();
                for (i, s) in batch.seqs.iter().enumerate() {
                    let row = rows[s.row.0 as usize].as_ref().expect("checked");
                    let start = tokens.len();
                    let (position, drafts) = if s.draft > 0 {
                        let from = (row.draft_len as usize).min(row.kv_len as usize);
                        tokens.extend_from_slice(&row.tokens[from..row.kv_len as usize]);
                        tokens.push(row.pending.expect("checked"));
                        (from, true)
                    } else if s.host_len > 0 {
                        let host =
                            &batch.host_tokens[s.host_start as usize..][..s.host_len as usize];
                        tokens.extend_from_slice(host);
                        if s.uses_pending_token() {
                            tokens.push(row.pending.expect("checked"));
                        }
                        (s.position as usize, false)
                    } else {
                        continue;
                    };
                    spans.push(DraftSpan {
                        seq: i,
                        position,
                        start,
                        end: tokens.len(),
                        drafts,
                    });
                }
                if spans.is_empty() {
                    return Ok(());
                }
                // (Chunks borrow the step's token and block-table slices: built per forward,
                // as in `forward`.)
                let chunks: Vec<SeqChunk<'_>> = spans
                    .iter()
                    .map(|sp| SeqChunk {
                        tokens: &tokens[sp.start..sp.end],
                        position: sp.position,
                        block_table: &rows[batch.seqs[sp.seq].row.0 as usize]
                            .as_ref()
                            .expect("checked")
                            .block_table,
                        local_block_table: &[],
                        logit_rows: sp.drafts as usize,
                    })
                    .collect();
                logits.resize(spans.iter().filter(|sp| sp.drafts).count() * vocab, 0.0);
                model.forward(&chunks, cache, logits)?;
                drop(chunks);
                for sp in spans.iter() {
                    let row = rows[batch.seqs[sp.seq].row.0 as usize]
                        .as_mut()
                        .expect("checked");
                    row.draft_len = (sp.position + sp.end - sp.start) as u32;
                }
                // Then one forward per further proposal. `live[j]` owns logits row `j`; each
                // proposal is drawn from the draft's processed distribution given the tokens
                // drafted before it (recorded, and taken back once all are drafted).
                live.clear();
                live.extend(spans.iter().filter(|sp| sp.drafts).map(|sp| sp.seq));
                let mut step = 0;
                loop {
                    for (j, &i) in live.iter().enumerate() {
                        let s = &batch.seqs[i];
                        let row = rows[s.row.0 as usize].as_mut().expect("checked");
                        let greedy = row.sampler.params().is_greedy();
                        if !greedy && row.q.len() < s.draft as usize * vocab {
                            row.q.resize(s.draft as usize * vocab, 0.0);
                        }
                        let q: &mut [f32] = if greedy {
                            &mut []
                        } else {
                            &mut row.q[step * vocab..(step + 1) * vocab]
                        };
                        let row_logits = &mut logits[j * vocab..(j + 1) * vocab];
                        let t = row.sampler.draft(row_logits, q, scratch);
                        row.sampler.record(t);
                        row.proposals.push(t);
                    }
                    live.retain(|&i| step + 1 < batch.seqs[i].draft as usize);
                    if live.is_empty() {
                        break;
                    }
                    tokens.clear();
                    tokens.extend(live.iter().map(|&i| {
                        let row = rows[batch.seqs[i].row.0 as usize]
                            .as_ref()
                            .expect("checked");
                        *row.proposals.last().expect("drafted")
                    }));
                    let chunks: Vec<SeqChunk<'_>> = live
                        .iter()
                        .enumerate()
                        .map(|(k, &i)| {
                            let row = rows[batch.seqs[i].row.0 as usize]
                                .as_ref()
                                .expect("checked");
                            SeqChunk {
                                tokens: &tokens[k..k + 1],
                                position: row.draft_len as usize,
                                block_table: &row.block_table,
                                local_block_table: &[],
                                logit_rows: 1,
                            }
                        })
                        .collect();
                    logits.resize(live.len() * vocab, 0.0);
                    model.forward(&chunks, cache, logits)?;
                    drop(chunks);
                    for &i in live.iter() {
                        let row = rows[batch.seqs[i].row.0 as usize]
                            .as_mut()
                            .expect("checked");
                        row.draft_len += 1;
                    }
                    step += 1;
                }
                for sp in spans.iter().filter(|sp| sp.drafts) {
                    let row = rows[batch.seqs[sp.seq].row.0 as usize]
                        .as_mut()
                        .expect("checked");
                    for &t in row.proposals.iter().rev() {
                        row.sampler.unrecord(t);
                    }
                }
                Ok(())
            }
        }
    }

    fn sample(&mut self, slot: usize) -> anyhow::Result<()> {
        let Self {
            vocab,
            rows,
            logits,
            logit_rows,
            scratch,
            slots,
            proposer,
            accept_rule,
            ..
        } = self;
        let vocab = *vocab;
        let spec_on = proposer.is_some();
        let dist_is_model = matches!(proposer, Some(Proposer::Draft(_)));
        let batch = lock(&slots[slot].batch);
        let masks = lock(&slots[slot].masks);
        let mut next_mask = 0;
        let mut done = lock(&slots[slot].done);
        let out = &mut done.output;
        out.clear();
        let mut at = 0usize;
        let mut sample_index = 0u32;
        for (s, &n_rows) in batch.seqs.iter().zip(&logit_rows[slot]) {
            let n_rows = n_rows as usize;
            let rows_logits = &mut logits[slot][at * vocab..(at + n_rows) * vocab];
            at += n_rows;
            if !s.sample {
                continue;
            }
            if masks.samples.get(next_mask) == Some(&sample_index) {
                // A constrained row never speculates: one logits row.
                crate::batch::TokenMasks::apply(masks.mask(next_mask), rows_logits);
                next_mask += 1;
            }
            sample_index += 1;
            let row = rows[s.row.0 as usize]
                .as_mut()
                .ok_or_else(|| anyhow!("sampling an uninitialised row"))?;
            if s.host_len > 0 {
                // The end of a prefill chunk: the first token (the KV is already counted).
                let (token, lp) = row.sampler.sample(rows_logits, scratch);
                row.pending = Some(token);
                out.push_one(token, lp);
                continue;
            }
            // A decode, plain or a round: verification emits 1 to k + 1 tokens (with no
            // proposals it is exactly plain sampling).
            let first = out.tokens.len();
            let dist = match (dist_is_model, row.proposals.is_empty()) {
                (true, false) => Proposals::Model(&row.q),
                _ => Proposals::PointMass,
            };
            let accepted = row.sampler.verify(
                rows_logits,
                &row.proposals,
                dist,
                *accept_rule,
                scratch,
                out,
            ) as usize;
            let emitted = out.tokens.len() - first;
            out.counts.push(emitted as u32);
            out.proposed.push(row.proposals.len() as u32);
            let pending = row.pending.expect("checked at launch");
            if spec_on {
                row.tokens.truncate(row.kv_len as usize);
                row.tokens.push(pending);
                row.tokens.extend_from_slice(&row.proposals[..accepted]);
            }
            row.kv_len += 1 + accepted as u32;
            row.draft_len = row.draft_len.min(row.kv_len);
            row.pending = out.tokens.last().copied();
        }
        Ok(())
    }
}
