//! `harrier bench serve`: a serving benchmark in the spirit of `vllm bench serve`.
//!
//! Random-token prompts (sent as token-id lists, so input lengths are exact) with
//! `ignore_eos` (so output lengths are exact), streamed completions, sent at a Poisson
//! request rate and/or with at most `--max-concurrency` requests in flight. Reports request
//! throughput, output tokens/s, and TTFT, TPOT and ITL (mean, p50, p90, p99), as text and,
//! with `--json`, as JSON.
//!
//! `--engine-endpoint` sends the same workload straight to an engine core over its ZeroMQ
//! protocol (no HTTP, no tokenizer, no detokenizer): the difference to a run through the
//! front ends is the front end's share of the cost.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use harrier_engine::splitmix::SplitMix64;
use harrier_shared::client::EngineClient;
use harrier_shared::endpoint::Endpoint;
use harrier_shared::protocol::{EngineCoreRequest, EngineMessage, FrontendMessage, SamplingParams};
use hyper::{Method, StatusCode};
use serde::Serialize;
use tokio::sync::{mpsc, Semaphore};

use crate::http_client::{BaseUrl, Conn, SseReader};

#[derive(Debug, Clone, clap::Args)]
pub struct BenchServeArgs {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// Benchmark an engine core directly over its protocol instead of the HTTP server.
    #[arg(long)]
    pub engine_endpoint: Option<Endpoint>,
    /// Model name to send (default: the server's first model).
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long, default_value_t = 200)]
    pub num_prompts: usize,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 128)]
    pub input_len: u32,
    /// Generated tokens per request (ignore_eos makes it exact).
    #[arg(long, default_value_t = 64)]
    pub output_len: u32,
    /// Requests per second (Poisson arrivals); `inf` sends all at once.
    #[arg(long, default_value = "inf")]
    pub request_rate: f64,
    /// At most this many requests in flight.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Random prompt token ids are drawn from [LO, HI).
    #[arg(long, default_value = "100-1000", value_parser = parse_range)]
    pub token_id_range: (u32, u32),
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, env = "HARRIER_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Write the results as JSON to this file (`-` for stdout).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// A label recorded in the JSON (e.g. "2 front ends").
    #[arg(long, default_value = "")]
    pub label: String,
    #[arg(long)]
    pub no_progress: bool,
}

fn parse_range(s: &str) -> Result<(u32, u32), String> {
    let (a, b) = s.split_once('-').ok_or("expected LO-HI")?;
    let (a, b): (u32, u32) = (
        a.parse().map_err(|e| format!("{e}"))?,
        b.parse().map_err(|e| format!("{e}"))?,
    );
    if a >= b {
        return Err("LO must be below HI".into());
    }
    Ok((a, b))
}

