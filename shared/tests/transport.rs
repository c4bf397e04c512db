//! The engine transport and the front-end client over real sockets (ipc in a tempdir and
//! tcp on 127.0.0.1). Every wait is bounded by a timeout so nothing can hang.

use std::time::Duration;

use bytes::Bytes;
use harrier_shared::client::EngineClient;
use harrier_shared::codec;
use harrier_shared::endpoint::Endpoint;
use harrier_shared::protocol::*;
use harrier_shared::transport::{handshake_reply, EngineTransport, Inbound, Outbound, PeerId};
use tokio::sync::{mpsc, oneshot};
use tokio::time::timeout;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

const WAIT: Duration = Duration::from_secs(3);

fn info() -> EngineInfo {
    EngineInfo {
        protocol_version: PROTOCOL_VERSION,
        engine_version: "test".into(),
        model_name: "tiny".into(),
        max_model_len: 2048,
        vocab_size: 1000,
        eos_token_ids: vec![2],
        limits: EngineLimits {
            max_num_seqs: 8,
            max_num_batched_tokens: 512,
            max_logprobs: 5,
            block_size: 16,
            num_kv_blocks: 100,
            num_speculative_tokens: 0,
        },
    }
}

fn ipc() -> (tempfile::TempDir, Endpoint) {
    let dir = tempfile::tempdir().unwrap();
    let ep = Endpoint::Ipc(dir.path().join("engine.sock"));
    (dir, ep)
}

fn tcp() -> Endpoint {
    "tcp://127.0.0.1:0".parse().unwrap()
}

fn request(id: &str, prompt: Vec<TokenId>) -> FrontendMessage {
    FrontendMessage::Request(EngineCoreRequest {
        request_id: id.into(),
        prompt_token_ids: prompt,
        sampling: SamplingParams::greedy(4),
        arrival_time: 0.0,
        cache_salt: None,
    })
}

