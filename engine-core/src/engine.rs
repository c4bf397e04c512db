//! The engine loop (reference 000 §4.6): one call of [`EngineCore::step`] makes one transition.
//!
//! ```text
//! step():
//!   1. launch   if no forward awaits sampling and a slot is free: schedule; launch the plan
//!               (or, if the plan needs a drained pipeline, commit the oldest step instead)
//!   2. finalize if a forward awaits sampling: enqueue its sampling + output copy
//!   3. commit   else: wait for the oldest step's outputs and commit them (FIFO)
//!   4. idle     nothing launched, queued or schedulable
//! ```
//!
//! With depth 2 this keeps one step queued on the backend while the host commits the previous
//! one; with depth 1 it is the synchronous loop (launch, sample, wait, commit).
//!
//! Faults (reference 000 §4.8): a launch rejected before dispatch rolls its step back (its
//! requests finish with an error) and the loop goes on; any other backend error is returned
//! as [`EngineFatal`] after every accepted request was finished with an error.

use std::collections::HashMap;
use std::time::Instant;

use harrier_shared::protocol::{
    EngineCoreRequest, EngineStats, Finish, FinishReason, RequestOutput,
};

use crate::batch::{ExecBatch, StepOutput};
use crate::config::EngineConfig;
use crate::executor::{ExecError, Executor, InFlightStep, LaunchHandle};
use crate::pipeline::{PipelineState, SlotId, NUM_SLOTS};
use crate::request::{Origin, Request, RequestId};
use crate::scheduler::{Decision, OutputSink, Scheduler, SchedulerConfig, StepEntry, StepPlan};
use crate::splitmix::SplitMix64;
use crate::structured::{CompileWorker, GrammarCompiler, Waker};
use std::sync::Arc;

/// The backend failed after dispatch; the engine must exit (its requests were answered).
#[derive(Debug, thiserror::Error)]
#[error("engine-fatal backend error: {0}")]
pub struct EngineFatal(pub String);

/// The message of the `abort` that ends every request at a graceful shutdown.
pub const SHUTDOWN_MESSAGE: &str = "the engine is shutting down";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    Worked,
    Idle,
}

/// What the engine needs to know about the model it serves.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelFacts {
    pub vocab_size: u32,
    pub eos_token_ids: Vec<u32>,
}

/// Per-slot host state: the batch sent to the backend and the step's membership record.
#[derive(Default)]
struct SlotState {
    batch: ExecBatch,
    record: Vec<StepEntry>,
    launched_at: Option<Instant>,
    /// Token masks of the step's constrained rows.
    masks: crate::batch::TokenMasks,
}

/// Structured outputs: the compiler for the served tokenizer, its worker thread (started
/// with the first constrained request) and the requests waiting for their grammar.
struct Structured {
    compiler: Arc<GrammarCompiler>,
    worker: Option<CompileWorker>,
    waker: Waker,
    /// Requests whose grammar is compiling: outside the scheduler until it is ready.
    compiling: HashMap<RequestId, Request>,
}

pub struct EngineCore<E: Executor> {
    cfg: EngineConfig,
    model: ModelFacts,
    sched: Scheduler,
    exec: E,
    pipeline: PipelineState<LaunchHandle, InFlightStep>,
    slots: [SlotState; NUM_SLOTS],
    step_output: StepOutput,
    sink: OutputSink,
    /// Front-end request ids of unfinished requests, per front end.
    ids: HashMap<Origin, HashMap<String, RequestId>>,
    next_id: u64,
    /// Seeds for requests that gave none.
    seeds: SplitMix64,
    steps_total: u64,
    last_step_us: u32,
    /// Launch nothing new (in-flight steps still complete).
    paused: bool,
    structured: Option<Structured>,
}

