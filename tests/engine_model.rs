//! The engine-core server with the real CPU backend and a generated `micro` model, driven over
//! its real socket: pipelined vs synchronous loops, seeded sampling across batch compositions,
//! stop ids, EOS and ignore_eos, logprobs, aborts, and a clean KV pool at the end.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use common::{rt, Client, Collected, TestServer};
use harrier_engine::cli::{build_cpu_engine, EngineCoreArgs};
use harrier_engine::gen_model::{write_model, ModelSpec, Preset};
use harrier_shared::protocol::{FinishReason, SamplingParams};

fn micro_model() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), &ModelSpec::from_preset(Preset::Micro, 11)).unwrap();
    dir
}

fn server(model: &Path, sync: bool, max_num_seqs: u32) -> TestServer {
    let args = EngineCoreArgs {
        max_num_seqs,
        sync,
        num_kv_blocks: Some(2048),
        max_num_batched_tokens: 512,
        ..EngineCoreArgs::defaults()
    };
    let built = build_cpu_engine(&args, model).unwrap();
    TestServer::start(built.engine, built.info)
}

/// The request mix: mixed prompt lengths; greedy, seeded random, and penalised requests.
fn workload() -> Vec<(String, Vec<u32>, SamplingParams)> {
    (0..64u32)
        .map(|i| {
            let len = 1 + (i * 41) % 150;
            let prompt = (0..len).map(|t| (t * 31 + i * 17) % 1000).collect();
            let sampling = match i % 4 {
                0 => SamplingParams::greedy(12 + i % 9),
                1 => SamplingParams {
                    temperature: 0.8,
                    top_p: 0.9,
                    seed: Some(i as u64),
                    max_tokens: 12 + i % 9,
                    ..SamplingParams::default()
                },
                2 => SamplingParams {
                    temperature: 1.2,
                    top_k: Some(20),
                    min_p: 0.05,
                    seed: Some(1000 + i as u64),
                    max_tokens: 10,
                    ..SamplingParams::default()
                },
                _ => SamplingParams {
                    repetition_penalty: 1.3,
                    frequency_penalty: 0.5,
                    presence_penalty: 0.3,
                    logprobs: Some(3),
                    ..SamplingParams::greedy(15)
                },
            };
            // The requests the pipelined run aborts must outlive the abort.
            let sampling = if [5, 22, 40].contains(&i) {
                SamplingParams {
                    max_tokens: 300,
                    ..sampling
                }
            } else {
                sampling
            };
            (format!("w{i}"), prompt, sampling)
        })
        .collect()
}

/// Runs the workload concurrently; aborts `abort` once they produced a few tokens.
fn run_workload(model: &Path, sync: bool, abort: &[&str]) -> HashMap<String, Collected> {
    run_workload_on(server(model, sync, 16), abort)
}

fn run_workload_on(_server: TestServer, abort: &[&str]) -> HashMap<String, Collected> {
    rt().block_on(async {
        let mut c = Client::connect(&_server.endpoint).await;
        let work = workload();
        for (id, prompt, sampling) in &work {
            c.submit(id, prompt.clone(), sampling.clone()).await;
        }
        let ids: Vec<String> = work.iter().map(|w| w.0.clone()).collect();
        if !abort.is_empty() {
            while !abort
                .iter()
                .all(|a| c.results.get(*a).is_some_and(|r| r.tokens.len() >= 2))
            {
                assert!(c.pump(Duration::from_secs(30)).await, "engine stalled");
            }
            c.abort(abort).await;
        }
        c.wait_all(&ids, Duration::from_secs(300)).await;
        let stats = c.wait_kv_free().await;
        assert!(stats.kv_blocks_total > 0);
        c.results.clone()
    })
}

