//! End-to-end harness: real `harrier` processes on loopback, talked to over HTTP.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use harrier_frontend::http_client::{BaseUrl, Conn, SseReader};
use hyper::{Method, StatusCode};
use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_harrier");

/// The embedded default model (`harrier-cpu`: vocabulary 8192, context 2048, the Llama 3.1
/// chat template), written under `$HARRIER_HOME/models` once and reused.
pub fn default_model() -> PathBuf {
    harrier_engine::cli::ensure_default_model().expect("writing the embedded default model")
}

/// The name the default model is served as (its directory's name).
pub const MODEL_NAME: &str = harrier_engine::default_model::NAME;

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A child process killed (with its process group) when dropped.
pub struct Proc {
    pub child: Child,
    pub name: &'static str,
}

impl Proc {
    pub fn spawn(name: &'static str, args: &[&str]) -> Proc {
        Self::spawn_env(name, args, &[])
    }

    /// `harrier frontend` number `index` in front of the engine at `endpoint`, printing its
    /// readiness line, with `extra` arguments (e.g. `--port`, `--reuse-port`).
    pub fn frontend(model: &str, endpoint: &str, index: usize, extra: &[&str]) -> Proc {
        let index = index.to_string();
        let mut args = vec![
            "frontend",
            "--model",
            model,
            "--engine-endpoint",
            endpoint,
            "--ready-line",
            "--frontend-index",
            &index,
        ];
        args.extend_from_slice(extra);
        Self::spawn("frontend", &args)
    }

    /// As [`Proc::spawn`], with extra environment variables.
    pub fn spawn_env(name: &'static str, args: &[&str], env: &[(&str, &str)]) -> Proc {
        use std::os::unix::process::CommandExt;
        let child = Command::new(BIN)
            .args(args)
            .envs(env.iter().copied())
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {name}: {e}"));
        Proc { child, name }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill with plain integers on a child we have not reaped.
        unsafe {
            libc::kill(self.pid(), sig);
        }
    }

    /// Waits for the exit status for at most `timeout`.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Reads stdout lines until one contains `needle` (echoing them), or panics after `timeout`.
    pub fn wait_for_line(&mut self, needle: &str, timeout: Duration) -> String {
        let out = self.child.stdout.take().expect("stdout piped");
        let (tx, rx) = std::sync::mpsc::channel();
        let needle = needle.to_owned();
        std::thread::spawn(move || {
            let mut found = false;
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                eprintln!("[stdout] {line}");
                if !found && line.contains(&needle) {
                    found = true;
                    let _ = tx.send(line);
                }
            }
        });
        rx.recv_timeout(timeout).unwrap_or_else(|_| {
            panic!(
                "{}: no line containing the marker within {timeout:?}",
                self.name
            )
        })
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            // SAFETY: the group is our child's own (process_group(0)); plain integers.
            unsafe {
                libc::killpg(self.pid(), libc::SIGKILL);
            }
            let _ = self.child.wait();
        }
    }
}

/// A running `harrier serve`.
pub struct Served {
    pub proc: Proc,
    pub port: u16,
    /// The first engine core's pid: the group of the launcher's children.
    pub engine_pid: i32,
    /// The launcher's readiness line.
    pub line: String,
    pub api: Api,
}

/// `harrier serve` of the embedded model on a free port (32 MiB of KV) with `extra`
/// options, once it says it serves.
pub fn serve(extra: &[&str]) -> Served {
    let model = default_model();
    let port = free_port();
    let port_s = port.to_string();
    let mut args = vec![
        "serve",
        "--model",
        model.to_str().unwrap(),
        "--port",
        &port_s,
        "--kv-cache-mib",
        "32",
    ];
    args.extend_from_slice(extra);
    let mut proc = Proc::spawn("harrier serve", &args);
    let line = proc.wait_for_line("Harrier is serving", Duration::from_secs(300));
    let engine_pid: i32 = line
        .split("engine pid ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no engine pid in {line:?}"));
    Served {
        proc,
        port,
        engine_pid,
        line,
        api: Api::new(port, None),
    }
}

