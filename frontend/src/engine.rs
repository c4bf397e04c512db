//! The front end's link to the engine core: one connection per process, liveness, reconnect.
//!
//! A connection task owns the [`ClientReceiver`]: it forwards every step's outputs to the
//! output processor, mirrors the engine's stats into the metrics, and watches liveness. The
//! engine is declared lost when the socket reports the connection gone (`recv()` is `None`,
//! within milliseconds of an engine exit) or when nothing (no outputs, no 250 ms heartbeat)
//! arrived for `liveness_timeout` (a hung engine). Then `/health` and new requests answer
//! 503, every open choice gets an error event, and the task tries to connect again every
//! `retry_interval` until an engine core answers on the same address: serving resumes
//! without a restart.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use harrier_shared::client::{ClientReceiver, EngineClient};
use harrier_shared::endpoint::Endpoint;
use harrier_shared::protocol::{
    Abort, EngineCoreRequest, EngineInfo, EngineMessage, FrontendMessage,
};
use tokenizers::Tokenizer;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::output::{ChoiceSpec, Processor, ProcessorInput};

#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub endpoint: Endpoint,
    /// Name announced in the handshake (logs only; identities are made unique by the client).
    pub name: String,
    /// No message from the engine for this long means it is lost.
    pub liveness_timeout: Duration,
    /// One connection attempt (connect + handshake) may take this long.
    pub connect_timeout: Duration,
    /// Pause between failed connection attempts.
    pub retry_interval: Duration,
}

impl EngineOptions {
    pub fn new(endpoint: Endpoint, name: String) -> Self {
        Self {
            endpoint,
            name,
            liveness_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(2),
            retry_interval: Duration::from_millis(250),
        }
    }
}

struct Conn {
    client: EngineClient,
    info: EngineInfo,
}

struct Inner {
    opts: EngineOptions,
    conn: RwLock<Option<Conn>>,
    last_info: RwLock<Option<EngineInfo>>,
    last_error: RwLock<String>,
    connected: watch::Sender<bool>,
    processor: std_mpsc::Sender<ProcessorInput>,
    metrics: Arc<Metrics>,
}

/// Cheap to clone; all clones share one connection.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

