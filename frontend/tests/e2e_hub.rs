//! Models by Hub id against a local HTTP server that serves a model in the Hub's URL layout
//! (`/{org}/{name}/resolve/{revision}/{file}`, ranged GETs, `x-repo-commit` and `etag`
//! headers), reached through `HF_ENDPOINT`: download into the Hugging Face cache, resume
//! after a cut connection, offline reuse, 401 and 404 with clear errors, and `harrier serve
//! ORG/NAME` end to end.

mod common;

use std::collections::HashMap;
use std::convert::Infallible;
use std::hash::{Hash, Hasher};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::{free_port, runtime, Api, Proc};
use harrier_engine::hub::{fetch, HubConfig, HubError};
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const REPO: &str = "harrier-test/tiny-draft";
const GATED: &str = "harrier-test/gated";
const TOKEN: &str = "hf_secret";

/// The committed draft model: small, real, and loadable.
fn source_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../engine-core/models/harrier-cpu-draft")
}

fn files() -> HashMap<String, Bytes> {
    files_in(&source_dir())
}

fn files_in(dir: &Path) -> HashMap<String, Bytes> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                Bytes::from(std::fs::read(e.path()).unwrap()),
            )
        })
        .collect()
}

#[derive(Default)]
struct HubState {
    /// Repositories served besides REPO and GATED (the committed draft): id -> directory.
    extra: HashMap<String, PathBuf>,
    /// (path, Range header) of every GET, in order.
    log: Vec<(String, String)>,
    /// Cut the body of this file after this many bytes, once.
    cut: Option<(String, usize)>,
}

type Body = BoxBody<Bytes, std::io::Error>;

fn full(status: StatusCode, body: impl Into<Bytes>) -> Response<Body> {
    Response::builder()
        .status(status)
        .body(Full::new(body.into()).map_err(|e| match e {}).boxed())
        .unwrap()
}

fn handle(req: Request<hyper::body::Incoming>, state: &Mutex<HubState>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let (range, auth) = (header("range"), header("authorization"));
    state
        .lock()
        .unwrap()
        .log
        .push((path.clone(), range.clone()));
    // /{org}/{name}/resolve/{revision}/{file}
    let parts: Vec<&str> = path.trim_start_matches('/').splitn(5, '/').collect();
    let [org, name, "resolve", _rev, file] = parts[..] else {
        return full(StatusCode::NOT_FOUND, "no such route");
    };
    let repo = format!("{org}/{name}");
    if repo == GATED && auth != format!("Bearer {TOKEN}") {
        return full(StatusCode::UNAUTHORIZED, "gated");
    }
    let extra = state.lock().unwrap().extra.get(&repo).cloned();
    let files = match extra {
        Some(dir) => files_in(&dir),
        None if repo == REPO || repo == GATED => files(),
        None => return full(StatusCode::NOT_FOUND, "Repository not found"),
    };
    let Some(content) = files.get(file) else {
        return full(StatusCode::NOT_FOUND, "Entry not found");
    };
    let size = content.len();
    let start: usize = range
        .strip_prefix("bytes=")
        .and_then(|r| r.split('-').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let end = match range
        .strip_prefix("bytes=")
        .and_then(|r| r.split('-').nth(1))
    {
        Some(e) if !e.is_empty() => e.parse::<usize>().unwrap() + 1,
        _ => size,
    };
    let mut h = std::collections::hash_map::DefaultHasher::new();
    content.hash(&mut h);
    let body_bytes = content.slice(start..end);
    let builder = Response::builder()
        .status(StatusCode::PARTIAL_CONTENT)
        .header("x-repo-commit", COMMIT)
        .header("etag", format!("\"{:016x}{:08x}\"", h.finish(), size))
        .header("content-range", format!("bytes {start}-{}/{size}", end - 1))
        .header("content-length", body_bytes.len());
    let cut = {
        let mut st = state.lock().unwrap();
        match &st.cut {
            Some((f, n)) if f == file && end - start > 1 => {
                let n = *n;
                st.cut = None;
                Some(n)
            }
            _ => None,
        }
    };
    match cut {
        // Send the first n bytes, then fail the body: the connection drops mid-file.
        Some(n) => {
            let chunks: Vec<Result<Frame<Bytes>, std::io::Error>> = vec![
                Ok(Frame::data(body_bytes.slice(..n))),
                Err(std::io::Error::other("cut")),
            ];
            builder
                .body(StreamBody::new(futures::stream::iter(chunks)).boxed())
                .unwrap()
        }
        None => builder
            .body(Full::new(body_bytes).map_err(|e| match e {}).boxed())
            .unwrap(),
    }
}

/// A mock Hub on a loopback port, served by a thread of its own.
struct MockHub {
    addr: SocketAddr,
    state: Arc<Mutex<HubState>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MockHub {
    fn start() -> MockHub {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(HubState::default()));
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        let st = state.clone();
        let thread = std::thread::spawn(move || {
            let rt = runtime();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                loop {
                    tokio::select! {
                        _ = &mut rx => return,
                        accepted = listener.accept() => {
                            let Ok((stream, _)) = accepted else { continue };
                            let st = st.clone();
                            tokio::spawn(async move {
                                let svc = hyper::service::service_fn(move |req| {
                                    let st = st.clone();
                                    async move { Ok::<_, Infallible>(handle(req, &st)) }
                                });
                                let _ = hyper::server::conn::http1::Builder::new()
                                    .serve_connection(TokioIo::new(stream), svc)
                                    .await;
                            });
                        }
                    }
                }
            });
        });
        MockHub {
            addr,
            state,
            stop: Some(tx),
            thread: Some(thread),
        }
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn log(&self) -> Vec<(String, String)> {
        self.state.lock().unwrap().log.clone()
    }
}

