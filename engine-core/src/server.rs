//! The engine-core process: sockets, front-end bookkeeping, heartbeats, signals.
//!
//! ```text
//!   ZeroMQ ROUTER task ──Inbound──► bridge (tokio) ──EngineInput (std mpsc)──► engine thread
//!          ▲                          │  ▲                                     (owns EngineCore:
//!          └────────Outbound──────────┘  └──────EngineEvent (tokio mpsc)─────── scheduler, pipeline,
//!                                                                               executor)
//! ```
//!
//! - The bridge answers the handshake, tracks front ends (an [`Origin`] per peer), answers
//!   health and stats calls from the latest stats snapshot, sends heartbeats every
//!   `heartbeat` interval, and declares a front end gone after `frontend_timeout` of silence
//!   (counted only while this process runs: [`harrier_shared::liveness`]) or when the socket
//!   reports it lost: the engine then aborts its requests.
//! - The engine thread drains its input channel without blocking between steps and blocks on
//!   it only when idle. Outputs leave once per step, one message per front end.
//! - SIGTERM/SIGINT: in-flight steps are committed, every request ends with `abort`, the
//!   process exits 0. Requests that reach the bridge once the shutdown has begun are answered
//!   with `abort` by the bridge itself (the engine thread may already have finished). An engine-fatal error ends every request with `error` and the process
//!   exits non-zero so its supervisor restarts it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use anyhow::Context;
use harrier_shared::endpoint::Endpoint;
use harrier_shared::liveness::{discounted, StallClock};
use harrier_shared::protocol::{
    EngineCoreOutputs, EngineCoreRequest, EngineInfo, EngineMessage, EngineStats, Finish,
    FinishReason, FrontendMessage, Rejected, RequestOutput, UtilityCall, UtilityReply,
    UtilityResult, PROTOCOL_VERSION,
};
use harrier_shared::transport::{EngineTransport, Inbound, Outbound, PeerId};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::engine::{EngineCore, EngineFatal, Progress, SHUTDOWN_MESSAGE};
use crate::executor::Executor;
use crate::request::Origin;

/// Timing knobs of the engine process.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    pub heartbeat: Duration,
    pub frontend_timeout: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            heartbeat: Duration::from_millis(250),
            frontend_timeout: Duration::from_secs(5),
        }
    }
}

/// Work handed from the bridge to the engine thread.
#[derive(Debug)]
pub enum EngineInput {
    Request(Origin, EngineCoreRequest),
    /// A grammar finished compiling: wakes an idle engine thread.
    Wake,
    Abort(Origin, Vec<String>),
    FrontendGone(Origin),
    /// Pause, resume or reset, answered by the engine thread.
    Utility(Origin, u64, UtilityCall),
    Shutdown,
}

/// What the engine thread sends back to the bridge.
// `Outputs` (with the step's stats) is far larger than `Reply`; boxing it would add an
// allocation per step and front end on the engine thread for nothing: each event is moved
// once, through the channel.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum EngineEvent {
    /// The outputs of one step for one front end.
    Outputs(Origin, EngineCoreOutputs),
    Reply(Origin, UtilityReply),
}

/// Serves `engine` on `endpoint` until `shutdown` resolves (graceful) or the engine fails.
pub async fn serve<E>(
    engine: EngineCore<E>,
    info: EngineInfo,
    endpoint: &Endpoint,
    opts: ServerOptions,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()>
where
    E: Executor + Send + 'static,
{
    let mut transport = EngineTransport::bind(endpoint)
        .await
        .with_context(|| format!("binding the engine socket at {endpoint}"))?;
    tracing::info!(endpoint = %transport.endpoint(), model = %info.model_name, "engine core ready");
    let (input_tx, input_rx) = std_mpsc::channel();
    let mut engine = engine;
    let wake_tx = input_tx.clone();
    engine.set_waker(std::sync::Arc::new(move || {
        let _ = wake_tx.send(EngineInput::Wake);
    }));
    let (event_tx, mut event_rx) = mpsc::unbounded_channel();
    let (stats_tx, stats_rx) = watch::channel(engine.stats());
    let engine_thread = std::thread::Builder::new()
        .name("harrier-engine".into())
        .spawn(move || engine_loop(engine, input_rx, event_tx, stats_tx))
        .context("spawning the engine thread")?;

    let mut bridge = Bridge {
        info,
        peers: HashMap::new(),
        origins: HashMap::new(),
        next_origin: 0,
        input: input_tx,
        outbound: transport.outbound.clone(),
        stats: stats_rx,
        shutting_down: false,
        clock: StallClock::new(opts.heartbeat, Instant::now()),
    };
    let mut heartbeat = tokio::time::interval(opts.heartbeat);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            inbound = transport.inbound.recv() => match inbound {
                Some(inbound) => bridge.on_inbound(inbound),
                None => {
                    tracing::error!("the engine socket task ended");
                    bridge.begin_shutdown();
                }
            },
            event = event_rx.recv() => match event {
                Some(EngineEvent::Outputs(origin, outputs)) => bridge.send_to(origin, EngineMessage::Outputs(outputs)),
                Some(EngineEvent::Reply(origin, reply)) => bridge.send_to(origin, EngineMessage::UtilityReply(reply)),
                None => break, // the engine thread ended
            },
            _ = heartbeat.tick() => bridge.on_heartbeat(opts.frontend_timeout, Instant::now()),
            _ = &mut shutdown, if !bridge.shutting_down => {
                tracing::info!("shutting down: finishing in-flight steps, aborting requests");
                bridge.begin_shutdown();
            }
        }
    }
    let result = engine_thread
        .join()
        .map_err(|_| anyhow::anyhow!("the engine thread panicked"))?;
    // Let the socket task send the last outputs before the socket closes.
    drop(bridge);
    match tokio::time::timeout(Duration::from_secs(2), transport.close()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!("closing the engine socket: {e:#}"),
        Err(_) => tracing::warn!("the engine socket did not close within 2 s"),
    }
    result.map_err(anyhow::Error::from)
}

