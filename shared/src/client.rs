//! The front-end side of the ZeroMQ link: a DEALER socket owned by one background task.
//!
//! [`EngineClient::connect`] connects, performs the handshake (`Hello` -> `Welcome` or
//! `Rejected`) and returns a cloneable [`EngineClient`] for sending and a [`ClientReceiver`]
//! for everything the engine sends afterwards.
//!
//! The socket task runs a reader and a writer joined in one task (see [`crate::transport`]
//! for why zmq.rs's split halves make that cancel-safe). The writer sends
//! [`FrontendMessage::Heartbeat`] every [`HEARTBEAT_INTERVAL`] and `Goodbye` once every
//! `EngineClient` clone is dropped (best effort). The reader decodes [`EngineMessage`]s;
//! malformed frames are logged and dropped.
//!
//! Connection loss: zmq.rs DEALER sockets do not reconnect. When the engine's connection
//! ends (engine exited or was killed) the socket monitor reports it, [`ClientReceiver::recv`]
//! returns `None`, [`EngineClient::is_connected`] turns false and sends fail. To talk to a
//! restarted engine, call [`EngineClient::connect`] again (it uses a fresh identity). A hung
//! engine (connection open, no traffic) is only visible through the engine's heartbeats,
//! which the caller should time.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use zeromq::util::PeerIdentity;
use zeromq::{
    DealerRecvHalf, DealerSendHalf, DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv,
    SocketSend, ZmqMessage,
};

use crate::codec;
use crate::endpoint::Endpoint;
use crate::protocol::{EngineInfo, EngineMessage, FrontendMessage, Hello, PROTOCOL_VERSION};

/// How often a live front end sends `FrontendMessage::Heartbeat`.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_millis(500);

/// Capacity of the channel from the socket task to the [`ClientReceiver`].
pub const RECEIVE_CAPACITY: usize = 4096;

/// Capacity of the channel from [`EngineClient::send`] to the socket task.
const SEND_CAPACITY: usize = 1024;

struct Command {
    msg: FrontendMessage,
    done: oneshot::Sender<anyhow::Result<()>>,
}

/// State shared by the handles and the socket task.
struct Shared {
    endpoint: Endpoint,
    identity: String,
    lost: AtomicBool,
}

/// Sends to the engine core. Cheap to clone; when the last clone is dropped the socket task
/// says `Goodbye` to the engine.
#[derive(Clone)]
pub struct EngineClient {
    commands: mpsc::Sender<Command>,
    shared: Arc<Shared>,
}

/// Everything the engine sends after the handshake (outputs, utility replies, heartbeats).
pub struct ClientReceiver {
    rx: mpsc::Receiver<EngineMessage>,
}

impl ClientReceiver {
    /// The next message; `None` once the connection to the engine is lost (or the socket
    /// task ended).
    pub async fn recv(&mut self) -> Option<EngineMessage> {
        self.rx.recv().await
    }

    /// A message if one is waiting, without blocking.
    pub fn try_recv(&mut self) -> Result<EngineMessage, mpsc::error::TryRecvError> {
        self.rx.try_recv()
    }
}

