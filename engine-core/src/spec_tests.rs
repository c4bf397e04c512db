//! Speculative decoding through the real engine loop and the CPU backend, on the committed
//! trained pair (harrier-cpu and harrier-cpu-draft): greedy equality with speculation off
//! (draft and n-gram proposers), seeded reproducibility, the output distribution (and that the
//! test catches a wrong acceptance rule), budgets and stop ids inside a round, preemption,
//! prefix caching and aborts in the middle of rounds.

use std::collections::HashMap;
use std::path::PathBuf;

use harrier_shared::protocol::{EngineCoreRequest, FinishReason, SamplingParams, TokenId};

use crate::config::{EngineConfig, PipelineDepth};
use crate::engine::{EngineCore, ModelFacts, Progress};
use crate::executor::cpu::{CpuExecutor, CpuExecutorConfig, CpuProposer};
use crate::model::{CpuModel, ModelDir};
use crate::request::Origin;
use crate::sampling::spec::AcceptRule;

fn models() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models")
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Method {
    Off,
    Draft,
    Ngram,
}

struct Setup {
    method: Method,
    k: u32,
    num_kv_blocks: u32,
    max_num_seqs: u32,
    max_model_len: u32,
    prefix_caching: bool,
    rule: AcceptRule,
    sync: bool,
    disable_batch: Option<u32>,
}

impl Setup {
    fn new(method: Method) -> Self {
        Self {
            method,
            k: 4,
            num_kv_blocks: 2048,
            max_num_seqs: 32,
            max_model_len: 1024,
            prefix_caching: true,
            rule: AcceptRule::Lossless,
            sync: false,
            disable_batch: None,
        }
    }

    fn engine(&self) -> EngineCore<CpuExecutor> {
        let dir = ModelDir::open(&models().join("harrier-cpu")).unwrap();
        let model = CpuModel::load(&dir).unwrap();
        let proposer = match self.method {
            Method::Off => None,
            Method::Draft => {
                let d = ModelDir::open(&models().join("harrier-cpu-draft")).unwrap();
                crate::spec::check_draft(&dir, &d).unwrap();
                Some(CpuProposer::Draft(Box::new(CpuModel::load(&d).unwrap())))
            }
            Method::Ngram => Some(CpuProposer::Ngram { min: 1, max: 4 }),
        };
        let exec = CpuExecutor::with_accept_rule(
            model,
            &dir.config,
            CpuExecutorConfig {
                num_kv_blocks: self.num_kv_blocks,
                num_local_kv_blocks: None,
                block_size: 16,
                max_rows: self.max_num_seqs,
            },
            proposer,
            self.rule,
        )
        .unwrap();
        let cfg = EngineConfig {
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: 1024,
            max_model_len: self.max_model_len,
            num_kv_blocks: self.num_kv_blocks,
            enable_prefix_caching: self.prefix_caching,
            num_speculative_tokens: if self.method == Method::Off {
                0
            } else {
                self.k
            },
            spec_disable_batch_size: self.disable_batch,
            pipeline: if self.sync {
                PipelineDepth::Sync
            } else {
                PipelineDepth::Async
            },
            ..EngineConfig::default()
        };
        let facts = ModelFacts {
            vocab_size: dir.config.vocab_size as u32,
            eos_token_ids: dir.generation.eos_token_ids.clone(),
        };
        EngineCore::new(cfg, facts, exec).unwrap()
    }
}

#[derive(Debug, Default, Clone)]
struct Out {
    tokens: Vec<TokenId>,
    finish: Option<FinishReason>,
    logprobs: usize,
    after_finish: usize,
    draft_tokens: u32,
    accepted_tokens: u32,
}