struct PeerState {
    origin: Origin,
    last_seen: Instant,
}

struct Bridge {
    info: EngineInfo,
    peers: HashMap<PeerId, PeerState>,
    origins: HashMap<Origin, PeerId>,
    next_origin: u32,
    input: std_mpsc::Sender<EngineInput>,
    outbound: mpsc::UnboundedSender<Outbound>,
    stats: watch::Receiver<EngineStats>,
    /// The engine thread was told to shut down: new requests are refused here.
    shutting_down: bool,
    /// How late the heartbeat ticks came: a stall of this process is no front end's silence
    /// ([`harrier_shared::liveness`]).
    clock: StallClock,
}

impl Bridge {
    fn send(&self, peer: &PeerId, msg: EngineMessage) {
        if self
            .outbound
            .send(Outbound {
                peer: peer.clone(),
                msg,
            })
            .is_err()
        {
            tracing::error!("the engine socket task is gone; dropping a message");
        }
    }

    fn begin_shutdown(&mut self) {
        self.shutting_down = true;
        self.send_input(EngineInput::Shutdown);
    }

    /// Ends a request that arrived after the shutdown began with `abort`, as the engine's own
    /// shutdown ends the ones it holds: past its `Shutdown` input the engine thread may have
    /// finished, and a request forwarded to it then would never be answered.
    fn refuse_during_shutdown(&self, peer: &PeerId, request_id: String) {
        let output = RequestOutput {
            request_id,
            new_token_ids: Vec::new(),
            logprobs: None,
            finish: Some(Finish {
                reason: FinishReason::Abort,
                stop_token: None,
                message: Some(SHUTDOWN_MESSAGE.into()),
                timing: None,
                spec: None,
            }),
            num_cached_tokens: None,
        };
        self.send(
            peer,
            EngineMessage::Outputs(EngineCoreOutputs {
                step: 0,
                outputs: vec![output],
                stats: *self.stats.borrow(),
            }),
        );
    }

    fn send_input(&self, input: EngineInput) {
        if self.input.send(input).is_err() {
            tracing::debug!("the engine thread has stopped; input dropped");
        }
    }

    fn on_inbound(&mut self, inbound: Inbound) {
        match inbound {
            Inbound::Message { peer, msg } => self.on_message(peer, msg),
            Inbound::PeerLost { peer } => self.forget(&peer, "its connection was lost"),
        }
    }

