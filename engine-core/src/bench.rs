//! `harrier bench engine`: the engine core's own numbers, measured in one run.
//!
//! 1. Decode throughput of the CPU backend at several batch sizes, pipelined (2 steps in flight)
//!    and synchronous, side by side: tokens/s over the decode phase (after every request's
//!    first token).
//! 2. Host time per step outside the model: the null backend (no model) at 64, 256 and 1024
//!    running requests, prefix caching on and off; µs per step of the loop alone (scheduler,
//!    pipeline, commit), and at `--host-requests` through the real server and a real client
//!    over ipc (adding serialization and the socket).
//! 3. A shared-prefix workload (a long common system prompt, short distinct suffixes) with
//!    prefix caching on vs off: mean/median TTFT and output tokens/s.
//! 4. A memory-pressure workload (KV pool far below the demand): preemptions, throughput,
//!    failures.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use harrier_shared::protocol::{EngineCoreRequest, EngineMessage, FrontendMessage, SamplingParams};
use serde::Serialize;

use crate::cli::{build_cpu_engine, EngineCoreArgs};
use crate::config::{EngineConfig, PipelineDepth};
use crate::engine::{EngineCore, ModelFacts, Progress};
use crate::executor::null::NullExecutor;
use crate::executor::Executor;
use crate::request::Origin;

#[derive(Debug, Clone, clap::Args)]
pub struct EngineBenchArgs {
    /// Model directory for the decode benchmark (default: the embedded `harrier-cpu`).
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub batch_sizes: Vec<u32>,
    #[arg(long, default_value_t = 32)]
    pub prompt_len: u32,
    /// Generated tokens per request in the decode benchmark.
    #[arg(long, default_value_t = 64)]
    pub decode_tokens: u32,
    /// Running requests for the host-overhead benchmark.
    #[arg(long, default_value_t = 256)]
    pub host_requests: u32,
    /// Decode steps timed in the host-overhead benchmark.
    #[arg(long, default_value_t = 400)]
    pub host_steps: u32,
    /// Skip the shared-prefix and memory-pressure workloads.
    #[arg(long)]
    pub skip_workloads: bool,
    /// Also write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Debug, Serialize)]
struct DecodeRow {
    batch: u32,
    pipeline: String,
    decode_tokens_per_s: f64,
    ms_per_step: f64,
}

#[derive(Debug, Serialize)]
struct HostRow {
    what: String,
    running: u32,
    /// Total time over steps: for the ipc row (the engine runs ahead of its client, so
    /// per-window numbers see bursts) this is the sustained rate.
    us_per_step_mean: f64,
    us_per_step_median: f64,
    us_per_step_p90: f64,
}

#[derive(Debug, Serialize)]
struct WorkloadRow {
    workload: String,
    variant: String,
    requests: u32,
    ttft_ms_mean: f64,
    ttft_ms_median: f64,
    output_tokens_per_s: f64,
    preemptions: u64,
    prefix_hit_rate: f64,
    errors: u32,
}

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    threads: usize,
    decode: Vec<DecodeRow>,
    host: Vec<HostRow>,
    workloads: Vec<WorkloadRow>,
}

/// Drives `reqs` (all arriving at once) to completion in-process; per-request TTFT.
fn run_workload<E: Executor>(
    engine: &mut EngineCore<E>,
    reqs: Vec<EngineCoreRequest>,
) -> anyhow::Result<(Vec<f64>, f64, u64, u32)> {
    let n = reqs.len();
    let start = Instant::now();
    let mut first: std::collections::HashMap<String, f64> = std::collections::HashMap::new();
    for r in reqs {
        engine.add_request(Origin(0), r);
    }
    let mut tokens = 0u64;
    let mut errors = 0u32;
    loop {
        let progress = engine.step()?;
        for (_, o) in engine.take_outputs() {
            tokens += o.new_token_ids.len() as u64;
            if !o.new_token_ids.is_empty() {
                first
                    .entry(o.request_id.clone())
                    .or_insert_with(|| start.elapsed().as_secs_f64() * 1e3);
            }
            if o.finish
                .as_ref()
                .is_some_and(|f| f.reason == harrier_shared::protocol::FinishReason::Error)
            {
                errors += 1;
            }
        }
        if progress == Progress::Idle && !engine.has_work() {
            break;
        }
    }
    anyhow::ensure!(
        first.len() == n || errors > 0,
        "{} of {n} requests produced a token",
        first.len()
    );
    Ok((
        first.into_values().collect(),
        start.elapsed().as_secs_f64(),
        tokens,
        errors,
    ))
}

