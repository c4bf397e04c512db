//! A fault-injecting wrapper around any executor, for tests of the fault model
//! (reference 000 §4.8): a failure before dispatch rolls the step back; a failure after
//! dispatch is engine-fatal.

use anyhow::anyhow;

use super::{ExecError, Executor, InFlightStep, LaunchHandle};
use crate::batch::{ExecBatch, StepOutput};
use crate::pipeline::SlotId;

/// Where and when to fail. Step numbers count launches from 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// `launch_forward` of step N is rejected before dispatch (recoverable).
    RejectLaunch(u64),
    /// `launch_forward` of step N fails after dispatch (fatal).
    FailLaunch(u64),
    /// `finalize_sampling` of step N fails (fatal).
    FailSampling(u64),
    /// `wait` on step N fails (fatal, as an asynchronous device error would surface).
    FailWait(u64),
}

pub struct FaultyExecutor<E> {
    inner: E,
    fault: Fault,
    launches: u64,
    /// Maps the inner executor's step numbers to launch counts.
    inner_steps: Vec<(u64, u64)>,
}

impl<E: Executor> FaultyExecutor<E> {
    pub fn new(inner: E, fault: Fault) -> Self {
        Self {
            inner,
            fault,
            launches: 0,
            inner_steps: Vec::new(),
        }
    }

    fn launch_index(&self, inner_step: u64) -> u64 {
        self.inner_steps
            .iter()
            .find(|(s, _)| *s == inner_step)
            .map(|&(_, n)| n)
            .unwrap_or(u64::MAX)
    }
}

impl<E: Executor> Executor for FaultyExecutor<E> {
    fn launch_forward(
        &mut self,
        batch: &ExecBatch,
        slot: SlotId,
    ) -> Result<LaunchHandle, ExecError> {
        let n = self.launches;
        self.launches += 1;
        match self.fault {
            Fault::RejectLaunch(at) if at == n => {
                return Err(ExecError::Rejected(format!(
                    "injected rejection at step {n}"
                )))
            }
            Fault::FailLaunch(at) if at == n => {
                return Err(ExecError::Fatal(anyhow!(
                    "injected launch failure at step {n}"
                )))
            }
            _ => {}
        }
        let handle = self.inner.launch_forward(batch, slot)?;
        self.inner_steps.retain(|(s, _)| *s + 8 > handle.step);
        self.inner_steps.push((handle.step, n));
        Ok(handle)
    }

    fn finalize_sampling(&mut self, handle: LaunchHandle) -> Result<InFlightStep, ExecError> {
        let n = self.launch_index(handle.step);
        if self.fault == Fault::FailSampling(n) {
            return Err(ExecError::Fatal(anyhow!(
                "injected sampling failure at step {n}"
            )));
        }
        self.inner.finalize_sampling(handle)
    }

    fn wait(&mut self, step: InFlightStep, out: &mut StepOutput) -> Result<(), ExecError> {
        let n = self.launch_index(step.step);
        if self.fault == Fault::FailWait(n) {
            return Err(ExecError::Fatal(anyhow!(
                "injected device failure surfacing at wait of step {n}"
            )));
        }
        self.inner.wait(step, out)
    }
}
