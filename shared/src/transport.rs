//! The engine side of the ZeroMQ link: one ROUTER socket, owned by one background task.
//!
//! [`EngineTransport::bind`] binds a ROUTER socket and spawns a task that owns it. The engine
//! loop (which may run on its own OS thread) talks to that task through two channels:
//! - `inbound` (bounded, [`INBOUND_CAPACITY`]): decoded [`FrontendMessage`]s tagged with the
//!   sending front end's [`PeerId`], and [`Inbound::PeerLost`] notices. Use `try_recv` to drain
//!   it between steps or `blocking_recv` from a thread. When it is full the task stops reading
//!   the socket (backpressure; zmq.rs then queues in the kernel and per-peer buffers).
//! - `outbound` (unbounded, so the engine loop never blocks on a slow front end):
//!   [`Outbound`] messages, each encoded once and sent as `[identity, payload]`.
//!
//! # How the task receives and sends concurrently
//!
//! zmq.rs 0.7's [`RouterSocket::split`] gives a receive half and a send half sharing one
//! backend. The task runs two futures joined in the same task (`tokio::join!`), a reader that
//! owns the receive half and a writer that owns the send half, so a send waiting on a full
//! peer queue never stalls receiving and a full `inbound` channel never stalls sending.
//!
//! The reader `select!`s the receive half's `recv()` against the socket monitor, the internal
//! lost-peer channel and `inbound`'s closing. Dropping a pending `recv()` loses no frame
//! (checked in zeromq-0.7.0's source): `RouterRecvHalf::recv` awaits only
//! `FairQueue::next()`, and `FairQueue::poll_next` either returns a complete message in the
//! same poll it takes it from the peer's stream, or puts the stream back; partially received
//! bytes and multipart state live in each peer's `ZmqFramedRead`/`ZmqCodec`, not in the
//! future (zmq.rs has a test for exactly this, `test_fair_queue_next_future_can_be_dropped_after_pending`).
//! The writer never races its `send()` against anything, so no send is ever cancelled.
//!
//! # Lost peers
//!
//! zmq.rs drops a peer when its connection ends (noticed while the receive half is polled,
//! which the reader always does) or a write to it fails, and then emits
//! `SocketEvent::Disconnected` on the socket monitor: the task turns that into
//! [`Inbound::PeerLost`]. A send to an identity the socket does not know (never connected or
//! already gone) fails with "Destination client not found by identity": that is logged and
//! also reported as `PeerLost` (once per peer until a send to it succeeds again). A peer can
//! therefore be reported lost more than once; handle `PeerLost` idempotently.
//!
//! # Shutdown
//!
//! The reader ends when `inbound` is dropped, the writer when every `outbound` sender is
//! dropped. When both have ended the socket is dropped: zmq.rs closes all connections and its
//! accept task removes the ipc socket file (asynchronously; [`EngineTransport::close`] waits
//! for it). `inbound` yields `None` only after the reader has ended.

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context};
use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::mpsc;
use zeromq::{
    RouterRecvHalf, RouterSendHalf, RouterSocket, Socket, SocketEvent, SocketRecv, SocketSend,
    ZmqMessage,
};

use crate::codec;
use crate::endpoint::{prepare_bind, Endpoint};
use crate::protocol::{
    EngineInfo, EngineMessage, FrontendMessage, Hello, Rejected, PROTOCOL_VERSION,
};

/// Capacity of the inbound channel (messages from all front ends together).
pub const INBOUND_CAPACITY: usize = 4096;

/// A front end's ROUTER identity (the DEALER's identity, unique per front-end connection).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub Bytes);

impl fmt::Display for PeerId {
    /// Printable ASCII as is, anything else as hex (`0x...`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.0.is_empty() && self.0.iter().all(|b| (0x20..0x7f).contains(b)) {
            // All bytes are printable ASCII, hence valid UTF-8.
            f.write_str(&String::from_utf8_lossy(&self.0))
        } else {
            f.write_str("0x")?;
            self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
        }
    }
}

impl fmt::Debug for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PeerId({self})")
    }
}

/// What the socket task hands to the engine.
// `Message` is far larger than `PeerLost`; each value is moved once through a channel, so
// boxing would only add an allocation per message.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Inbound {
    /// A well-formed message from a front end.
    Message { peer: PeerId, msg: FrontendMessage },
    /// The front end's connection is gone (or a send to it failed): abort its requests.
    /// May be reported more than once for one peer.
    PeerLost { peer: PeerId },
}

/// A message for one front end.
#[derive(Debug, Clone, PartialEq)]
pub struct Outbound {
    pub peer: PeerId,
    pub msg: EngineMessage,
}