/// What one request measured.
#[derive(Debug, Clone, Default)]
struct Sample {
    ok: bool,
    error: String,
    output_tokens: u32,
    ttft: f64,
    latency: f64,
    itls: Vec<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Percentiles {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

fn percentiles(v: &mut [f64]) -> Percentiles {
    if v.is_empty() {
        return Percentiles {
            mean: 0.0,
            p50: 0.0,
            p90: 0.0,
            p99: 0.0,
        };
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| {
        // Linear interpolation, as numpy.percentile.
        let pos = q * (v.len() - 1) as f64;
        let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
        v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
    };
    Percentiles {
        mean: v.iter().sum::<f64>() / v.len() as f64,
        p50: at(0.5),
        p90: at(0.9),
        p99: at(0.99),
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    pub label: String,
    pub target: String,
    pub num_prompts: usize,
    pub input_len: u32,
    pub output_len: u32,
    pub request_rate: f64,
    pub max_concurrency: Option<usize>,
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub total_input_tokens: u64,
    pub total_output_tokens: u64,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft_ms: Percentiles,
    pub tpot_ms: Percentiles,
    pub itl_ms: Percentiles,
    pub e2e_ms: Percentiles,
    pub errors: Vec<String>,
}

pub fn run_bench_serve(args: BenchServeArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = rt.block_on(bench(args.clone()))?;
    print_report(&result);
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&result)?;
        if path.as_os_str() == "-" {
            println!("{text}");
        } else {
            std::fs::write(path, text + "\n")
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    if result.completed == 0 {
        bail!("every request failed");
    }
    Ok(())
}

pub async fn bench(args: BenchServeArgs) -> anyhow::Result<BenchResult> {
    let mut rng = SplitMix64(args.seed ^ 0x5EED);
    let (lo, hi) = args.token_id_range;
    let prompts: Vec<Vec<u32>> = (0..args.num_prompts)
        .map(|_| {
            (0..args.input_len)
                .map(|_| lo + (rng.next_u64() % u64::from(hi - lo)) as u32)
                .collect()
        })
        .collect();
    let target: Arc<dyn Target> = match &args.engine_endpoint {
        Some(ep) => Arc::new(EngineTarget::connect(ep).await?),
        None => Arc::new(HttpTarget::new(&args).await?),
    };
    let target_name = target.describe();
    let bar = if args.no_progress {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(args.num_prompts as u64)
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} requests [{elapsed_precise}<{eta_precise}]",
        )
        .expect("template"),
    );
    let limit = Arc::new(Semaphore::new(
        args.max_concurrency.unwrap_or(Semaphore::MAX_PERMITS),
    ));
    let samples = Arc::new(Mutex::new(Vec::with_capacity(args.num_prompts)));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for prompt in prompts {
        if args.request_rate.is_finite() && args.request_rate > 0.0 {
            let gap = -(1.0 - rng.unit()).ln() / args.request_rate;
            tokio::time::sleep(Duration::from_secs_f64(gap)).await;
        }
        let permit = limit.clone().acquire_owned().await?;
        let (target, samples, bar, out_len) = (
            target.clone(),
            samples.clone(),
            bar.clone(),
            args.output_len,
        );
        tasks.push(tokio::spawn(async move {
            let s = target.run(prompt, out_len).await;
            drop(permit);
            samples.lock().expect("samples").push(s);
            bar.inc(1);
        }));
    }
    for t in tasks {
        t.await?;
    }
    let duration = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let samples = std::mem::take(&mut *samples.lock().expect("samples"));
    Ok(summarize(&args, target_name, duration, samples))
}

fn summarize(
    args: &BenchServeArgs,
    target: String,
    duration: f64,
    samples: Vec<Sample>,
) -> BenchResult {
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    let mut errors: Vec<String> = samples
        .iter()
        .filter(|s| !s.ok)
        .map(|s| s.error.clone())
        .collect();
    errors.sort();
    errors.dedup();
    let total_out: u64 = ok.iter().map(|s| u64::from(s.output_tokens)).sum();
    let total_in = ok.len() as u64 * u64::from(args.input_len);
    let ms = |v: Vec<f64>| {
        let mut v: Vec<f64> = v.into_iter().map(|x| x * 1e3).collect();
        percentiles(&mut v)
    };
    BenchResult {
        label: args.label.clone(),
        target,
        num_prompts: args.num_prompts,
        input_len: args.input_len,
        output_len: args.output_len,
        request_rate: args.request_rate,
        max_concurrency: args.max_concurrency,
        completed: ok.len(),
        failed: samples.len() - ok.len(),
        duration_s: duration,
        total_input_tokens: total_in,
        total_output_tokens: total_out,
        request_throughput: ok.len() as f64 / duration,
        output_throughput: total_out as f64 / duration,
        total_token_throughput: (total_in + total_out) as f64 / duration,
        ttft_ms: ms(ok.iter().map(|s| s.ttft).collect()),
        tpot_ms: ms(ok
            .iter()
            .filter(|s| s.output_tokens > 1)
            .map(|s| (s.latency - s.ttft) / f64::from(s.output_tokens - 1))
            .collect()),
        itl_ms: ms(ok.iter().flat_map(|s| s.itls.iter().copied()).collect()),
        e2e_ms: ms(ok.iter().map(|s| s.latency).collect()),
        errors,
    }
}

fn print_report(r: &BenchResult) {
    let line = |k: &str, v: String| println!("{k:<40}{v:>12}");
    println!("{:=^52}", " Serving Benchmark Result ");
    line("Target:", r.target.clone());
    line("Successful requests:", r.completed.to_string());
    line("Failed requests:", r.failed.to_string());
    line("Benchmark duration (s):", format!("{:.2}", r.duration_s));
    line("Total input tokens:", r.total_input_tokens.to_string());
    line("Total generated tokens:", r.total_output_tokens.to_string());
    line(
        "Request throughput (req/s):",
        format!("{:.2}", r.request_throughput),
    );
    line(
        "Output token throughput (tok/s):",
        format!("{:.2}", r.output_throughput),
    );
    line(
        "Total token throughput (tok/s):",
        format!("{:.2}", r.total_token_throughput),
    );
    for (title, p) in [
        ("Time to First Token", &r.ttft_ms),
        ("Time per Output Token (excl. 1st token)", &r.tpot_ms),
        ("Inter-token Latency", &r.itl_ms),
        ("End-to-end Latency", &r.e2e_ms),
    ] {
        println!("{:-^52}", format!(" {title} "));
        let short: String = title
            .split_whitespace()
            .filter_map(|w| w.chars().next())
            .filter(|c| c.is_uppercase())
            .collect();
        line(&format!("Mean {short} (ms):"), format!("{:.2}", p.mean));
        line(&format!("P50 {short} (ms):"), format!("{:.2}", p.p50));
        line(&format!("P90 {short} (ms):"), format!("{:.2}", p.p90));
        line(&format!("P99 {short} (ms):"), format!("{:.2}", p.p99));
    }
    println!("{}", "=".repeat(52));
    for e in r.errors.iter().take(5) {
        println!("error: {e}");
    }
}

trait Target: Send + Sync {
    fn describe(&self) -> String;
    /// One request.
    fn try_run(
        &self,
        prompt: Vec<u32>,
        output_len: u32,
    ) -> futures::future::BoxFuture<'_, anyhow::Result<Sample>>;
    /// One request; a failure becomes the sample's `error`.
    fn run(&self, prompt: Vec<u32>, output_len: u32) -> futures::future::BoxFuture<'_, Sample> {
        let request = self.try_run(prompt, output_len);
        Box::pin(async move {
            request.await.unwrap_or_else(|e| Sample {
                error: format!("{e:#}"),
                ..Default::default()
            })
        })
    }
}

struct HttpTarget {
    base: BaseUrl,
    model: String,
    api_key: Option<String>,
}

impl HttpTarget {
    async fn new(args: &BenchServeArgs) -> anyhow::Result<Self> {
        let base = BaseUrl::parse(&args.base_url).await?;
        let model = match &args.model {
            Some(m) => m.clone(),
            None => {
                let mut conn = Conn::connect(&base, args.api_key.as_deref()).await?;
                let (status, body) = conn.call(Method::GET, "/v1/models", None).await?;
                if status != StatusCode::OK {
                    bail!(
                        "GET /v1/models answered {status}: {}",
                        String::from_utf8_lossy(&body)
                    );
                }
                let v: serde_json::Value = serde_json::from_slice(&body)?;
                v["data"][0]["id"]
                    .as_str()
                    .context("no model in /v1/models")?
                    .to_owned()
            }
        };
        Ok(Self {
            base,
            model,
            api_key: args.api_key.clone(),
        })
    }