    fn on_message(&mut self, peer: PeerId, msg: FrontendMessage) {
        if let FrontendMessage::Hello(hello) = &msg {
            if hello.protocol_version != PROTOCOL_VERSION {
                tracing::warn!(name = %hello.name, theirs = hello.protocol_version, ours = PROTOCOL_VERSION, "rejecting a front end with another protocol version");
                let reason = format!(
                    "protocol version mismatch: front end speaks {}, engine core speaks {}",
                    hello.protocol_version, PROTOCOL_VERSION
                );
                return self.send(
                    &peer,
                    EngineMessage::Rejected(Rejected {
                        engine_protocol_version: PROTOCOL_VERSION,
                        reason,
                    }),
                );
            }
            if !self.peers.contains_key(&peer) {
                let origin = Origin(self.next_origin);
                self.next_origin += 1;
                tracing::info!(name = %hello.name, origin = origin.0, "front end connected");
                self.peers.insert(
                    peer.clone(),
                    PeerState {
                        origin,
                        last_seen: Instant::now(),
                    },
                );
                self.origins.insert(origin, peer.clone());
            }
            return self.send(&peer, EngineMessage::Welcome(self.info.clone()));
        }
        let Some(state) = self.peers.get_mut(&peer) else {
            tracing::warn!(
                ?peer,
                "dropping a message from a front end that has not said hello"
            );
            return;
        };
        state.last_seen = Instant::now();
        let origin = state.origin;
        match msg {
            FrontendMessage::Hello(_) => unreachable!("handled above"),
            FrontendMessage::Request(r) if self.shutting_down => {
                self.refuse_during_shutdown(&peer, r.request_id)
            }
            FrontendMessage::Request(r) => self.send_input(EngineInput::Request(origin, r)),
            FrontendMessage::Abort(a) => self.send_input(EngineInput::Abort(origin, a.request_ids)),
            FrontendMessage::Utility(u) => {
                let result = match u.call {
                    UtilityCall::Health => UtilityResult::Health { healthy: true },
                    UtilityCall::Stats => UtilityResult::Stats(Box::new(*self.stats.borrow())),
                    call @ (UtilityCall::Pause
                    | UtilityCall::Resume
                    | UtilityCall::ResetPrefixCache) => {
                        return self.send_input(EngineInput::Utility(origin, u.call_id, call));
                    }
                };
                self.send(
                    &peer,
                    EngineMessage::UtilityReply(UtilityReply {
                        call_id: u.call_id,
                        result,
                    }),
                );
            }
            FrontendMessage::Heartbeat => {}
            FrontendMessage::Goodbye => self.forget(&peer, "it said goodbye"),
        }
    }

    fn forget(&mut self, peer: &PeerId, why: &str) {
        if let Some(state) = self.peers.remove(peer) {
            tracing::info!(
                origin = state.origin.0,
                "front end gone ({why}): aborting its requests"
            );
            self.origins.remove(&state.origin);
            self.send_input(EngineInput::FrontendGone(state.origin));
        }
    }

    fn send_to(&mut self, origin: Origin, msg: EngineMessage) {
        match self.origins.get(&origin) {
            Some(peer) => self.send(&peer.clone(), msg),
            None => tracing::debug!(origin = origin.0, "a message for a front end that is gone"),
        }
    }

    /// Forgets the front ends silent for more than `timeout` (the time this process did not
    /// run not counted), then sends the others a heartbeat.
    fn on_heartbeat(&mut self, timeout: Duration, now: Instant) {
        let stats = *self.stats.borrow();
        let stalled = self.clock.stalled(now);
        for s in self.peers.values_mut() {
            s.last_seen = discounted(s.last_seen, stalled, now);
        }
        let silent: Vec<PeerId> = self
            .peers
            .iter()
            .filter(|(_, s)| now.duration_since(s.last_seen) > timeout)
            .map(|(p, _)| p.clone())
            .collect();
        for peer in silent {
            self.forget(&peer, "it stopped sending heartbeats");
        }
        for peer in self.peers.keys() {
            self.send(peer, EngineMessage::Heartbeat(stats));
        }
    }
}

/// The engine thread: drain inputs, step, flush outputs; block only when idle.
fn engine_loop<E: Executor>(
    mut engine: EngineCore<E>,
    input: std_mpsc::Receiver<EngineInput>,
    events: mpsc::UnboundedSender<EngineEvent>,
    stats: watch::Sender<EngineStats>,
) -> Result<(), EngineFatal> {
    let mut step_id = 0u64;
    let mut groups: Vec<(Origin, Vec<RequestOutput>)> = Vec::new();
    let mut pause_waiters: Vec<(Origin, u64)> = Vec::new();
    loop {
        let mut stop = false;
        loop {
            match input.try_recv() {
                Ok(i) => stop |= apply_input(&mut engine, i, &events, &mut pause_waiters),
                Err(std_mpsc::TryRecvError::Empty) => break,
                Err(std_mpsc::TryRecvError::Disconnected) => {
                    stop = true;
                    break;
                }
            }
        }
        if stop {
            return shut_down(&mut engine, &events, &mut groups, &mut step_id);
        }
        let progress = engine.step();
        stats.send_replace(flush(&mut engine, &events, &mut groups, &mut step_id));
        if engine.is_paused() && engine.is_drained() {
            for (origin, call_id) in pause_waiters.drain(..) {
                let _ = events.send(EngineEvent::Reply(
                    origin,
                    UtilityReply {
                        call_id,
                        result: UtilityResult::Done,
                    },
                ));
            }
        }
        match progress? {
            Progress::Worked => {}
            Progress::Idle => match input.recv() {
                Ok(i) => {
                    if apply_input(&mut engine, i, &events, &mut pause_waiters) {
                        return shut_down(&mut engine, &events, &mut groups, &mut step_id);
                    }
                }
                Err(_) => return shut_down(&mut engine, &events, &mut groups, &mut step_id),
            },
        }
    }
}

