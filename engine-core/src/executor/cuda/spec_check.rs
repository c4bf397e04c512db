//! `harrier-cuda-tool check-spec` and `bench-spec`: speculative decoding on the CUDA backend
//! through the real engine loop (scheduler, async pipeline, commit), against the same target
//! without speculation.
//!
//! check-spec (fails on any mismatch; greedy mismatches only with f32 weights, see below):
//! - greedy text with speculation equals greedy text without, token for token: one request,
//!   all prompts at once, arrivals every 3 steps (batches grow and shrink mid-round), and
//!   `max_tokens` 1 to 12 (budgets inside rounds);
//! - a logprobs request (sampled on the host: it proposes nothing) among speculating rows;
//! - seeded sampled requests (temperature, top-k/p, min-p; one with penalties, logit_bias and
//!   min_tokens: the device's row state) give the same text alone and among other requests;
//! - the same text with CUDA graphs (steps of rounds and plain steps replayed) and eagerly;
//! - acceptance is reported (mean tokens per round, per-position acceptance).
//!
//! `HARRIER_SPEC_CHECK_F32=1` loads both engines in f32, where greedy equality is gated. In
//! bf16 a verify step (1 + k rows per sequence) runs other GEMM shapes than a plain decode
//! step, and rounding moves near-ties between them as another batch composition does on the
//! plain engine: bf16 mismatches are reported beside the plain engine's own alone-vs-batch
//! figure, not gated.
//!
//! bench-spec: output tokens/s with and without speculation at each batch size (every
//! request `--max-tokens` greedy tokens after its prompt, `ignore_eos`), both engines loaded
//! side by side, each batch measured on both before the next.

use std::time::Instant;

use anyhow::{ensure, Context};
use harrier_shared::protocol::{SamplingParams, TokenId};

use super::scenario::{greedy, run, Arrival};
use super::{CudaExecutor, GapStats};
use crate::cli::{build_cuda_engine, EngineCoreArgs};
use crate::engine::EngineCore;
use crate::executor::Executor;

/// Prompts from `file` (a JSON list of token-id lists, or the parity fixture's
/// `{"prompts": [{"prompt_ids": [..]}, ..]}`), else synthetic ones over `vocab`.
pub fn load_prompts(
    file: Option<&std::path::Path>,
    vocab: u32,
) -> anyhow::Result<Vec<Vec<TokenId>>> {
    let Some(f) = file else {
        return Ok((0..16u64)
            .map(|i| {
                (0..8 + (i * 13) % 57)
                    .map(|t| ((t * 7919 + i * 104_729 + 17) % vocab.min(32_000) as u64) as TokenId)
                    .collect()
            })
            .collect());
    };
    let text = std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text)?;
    let list = json.get("prompts").unwrap_or(&json);
    let ids = |v: &serde_json::Value| -> Option<Vec<TokenId>> {
        v.as_array()?
            .iter()
            .map(|x| x.as_u64().map(|t| t as TokenId))
            .collect()
    };
    let out: Vec<Vec<TokenId>> = list
        .as_array()
        .context("prompts: a JSON list")?
        .iter()
        .filter_map(|p| ids(p.get("prompt_ids").unwrap_or(p)))
        .filter(|p| !p.is_empty())
        .collect();
    ensure!(!out.is_empty(), "no prompts in {}", f.display());
    ensure!(
        out.iter().flatten().all(|&t| t < vocab),
        "a prompt token is outside the vocabulary ({vocab})"
    );
    Ok(out)
}

/// Each prompt `n` times over (a workload that repeats its context: n-gram lookup's case).
pub fn repeated(prompts: Vec<Vec<TokenId>>, n: usize) -> Vec<Vec<TokenId>> {
    match n {
        0 | 1 => prompts,
        n => prompts.into_iter().map(|p| p.repeat(n)).collect(),
    }
}

/// Speculation counters of an engine (or their growth between two snapshots).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SpecCounts {
    rounds: u64,
    proposed: u64,
    accepted: u64,
}

impl SpecCounts {
    fn of<E: Executor>(engine: &EngineCore<E>) -> SpecCounts {
        let s = engine.stats();
        SpecCounts {
            rounds: s.spec_drafts_total,
            proposed: s.spec_draft_tokens_total,
            accepted: s.spec_accepted_tokens_total,
        }
    }

