//! `harrier frontend`: one front-end process (HTTP server + engine client).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use harrier_shared::endpoint::{default_engine_endpoint, private_socket_dir, Endpoint};

use crate::engine::{Engine, EngineOptions};
use crate::metrics::Metrics;
use crate::server::{bind_listener, serve, AppState, ServerConfig};
use crate::text::{TextModel, TextSource};

/// What the front end prints on stdout once it listens and the engine answered (the launcher
/// waits for this line).
pub const READY_MARKER: &str = "HARRIER_FRONTEND_READY";

/// Options every front end has (shared with `harrier serve`).
#[derive(Debug, Clone, clap::Args)]
pub struct HttpArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1", env = "HARRIER_HOST")]
    pub host: IpAddr,
    #[arg(long, default_value_t = 8000, env = "HARRIER_PORT")]
    pub port: u16,
    /// Require `Authorization: Bearer <key>` on every endpoint but /health.
    #[arg(long, env = "HARRIER_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Seconds to let in-flight requests finish on SIGTERM/SIGINT.
    #[arg(long, default_value_t = 30.0)]
    pub drain_timeout: f64,
    /// tokenizer.json to use instead of the model directory's.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Jinja chat template file to use instead of the model's, or a built-in one by name:
    /// `llama3.1`, `gemma3`.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Largest accepted request body in bytes.
    #[arg(long, default_value_t = 32 << 20)]
    pub max_body_bytes: usize,
    /// Largest accepted `n` (choices per prompt).
    #[arg(long, default_value_t = 128)]
    pub max_n: u32,
    /// Concurrent tokenization / template jobs (default: the number of cores).
    #[arg(long)]
    pub tokenizer_threads: Option<usize>,
    /// How tool calls are found in the model's text (and written by forced tool choice).
    #[arg(long, value_enum)]
    pub tool_call_parser: Option<crate::tools::ToolCallParser>,
    /// Let the model decide whether to call tools (`tool_choice: "auto"`, the default with
    /// `tools`); needs --tool-call-parser.
    #[arg(long)]
    pub enable_auto_tool_choice: bool,
}

impl HttpArgs {
    /// Rejects values clap accepts but that make no sense (an empty key would let an empty
    /// bearer token in).
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
            anyhow::bail!("--api-key / HARRIER_API_KEY is empty; unset it to serve without a key");
        }
        if !(self.drain_timeout.is_finite() && self.drain_timeout >= 0.0) {
            anyhow::bail!("--drain-timeout must be a non-negative number of seconds");
        }
        if self.enable_auto_tool_choice && self.tool_call_parser.is_none() {
            anyhow::bail!(
                "--enable-auto-tool-choice needs --tool-call-parser (llama3_json or hermes)"
            );
        }
        if self.max_n == 0 || self.max_body_bytes == 0 {
            anyhow::bail!("--max-n and --max-body-bytes must be at least 1");
        }
        Ok(())
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct FrontendArgs {
    /// Model directory (tokenizer.json, tokenizer_config.json) or Hub model id, as the engine
    /// core's `--model`. Default: the embedded `harrier-cpu`.
    #[arg(long, env = "HARRIER_MODEL")]
    pub model: Option<PathBuf>,
    /// Hub models: the branch, tag or commit (default `main`).
    #[arg(long, env = "HARRIER_REVISION")]
    pub revision: Option<String>,
    /// The engine core's address; several, comma-separated (or the option repeated), for
    /// data parallelism: each request goes to one of them. Default: `engine.sock` in the
    /// private socket directory.
    #[arg(long, env = "HARRIER_ENGINE_ENDPOINT", value_delimiter = ',')]
    pub engine_endpoint: Vec<Endpoint>,
    #[arg(long, env = "HARRIER_SOCKET_DIR")]
    pub socket_dir: Option<PathBuf>,
    #[command(flatten)]
    pub http: HttpArgs,
    /// Set SO_REUSEPORT so several front ends can serve one port.
    #[arg(long)]
    pub reuse_port: bool,
    /// This front end's number (its name towards the engine).
    #[arg(long, default_value_t = 0)]
    pub frontend_index: u32,
    /// A directory shared by the front ends of one server: each publishes its request metrics
    /// there and /metrics on any of them reports the sum (docs/frontend.md, "Metrics").
    /// `harrier serve` passes one; without it a front end reports only its own requests.
    #[arg(long, env = "HARRIER_METRICS_DIR")]
    pub metrics_dir: Option<PathBuf>,
    /// Print a readiness line on stdout (used by `harrier serve`).
    #[arg(long, hide = true)]
    pub ready_line: bool,
}