impl EngineClient {
    /// Connects, sends `Hello{PROTOCOL_VERSION, name}` and waits for `Welcome` (returning the
    /// engine's [`EngineInfo`]) or `Rejected`. Everything, the connection included, must
    /// happen within `timeout`.
    pub async fn connect(
        endpoint: &Endpoint,
        name: &str,
        timeout: Duration,
    ) -> anyhow::Result<(EngineClient, ClientReceiver, EngineInfo)> {
        let deadline = Instant::now() + timeout;
        let timed_out = || anyhow!("no engine core answered at {endpoint} within {timeout:?}");

        let identity = unique_identity(name);
        let mut options = SocketOptions::default();
        options.peer_identity(
            PeerIdentity::try_from(identity.as_bytes())
                .with_context(|| format!("invalid socket identity {identity:?}"))?,
        );
        // zmq.rs retries the connection for 30 s by default; keep it within our deadline.
        options.connect_timeout(timeout);
        let mut socket = DealerSocket::with_options(options);
        let monitor = socket.monitor();
        match tokio::time::timeout_at(deadline, socket.connect(&endpoint.to_zmq())).await {
            Err(_) | Ok(Err(zeromq::ZmqError::ConnectTimeout(_))) => return Err(timed_out()),
            Ok(Err(e)) => {
                return Err(e)
                    .with_context(|| format!("cannot connect to the engine core at {endpoint}"))
            }
            Ok(Ok(())) => {}
        }
        tracing::debug!(%endpoint, %identity, "connected to engine socket");

        let shared = Arc::new(Shared {
            endpoint: endpoint.clone(),
            identity,
            lost: AtomicBool::new(false),
        });
        let (send_half, recv_half) = socket.split();
        let (commands, commands_rx) = mpsc::channel(SEND_CAPACITY);
        let (msg_tx, rx) = mpsc::channel(RECEIVE_CAPACITY);
        tokio::spawn({
            let shared = shared.clone();
            async move {
                tokio::join!(
                    read_loop(recv_half, monitor, msg_tx, &shared),
                    write_loop(send_half, commands_rx, &shared),
                );
                tracing::debug!(endpoint = %shared.endpoint, "front-end socket task ended");
            }
        });
        let client = EngineClient { commands, shared };
        let mut receiver = ClientReceiver { rx };

        let hello = FrontendMessage::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            name: name.to_owned(),
        });
        match tokio::time::timeout_at(deadline, client.send(hello)).await {
            Err(_) => return Err(timed_out()),
            Ok(sent) => sent.context("cannot send Hello to the engine core")?,
        }
        loop {
            let msg = match tokio::time::timeout_at(deadline, receiver.recv()).await {
                Err(_) => return Err(timed_out()),
                Ok(None) => bail!(
                    "the engine core at {endpoint} closed the connection during the handshake"
                ),
                Ok(Some(msg)) => msg,
            };
            match msg {
                EngineMessage::Welcome(info) => {
                    if info.protocol_version != PROTOCOL_VERSION {
                        bail!(
                            "protocol version mismatch: the engine core at {endpoint} speaks version {}, \
                             this front end speaks version {PROTOCOL_VERSION}",
                            info.protocol_version
                        );
                    }
                    tracing::info!(%endpoint, model = %info.model_name, "engine core handshake done");
                    return Ok((client, receiver, info));
                }
                EngineMessage::Rejected(r) => bail!(
                    "the engine core at {endpoint} rejected this front end: {} \
                     (engine protocol version {}, front-end protocol version {PROTOCOL_VERSION})",
                    r.reason,
                    r.engine_protocol_version
                ),
                other => {
                    tracing::debug!(msg = ?other, "ignoring a message before the handshake reply")
                }
            }
        }
    }

    /// Sends one message. `Ok` means zmq.rs queued it for the engine's connection; an error
    /// means the connection is gone.
    pub async fn send(&self, msg: FrontendMessage) -> anyhow::Result<()> {
        let (done, result) = oneshot::channel();
        let gone = || {
            anyhow!(
                "the connection to the engine core at {} is closed",
                self.shared.endpoint
            )
        };
        self.commands
            .send(Command { msg, done })
            .await
            .map_err(|_| gone())?;
        result.await.map_err(|_| gone())?
    }

    /// False once the connection to the engine was lost.
    pub fn is_connected(&self) -> bool {
        !self.shared.lost.load(Ordering::Acquire)
    }

    /// The engine's endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.shared.endpoint
    }

    /// This connection's socket identity (what the engine sees as its `PeerId`).
    pub fn identity(&self) -> &str {
        &self.shared.identity
    }
}

/// `{name}-{pid}-{random}`: unique per connection, so two front ends (or one restarted
/// front end whose old connection the engine has not yet dropped) never share an identity,
/// which zmq.rs's ROUTER handles badly. At most 255 bytes (zmq's limit), never empty.
fn unique_identity(name: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    // RandomState is seeded from the OS; mix in a counter and the time for good measure.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    let suffix = format!("-{}-{:016x}", std::process::id(), h.finish());
    let mut prefix: String = name.chars().filter(|c| !c.is_control()).collect();
    let max = PeerIdentity::MAX_LENGTH - suffix.len();
    while prefix.len() > max {
        prefix.pop();
    }
    if prefix.is_empty() {
        prefix.push_str("frontend");
    }
    prefix + &suffix
}

