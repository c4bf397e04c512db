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
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use harrier_shared::client::{ClientReceiver, EngineClient};
use harrier_shared::endpoint::Endpoint;
use harrier_shared::liveness::{discounted, StallClock};
use harrier_shared::protocol::{
    Abort, EngineCoreRequest, EngineInfo, EngineMessage, FrontendMessage, TokenId,
};
use tokenizers::Tokenizer;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::output::{ChoiceSpec, Processor, ProcessorInput};

#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// One engine core, or several (data parallelism): each request goes to one of them.
    pub endpoints: Vec<Endpoint>,
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
        Self::many(vec![endpoint], name)
    }

    pub fn many(endpoints: Vec<Endpoint>, name: String) -> Self {
        Self {
            endpoints,
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

/// One engine core: its connection (re-made by its connection task) and its load.
struct Link {
    index: u32,
    endpoint: Endpoint,
    conn: RwLock<Option<Conn>>,
    last_info: RwLock<Option<EngineInfo>>,
    last_error: RwLock<String>,
    /// Running + waiting requests in the engine's latest stats (all front ends' requests).
    reported_load: AtomicU32,
    /// Choices this front end sent since those stats (not in them yet).
    sent_since: AtomicU32,
}

impl Link {
    fn load(&self) -> u32 {
        self.reported_load.load(Ordering::Relaxed) + self.sent_since.load(Ordering::Relaxed)
    }

    fn client(&self) -> Option<EngineClient> {
        self.conn
            .read()
            .expect("conn lock")
            .as_ref()
            .map(|c| c.client.clone())
    }
}

struct Inner {
    opts: EngineOptions,
    links: Vec<Link>,
    connected: watch::Sender<usize>,
    processor: std_mpsc::Sender<ProcessorInput>,
    metrics: Arc<Metrics>,
}

/// Cheap to clone; all clones share the connections.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

/// Data parallelism: a request goes to the engine core its prompt prefix hashes to, unless
/// that one is busier than the least loaded by more than this many requests (then to the
/// least loaded). Requests sharing a prefix thus meet the same prefix cache while the load
/// stays even.
pub const AFFINITY_SLACK: u32 = 4;

/// Prompt tokens hashed for prefix affinity (about one system prompt's worth of blocks).
const AFFINITY_TOKENS: usize = 64;

/// Which of `loads` (one per connected engine core, `None` when down) a request whose prompt
/// starts with `prefix` goes to; `None` when every engine core is down.
pub fn choose_link(loads: &[Option<u32>], prefix: &[TokenId]) -> Option<usize> {
    let up: Vec<usize> = (0..loads.len()).filter(|&i| loads[i].is_some()).collect();
    let least = *up.iter().min_by_key(|&&i| (loads[i], i))?;
    let min = loads[least].expect("up");
    let mut h = xxhash_rust::xxh64::Xxh64::new(0x5eed);
    for t in &prefix[..prefix.len().min(AFFINITY_TOKENS)] {
        h.update(&t.to_le_bytes());
    }
    let preferred = up[(h.digest() % up.len() as u64) as usize];
    if loads[preferred].expect("up") <= min + AFFINITY_SLACK {
        Some(preferred)
    } else {
        Some(least)
    }
}

impl Engine {
    /// Starts the output processor thread, the abort task and one connection task per
    /// engine core. Must be called inside a tokio runtime.
    pub fn start(
        opts: EngineOptions,
        tokenizer: Arc<Tokenizer>,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Engine> {
        anyhow::ensure!(!opts.endpoints.is_empty(), "no engine core endpoint");
        let (proc_tx, proc_rx) = std_mpsc::channel();
        let (abort_tx, abort_rx) = mpsc::unbounded_channel();
        let processor = Processor::new(tokenizer, metrics.clone(), abort_tx);
        std::thread::Builder::new()
            .name("harrier-output".into())
            .spawn(move || processor.run(proc_rx))?;
        let (connected, _) = watch::channel(0);
        metrics.set_engine_count(opts.endpoints.len());
        let links = opts
            .endpoints
            .iter()
            .enumerate()
            .map(|(i, e)| Link {
                index: i as u32,
                endpoint: e.clone(),
                conn: RwLock::new(None),
                last_info: RwLock::new(None),
                last_error: RwLock::new("not connected yet".into()),
                reported_load: AtomicU32::new(0),
                sent_since: AtomicU32::new(0),
            })
            .collect();
        let engine = Engine {
            inner: Arc::new(Inner {
                opts,
                links,
                connected,
                processor: proc_tx,
                metrics,
            }),
        };
        tokio::spawn(abort_task(engine.clone(), abort_rx));
        for i in 0..engine.inner.links.len() {
            tokio::spawn(connection_task(Arc::downgrade(&engine.inner), i));
        }
        Ok(engine)
    }

    /// At least one engine core is connected.
    pub fn is_healthy(&self) -> bool {
        self.inner
            .links
            .iter()
            .any(|l| l.conn.read().expect("conn lock").is_some())
    }

    /// An engine's handshake answer (the latest one, also while disconnected).
    pub fn info(&self) -> Option<EngineInfo> {
        self.inner
            .links
            .iter()
            .find_map(|l| l.last_info.read().expect("info lock").clone())
    }

    /// Why the engine (the first engine core that is down) is unavailable, for 503
    /// messages and logs.
    pub fn last_error(&self) -> String {
        let links = &self.inner.links;
        let down = links
            .iter()
            .find(|l| l.conn.read().expect("conn lock").is_none())
            .unwrap_or(&links[0]);
        let e = down.last_error.read().expect("error lock").clone();
        if links.len() > 1 {
            format!("engine core {} ({}): {e}", down.index, down.endpoint)
        } else {
            e
        }
    }

    /// Waits until an engine core is connected (true) or `timeout` passed (false).
    pub async fn wait_connected(&self, timeout: Duration) -> bool {
        let mut rx = self.inner.connected.subscribe();
        let ok = tokio::time::timeout(timeout, rx.wait_for(|c| *c > 0))
            .await
            .is_ok();
        ok
    }

    /// Waits until every engine core is connected (start-up: a front end is ready when all
    /// of them are, so the first requests spread) or `timeout` passed (false).
    pub async fn wait_all_connected(&self, timeout: Duration) -> bool {
        let n = self.inner.links.len();
        let mut rx = self.inner.connected.subscribe();
        let ok = tokio::time::timeout(timeout, rx.wait_for(|c| *c >= n))
            .await
            .is_ok();
        ok
    }

    /// Picks the engine core (prefix affinity within [`AFFINITY_SLACK`] of the least
    /// loaded), registers the choices with the output processor, then sends their requests
    /// there. The returned guard cancels (and aborts in the engine) whatever is unfinished
    /// when dropped.
    pub async fn submit(
        &self,
        requests: Vec<EngineCoreRequest>,
        mut specs: Vec<ChoiceSpec>,
    ) -> Result<CancelGuard, ApiError> {
        let links = &self.inner.links;
        let loads: Vec<Option<u32>> = links
            .iter()
            .map(|l| l.conn.read().expect("conn lock").as_ref().map(|_| l.load()))
            .collect();
        let prefix = requests
            .first()
            .map(|r| r.prompt_token_ids.as_slice())
            .unwrap_or_default();
        let Some(i) = choose_link(&loads, prefix) else {
            return Err(ApiError::engine_unavailable(&self.last_error()));
        };
        let link = &links[i];
        let Some(client) = link.client() else {
            return Err(ApiError::engine_unavailable(&self.last_error()));
        };
        link.sent_since
            .fetch_add(specs.len() as u32, Ordering::Relaxed);
        for s in &mut specs {
            s.link = link.index;
        }
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

    /// Drops the connections: the socket tasks say `Goodbye` and the engines abort whatever
    /// this front end still had running.
    pub async fn close(&self) {
        for l in &self.inner.links {
            let conn = l.conn.write().expect("conn lock").take();
            drop(conn);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    /// Aborts go to every connected engine core: each ignores ids it does not know, and the
    /// front end need not remember where each request went.
    async fn send_abort(&self, ids: Vec<String>) {
        for l in &self.inner.links {
            if let Some(client) = l.client() {
                if let Err(e) = client
                    .send(FrontendMessage::Abort(Abort {
                        request_ids: ids.clone(),
                    }))
                    .await
                {
                    tracing::debug!(error = %e, "abort not sent (engine connection lost)");
                }
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

async fn connection_task(inner: std::sync::Weak<Inner>, index: usize) {
    let mut failures = 0u64;
    loop {
        let Some(this) = inner.upgrade() else { return };
        let opts = this.opts.clone();
        let endpoint = this.links[index].endpoint.clone();
        drop(this);
        match EngineClient::connect(&endpoint, &opts.name, opts.connect_timeout).await {
            Ok((client, receiver, info)) => {
                let Some(this) = inner.upgrade() else { return };
                failures = 0;
                let link = &this.links[index];
                tracing::info!(endpoint = %endpoint, engine = index, model = %info.model_name, max_model_len = info.max_model_len, "connected to the engine core");
                if let Some(other) = this.links.iter().find_map(|l| {
                    let i = l.last_info.read().expect("info lock");
                    i.as_ref()
                        .filter(|i| {
                            l.index != link.index
                                && (i.model_name != info.model_name
                                    || i.vocab_size != info.vocab_size)
                        })
                        .cloned()
                }) {
                    tracing::error!(engine = index, model = %info.model_name, other = %other.model_name, "engine cores serve different models; requests may reach either");
                }
                *link.last_info.write().expect("info lock") = Some(info.clone());
                this.metrics.set_model_name(&info.model_name);
                this.metrics
                    .set_speculative_tokens(info.limits.num_speculative_tokens);
                *link.conn.write().expect("conn lock") = Some(Conn { client, info });
                this.metrics.set_engine_up(index, true);
                this.connected.send_modify(|c| *c += 1);
                let reason = watch_connection(&this, index, receiver).await;
                tracing::error!(endpoint = %endpoint, engine = index, %reason, "engine core lost; its requests fail, reconnecting");
                *link.last_error.write().expect("error lock") = reason.clone();
                let conn = link.conn.write().expect("conn lock").take();
                link.reported_load.store(0, Ordering::Relaxed);
                link.sent_since.store(0, Ordering::Relaxed);
                this.metrics.set_engine_up(index, false);
                this.connected.send_modify(|c| *c -= 1);
                let _ = this
                    .processor
                    .send(ProcessorInput::EngineLost(index as u32, reason));
                drop(conn);
            }
            Err(e) => {
                failures += 1;
                let Some(this) = inner.upgrade() else { return };
                let msg = format!("{e:#}");
                if failures == 1 || failures.is_multiple_of(40) {
                    tracing::warn!(endpoint = %endpoint, error = %msg, attempts = failures, "cannot reach the engine core; retrying");
                }
                *this.links[index].last_error.write().expect("error lock") = msg;
                drop(this);
                tokio::time::sleep(opts.retry_interval).await;
            }
        }
    }
}

/// How often the front end checks an engine core's silence.
const LIVENESS_TICK: Duration = Duration::from_millis(100);

/// An engine core's silence, counted only while this process ran
/// ([`harrier_shared::liveness`]: a check that comes late because the front end stalled does
/// not count the stall against the engine). A hung engine (SIGSTOP) is still found after
/// `timeout`: the checks keep their pace.
#[derive(Debug)]
struct Liveness {
    timeout: Duration,
    last_seen: Instant,
    clock: StallClock,
}

impl Liveness {
    fn new(timeout: Duration, now: Instant) -> Self {
        Self {
            timeout,
            last_seen: now,
            clock: StallClock::new(LIVENESS_TICK, now),
        }
    }

    fn seen(&mut self, now: Instant) {
        self.last_seen = now;
    }

    /// The silence counted so far when it is past the timeout.
    fn check(&mut self, now: Instant) -> Option<Duration> {
        self.last_seen = discounted(self.last_seen, self.clock.stalled(now), now);
        let silent = now.saturating_duration_since(self.last_seen);
        (silent > self.timeout).then_some(silent)
    }
}

/// Forwards engine messages until the connection is lost or the engine stops talking;
/// returns why.
async fn watch_connection(this: &Inner, index: usize, mut receiver: ClientReceiver) -> String {
    let link = &this.links[index];
    let mut liveness = Liveness::new(this.opts.liveness_timeout, Instant::now());
    let mut tick = tokio::time::interval(LIVENESS_TICK);
    let stats_seen = |s: &harrier_shared::protocol::EngineStats| {
        link.reported_load
            .store(s.num_running + s.num_waiting, Ordering::Relaxed);
        link.sent_since.store(0, Ordering::Relaxed);
        this.metrics.set_engine_stats(index, s);
    };
    loop {
        tokio::select! {
            // (Messages first: one already delivered counts before the timer's verdict.)
            biased;
            msg = receiver.recv() => match msg {
                None => return "the connection to the engine core was lost".into(),
                Some(msg) => {
                    liveness.seen(Instant::now());
                    match msg {
                        EngineMessage::Outputs(outputs) => {
                            stats_seen(&outputs.stats);
                            if this.processor.send(ProcessorInput::Outputs(Box::new(outputs))).is_err() {
                                return "the output processor stopped".into();
                            }
                        }
                        EngineMessage::Heartbeat(stats) => stats_seen(&stats),
                        EngineMessage::UtilityReply(_) | EngineMessage::Welcome(_) | EngineMessage::Rejected(_) => {}
                    }
                }
            },
            _ = tick.tick() => {
                if let Some(silent) = liveness.check(Instant::now()) {
                    return format!("no message from the engine core for {:.1} s", silent.as_secs_f64());
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
        self.inner
            .links
            .iter()
            .find_map(|l| {
                l.conn
                    .read()
                    .expect("conn lock")
                    .as_ref()
                    .map(|c| c.info.clone())
            })
            .ok_or_else(|| ApiError::engine_unavailable(&self.last_error()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_follow_their_prefix_unless_that_engine_is_busier() {
        let a: Vec<TokenId> = (0..100).collect();
        let b: Vec<TokenId> = (5..105).collect();
        let even = [Some(3), Some(3)];
        let pa = choose_link(&even, &a).unwrap();
        // The same prefix (past the hashed tokens too) goes to the same engine.
        let mut a2 = a[..AFFINITY_TOKENS].to_vec();
        a2.push(7);
        assert_eq!(choose_link(&even, &a2), Some(pa));
        // Prefixes spread: among 64 different ones both engines are chosen.
        let picks: std::collections::HashSet<usize> = (0..64u32)
            .map(|k| choose_link(&even, &[k, k + 1]).unwrap())
            .collect();
        assert_eq!(picks.len(), 2);
        // Busier by more than the slack: the least loaded takes it.
        let mut loads = [Some(0), Some(0)];
        loads[pa] = Some(AFFINITY_SLACK + 1);
        assert_eq!(choose_link(&loads, &a), Some(1 - pa));
        loads[pa] = Some(AFFINITY_SLACK);
        assert_eq!(choose_link(&loads, &a), Some(pa));
        // Engines that are down take nothing; none up: none.
        assert_eq!(choose_link(&[None, Some(9)], &b), Some(1));
        assert_eq!(choose_link(&[None, None], &b), None);
    }

    #[test]
    fn silence_counts_only_while_the_front_end_runs() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let mut l = Liveness::new(Duration::from_secs(1), t0);
        // Checks on time and no message: lost once past the timeout, not before.
        for k in 1..=10 {
            assert_eq!(l.check(t0 + ms(100 * k)), None, "{k}");
        }
        assert_eq!(l.check(t0 + ms(1100)), Some(ms(1100)));

        // A message resets the count.
        let mut l = Liveness::new(Duration::from_secs(1), t0);
        l.check(t0 + ms(100));
        l.seen(t0 + ms(150));
        for k in 2..=11 {
            assert_eq!(l.check(t0 + ms(100 * k)), None, "{k}");
        }
        assert_eq!(l.check(t0 + ms(1200)), Some(ms(1050)));

        // The front end stalled 2 s between two checks: the stall is not the engine's silence
        // (two ticks' 200 ms of it are), but silence after it counts again at the checks' pace.
        let mut l = Liveness::new(Duration::from_secs(1), t0);
        assert_eq!(l.check(t0 + ms(100)), None);
        assert_eq!(l.check(t0 + ms(2100)), None);
        let mut t = 2100;
        while l.check(t0 + ms(t + 100)).is_none() {
            t += 100;
            assert!(t < 3000, "never lost after the stall");
        }
        // Lost at 2.9 s: 0.1 s before the stall, 0.2 s of it, 0.8 s after it.
        assert_eq!(t + 100, 2900);
    }

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