impl<E: Executor> EngineCore<E> {
    pub fn new(
        cfg: EngineConfig,
        model: ModelFacts,
        exec: E,
    ) -> Result<Self, crate::config::ConfigError> {
        cfg.validate()?;
        let sched = Scheduler::new(SchedulerConfig {
            max_num_seqs: cfg.max_num_seqs,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            max_model_len: cfg.max_model_len,
            block_size: cfg.block_size,
            num_kv_blocks: cfg.num_kv_blocks,
            max_inflight_refs: cfg.pipeline.max_in_flight() as u8,
            eos_token_ids: model.eos_token_ids.clone(),
            enable_prefix_caching: cfg.enable_prefix_caching,
            policy: cfg.policy,
            num_speculative_tokens: cfg.num_speculative_tokens,
            spec_disable_batch_size: cfg.spec_disable_batch_size,
            local_kv: cfg.local_kv,
        });
        let seed_state = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x5eed);
        Ok(Self {
            pipeline: PipelineState::new(cfg.pipeline.max_in_flight()),
            cfg,
            model,
            sched,
            exec,
            slots: Default::default(),
            step_output: StepOutput::default(),
            sink: Vec::new(),
            ids: HashMap::new(),
            next_id: 0,
            seeds: SplitMix64(seed_state),
            steps_total: 0,
            last_step_us: 0,
            paused: false,
            structured: None,
        })
    }

    /// Serves structured outputs with `compiler` (the served tokenizer's). Without it (or
    /// with a backend that cannot apply token masks) constrained requests are refused.
    pub fn enable_structured_outputs(&mut self, compiler: Arc<GrammarCompiler>) {
        self.structured = Some(Structured {
            compiler,
            worker: None,
            waker: Arc::new(|| {}),
            compiling: HashMap::new(),
        });
    }

    /// Called by the grammar compiler thread when a grammar is ready: the server wakes its
    /// idle engine thread with it.
    pub fn set_waker(&mut self, waker: Waker) {
        if let Some(s) = &mut self.structured {
            s.waker = waker;
        }
    }

    /// Moves compiled requests into the scheduler (or finishes those whose grammar failed).
    fn take_compiled(&mut self) {
        loop {
            let Some(s) = &mut self.structured else {
                return;
            };
            let Some((id, result)) = s.worker.as_ref().and_then(CompileWorker::try_recv) else {
                return;
            };
            // Gone if it was aborted while compiling.
            let Some(mut request) = s.compiling.remove(&RequestId(id)) else {
                continue;
            };
            match result {
                Ok(grammar) => {
                    request.grammar = Some(grammar);
                    self.sched.add(request);
                }
                Err(e) => {
                    let message = format!("invalid structured-output constraint: {e}");
                    self.reject(request.origin, request.external_id, message);
                }
            }
        }
    }

    /// The backend (tools compare backend settings on one loaded model).
    pub fn executor_mut(&mut self) -> &mut E {
        &mut self.exec
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    /// Stops launching steps; in-flight steps still complete (reference 000 §4.5a). Requests
    /// keep arriving and wait. Pause is acknowledged once [`Self::is_drained`].
    pub fn pause(&mut self) {
        self.paused = true;
    }

    pub fn resume(&mut self) {
        self.paused = false;
    }

    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// No step launched, queued or being committed.
    pub fn is_drained(&self) -> bool {
        self.pipeline.is_drained()
    }

    /// Forgets every cached prefix. Safe while steps are in flight: blocks in use keep their
    /// KV for their owners, so no output becomes stale; only future hits are lost.
    pub fn reset_prefix_cache(&mut self) {
        self.sched.reset_prefix_cache();
    }

    /// True while requests are queued, running or in flight.
    pub fn has_work(&self) -> bool {
        self.sched.has_work()
            || !self.pipeline.is_drained()
            || self
                .structured
                .as_ref()
                .is_some_and(|s| !s.compiling.is_empty())
    }

    /// Outputs produced since the last call, tagged with their front end.
    pub fn take_outputs(&mut self) -> std::vec::Drain<'_, (Origin, RequestOutput)> {
        for (origin, out) in &self.sink {
            if out.finish.is_some() {
                if let Some(m) = self.ids.get_mut(origin) {
                    m.remove(&out.request_id);
                }
            }
        }
        self.sink.drain(..)
    }

    pub fn stats(&self) -> EngineStats {
        let c = self.sched.counters();
        let x = self.exec.counters();
        EngineStats {
            num_running: self.sched.num_running() as u32,
            num_waiting: self.sched.num_waiting() as u32,
            kv_blocks_used: self.sched.kv().num_used(),
            kv_blocks_total: self.sched.kv().num_usable(),
            sliding_kv_blocks_used: self.sched.local_kv().map_or(0, |l| l.num_used()),
            sliding_kv_blocks_total: self.sched.local_kv().map_or(0, |l| l.num_usable()),
            last_step_us: self.last_step_us,
            steps_total: self.steps_total,
            preemptions_total: c.preemptions,
            prefix_cache_queries_total: c.prefix_cache_queries,
            prefix_cache_hits_total: c.prefix_cache_hits,
            prompt_tokens_total: c.prompt_tokens,
            generation_tokens_total: c.generation_tokens,
            graph_replays_total: x.graph_replays,
            eager_decode_steps_total: x.eager_decode_steps,
            spec_drafts_total: c.spec.drafts,
            spec_draft_tokens_total: c.spec.draft_tokens,
            spec_accepted_tokens_total: c.spec.accepted_tokens,
            spec_accepted_per_pos_total: c.spec.accepted_per_pos,
        }
    }

    fn reject(&mut self, origin: Origin, request_id: String, message: String) {
        tracing::debug!(%request_id, "request rejected: {message}");
        let finish = Finish {
            reason: FinishReason::Error,
            stop_token: None,
            message: Some(message),
            timing: None,
            spec: None,
        };
        self.push_finish(origin, request_id, finish);
    }

    /// The last output of a request the scheduler never held (rejected, or ended while its
    /// grammar compiled). `take_outputs` forgets its id.
    fn push_finish(&mut self, origin: Origin, request_id: String, finish: Finish) {
        self.sink.push((
            origin,
            RequestOutput {
                request_id,
                new_token_ids: Vec::new(),
                logprobs: None,
                finish: Some(finish),
                num_cached_tokens: None,
            },
        ));
    }

    /// Validates and queues a request; an invalid one finishes at once with an error.
    pub fn add_request(&mut self, origin: Origin, req: EngineCoreRequest) {
        let EngineCoreRequest {
            request_id,
            prompt_token_ids,
            sampling,
            arrival_time: _,
            cache_salt,
        } = req;
        let problem = if prompt_token_ids.is_empty() {
            Some("the prompt must contain at least one token".to_string())
        } else if let Some(&t) = prompt_token_ids
            .iter()
            .find(|&&t| t >= self.model.vocab_size)
        {
            Some(format!(
                "token id {t} is out of range for the vocabulary of {} tokens",
                self.model.vocab_size
            ))
        } else if prompt_token_ids.len() as u32 >= self.cfg.max_model_len {
            Some(format!(
                "the prompt has {} tokens but the maximum model length is {} (including at least one generated token)",
                prompt_token_ids.len(),
                self.cfg.max_model_len
            ))
        } else if let Err(e) = sampling.validate(self.cfg.max_logprobs) {
            Some(format!("{}: {}", e.param, e.message))
        } else if sampling.structured.is_some()
            && (self.structured.is_none() || !self.exec.supports_token_masks())
        {
            Some(if self.structured.is_none() {
                "structured outputs need the model's tokenizer.json in its directory".to_string()
            } else {
                "structured outputs are not supported on this backend yet".to_string()
            })
        } else if self
            .ids
            .get(&origin)
            .is_some_and(|m| m.contains_key(&request_id))
        {
            // Answering on that id would end the original request in the front end's eyes.
            tracing::warn!(%request_id, origin = origin.0, "dropping a request whose id is already in use");
            return;
        } else {
            None
        };
        if let Some(message) = problem {
            return self.reject(origin, request_id, message);
        }
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let seed = sampling.seed.unwrap_or_else(|| self.seeds.next_u64());
        self.ids
            .entry(origin)
            .or_default()
            .insert(request_id.clone(), id);
        let mut request = Request::new(id, origin, request_id, prompt_token_ids, sampling, seed);
        // Salted requests hash their first block differently (never 0 = unsalted in practice).
        request.cache_salt =
            cache_salt.map_or(0, |s| xxhash_rust::xxh64::xxh64(s.as_bytes(), 0x5a17_5a17));
        if let Some(spec) = request.sampling.structured.as_deref().cloned() {
            let s = self.structured.as_mut().expect("checked above");
            if s.worker.is_none() {
                match CompileWorker::start(s.compiler.clone(), s.waker.clone()) {
                    Ok(w) => s.worker = Some(w),
                    Err(e) => {
                        return self.reject(request.origin, request.external_id, format!("{e:#}"))
                    }
                }
            }
            s.worker.as_ref().expect("started").submit(id.0, spec);
            s.compiling.insert(id, request);
            return;
        }
        self.sched.add(request);
    }

    /// Aborts the front end's requests by id; unknown or finished ids are ignored.
    pub fn abort(&mut self, origin: Origin, request_ids: &[String]) {
        for rid in request_ids {
            if let Some(id) = self.ids.get(&origin).and_then(|m| m.get(rid)).copied() {
                if !self.abort_compiling(id) {
                    self.sched.abort(id, &mut self.sink);
                }
            }
        }
        self.debug_check();
    }

    /// Aborts everything a front end sent (it went away).
    pub fn abort_origin(&mut self, origin: Origin) {
        if let Some(m) = self.ids.get(&origin) {
            let ids: Vec<RequestId> = m.values().copied().collect();
            for id in ids {
                if !self.abort_compiling(id) {
                    self.sched.abort(id, &mut self.sink);
                }
            }
        }
        self.debug_check();
    }

    /// Aborts a request whose grammar is still compiling; false if it is not one.
    fn abort_compiling(&mut self, id: RequestId) -> bool {
        let Some(r) = self
            .structured
            .as_mut()
            .and_then(|s| s.compiling.remove(&id))
        else {
            return false;
        };
        let finish = Finish {
            reason: FinishReason::Abort,
            stop_token: None,
            message: None,
            timing: Some(r.timing(Instant::now())),
            spec: None,
        };
        self.push_finish(r.origin, r.external_id, finish);
        true
    }

    /// One transition of the loop.
    pub fn step(&mut self) -> Result<Progress, EngineFatal> {
        let result = self.try_step();
        if let Err(e) = &result {
            self.fail(&e.0);
        }
        result
    }

    fn try_step(&mut self) -> Result<Progress, EngineFatal> {
        self.take_compiled();
        if !self.pipeline.has_launch() && !self.paused {
            if let Some(slot) = self.pipeline.free_slot() {
                match self.sched.schedule(self.pipeline.is_drained()) {
                    Decision::Launch(plan) => {
                        self.launch(&plan, slot)?;
                        if !self.pipeline.has_launch() {
                            return Ok(Progress::Worked); // rejected and rolled back
                        }
                    }
                    Decision::DrainFirst => {
                        let committed = self.commit_oldest()?;
                        debug_assert!(committed, "DrainFirst with nothing queued");
                        return Ok(Progress::Worked);
                    }
                    Decision::Idle => {}
                }
            }
        }
        if let Some(handle) = self.pipeline.take_launch() {
            let step = self.exec.finalize_sampling(handle).map_err(fatal)?;
            self.pipeline.on_pending_commit(step);
            return Ok(Progress::Worked);
        }
        if self.commit_oldest()? {
            return Ok(Progress::Worked);
        }
        Ok(Progress::Idle)
    }

    fn launch(&mut self, plan: &StepPlan, slot: SlotId) -> Result<(), EngineFatal> {
        let st = &mut self.slots[slot.0 as usize];
        self.sched.apply(plan, &mut st.batch, &mut st.record);
        match self.exec.launch_forward(&st.batch, slot) {
            Ok(handle) => {
                st.launched_at = Some(Instant::now());
                self.pipeline.on_launch(handle);
                // Constrained rows' masks, computed on this thread while the forward runs.
                if let Some(s) = &self.structured {
                    self.sched
                        .token_masks(&st.record, s.compiler.mask_words(), &mut st.masks);
                    if !st.masks.is_empty() {
                        self.exec.set_token_masks(slot, &st.masks).map_err(fatal)?;
                    }
                }
            }
            Err(ExecError::Rejected(message)) => {
                tracing::warn!("step rejected before dispatch, rolling back: {message}");
                self.sched.rollback(&st.record, &message, &mut self.sink);
                st.record.clear();
            }
            Err(e @ ExecError::Fatal(_)) => return Err(fatal(e)),
        }
        self.debug_check();
        Ok(())
    }

    /// Waits for and commits the oldest in-flight step; false if none is queued.
    fn commit_oldest(&mut self) -> Result<bool, EngineFatal> {
        let Some(step) = self.pipeline.pop_oldest() else {
            return Ok(false);
        };
        let slot = step.slot.0 as usize;
        self.exec.wait(step, &mut self.step_output).map_err(fatal)?;
        let st = &mut self.slots[slot];
        self.sched
            .commit(&st.record, &self.step_output, &mut self.sink);
        st.record.clear();
        if let Some(t) = st.launched_at.take() {
            self.last_step_us = t.elapsed().as_micros().min(u32::MAX as u128) as u32;
        }
        self.steps_total += 1;
        self.pipeline.on_step_completed();
        self.debug_check();
        Ok(true)
    }

    /// Commits every in-flight step, in order.
    pub fn drain(&mut self) -> Result<(), EngineFatal> {
        while !self.pipeline.is_drained() {
            if let Some(handle) = self.pipeline.take_launch() {
                let step = self.exec.finalize_sampling(handle).map_err(fatal)?;
                self.pipeline.on_pending_commit(step);
            }
            self.commit_oldest()?;
        }
        Ok(())
    }

    /// Graceful stop: commits in-flight steps, then ends every request with `abort`.
    pub fn shutdown(&mut self) -> Result<(), EngineFatal> {
        let drained = self.drain();
        if drained.is_ok() {
            let finish = Finish {
                reason: FinishReason::Abort,
                stop_token: None,
                message: Some(SHUTDOWN_MESSAGE.into()),
                timing: None,
                spec: None,
            };
            self.finish_compiling(&finish);
            self.sched.finish_all(finish, &mut self.sink);
        }
        drained
    }

    /// Finishes every request still waiting for its grammar (shutdown, engine-fatal error).
    fn finish_compiling(&mut self, finish: &Finish) {
        let Some(s) = &mut self.structured else {
            return;
        };
        let mut waiting: Vec<Request> = s.compiling.drain().map(|(_, r)| r).collect();
        waiting.sort_by_key(|r| r.id);
        for r in waiting {
            self.push_finish(r.origin, r.external_id, finish.clone());
        }
    }

    /// Engine-fatal path: every accepted request gets an error; all state is released.
    fn fail(&mut self, message: &str) {
        tracing::error!("{message}");
        let finish = Finish {
            reason: FinishReason::Error,
            stop_token: None,
            message: Some(message.to_string()),
            timing: None,
            spec: None,
        };
        self.finish_compiling(&finish);
        self.sched.finish_all(finish, &mut self.sink);
        self.pipeline.clear();
        for st in &mut self.slots {
            st.record.clear();
        }
        self.sched.release_all();
    }

    fn debug_check(&self) {
        if cfg!(debug_assertions) {
            self.sched
                .check_invariants(self.slots.iter().map(|s| s.record.as_slice()));
        }
    }
}