/// Runs `work` to the end (all submitted at once); `abort_after`: ids to abort once they have
/// that many tokens.
/// Queues `work` (from front end 0).
fn submit(e: &mut EngineCore<CpuExecutor>, work: &[(String, Vec<TokenId>, SamplingParams)]) {
    for (id, prompt, sampling) in work {
        e.add_request(
            Origin(0),
            EngineCoreRequest {
                request_id: id.clone(),
                prompt_token_ids: prompt.clone(),
                sampling: sampling.clone(),
                arrival_time: 0.0,
                cache_salt: None,
            },
        );
    }
}

fn run(
    e: &mut EngineCore<CpuExecutor>,
    work: &[(String, Vec<TokenId>, SamplingParams)],
    abort_after: &[(&str, usize)],
) -> HashMap<String, Out> {
    submit(e, work);
    let mut outs: HashMap<String, Out> = HashMap::new();
    let mut aborted = Vec::new();
    loop {
        let progress = e.step().unwrap();
        for (_, o) in e.take_outputs() {
            let out = outs.entry(o.request_id.clone()).or_default();
            if out.finish.is_some() {
                out.after_finish += 1;
            }
            out.tokens.extend_from_slice(&o.new_token_ids);
            out.logprobs += o.logprobs.map_or(0, |l| l.len());
            if let Some(f) = o.finish {
                out.finish = Some(f.reason);
                if let Some(s) = f.spec {
                    out.draft_tokens = s.draft_tokens;
                    out.accepted_tokens = s.accepted_tokens;
                }
            }
        }
        for &(id, n) in abort_after {
            let due = outs
                .get(id)
                .is_some_and(|o| o.tokens.len() >= n && o.finish.is_none());
            if due && !aborted.contains(&id) {
                e.abort(Origin(0), &[id.to_string()]);
                aborted.push(id);
            }
        }
        if progress == Progress::Idle && !e.has_work() {
            break;
        }
    }
    assert_eq!(e.scheduler().kv().num_used(), 0, "KV blocks left in use");
    outs
}

/// The 16 held-out prompts of the parity fixture, and their transformers greedy
/// continuations appended (longer, natural contexts).
fn prompts() -> Vec<Vec<TokenId>> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/parity_harrier-cpu.json");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<TokenId> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as TokenId)
            .collect()
    };
    let mut out = Vec::new();
    for p in json["prompts"].as_array().unwrap() {
        let prompt = ids(&p["prompt_ids"]);
        let mut long = prompt.clone();
        long.extend(ids(&p["greedy_ids"]));
        out.push(prompt);
        out.push(long);
    }
    out
}

fn greedy_work(max_tokens: u32) -> Vec<(String, Vec<TokenId>, SamplingParams)> {
    prompts()
        .into_iter()
        .enumerate()
        .map(|(i, p)| (format!("g{i}"), p, SamplingParams::greedy(max_tokens)))
        .collect()
}

fn assert_same_tokens(a: &HashMap<String, Out>, b: &HashMap<String, Out>, what: &str) {
    assert_eq!(a.len(), b.len());
    for (id, x) in a {
        let y = &b[id];
        assert_eq!(x.tokens, y.tokens, "{id}: {what}");
        assert_eq!(x.finish, y.finish, "{id}: {what}");
        assert_eq!(
            x.after_finish + y.after_finish,
            0,
            "{id}: outputs after the finish"
        );
    }
}

