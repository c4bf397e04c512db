//! Test harness: a real engine-core server (in this process, on its own thread and runtime)
//! on a real socket, and a real client.

#![allow(dead_code)]

use std::collections::HashMap;
use std::time::Duration;

use harrier_engine::engine::EngineCore;
use harrier_engine::executor::Executor;
use harrier_engine::server::{serve, ServerOptions};
use harrier_shared::client::{ClientReceiver, EngineClient};
use harrier_shared::endpoint::Endpoint;
use harrier_shared::protocol::{
    EngineCoreRequest, EngineInfo, EngineLimits, EngineMessage, EngineStats, FinishReason,
    FrontendMessage, SamplingParams, TokenId, UtilityCall, UtilityRequest, UtilityResult,
    PROTOCOL_VERSION,
};

pub struct TestServer {
    pub endpoint: Endpoint,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
    _dir: tempfile::TempDir,
}

pub fn info(vocab: u32, max_model_len: u32) -> EngineInfo {
    EngineInfo {
        protocol_version: PROTOCOL_VERSION,
        engine_version: "test".into(),
        model_name: "test-model".into(),
        max_model_len,
        vocab_size: vocab,
        eos_token_ids: vec![],
        limits: EngineLimits {
            max_num_seqs: 0,
            max_num_batched_tokens: 0,
            max_logprobs: 20,
            block_size: 16,
            num_kv_blocks: 0,
            num_speculative_tokens: 0,
        },
    }
}

impl TestServer {
    /// Starts `engine` on a fresh ipc endpoint.
    pub fn start<E: Executor + Send + 'static>(
        engine: EngineCore<E>,
        info: EngineInfo,
    ) -> TestServer {
        Self::start_with(engine, info, ServerOptions::default())
    }

    pub fn start_with<E: Executor + Send + 'static>(
        engine: EngineCore<E>,
        info: EngineInfo,
        opts: ServerOptions,
    ) -> TestServer {
        let dir = tempfile::tempdir().unwrap();
        let endpoint: Endpoint = format!("ipc://{}/engine.sock", dir.path().display())
            .parse()
            .unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let ep = endpoint.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(serve(engine, info, &ep, opts, async move {
                let _ = rx.await;
            }))
        });
        TestServer {
            endpoint,
            shutdown: Some(tx),
            thread: Some(thread),
            _dir: dir,
        }
    }

    /// Sends the shutdown signal and returns how `serve` ended.
    pub fn stop(&mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.thread
            .take()
            .map(|t| t.join().unwrap())
            .unwrap_or(Ok(()))
    }

    /// Waits for `serve` to end on its own (e.g. after a fatal error).
    pub fn join(&mut self) -> anyhow::Result<()> {
        self.thread
            .take()
            .map(|t| t.join().unwrap())
            .unwrap_or(Ok(()))
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// What a request produced, as seen by the client.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Collected {
    pub tokens: Vec<TokenId>,
    pub finish: Option<FinishReason>,
    pub stop_token: Option<TokenId>,
    pub message: Option<String>,
    pub logprobs: usize,
    pub outputs_after_finish: usize,
}

pub struct Client {
    pub client: EngineClient,
    pub rx: ClientReceiver,
    pub info: EngineInfo,
    pub results: HashMap<String, Collected>,
    pub last_stats: EngineStats,
    next_call: u64,
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

impl Client {
    pub async fn connect(ep: &Endpoint) -> Client {
        let (client, rx, info) = EngineClient::connect(ep, "test-client", Duration::from_secs(10))
            .await
            .unwrap();
        Client {
            client,
            rx,
            info,
            results: HashMap::new(),
            last_stats: EngineStats::default(),
            next_call: 1,
        }
    }

    pub async fn submit(&self, id: &str, prompt: Vec<TokenId>, sampling: SamplingParams) {
        let req = EngineCoreRequest {
            request_id: id.to_string(),
            prompt_token_ids: prompt,
            sampling,
            arrival_time: 0.0,
            cache_salt: None,
        };
        self.client
            .send(FrontendMessage::Request(req))
            .await
            .unwrap();
    }

    pub async fn abort(&self, ids: &[&str]) {
        let a = harrier_shared::protocol::Abort {
            request_ids: ids.iter().map(|s| s.to_string()).collect(),
        };
        self.client.send(FrontendMessage::Abort(a)).await.unwrap();
    }

    /// Handles one message; returns false on timeout or a closed connection.
    pub async fn pump(&mut self, timeout: Duration) -> bool {
        let msg = match tokio::time::timeout(timeout, self.rx.recv()).await {
            Ok(Some(m)) => m,
            _ => return false,
        };
        if let EngineMessage::Outputs(o) = msg {
            self.last_stats = o.stats;
            for out in o.outputs {
                let c = self.results.entry(out.request_id.clone()).or_default();
                if c.finish.is_some() {
                    c.outputs_after_finish += 1;
                }
                c.tokens.extend(&out.new_token_ids);
                c.logprobs += out.logprobs.map(|l| l.len()).unwrap_or(0);
                if let Some(f) = out.finish {
                    c.finish = Some(f.reason);
                    c.stop_token = f.stop_token;
                    c.message = f.message;
                }
            }
        } else if let EngineMessage::Heartbeat(s) = msg {
            self.last_stats = s;
        }
        true
    }

    /// Pumps until every id in `ids` finished (panics after `limit`).
    pub async fn wait_all(&mut self, ids: &[String], limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        while !ids
            .iter()
            .all(|id| self.results.get(id).is_some_and(|c| c.finish.is_some()))
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "requests did not finish in {limit:?}"
            );
            if !self.pump(Duration::from_millis(500)).await {
                assert!(
                    self.client.is_connected(),
                    "the engine closed the connection; results so far: {:?}",
                    self.results
                );
            }
        }
    }

    pub async fn stats(&mut self) -> EngineStats {
        match self.utility(UtilityCall::Stats).await {
            UtilityResult::Stats(s) => *s,
            other => panic!("unexpected reply {other:?}"),
        }
    }

    /// Makes a utility call and waits for its reply (recording outputs meanwhile).
    pub async fn utility(&mut self, call: UtilityCall) -> UtilityResult {
        let call_id = self.next_call;
        self.next_call += 1;
        self.client
            .send(FrontendMessage::Utility(UtilityRequest { call_id, call }))
            .await
            .unwrap();
        loop {
            match tokio::time::timeout(Duration::from_secs(10), self.rx.recv())
                .await
                .expect("utility reply")
                .expect("connection")
            {
                EngineMessage::UtilityReply(r) if r.call_id == call_id => return r.result,
                EngineMessage::Outputs(o) => {
                    for out in o.outputs {
                        let c = self.results.entry(out.request_id.clone()).or_default();
                        c.tokens.extend(&out.new_token_ids);
                        if let Some(f) = out.finish {
                            c.finish = Some(f.reason);
                        }
                    }
                }
                _ => {}
            }
        }
    }

    /// Waits until the engine's stats (which trail a step behind outputs) show no KV in use.
    pub async fn wait_kv_free(&mut self) -> EngineStats {
        for _ in 0..100 {
            let s = self.stats().await;
            if s.kv_blocks_used == 0 && s.num_running == 0 && s.num_waiting == 0 {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("KV blocks still in use: {:?}", self.stats().await);
    }
}