    fn since(self, before: SpecCounts) -> SpecCounts {
        SpecCounts {
            rounds: self.rounds - before.rounds,
            proposed: self.proposed - before.proposed,
            accepted: self.accepted - before.accepted,
        }
    }

    fn tokens_per_round(&self) -> f64 {
        1.0 + self.accepted as f64 / self.rounds.max(1) as f64
    }

    fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.proposed.max(1) as f64
    }
}

fn median(v: &[f32]) -> f64 {
    GapStats::median(v) as f64
}

fn at_once(
    prompts: &[Vec<TokenId>],
    n: usize,
    s: impl Fn(usize) -> SamplingParams,
) -> Vec<Arrival> {
    (0..n)
        .map(|i| Arrival {
            at: 0,
            prompt: prompts[i % prompts.len()].clone(),
            sampling: s(i),
        })
        .collect()
}

/// Greedy scenarios: (name, requests).
fn greedy_scenarios(prompts: &[Vec<TokenId>]) -> Vec<(String, Vec<Arrival>)> {
    let n = prompts.len();
    let mut v = vec![
        ("one".to_string(), at_once(prompts, 1, |_| greedy(64))),
        ("all".into(), at_once(prompts, n, |_| greedy(48))),
    ];
    let churn = (0..2 * n)
        .map(|i| Arrival {
            at: 3 * i as u64,
            prompt: prompts[i % n].clone(),
            sampling: greedy(8 + (i as u32 * 37) % 56),
        })
        .collect();
    v.push(("churn".into(), churn));
    v.push((
        "budgets".into(),
        at_once(prompts, 12, |i| greedy(1 + i as u32)),
    ));
    // A logprobs row samples on the host and proposes nothing; its batch mates speculate.
    v.push((
        "logprobs".into(),
        at_once(prompts, 6, |i| SamplingParams {
            logprobs: (i == 2).then_some(2),
            ..greedy(40)
        }),
    ));
    v
}

fn seeded(i: usize, max_tokens: u32) -> SamplingParams {
    let mut s = SamplingParams {
        temperature: 0.8,
        seed: Some(1000 + i as u64),
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    };
    match i % 4 {
        0 => s.top_p = 0.9,
        1 => s.top_k = Some(20),
        2 => s.min_p = 0.05,
        _ => {
            s.repetition_penalty = 1.2;
            s.frequency_penalty = 0.3;
            s.presence_penalty = 0.2;
            s.logit_bias = vec![(5, 2.0), (7, -100.0)];
            s.min_tokens = 4;
        }
    }
    s
}

/// What proposes in the speculative engine under test.
#[derive(Debug, Clone)]
pub enum Proposal {
    /// A draft model's directory.
    Draft(std::path::PathBuf),
    /// N-gram lookup (`--speculative-method ngram`).
    Ngram { min: usize, max: usize },
}

impl Proposal {
    /// `--draft DIR` or `--ngram MIN-MAX`.
    pub fn from_args(draft: Option<&str>, ngram: Option<&str>) -> anyhow::Result<Proposal> {
        match (draft, ngram) {
            (Some(d), None) => Ok(Proposal::Draft(d.into())),
            (None, Some(n)) => {
                let (a, b) = n.split_once('-').context("--ngram MIN-MAX")?;
                Ok(Proposal::Ngram {
                    min: a.parse().context("--ngram MIN-MAX")?,
                    max: b.parse().context("--ngram MIN-MAX")?,
                })
            }
            _ => anyhow::bail!("give one of --draft DIR and --ngram MIN-MAX"),
        }
    }
}

