//! The HTTP server: listener (SO_REUSEPORT), accept loop, routing, auth, graceful drain.
//!
//! hyper 1.x through hyper-util's auto builder: HTTP/1.1 with keep-alive, and HTTP/2 with
//! prior knowledge (h2c). Drain: on shutdown the listener closes (no new connections), every
//! connection is told to finish its in-flight request and close, new requests that still
//! arrive on open connections get 503, and the server waits for in-flight responses (streams
//! included) up to the drain timeout.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;

use crate::engine::Engine;
use crate::error::ApiError;
use crate::handlers::{self, error_response, json_response};
use crate::metrics::Metrics;
use crate::text::TextModel;

pub type RespBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// When set, every endpoint but /health needs `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
    pub max_n: u32,
    pub tools: crate::tools::ToolConfig,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            api_key: None,
            max_body_bytes: 32 << 20,
            max_n: 128,
            tools: Default::default(),
        }
    }
}

pub struct AppState {
    pub engine: Engine,
    pub text: Arc<TextModel>,
    pub metrics: Arc<Metrics>,
    pub cfg: ServerConfig,
    pub started_unix: u64,
    draining: AtomicBool,
}

impl AppState {
    pub fn new(
        engine: Engine,
        text: Arc<TextModel>,
        metrics: Arc<Metrics>,
        cfg: ServerConfig,
    ) -> Self {
        Self {
            engine,
            text,
            metrics,
            cfg,
            started_unix: crate::api::response::unix_now(),
            draining: AtomicBool::new(false),
        }
    }

    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }
}

/// A listening socket with SO_REUSEADDR and, if asked, SO_REUSEPORT (so that several front-end
/// processes serve one port; the kernel spreads connections over them).
pub fn bind_listener(addr: SocketAddr, reuse_port: bool) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// Serves until `shutdown` resolves, then drains for at most `drain_timeout`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()>,
    drain_timeout: Duration,
) {
    let graceful = GracefulShutdown::new();
    let builder = auto::Builder::new(TokioExecutor::new());
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _peer) = match accepted {
                    Ok(s) => s,
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let st = state.clone();
                let svc = hyper::service::service_fn(move |req| {
                    let st = st.clone();
                    async move { Ok::<_, Infallible>(route(st, req).await) }
                });
                let conn = builder.serve_connection(TokioIo::new(stream), svc).into_owned();
                let watched = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = watched.await {
                        tracing::debug!(error = %e, "connection ended with an error");
                    }
                });
            }
            _ = &mut shutdown => break,
        }
    }
    drop(listener);
    state.draining.store(true, Ordering::Release);
    tracing::info!(
        timeout_s = drain_timeout.as_secs_f64(),
        "draining: no new connections; waiting for in-flight requests"
    );
    tokio::select! {
        _ = graceful.shutdown() => tracing::info!("drained"),
        _ = tokio::time::sleep(drain_timeout) => tracing::warn!("drain timeout: closing the remaining connections"),
    }
}

/// Constant-time comparison of the bearer token with the key.
fn authorized(req: &Request<Incoming>, key: &str) -> bool {
    let header = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    bearer_matches(header, key)
}

/// Whether `Authorization: Bearer <token>` carries `key`. The comparison takes the same
/// time wherever the first difference is (it depends on the lengths only).
fn bearer_matches(header: Option<&str>, key: &str) -> bool {
    let Some(given) = header.and_then(|v| v.strip_prefix("Bearer ")) else {
        return false;
    };
    let (a, b) = (given.trim().as_bytes(), key.as_bytes());
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0);
    }
    std::hint::black_box(diff) == 0
}

/// Reads and drops a rejected body, up to twice the limit and for at most a second, before
/// the 413 goes out (a lingering close): a client still writing its body would otherwise have
/// its connection reset under it and never read the error. Larger bodies are cut off.
async fn drain_rejected(mut body: Incoming, limit: usize) {
    let cap = limit.saturating_mul(2);
    let mut seen = 0usize;
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        while let Some(Ok(frame)) = body.frame().await {
            seen += frame.data_ref().map_or(0, Bytes::len);
            if seen > cap {
                break;
            }
        }
    })
    .await;
}

async fn read_body(req: Request<Incoming>, limit: usize) -> Result<Bytes, ApiError> {
    let declared = req
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        drain_rejected(req.into_body(), limit).await;
        return Err(ApiError::payload_too_large(limit));
    }
    match Limited::new(req.into_body(), limit).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(ApiError::payload_too_large(limit))
        }
        Err(e) => Err(ApiError::bad_request(format!(
            "Cannot read the request body: {e}"
        ))),
    }
}

