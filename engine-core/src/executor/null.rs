//! A backend that computes nothing: the token sampled for a row is a hash of the request's
//! seed and its output index. It measures the host-side cost of the engine loop (scheduler,
//! pipeline, output routing) with the model taken out, and lets tests of the loop and the
//! process run without weights. It keeps the real backends' contract: per-row state set by
//! `RowInit`, decode inputs from the row's pending token (checked), FIFO completion.

use anyhow::anyhow;

use super::{ExecError, Executor, InFlightStep, LaunchHandle};
use crate::batch::{ExecBatch, StepOutput};
use crate::pipeline::{SlotId, NUM_SLOTS};

#[derive(Debug, Clone, Copy)]
struct Row {
    seed: u64,
    generated: u32,
    pending: Option<u32>,
}

pub struct NullExecutor {
    vocab: u32,
    rows: Vec<Option<Row>>,
    /// Sampled tokens per slot, produced at `finalize_sampling`.
    outputs: [StepOutput; NUM_SLOTS],
    batches: [ExecBatch; NUM_SLOTS],
    next_step: u64,
    /// Emulated device time per step, spent in `wait` (zero: none).
    step_time: std::time::Duration,
}

impl NullExecutor {
    pub fn new(vocab: u32, max_rows: u32) -> Self {
        Self {
            vocab,
            rows: vec![None; max_rows as usize],
            outputs: Default::default(),
            batches: Default::default(),
            next_step: 0,
            step_time: std::time::Duration::ZERO,
        }
    }

    /// Makes every step take `step_time` (slept in `wait`), like a device would.
    pub fn with_step_time(mut self, step_time: std::time::Duration) -> Self {
        self.step_time = step_time;
        self
    }

    /// The token the null backend samples for a request with `seed` at output `index`.
    pub fn token_for(seed: u64, index: u32, vocab: u32) -> u32 {
        (crate::splitmix::splitmix64(seed ^ crate::splitmix::splitmix64(index as u64))
            % vocab as u64) as u32
    }
}

impl Executor for NullExecutor {
    fn launch_forward(
        &mut self,
        batch: &ExecBatch,
        slot: SlotId,
    ) -> Result<LaunchHandle, ExecError> {
        batch.check().map_err(ExecError::Rejected)?;
        for init in &batch.row_inits {
            let row = self
                .rows
                .get_mut(init.row.0 as usize)
                .ok_or_else(|| ExecError::Rejected(format!("row {} out of range", init.row.0)))?;
            *row = Some(Row {
                seed: init.seed,
                generated: init.output.len() as u32,
                pending: None,
            });
        }
        for s in &batch.seqs {
            let row = self.rows[s.row.0 as usize]
                .as_ref()
                .ok_or_else(|| ExecError::Fatal(anyhow!("uninitialised row {}", s.row.0)))?;
            if s.uses_pending_token() && row.pending.is_none() {
                return Err(ExecError::Fatal(anyhow!(
                    "decode on row {} without a sampled token",
                    s.row.0
                )));
            }
        }
        self.batches[slot.0 as usize].clone_from(batch);
        let step = self.next_step;
        self.next_step += 1;
        Ok(LaunchHandle { slot, step })
    }

    fn finalize_sampling(&mut self, handle: LaunchHandle) -> Result<InFlightStep, ExecError> {
        let LaunchHandle { slot, step } = handle;
        let out = &mut self.outputs[slot.0 as usize];
        out.clear();
        for s in self.batches[slot.0 as usize]
            .seqs
            .iter()
            .filter(|s| s.sample)
        {
            let row = self.rows[s.row.0 as usize]
                .as_mut()
                .expect("checked at launch");
            let t = Self::token_for(row.seed, row.generated, self.vocab);
            row.generated += 1;
            row.pending = Some(t);
            out.push_one(t, None);
        }
        Ok(InFlightStep { slot, step })
    }

    fn wait(&mut self, step: InFlightStep, out: &mut StepOutput) -> Result<(), ExecError> {
        if !self.step_time.is_zero() {
            std::thread::sleep(self.step_time);
        }
        out.clear();
        std::mem::swap(out, &mut self.outputs[step.slot.0 as usize]);
        Ok(())
    }
}