    async fn request(&self, prompt: Vec<u32>, output_len: u32) -> anyhow::Result<Sample> {
        let body = serde_json::json!({
            "model": self.model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": true,
            "temperature": 0.0, "stream": true, "stream_options": {"include_usage": true},
        });
        let start = Instant::now();
        let mut conn = Conn::connect(&self.base, self.api_key.as_deref()).await?;
        let (status, body) = conn
            .send(
                Method::POST,
                "/v1/completions",
                Some(Bytes::from(body.to_string())),
            )
            .await?;
        if status != StatusCode::OK {
            use http_body_util::BodyExt;
            let text = body
                .collect()
                .await
                .map(|c| c.to_bytes())
                .unwrap_or_default();
            bail!("HTTP {status}: {}", String::from_utf8_lossy(&text));
        }
        let mut sse = SseReader::new(body);
        let mut s = Sample::default();
        let mut last: Option<Instant> = None;
        while let Some(data) = sse.next().await? {
            if data == "[DONE]" {
                break;
            }
            let v: serde_json::Value = serde_json::from_str(&data)?;
            if let Some(e) = v.get("error") {
                bail!("error event: {e}");
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                s.output_tokens = u["completion_tokens"].as_u64().unwrap_or(0) as u32;
            }
            let has_text = v["choices"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|c| c["text"].as_str().is_some_and(|t| !t.is_empty()))
            });
            if has_text {
                let now = Instant::now();
                match last {
                    None => s.ttft = (now - start).as_secs_f64(),
                    Some(prev) => s.itls.push((now - prev).as_secs_f64()),
                }
                last = Some(now);
            }
        }
        s.latency = start.elapsed().as_secs_f64();
        s.ok = true;
        Ok(s)
    }
}

