//! Unit tests of the scheduler as a state machine, with a stand-in backend that "samples"
//! token `1000 + position` so tests can predict every token.

use std::collections::VecDeque;

use harrier_shared::protocol::{FinishReason, SamplingParams};

use super::*;

const EOS: TokenId = 7;

fn cfg(max_num_seqs: u32, budget: u32, blocks: u32, depth: u8) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs,
        max_num_batched_tokens: budget,
        max_model_len: 256,
        block_size: 4,
        num_kv_blocks: blocks,
        max_inflight_refs: depth,
        eos_token_ids: vec![EOS],
        enable_prefix_caching: true,
        policy: SchedulingPolicy::DecodeFirst,
        num_speculative_tokens: 0,
        spec_disable_batch_size: None,
        local_kv: None,
    }
}

struct Harness {
    s: Scheduler,
    in_flight: VecDeque<(Vec<StepEntry>, ExecBatch)>,
    sink: OutputSink,
    /// Tokens the stand-in backend samples, by (request, output index); default 1000 + index.
    forced: Vec<(RequestId, u32, TokenId)>,
    /// The backend's view of each row's block table, rebuilt from batches only.
    rows: std::collections::HashMap<RowId, Vec<u32>>,
    /// The same for the sliding-window tables.
    local_rows: std::collections::HashMap<RowId, Vec<u32>>,
    /// Most local blocks one request held alive, after any step.
    max_local_live: usize,
}

impl Harness {
    fn new(c: SchedulerConfig) -> Self {
        Self {
            s: Scheduler::new(c),
            in_flight: VecDeque::new(),
            sink: Vec::new(),
            forced: Vec::new(),
            rows: Default::default(),
            local_rows: Default::default(),
            max_local_live: 0,
        }
    }

    fn add(&mut self, id: u64, prompt_len: usize, max_tokens: u32) {
        let prompt = (0..prompt_len as u32).map(|i| 100 + i).collect();
        let p = SamplingParams::greedy(max_tokens);
        self.s.add(Request::new(
            RequestId(id),
            Origin(0),
            format!("r{id}"),
            prompt,
            p,
            0,
        ));
    }

    fn check(&self) {
        self.s
            .check_invariants(self.in_flight.iter().map(|(r, _)| r.as_slice()));
    }

    /// Schedules and applies one step if the decision is Launch; returns the decision kind.
    fn launch(&mut self) -> Decision {
        let drained = self.in_flight.is_empty();
        let before = format!("{:?}", self.s);
        let d = self.s.schedule(drained);
        assert_eq!(
            before,
            format!("{:?}", self.s),
            "schedule() must not mutate"
        );
        if let Decision::Launch(plan) = &d {
            let mut batch = ExecBatch::default();
            let mut record = Vec::new();
            self.s.apply(plan, &mut batch, &mut record);
            batch.check().unwrap();
            // What a backend learns from the batch must equal the scheduler's block tables.
            for init in &batch.row_inits {
                self.rows.insert(init.row, Vec::new());
                self.local_rows.insert(init.row, Vec::new());
            }
            for (seq, e) in batch.seqs.iter().zip(&record) {
                let table = self
                    .rows
                    .get_mut(&seq.row)
                    .expect("row initialised before use");
                table.extend_from_slice(
                    &batch.new_blocks
                        [seq.blocks_start as usize..(seq.blocks_start + seq.blocks_len) as usize],
                );
                let r = self.s.request(e.id).unwrap();
                assert_eq!(
                    *table,
                    r.blocks.iter().map(|b| b.0).collect::<Vec<_>>(),
                    "backend block table of {:?}",
                    e.id
                );
                assert!(table.len() as u32 * 4 >= seq.position + seq.num_tokens);
                // The local table: entries given back are stale on the backend; the rest match.
                let local = self.local_rows.get_mut(&seq.row).expect("row initialised");
                let mid = (seq.blocks_start + seq.blocks_len) as usize;
                local
                    .extend_from_slice(&batch.new_blocks[mid..mid + seq.local_blocks_len as usize]);
                let released = r.local_released as usize;
                assert_eq!(
                    local[released.min(local.len())..],
                    r.local_blocks[released.min(r.local_blocks.len())..]
                        .iter()
                        .map(|b| b.0)
                        .collect::<Vec<_>>(),
                    "backend local table of {:?}",
                    e.id
                );
                if let Some(l) = self.s.config().local_kv {
                    assert!(local.len() as u32 * 4 >= seq.position + seq.num_tokens);
                    // Every position the step's tokens read is in a live entry.
                    let first_read = (seq.position + 1).saturating_sub(l.window) / 4;
                    assert!(
                        r.local_released <= first_read,
                        "{:?} reads a released block",
                        e.id
                    );
                    let live = r.local_blocks.len() - released;
                    self.max_local_live = self.max_local_live.max(live);
                }
            }
            self.in_flight.push_back((record, batch));
        }
        self.check();
        d
    }

