//! Property tests of the whole engine (scheduler, pipeline, CPU backend, micro model) under
//! random interleavings of arrivals, aborts, stop ids, length caps, preemptions (small KV
//! pools), pause/resume, pipeline depths and prefix caching on or off. Afterwards: every
//! request finished exactly once, nothing was sent after a finish, no block or row is leaked,
//! and every request's tokens equal a synchronous, unbatched reference run of that request.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Mutex, OnceLock};

use harrier_engine::cli::{build_cpu_engine, EngineCoreArgs};
use harrier_engine::engine::{EngineCore, Progress};
use harrier_engine::executor::cpu::CpuExecutor;
use harrier_engine::gen_model::{write_model, ModelSpec, Preset};
use harrier_engine::request::Origin;
use harrier_shared::protocol::{EngineCoreRequest, FinishReason, SamplingParams};
use proptest::prelude::*;

/// `micro`, or `micro-gemma3` (window 32: its sliding layers keep window-sized KV in a pool of
/// their own, which the references, run with full KV in every layer, check).
fn model_dir(preset: Preset) -> &'static Path {
    static MICRO: OnceLock<tempfile::TempDir> = OnceLock::new();
    static GEMMA: OnceLock<tempfile::TempDir> = OnceLock::new();
    let cell = match preset {
        Preset::MicroGemma3 => &GEMMA,
        _ => &MICRO,
    };
    cell.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        write_model(dir.path(), &ModelSpec::from_preset(preset, 5)).unwrap();
        dir
    })
    .path()
}

#[derive(Debug, Clone)]
struct Spec {
    prompt: Vec<u32>,
    sampling: SamplingParams,
    /// Stop at the reference's token at this index (if any): exercises stop ids.
    stop_at: Option<usize>,
}

fn engine(args: EngineCoreArgs, preset: Preset) -> EngineCore<CpuExecutor> {
    build_cpu_engine(&args, model_dir(preset)).unwrap().engine
}

/// Tokens of `spec` run alone on a synchronous engine with a roomy KV cache (memoised).
fn reference(spec: &Spec, preset: Preset) -> (Vec<u32>, FinishReason) {
    type Memo = Mutex<HashMap<String, (Vec<u32>, FinishReason)>>;
    static MEMO: OnceLock<Memo> = OnceLock::new();
    let key = format!("{preset:?}{:?}{:?}", spec.prompt, spec.sampling);
    if let Some(hit) = MEMO.get_or_init(Default::default).lock().unwrap().get(&key) {
        return hit.clone();
    }
    let mut e = engine(
        EngineCoreArgs {
            sync: true,
            max_num_seqs: 1,
            num_kv_blocks: Some(64),
            disable_hybrid_kv_cache_manager: true,
            ..EngineCoreArgs::defaults()
        },
        preset,
    );
    e.add_request(
        Origin(0),
        EngineCoreRequest {
            request_id: "ref".into(),
            prompt_token_ids: spec.prompt.clone(),
            sampling: spec.sampling.clone(),
            arrival_time: 0.0,
            cache_salt: None,
        },
    );
    let mut tokens = Vec::new();
    let mut finish = None;
    while finish.is_none() {
        e.step().unwrap();
        for (_, o) in e.take_outputs() {
            tokens.extend(o.new_token_ids);
            finish = o.finish.map(|f| f.reason);
        }
    }
    let out = (tokens, finish.unwrap());
    MEMO.get().unwrap().lock().unwrap().insert(key, out.clone());
    out
}

fn spec_strategy() -> impl Strategy<Value = Spec> {
    (
        1usize..70,
        0u32..4,
        1u32..14,
        any::<u64>(),
        proptest::option::of(0usize..10),
        0u32..3,
    )
        .prop_map(|(len, kind, max_tokens, seed, stop_at, prefix)| {
            // A few shared prefixes make prefix-cache hits likely.
            let prompt = (0..len as u32)
                .map(|t| {
                    if t < 20 {
                        (t * 7 + prefix * 101) % 1000
                    } else {
                        (t * 13 + seed as u32) % 1000
                    }
                })
                .collect();
            let sampling = match kind {
                0 => SamplingParams::greedy(max_tokens),
                1 => SamplingParams {
                    temperature: 0.9,
                    seed: Some(seed),
                    max_tokens,
                    ..SamplingParams::default()
                },
                2 => SamplingParams {
                    temperature: 0.7,
                    top_k: Some(10),
                    top_p: 0.8,
                    seed: Some(seed),
                    max_tokens,
                    ..SamplingParams::default()
                },
                _ => SamplingParams {
                    presence_penalty: 0.5,
                    repetition_penalty: 1.2,
                    ..SamplingParams::greedy(max_tokens)
                },
            };
            Spec {
                prompt,
                sampling,
                stop_at,
            }
        })
}

#[derive(Debug, Clone)]
enum Event {
    Arrive(usize),
    Abort(usize),
    Pause,
    Resume,
}

/// (specs, timed events, sync loop, max_num_seqs, block size, KV blocks, prefix caching)
type Case = (Vec<Spec>, Vec<(u32, Event)>, bool, u32, u32, u32, bool);

fn case_strategy() -> impl Strategy<Value = Case> {
    proptest::collection::vec(spec_strategy(), 1..10).prop_flat_map(|specs| {
        let n = specs.len();
        let events = proptest::collection::vec(
            (
                0u32..40,
                prop_oneof![
                    (0..n).prop_map(Event::Arrive),
                    (0..n).prop_map(Event::Abort),
                    Just(Event::Pause),
                    Just(Event::Resume)
                ],
            ),
            0..12,
        );
        (
            Just(specs),
            events,
            any::<bool>(),
            1u32..6,
            Just(8u32),
            9u32..40,
            any::<bool>(),
        )
    })
}