#[test]
fn pipelined_and_synchronous_loops_agree_and_seeds_ignore_batch_mates() {
    let model = micro_model();
    let aborted = ["w5", "w22", "w40"];
    let pipelined = run_workload(model.path(), false, &aborted);
    let sync = run_workload(model.path(), true, &[]);
    for (id, _, sampling) in workload() {
        let (p, s) = (&pipelined[&id], &sync[&id]);
        assert_eq!(p.outputs_after_finish, 0, "{id}");
        if aborted.contains(&id.as_str()) {
            assert_eq!(p.finish, Some(FinishReason::Abort), "{id}");
            assert!(
                s.tokens.starts_with(&p.tokens),
                "{id}: aborted output is a prefix of the full one"
            );
            continue;
        }
        assert_eq!(
            p.tokens, s.tokens,
            "{id}: pipelined and synchronous tokens differ"
        );
        assert_eq!(p.finish, s.finish, "{id}");
        assert!(
            matches!(p.finish, Some(FinishReason::Length | FinishReason::Stop)),
            "{id}: {:?}",
            p.finish
        );
        if p.finish == Some(FinishReason::Length) {
            assert_eq!(p.tokens.len() as u32, sampling.max_tokens, "{id}");
        }
        if let Some(n) = sampling.logprobs {
            assert!(n > 0);
            assert_eq!(
                p.logprobs,
                p.tokens.len(),
                "{id}: one logprobs entry per token"
            );
        }
    }
    // Seeded and greedy requests alone on a fresh engine give what they gave in the crowd.
    let _server = server(model.path(), false, 4);
    rt().block_on(async {
        let mut c = Client::connect(&_server.endpoint).await;
        let work = workload();
        for i in [0usize, 1, 2, 3, 9, 10] {
            let (id, prompt, sampling) = &work[i];
            c.submit(id, prompt.clone(), sampling.clone()).await;
            c.wait_all(std::slice::from_ref(id), Duration::from_secs(60))
                .await;
            assert_eq!(
                c.results[id].tokens, sync[id].tokens,
                "{id}: alone vs batched"
            );
        }
    });
}

#[test]
fn stop_ids_eos_and_ignore_eos() {
    let model = micro_model();
    let prompt: Vec<u32> = (0..20).map(|t| (t * 13) % 1000).collect();
    let greedy = |n| SamplingParams::greedy(n);
    let mut reference = Vec::new();
    {
        let _server = server(model.path(), false, 4);
        rt().block_on(async {
            let mut c = Client::connect(&_server.endpoint).await;
            c.submit("ref", prompt.clone(), greedy(24)).await;
            c.wait_all(&["ref".into()], Duration::from_secs(60)).await;
            reference = c.results["ref"].tokens.clone();
            assert_eq!(
                reference.len(),
                24,
                "micro's EOS did not come up early: {reference:?}"
            );

            let stop = reference[6];
            let first = reference.iter().position(|&t| t == stop).unwrap();
            c.submit(
                "stop-id",
                prompt.clone(),
                SamplingParams {
                    stop_token_ids: vec![stop],
                    ..greedy(24)
                },
            )
            .await;
            c.submit(
                "min-tokens",
                prompt.clone(),
                SamplingParams {
                    stop_token_ids: vec![stop],
                    min_tokens: 24,
                    ..greedy(24)
                },
            )
            .await;
            c.submit("max-3", prompt.clone(), greedy(3)).await;
            c.wait_all(
                &["stop-id".into(), "min-tokens".into(), "max-3".into()],
                Duration::from_secs(60),
            )
            .await;
            let r = &c.results["stop-id"];
            assert_eq!(
                (r.finish, r.stop_token),
                (Some(FinishReason::Stop), Some(stop))
            );
            assert_eq!(
                r.tokens,
                reference[..=first],
                "output ends with the stop id"
            );
            let r = &c.results["min-tokens"];
            assert_eq!(
                r.finish,
                Some(FinishReason::Length),
                "stop ids are masked below min_tokens"
            );
            assert!(!r.tokens.contains(&stop));
            assert_eq!(c.results["max-3"].tokens, reference[..3]);
            c.wait_kv_free().await;
        });
    }
    // Make the 5th greedy token the model's EOS by editing generation_config.json.
    let eos = reference[4];
    let first = reference.iter().position(|&t| t == eos).unwrap();
    let gen_path = model.path().join("generation_config.json");
    let mut gen: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&gen_path).unwrap()).unwrap();
    gen["eos_token_id"] = serde_json::json!([eos]);
    std::fs::write(&gen_path, gen.to_string()).unwrap();
    let _server = server(model.path(), false, 4);
    rt().block_on(async {
        let mut c = Client::connect(&_server.endpoint).await;
        c.submit("eos", prompt.clone(), greedy(24)).await;
        c.submit(
            "ignore-eos",
            prompt.clone(),
            SamplingParams {
                ignore_eos: true,
                ..greedy(24)
            },
        )
        .await;
        c.wait_all(
            &["eos".into(), "ignore-eos".into()],
            Duration::from_secs(60),
        )
        .await;
        let r = &c.results["eos"];
        assert_eq!(
            (r.finish, r.stop_token),
            (Some(FinishReason::Stop), Some(eos))
        );
        assert_eq!(r.tokens, reference[..=first]);
        let r = &c.results["ignore-eos"];
        assert_eq!(
            (r.finish, &r.tokens),
            (Some(FinishReason::Length), &reference)
        );
        c.wait_kv_free().await;
    });
}