    fn commit(&mut self) {
        let (record, _batch) = self.in_flight.pop_front().expect("a step in flight");
        let mut out = StepOutput::default();
        for e in record.iter().filter(|e| e.sample) {
            let r = self.s.request(e.id).unwrap();
            // The sampled token's output index, counting in-flight samples before this one.
            let index = r.output.len() as u32;
            let t = self
                .forced
                .iter()
                .find(|f| f.0 == e.id && f.1 == index)
                .map(|f| f.2)
                .unwrap_or(1000 + index);
            out.push_one(t, None);
        }
        self.s.commit(&record, &out, &mut self.sink);
        self.check();
    }

    fn outputs_of(&self, id: u64) -> (Vec<TokenId>, Option<FinishReason>) {
        let name = format!("r{id}");
        let mut toks = Vec::new();
        let mut fin = None;
        for (_, o) in self.sink.iter().filter(|(_, o)| o.request_id == name) {
            assert!(fin.is_none(), "output after finish for {name}");
            toks.extend(&o.new_token_ids);
            fin = o.finish.as_ref().map(|f| f.reason);
        }
        (toks, fin)
    }

    /// Runs the async loop to completion: launch while possible, else commit.
    fn run(&mut self, depth: usize) {
        for _ in 0..10_000 {
            let can_launch = self.in_flight.len() < depth;
            let d = if can_launch {
                self.launch()
            } else {
                Decision::DrainFirst
            };
            match d {
                Decision::Launch(_) => {}
                Decision::DrainFirst => self.commit(),
                Decision::Idle if !self.in_flight.is_empty() => self.commit(),
                Decision::Idle => return,
            }
        }
        panic!("did not finish");
    }
}

#[test]
fn admission_respects_rows_budget_and_fifo() {
    let mut h = Harness::new(cfg(2, 10, 64, 2));
    h.add(1, 6, 4);
    h.add(2, 6, 4);
    h.add(3, 3, 4);
    let Decision::Launch(plan) = h.launch() else {
        panic!()
    };
    // Budget 10: r1 gets 6, r2 gets a 4-token chunk; r3 has no row.
    assert_eq!(
        plan.entries,
        vec![
            Planned {
                id: RequestId(1),
                num_tokens: 6,
                admit: true,
                cached_blocks: 0
            },
            Planned {
                id: RequestId(2),
                num_tokens: 4,
                admit: true,
                cached_blocks: 0
            }
        ]
    );
    let (_, batch) = h.in_flight.back().unwrap();
    assert_eq!(
        batch.seqs.iter().map(|s| s.sample).collect::<Vec<_>>(),
        vec![true, false],
        "partial chunk does not sample"
    );
    assert_eq!(h.s.num_waiting(), 1);
}

#[test]
fn prefill_waits_for_a_drained_pipeline() {
    let mut h = Harness::new(cfg(4, 64, 64, 2));
    h.add(1, 5, 10);
    assert!(matches!(h.launch(), Decision::Launch(_)));
    // r1 decodes with one step in flight: allowed (run-ahead).
    assert!(matches!(h.launch(), Decision::Launch(_)));
    h.add(2, 5, 10);
    h.commit();
    // A waiting request now needs the pipeline drained first.
    assert_eq!(h.s.schedule(false), Decision::DrainFirst);
    h.commit();
    let Decision::Launch(plan) = h.launch() else {
        panic!()
    };
    assert!(
        plan.entries.iter().any(|p| p.id == RequestId(2) && p.admit),
        "prefill begins after at most 2 completions"
    );
    assert_eq!(
        plan.entries[0],
        Planned {
            id: RequestId(1),
            num_tokens: 1,
            admit: false,
            cached_blocks: 0
        },
        "decodes first"
    );
}

