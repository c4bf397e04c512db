//! The executor seam: how the engine loop drives a backend, with no backend types.
//!
//! A step goes through three calls, mirroring a CUDA stream (reference 000 §4.5):
//! - [`Executor::launch_forward`] enqueues the step's inputs and forward pass on the slot and
//!   returns at once;
//! - [`Executor::finalize_sampling`] enqueues sampling and the copy of the sampled ids to the
//!   slot's host buffer, anchored to that step alone;
//! - [`Executor::wait`] blocks until that step's copy is done and hands back the tokens.
//!
//! Backends: [`cpu::CpuExecutor`] (a compute thread plays the stream), [`null::NullExecutor`]
//! (no model: measures the loop itself) and, for tests,
//! [`fault::FaultyExecutor`] which injects failures at any of the three calls.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod fault;
pub mod null;

use crate::batch::{ExecBatch, StepOutput, TokenMasks};
use crate::pipeline::{SlotId, SlotOwner};

/// A forward pass enqueued on a slot, not yet sampled.
#[derive(Debug, PartialEq, Eq)]
pub struct LaunchHandle {
    pub slot: SlotId,
    pub step: u64,
}

/// A step whose sampling and output copy are enqueued.
#[derive(Debug, PartialEq, Eq)]
pub struct InFlightStep {
    pub slot: SlotId,
    pub step: u64,
}

impl SlotOwner for LaunchHandle {
    fn slot(&self) -> SlotId {
        self.slot
    }
}

impl SlotOwner for InFlightStep {
    fn slot(&self) -> SlotId {
        self.slot
    }
}

/// Why a backend call failed, and whether the engine can go on (reference 000 §4.8).
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// Refused before anything was enqueued: roll the step back and continue.
    #[error("step rejected before dispatch: {0}")]
    Rejected(String),
    /// Failed after work was enqueued: the backend's state is unknown; engine-fatal.
    #[error("backend failure: {0:#}")]
    Fatal(anyhow::Error),
}

/// How a backend ran its steps, reported in the engine's stats and /metrics so that a silent
/// fall back from CUDA graphs to eager launches is visible. Backends without graphs report
/// zeros.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExecCounters {
    /// Decode steps replayed from a captured graph.
    pub graph_replays: u64,
    /// Decode-only steps launched eagerly (larger than every bucket, or graphs off).
    pub eager_decode_steps: u64,
    /// Steps with prefill work, always eager.
    pub eager_other_steps: u64,
}

pub trait Executor {
    /// Enqueues `batch` on `slot`. `slot` is free (no in-flight step uses it, I6).
    fn launch_forward(
        &mut self,
        batch: &ExecBatch,
        slot: SlotId,
    ) -> Result<LaunchHandle, ExecError>;

    /// Enqueues sampling for the launched step and the copy of its outputs.
    fn finalize_sampling(&mut self, handle: LaunchHandle) -> Result<InFlightStep, ExecError>;

    /// Blocks until `step`'s outputs are on the host; fills `out` (cleared first).
    fn wait(&mut self, step: InFlightStep, out: &mut StepOutput) -> Result<(), ExecError>;

    /// How steps ran so far.
    fn counters(&self) -> ExecCounters {
        ExecCounters::default()
    }

    /// Whether [`Executor::set_token_masks`] works (structured outputs).
    fn supports_token_masks(&self) -> bool {
        false
    }

    /// Sets the allowed-token masks of the launched step on `slot` (called after
    /// `launch_forward`, before `finalize_sampling`; while the forward runs).
    fn set_token_masks(&mut self, slot: SlotId, masks: &TokenMasks) -> Result<(), ExecError> {
        let _ = (slot, masks);
        Err(ExecError::Rejected(
            "this backend does not apply token masks (structured outputs)".into(),
        ))
    }
}

impl<E: Executor + ?Sized> Executor for Box<E> {
    fn launch_forward(
        &mut self,
        batch: &ExecBatch,
        slot: SlotId,
    ) -> Result<LaunchHandle, ExecError> {
        (**self).launch_forward(batch, slot)
    }
    fn finalize_sampling(&mut self, handle: LaunchHandle) -> Result<InFlightStep, ExecError> {
        (**self).finalize_sampling(handle)
    }
    fn wait(&mut self, step: InFlightStep, out: &mut StepOutput) -> Result<(), ExecError> {
        (**self).wait(step, out)
    }
    fn counters(&self) -> ExecCounters {
        (**self).counters()
    }
    fn supports_token_masks(&self) -> bool {
        (**self).supports_token_masks()
    }
    fn set_token_masks(&mut self, slot: SlotId, masks: &TokenMasks) -> Result<(), ExecError> {
        (**self).set_token_masks(slot, masks)
    }
}