/// The engine's answer to a `Hello`: `Welcome(info)` when the protocol versions match,
/// else `Rejected` naming both versions.
pub fn handshake_reply(hello: &Hello, info: &EngineInfo) -> EngineMessage {
    if hello.protocol_version == PROTOCOL_VERSION {
        EngineMessage::Welcome(info.clone())
    } else {
        EngineMessage::Rejected(Rejected {
            engine_protocol_version: PROTOCOL_VERSION,
            reason: format!(
                "protocol version mismatch: front end {:?} speaks version {}, this engine core speaks version {}",
                hello.name, hello.protocol_version, PROTOCOL_VERSION
            ),
        })
    }
}

/// The engine side of the link: a bound ROUTER socket owned by a background task.
pub struct EngineTransport {
    /// Messages and lost-peer notices from front ends.
    pub inbound: mpsc::Receiver<Inbound>,
    /// Messages to front ends (clone it freely).
    pub outbound: mpsc::UnboundedSender<Outbound>,
    endpoint: Endpoint,
    task: tokio::task::JoinHandle<()>,
}

impl EngineTransport {
    /// Binds (after [`prepare_bind`]) and spawns the socket task on the current tokio runtime.
    pub async fn bind(endpoint: &Endpoint) -> anyhow::Result<EngineTransport> {
        prepare_bind(endpoint)?;
        let mut socket = RouterSocket::new();
        // Set before `split`: the monitor sender lives in the backend both halves share.
        let monitor = socket.monitor();
        let bound = socket
            .bind(&endpoint.to_zmq())
            .await
            .with_context(|| format!("cannot bind the engine socket at {endpoint}"))?;
        let endpoint = resolved_endpoint(endpoint, &bound)?;
        tracing::info!(%endpoint, "engine socket bound");

        let (send_half, recv_half) = socket.split();
        let (inbound_tx, inbound) = mpsc::channel(INBOUND_CAPACITY);
        let (outbound, outbound_rx) = mpsc::unbounded_channel();
        let (lost_tx, lost_rx) = mpsc::unbounded_channel();
        let task_endpoint = endpoint.clone();
        let task = tokio::spawn(async move {
            tokio::join!(
                read_loop(recv_half, monitor, lost_rx, inbound_tx),
                write_loop(send_half, outbound_rx, lost_tx),
            );
            tracing::debug!(endpoint = %task_endpoint, "engine socket task ended");
        });
        Ok(EngineTransport {
            inbound,
            outbound,
            endpoint,
            task,
        })
    }