#[allow(clippy::too_many_arguments)]
fn run_case(
    specs: &[Spec],
    events: &[(u32, Event)],
    sync: bool,
    max_num_seqs: u32,
    block_size: u32,
    num_kv_blocks: u32,
    caching: bool,
    preset: Preset,
) -> Result<(), TestCaseError> {
    // Turn `stop_at` into a stop id taken from the reference run without it.
    let specs: Vec<Spec> = specs
        .iter()
        .map(|s| {
            let (free_run, _) = reference(
                &Spec {
                    stop_at: None,
                    ..s.clone()
                },
                preset,
            );
            let mut s = s.clone();
            if let Some(&stop) = s.stop_at.and_then(|j| free_run.get(j)) {
                s.sampling.stop_token_ids = vec![stop];
            }
            s
        })
        .collect();
    let args = EngineCoreArgs {
        sync,
        max_num_seqs,
        block_size,
        // The pool always holds one request of max_model_len; max_model_len covers every spec.
        max_model_len: Some(96),
        num_kv_blocks: Some(num_kv_blocks.max(96 / block_size + 2)),
        max_num_batched_tokens: 64,
        no_prefix_caching: !caching,
        ..EngineCoreArgs::defaults()
    };
    let mut e = engine(args, preset);
    let mut arrived = vec![false; specs.len()];
    let mut results: HashMap<String, (Vec<u32>, Option<FinishReason>, usize)> = HashMap::new();
    let submit = |e: &mut EngineCore<CpuExecutor>, i: usize, arrived: &mut Vec<bool>| {
        if !arrived[i] {
            arrived[i] = true;
            let s = &specs[i];
            e.add_request(
                Origin(0),
                EngineCoreRequest {
                    request_id: format!("q{i}"),
                    prompt_token_ids: s.prompt.clone(),
                    sampling: s.sampling.clone(),
                    arrival_time: 0.0,
                    cache_salt: None,
                },
            );
        }
    };
    let mut aborted = vec![false; specs.len()];
    for t in 0..10_000u32 {
        for (at, ev) in events.iter().filter(|(at, _)| *at == t) {
            let _ = at;
            match ev {
                Event::Arrive(i) => submit(&mut e, *i, &mut arrived),
                Event::Abort(i) => {
                    if arrived[*i] {
                        aborted[*i] = true;
                        e.abort(Origin(0), &[format!("q{i}")]);
                    }
                }
                Event::Pause => e.pause(),
                Event::Resume => e.resume(),
            }
        }
        if t == 40 {
            // Everything not yet arrived arrives now; the engine resumes.
            for i in 0..specs.len() {
                submit(&mut e, i, &mut arrived);
            }
            e.resume();
        }
        let progress = e
            .step()
            .map_err(|f| TestCaseError::fail(format!("fatal: {f}")))?;
        for (_, o) in e.take_outputs() {
            let r = results.entry(o.request_id.clone()).or_default();
            if r.1.is_some() {
                r.2 += 1;
            }
            r.0.extend(o.new_token_ids);
            if let Some(f) = o.finish {
                r.1 = Some(f.reason);
            }
        }
        if t > 40 && progress == Progress::Idle && !e.has_work() {
            break;
        }
    }
    for (i, s) in specs.iter().enumerate() {
        let id = format!("q{i}");
        let (tokens, finish, after) = results.get(&id).cloned().unwrap_or_default();
        prop_assert_eq!(after, 0, "{} got output after its finish", id);
        let (want, want_finish) = reference(s, preset);
        match finish {
            Some(FinishReason::Abort) => {
                prop_assert!(aborted[i], "{} aborted without an abort", id);
                prop_assert!(
                    want.starts_with(&tokens),
                    "{}: aborted output {:?} is not a prefix of {:?}",
                    id,
                    tokens,
                    want
                );
            }
            other => {
                prop_assert_eq!(other, Some(want_finish), "{} finish", id);
                prop_assert_eq!(
                    &tokens,
                    &want,
                    "{} tokens differ from the unbatched reference",
                    id
                );
            }
        }
    }
    let stats = e.stats();
    prop_assert_eq!(stats.kv_blocks_used, 0, "KV blocks leaked");
    prop_assert_eq!(e.scheduler().num_requests(), 0, "requests leaked");
    prop_assert_eq!(e.scheduler().num_allocated_rows(), 0, "rows leaked");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, max_shrink_iters: 200, ..ProptestConfig::default() })]
    #[test]
    fn random_interleavings_match_unbatched_reference((specs, events, sync, max_num_seqs, block_size, num_kv_blocks, caching) in case_strategy()) {
        run_case(&specs, &events, sync, max_num_seqs, block_size, num_kv_blocks, caching, Preset::Micro)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, max_shrink_iters: 100, ..ProptestConfig::default() })]
    /// Gemma 3 with window-sized KV for its sliding layers (prompts and outputs up to 96 tokens
    /// cross the window of 32) against references with full KV in every layer.
    #[test]
    fn sliding_window_kv_matches_full_kv_references((specs, events, sync, max_num_seqs, block_size, num_kv_blocks, caching) in case_strategy()) {
        run_case(&specs, &events, sync, max_num_seqs, block_size, num_kv_blocks, caching, Preset::MicroGemma3)?;
    }
}