/// Whether any process is still in group `pgid`.
pub fn group_alive(pgid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    unsafe { libc::killpg(pgid, 0) == 0 }
}

/// An HTTP client for one server, with a current-thread runtime of its own.
#[derive(Clone)]
pub struct Api {
    pub base: BaseUrl,
    pub key: Option<String>,
}

pub struct Streamed {
    pub status: StatusCode,
    /// Each event's data, `[DONE]` included.
    pub events: Vec<String>,
}

impl Streamed {
    pub fn chunks(&self) -> Vec<Value> {
        self.events
            .iter()
            .filter(|e| *e != "[DONE]")
            .map(|e| serde_json::from_str(e).unwrap())
            .collect()
    }

    /// Per choice index: the concatenated text (completions) or content (chat).
    pub fn texts(&self, n: usize) -> Vec<String> {
        let mut out = vec![String::new(); n];
        for c in self.chunks() {
            for ch in c["choices"].as_array().into_iter().flatten() {
                let i = ch["index"].as_u64().unwrap() as usize;
                if let Some(t) = ch["text"].as_str().or(ch["delta"]["content"].as_str()) {
                    out[i].push_str(t);
                }
            }
        }
        out
    }

    pub fn finish_reasons(&self, n: usize) -> Vec<Option<String>> {
        let mut out = vec![None; n];
        for c in self.chunks() {
            for ch in c["choices"].as_array().into_iter().flatten() {
                if let Some(r) = ch["finish_reason"].as_str() {
                    let i = ch["index"].as_u64().unwrap() as usize;
                    assert!(out[i].is_none(), "two finish reasons for choice {i}");
                    out[i] = Some(r.to_owned());
                }
            }
        }
        out
    }
}

impl Api {
    pub fn new(port: u16, key: Option<&str>) -> Api {
        Api {
            base: BaseUrl::from_addr(SocketAddr::from(([127, 0, 0, 1], port))),
            key: key.map(str::to_owned),
        }
    }

    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
    ) -> (StatusCode, Bytes) {
        let mut c = Conn::connect(&self.base, self.key.as_deref())
            .await
            .unwrap();
        c.call(method, path, body).await.unwrap()
    }

    pub async fn get(&self, path: &str) -> (StatusCode, Bytes) {
        self.call(Method::GET, path, None).await
    }

    pub async fn post_json(&self, path: &str, body: &Value) -> (StatusCode, Value) {
        let (s, b) = self
            .call(Method::POST, path, Some(Bytes::from(body.to_string())))
            .await;
        (
            s,
            serde_json::from_slice(&b)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&b).into_owned())),
        )
    }

    pub async fn stream(&self, path: &str, body: &Value) -> Streamed {
        let mut c = Conn::connect(&self.base, self.key.as_deref())
            .await
            .unwrap();
        let (status, body) = c
            .send(Method::POST, path, Some(Bytes::from(body.to_string())))
            .await
            .unwrap();
        let mut sse = SseReader::new(body);
        let mut events = Vec::new();
        while let Some(e) = sse.next().await.unwrap() {
            events.push(e);
        }
        Streamed { status, events }
    }

    pub async fn metric(&self, name: &str) -> f64 {
        let (s, body) = self.get("/metrics").await;
        assert_eq!(s, StatusCode::OK);
        let text = String::from_utf8(body.to_vec()).unwrap();
        text.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("metric {name} not found"))
    }

    pub async fn wait_health(&self, want: StatusCode, timeout: Duration) -> Duration {
        let start = Instant::now();
        loop {
            let status = match Conn::connect(&self.base, None).await {
                Ok(mut c) => c
                    .call(Method::GET, "/health", None)
                    .await
                    .map(|(s, _)| s)
                    .unwrap_or(StatusCode::BAD_GATEWAY),
                Err(_) => StatusCode::BAD_GATEWAY,
            };
            if status == want {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < timeout,
                "/health did not answer {want} within {timeout:?} (last {status})"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}