#[test]
fn preemption_under_memory_pressure_loses_nothing() {
    let model = micro_model();
    let work: Vec<(String, Vec<u32>, SamplingParams)> = (0..12u32)
        .map(|i| {
            (
                format!("p{i}"),
                (0..40).map(|t| (t * 7 + i) % 1000).collect(),
                SamplingParams {
                    seed: Some(i as u64),
                    temperature: 0.7,
                    ..SamplingParams::greedy(40)
                },
            )
        })
        .collect();
    let run = |num_kv_blocks: u32| {
        let args = EngineCoreArgs {
            max_num_seqs: 12,
            num_kv_blocks: Some(num_kv_blocks),
            max_model_len: Some(128),
            ..EngineCoreArgs::defaults()
        };
        let built = build_cpu_engine(&args, model.path()).unwrap();
        let _server = TestServer::start(built.engine, built.info);
        rt().block_on(async {
            let mut c = Client::connect(&_server.endpoint).await;
            for (id, p, s) in &work {
                c.submit(id, p.clone(), s.clone()).await;
            }
            let ids: Vec<String> = work.iter().map(|w| w.0.clone()).collect();
            c.wait_all(&ids, Duration::from_secs(300)).await;
            let stats = c.wait_kv_free().await;
            (c.results.clone(), stats.preemptions_total)
        })
    };
    // 12 requests x 80 tokens = 60 blocks of 16 wanted; 20 forces preemption.
    let (tight, preemptions) = run(20);
    let (roomy, none) = run(512);
    assert!(preemptions > 0, "the small pool must preempt");
    assert_eq!(none, 0);
    for (id, _, _) in &work {
        assert_eq!(
            tight[id].tokens, roomy[id].tokens,
            "{id}: recompute changed the output"
        );
        assert_eq!(tight[id].finish, Some(FinishReason::Length));
        assert_eq!(tight[id].outputs_after_finish, 0);
    }
}

#[test]
fn prefix_caching_on_and_off_give_the_same_tokens() {
    let model = micro_model();
    let runs = caching_runs(model.path(), &[(true, 2048, true), (false, 2048, true)]);
    assert_eq!(runs[1].1.prefix_cache_hits_total, 0);
}

/// Gemma 3 with a window of 32 (micro-gemma3): prompts of 101-107 tokens sharing 100, so cache
/// hits, chunked prefill (16-token budget) and decode all cross the window; every run, with
/// window-sized KV for the sliding layers or full KV in every layer, must give the tokens of
/// the first (full KV, no caching, no chunking).
/// FP8 through the engine: an FP8 checkpoint written by `harrier quantize` serves the same
/// tokens (greedy, seeded, penalised) as the original loaded with `--quantization fp8` (the
/// same bytes), and some differ from the unquantized model's.
#[test]
fn fp8_checkpoints_serve_what_quantizing_at_load_serves() {
    use harrier_engine::cli::Quantization;
    let model = micro_model();
    let fp8_dir = tempfile::tempdir().unwrap();
    let fp8 = fp8_dir.path().join("fp8");
    harrier_engine::quantize::quantize_dir(model.path(), &fp8, false).unwrap();
    let run = |dir: &Path, quantization: Option<Quantization>| {
        let args = EngineCoreArgs {
            max_num_seqs: 16,
            num_kv_blocks: Some(2048),
            max_num_batched_tokens: 512,
            quantization,
            ..EngineCoreArgs::defaults()
        };
        let built = build_cpu_engine(&args, dir).unwrap();
        run_workload_on(TestServer::start(built.engine, built.info), &[])
    };
    let at_load = run(model.path(), Some(Quantization::Fp8));
    let from_ckpt = run(&fp8, None);
    let plain = run(model.path(), None);
    let mut changed = 0;
    for (id, _, _) in workload() {
        assert_eq!(at_load[&id].tokens, from_ckpt[&id].tokens, "{id}");
        changed += (at_load[&id].tokens != plain[&id].tokens) as usize;
    }
    assert!(changed > 0, "FP8 changed no request's tokens");
}

#[test]
fn gemma3_sliding_window_survives_prefix_caching_and_chunked_prefill() {
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), &ModelSpec::from_preset(Preset::MicroGemma3, 12)).unwrap();
    let runs = caching_runs(
        dir.path(),
        &[
            (false, 2048, false),
            (true, 2048, false),
            (true, 16, false),
            (false, 2048, true),
            (true, 2048, true),
            (true, 16, true),
            (false, 16, true),
        ],
    );
    assert_eq!(runs[0].1.prefix_cache_hits_total, 0);
    // The sliding pool is reported, and drains with the full one.
    for (i, (_, stats)) in runs.iter().enumerate() {
        let hybrid = i >= 3;
        assert_eq!(
            stats.sliding_kv_blocks_total > 0,
            hybrid,
            "run {i}: {stats:?}"
        );
        assert_eq!(stats.sliding_kv_blocks_used, 0, "run {i}: {stats:?}");
    }
}

