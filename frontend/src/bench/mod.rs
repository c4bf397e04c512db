//! `harrier bench serve`: a serving benchmark in the spirit of `vllm bench serve`, and
//! `harrier bench soak`, the same load run long against a `harrier serve` whose processes'
//! memory is watched ([`soak`]).
//!
//! Random-token prompts (sent as token-id lists, so input lengths are exact) with
//! `ignore_eos` (so output lengths are exact), streamed completions, sent at a Poisson
//! request rate and/or with at most `--max-concurrency` requests in flight. Reports request
//! throughput, output tokens/s, and TTFT, TPOT and ITL (mean, p50, p90, p99), as text and,
//! with `--json`, as JSON.
//!
//! The mix can be widened ([`workload`]): lengths spread around the means
//! (`--range-ratio`), chat requests with text prompts (`--chat-fraction`), clients that hang
//! up mid-stream (`--disconnect-fraction`) and invalid requests that must be refused with a
//! 4xx OpenAI error (`--bad-request-fraction`). Every request ends in one [`Outcome`]; a
//! finished stream is checked (one finish reason, `length`, the asked-for token count, then
//! `[DONE]`), and one with no end within `--request-timeout` counts as hung.
//!
//! `--engine-endpoint` sends the same workload straight to an engine core over its ZeroMQ
//! protocol (no HTTP, no tokenizer, no detokenizer): the difference to a run through the
//! front ends is the front end's share of the cost.
//!
//! Files: `workload.rs` draws the requests, `http.rs` and `engine.rs` send them, `soak.rs`
//! watches a server's memory around a run.

mod engine;
mod http;
pub mod soak;
pub mod workload;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use harrier_engine::splitmix::SplitMix64;
use harrier_shared::endpoint::Endpoint;
use serde::Serialize;
use tokio::sync::Semaphore;

use self::workload::{Mix, Plan, RequestSpec, Workload};

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
    /// Spread lengths uniformly over [len·(1−R), len·(1+R)] (vLLM's --random-range-ratio).
    #[arg(long, default_value_t = 0.0)]
    pub range_ratio: f64,
    /// Fraction of the good requests sent as chat completions with a text prompt (about
    /// --input-len words), so the chat template and the tokenizer run.
    #[arg(long, default_value_t = 0.0)]
    pub chat_fraction: f64,
    /// Fraction of requests whose client hangs up mid-stream (after a random number of text
    /// chunks).
    #[arg(long, default_value_t = 0.0)]
    pub disconnect_fraction: f64,
    /// Fraction of requests that are invalid; each must be refused with its 4xx OpenAI error.
    #[arg(long, default_value_t = 0.0)]
    pub bad_request_fraction: f64,
    /// Send no new request after this many seconds (the run ends at --num-prompts or here).
    #[arg(long)]
    pub duration: Option<f64>,
    /// A request not ended after this many seconds counts as hung.
    #[arg(long, default_value_t = 300.0)]
    pub request_timeout: f64,
}

impl BenchServeArgs {
    /// The defaults of every option (environment variables ignored), for callers in code.
    pub fn defaults() -> Self {
        #[derive(clap::Parser)]
        struct Wrapper {
            #[command(flatten)]
            args: BenchServeArgs,
        }
        let mut args = <Wrapper as clap::Parser>::parse_from(["bench"]).args;
        args.api_key = None;
        args
    }

    fn mix(&self) -> Mix {
        Mix {
            input_len: self.input_len,
            output_len: self.output_len,
            range_ratio: self.range_ratio,
            token_id_range: self.token_id_range,
            chat_fraction: self.chat_fraction,
            disconnect_fraction: self.disconnect_fraction,
            bad_fraction: self.bad_request_fraction,
        }
    }
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

/// How one request ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Streamed to its finish reason (`length`, with the asked-for token count) and `[DONE]`.
    Completed,
    /// The client hung up mid-stream, as planned.
    Disconnected,
    /// An invalid request answered with its 4xx OpenAI error, as planned.
    Rejected,
    /// Anything else: a transport error, an error event, a stream without a finish reason or
    /// `[DONE]`, a wrong token count, an invalid request not refused as it should be.
    Failed(String),
    /// Not ended within `--request-timeout`.
    Hung,
}

/// What one request measured.
#[derive(Debug, Clone)]
struct Sample {
    plan: Plan,
    outcome: Outcome,
    input_tokens: u32,
    output_tokens: u32,
    ttft: f64,
    latency: f64,
    itls: Vec<f64>,
}

impl Sample {
    fn new(plan: Plan) -> Self {
        Self {
            plan,
            outcome: Outcome::Failed(String::new()),
            input_tokens: 0,
            output_tokens: 0,
            ttft: 0.0,
            latency: 0.0,
            itls: Vec::new(),
        }
    }

    fn ended(plan: Plan, outcome: Outcome) -> Self {
        Self {
            outcome,
            ..Self::new(plan)
        }
    }