#[test]
fn budgeted_counts_stop_scheduling_at_max_tokens() {
    let mut h = Harness::new(cfg(4, 64, 64, 2));
    h.add(1, 3, 2);
    assert!(matches!(h.launch(), Decision::Launch(_))); // prefill, samples token 1
    assert!(matches!(h.launch(), Decision::Launch(_))); // decode, samples token 2
                                                        // Two samples in flight = max_tokens: not dispatchable although inflight_refs < 2 is false anyway.
    assert_eq!(h.s.request(RequestId(1)).unwrap().budgeted_output(), 2);
    h.commit();
    assert_eq!(
        h.launch(),
        Decision::Idle,
        "never scheduled past max_tokens"
    );
    h.commit();
    assert_eq!(
        h.outputs_of(1),
        (vec![1000, 1001], Some(FinishReason::Length))
    );
    assert_eq!(h.s.num_requests(), 0, "released");
    assert_eq!(h.s.kv().num_used(), 0);
}

#[test]
fn eos_zombie_is_skipped_and_released_after_its_last_step() {
    let mut h = Harness::new(cfg(4, 64, 64, 2));
    h.add(1, 3, 10);
    h.forced.push((RequestId(1), 1, EOS));
    h.launch(); // prefill -> token 0
    h.launch(); // decode -> token 1 = EOS
    h.commit();
    h.launch(); // decode -> token 2 (will be a zombie's)
    h.commit(); // EOS committed: finalized, still in the last step
    let r = h.s.request(RequestId(1)).unwrap();
    assert!(r.is_zombie(), "EOS'd request still in flight is a zombie");
    assert_eq!(h.s.num_running(), 0);
    assert_eq!(
        h.s.num_allocated_rows(),
        1,
        "the zombie still holds its row"
    );
    h.commit();
    assert_eq!(h.outputs_of(1), (vec![1000, EOS], Some(FinishReason::Stop)));
    assert_eq!(h.s.num_allocated_rows(), 0);
    assert_eq!(h.s.kv().num_used(), 0);
}

#[test]
fn abort_in_flight_releases_after_the_step() {
    let mut h = Harness::new(cfg(4, 64, 64, 2));
    h.add(1, 3, 10);
    h.launch();
    h.launch();
    assert!(h.s.abort(RequestId(1), &mut h.sink));
    assert_eq!(h.outputs_of(1).1, Some(FinishReason::Abort));
    assert!(
        h.s.kv().num_used() > 0,
        "blocks held until in-flight steps complete"
    );
    h.commit();
    h.commit();
    assert_eq!(
        h.outputs_of(1),
        (vec![], Some(FinishReason::Abort)),
        "no tokens after the abort"
    );
    assert_eq!(h.s.kv().num_used(), 0);
    assert!(
        !h.s.abort(RequestId(1), &mut h.sink),
        "second abort is a no-op"
    );
}

#[test]
fn chunked_prefill_then_decode() {
    let mut h = Harness::new(cfg(2, 4, 64, 2));
    h.add(1, 10, 3);
    h.run(2);
    assert_eq!(
        h.outputs_of(1),
        (vec![1000, 1001, 1002], Some(FinishReason::Length))
    );
}

#[test]
fn preemption_recomputes_without_resending() {
    // 4-token blocks, 7 usable blocks: two requests of 8-token prompts growing to 16 tokens
    // each need 4 blocks: someone gets preempted.
    let mut h = Harness::new(cfg(4, 64, 8, 2));
    h.add(1, 8, 8);
    h.add(2, 8, 8);
    h.run(2);
    assert!(
        h.s.counters().preemptions > 0,
        "the pool is too small for both"
    );
    for id in [1, 2] {
        assert_eq!(
            h.outputs_of(id),
            ((1000..1008).collect(), Some(FinishReason::Length)),
            "request {id}"
        );
    }
    assert_eq!(h.s.kv().num_used(), 0);
}

#[test]
fn many_requests_all_finish_once_with_sync_and_async_depths() {
    for depth in [1u8, 2] {
        let mut h = Harness::new(cfg(5, 16, 40, depth));
        for i in 0..20u64 {
            h.add(i, 1 + (i as usize * 7) % 23, 1 + (i as u32 * 5) % 9);
            if i % 3 == 0 {
                h.forced.push((RequestId(i), 2, EOS));
            }
        }
        h.run(depth as usize);
        for i in 0..20u64 {
            let max = 1 + (i as u32 * 5) % 9;
            let (toks, fin) = h.outputs_of(i);
            if i % 3 == 0 && max > 2 {
                assert_eq!(
                    (toks, fin),
                    (vec![1000, 1001, EOS], Some(FinishReason::Stop))
                );
            } else {
                assert_eq!(
                    (toks, fin),
                    ((1000..1000 + max).collect(), Some(FinishReason::Length)),
                    "request {i}"
                );
            }
        }
        assert_eq!(h.s.num_requests(), 0);
        assert_eq!(h.s.kv().num_used(), 0);
    }
}