/// Runs a shared-prefix workload in two waves once per `(prefix caching, token budget,
/// window-sized sliding KV)`; asserts every run gives the first's tokens, and that caching
/// runs hit the shared prefix.
fn caching_runs(
    model: &Path,
    configs: &[(bool, u32, bool)],
) -> Vec<(
    HashMap<String, Collected>,
    harrier_shared::protocol::EngineStats,
)> {
    let system: Vec<u32> = (0..100).map(|t| (t * 29 + 3) % 1000).collect();
    let work: Vec<(String, Vec<u32>, SamplingParams)> = (0..16u32)
        .map(|i| {
            let mut p = system.clone();
            p.extend((0..1 + i % 7).map(|t| (t * 11 + i * 97) % 1000));
            let s = if i % 2 == 0 {
                SamplingParams::greedy(12)
            } else {
                SamplingParams {
                    seed: Some(i as u64),
                    temperature: 0.9,
                    max_tokens: 12,
                    ..SamplingParams::default()
                }
            };
            (format!("c{i}"), p, s)
        })
        .collect();
    let run = |caching: bool, budget: u32, hybrid: bool| {
        let args = EngineCoreArgs {
            max_num_seqs: 8,
            no_prefix_caching: !caching,
            max_num_batched_tokens: budget,
            disable_hybrid_kv_cache_manager: !hybrid,
            ..EngineCoreArgs::defaults()
        };
        let built = build_cpu_engine(&args, model).unwrap();
        let _server = TestServer::start(built.engine, built.info);
        rt().block_on(async {
            let mut c = Client::connect(&_server.endpoint).await;
            // Two waves, so the second finds the first's blocks in the cache.
            for wave in work.chunks(8) {
                for (id, p, s) in wave {
                    c.submit(id, p.clone(), s.clone()).await;
                }
                let ids: Vec<String> = wave.iter().map(|w| w.0.clone()).collect();
                c.wait_all(&ids, Duration::from_secs(120)).await;
            }
            let stats = c.wait_kv_free().await;
            (c.results.clone(), stats)
        })
    };
    let runs: Vec<_> = configs.iter().map(|&(c, b, h)| run(c, b, h)).collect();
    for (&(caching, budget, _), (out, stats)) in configs.iter().zip(&runs) {
        if caching {
            assert!(
                stats.prefix_cache_hits_total >= 8 * 96,
                "second wave hits the shared system prompt: {stats:?}"
            );
        }
        for (id, _, _) in &work {
            assert_eq!(
                out[id].tokens, runs[0].0[id].tokens,
                "{id}: caching {caching}, budget {budget} changed the output"
            );
            assert_eq!(out[id].finish, Some(FinishReason::Length));
        }
    }
    runs
}

#[test]
fn logit_bias_steers_greedy_and_leaves_batch_mates_alone() {
    let model = micro_model();
    let prompt: Vec<u32> = (0..12).map(|t| (t * 29 + 5) % 1000).collect();
    let server = server(model.path(), false, 4);
    rt().block_on(async {
        let mut c = Client::connect(&server.endpoint).await;
        let plain = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(8)
        };
        c.submit("plain", prompt.clone(), plain.clone()).await;
        c.wait_all(&["plain".into()], Duration::from_secs(60)).await;
        let reference = c.results["plain"].tokens.clone();
        // +100 on one token makes it the greedy choice at every step; -100 on the reference's
        // first token moves the first choice away from it. A plain batch mate is unchanged.
        let forced = (reference[0] + 1) % 1000;
        c.submit(
            "forced",
            prompt.clone(),
            SamplingParams {
                logit_bias: vec![(forced, 100.0)],
                ..plain.clone()
            },
        )
        .await;
        c.submit(
            "banned",
            prompt.clone(),
            SamplingParams {
                logit_bias: vec![(reference[0], -100.0)],
                ..plain.clone()
            },
        )
        .await;
        c.submit("mate", prompt.clone(), plain.clone()).await;
        let ids = ["forced".into(), "banned".into(), "mate".into()];
        c.wait_all(&ids, Duration::from_secs(60)).await;
        assert_eq!(c.results["forced"].tokens, vec![forced; 8]);
        assert_ne!(c.results["banned"].tokens[0], reference[0]);
        assert_eq!(c.results["mate"].tokens, reference);
    });
}