    /// The bound endpoint (for `tcp://...:0`, with the port the OS picked).
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Drops both channels, waits for the socket task to end and (for ipc, up to a second)
    /// for the socket file to be removed. Clones of `outbound` held elsewhere keep the task
    /// sending until they are dropped too.
    pub async fn close(self) -> anyhow::Result<()> {
        let EngineTransport {
            inbound,
            outbound,
            endpoint,
            task,
        } = self;
        drop(inbound);
        drop(outbound);
        task.await.context("the engine socket task failed")?;
        if let Endpoint::Ipc(path) = &endpoint {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
            while path.exists() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        Ok(())
    }
}

/// Maps zmq.rs's resolved bind address back to ours (keeps our ipc path as given).
fn resolved_endpoint(requested: &Endpoint, bound: &zeromq::Endpoint) -> anyhow::Result<Endpoint> {
    match (requested, bound) {
        (Endpoint::Ipc(_), _) => Ok(requested.clone()),
        (Endpoint::Tcp(_), zeromq::Endpoint::Tcp(host, port)) => {
            let ip = std::net::IpAddr::try_from(host.clone())
                .map_err(|e| anyhow::anyhow!("zmq bound to a non-IP host {host}: {e}"))?;
            Ok(Endpoint::Tcp(SocketAddr::new(ip, *port)))
        }
        (Endpoint::Tcp(_), other) => bail!("zmq bound {requested} to unexpected endpoint {other}"),
    }
}

/// Receives frames, decodes them and forwards them (and lost-peer notices) to the engine.
async fn read_loop(
    mut recv: RouterRecvHalf,
    mut monitor: futures::channel::mpsc::Receiver<SocketEvent>,
    mut lost_rx: mpsc::UnboundedReceiver<PeerId>,
    inbound: mpsc::Sender<Inbound>,
) {
    let mut monitor_open = true;
    loop {
        let item = tokio::select! {
            biased;
            () = inbound.closed() => break,
            Some(peer) = lost_rx.recv() => Inbound::PeerLost { peer },
            event = monitor.next(), if monitor_open => match event {
                Some(SocketEvent::Disconnected(id)) => {
                    let peer = PeerId(Bytes::from(id));
                    tracing::info!(%peer, "front end disconnected");
                    Inbound::PeerLost { peer }
                }
                Some(SocketEvent::Accepted(ep, id)) => {
                    tracing::debug!(peer = %PeerId(Bytes::from(id)), endpoint = %ep, "front end connected");
                    continue;
                }
                Some(other) => {
                    tracing::debug!(event = ?other, "engine socket event");
                    continue;
                }
                None => {
                    monitor_open = false;
                    continue;
                }
            },
            // Cancel-safe: see the module docs.
            frames = recv.recv() => match frames {
                Ok(frames) => match parse_inbound(frames) {
                    Some(item) => item,
                    None => continue,
                },
                Err(e) => {
                    // A ROUTER's recv only fails when its queue is gone for good.
                    tracing::error!(error = %e, "engine socket receive failed; no more input");
                    break;
                }
            },
        };
        if inbound.send(item).await.is_err() {
            break;
        }
    }
}

/// `[identity, payload]` -> `Inbound::Message`; anything else is logged and dropped.
fn parse_inbound(frames: ZmqMessage) -> Option<Inbound> {
    let mut frames = frames.into_vecdeque();
    let Some(identity) = frames.pop_front() else {
        tracing::warn!("dropping a message without frames");
        return None;
    };
    let peer = PeerId(identity);
    if frames.len() != 1 {
        tracing::warn!(%peer, frames = frames.len(), "dropping a message with the wrong frame count (want 1 payload frame)");
        return None;
    }
    let payload = frames.pop_front()?;
    match codec::decode::<FrontendMessage>(&payload) {
        Ok(msg) => Some(Inbound::Message { peer, msg }),
        Err(e) => {
            tracing::warn!(%peer, error = %e, "dropping an undecodable message");
            None
        }
    }
}

/// Encodes and sends outbound messages; a failed send reports the peer lost.
async fn write_loop(
    mut send: RouterSendHalf,
    mut outbound: mpsc::UnboundedReceiver<Outbound>,
    lost_tx: mpsc::UnboundedSender<PeerId>,
) {
    // Peers already reported lost by a failed send, so a burst of outputs for a dead front
    // end gives one notice, not one per message.
    let mut failed: HashSet<PeerId> = HashSet::new();
    while let Some(Outbound { peer, msg }) = outbound.recv().await {
        let payload = match codec::encode(&msg) {
            Ok(payload) => payload,
            Err(e) => {
                tracing::error!(%peer, error = %e, "cannot encode an engine message; dropped");
                continue;
            }
        };
        let mut frames = ZmqMessage::from(payload);
        frames.push_front(peer.0.clone());
        match send.send(frames).await {
            Ok(()) => {
                failed.remove(&peer);
            }
            Err(e) => {
                if failed.insert(peer.clone()) {
                    tracing::warn!(%peer, error = %e, "send to front end failed; reporting it lost");
                    let _ = lost_tx.send(peer);
                } else {
                    tracing::debug!(%peer, error = %e, "send to lost front end failed");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_id_formats() {
        let p = PeerId(Bytes::from_static(b"frontend-12-ab"));
        assert_eq!(format!("{p:?}"), "PeerId(frontend-12-ab)");
        let p = PeerId(Bytes::from_static(&[0, 1, 0xab]));
        assert_eq!(format!("{p}"), "0x0001ab");
        assert_eq!(format!("{}", PeerId(Bytes::new())), "0x");
    }

    #[test]
    fn handshake_reply_checks_version() {
        let info = EngineInfo {
            protocol_version: PROTOCOL_VERSION,
            engine_version: "t".into(),
            model_name: "m".into(),
            max_model_len: 1,
            vocab_size: 2,
            eos_token_ids: vec![],
            limits: crate::protocol::EngineLimits {
                max_num_seqs: 1,
                max_num_batched_tokens: 1,
                max_logprobs: 1,
                block_size: 16,
                num_kv_blocks: 1,
                num_speculative_tokens: 0,
            },
        };
        let ok = Hello {
            protocol_version: PROTOCOL_VERSION,
            name: "f".into(),
        };
        assert_eq!(
            handshake_reply(&ok, &info),
            EngineMessage::Welcome(info.clone())
        );
        let bad = Hello {
            protocol_version: PROTOCOL_VERSION + 1,
            name: "f".into(),
        };
        match handshake_reply(&bad, &info) {
            EngineMessage::Rejected(r) => {
                assert_eq!(r.engine_protocol_version, PROTOCOL_VERSION);
                assert!(r.reason.contains(&(PROTOCOL_VERSION + 1).to_string()));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn parse_inbound_checks_frames() {
        let good = codec::encode(&FrontendMessage::Heartbeat).unwrap();
        let mk = |frames: Vec<Bytes>| ZmqMessage::try_from(frames).unwrap();
        let id = Bytes::from_static(b"peer");
        assert_eq!(
            parse_inbound(mk(vec![id.clone(), good.clone()])),
            Some(Inbound::Message {
                peer: PeerId(id.clone()),
                msg: FrontendMessage::Heartbeat
            })
        );
        assert_eq!(parse_inbound(mk(vec![id.clone()])), None);
        assert_eq!(
            parse_inbound(mk(vec![id.clone(), good.clone(), good.clone()])),
            None
        );
        assert_eq!(
            parse_inbound(mk(vec![id.clone(), Bytes::from_static(b"junk")])),
            None
        );
        assert_eq!(parse_inbound(mk(vec![id, Bytes::new()])), None);
    }
}