impl Engine {
    /// Starts the output processor thread, the abort task and the connection task.
    /// Must be called inside a tokio runtime.
    pub fn start(
        opts: EngineOptions,
        tokenizer: Arc<Tokenizer>,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Engine> {
        let (proc_tx, proc_rx) = std_mpsc::channel();
        let (abort_tx, abort_rx) = mpsc::unbounded_channel();
        let processor = Processor::new(tokenizer, metrics.clone(), abort_tx);
        std::thread::Builder::new()
            .name("harrier-output".into())
            .spawn(move || processor.run(proc_rx))?;
        let (connected, _) = watch::channel(false);
        let engine = Engine {
            inner: Arc::new(Inner {
                opts,
                conn: RwLock::new(None),
                last_info: RwLock::new(None),
                last_error: RwLock::new("not connected yet".into()),
                connected,
                processor: proc_tx,
                metrics,
            }),
        };
        tokio::spawn(abort_task(engine.clone(), abort_rx));
        tokio::spawn(connection_task(Arc::downgrade(&engine.inner)));
        Ok(engine)
    }

    pub fn is_healthy(&self) -> bool {
        self.inner.conn.read().expect("conn lock").is_some()
    }

    /// The engine's handshake answer (the latest one, also while disconnected).
    pub fn info(&self) -> Option<EngineInfo> {
        self.inner.last_info.read().expect("info lock").clone()
    }

    /// Why the engine is unavailable (for 503 messages).
    pub fn last_error(&self) -> String {
        self.inner.last_error.read().expect("error lock").clone()
    }

    /// Waits until connected (true) or `timeout` passed (false).
    pub async fn wait_connected(&self, timeout: Duration) -> bool {
        let mut rx = self.inner.connected.subscribe();
        let ok = tokio::time::timeout(timeout, rx.wait_for(|c| *c))
            .await
            .is_ok();
        ok
    }

    /// Registers the choices with the output processor, then sends their requests. The
    /// returned guard cancels (and aborts in the engine) whatever is unfinished when dropped.
    pub async fn submit(
        &self,
        requests: Vec<EngineCoreRequest>,
        specs: Vec<ChoiceSpec>,
    ) -> Result<CancelGuard, ApiError> {
        let client = match &*self.inner.conn.read().expect("conn lock") {
            Some(c) => c.client.clone(),
            None => return Err(ApiError::engine_unavailable(&self.last_error())),
        };
        let guard = CancelGuard {
            ids: specs.iter().map(|s| s.engine_id.clone()).collect(),
            processor: self.inner.processor.clone(),
        };
        self.inner
            .processor
            .send(ProcessorInput::Register(specs))
            .map_err(|_| ApiError::internal("the output processor has stopped"))?;
        for r in requests {
            if let Err(e) = client.send(FrontendMessage::Request(r)).await {
                return Err(ApiError::engine_unavailable(&format!("{e:#}")));
            }
        }
        Ok(guard)
    }

    /// Drops the connection: the socket task says `Goodbye` and the engine aborts whatever
    /// this front end still had running.
    pub async fn close(&self) {
        let conn = self.inner.conn.write().expect("conn lock").take();
        drop(conn);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    async fn send_abort(&self, ids: Vec<String>) {
        let client = self
            .inner
            .conn
            .read()
            .expect("conn lock")
            .as_ref()
            .map(|c| c.client.clone());
        if let Some(client) = client {
            if let Err(e) = client
                .send(FrontendMessage::Abort(Abort { request_ids: ids }))
                .await
            {
                tracing::debug!(error = %e, "abort not sent (engine connection lost)");
            }
        }
    }
}

/// Cancels unfinished choices when dropped (client disconnect, handler dropped).
pub struct CancelGuard {
    ids: Vec<String>,
    processor: std_mpsc::Sender<ProcessorInput>,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        let _ = self
            .processor
            .send(ProcessorInput::Cancel(std::mem::take(&mut self.ids)));
    }
}

/// Sends aborts from the processor to the engine, batching those that queued up.
async fn abort_task(engine: Engine, mut rx: mpsc::UnboundedReceiver<Vec<String>>) {
    while let Some(mut ids) = rx.recv().await {
        while let Ok(more) = rx.try_recv() {
            ids.extend(more);
        }
        engine.send_abort(ids).await;
    }
}

async fn connection_task(inner: std::sync::Weak<Inner>) {
    let mut failures = 0u64;
    loop {
        let Some(this) = inner.upgrade() else { return };
        let opts = this.opts.clone();
        drop(this);
        match EngineClient::connect(&opts.endpoint, &opts.name, opts.connect_timeout).await {
            Ok((client, receiver, info)) => {
                let Some(this) = inner.upgrade() else { return };
                failures = 0;
                tracing::info!(endpoint = %opts.endpoint, model = %info.model_name, max_model_len = info.max_model_len, "connected to the engine core");
                *this.last_info.write().expect("info lock") = Some(info.clone());
                this.metrics.set_model_name(&info.model_name);
                this.metrics
                    .set_speculative_tokens(info.limits.num_speculative_tokens);
                *this.conn.write().expect("conn lock") = Some(Conn { client, info });
                this.metrics.set_engine_up(true);
                this.connected.send_replace(true);
                let reason = watch_connection(&this, receiver).await;
                tracing::error!(endpoint = %opts.endpoint, %reason, "engine core lost; answering 503 and reconnecting");
                *this.last_error.write().expect("error lock") = reason.clone();
                let conn = this.conn.write().expect("conn lock").take();
                this.metrics.set_engine_up(false);
                this.connected.send_replace(false);
                let _ = this.processor.send(ProcessorInput::EngineLost(reason));
                drop(conn);
            }
            Err(e) => {
                failures += 1;
                let Some(this) = inner.upgrade() else { return };
                let msg = format!("{e:#}");
                if failures == 1 || failures.is_multiple_of(40) {
                    tracing::warn!(endpoint = %opts.endpoint, error = %msg, attempts = failures, "cannot reach the engine core; retrying");
                }
                *this.last_error.write().expect("error lock") = msg;
                drop(this);
                tokio::time::sleep(opts.retry_interval).await;
            }
        }
    }
}

/// Forwards engine messages until the connection is lost or the engine stops talking;
/// returns why.
async fn watch_connection(this: &Inner, mut receiver: ClientReceiver) -> String {
    let timeout = this.opts.liveness_timeout;
    let mut last_seen = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            msg = receiver.recv() => match msg {
                None => return "the connection to the engine core was lost".into(),
                Some(msg) => {
                    last_seen = Instant::now();
                    match msg {
                        EngineMessage::Outputs(outputs) => {
                            this.metrics.set_engine_stats(&outputs.stats);
                            if this.processor.send(ProcessorInput::Outputs(Box::new(outputs))).is_err() {
                                return "the output processor stopped".into();
                            }
                        }
                        EngineMessage::Heartbeat(stats) => this.metrics.set_engine_stats(&stats),
                        EngineMessage::UtilityReply(_) | EngineMessage::Welcome(_) | EngineMessage::Rejected(_) => {}
                    }
                }
            },
            _ = tick.tick() => {
                if last_seen.elapsed() > timeout {
                    return format!("no message from the engine core for {:.1} s", last_seen.elapsed().as_secs_f64());
                }
            }
        }
    }
}

/// `{prefix}-{32 hex digits}`: unique per process start and request.
pub fn new_request_id(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    let a = h.finish();
    h.write_u64(a);
    format!("{prefix}-{a:016x}{:016x}", h.finish())
}

impl Engine {
    /// The connected engine's handshake answer, or a 503.
    pub fn connected_info(&self) -> Result<EngineInfo, ApiError> {
        match &*self.inner.conn.read().expect("conn lock") {
            Some(c) => Ok(c.info.clone()),
            None => Err(ApiError::engine_unavailable(&self.last_error())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_unique() {
        let a = new_request_id("cmpl");
        let b = new_request_id("cmpl");
        assert_ne!(a, b);
        assert!(a.starts_with("cmpl-") && a.len() == 5 + 32, "{a}");
    }
}

#[cfg(test)]
pub(crate) mod tests_support {
    use super::*;

    pub fn guard(ids: Vec<String>, processor: std_mpsc::Sender<ProcessorInput>) -> CancelGuard {
        CancelGuard { ids, processor }
    }
}