#[test]
fn every_finish_carries_the_engine_timing() {
    let mut h = Harness::new(cfg(2, 16, 40, 2));
    for i in 0..4u64 {
        h.add(i, 5, 3);
    }
    h.run(2);
    let finishes: Vec<_> = h
        .sink
        .iter()
        .filter_map(|(_, o)| o.finish.as_ref())
        .collect();
    assert_eq!(finishes.len(), 4);
    for f in finishes {
        let t = f.timing.expect("timing on every finish");
        assert!(
            t.queue_s >= 0.0 && t.prefill_s >= 0.0 && t.decode_s >= 0.0,
            "{t:?}"
        );
    }
}

#[test]
fn prefix_cache_serves_a_repeated_prompt() {
    let mut h = Harness::new(cfg(4, 64, 64, 2));
    h.add(1, 10, 3); // 10 tokens: blocks [0..4) [4..8) full, [8..10) partial
    h.run(2);
    h.add(2, 10, 3);
    let Decision::Launch(plan) = h.launch() else {
        panic!()
    };
    assert_eq!(
        plan.entries[0].cached_blocks, 2,
        "both full prompt blocks hit"
    );
    assert_eq!(
        plan.entries[0].num_tokens, 2,
        "only the partial block is computed"
    );
    let (_, batch) = h.in_flight.back().unwrap();
    assert_eq!(batch.seqs[0].position, 8);
    h.run(2);
    assert_eq!(h.outputs_of(2).0, h.outputs_of(1).0);
    let first = h.sink.iter().find(|(_, o)| o.request_id == "r2").unwrap();
    assert_eq!(
        first.1.num_cached_tokens,
        Some(8),
        "cached prompt tokens are reported on the first output"
    );
    let c = h.s.counters();
    assert_eq!((c.prefix_cache_queries, c.prefix_cache_hits), (20, 8));
}

#[test]
fn a_fully_cached_prompt_still_computes_its_last_block() {
    let mut h = Harness::new(cfg(4, 64, 64, 2));
    h.add(1, 8, 2);
    h.run(2);
    h.add(2, 8, 2);
    let Decision::Launch(plan) = h.launch() else {
        panic!()
    };
    assert_eq!(
        (plan.entries[0].cached_blocks, plan.entries[0].num_tokens),
        (1, 4)
    );
    h.run(2);
    assert_eq!(h.outputs_of(2).0, vec![1000, 1001]);
}

#[test]
fn concurrent_requests_share_prefix_blocks() {
    let mut h = Harness::new(cfg(4, 64, 64, 2));
    h.add(1, 9, 20);
    h.launch(); // r1 prefill registers its two full blocks
    h.add(2, 9, 20);
    h.commit();
    let Decision::Launch(plan) = h.launch() else {
        panic!()
    };
    let r2 = plan.entries.iter().find(|p| p.id == RequestId(2)).unwrap();
    assert_eq!(r2.cached_blocks, 2);
    let b1 = h.s.request(RequestId(1)).unwrap().blocks.clone();
    let b2 = h.s.request(RequestId(2)).unwrap().blocks.clone();
    assert_eq!(b1[..2], b2[..2], "same physical blocks");
    assert_eq!(h.s.kv().ref_count(b1[0]), 2);
    h.run(2);
    assert_eq!(h.outputs_of(1).0, h.outputs_of(2).0);
}

#[test]
fn caching_off_computes_everything() {
    let mut c = cfg(4, 64, 64, 2);
    c.enable_prefix_caching = false;
    let mut h = Harness::new(c);
    h.add(1, 10, 3);
    h.run(2);
    h.add(2, 10, 3);
    let Decision::Launch(plan) = h.launch() else {
        panic!()
    };
    assert_eq!(
        (plan.entries[0].cached_blocks, plan.entries[0].num_tokens),
        (0, 10)
    );
}