    /// Records a text chunk arriving at `now`.
    fn text_chunk(&mut self, start: Instant, last: &mut Option<Instant>, now: Instant) {
        match last {
            None => self.ttft = (now - start).as_secs_f64(),
            Some(prev) => self.itls.push((now - *prev).as_secs_f64()),
        }
        *last = Some(now);
    }
}

/// Counters another task (the soak's memory sampler) reads while a run goes on.
#[derive(Debug, Default)]
pub struct Progress {
    pub sent: AtomicU64,
    pub done: AtomicU64,
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
    pub range_ratio: f64,
    /// Requests sent (fewer than `num_prompts` when `--duration` ended the run).
    pub sent: usize,
    /// Of those, planned to hang up mid-stream / to be invalid.
    pub planned_disconnects: usize,
    pub planned_bad: usize,
    /// How they ended ([`Outcome`]).
    pub completed: usize,
    pub disconnected: usize,
    pub rejected: usize,
    pub failed: usize,
    pub hung: usize,
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
    /// The distinct failure messages (at most 20).
    pub errors: Vec<String>,
}

impl BenchResult {
    /// Requests that did not end as planned (failed or hung).
    pub fn lost(&self) -> usize {
        self.failed + self.hung
    }
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
    run(args, Arc::default()).await
}