impl Target for HttpTarget {
    fn describe(&self) -> String {
        format!("http://{}{}", self.base.host, self.base.prefix)
    }

    fn try_run(
        &self,
        prompt: Vec<u32>,
        output_len: u32,
    ) -> futures::future::BoxFuture<'_, anyhow::Result<Sample>> {
        Box::pin(self.request(prompt, output_len))
    }
}

/// (arrival, new tokens, finished) of one engine output.
type OutputTick = (Instant, usize, bool);
type Routes = Arc<Mutex<HashMap<String, mpsc::UnboundedSender<OutputTick>>>>;

/// Straight to the engine: one connection, outputs routed to requests by id.
struct EngineTarget {
    endpoint: Endpoint,
    client: EngineClient,
    routes: Routes,
    next: std::sync::atomic::AtomicU64,
}

impl EngineTarget {
    async fn connect(ep: &Endpoint) -> anyhow::Result<Self> {
        let (client, mut rx, _info) =
            EngineClient::connect(ep, "bench", Duration::from_secs(10)).await?;
        let routes: Routes = Arc::default();
        let r = routes.clone();
        tokio::spawn(async move {
            while let Some(msg) = rx.recv().await {
                if let EngineMessage::Outputs(o) = msg {
                    let now = Instant::now();
                    let routes = r.lock().expect("routes");
                    for out in o.outputs {
                        if let Some(tx) = routes.get(&out.request_id) {
                            let _ = tx.send((now, out.new_token_ids.len(), out.finish.is_some()));
                        }
                    }
                }
            }
            // Connection lost: fail everyone still waiting.
            r.lock().expect("routes").clear();
        });
        Ok(Self {
            endpoint: ep.clone(),
            client,
            routes,
            next: Default::default(),
        })
    }

    async fn request(&self, prompt: Vec<u32>, output_len: u32) -> anyhow::Result<Sample> {
        let id = format!(
            "bench-{}",
            self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let (tx, mut rx) = mpsc::unbounded_channel();
        self.routes.lock().expect("routes").insert(id.clone(), tx);
        let sampling = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(output_len)
        };
        let start = Instant::now();
        let arrival_time = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        self.client
            .send(FrontendMessage::Request(EngineCoreRequest {
                request_id: id.clone(),
                prompt_token_ids: prompt,
                sampling,
                arrival_time,
                cache_salt: None,
            }))
            .await?;
        let mut s = Sample::default();
        let mut last: Option<Instant> = None;
        let result = loop {
            let Some((at, n, done)) = rx.recv().await else {
                break Err(anyhow::anyhow!("engine connection lost"));
            };
            if n > 0 {
                match last {
                    None => s.ttft = (at - start).as_secs_f64(),
                    Some(prev) => s.itls.push((at - prev).as_secs_f64()),
                }
                last = Some(at);
                s.output_tokens += n as u32;
            }
            if done {
                break Ok(());
            }
        };
        self.routes.lock().expect("routes").remove(&id);
        result?;
        s.latency = start.elapsed().as_secs_f64();
        s.ok = true;
        Ok(s)
    }
}

impl Target for EngineTarget {
    fn describe(&self) -> String {
        format!("engine {}", self.endpoint)
    }

    fn try_run(
        &self,
        prompt: Vec<u32>,
        output_len: u32,
    ) -> futures::future::BoxFuture<'_, anyhow::Result<Sample>> {
        Box::pin(self.request(prompt, output_len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let mut v: Vec<f64> = (1..=10).map(f64::from).collect();
        let p = percentiles(&mut v);
        assert_eq!(p.mean, 5.5);
        assert_eq!(p.p50, 5.5);
        assert!((p.p90 - 9.1).abs() < 1e-9);
        assert!((p.p99 - 9.91).abs() < 1e-9);
    }

    #[test]
    fn ranges_parse() {
        assert_eq!(parse_range("5-10").unwrap(), (5, 10));
        assert!(parse_range("10-5").is_err());
    }
}