#[test]
fn greedy_with_speculation_equals_greedy_without() {
    let work = greedy_work(48);
    let off = run(&mut Setup::new(Method::Off).engine(), &work, &[]);
    for method in [Method::Draft, Method::Ngram] {
        for k in [1, 4, 7] {
            let mut e = Setup {
                k,
                ..Setup::new(method)
            }
            .engine();
            let on = run(&mut e, &work, &[]);
            assert_same_tokens(&off, &on, &format!("{method:?} k={k}"));
            let st = e.stats();
            assert!(
                st.spec_draft_tokens_total > 0,
                "{method:?}: nothing proposed"
            );
            assert!(
                st.spec_accepted_tokens_total > 0,
                "{method:?} k={k}: nothing accepted"
            );
            assert_eq!(
                st.spec_accepted_per_pos_total.iter().sum::<u64>(),
                st.spec_accepted_tokens_total
            );
            // Per-position acceptance can only fall along a round.
            let pos = &st.spec_accepted_per_pos_total[..k as usize];
            assert!(pos.windows(2).all(|w| w[0] >= w[1]), "{pos:?}");
            let per_request: u32 = on.values().map(|o| o.accepted_tokens).sum();
            assert_eq!(per_request as u64, st.spec_accepted_tokens_total);
            if method == Method::Draft && k == 4 {
                // The committed pair agrees on about half the greedy tokens: a round of 4
                // yields well above one token on held-out text.
                let tokens_per_round =
                    1.0 + st.spec_accepted_tokens_total as f64 / st.spec_drafts_total as f64;
                assert!(tokens_per_round > 1.5, "{tokens_per_round}");
            }
        }
    }
}

#[test]
fn synchronous_loop_and_single_requests_agree_with_the_pipelined_batch() {
    let work = greedy_work(24);
    let mut sync = Setup {
        sync: true,
        ..Setup::new(Method::Draft)
    }
    .engine();
    let batched = run(&mut Setup::new(Method::Draft).engine(), &work, &[]);
    for w in work.iter().take(6) {
        let alone = run(&mut sync, std::slice::from_ref(w), &[]);
        assert_eq!(
            alone[&w.0].tokens, batched[&w.0].tokens,
            "{}: alone vs batched",
            w.0
        );
    }
}

fn sampled_work(n: usize) -> Vec<(String, Vec<TokenId>, SamplingParams)> {
    let prompts = prompts();
    (0..n)
        .map(|i| {
            let sampling = match i % 3 {
                0 => SamplingParams {
                    temperature: 0.9,
                    top_p: 0.95,
                    seed: Some(i as u64),
                    max_tokens: 30,
                    ..SamplingParams::default()
                },
                1 => SamplingParams {
                    temperature: 1.1,
                    top_k: Some(40),
                    min_p: 0.02,
                    repetition_penalty: 1.2,
                    seed: Some(i as u64),
                    max_tokens: 30,
                    logprobs: Some(2),
                    ..SamplingParams::default()
                },
                _ => SamplingParams {
                    temperature: 0.7,
                    frequency_penalty: 0.4,
                    presence_penalty: 0.2,
                    logit_bias: vec![(13, 2.0)],
                    min_tokens: 5,
                    seed: Some(i as u64),
                    max_tokens: 30,
                    ..SamplingParams::default()
                },
            };
            (
                format!("s{i}"),
                prompts[i % prompts.len()].clone(),
                sampling,
            )
        })
        .collect()
}

#[test]
fn seeded_requests_are_reproducible_with_speculation() {
    let work = sampled_work(24);
    for method in [Method::Draft, Method::Ngram] {
        let a = run(&mut Setup::new(method).engine(), &work, &[]);
        let b = run(
            &mut Setup {
                max_num_seqs: 5,
                ..Setup::new(method)
            }
            .engine(),
            &work,
            &[],
        );
        assert_same_tokens(
            &a,
            &b,
            &format!("{method:?}: same seeds, other batch mates"),
        );
        for (id, _, s) in &work {
            assert_eq!(
                a[id].tokens.len() as u32,
                s.max_tokens.min(a[id].tokens.len() as u32)
            );
            if s.logprobs.is_some() {
                assert_eq!(
                    a[id].logprobs,
                    a[id].tokens.len(),
                    "{id}: a logprob per token"
                );
            }
        }
    }
}

