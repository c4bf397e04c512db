//! A minimal HTTP/1.1 client on hyper's connection API, for the serving benchmark, the
//! launcher's readiness probe and the end-to-end tests. Plain `http://` only.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;

/// `http://host:port[/base]` split into its socket address and host header.
#[derive(Debug, Clone)]
pub struct BaseUrl {
    pub addr: SocketAddr,
    pub host: String,
    pub prefix: String,
}

impl BaseUrl {
    pub async fn parse(url: &str) -> anyhow::Result<Self> {
        let Some(rest) = url.strip_prefix("http://") else {
            bail!("only http:// URLs are supported, got {url:?}")
        };
        let (hostport, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/').to_owned()),
            None => (rest, String::new()),
        };
        let hostport = if hostport.contains(':') {
            hostport.to_owned()
        } else {
            format!("{hostport}:80")
        };
        let addr = tokio::net::lookup_host(&hostport)
            .await
            .with_context(|| format!("resolving {hostport}"))?
            .next()
            .with_context(|| format!("{hostport} has no address"))?;
        Ok(Self {
            addr,
            host: hostport,
            prefix,
        })
    }

    pub fn from_addr(addr: SocketAddr) -> Self {
        Self {
            addr,
            host: addr.to_string(),
            prefix: String::new(),
        }
    }
}

/// One keep-alive connection.
pub struct Conn {
    base: BaseUrl,
    sender: SendRequest<Full<Bytes>>,
    api_key: Option<String>,
}

impl Conn {
    pub async fn connect(base: &BaseUrl, api_key: Option<&str>) -> anyhow::Result<Conn> {
        let stream = tokio::net::TcpStream::connect(base.addr)
            .await
            .with_context(|| format!("connecting to {}", base.addr))?;
        stream.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Conn {
            base: base.clone(),
            sender,
            api_key: api_key.map(str::to_owned),
        })
    }

    pub fn is_open(&self) -> bool {
        !self.sender.is_closed()
    }

    /// Sends a request; returns the status and the body still to be read.
    pub async fn send(
        &mut self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
    ) -> anyhow::Result<(StatusCode, Incoming)> {
        self.sender.ready().await?;
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base.prefix))
            .header("host", &self.base.host);
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        if let Some(key) = &self.api_key {
            req = req.header("authorization", format!("Bearer {key}"));
        }
        let req = req.body(Full::new(body.unwrap_or_default()))?;
        let resp = self.sender.send_request(req).await?;
        Ok((resp.status(), resp.into_body()))
    }

    /// Sends a request and reads the whole body.
    pub async fn call(
        &mut self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
    ) -> anyhow::Result<(StatusCode, Bytes)> {
        let (status, body) = self.send(method, path, body).await?;
        Ok((status, body.collect().await?.to_bytes()))
    }
}

/// One request on a fresh connection.
pub async fn call(
    base: &BaseUrl,
    method: Method,
    path: &str,
    body: Option<&str>,
) -> anyhow::Result<(StatusCode, Bytes)> {
    Conn::connect(base, None)
        .await?
        .call(method, path, body.map(|b| Bytes::from(b.to_owned())))
        .await
}

/// Reads server-sent events: yields each event's `data:` payload.
pub struct SseReader {
    body: Incoming,
    buf: Vec<u8>,
}

impl SseReader {
    pub fn new(body: Incoming) -> Self {
        Self {
            body,
            buf: Vec::new(),
        }
    }

    /// The next event's data, or `None` at the end of the body.
    pub async fn next(&mut self) -> anyhow::Result<Option<String>> {
        loop {
            if let Some(pos) = find_event_end(&self.buf) {
                let event: Vec<u8> = self.buf.drain(..pos + 2).collect();
                let text = std::str::from_utf8(&event[..pos]).context("SSE event is not UTF-8")?;
                let data: Vec<&str> = text
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect();
                if data.is_empty() {
                    continue;
                }
                return Ok(Some(data.join("\n")));
            }
            match self.body.frame().await {
                None => {
                    if !self.buf.iter().all(|b| b.is_ascii_whitespace()) {
                        bail!(
                            "stream ended inside an event: {:?}",
                            String::from_utf8_lossy(&self.buf)
                        );
                    }
                    return Ok(None);
                }
                Some(frame) => {
                    if let Ok(data) = frame?.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }
}

fn find_event_end(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\n\n")
}

/// Polls `GET /health` until it answers 200 or `timeout` passes.
pub async fn wait_healthy(base: &BaseUrl, timeout: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if let Ok((status, _)) = call(base, Method::GET, "/health", None).await {
            if status == StatusCode::OK {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}