/// A fake engine loop: answers Hello with `reply`, echoes each Request as one Outputs
/// message to its sender, and reports every inbound item on `events`.
struct FakeEngine {
    endpoint: Endpoint,
    events: mpsc::UnboundedReceiver<Inbound>,
    outbound: mpsc::UnboundedSender<Outbound>,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeEngine {
    async fn start(ep: &Endpoint) -> FakeEngine {
        Self::start_with(ep, |hello| handshake_reply(hello, &info())).await
    }

    async fn start_with(ep: &Endpoint, reply: fn(&Hello) -> EngineMessage) -> FakeEngine {
        let mut transport = EngineTransport::bind(ep).await.unwrap();
        let endpoint = transport.endpoint().clone();
        let outbound = transport.outbound.clone();
        let (events_tx, events) = mpsc::unbounded_channel();
        let (stop, mut stop_rx) = oneshot::channel();
        let task = tokio::spawn(async move {
            loop {
                let item = tokio::select! {
                    _ = &mut stop_rx => break,
                    item = transport.inbound.recv() => match item {
                        Some(item) => item,
                        None => break,
                    },
                };
                if let Inbound::Message { peer, msg } = &item {
                    let answer = match msg {
                        FrontendMessage::Hello(h) => Some(reply(h)),
                        FrontendMessage::Request(r) => {
                            Some(EngineMessage::Outputs(EngineCoreOutputs {
                                step: 1,
                                outputs: vec![RequestOutput {
                                    request_id: r.request_id.clone(),
                                    new_token_ids: r.prompt_token_ids.clone(),
                                    logprobs: None,
                                    finish: Some(Finish {
                                        reason: FinishReason::Stop,
                                        stop_token: None,
                                        message: None,
                                        timing: None,
                                        spec: None,
                                    }),
                                    num_cached_tokens: Some(0),
                                }],
                                stats: EngineStats::default(),
                            }))
                        }
                        _ => None,
                    };
                    if let Some(msg) = answer {
                        transport
                            .outbound
                            .send(Outbound {
                                peer: peer.clone(),
                                msg,
                            })
                            .unwrap();
                    }
                }
                let _ = events_tx.send(item);
            }
            transport.close().await.unwrap();
        });
        FakeEngine {
            endpoint,
            events,
            outbound,
            stop,
            task,
        }
    }

    /// The next event matching `pred`, skipping others (heartbeats, ...).
    async fn wait_for(&mut self, what: &str, pred: impl Fn(&Inbound) -> bool) -> Inbound {
        timeout(WAIT, async {
            loop {
                let ev = self.events.recv().await.expect("engine loop ended");
                if pred(&ev) {
                    return ev;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
    }

    /// The PeerId of the front end that said Hello as `name`.
    async fn hello_from(&mut self, name: &str) -> PeerId {
        match self
            .wait_for("Hello", |ev| matches!(ev, Inbound::Message { msg: FrontendMessage::Hello(h), .. } if h.name == name))
            .await
        {
            Inbound::Message { peer, .. } => peer,
            _ => unreachable!(),
        }
    }

    /// Stops the loop and closes the transport (the socket goes away).
    async fn stop(self) {
        drop(self.outbound);
        let _ = self.stop.send(());
        timeout(WAIT, self.task).await.unwrap().unwrap();
    }
}

async fn connect(
    ep: &Endpoint,
    name: &str,
) -> (EngineClient, harrier_shared::client::ClientReceiver) {
    let (client, rx, got) = EngineClient::connect(ep, name, WAIT).await.unwrap();
    assert_eq!(got, info());
    (client, rx)
}

async fn recv(rx: &mut harrier_shared::client::ClientReceiver) -> EngineMessage {
    timeout(WAIT, rx.recv())
        .await
        .expect("timed out waiting for an engine message")
        .expect("connection closed")
}

fn output_id(msg: &EngineMessage) -> &str {
    match msg {
        EngineMessage::Outputs(o) => &o.outputs[0].request_id,
        other => panic!("expected Outputs, got {other:?}"),
    }
}

// ---------------------------------------------------------------- handshake and requests

async fn handshake_and_request(ep: Endpoint) {
    let mut engine = FakeEngine::start(&ep).await;
    if let Endpoint::Tcp(addr) = engine.endpoint {
        assert_ne!(
            addr.port(),
            0,
            "the resolved endpoint carries the real port"
        );
    }
    let (client, mut rx) = connect(&engine.endpoint, "fe-a").await;
    let peer = engine.hello_from("fe-a").await;
    assert_eq!(peer.0, Bytes::copy_from_slice(client.identity().as_bytes()));
    assert!(peer
        .to_string()
        .starts_with(&format!("fe-a-{}-", std::process::id())));

    client.send(request("r1", vec![1, 2, 3])).await.unwrap();
    let ev = engine
        .wait_for("Request", |ev| {
            matches!(
                ev,
                Inbound::Message {
                    msg: FrontendMessage::Request(_),
                    ..
                }
            )
        })
        .await;
    assert_eq!(
        ev,
        Inbound::Message {
            peer,
            msg: request("r1", vec![1, 2, 3])
        }
    );
    let out = recv(&mut rx).await;
    assert_eq!(output_id(&out), "r1");
    assert!(client.is_connected());
    engine.stop().await;
}

#[tokio::test]
async fn handshake_and_request_ipc() {
    let (_dir, ep) = ipc();
    handshake_and_request(ep).await;
}

#[tokio::test]
async fn handshake_and_request_tcp() {
    handshake_and_request(tcp()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_and_request_multi_thread_runtime() {
    let (_dir, ep) = ipc();
    handshake_and_request(ep).await;
}

// ---------------------------------------------------------------- version checks

#[tokio::test]
async fn rejected_names_both_versions() {
    let (_dir, ep) = ipc();
    let engine = FakeEngine::start_with(&ep, |_| {
        EngineMessage::Rejected(Rejected {
            engine_protocol_version: 777,
            reason: "too new for you".into(),
        })
    })
    .await;
    let err = EngineClient::connect(&engine.endpoint, "fe", WAIT)
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("too new for you"), "{err}");
    assert!(err.contains("engine protocol version 777"), "{err}");
    assert!(
        err.contains(&format!("front-end protocol version {PROTOCOL_VERSION}")),
        "{err}"
    );
    engine.stop().await;
}

#[tokio::test]
async fn welcome_with_other_version_is_an_error() {
    let ep = tcp();
    let engine = FakeEngine::start_with(&ep, |_| {
        EngineMessage::Welcome(EngineInfo {
            protocol_version: PROTOCOL_VERSION + 1,
            ..info()
        })
    })
    .await;
    let err = EngineClient::connect(&engine.endpoint, "fe", WAIT)
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("protocol version mismatch"), "{err}");
    assert!(
        err.contains(&format!("speaks version {}", PROTOCOL_VERSION + 1)),
        "{err}"
    );
    assert!(
        err.contains(&format!("speaks version {PROTOCOL_VERSION}")),
        "{err}"
    );
    engine.stop().await;
}

#[tokio::test]
async fn engine_side_rejects_other_version() {
    // handshake_reply with a Hello of another version, sent by a raw DEALER.
    let (_dir, ep) = ipc();
    let engine = FakeEngine::start(&ep).await;
    let mut raw = zeromq::DealerSocket::new();
    raw.connect(&engine.endpoint.to_zmq()).await.unwrap();
    let hello = FrontendMessage::Hello(Hello {
        protocol_version: PROTOCOL_VERSION + 5,
        name: "old".into(),
    });
    raw.send(ZmqMessage::from(codec::encode(&hello).unwrap()))
        .await
        .unwrap();
    let reply = timeout(WAIT, raw.recv()).await.unwrap().unwrap();
    match codec::decode::<EngineMessage>(reply.get(0).unwrap()).unwrap() {
        EngineMessage::Rejected(r) => {
            assert_eq!(r.engine_protocol_version, PROTOCOL_VERSION);
            assert!(
                r.reason.contains(&(PROTOCOL_VERSION + 5).to_string()),
                "{}",
                r.reason
            );
        }
        other => panic!("{other:?}"),
    }
    engine.stop().await;
}

// ---------------------------------------------------------------- malformed frames

async fn garbage_does_not_kill_transport(ep: Endpoint) {
    let mut engine = FakeEngine::start(&ep).await;
    let mut options = zeromq::SocketOptions::default();
    options.peer_identity("raw-dealer".parse().unwrap());
    let mut raw = zeromq::DealerSocket::with_options(options);
    raw.connect(&engine.endpoint.to_zmq()).await.unwrap();

    let good = codec::encode(&FrontendMessage::Heartbeat).unwrap();
    let junk = [
        ZmqMessage::from("definitely not msgpack"),
        ZmqMessage::from(Bytes::new()),
        ZmqMessage::from(good.slice(..good.len() - 1)),
        ZmqMessage::from(codec::encode(&EngineMessage::Heartbeat(EngineStats::default())).unwrap()),
        ZmqMessage::try_from(vec![good.clone(), good.clone()]).unwrap(),
        ZmqMessage::try_from(vec![Bytes::new(), good.clone()]).unwrap(),
        ZmqMessage::from(Bytes::from(vec![0xffu8; 70_000])),
    ];
    for frames in junk {
        raw.send(frames).await.unwrap();
    }
    raw.send(ZmqMessage::from(good)).await.unwrap();
    // The first thing the engine hears from the raw peer is the good message.
    let ev = engine
        .wait_for(
            "raw message",
            |ev| matches!(ev, Inbound::Message { peer, .. } if peer.0 == "raw-dealer"),
        )
        .await;
    assert!(
        matches!(
            ev,
            Inbound::Message {
                msg: FrontendMessage::Heartbeat,
                ..
            }
        ),
        "{ev:?}"
    );

    // And the transport still serves a real client.
    let (client, mut rx) = connect(&engine.endpoint, "after-garbage").await;
    client.send(request("ok", vec![5])).await.unwrap();
    assert_eq!(output_id(&recv(&mut rx).await), "ok");
    engine.stop().await;
}

#[tokio::test]
async fn garbage_does_not_kill_transport_ipc() {
    let (_dir, ep) = ipc();
    garbage_does_not_kill_transport(ep).await;
}

#[tokio::test]
async fn garbage_does_not_kill_transport_tcp() {
    garbage_does_not_kill_transport(tcp()).await;
}

#[tokio::test]
async fn garbage_does_not_kill_client() {
    let (_dir, ep) = ipc();
    let mut router = zeromq::RouterSocket::new();
    router.bind(&ep.to_zmq()).await.unwrap();
    let connecting = tokio::spawn({
        let ep = ep.clone();
        async move { EngineClient::connect(&ep, "fe", WAIT).await }
    });
    let hello = timeout(WAIT, router.recv()).await.unwrap().unwrap();
    assert_eq!(hello.len(), 2);
    let id = hello.get(0).unwrap().clone();
    assert!(matches!(
        codec::decode(hello.get(1).unwrap()).unwrap(),
        FrontendMessage::Hello(_)
    ));

    let to_client = |frames: Vec<Bytes>| {
        let mut all = vec![id.clone()];
        all.extend(frames);
        ZmqMessage::try_from(all).unwrap()
    };
    let welcome = codec::encode(&EngineMessage::Welcome(info())).unwrap();
    let beat = codec::encode(&EngineMessage::Heartbeat(EngineStats {
        steps_total: 42,
        ..Default::default()
    }))
    .unwrap();
    for frames in [
        vec![Bytes::from_static(b"junk")],
        vec![Bytes::new()],
        vec![welcome.clone(), welcome.clone()],
        vec![codec::encode(&FrontendMessage::Goodbye).unwrap()],
        vec![welcome.clone()],
        vec![Bytes::from_static(b"\xc1")],
        vec![beat.clone()],
    ] {
        router.send(to_client(frames)).await.unwrap();
    }
    let (client, mut rx, got) = timeout(WAIT, connecting).await.unwrap().unwrap().unwrap();
    assert_eq!(got, info());
    assert_eq!(
        recv(&mut rx).await,
        EngineMessage::Heartbeat(EngineStats {
            steps_total: 42,
            ..Default::default()
        })
    );
    assert!(client.is_connected());
}

// ---------------------------------------------------------------- routing

async fn two_clients_routed(ep: Endpoint) {
    let mut engine = FakeEngine::start(&ep).await;
    let (a, mut rx_a) = connect(&engine.endpoint, "fe-a").await;
    let (b, mut rx_b) = connect(&engine.endpoint, "fe-b").await;
    let peer_a = engine.hello_from("fe-a").await;
    let peer_b = engine.hello_from("fe-b").await;
    assert_ne!(peer_a, peer_b);
    for i in 0..20 {
        a.send(request(&format!("a-{i}"), vec![i])).await.unwrap();
        b.send(request(&format!("b-{i}"), vec![i])).await.unwrap();
    }
    for i in 0..20 {
        assert_eq!(output_id(&recv(&mut rx_a).await), format!("a-{i}"));
        assert_eq!(output_id(&recv(&mut rx_b).await), format!("b-{i}"));
    }
    // Nothing else arrives for either (the engine only answers requests).
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(rx_a.try_recv().is_err());
    assert!(rx_b.try_recv().is_err());
    // An explicit message to one peer reaches only that peer.
    engine
        .outbound
        .send(Outbound {
            peer: peer_b,
            msg: EngineMessage::Heartbeat(EngineStats {
                num_running: 9,
                ..Default::default()
            }),
        })
        .unwrap();
    assert_eq!(
        recv(&mut rx_b).await,
        EngineMessage::Heartbeat(EngineStats {
            num_running: 9,
            ..Default::default()
        })
    );
    assert!(rx_a.try_recv().is_err());
    engine.stop().await;
}

#[tokio::test]
async fn two_clients_routed_ipc() {
    let (_dir, ep) = ipc();
    two_clients_routed(ep).await;
}

#[tokio::test]
async fn two_clients_routed_tcp() {
    two_clients_routed(tcp()).await;
}

// ---------------------------------------------------------------- lost peers

async fn peer_lost_on_disconnect(ep: Endpoint) {
    let mut engine = FakeEngine::start(&ep).await;
    let (client, rx) = connect(&engine.endpoint, "leaver").await;
    let peer = engine.hello_from("leaver").await;
    drop(client);
    drop(rx);
    let ev = engine
        .wait_for("Goodbye or PeerLost", |ev| {
            !matches!(
                ev,
                Inbound::Message {
                    msg: FrontendMessage::Heartbeat,
                    ..
                }
            )
        })
        .await;
    assert_eq!(
        ev,
        Inbound::Message {
            peer: peer.clone(),
            msg: FrontendMessage::Goodbye
        }
    );
    // The monitor reports the closed connection without any send.
    let ev = engine
        .wait_for("PeerLost", |ev| matches!(ev, Inbound::PeerLost { .. }))
        .await;
    assert_eq!(ev, Inbound::PeerLost { peer: peer.clone() });
    // Sending to it now fails, which is reported too.
    engine
        .outbound
        .send(Outbound {
            peer: peer.clone(),
            msg: EngineMessage::Heartbeat(EngineStats::default()),
        })
        .unwrap();
    let ev = engine
        .wait_for("PeerLost after send", |ev| {
            matches!(ev, Inbound::PeerLost { .. })
        })
        .await;
    assert_eq!(ev, Inbound::PeerLost { peer });
    engine.stop().await;
}

#[tokio::test]
async fn peer_lost_on_disconnect_ipc() {
    let (_dir, ep) = ipc();
    peer_lost_on_disconnect(ep).await;
}

#[tokio::test]
async fn peer_lost_on_disconnect_tcp() {
    peer_lost_on_disconnect(tcp()).await;
}

#[tokio::test]
async fn send_to_unknown_peer_reports_it_lost_once() {
    let (_dir, ep) = ipc();
    let mut engine = FakeEngine::start(&ep).await;
    let (_client, _rx) = connect(&engine.endpoint, "bystander").await;
    let msg = EngineMessage::Heartbeat(EngineStats::default());
    for name in ["nobody", "nobody", "nobody", "nobody-else"] {
        let peer = PeerId(Bytes::from_static(name.as_bytes()));
        engine
            .outbound
            .send(Outbound {
                peer,
                msg: msg.clone(),
            })
            .unwrap();
    }
    let lost = |ev: &Inbound| matches!(ev, Inbound::PeerLost { .. });
    assert_eq!(
        engine.wait_for("lost 1", lost).await,
        Inbound::PeerLost {
            peer: PeerId(Bytes::from_static(b"nobody"))
        }
    );
    assert_eq!(
        engine.wait_for("lost 2", lost).await,
        Inbound::PeerLost {
            peer: PeerId(Bytes::from_static(b"nobody-else"))
        }
    );
    engine.stop().await;
}

// ---------------------------------------------------------------- engine death, timeouts

async fn client_notices_engine_death(ep: Endpoint) {
    let engine = FakeEngine::start(&ep).await;
    let (client, mut rx) = connect(&engine.endpoint, "watcher").await;
    let started = std::time::Instant::now();
    engine.stop().await;
    assert_eq!(
        timeout(WAIT, rx.recv())
            .await
            .expect("receiver did not close"),
        None
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "took {:?}",
        started.elapsed()
    );
    assert!(!client.is_connected());
    let err = client
        .send(FrontendMessage::Heartbeat)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("lost") || err.contains("closed"), "{err}");
}

#[tokio::test]
async fn client_notices_engine_death_ipc() {
    let (_dir, ep) = ipc();
    client_notices_engine_death(ep).await;
}

#[tokio::test]
async fn client_notices_engine_death_tcp() {
    client_notices_engine_death(tcp()).await;
}

async fn assert_times_out(ep: &Endpoint) {
    let t = Duration::from_millis(300);
    let started = std::time::Instant::now();
    let err = EngineClient::connect(ep, "fe", t)
        .await
        .err()
        .unwrap()
        .to_string();
    assert_eq!(err, format!("no engine core answered at {ep} within {t:?}"));
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn connect_times_out_without_engine() {
    let (_dir, ep) = ipc();
    assert_times_out(&ep).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    assert_times_out(&format!("tcp://127.0.0.1:{port}").parse().unwrap()).await;
}

#[tokio::test]
async fn connect_times_out_with_silent_engine() {
    let (_dir, ep) = ipc();
    let mut router = zeromq::RouterSocket::new();
    router.bind(&ep.to_zmq()).await.unwrap();
    assert_times_out(&ep).await;
}

// ---------------------------------------------------------------- heartbeats, goodbye

#[tokio::test]
async fn client_heartbeats_and_says_goodbye() {
    let (_dir, ep) = ipc();
    let mut engine = FakeEngine::start(&ep).await;
    let (client, _rx) = connect(&engine.endpoint, "beater").await;
    let peer = engine.hello_from("beater").await;
    let started = std::time::Instant::now();
    let ev = engine
        .wait_for("Heartbeat", |ev| {
            matches!(
                ev,
                Inbound::Message {
                    msg: FrontendMessage::Heartbeat,
                    ..
                }
            )
        })
        .await;
    assert_eq!(
        ev,
        Inbound::Message {
            peer: peer.clone(),
            msg: FrontendMessage::Heartbeat
        }
    );
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "took {:?}",
        started.elapsed()
    );
    // Dropping every client clone (the receiver stays) says Goodbye.
    let clone = client.clone();
    drop(client);
    clone
        .send(FrontendMessage::Abort(Abort {
            request_ids: vec!["x".into()],
        }))
        .await
        .unwrap();
    drop(clone);
    let ev = engine
        .wait_for("Goodbye", |ev| {
            matches!(
                ev,
                Inbound::Message {
                    msg: FrontendMessage::Goodbye,
                    ..
                }
            )
        })
        .await;
    assert_eq!(
        ev,
        Inbound::Message {
            peer,
            msg: FrontendMessage::Goodbye
        }
    );
    engine.stop().await;
}

// ---------------------------------------------------------------- ipc files

#[tokio::test]
async fn stale_ipc_file_still_binds() {
    let (_dir, ep) = ipc();
    let path = ep.ipc_path().unwrap().to_path_buf();
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists(), "a stale socket file is left behind");
    let engine = FakeEngine::start(&ep).await;
    let (client, mut rx) = connect(&engine.endpoint, "fe").await;
    client.send(request("r", vec![1])).await.unwrap();
    assert_eq!(output_id(&recv(&mut rx).await), "r");
    engine.stop().await;
}

#[tokio::test]
async fn close_removes_the_socket_file_and_the_path_can_be_rebound() {
    let (_dir, ep) = ipc();
    let path = ep.ipc_path().unwrap().to_path_buf();
    let transport = EngineTransport::bind(&ep).await.unwrap();
    assert!(path.exists());
    // A second engine on a live path is refused, not allowed to steal the socket.
    let err = EngineTransport::bind(&ep).await.err().unwrap().to_string();
    assert!(err.contains("another process is listening"), "{err}");
    timeout(WAIT, transport.close()).await.unwrap().unwrap();
    assert!(!path.exists());
    let engine = FakeEngine::start(&ep).await;
    let _ = connect(&engine.endpoint, "fe").await;
    engine.stop().await;
}