/// Runs the load, counting sent and finished requests in `progress`.
pub async fn run(args: BenchServeArgs, progress: Arc<Progress>) -> anyhow::Result<BenchResult> {
    let mix = args.mix();
    mix.validate()?;
    let target: Arc<dyn Target> = match &args.engine_endpoint {
        Some(ep) => {
            if mix.chat_fraction > 0.0 || mix.bad_fraction > 0.0 {
                bail!("--chat-fraction and --bad-request-fraction need the HTTP server");
            }
            Arc::new(engine::EngineTarget::connect(ep).await?)
        }
        None => Arc::new(http::HttpTarget::new(&args).await?),
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
    let timeout = Duration::from_secs_f64(args.request_timeout);
    let mut workload = Workload::new(mix, args.seed);
    let mut arrivals = SplitMix64(args.seed ^ 0xA441_7A15);
    let start = Instant::now();
    let past_deadline = || {
        args.duration
            .is_some_and(|d| start.elapsed().as_secs_f64() >= d)
    };
    let mut tasks = tokio::task::JoinSet::new();
    let mut samples = Vec::with_capacity(args.num_prompts.min(1 << 20));
    for _ in 0..args.num_prompts {
        if args.request_rate.is_finite() && args.request_rate > 0.0 {
            let gap = -(1.0 - arrivals.unit()).ln() / args.request_rate;
            tokio::time::sleep(Duration::from_secs_f64(gap)).await;
        }
        let permit = limit.clone().acquire_owned().await?;
        if past_deadline() {
            break;
        }
        let spec = workload.next_request();
        progress.sent.fetch_add(1, Ordering::Relaxed);
        let (target, bar, progress) = (target.clone(), bar.clone(), progress.clone());
        tasks.spawn(async move {
            let plan = spec.plan;
            let s = tokio::time::timeout(timeout, target.run(spec))
                .await
                .unwrap_or_else(|_| Sample::ended(plan, Outcome::Hung));
            drop(permit);
            bar.inc(1);
            progress.done.fetch_add(1, Ordering::Relaxed);
            s
        });
        while let Some(s) = tasks.try_join_next() {
            samples.push(s?);
        }
    }
    while let Some(s) = tasks.join_next().await {
        samples.push(s?);
    }
    let duration = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    Ok(summarize(&args, target_name, duration, samples))
}

fn summarize(
    args: &BenchServeArgs,
    target: String,
    duration: f64,
    samples: Vec<Sample>,
) -> BenchResult {
    let count = |f: &dyn Fn(&Sample) -> bool| samples.iter().filter(|s| f(s)).count();
    let ok: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.outcome == Outcome::Completed)
        .collect();
    let mut errors: Vec<String> = samples
        .iter()
        .filter_map(|s| match &s.outcome {
            Outcome::Failed(e) => Some(e.clone()),
            Outcome::Hung => Some(format!("hung ({:?})", s.plan)),
            _ => None,
        })
        .collect();
    errors.sort();
    errors.dedup();
    errors.truncate(20);
    let total_out: u64 = ok.iter().map(|s| u64::from(s.output_tokens)).sum();
    let total_in: u64 = ok.iter().map(|s| u64::from(s.input_tokens)).sum();
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
        range_ratio: args.range_ratio,
        sent: samples.len(),
        planned_disconnects: count(&|s| matches!(s.plan, Plan::Disconnect { .. })),
        planned_bad: count(&|s| matches!(s.plan, Plan::Bad(_))),
        completed: ok.len(),
        disconnected: count(&|s| s.outcome == Outcome::Disconnected),
        rejected: count(&|s| s.outcome == Outcome::Rejected),
        failed: count(&|s| matches!(s.outcome, Outcome::Failed(_))),
        hung: count(&|s| s.outcome == Outcome::Hung),
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

/// The latency sections, titled and abbreviated as vLLM's `benchmark_serving` prints them
/// ("Mean TTFT (ms):", "P99 ITL (ms):"): scripts and people grep for those names.
const LATENCY_SECTIONS: [(&str, &str); 4] = [
    ("Time to First Token", "TTFT"),
    ("Time per Output Token (excl. 1st token)", "TPOT"),
    ("Inter-token Latency", "ITL"),
    ("End-to-end Latency", "E2EL"),
];

fn print_report(r: &BenchResult) {
    print!("{}", report(r));
}

/// The human-readable report (vLLM's layout).
fn report(r: &BenchResult) -> String {
    use std::fmt::Write;
    let mut rows = vec![
        ("Target:", r.target.clone()),
        ("Successful requests:", r.completed.to_string()),
        ("Failed requests:", r.failed.to_string()),
    ];
    if r.planned_disconnects + r.planned_bad + r.hung > 0 {
        rows.extend([
            ("Hung requests:", r.hung.to_string()),
            (
                "Hung up mid-stream (planned):",
                format!("{}/{}", r.disconnected, r.planned_disconnects),
            ),
            (
                "Invalid, refused (planned):",
                format!("{}/{}", r.rejected, r.planned_bad),
            ),
        ]);
    }
    rows.extend([
        ("Benchmark duration (s):", format!("{:.2}", r.duration_s)),
        ("Total input tokens:", r.total_input_tokens.to_string()),
        ("Total generated tokens:", r.total_output_tokens.to_string()),
        (
            "Request throughput (req/s):",
            format!("{:.2}", r.request_throughput),
        ),
        (
            "Output token throughput (tok/s):",
            format!("{:.2}", r.output_throughput),
        ),
        (
            "Total token throughput (tok/s):",
            format!("{:.2}", r.total_token_throughput),
        ),
    ]);
    let mut out = format!("{:=^52}\n", " Serving Benchmark Result ");
    for (k, v) in rows {
        writeln!(out, "{k:<40}{v:>12}").expect("a String");
    }
    let sections = [&r.ttft_ms, &r.tpot_ms, &r.itl_ms, &r.e2e_ms];
    for ((title, short), p) in LATENCY_SECTIONS.into_iter().zip(sections) {
        writeln!(out, "{:-^52}", format!(" {title} ")).expect("a String");
        for (stat, v) in [
            ("Mean", p.mean),
            ("P50", p.p50),
            ("P90", p.p90),
            ("P99", p.p99),
        ] {
            let k = format!("{stat} {short} (ms):");
            writeln!(out, "{k:<40}{v:>12.2}").expect("a String");
        }
    }
    writeln!(out, "{}", "=".repeat(52)).expect("a String");
    for e in r.errors.iter().take(5) {
        writeln!(out, "error: {e}").expect("a String");
    }
    out
}

/// Where requests go: the HTTP server ([`http::HttpTarget`]) or an engine core
/// ([`engine::EngineTarget`]).
trait Target: Send + Sync {
    fn describe(&self) -> String;
    /// One request; the outcome is set by the implementation.
    fn try_run(&self, spec: RequestSpec) -> futures::future::BoxFuture<'_, anyhow::Result<Sample>>;
    /// One request; an error becomes [`Outcome::Failed`].
    fn run(&self, spec: RequestSpec) -> futures::future::BoxFuture<'_, Sample> {
        let plan = spec.plan;
        let request = self.try_run(spec);
        Box::pin(async move {
            request
                .await
                .unwrap_or_else(|e| Sample::ended(plan, Outcome::Failed(format!("{e:#}"))))
        })
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

    /// The report names its latency rows as vLLM does (TTFT, TPOT, ITL, E2EL), from the
    /// samples' times in ms.
    #[test]
    fn the_report_names_latencies_as_vllm_does() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: BenchServeArgs,
        }
        let args = <Cli as clap::Parser>::parse_from(["bench"]).args;
        let sample = Sample {
            plan: Plan::Complete,
            outcome: Outcome::Completed,
            input_tokens: 4,
            output_tokens: 3,
            ttft: 0.010,
            latency: 0.050,
            itls: vec![0.015, 0.025],
        };
        let text = report(&summarize(&args, "t".into(), 1.0, vec![sample]));
        for (row, value) in [
            ("Mean TTFT (ms):", "10.00"),
            ("P50 TPOT (ms):", "20.00"),
            ("P99 ITL (ms):", "24.90"),
            ("Mean E2EL (ms):", "50.00"),
        ] {
            let line = text
                .lines()
                .find(|l| l.starts_with(row))
                .unwrap_or_else(|| panic!("no {row} in\n{text}"));
            assert!(line.ends_with(value), "{line}");
        }
        assert!(text.contains("-- Inter-token Latency --"), "{text}");
    }

    #[test]
    fn ranges_parse() {
        assert_eq!(parse_range("5-10").unwrap(), (5, 10));
        assert!(parse_range("10-5").is_err());
    }
}