fn args_for(proposal: Option<&Proposal>, k: u32, max_seqs: u32) -> EngineCoreArgs {
    let mut args = EngineCoreArgs::defaults();
    if std::env::var("HARRIER_SPEC_CHECK_F32").is_ok_and(|v| v == "1") {
        args.dtype = crate::cli::ModelDtype::Float32;
    }
    args.max_num_seqs = max_seqs;
    args.max_num_batched_tokens = 4096;
    // `HARRIER_SPEC_CHECK_SIZES=LEN,BLOCKS`: another model length and KV pool.
    let (len, blocks) = std::env::var("HARRIER_SPEC_CHECK_SIZES")
        .ok()
        .and_then(|v| {
            let (a, b) = v.split_once(',')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .unwrap_or((2048, 8192));
    args.max_model_len = Some(len);
    args.num_kv_blocks = Some(blocks);
    // `HARRIER_SPEC_CHECK_FUSED=N`: the fused small-batch decode path up to N rows (0: off).
    if let Some(n) = std::env::var("HARRIER_SPEC_CHECK_FUSED")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        args.fused_decode_max_rows = n;
    }
    args.no_prefix_caching =
        std::env::var("HARRIER_SPEC_CHECK_PREFIX_CACHE").map_or(true, |v| v != "1");
    match proposal {
        Some(Proposal::Draft(d)) => args.speculative_model = Some(d.clone()),
        Some(&Proposal::Ngram { min, max }) => {
            args.speculative_method = Some(crate::spec::SpecMethod::Ngram);
            args.ngram_min = min;
            args.ngram_max = max;
        }
        None => {}
    }
    args.num_speculative_tokens = k;
    args
}

/// The device's n-gram lookups against the CPU backend's (`crate::spec::ngram_propose`):
/// greedy runs of the `all` scenario on both backends; where they emit the same tokens, the
/// lookups saw the same contexts, so proposals and acceptances must agree round for round
/// (gated in f32, where the CPU and the device agree on the tokens; reported in bf16).
fn ngram_matches_cpu(
    target: &std::path::Path,
    proposal: &Proposal,
    prompts: &[Vec<TokenId>],
    k: u32,
    strict: bool,
) -> anyhow::Result<bool> {
    let mut cuda = build_cuda_engine(&args_for(Some(proposal), k, 64), target)?.engine;
    let mut cpu_args = args_for(Some(proposal), k, 64);
    cpu_args.num_kv_blocks = None;
    cpu_args.kv_cache_mib = 256;
    let mut cpu = crate::cli::build_cpu_engine(&cpu_args, target)?.engine;
    let reqs = at_once(prompts, prompts.len(), |_| greedy(48));
    let a = run(&mut cuda, &reqs, "ngram-cuda")?;
    let b = run(&mut cpu, &reqs, "ngram-cpu")?;
    let (sa, sb) = (SpecCounts::of(&cuda), SpecCounts::of(&cpu));
    let same_text = a == b;
    let same_lookups = sa == sb;
    println!(
        "    ngram: device vs CPU backend: text {}, (rounds, proposed, accepted) {:?} vs {:?} -> {}",
        if same_text { "identical" } else { "differs" },
        (sa.rounds, sa.proposed, sa.accepted),
        (sb.rounds, sb.proposed, sb.accepted),
        match (same_text, same_lookups) {
            (true, true) => "ok",
            (true, false) => "FAIL",
            (false, _) if strict => "FAIL",
            (false, _) => "not compared (the texts differ: bf16)",
        }
    );
    Ok(if same_text { same_lookups } else { !strict })
}

fn acceptance<E: Executor>(engine: &EngineCore<E>) -> String {
    let c = SpecCounts::of(engine);
    let per_pos: Vec<String> = engine
        .stats()
        .spec_accepted_per_pos_total
        .iter()
        .take_while(|&&n| n > 0)
        .map(|&n| format!("{:.2}", n as f64 / c.rounds.max(1) as f64))
        .collect();
    format!(
        "{} rounds, {:.2} tokens/round, acceptance {:.3}, per position [{}]",
        c.rounds,
        c.tokens_per_round(),
        c.acceptance(),
        per_pos.join(", ")
    )
}

/// A scenario's verdict: failed, identical, or different where bf16 is reported, not gated.
fn verdict(ok: bool, identical: bool) -> &'static str {
    match (ok, identical) {
        (false, _) => "FAIL",
        (true, true) => "ok",
        (true, false) => "differ (bf16: reported, not gated)",
    }
}