fn workload_row<E: Executor>(
    engine: &mut EngineCore<E>,
    workload: &str,
    variant: &str,
    reqs: Vec<EngineCoreRequest>,
) -> anyhow::Result<WorkloadRow> {
    let requests = reqs.len() as u32;
    let (mut ttft, secs, tokens, errors) = run_workload(engine, reqs)?;
    let s = engine.stats();
    let row = WorkloadRow {
        workload: workload.into(),
        variant: variant.into(),
        requests,
        ttft_ms_mean: ttft.iter().sum::<f64>() / ttft.len().max(1) as f64,
        ttft_ms_median: percentile(&mut ttft, 0.5),
        output_tokens_per_s: tokens as f64 / secs,
        preemptions: s.preemptions_total,
        prefix_hit_rate: s.prefix_cache_hits_total as f64
            / s.prefix_cache_queries_total.max(1) as f64,
        errors,
    };
    eprintln!(
        "{workload} [{variant}]: TTFT mean {:.1} ms median {:.1} ms, {:.1} out tok/s, {} preemptions, hit rate {:.2}, {} errors",
        row.ttft_ms_mean, row.ttft_ms_median, row.output_tokens_per_s, row.preemptions, row.prefix_hit_rate, row.errors
    );
    Ok(row)
}

fn request(i: u32, prompt_len: u32, max_tokens: u32, vocab: u32) -> EngineCoreRequest {
    EngineCoreRequest {
        request_id: format!("bench-{i}"),
        prompt_token_ids: (0..prompt_len)
            .map(|t| (t * 7919 + i * 104_729) % vocab.min(32_000))
            .collect(),
        sampling: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(max_tokens)
        },
        arrival_time: 0.0,
        cache_salt: None,
    }
}