fn fatal(e: ExecError) -> EngineFatal {
    EngineFatal(e.to_string())
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use harrier_shared::protocol::SamplingParams;

    use super::*;
    use crate::config::PipelineDepth;
    use crate::executor::null::NullExecutor;

    /// Records the order of backend calls.
    struct Recorder {
        inner: NullExecutor,
        log: Arc<Mutex<Vec<String>>>,
    }

    impl Executor for Recorder {
        fn launch_forward(
            &mut self,
            batch: &ExecBatch,
            slot: SlotId,
        ) -> Result<LaunchHandle, ExecError> {
            let h = self.inner.launch_forward(batch, slot)?;
            let kind = if batch.has_prefill() { "P" } else { "D" };
            self.log
                .lock()
                .unwrap()
                .push(format!("launch{kind}{}", h.step));
            Ok(h)
        }
        fn finalize_sampling(&mut self, handle: LaunchHandle) -> Result<InFlightStep, ExecError> {
            self.log
                .lock()
                .unwrap()
                .push(format!("sample{}", handle.step));
            self.inner.finalize_sampling(handle)
        }
        fn wait(&mut self, step: InFlightStep, out: &mut StepOutput) -> Result<(), ExecError> {
            self.log.lock().unwrap().push(format!("wait{}", step.step));
            self.inner.wait(step, out)
        }
    }

    fn engine(depth: PipelineDepth) -> (EngineCore<Recorder>, Arc<Mutex<Vec<String>>>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let exec = Recorder {
            inner: NullExecutor::new(100, 8),
            log: log.clone(),
        };
        let cfg = EngineConfig {
            max_num_seqs: 8,
            num_kv_blocks: 64,
            max_model_len: 256,
            pipeline: depth,
            ..EngineConfig::default()
        };
        (
            EngineCore::new(
                cfg,
                ModelFacts {
                    vocab_size: 100,
                    eos_token_ids: vec![],
                },
                exec,
            )
            .unwrap(),
            log,
        )
    }

    fn req(id: &str, max_tokens: u32) -> EngineCoreRequest {
        EngineCoreRequest {
            request_id: id.into(),
            prompt_token_ids: vec![1, 2, 3],
            sampling: SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(max_tokens)
            },
            arrival_time: 0.0,
            cache_salt: None,
        }
    }

    fn run(e: &mut EngineCore<Recorder>) {
        while e.step().unwrap() == Progress::Worked {}
    }

    #[test]
    fn async_loop_launches_the_next_step_before_committing_the_last() {
        let (mut e, log) = engine(PipelineDepth::Async);
        e.add_request(Origin(0), req("a", 4));
        run(&mut e);
        let log = log.lock().unwrap().join(" ");
        assert!(
            log.starts_with("launchP0 sample0 launchD1 sample1 wait0 launchD2 sample2 wait1"),
            "{log}"
        );
    }

    #[test]
    fn sync_loop_commits_each_step_before_the_next() {
        let (mut e, log) = engine(PipelineDepth::Sync);
        e.add_request(Origin(0), req("a", 3));
        run(&mut e);
        assert_eq!(
            log.lock().unwrap().join(" "),
            "launchP0 sample0 wait0 launchD1 sample1 wait1 launchD2 sample2 wait2"
        );
    }

    #[test]
    fn a_new_request_is_prefilled_within_two_completions() {
        let (mut e, log) = engine(PipelineDepth::Async);
        e.add_request(Origin(0), req("a", 50));
        for _ in 0..12 {
            e.step().unwrap();
        }
        let before = log.lock().unwrap().len();
        e.add_request(Origin(0), req("b", 5));
        for _ in 0..10 {
            e.step().unwrap();
        }
        let l = log.lock().unwrap();
        let after = &l[before..];
        let prefill = after
            .iter()
            .position(|x| x.starts_with("launchP"))
            .expect("prefill launched");
        let waits = after[..prefill]
            .iter()
            .filter(|x| x.starts_with("wait"))
            .count();
        assert!(
            waits <= 2,
            "prefill began after {waits} completions: {after:?}"
        );
        assert!(
            after[..prefill].iter().all(|x| !x.starts_with("launch")),
            "no new decode launched while draining: {after:?}"
        );
    }

    #[test]
    fn outputs_are_tagged_and_finished_ids_are_forgotten() {
        let (mut e, _) = engine(PipelineDepth::Async);
        e.add_request(Origin(3), req("x", 2));
        run(&mut e);
        let outs: Vec<_> = e.take_outputs().collect();
        assert!(outs
            .iter()
            .all(|(o, r)| *o == Origin(3) && r.request_id == "x"));
        assert_eq!(
            outs.iter()
                .map(|(_, r)| r.new_token_ids.len())
                .sum::<usize>(),
            2
        );
        assert_eq!(
            outs.last().unwrap().1.finish.as_ref().unwrap().reason,
            FinishReason::Length
        );
        // The id is free again once its finish was taken.
        e.add_request(Origin(3), req("x", 1));
        run(&mut e);
        assert_eq!(e.take_outputs().count(), 1);
    }
}