/// The check (see the module doc); prints one line per scenario, fails on any mismatch.
pub fn check_spec(
    target: &std::path::Path,
    proposal: &Proposal,
    (prompts, repeat): (Option<&std::path::Path>, usize),
    k: u32,
) -> anyhow::Result<()> {
    let mut plain = build_cuda_engine(&args_for(None, 0, 64), target)?.engine;
    let built = build_cuda_engine(&args_for(Some(proposal), k, 64), target)?;
    let vocab = built.info.vocab_size;
    let mut spec = built.engine;
    let prompts = repeated(load_prompts(prompts, vocab)?, repeat);
    let mut failures = 0;
    // Greedy text is compared token for token; in bf16 a mismatch fails only the f32 run:
    // a round's verify step runs other GEMM shapes (1 + k rows per sequence) than a plain
    // decode step, and bf16 rounding moves near-ties between them just as another batch
    // composition moves them on the plain engine (measured below as its own baseline).
    let strict = std::env::var("HARRIER_SPEC_CHECK_F32").is_ok_and(|v| v == "1");
    for (name, reqs) in greedy_scenarios(&prompts) {
        let want = run(&mut plain, &reqs, &format!("{name}-p"))?;
        let got = run(&mut spec, &reqs, &format!("{name}-s"))?;
        let same = want.iter().zip(&got).filter(|(a, b)| a == b).count();
        let lengths = got
            .iter()
            .zip(&reqs)
            .all(|(t, r)| t.len() == r.sampling.max_tokens as usize);
        let first_diff = want
            .iter()
            .zip(&got)
            .enumerate()
            .find(|(_, (a, b))| a != b)
            .map(|(i, (a, b))| {
                let j = a.iter().zip(b.iter()).take_while(|(x, y)| x == y).count();
                format!(" (first: request {i} at token {j})")
            })
            .unwrap_or_default();
        let ok = lengths && (same == reqs.len() || !strict);
        let verdict = verdict(ok, same == reqs.len());
        println!(
            "{name:>9}: {same}/{} greedy requests identical to the plain engine{first_diff} -> {verdict}",
            reqs.len(),
        );
        failures += !ok as usize;
    }
    // The plain engine's own batch dependence: each request of the "all" scenario alone vs
    // all at once.
    let all = at_once(&prompts, prompts.len(), |_| greedy(48));
    let together = run(&mut plain, &all, "baseline-all")?;
    let mut same = 0;
    for (i, a) in all.iter().enumerate() {
        let one = [Arrival {
            at: 0,
            prompt: a.prompt.clone(),
            sampling: a.sampling.clone(),
        }];
        same += (run(&mut plain, &one, &format!("baseline{i}"))?[0] == together[i]) as usize;
    }
    println!(
        " baseline: plain engine, greedy alone vs in the batch of {}: {same}/{} identical",
        all.len(),
        all.len()
    );
    println!("acceptance (greedy scenarios): {}", acceptance(&spec));
    // Greedy with penalties: the draft's draws see the round's earlier proposals in the
    // counts (as the target's verification does); equality gated as above, acceptance shown.
    let penalised = at_once(&prompts, prompts.len(), |_| SamplingParams {
        repetition_penalty: 1.3,
        presence_penalty: 0.5,
        frequency_penalty: 0.2,
        ..greedy(48)
    });
    let want = run(&mut plain, &penalised, "penalised-p")?;
    let before = SpecCounts::of(&spec);
    let got = run(&mut spec, &penalised, "penalised-s")?;
    let delta = SpecCounts::of(&spec).since(before);
    let same = want.iter().zip(&got).filter(|(a, b)| a == b).count();
    let ok = same == penalised.len() || !strict;
    println!(
        "penalised: {same}/{} greedy requests with penalties identical to the plain engine, {:.2} tokens/round -> {}",
        penalised.len(),
        delta.tokens_per_round(),
        verdict(ok, same == penalised.len())
    );
    failures += !ok as usize;
    // Round graphs against the same rounds run eagerly (eager steps run their bucket's GEMM
    // rows): gated in f32; in bf16 a draft computed in other shapes accepts differently, so
    // a position may be verified at another row of another round, and near-ties move.
    let graphs_on = super::spec::SpecGraphs::from_env()?.any();
    if !graphs_on {
        println!("   graphs: off with speculation (HARRIER_SPEC_GRAPHS=0)");
    }
    for (name, reqs) in greedy_scenarios(&prompts).into_iter().filter(|_| graphs_on) {
        let before = spec.executor_mut().counters();
        let graphs = run(&mut spec, &reqs, &format!("{name}-g"))?;
        let mid = spec.executor_mut().counters();
        spec.executor_mut().use_graphs = false;
        let eager = run(&mut spec, &reqs, &format!("{name}-e"))?;
        spec.executor_mut().use_graphs = true;
        let same = graphs.iter().zip(&eager).filter(|(a, b)| a == b).count();
        let replays = mid.graph_replays - before.graph_replays;
        let ok = replays > 0 && (same == reqs.len() || !strict);
        let verdict = verdict(ok, same == reqs.len());
        println!(
            "{name:>9}: {same}/{} identical with graphs ({replays} replays) and eager -> {verdict}",
            reqs.len(),
        );
        failures += !ok as usize;
    }
    // Seeded rows: the same text on every run of the same batch (bit-exact). Alone vs among
    // other requests is reported beside the plain engine's own figure: another batch runs
    // other GEMM shapes, whose bf16 rounding can move a draw across a threshold on either
    // engine.
    let n = prompts.len().min(8);
    let batch = at_once(&prompts, n, |i| seeded(i, 40));
    let first = run(&mut spec, &batch, "seeded1-s")?;
    let again = run(&mut spec, &batch, "seeded2-s")?;
    let same = first.iter().zip(&again).filter(|(a, b)| a == b).count();
    let ok = same == n;
    println!(
        "   seeded: {same}/{n} seeded requests give the same text on a second run -> {}",
        if ok { "ok" } else { "FAIL" }
    );
    failures += !ok as usize;
    for (name, engine) in [("speculative", &mut spec), ("plain", &mut plain)] {
        let together = run(engine, &batch, &format!("together-{name}"))?;
        let mut same = 0;
        for (i, t) in together.iter().enumerate() {
            let r = [Arrival {
                at: 0,
                prompt: prompts[i].clone(),
                sampling: seeded(i, 40),
            }];
            same += (run(engine, &r, &format!("alone{i}-{name}"))?[0] == *t) as usize;
        }
        println!("   seeded ({name}): {same}/{n} give the same text alone as in the batch");
    }
    println!("acceptance (all): {}", acceptance(&spec));
    if let Proposal::Ngram { .. } = proposal {
        failures += !ngram_matches_cpu(target, proposal, &prompts, k, strict)? as usize;
    }
    ensure!(failures == 0, "{failures} scenario(s) failed");
    println!("check-spec: all scenarios pass");
    Ok(())
}