#[test]
fn prefill_first_policy_runs_prefills_alone() {
    let mut c = cfg(4, 64, 64, 1);
    c.policy = SchedulingPolicy::PrefillFirst;
    let mut h = Harness::new(c);
    h.add(1, 5, 10);
    h.launch();
    h.commit();
    h.add(2, 5, 10);
    let Decision::Launch(plan) = h.launch() else {
        panic!()
    };
    assert_eq!(plan.entries.len(), 1, "no decode mixed into a prefill step");
    assert!(plan.entries[0].admit);
    h.commit();
    let Decision::Launch(plan) = h.launch() else {
        panic!()
    };
    assert_eq!(plan.entries.len(), 2, "then both decode");
    h.commit();
    h.run(1);
    assert_eq!(h.outputs_of(1).0, (1000..1010).collect::<Vec<_>>());
    assert_eq!(h.outputs_of(2).0, (1000..1010).collect::<Vec<_>>());
}

#[test]
fn different_cache_salts_do_not_share_blocks() {
    let mut h = Harness::new(cfg(4, 64, 64, 2));
    h.add(1, 10, 3);
    h.run(2);
    let mut salted = Request::new(
        RequestId(2),
        Origin(0),
        "r2".into(),
        (0..10).map(|i| 100 + i).collect(),
        SamplingParams::greedy(3),
        0,
    );
    salted.cache_salt = 77;
    h.s.add(salted);
    let Decision::Launch(plan) = h.launch() else {
        panic!()
    };
    assert_eq!(plan.entries[0].cached_blocks, 0, "another salt: no hit");
    h.run(2);
    let mut same = Request::new(
        RequestId(3),
        Origin(0),
        "r3".into(),
        (0..10).map(|i| 100 + i).collect(),
        SamplingParams::greedy(3),
        0,
    );
    same.cache_salt = 77;
    h.s.add(same);
    let Decision::Launch(plan) = h.launch() else {
        panic!()
    };
    assert_eq!(plan.entries[0].cached_blocks, 2, "same salt: hit");
}

mod speculative {
    use super::*;
    use proptest::prelude::*;

    /// Commits the oldest step as a speculative backend would: each sampled entry emits
    /// `1 + accepted` tokens, `accepted` drawn by `accept` from `0..booked`.
    fn commit_round(h: &mut Harness, accept: &mut impl FnMut(u32) -> u32) {
        let (record, _batch) = h.in_flight.pop_front().expect("a step in flight");
        let mut out = StepOutput::default();
        for e in record.iter().filter(|e| e.sample) {
            let r = h.s.request(e.id).unwrap();
            let base = r.output.len() as u32;
            let proposed = e.booked - 1;
            let n = 1 + accept(proposed).min(proposed);
            for k in 0..n {
                out.tokens.push(1000 + base + k);
                out.logprobs.push(None);
            }
            out.counts.push(n);
            out.proposed.push(proposed);
        }
        h.s.commit(&record, &out, &mut h.sink);
        h.check();
    }

    proptest! {
        /// Random acceptance, random limits, pipelined rounds: every request ends with
        /// exactly `max_tokens` tokens (or at the model length), never more; rows, blocks and
        /// in-flight references stay consistent after every transition; all KV comes back.
        #[test]
        fn rounds_never_overshoot_and_leak_nothing(
            k in 1u32..6,
            reqs in proptest::collection::vec((1usize..40, 1u32..60), 1..8),
            accepts in proptest::collection::vec(0u32..8, 64),
            depth in 1u8..=2,
        ) {
            let mut c = cfg(4, 64, 200, depth);
            c.num_speculative_tokens = k;
            c.max_model_len = 80;
            let max_len = c.max_model_len;
            let mut h = Harness::new(c);
            for (i, &(p, m)) in reqs.iter().enumerate() {
                h.add(i as u64, p, m);
            }
            let mut draws = accepts.iter().cycle().copied();
            let mut accept = |_| draws.next().unwrap();
            let mut guard = 0;
            while h.s.has_work() || !h.in_flight.is_empty() {
                guard += 1;
                prop_assert!(guard < 10_000, "no progress");
                let full = h.in_flight.len() >= depth as usize;
                match if full { Decision::Idle } else { h.launch() } {
                    Decision::Launch(_) => {}
                    _ => commit_round(&mut h, &mut accept),
                }
            }
            prop_assert_eq!(h.s.kv().num_used(), 0);
            for (i, &(p, m)) in reqs.iter().enumerate() {
                let (toks, fin) = h.outputs_of(i as u64);
                let want = m.min(max_len - p as u32);
                prop_assert_eq!(toks.len() as u32, want, "request {}", i);
                prop_assert_eq!(fin, Some(FinishReason::Length));
                // Tokens are the backend's, in order, with none dropped or repeated.
                let expect: Vec<u32> = (0..want).map(|j| 1000 + j).collect();
                prop_assert_eq!(toks, expect);
            }
        }
    }
}