/// The engine cores a front end talks to: `--engine-endpoint` (repeated options add up: the
/// systemd units name engine core 0 and HARRIER_FRONTEND_ARGS the others; an address named
/// twice is one engine core), or the default socket.
fn engine_endpoints(args: &FrontendArgs) -> anyhow::Result<Vec<Endpoint>> {
    if args.engine_endpoint.is_empty() {
        return Ok(vec![default_engine_endpoint(&private_socket_dir(
            args.socket_dir.as_deref(),
        )?)]);
    }
    let mut v: Vec<Endpoint> = Vec::new();
    for e in &args.engine_endpoint {
        if !v.contains(e) {
            v.push(e.clone());
        }
    }
    Ok(v)
}

/// Runs a front end until SIGTERM/SIGINT (then drains and exits 0).
pub fn run_frontend(args: FrontendArgs) -> anyhow::Result<()> {
    args.http.validate()?;
    let model_dir =
        harrier_engine::cli::resolve_model(args.model.as_deref(), args.revision.as_deref())?.dir;
    let endpoints = engine_endpoints(&args)?;
    let endpoint = endpoints
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2);
    let pool = args.http.tokenizer_threads.unwrap_or(threads);
    // Load the tokenizer before any runtime thread exists.
    let text = Arc::new(TextModel::load(
        &TextSource {
            model_dir: model_dir.clone(),
            tokenizer: args.http.tokenizer.clone(),
            chat_template: args.http.chat_template.clone(),
        },
        pool,
    )?);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.clamp(2, 8))
        .enable_all()
        .thread_name("harrier-frontend")
        .build()?;
    rt.block_on(async move {
        let name = format!("frontend-{}", args.frontend_index);
        let mut metrics = Metrics::new(&args.frontend_index.to_string());
        if let Some(dir) = &args.metrics_dir {
            let identity = format!("frontend-{}-{}", args.frontend_index, std::process::id());
            metrics = metrics.share(dir, identity).with_context(|| format!("metrics directory {}", dir.display()))?;
        }
        let metrics = Arc::new(metrics);
        let publisher = args.metrics_dir.is_some().then(|| {
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(crate::metrics::shared::SNAPSHOT_INTERVAL);
                loop {
                    tick.tick().await;
                    metrics.publish();
                }
            })
        });
        let engine = Engine::start(EngineOptions::many(endpoints, name), text.tokenizer.clone(), metrics.clone())?;
        let mut shutdown = std::pin::pin!(harrier_engine::cli::shutdown_signal());
        tracing::info!(%endpoint, "waiting for the engine core");
        // Every engine core answering, so the first requests spread; after a minute, serve
        // with those that do (a core that is down fails nothing while it is not used).
        let waiting_since = std::time::Instant::now();
        loop {
            tokio::select! {
                ok = engine.wait_all_connected(Duration::from_secs(10)) => if ok { break } else if engine.is_healthy() && waiting_since.elapsed() > Duration::from_secs(60) {
                    tracing::warn!(%endpoint, error = %engine.last_error(), "serving without every engine core; the others join when they answer");
                    break;
                } else {
                    tracing::info!(%endpoint, error = %engine.last_error(), "still waiting for the engine core");
                },
                _ = &mut shutdown => return Ok(()),
            }
        }
        let addr = SocketAddr::new(args.http.host, args.http.port);
        let std_listener = bind_listener(addr, args.reuse_port).with_context(|| format!("listening on {addr}"))?;
        let listener = tokio::net::TcpListener::from_std(std_listener)?;
        let local = listener.local_addr()?;
        let cfg = ServerConfig {
            api_key: args.http.api_key.clone(),
            max_body_bytes: args.http.max_body_bytes,
            max_n: args.http.max_n,
            tools: crate::tools::ToolConfig {
                parser: args.http.tool_call_parser,
                enable_auto: args.http.enable_auto_tool_choice,
            },
        };
        let state = Arc::new(AppState::new(engine.clone(), text, metrics.clone(), cfg));
        tracing::info!(url = %format!("http://{local}"), model = %model_dir.display(), "front end ready");
        if args.ready_line {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            writeln!(out, "{READY_MARKER} http://{local}")?;
            out.flush()?;
        }
        serve(listener, state, shutdown, Duration::from_secs_f64(args.http.drain_timeout.max(0.0))).await;
        if let Some(task) = publisher {
            task.abort();
        }
        metrics.publish(); // the final counts (a no-op without a shared directory)
        engine.close().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_endpoints_add_up_and_repeats_count_once() {
        #[derive(clap::Parser)]
        struct W {
            #[command(flatten)]
            a: FrontendArgs,
        }
        let parse = |args: &[&str]| {
            let mut all = vec!["harrier"];
            all.extend_from_slice(args);
            <W as clap::Parser>::try_parse_from(all).unwrap().a
        };
        let a = parse(&[
            "--engine-endpoint",
            "tcp://127.0.0.1:5000",
            "--engine-endpoint",
            "tcp://127.0.0.1:5001,tcp://127.0.0.1:5000",
        ]);
        let got: Vec<String> = engine_endpoints(&a)
            .unwrap()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(got, ["tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001"]);
    }
}