impl Drop for MockHub {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn config(endpoint: &str, cache: &Path) -> HubConfig {
    HubConfig {
        endpoint: endpoint.into(),
        cache_dir: cache.into(),
        token: None,
        offline: false,
        progress_bar: false,
    }
}

fn assert_same_files(dir: &Path) {
    for (name, bytes) in files() {
        assert_eq!(
            std::fs::read(dir.join(&name)).unwrap(),
            bytes,
            "{name} differs from the served file"
        );
    }
}

#[test]
fn downloads_into_the_hf_cache_then_reuses_it_offline() {
    let hub = MockHub::start();
    let cache = tempfile::tempdir().unwrap();
    let m = fetch(&config(&hub.endpoint(), cache.path()), REPO, None).unwrap();
    let want = cache
        .path()
        .join("models--harrier-test--tiny-draft/snapshots")
        .join(COMMIT);
    assert_eq!(m.dir, want, "the standard cache layout");
    assert_same_files(&m.dir);
    assert_eq!(
        std::fs::read_to_string(
            cache
                .path()
                .join("models--harrier-test--tiny-draft/refs/main")
        )
        .unwrap(),
        COMMIT
    );
    harrier_engine::model::ModelDir::open(&m.dir).expect("a loadable model directory");
    // Only what serving needs: no index here, so the single weights file; nothing else asked.
    let asked: Vec<String> = hub.log().into_iter().map(|(p, _)| p).collect();
    assert!(asked
        .iter()
        .any(|p| p.ends_with("/model.safetensors.index.json")));
    assert!(asked.iter().all(
        |p| p.rsplit('/').next().is_some_and(|f| f.ends_with(".json")
            || f.ends_with(".jinja")
            || f == "model.safetensors")
    ));

    // A second fetch is served from the cache without the network; so is an offline one
    // after the Hub is gone.
    let before = hub.log().len();
    fetch(&config(&hub.endpoint(), cache.path()), REPO, None).unwrap();
    let fetched_again: Vec<_> = hub.log()[before..]
        .iter()
        .filter(|(p, _)| !p.contains("chat_template"))
        .cloned()
        .collect();
    assert!(
        fetched_again.is_empty(),
        "cached files were fetched again: {fetched_again:?}"
    );
    drop(hub);
    let mut offline = config("http://127.0.0.1:9", cache.path());
    offline.offline = true;
    assert_eq!(fetch(&offline, REPO, None).unwrap().dir, want);
}

#[test]
fn sharded_weights_come_with_their_index() {
    let repo_dir = tempfile::tempdir().unwrap();
    let mut args = harrier_engine::gen_model::GenModelArgs::new("micro", repo_dir.path());
    args.max_shard_size = Some(100_000);
    args.no_tokenizer = true;
    harrier_engine::gen_model::run(&args).unwrap();
    std::fs::copy(
        source_dir().join("tokenizer.json"),
        repo_dir.path().join("tokenizer.json"),
    )
    .unwrap();
    let shards: Vec<String> = std::fs::read_dir(repo_dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("model-") && n.ends_with(".safetensors"))
        .collect();
    assert!(shards.len() >= 2, "the generator wrote shards: {shards:?}");
    let hub = MockHub::start();
    hub.state
        .lock()
        .unwrap()
        .extra
        .insert("harrier-test/sharded".into(), repo_dir.path().into());
    let cache = tempfile::tempdir().unwrap();
    let m = fetch(
        &config(&hub.endpoint(), cache.path()),
        "harrier-test/sharded",
        None,
    )
    .unwrap();
    for (name, bytes) in files_in(repo_dir.path()) {
        assert_eq!(std::fs::read(m.dir.join(&name)).unwrap(), bytes, "{name}");
    }
    let asked: Vec<String> = hub.log().into_iter().map(|(p, _)| p).collect();
    assert!(
        !asked.iter().any(|p| p.ends_with("/model.safetensors")),
        "a sharded repository's single-file name is not asked for: {asked:?}"
    );
    let md = harrier_engine::model::ModelDir::open(&m.dir).unwrap();
    harrier_engine::model::Checkpoint::open(&md.path).expect("the sharded checkpoint opens");
}

#[test]
fn a_cut_download_resumes_where_it_stopped() {
    let hub = MockHub::start();
    let cut_at = 1_000_000;
    hub.state.lock().unwrap().cut = Some(("model.safetensors".into(), cut_at));
    let cache = tempfile::tempdir().unwrap();
    let m = fetch(&config(&hub.endpoint(), cache.path()), REPO, None).unwrap();
    assert_same_files(&m.dir);
    let ranges: Vec<String> = hub
        .log()
        .into_iter()
        .filter(|(p, r)| p.ends_with("/model.safetensors") && r != "bytes=0-0")
        .map(|(_, r)| r)
        .collect();
    assert_eq!(
        ranges,
        ["bytes=0-".to_string(), format!("bytes={cut_at}-")],
        "the second request continues from the last byte received"
    );
}

#[test]
fn errors_name_the_problem() {
    let hub = MockHub::start();
    let cache = tempfile::tempdir().unwrap();
    let cfg = config(&hub.endpoint(), cache.path());
    let e = fetch(&cfg, GATED, None).unwrap_err();
    assert!(
        matches!(e, HubError::Unauthorized { status: 401, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("HF_TOKEN"), "{e}");
    let mut with_token = cfg.clone();
    with_token.token = Some(TOKEN.into());
    fetch(&with_token, GATED, None).expect("the token opens the gated repository");

    let e = fetch(&cfg, "harrier-test/missing", None).unwrap_err();
    assert!(matches!(e, HubError::NotFound { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("harrier-test/missing") && msg.contains("config.json"),
        "{msg}"
    );

    let mut offline = cfg.clone();
    offline.offline = true;
    offline.cache_dir = cache.path().join("empty");
    let e = fetch(&offline, REPO, None).unwrap_err();
    assert!(matches!(e, HubError::NotCached { .. }), "{e}");
    assert!(e.to_string().contains("HF_HUB_OFFLINE"), "{e}");
}

#[test]
fn serve_by_hub_id() {
    let hub = MockHub::start();
    let home = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut server = Proc::spawn_env(
        "harrier serve",
        &[
            "serve",
            REPO,
            "--port",
            &port.to_string(),
            "--kv-cache-mib",
            "32",
        ],
        &[
            ("HF_ENDPOINT", hub.endpoint().as_str()),
            ("HF_HOME", home.path().to_str().unwrap()),
            ("HF_TOKEN", ""),
        ],
    );
    server.wait_for_line("Harrier is serving", Duration::from_secs(120));
    let api = Api::new(port, None);
    runtime().block_on(async {
        let (s, body) = api.get("/v1/models").await;
        assert_eq!(s, StatusCode::OK);
        let models: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(models["data"][0]["id"], REPO, "served under its Hub id");
        let (s, r) = api
            .post_json(
                "/v1/completions",
                &serde_json::json!({"model": REPO, "prompt": "import os", "max_tokens": 4, "ignore_eos": true}),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{r}");
        assert_eq!(r["usage"]["completion_tokens"], 4);
    });
    assert!(home
        .path()
        .join("hub/models--harrier-test--tiny-draft/snapshots")
        .join(COMMIT)
        .join("model.safetensors")
        .exists());
}