/// Receives, decodes and forwards engine messages until the connection or the receiver goes.
async fn read_loop(
    mut recv: DealerRecvHalf,
    mut monitor: futures::channel::mpsc::Receiver<SocketEvent>,
    msg_tx: mpsc::Sender<EngineMessage>,
    shared: &Shared,
) {
    let mut monitor_open = true;
    loop {
        let msg = tokio::select! {
            biased;
            () = msg_tx.closed() => break,
            event = monitor.next(), if monitor_open => match event {
                Some(SocketEvent::Disconnected(_)) => {
                    shared.lost.store(true, Ordering::Release);
                    tracing::warn!(endpoint = %shared.endpoint, "lost the connection to the engine core");
                    break;
                }
                Some(other) => {
                    tracing::debug!(event = ?other, "front-end socket event");
                    continue;
                }
                None => {
                    monitor_open = false;
                    continue;
                }
            },
            // Cancel-safe like the ROUTER's (same FairQueue underneath).
            frames = recv.recv() => match frames {
                Ok(frames) => match parse_frames(frames) {
                    Some(msg) => msg,
                    None => continue,
                },
                Err(e) => {
                    shared.lost.store(true, Ordering::Release);
                    tracing::warn!(endpoint = %shared.endpoint, error = %e, "front-end socket receive failed");
                    break;
                }
            },
        };
        if msg_tx.send(msg).await.is_err() {
            break;
        }
    }
}

/// A single payload frame -> `EngineMessage`; anything else is logged and dropped.
fn parse_frames(frames: ZmqMessage) -> Option<EngineMessage> {
    if frames.len() != 1 {
        tracing::warn!(
            frames = frames.len(),
            "dropping an engine message with the wrong frame count (want 1)"
        );
        return None;
    }
    let payload = frames.get(0)?;
    match codec::decode::<EngineMessage>(payload) {
        Ok(msg) => Some(msg),
        Err(e) => {
            tracing::warn!(error = %e, "dropping an undecodable engine message");
            None
        }
    }
}

async fn send_one(
    send: &mut DealerSendHalf,
    msg: &FrontendMessage,
    shared: &Shared,
) -> anyhow::Result<()> {
    if shared.lost.load(Ordering::Acquire) {
        bail!(
            "the connection to the engine core at {} was lost",
            shared.endpoint
        );
    }
    let payload = codec::encode(msg)?;
    send.send(ZmqMessage::from(payload))
        .await
        .with_context(|| format!("cannot send to the engine core at {}", shared.endpoint))
}

/// Sends commands and heartbeats; says `Goodbye` when every `EngineClient` is gone.
async fn write_loop(
    mut send: DealerSendHalf,
    mut commands: mpsc::Receiver<Command>,
    shared: &Shared,
) {
    let mut heartbeat =
        tokio::time::interval_at(Instant::now() + HEARTBEAT_INTERVAL, HEARTBEAT_INTERVAL);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            command = commands.recv() => match command {
                Some(Command { msg, done }) => {
                    let result = send_one(&mut send, &msg, shared).await;
                    let _ = done.send(result);
                }
                None => {
                    if let Err(e) = send_one(&mut send, &FrontendMessage::Goodbye, shared).await {
                        tracing::debug!(error = %e, "could not say Goodbye to the engine core");
                    }
                    break;
                }
            },
            _ = heartbeat.tick() => {
                if shared.lost.load(Ordering::Acquire) {
                    continue;
                }
                if let Err(e) = send_one(&mut send, &FrontendMessage::Heartbeat, shared).await {
                    tracing::debug!(error = %e, "heartbeat to the engine core failed");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_are_unique_and_bounded() {
        let a = unique_identity("frontend-0");
        let b = unique_identity("frontend-0");
        assert_ne!(a, b);
        assert!(a.starts_with(&format!("frontend-0-{}-", std::process::id())));
        let long = unique_identity(&"é".repeat(300));
        assert!(long.len() <= PeerIdentity::MAX_LENGTH);
        assert!(PeerIdentity::try_from(long.as_bytes()).is_ok());
        assert!(unique_identity("").starts_with("frontend-"));
        assert!(!unique_identity("a\nb").contains('\n'));
    }

    #[test]
    fn parse_frames_checks_shape() {
        let good = codec::encode(&EngineMessage::Heartbeat(Default::default())).unwrap();
        assert!(parse_frames(ZmqMessage::from(good.clone())).is_some());
        assert!(parse_frames(ZmqMessage::try_from(vec![good.clone(), good]).unwrap()).is_none());
        assert!(parse_frames(ZmqMessage::from(bytes::Bytes::from_static(b"junk"))).is_none());
        assert!(parse_frames(ZmqMessage::from(bytes::Bytes::new())).is_none());
    }
}