/// Applies one input; true on shutdown.
fn apply_input<E: Executor>(
    engine: &mut EngineCore<E>,
    input: EngineInput,
    events: &mpsc::UnboundedSender<EngineEvent>,
    pause_waiters: &mut Vec<(Origin, u64)>,
) -> bool {
    let reply = |origin, call_id| {
        let _ = events.send(EngineEvent::Reply(
            origin,
            UtilityReply {
                call_id,
                result: UtilityResult::Done,
            },
        ));
    };
    match input {
        EngineInput::Request(origin, r) => engine.add_request(origin, r),
        EngineInput::Wake => {}
        EngineInput::Abort(origin, ids) => engine.abort(origin, &ids),
        EngineInput::FrontendGone(origin) => engine.abort_origin(origin),
        EngineInput::Utility(origin, call_id, call) => match call {
            UtilityCall::Pause => {
                engine.pause();
                pause_waiters.push((origin, call_id));
            }
            UtilityCall::Resume => {
                engine.resume();
                reply(origin, call_id);
            }
            UtilityCall::ResetPrefixCache => {
                engine.reset_prefix_cache();
                reply(origin, call_id);
            }
            UtilityCall::Health | UtilityCall::Stats => unreachable!("answered by the bridge"),
        },
        EngineInput::Shutdown => return true,
    }
    false
}

/// Graceful stop: commits in-flight steps, aborts every request, sends the last outputs.
fn shut_down<E: Executor>(
    engine: &mut EngineCore<E>,
    events: &mpsc::UnboundedSender<EngineEvent>,
    groups: &mut Vec<(Origin, Vec<RequestOutput>)>,
    step_id: &mut u64,
) -> Result<(), EngineFatal> {
    let result = engine.shutdown();
    flush(engine, events, groups, step_id);
    result
}