async fn route(state: Arc<AppState>, req: Request<Incoming>) -> Response<RespBody> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let (endpoint, resp) = dispatch(&state, method, &path, req).await;
    let resp = resp.unwrap_or_else(|e| {
        if e.status.is_server_error() && e.status != StatusCode::SERVICE_UNAVAILABLE {
            tracing::error!(%path, error = %e, "request failed");
        }
        error_response(&e)
    });
    state
        .metrics
        .http_responses
        .with_label_values(&[endpoint, resp.status().as_str()])
        .inc();
    resp
}

async fn dispatch(
    state: &Arc<AppState>,
    method: Method,
    path: &str,
    req: Request<Incoming>,
) -> (&'static str, Result<Response<RespBody>, ApiError>) {
    const ROUTES: &[(&str, &str)] = &[
        ("/health", "GET"),
        ("/version", "GET"),
        ("/metrics", "GET"),
        ("/v1/models", "GET"),
        ("/v1/completions", "POST"),
        ("/v1/chat/completions", "POST"),
        ("/tokenize", "POST"),
        ("/detokenize", "POST"),
    ];
    let model_path = path.strip_prefix("/v1/models/").filter(|id| !id.is_empty());
    let route = ROUTES
        .iter()
        .find(|(p, _)| *p == path)
        .copied()
        .or(model_path.map(|_| ("/v1/models/{id}", "GET")));
    let Some((endpoint, allowed)) = route else {
        return ("other", Err(ApiError::not_found_route(path)));
    };
    if method.as_str() != allowed && !(method == Method::HEAD && allowed == "GET") {
        return (
            endpoint,
            Err(ApiError::method_not_allowed(method.as_str(), path)),
        );
    }
    if endpoint != "/health" {
        if let Some(key) = &state.cfg.api_key {
            if !authorized(&req, key) {
                return (endpoint, Err(ApiError::unauthorized()));
            }
        }
    }
    let result = match endpoint {
        "/health" => health(state),
        "/version" => Ok(json_response(
            StatusCode::OK,
            serde_json::json!({"version": env!("CARGO_PKG_VERSION")}).to_string(),
        )),
        "/metrics" => Ok(Response::builder()
            .header("content-type", "text/plain; version=0.0.4; charset=utf-8")
            .body(
                http_body_util::Full::new(Bytes::from(state.metrics.render()))
                    .map_err(|e| match e {})
                    .boxed(),
            )
            .expect("response")),
        "/v1/models" => handlers::models(state).await,
        "/v1/models/{id}" => handlers::model(state, model_path.unwrap_or_default()).await,
        _ => {
            let body = match read_body(req, state.cfg.max_body_bytes).await {
                Ok(b) => b,
                Err(e) => return (endpoint, Err(e)),
            };
            match endpoint {
                "/v1/completions" => handlers::completions(state.clone(), body).await,
                "/v1/chat/completions" => handlers::chat(state.clone(), body).await,
                "/tokenize" => handlers::tokenize(state.clone(), body).await,
                "/detokenize" => handlers::detokenize(state.clone(), body).await,
                _ => unreachable!("every route is handled"),
            }
        }
    };
    (endpoint, result)
}

fn health(state: &AppState) -> Result<Response<RespBody>, ApiError> {
    if state.draining() {
        return Err(ApiError::draining());
    }
    if !state.engine.is_healthy() {
        return Err(ApiError::engine_unavailable(&state.engine.last_error()));
    }
    Ok(json_response(StatusCode::OK, String::new()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens() {
        assert!(bearer_matches(Some("Bearer sk-1"), "sk-1"));
        assert!(bearer_matches(Some("Bearer  sk-1 "), "sk-1"));
        for bad in [
            None,
            Some("sk-1"),
            Some("Bearer sk-2"),
            Some("Bearer sk-1x"),
            Some("Bearer sk-"),
            Some("Bearer "),
            Some("bearer sk-1"),
            Some("Basic sk-1"),
        ] {
            assert!(!bearer_matches(bad, "sk-1"), "{bad:?}");
        }
        // Prefix and suffix of the key, and a longer token sharing the key as prefix.
        assert!(!bearer_matches(Some("Bearer sk-1\0"), "sk-1"));
    }

    #[test]
    fn reuse_port_listeners_share_a_port() {
        let a = bind_listener("127.0.0.1:0".parse().unwrap(), true).unwrap();
        let port = a.local_addr().unwrap().port();
        let b = bind_listener(SocketAddr::from(([127, 0, 0, 1], port)), true).unwrap();
        assert_eq!(b.local_addr().unwrap().port(), port);
        // Without SO_REUSEPORT the port is taken.
        assert!(bind_listener(SocketAddr::from(([127, 0, 0, 1], port)), false).is_err());
    }
}