/// Two-sample chi-square between the counts of two runs over the same categories, pooling
/// categories with fewer than 10 observations in both into one.
fn two_sample_chi2(a: &HashMap<TokenId, u32>, b: &HashMap<TokenId, u32>) -> (f64, usize) {
    let (na, nb) = (
        a.values().sum::<u32>() as f64,
        b.values().sum::<u32>() as f64,
    );
    let mut keys: Vec<TokenId> = a.keys().chain(b.keys()).copied().collect();
    keys.sort();
    keys.dedup();
    let mut cells: Vec<(f64, f64)> = Vec::new();
    let mut pooled = (0.0, 0.0);
    for k in keys {
        let (x, y) = (
            *a.get(&k).unwrap_or(&0) as f64,
            *b.get(&k).unwrap_or(&0) as f64,
        );
        if x + y < 20.0 {
            pooled.0 += x;
            pooled.1 += y;
        } else {
            cells.push((x, y));
        }
    }
    cells.push(pooled);
    let (ka, kb) = ((nb / na).sqrt(), (na / nb).sqrt());
    let chi2 = cells
        .iter()
        .filter(|c| c.0 + c.1 > 0.0)
        .map(|&(x, y)| (ka * x - kb * y).powi(2) / (x + y))
        .sum();
    (chi2, cells.len() - 1)
}

/// The tokens that rounds produce (output positions 1 to 3; position 0 comes from the
/// prefill) of `n` seeded requests, pooled.
fn second_tokens(setup: Setup, n: u64) -> HashMap<TokenId, u32> {
    // The start of a held-out prompt: an open context with a broad next-token distribution.
    let prompt = prompts().into_iter().find(|p| p.len() >= 8).unwrap()[..4].to_vec();
    let work: Vec<_> = (0..n)
        .map(|seed| {
            (
                format!("d{seed}"),
                prompt.clone(),
                SamplingParams {
                    temperature: 1.0,
                    seed: Some(seed),
                    max_tokens: 4,
                    ignore_eos: true,
                    ..SamplingParams::default()
                },
            )
        })
        .collect();
    let outs = run(
        &mut Setup {
            max_num_seqs: 256,
            ..setup
        }
        .engine(),
        &work,
        &[],
    );
    let mut counts = HashMap::new();
    for o in outs.values() {
        for &t in &o.tokens[1..] {
            *counts.entry(t).or_insert(0) += 1;
        }
    }
    counts
}

/// Upper 0.1% point of chi-square with `df` degrees of freedom (Wilson-Hilferty).
fn chi2_critical(df: usize) -> f64 {
    let d = df as f64;
    let z = 3.09;
    d * (1.0 - 2.0 / (9.0 * d) + z * (2.0 / (9.0 * d)).sqrt()).powi(3)
}

#[test]
fn sampled_output_distribution_is_the_targets() {
    // The second token's distribution over 3,000 seeds: plain sampling vs draft speculation
    // (where the first round's proposals are accepted or resampled) vs a wrong acceptance
    // rule, which the same test must reject.
    let n = 3000;
    let plain = second_tokens(Setup::new(Method::Off), n);
    let spec = second_tokens(Setup::new(Method::Draft), n);
    let (chi2, df) = two_sample_chi2(&plain, &spec);
    assert!(df >= 20, "too few categories to judge: {df}");
    eprintln!(
        "lossless: chi2 {chi2:.1} df {df} (critical {:.1})",
        chi2_critical(df)
    );
    assert!(
        chi2 < chi2_critical(df),
        "lossless rule: chi2 {chi2:.1} df {df}"
    );
    let wrong = second_tokens(
        Setup {
            rule: AcceptRule::IgnoreDraft,
            ..Setup::new(Method::Draft)
        },
        n,
    );
    let (chi2, df) = two_sample_chi2(&plain, &wrong);
    eprintln!(
        "wrong rule: chi2 {chi2:.1} df {df} (critical {:.1})",
        chi2_critical(df)
    );
    assert!(
        chi2 > chi2_critical(df),
        "wrong rule not caught: chi2 {chi2:.1} df {df}"
    );
}