/// Output tokens/s of `n` requests of `max_tokens` greedy tokens each, and the engine steps
/// they took.
fn throughput(
    engine: &mut EngineCore<CudaExecutor>,
    prompts: &[Vec<TokenId>],
    n: usize,
    max_tokens: u32,
    tag: &str,
) -> anyhow::Result<(f64, u64)> {
    let reqs = at_once(prompts, n, |_| greedy(max_tokens));
    let steps0 = engine.stats().steps_total;
    let t0 = Instant::now();
    let out = run(engine, &reqs, tag)?;
    let secs = t0.elapsed().as_secs_f64();
    let tokens: usize = out.iter().map(Vec::len).sum();
    Ok((tokens as f64 / secs, engine.stats().steps_total - steps0))
}

/// bench-spec (see the module doc): one line per batch size. Besides tokens/s: the GPU time
/// of a speculative step (median, as the engine runs it: graphs or eager) and the idle gap
/// between steps, then from a shorter eager run the proposer's share of a step (draft ms)
/// and the rest (placement, the target's verify forward; verify ms).
pub fn bench_spec(
    target: &std::path::Path,
    proposal: &Proposal,
    (prompts, repeat): (Option<&std::path::Path>, usize),
    (k, batches, max_tokens): (u32, &[usize], u32),
    disable_above: Option<u32>,
) -> anyhow::Result<()> {
    let max_seqs = batches.iter().copied().max().unwrap_or(1).max(1) as u32;
    let mut plain = build_cuda_engine(&args_for(None, 0, max_seqs), target)?.engine;
    let built = build_cuda_engine(&args_for(Some(proposal), k, max_seqs), target)?;
    let vocab = built.info.vocab_size;
    let mut spec = built.engine;
    // With `--speculative-disable-by-batch-size`: speculation off above that many decodes.
    let mut gated = match disable_above {
        None => None,
        Some(n) => {
            let mut a = args_for(Some(proposal), k, max_seqs);
            a.speculative_disable_by_batch_size = Some(n);
            Some(build_cuda_engine(&a, target)?.engine)
        }
    };
    let prompts = repeated(load_prompts(prompts, vocab)?, repeat);
    // Warm-up (kernels, cuBLAS heuristics).
    throughput(&mut plain, &prompts, 2, 16, "warm-p")?;
    throughput(&mut spec, &prompts, 2, 16, "warm-s")?;
    if let Some(g) = &mut gated {
        throughput(g, &prompts, 2, 16, "warm-g")?;
    }
    println!(
        "| batch | plain tok/s | speculative tok/s | ratio | tokens/round | acceptance | round ms | break-even tokens/round | step GPU ms | gap ms | eager draft ms | eager verify ms | off above {} tok/s | ratio |",
        disable_above.map_or("-".into(), |n| n.to_string())
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for &b in batches {
        let (p, _) = throughput(&mut plain, &prompts, b, max_tokens, &format!("b{b}-p"))?;
        let before = SpecCounts::of(&spec);
        spec.executor_mut().time_steps(true)?;
        let (s, _) = throughput(&mut spec, &prompts, b, max_tokens, &format!("b{b}-s"))?;
        let delta = SpecCounts::of(&spec).since(before);
        let exec = spec.executor_mut();
        let (step_ms, gap_ms) = (median(&exec.gaps.step_ms), median(&exec.gaps.gaps_ms));
        // The split, eagerly (a graph replay is one unit).
        let graphs = exec.use_graphs;
        exec.use_graphs = false;
        exec.time_steps(true)?;
        throughput(
            &mut spec,
            &prompts,
            b,
            max_tokens.min(64),
            &format!("b{b}-split"),
        )?;
        let exec = spec.executor_mut();
        exec.use_graphs = graphs;
        exec.record_gaps = false;
        let draft_ms = median(&exec.gaps.draft_ms);
        let verify_ms = median(&exec.gaps.step_ms) - draft_ms;
        let g = match &mut gated {
            Some(g) => {
                let (t, _) = throughput(g, &prompts, b, max_tokens, &format!("b{b}-g"))?;
                format!("{t:.0} | {:.2}x", t / p)
            }
            None => "- | -".into(),
        };
        // A round yields `tpr` tokens per sequence: it takes b * tpr / s seconds, and pays
        // off once it yields what plain decoding makes in that time.
        let tpr = delta.tokens_per_round();
        let round_s = b as f64 * tpr / s;
        println!(
            "| {b} | {p:.0} | {s:.0} | {:.2}x | {tpr:.2} | {:.3} | {:.3} | {:.2} | {step_ms:.3} | {gap_ms:.3} | {draft_ms:.3} | {verify_ms:.3} | {g} |",
            s / p,
            delta.acceptance(),
            round_s * 1e3,
            round_s * p / b as f64
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{median, SpecCounts};

    #[test]
    fn spec_counts_grow_and_give_rates() {
        let before = SpecCounts {
            rounds: 10,
            proposed: 40,
            accepted: 20,
        };
        let after = SpecCounts {
            rounds: 14,
            proposed: 56,
            accepted: 32,
        };
        let d = after.since(before);
        assert_eq!((d.rounds, d.proposed, d.accepted), (4, 16, 12));
        assert_eq!(d.tokens_per_round(), 4.0);
        assert_eq!(d.acceptance(), 0.75);
        // No rounds: one token per round, no acceptance (not NaN).
        let none = before.since(before);
        assert_eq!((none.tokens_per_round(), none.acceptance()), (1.0, 0.0));
    }

    #[test]
    fn median_takes_the_upper_middle_and_is_nan_when_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 3.0);
        assert!(median(&[]).is_nan());
    }
}