/// Window-sized KV (sliding-window layers' own pool): window 8, blocks of 4.
fn local_cfg(max_num_seqs: u32, budget: u32, blocks: u32, local_blocks: u32) -> SchedulerConfig {
    SchedulerConfig {
        local_kv: Some(LocalKvConfig {
            window: 8,
            num_blocks: local_blocks,
        }),
        ..cfg(max_num_seqs, budget, blocks, 2)
    }
}

#[test]
fn sliding_window_blocks_are_given_back_as_the_window_moves() {
    for depth in [1usize, 2] {
        let mut h = Harness::new(local_cfg(2, 8, 64, 40));
        h.add(1, 37, 40);
        h.run(depth);
        let (toks, fin) = h.outputs_of(1);
        assert_eq!((toks.len(), fin), (40, Some(FinishReason::Length)));
        // 77 positions would need 20 blocks; a window of 8 with chunks of 8 needs at most
        // the window's 2-3 blocks and the chunk's 2-3.
        assert!(
            h.max_local_live <= 6,
            "held {} local blocks",
            h.max_local_live
        );
        assert_eq!(h.s.local_kv().unwrap().num_used(), 0);
        assert_eq!(h.s.kv().num_used(), 0);
    }
}

#[test]
fn a_small_sliding_window_pool_bounds_chunks_and_everything_finishes() {
    // 12 local blocks (one scratch) for 4 requests whose windows need 3-4 each: chunks shrink,
    // requests wait or are preempted, every one finishes with its tokens.
    let mut h = Harness::new(local_cfg(4, 16, 200, 12));
    for i in 0..12u64 {
        h.add(i, 1 + (i as usize * 11) % 37, 1 + (i as u32 * 7) % 13);
        if i % 4 == 1 {
            h.forced.push((RequestId(i), 3, EOS));
        }
    }
    h.run(2);
    assert!(
        h.s.counters().preemptions > 0,
        "the small pool forces a preemption"
    );
    for i in 0..12u64 {
        let max = 1 + (i as u32 * 7) % 13;
        let (toks, fin) = h.outputs_of(i);
        if i % 4 == 1 && max > 3 {
            assert_eq!(
                (toks, fin),
                (vec![1000, 1001, 1002, EOS], Some(FinishReason::Stop))
            );
        } else {
            assert_eq!(
                (toks, fin),
                ((1000..1000 + max).collect(), Some(FinishReason::Length)),
                "request {i}"
            );
        }
    }
    assert_eq!(h.s.local_kv().unwrap().num_used(), 0);
}

#[test]
fn prefix_hits_need_the_window_before_them_in_the_sliding_pool() {
    let mut h = Harness::new(local_cfg(4, 64, 64, 64));
    h.add(1, 30, 2); // blocks 0..7 full (28 tokens), window 8
    h.run(2);
    // Request 1's local blocks before its last window went back to the pool but keep their
    // hashes until reused: every full block is still a hit, and the new request's local
    // table starts with scratch entries up to the window before its hit.
    h.add(2, 30, 2);
    let Decision::Launch(plan) = h.launch() else {
        panic!()
    };
    assert_eq!(plan.entries[0].cached_blocks, 7);
    let r = h.s.request(RequestId(2)).unwrap();
    // Position 28's window starts at 21: block 5 onwards must be live.
    assert_eq!(r.local_released, 5);
    assert!(r.local_blocks[..5]
        .iter()
        .all(|&b| b == crate::kv::SCRATCH_BLOCK));
    h.run(2);
    assert_eq!(h.outputs_of(2).0, h.outputs_of(1).0);

    // Once the sliding pool reused those blocks, a hit stops where the window is missing.
    let mut h = Harness::new(local_cfg(4, 64, 64, 64));
    h.add(1, 30, 2);
    h.run(2);
    h.s.local.as_mut().unwrap().kv.reset_cache();
    h.add(2, 30, 2);
    let Decision::Launch(plan) = h.launch() else {
        panic!()
    };
    assert_eq!(plan.entries[0].cached_blocks, 0, "no local window: no hit");
    h.run(2);
    assert_eq!(h.outputs_of(2).0, h.outputs_of(1).0);
}