#[test]
fn budgets_and_stop_ids_hold_inside_rounds() {
    let prompts = prompts();
    let off = run(&mut Setup::new(Method::Off).engine(), &greedy_work(40), &[]);
    for method in [Method::Draft, Method::Ngram] {
        // max_tokens from 1 to 12: never more, never fewer (ignore_eos).
        let work: Vec<_> = (0..24)
            .map(|i| {
                (
                    format!("m{i}"),
                    prompts[i % prompts.len()].clone(),
                    SamplingParams {
                        ignore_eos: true,
                        ..SamplingParams::greedy(1 + i as u32 % 12)
                    },
                )
            })
            .collect();
        let outs = run(&mut Setup::new(method).engine(), &work, &[]);
        for (id, _, s) in &work {
            assert_eq!(
                outs[id].tokens.len() as u32,
                s.max_tokens,
                "{method:?} {id}"
            );
            assert_eq!(outs[id].finish, Some(FinishReason::Length));
        }
        // A stop id that occurs inside the greedy text ends the output exactly there.
        let mut stop_work = Vec::new();
        for (i, p) in prompts.iter().enumerate().take(12) {
            let full = &off[&format!("g{i}")].tokens;
            let at = 5 + i % 20;
            let stop = full[at];
            let first = full.iter().position(|&t| t == stop).unwrap();
            stop_work.push((
                format!("t{i}"),
                p.clone(),
                SamplingParams {
                    stop_token_ids: vec![stop],
                    ..SamplingParams::greedy(40)
                },
                full[..=first].to_vec(),
            ));
        }
        let work: Vec<_> = stop_work
            .iter()
            .map(|w| (w.0.clone(), w.1.clone(), w.2.clone()))
            .collect();
        let outs = run(&mut Setup::new(method).engine(), &work, &[]);
        for (id, _, _, want) in &stop_work {
            assert_eq!(
                &outs[id].tokens, want,
                "{method:?} {id}: cut at the stop id"
            );
            assert_eq!(outs[id].finish, Some(FinishReason::Stop));
        }
        // The model length: a request that runs into it ends at exactly max_model_len.
        let long = &prompts[1];
        let max_model_len = long.len() as u32 + 9;
        let work = vec![(
            "len".to_string(),
            long.clone(),
            SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(100)
            },
        )];
        let outs = run(
            &mut Setup {
                max_model_len,
                ..Setup::new(method)
            }
            .engine(),
            &work,
            &[],
        );
        assert_eq!(outs["len"].tokens.len(), 9, "{method:?}");
        assert_eq!(outs["len"].finish, Some(FinishReason::Length));
    }
}

#[test]
fn preemption_prefix_caching_and_aborts_in_the_middle_of_rounds() {
    let work = greedy_work(40);
    let off = run(
        &mut Setup {
            prefix_caching: false,
            max_model_len: 256,
            ..Setup::new(Method::Off)
        }
        .engine(),
        &work,
        &[],
    );
    for method in [Method::Draft, Method::Ngram] {
        // A pool too small for the batch: requests are preempted (recomputed) mid-decode.
        let mut tight = Setup {
            num_kv_blocks: 40,
            max_num_seqs: 32,
            max_model_len: 256,
            ..Setup::new(method)
        }
        .engine();
        let outs = run(&mut tight, &work, &[]);
        assert!(
            tight.stats().preemptions_total > 0,
            "{method:?}: no preemption"
        );
        assert_same_tokens(&off, &outs, &format!("{method:?} under preemption"));
        // Prefix caching: the same prompts again hit the cache and give the same tokens.
        let mut e = Setup {
            max_model_len: 256,
            ..Setup::new(method)
        }
        .engine();
        let first = run(&mut e, &work, &[]);
        let again = run(&mut e, &work, &[]);
        assert!(e.stats().prefix_cache_hits_total > 0);
        assert_same_tokens(
            &first,
            &again,
            &format!("{method:?} with prefix-cache hits"),
        );
        assert_same_tokens(&off, &again, &format!("{method:?} vs off"));
        // Aborts land between rounds of others: the rest are unaffected, KV returns to 0
        // (checked by `run`).
        let aborts = [("g0", 3), ("g5", 10), ("g17", 1)];
        let outs = run(
            &mut Setup {
                max_model_len: 256,
                ..Setup::new(method)
            }
            .engine(),
            &work,
            &aborts,
        );
        for (id, o) in &outs {
            if aborts.iter().any(|a| a.0 == id) {
                assert_eq!(o.finish, Some(FinishReason::Abort), "{id}");
                assert!(off[id].tokens.starts_with(&o.tokens), "{id}");
            } else {
                assert_eq!(o.tokens, off[id].tokens, "{method:?} {id}");
            }
            assert_eq!(o.after_finish, 0);
        }
    }
}

