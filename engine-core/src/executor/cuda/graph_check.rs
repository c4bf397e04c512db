//! `harrier-cuda-tool check-graphs`: greedy tokens with CUDA graphs against the same engine run
//! eagerly (one loaded model, `use_graphs` toggled between runs), through the real scheduler.
//!
//! Scenarios (prefix caching off, so both runs compute the same prefills):
//! - `batch-N` for N = 1, 3, 5, 8, 17, 33: N prompts of different lengths at once, 64 tokens
//!   each: padding to 1, 4, 8, 8, 24, 48 and the bucket changes as prefill ends;
//! - `churn`: 40 requests arriving every 3 steps with 16-79 output tokens: batches grow and
//!   shrink mid-run;
//! - `oversize`: 56 at once (20-75 output tokens) with graphs only up to 48: steps above fall
//!   back to eager, then replay once enough have finished.
//!
//! Every request's tokens must match; the graph runs must replay (and `oversize` must fall
//! back), or the check fails.

use anyhow::ensure;
use harrier_shared::protocol::TokenId;

use super::scenario::{greedy, run, Arrival};
use super::CudaExecutor;
use crate::cli::{build_cuda_engine, EngineCoreArgs};
use crate::engine::EngineCore;
use crate::executor::{ExecCounters, Executor};

/// One request of a scenario: arrives before engine step `at`.
struct Planned {
    at: u64,
    prompt_len: u32,
    max_tokens: u32,
}

fn scenarios() -> Vec<(String, Vec<Planned>)> {
    let mut v = Vec::new();
    for n in [1u32, 3, 5, 8, 17, 33] {
        let reqs = (0..n)
            .map(|i| Planned {
                at: 0,
                prompt_len: 8 + (i * 13) % 57,
                max_tokens: 64,
            })
            .collect();
        v.push((format!("batch-{n}"), reqs));
    }
    let churn = (0..40u32)
        .map(|i| Planned {
            at: 3 * i as u64,
            prompt_len: 5 + (i * 29) % 40,
            max_tokens: 16 + (i * 37) % 64,
        })
        .collect();
    v.push(("churn".into(), churn));
    let over = (0..56u32)
        .map(|i| Planned {
            at: 0,
            prompt_len: 4 + i % 9,
            max_tokens: 20 + i,
        })
        .collect();
    v.push(("oversize".into(), over));
    v
}

fn prompt(i: usize, len: u32, vocab: u32) -> Vec<TokenId> {
    (0..len)
        .map(|t| ((t as u64 * 7919 + i as u64 * 104_729 + 17) % vocab.min(32_000) as u64) as u32)
        .collect()
}

/// Runs one scenario (greedy, EOS ignored); returns each request's tokens and the counters
/// it added.
fn run_planned(
    engine: &mut EngineCore<CudaExecutor>,
    reqs: &[Planned],
    vocab: u32,
    tag: &str,
) -> anyhow::Result<(Vec<Vec<TokenId>>, ExecCounters)> {
    let arrivals: Vec<Arrival> = reqs
        .iter()
        .enumerate()
        .map(|(i, r)| Arrival {
            at: r.at,
            prompt: prompt(i, r.prompt_len, vocab),
            sampling: greedy(r.max_tokens),
        })
        .collect();
    let before = engine.executor_mut().counters();
    let out = run(engine, &arrivals, tag)?;
    let after = engine.executor_mut().counters();
    let delta = ExecCounters {
        graph_replays: after.graph_replays - before.graph_replays,
        eager_decode_steps: after.eager_decode_steps - before.eager_decode_steps,
        eager_other_steps: after.eager_other_steps - before.eager_other_steps,
    };
    Ok((out, delta))
}

/// The check on the model at `model`; prints one line per scenario and fails on any mismatch.
/// `fp8`: FP8 weights (`--quantization fp8`); `fused_max_rows`: `--fused-decode-max-rows`;
/// `decode_ring`: `--decode-ring` (on: batch-1 steps replay and run the persistent launch).
pub fn check_graphs(
    model: &std::path::Path,
    fp8: bool,
    fused_max_rows: usize,
    decode_ring: crate::cli::DecodeRing,
) -> anyhow::Result<()> {
    let mut args = EngineCoreArgs::defaults();
    args.quantization = fp8.then_some(crate::cli::Quantization::Fp8);
    args.fused_decode_max_rows = fused_max_rows;
    args.decode_ring = decode_ring;
    args.max_num_seqs = 64;
    args.max_num_batched_tokens = 2048;
    args.max_model_len = Some(256);
    args.num_kv_blocks = Some(2048);
    args.no_prefix_caching = true;
    args.cuda_graph_sizes = Some(crate::config::default_graph_sizes(48));
    let built = build_cuda_engine(&args, model)?;
    let mut engine = built.engine;
    let vocab = built.info.vocab_size;
    println!(
        "decode ring ({decode_ring:?}): {}",
        if engine.executor_mut().decode_ring() {
            "on"
        } else {
            "off"
        }
    );
    let mut failures = 0;
    for (name, reqs) in scenarios() {
        engine.executor_mut().use_graphs = true;
        let (g, gc) = run_planned(&mut engine, &reqs, vocab, &format!("{name}-g"))?;
        engine.executor_mut().use_graphs = false;
        let (e, ec) = run_planned(&mut engine, &reqs, vocab, &format!("{name}-e"))?;
        let same = g.iter().zip(&e).filter(|(a, b)| a == b).count();
        let first_diff = g
            .iter()
            .zip(&e)
            .enumerate()
            .find(|(_, (a, b))| a != b)
            .map(|(i, (a, b))| {
                let k = a.iter().zip(b.iter()).take_while(|(x, y)| x == y).count();
                format!(" (first: request {i} at token {k})")
            })
            .unwrap_or_default();
        let ok = same == reqs.len()
            && g.iter()
                .zip(&reqs)
                .all(|(t, r)| t.len() == r.max_tokens as usize)
            && gc.graph_replays > 0
            && ec.graph_replays == 0
            && (name != "oversize" || gc.eager_decode_steps > 0);
        println!(
            "{name:>9}: {same}/{} requests identical{first_diff}; graph run {} replays, {} eager decode, {} eager prefill steps; eager run {} eager decode steps -> {}",
            reqs.len(),
            gc.graph_replays,
            gc.eager_decode_steps,
            gc.eager_other_steps,
            ec.eager_decode_steps,
            if ok { "ok" } else { "FAIL" }
        );
        if !ok {
            failures += 1;
        }
    }
    ensure!(failures == 0, "{failures} scenario(s) failed");
    println!("check-graphs: all scenarios identical");
    Ok(())
}
