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

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use anyhow::{anyhow, Context};

use super::{ExecError, Executor, InFlightStep, LaunchHandle};
use crate::batch::{ExecBatch, StepOutput};
use crate::model::{CpuModel, KvCache, SeqChunk};
use crate::pipeline::{SlotId, NUM_SLOTS};
use crate::sampling::{RowSampler, SamplerScratch};

#[derive(Debug, Clone)]
pub struct CpuExecutorConfig {
    pub num_kv_blocks: u32,
    pub block_size: u32,
    pub max_rows: u32,
}

/// A slot's host-side buffers, shared with the compute thread.
#[derive(Default)]
struct Slot {
    batch: Mutex<ExecBatch>,
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
    ) -> anyhow::Result<Self> {
        let cache = KvCache::new(
            kv_config,
            cfg.num_kv_blocks as usize,
            cfg.block_size as usize,
        );
        let slots: Arc<[Slot; NUM_SLOTS]> = Arc::new(Default::default());
        let (tx, rx) = mpsc::channel();
        let stream = Stream {
            model,
            cache,
            vocab: kv_config.vocab_size,
            rows: (0..cfg.max_rows).map(|_| None).collect(),
            logits: Default::default(),
            tokens: Vec::new(),
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
        self.submit(Work::Forward {
            slot: slot.0 as usize,
        })?;
        let step = self.next_step;
        self.next_step += 1;
        Ok(LaunchHandle { slot, step })
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
    /// The last token sampled for this row: the input of its next decode.
    pending: Option<u32>,
    sampler: RowSampler,
}

/// The compute thread's state: model, KV cache, rows, per-slot logits.
struct Stream {
    model: CpuModel,
    cache: KvCache,
    vocab: usize,
    rows: Vec<Option<RowState>>,
    logits: [Vec<f32>; NUM_SLOTS],
    tokens: Vec<u32>,
    scratch: SamplerScratch,
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
        let Self {
            model,
            cache,
            vocab,
            rows,
            logits,
            tokens,
            slots,
            ..
        } = self;
        let batch = lock(&slots[slot].batch);
        for init in &batch.row_inits {
            let row = rows
                .get_mut(init.row.0 as usize)
                .ok_or_else(|| anyhow!("row {} out of range", init.row.0))?;
            *row = Some(RowState {
                block_table: Vec::new(),
                pending: None,
                sampler: RowSampler::new(init),
            });
        }
        tokens.clear();
        for s in &batch.seqs {
            let row = rows
                .get_mut(s.row.0 as usize)
                .and_then(Option::as_mut)
                .ok_or_else(|| anyhow!("step names uninitialised row {}", s.row.0))?;
            let range = s.blocks_start as usize..(s.blocks_start + s.blocks_len) as usize;
            row.block_table.extend_from_slice(&batch.new_blocks[range]);
            tokens.extend_from_slice(
                &batch.host_tokens[s.host_start as usize..(s.host_start + s.host_len) as usize],
            );
            if s.uses_pending_token() {
                let t = row
                    .pending
                    .ok_or_else(|| anyhow!("decode on row {} without a sampled token", s.row.0))?;
                tokens.push(t);
            }
        }
        let mut chunks = Vec::with_capacity(batch.seqs.len());
        let mut offset = 0;
        for s in &batch.seqs {
            let n = s.num_tokens as usize;
            let row = rows[s.row.0 as usize].as_ref().expect("checked above");
            chunks.push(SeqChunk {
                tokens: &tokens[offset..offset + n],
                position: s.position as usize,
                block_table: &row.block_table,
                want_logits: s.sample,
            });
            offset += n;
        }
        let out = &mut logits[slot];
        out.resize(batch.num_samples() * *vocab, 0.0);
        model.forward(&chunks, cache, out)
    }

    fn sample(&mut self, slot: usize) -> anyhow::Result<()> {
        let Self {
            vocab,
            rows,
            logits,
            scratch,
            slots,
            ..
        } = self;
        let batch = lock(&slots[slot].batch);
        let mut done = lock(&slots[slot].done);
        let out = &mut done.output;
        out.clear();
        for (k, s) in batch.seqs.iter().filter(|s| s.sample).enumerate() {
            let row = rows[s.row.0 as usize]
                .as_mut()
                .ok_or_else(|| anyhow!("sampling an uninitialised row"))?;
            let row_logits = &mut logits[slot][k * *vocab..(k + 1) * *vocab];
            let (token, lp) = row.sampler.sample(row_logits, scratch);
            row.pending = Some(token);
            out.tokens.push(token);
            out.logprobs.push(lp);
        }
        Ok(())
    }
}