#[test]
fn large_decode_batches_turn_speculation_off() {
    // 32 requests decoding at once, speculation off above 8: the rounds of the crowded phase
    // propose nothing, greedy text is unchanged, and the tail (8 or fewer left) speculates.
    let work: Vec<_> = greedy_work(40)
        .into_iter()
        .enumerate()
        .map(|(i, (id, p, s))| {
            (
                id,
                p,
                SamplingParams {
                    max_tokens: 8 + 2 * i as u32,
                    ..s
                },
            )
        })
        .collect();
    let off = run(&mut Setup::new(Method::Off).engine(), &work, &[]);
    let mut always = Setup::new(Method::Ngram).engine();
    let a = run(&mut always, &work, &[]);
    let mut ruled = Setup {
        disable_batch: Some(8),
        ..Setup::new(Method::Ngram)
    }
    .engine();
    let r = run(&mut ruled, &work, &[]);
    assert_same_tokens(&off, &a, "always");
    assert_same_tokens(&off, &r, "with the batch-size rule");
    let (da, dr) = (
        always.stats().spec_drafts_total,
        ruled.stats().spec_drafts_total,
    );
    assert!(dr > 0, "the tail speculates");
    assert!(dr < da / 2, "crowded rounds still speculated: {dr} vs {da}");
}

#[test]
fn pause_and_prefix_cache_reset_in_the_middle_of_rounds() {
    let work = greedy_work(40);
    let off = run(&mut Setup::new(Method::Off).engine(), &work, &[]);
    let mut e = Setup::new(Method::Draft).engine();
    submit(&mut e, &work);
    let mut outs: HashMap<String, Vec<TokenId>> = HashMap::new();
    fn collect(e: &mut EngineCore<CpuExecutor>, outs: &mut HashMap<String, Vec<TokenId>>) {
        for (_, o) in e.take_outputs() {
            outs.entry(o.request_id.clone())
                .or_default()
                .extend_from_slice(&o.new_token_ids);
        }
    }
    // Run until rounds are in flight, then pause: in-flight rounds complete, nothing new
    // launches; reset the prefix cache while paused and again after resuming, mid-rounds.
    for _ in 0..40 {
        e.step().unwrap();
    }
    collect(&mut e, &mut outs);
    e.pause();
    while !e.is_drained() {
        e.step().unwrap();
    }
    collect(&mut e, &mut outs);
    let frozen: usize = outs.values().map(Vec::len).sum();
    for _ in 0..5 {
        assert_eq!(
            e.step().unwrap(),
            Progress::Idle,
            "paused engine launched work"
        );
    }
    collect(&mut e, &mut outs);
    assert_eq!(outs.values().map(Vec::len).sum::<usize>(), frozen);
    e.reset_prefix_cache();
    e.resume();
    for i in 0.. {
        if i == 7 {
            e.reset_prefix_cache();
        }
        let p = e.step().unwrap();
        collect(&mut e, &mut outs);
        if p == Progress::Idle && !e.has_work() {
            break;
        }
    }
    assert_eq!(e.scheduler().kv().num_used(), 0);
    for (id, o) in &off {
        assert_eq!(&outs[id], &o.tokens, "{id}");
    }
}