/// Sends this step's outputs (one message per front end) and returns the stats they carry.
fn flush<E: Executor>(
    engine: &mut EngineCore<E>,
    events: &mpsc::UnboundedSender<EngineEvent>,
    groups: &mut Vec<(Origin, Vec<RequestOutput>)>,
    step_id: &mut u64,
) -> EngineStats {
    for (origin, out) in engine.take_outputs() {
        match groups.iter_mut().find(|(o, _)| *o == origin) {
            Some((_, v)) => v.push(out),
            None => groups.push((origin, vec![out])),
        }
    }
    let stats = engine.stats();
    if groups.is_empty() {
        return stats;
    }
    *step_id += 1;
    for (origin, outputs) in groups.drain(..) {
        let _ = events.send(EngineEvent::Outputs(
            origin,
            EngineCoreOutputs {
                step: *step_id,
                outputs,
                stats,
            },
        ));
    }
    stats
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use harrier_shared::protocol::{EngineLimits, Hello, SamplingParams};

    fn bridge() -> (
        Bridge,
        std_mpsc::Receiver<EngineInput>,
        mpsc::UnboundedReceiver<Outbound>,
    ) {
        let (input, input_rx) = std_mpsc::channel();
        let (outbound, outbound_rx) = mpsc::unbounded_channel();
        let (_, stats) = watch::channel(EngineStats::default());
        let info = EngineInfo {
            protocol_version: PROTOCOL_VERSION,
            engine_version: "test".into(),
            model_name: "test".into(),
            max_model_len: 64,
            vocab_size: 32,
            eos_token_ids: vec![],
            limits: EngineLimits {
                max_num_seqs: 4,
                max_num_batched_tokens: 64,
                max_logprobs: 0,
                block_size: 16,
                num_kv_blocks: 8,
                num_speculative_tokens: 0,
            },
        };
        let b = Bridge {
            info,
            peers: HashMap::new(),
            origins: HashMap::new(),
            next_origin: 0,
            input,
            outbound,
            stats,
            shutting_down: false,
            clock: StallClock::new(Duration::from_millis(250), Instant::now()),
        };
        (b, input_rx, outbound_rx)
    }

    fn request(id: &str) -> FrontendMessage {
        FrontendMessage::Request(EngineCoreRequest {
            request_id: id.into(),
            prompt_token_ids: vec![1, 2],
            sampling: SamplingParams::default(),
            arrival_time: 0.0,
            cache_salt: None,
        })
    }

    /// A front end silent past the timeout is forgotten (its requests aborted), but not for
    /// a stall of the engine's own process between two heartbeat ticks.
    #[test]
    fn front_ends_are_forgotten_after_silence_not_after_a_stall_of_the_engine() {
        let ms = Duration::from_millis;
        let (mut b, input_rx, mut out_rx) = bridge();
        let t0 = Instant::now();
        let hello = |name: &str| {
            FrontendMessage::Hello(Hello {
                protocol_version: PROTOCOL_VERSION,
                name: name.into(),
            })
        };
        let (talks, silent) = (
            PeerId(Bytes::from_static(b"a")),
            PeerId(Bytes::from_static(b"b")),
        );
        for p in [&talks, &silent] {
            b.on_message(p.clone(), hello("fe"));
        }
        b.on_message(talks.clone(), request("r"));
        assert!(matches!(input_rx.try_recv(), Ok(EngineInput::Request(..))));
        let origin = b.peers[&talks].origin;
        // Ticks on time; `silent` is forgotten past 5 s, `talks` keeps sending heartbeats.
        let mut t = 0;
        while b.peers.contains_key(&silent) {
            t += 250;
            assert!(t <= 5_250, "never forgotten");
            b.peers.get_mut(&talks).unwrap().last_seen = t0 + ms(t);
            b.on_heartbeat(Duration::from_secs(5), t0 + ms(t));
        }
        assert_eq!(t, 5_250);
        // Then the engine's process stalls 20 s: the next tick forgets no one, though `talks`
        // last spoke 20 s before it.
        b.on_heartbeat(Duration::from_secs(5), t0 + ms(t + 20_000));
        assert!(b.peers.contains_key(&talks));
        // Silence after the stall counts again: forgotten 5 s on (the engine thread told, to
        // abort its request).
        let mut u = t + 20_000;
        while b.peers.contains_key(&talks) {
            u += 250;
            assert!(u <= t + 26_000, "never forgotten after the stall");
            b.on_heartbeat(Duration::from_secs(5), t0 + ms(u));
        }
        assert!(
            u > t + 20_000 + 4_500,
            "forgotten {} ms after the stall",
            u - t - 20_000
        );
        let gone: Vec<_> = std::iter::from_fn(|| input_rx.try_recv().ok()).collect();
        assert!(
            matches!(gone[..], [EngineInput::FrontendGone(_), EngineInput::FrontendGone(o)] if o == origin)
        );
        assert!(
            out_rx.try_recv().is_ok(),
            "the welcomes and heartbeats were sent"
        );
    }

    /// Before the shutdown a request goes to the engine thread; after it the bridge ends it
    /// with `abort` itself and the engine thread sees nothing.
    #[test]
    fn requests_after_the_shutdown_began_are_aborted_by_the_bridge() {
        let (mut b, input_rx, mut out_rx) = bridge();
        let peer = PeerId(Bytes::from_static(b"fe"));
        let hello = Hello {
            protocol_version: PROTOCOL_VERSION,
            name: "fe".into(),
        };
        b.on_message(peer.clone(), FrontendMessage::Hello(hello));
        assert!(matches!(
            out_rx.try_recv().map(|o| o.msg),
            Ok(EngineMessage::Welcome(_))
        ));
        b.on_message(peer.clone(), request("before"));
        assert!(
            matches!(input_rx.try_recv(), Ok(EngineInput::Request(_, r)) if r.request_id == "before")
        );
        b.begin_shutdown();
        assert!(matches!(input_rx.try_recv(), Ok(EngineInput::Shutdown)));
        b.on_message(peer.clone(), request("late"));
        assert!(
            input_rx.try_recv().is_err(),
            "nothing reaches the engine thread"
        );
        let sent = out_rx.try_recv().expect("an answer");
        assert_eq!(sent.peer, peer);
        let EngineMessage::Outputs(o) = sent.msg else {
            panic!("want outputs, got {:?}", sent.msg);
        };
        assert_eq!(o.outputs.len(), 1);
        assert_eq!(o.outputs[0].request_id, "late");
        assert!(o.outputs[0].new_token_ids.is_empty());
        let finish = o.outputs[0].finish.as_ref().expect("finished");
        assert_eq!(finish.reason, FinishReason::Abort);
        assert_eq!(finish.message.as_deref(), Some(SHUTDOWN_MESSAGE));
    }
}