/// Runs `n` requests to completion in-process; returns (decode tokens/s, ms per decode step).
fn decode_run<E: Executor>(
    engine: &mut EngineCore<E>,
    n: u32,
    prompt_len: u32,
    max_tokens: u32,
    vocab: u32,
) -> anyhow::Result<(f64, f64)> {
    for i in 0..n {
        engine.add_request(Origin(0), request(i, prompt_len, max_tokens, vocab));
    }
    let mut start: Option<(Instant, u64, u64)> = None;
    loop {
        let progress = engine.step()?;
        engine.take_outputs().for_each(drop);
        let s = engine.stats();
        if start.is_none() && s.generation_tokens_total >= n as u64 && s.num_waiting == 0 {
            start = Some((Instant::now(), s.generation_tokens_total, s.steps_total));
        }
        if progress == Progress::Idle && !engine.has_work() {
            break;
        }
    }
    let (t0, tok0, steps0) = start.context("no request produced a token")?;
    let s = engine.stats();
    let secs = t0.elapsed().as_secs_f64();
    let steps = (s.steps_total - steps0).max(1);
    Ok((
        (s.generation_tokens_total - tok0) as f64 / secs,
        secs * 1e3 / steps as f64,
    ))
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn null_engine(
    requests: u32,
    depth: PipelineDepth,
    caching: bool,
) -> anyhow::Result<EngineCore<NullExecutor>> {
    let cfg = EngineConfig {
        max_num_seqs: requests,
        max_num_batched_tokens: (requests * 16).max(2048),
        max_model_len: 8192,
        block_size: 16,
        num_kv_blocks: requests * 40 + 1,
        pipeline: depth,
        max_logprobs: 20,
        enable_prefix_caching: caching,
        policy: Default::default(),
        num_speculative_tokens: 0,
        spec_disable_batch_size: None,
        local_kv: None,
    };
    Ok(EngineCore::new(
        cfg,
        ModelFacts {
            vocab_size: 32_000,
            eos_token_ids: vec![],
        },
        NullExecutor::new(32_000, requests),
    )?)
}

/// Per-step host time of the loop alone (no sockets).
fn host_in_process(requests: u32, steps: u32, caching: bool) -> anyhow::Result<Vec<f64>> {
    let mut engine = null_engine(requests, PipelineDepth::Async, caching)?;
    for i in 0..requests {
        engine.add_request(Origin(0), request(i, 16, steps + 64, 32_000));
    }
    while engine.stats().num_waiting > 0 || engine.stats().generation_tokens_total < requests as u64
    {
        engine.step()?;
        engine.take_outputs().for_each(drop);
    }
    let mut samples = Vec::with_capacity(steps as usize);
    let mut last = (Instant::now(), engine.stats().steps_total);
    while samples.len() < steps as usize {
        engine.step()?;
        engine.take_outputs().for_each(drop);
        let n = engine.stats().steps_total;
        if n > last.1 {
            samples.push(last.0.elapsed().as_secs_f64() * 1e6 / (n - last.1) as f64);
            last = (Instant::now(), n);
        }
    }
    Ok(samples)
}

/// Per-step time seen by a client of the real server (loop + serialization + ipc).
fn host_over_ipc(requests: u32, steps: u32) -> anyhow::Result<Vec<f64>> {
    let dir = tempfile::tempdir()?;
    let endpoint: harrier_shared::endpoint::Endpoint =
        format!("ipc://{}/bench.sock", dir.path().display()).parse()?;
    let engine = null_engine(requests, PipelineDepth::Async, true)?;
    let info = harrier_shared::protocol::EngineInfo {
        protocol_version: harrier_shared::protocol::PROTOCOL_VERSION,
        engine_version: env!("CARGO_PKG_VERSION").into(),
        model_name: "null".into(),
        max_model_len: 8192,
        vocab_size: 32_000,
        eos_token_ids: vec![],
        limits: harrier_shared::protocol::EngineLimits {
            max_num_seqs: requests,
            max_num_batched_tokens: 0,
            max_logprobs: 20,
            block_size: 16,
            num_kv_blocks: 0,
            num_speculative_tokens: 0,
        },
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let ep = endpoint.clone();
    let server = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(crate::server::serve(
            engine,
            info,
            &ep,
            Default::default(),
            async move {
                let _ = stop_rx.await;
            },
        ))
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let samples = rt.block_on(async {
        let (client, mut rx, _) = harrier_shared::client::EngineClient::connect(
            &endpoint,
            "bench",
            Duration::from_secs(10),
        )
        .await?;
        // Paused while the requests arrive, so that all of them are admitted in one step and
        // decode together (otherwise they trickle in over hundreds of null-backend steps).
        let utility = |call_id, call| {
            FrontendMessage::Utility(harrier_shared::protocol::UtilityRequest { call_id, call })
        };
        client
            .send(utility(1, harrier_shared::protocol::UtilityCall::Pause))
            .await?;
        for i in 0..requests {
            client
                .send(FrontendMessage::Request(request(i, 16, steps + 64, 32_000)))
                .await?;
        }
        client
            .send(utility(2, harrier_shared::protocol::UtilityCall::Resume))
            .await?;
        // The engine does not wait for its client, so single gaps between messages measure
        // bursts; the mean over windows of 10 steps measures the sustained per-step cost of
        // loop + serialisation + socket + client decoding.
        const WINDOW: usize = 10;
        let mut stamps = Vec::with_capacity(steps as usize + 1);
        while stamps.len() <= steps as usize {
            let msg = tokio::time::timeout(Duration::from_secs(10), rx.recv())
                .await
                .map_err(|_| {
                    anyhow::anyhow!(
                        "only {} steps with all {requests} requests decoding",
                        stamps.len()
                    )
                })?;
            match msg {
                Some(EngineMessage::Outputs(o)) if o.outputs.len() as u32 == requests => {
                    stamps.push(Instant::now())
                }
                Some(_) => {}
                None => anyhow::bail!("the engine went away"),
            }
        }
        let samples = stamps
            .windows(WINDOW + 1)
            .step_by(WINDOW)
            .map(|w| w[WINDOW].duration_since(w[0]).as_secs_f64() * 1e6 / WINDOW as f64)
            .collect();
        anyhow::Ok(samples)
    })?;
    let _ = stop_tx.send(());
    server
        .join()
        .map_err(|_| anyhow::anyhow!("server thread panicked"))??;
    Ok(samples)
}

pub fn run(args: &EngineBenchArgs) -> anyhow::Result<()> {
    let model_dir = crate::cli::resolve_model(args.model.as_deref(), None)?.dir;
    let mut report = Report {
        model: model_dir.display().to_string(),
        threads: rayon::current_num_threads(),
        decode: Vec::new(),
        host: Vec::new(),
        workloads: Vec::new(),
    };
    for &batch in &args.batch_sizes {
        for sync in [false, true] {
            let engine_args = EngineCoreArgs {
                max_num_seqs: batch.max(1),
                sync,
                num_kv_blocks: Some(
                    batch * (args.prompt_len + args.decode_tokens).div_ceil(16) + 8,
                ),
                max_model_len: Some(args.prompt_len + args.decode_tokens + 1),
                ..EngineCoreArgs::defaults()
            };
            let mut built = build_cpu_engine(&engine_args, &model_dir)?;
            let vocab = built.info.vocab_size;
            let (tps, ms) = decode_run(
                &mut built.engine,
                batch,
                args.prompt_len,
                args.decode_tokens,
                vocab,
            )?;
            let pipeline = if sync { "sync" } else { "async" };
            eprintln!("decode batch {batch:>3} {pipeline:>5}: {tps:9.1} tok/s, {ms:7.2} ms/step");
            report.decode.push(DecodeRow {
                batch,
                pipeline: pipeline.into(),
                decode_tokens_per_s: tps,
                ms_per_step: ms,
            });
        }
    }
    let mut host_runs = Vec::new();
    for requests in [64u32, 256, 1024] {
        for caching in [true, false] {
            let what = format!(
                "loop only, null backend, prefix caching {}",
                if caching { "on" } else { "off" }
            );
            host_runs.push((
                what,
                requests,
                host_in_process(requests, args.host_steps, caching)?,
            ));
        }
    }
    host_runs.push((
        "loop + server + ipc client, null backend".into(),
        args.host_requests,
        host_over_ipc(args.host_requests, args.host_steps)?,
    ));
    for (what, running, mut samples) in host_runs {
        let mean = samples.iter().sum::<f64>() / samples.len().max(1) as f64;
        let row = HostRow {
            what,
            running,
            us_per_step_mean: mean,
            us_per_step_median: percentile(&mut samples, 0.5),
            us_per_step_p90: percentile(&mut samples, 0.9),
        };
        eprintln!(
            "host {}: {} running, mean {:.1} us/step, median {:.1}, p90 {:.1}",
            row.what,
            row.running,
            row.us_per_step_mean,
            row.us_per_step_median,
            row.us_per_step_p90
        );
        report.host.push(row);
    }
    if !args.skip_workloads {
        // Shared prefix: 32 requests, a 512-token system prompt, 16-token suffixes, 16 out.
        for caching in [true, false] {
            let engine_args = EngineCoreArgs {
                no_prefix_caching: !caching,
                max_num_seqs: 32,
                ..EngineCoreArgs::defaults()
            };
            let mut built = build_cpu_engine(&engine_args, &model_dir)?;
            let reqs = (0..32u32)
                .map(|i| {
                    let mut p: Vec<u32> = (0..512).map(|t| (t * 7919) % 32_000).collect();
                    p.extend((0..16).map(|t| (t * 31 + i * 977) % 32_000));
                    EngineCoreRequest {
                        request_id: format!("sp-{i}"),
                        prompt_token_ids: p,
                        sampling: SamplingParams {
                            ignore_eos: true,
                            ..SamplingParams::greedy(16)
                        },
                        arrival_time: 0.0,
                        cache_salt: None,
                    }
                })
                .collect();
            report.workloads.push(workload_row(
                &mut built.engine,
                "shared prefix (32 x 512+16 in, 16 out)",
                if caching { "caching on" } else { "caching off" },
                reqs,
            )?);
        }
        // Memory pressure: 32 requests x (64 in + 192 out) = 512 blocks wanted, 96 available.
        for blocks in [96u32, 1024] {
            let engine_args = EngineCoreArgs {
                num_kv_blocks: Some(blocks),
                max_num_seqs: 32,
                max_model_len: Some(512),
                ..EngineCoreArgs::defaults()
            };
            let mut built = build_cpu_engine(&engine_args, &model_dir)?;
            let reqs = (0..32u32)
                .map(|i| request(i, 64, 192, built.info.vocab_size))
                .collect();
            report.workloads.push(workload_row(
                &mut built.engine,
                "memory pressure (32 x 64 in, 192 out)",
                &format!("{blocks} KV blocks"),
                reqs,
            )?);
        }
    }
    println!("| batch | pipeline | decode tok/s | ms/step |\n|---|---|---|---|");
    for r in &report.decode {
        println!(
            "| {} | {} | {:.1} | {:.2} |",
            r.batch, r.pipeline, r.decode_tokens_per_s, r.ms_per_step
        );
    }
    println!("\n| host measurement | running | mean us/step | median us/step | p90 us/step |\n|---|---|---|---|---|");
    for r in &report.host {
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.1} |",
            r.what, r.running, r.us_per_step_mean, r.us_per_step_median, r.us_per_step_p90
        );
    }
    if !report.workloads.is_empty() {
        println!("\n| workload | variant | TTFT mean ms | TTFT median ms | output tok/s | preemptions | prefix hit rate | errors |\n|---|---|---|---|---|---|---|---|");
        for r in &report.workloads {
            println!(
                "| {} | {} | {:.1} | {:.1} | {:.1} | {} | {:.2} | {} |",
                r.workload,
                r.variant,
                r.ttft_ms_mean,
                r.ttft_ms_median,
                r.output_tokens_per_s,
                r.preemptions,
                r.prefix_hit_rate,
                r.errors
            );
        }
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
