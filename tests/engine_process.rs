//! The engine-core server over its real sockets, with the null backend (no model): many
//! concurrent requests, aborts, bad input, front ends going away, shutdown and the fatal path.

mod common;

use std::time::Duration;

use common::{info, rt, Client, TestServer};
use harrier_engine::config::{EngineConfig, PipelineDepth};
use harrier_engine::engine::{EngineCore, ModelFacts};
use harrier_engine::executor::fault::{Fault, FaultyExecutor};
use harrier_engine::executor::null::NullExecutor;
use harrier_engine::executor::Executor;
use harrier_shared::protocol::{FinishReason, SamplingParams};

const VOCAB: u32 = 1000;

fn config(depth: PipelineDepth) -> EngineConfig {
    EngineConfig {
        max_num_seqs: 16,
        max_num_batched_tokens: 256,
        max_model_len: 512,
        block_size: 16,
        num_kv_blocks: 200,
        pipeline: depth,
        max_logprobs: 5,
        ..EngineConfig::default()
    }
}

fn engine_with<E: Executor>(exec: E, depth: PipelineDepth) -> EngineCore<E> {
    EngineCore::new(
        config(depth),
        ModelFacts {
            vocab_size: VOCAB,
            eos_token_ids: vec![],
        },
        exec,
    )
    .unwrap()
}

fn null_server(depth: PipelineDepth) -> TestServer {
    TestServer::start(
        engine_with(NullExecutor::new(VOCAB, 16), depth),
        info(VOCAB, 512),
    )
}

fn seeded(max_tokens: u32, seed: u64) -> SamplingParams {
    SamplingParams {
        seed: Some(seed),
        max_tokens,
        ..SamplingParams::default()
    }
}

fn expected(seed: u64, n: u32) -> Vec<u32> {
    (0..n)
        .map(|i| NullExecutor::token_for(seed, i, VOCAB))
        .collect()
}

#[test]
fn sixty_four_concurrent_requests_with_aborts() {
    for depth in [PipelineDepth::Async, PipelineDepth::Sync] {
        let _server = null_server(depth);
        rt().block_on(async {
            let mut c = Client::connect(&_server.endpoint).await;
            let mut ids = Vec::new();
            for i in 0..64u32 {
                let id = format!("req-{i}");
                let prompt: Vec<u32> = (0..1 + (i * 37) % 300).map(|t| t % VOCAB).collect();
                c.submit(&id, prompt, seeded(5 + i % 40, i as u64)).await;
                ids.push(id);
            }
            // Abort every 8th request once it produced something (or at once if it is queued).
            for _ in 0..20 {
                c.pump(Duration::from_millis(100)).await;
            }
            let aborted: Vec<String> = (0..64).step_by(8).map(|i| format!("req-{i}")).collect();
            c.abort(&aborted.iter().map(String::as_str).collect::<Vec<_>>())
                .await;
            c.wait_all(&ids, Duration::from_secs(60)).await;
            for i in 0..64u32 {
                let r = &c.results[&format!("req-{i}")];
                assert_eq!(r.outputs_after_finish, 0, "req-{i}: output after finish");
                let want = expected(i as u64, 5 + i % 40);
                if i % 8 == 0 && r.finish == Some(FinishReason::Abort) {
                    assert!(
                        want.starts_with(&r.tokens),
                        "req-{i}: aborted tokens are a prefix"
                    );
                } else {
                    assert_eq!(
                        (r.finish, &r.tokens),
                        (Some(FinishReason::Length), &want),
                        "req-{i} ({depth:?})"
                    );
                }
            }
            let stats = c.wait_kv_free().await;
            assert!(stats.kv_blocks_total > 0);
        });
    }
}

#[test]
fn out_of_range_inputs_finish_with_errors() {
    let _server = null_server(PipelineDepth::Async);
    rt().block_on(async {
        let mut c = Client::connect(&_server.endpoint).await;
        c.submit("empty", vec![], seeded(4, 1)).await;
        c.submit("big-token", vec![1, VOCAB, 2], seeded(4, 1)).await;
        c.submit("zero-max", vec![1, 2], seeded(0, 1)).await;
        c.submit("too-long", vec![1; 512], seeded(4, 1)).await;
        c.submit(
            "bad-temp",
            vec![1],
            SamplingParams {
                temperature: -1.0,
                ..seeded(4, 1)
            },
        )
        .await;
        c.submit(
            "bad-top-p",
            vec![1],
            SamplingParams {
                top_p: 0.0,
                ..seeded(4, 1)
            },
        )
        .await;
        c.submit(
            "too-many-logprobs",
            vec![1],
            SamplingParams {
                logprobs: Some(50),
                ..seeded(4, 1)
            },
        )
        .await;
        c.submit("fine", vec![1, 2, 3], seeded(4, 9)).await;
        c.submit("fine", vec![7, 7], seeded(9, 3)).await; // duplicate id while active: dropped
        let bad = [
            "empty",
            "big-token",
            "zero-max",
            "too-long",
            "bad-temp",
            "bad-top-p",
            "too-many-logprobs",
        ];
        let all: Vec<String> = bad
            .iter()
            .chain(["fine"].iter())
            .map(|s| s.to_string())
            .collect();
        c.wait_all(&all, Duration::from_secs(10)).await;
        for id in bad {
            let r = &c.results[id];
            assert_eq!(r.finish, Some(FinishReason::Error), "{id}");
            assert!(
                r.message.as_deref().is_some_and(|m| !m.is_empty()),
                "{id}: error has a message"
            );
            assert!(r.tokens.is_empty());
        }
        assert_eq!(
            c.results["fine"].tokens,
            expected(9, 4),
            "the good request is unaffected"
        );
        c.wait_kv_free().await;
    });
}

#[test]
fn malformed_frames_are_dropped_and_the_engine_keeps_serving() {
    use zeromq::{Socket, SocketRecv, SocketSend};
    let _server = null_server(PipelineDepth::Async);
    rt().block_on(async {
        let mut raw = zeromq::DealerSocket::new();
        raw.connect(&_server.endpoint.to_zmq()).await.unwrap();
        for junk in [
            vec![0xc1u8, 0xff, 0x00],
            vec![],
            b"not msgpack at all".to_vec(),
            vec![0x92, 0x01],
        ] {
            let _ = raw.send(zeromq::ZmqMessage::from(junk)).await;
        }
        let mut multi = zeromq::ZmqMessage::from(vec![1u8, 2, 3]);
        multi.push_back(vec![4u8].into());
        let _ = raw.send(multi).await;
        // A request from a peer that never said hello is dropped, not served.
        let req = harrier_shared::protocol::FrontendMessage::Request(
            harrier_shared::protocol::EngineCoreRequest {
                request_id: "sneaky".into(),
                prompt_token_ids: vec![1],
                sampling: seeded(2, 1),
                arrival_time: 0.0,
                cache_salt: None,
            },
        );
        let _ = raw
            .send(zeromq::ZmqMessage::from(
                harrier_shared::codec::encode(&req).unwrap().to_vec(),
            ))
            .await;
        assert!(
            tokio::time::timeout(Duration::from_millis(300), raw.recv())
                .await
                .is_err(),
            "no reply to an unannounced peer"
        );

        let mut c = Client::connect(&_server.endpoint).await;
        c.submit("after-junk", vec![5, 6], seeded(3, 4)).await;
        c.wait_all(&["after-junk".to_string()], Duration::from_secs(10))
            .await;
        assert_eq!(c.results["after-junk"].tokens, expected(4, 3));
    });
}

#[test]
fn a_departed_front_end_has_its_requests_aborted() {
    let exec = NullExecutor::new(VOCAB, 16).with_step_time(Duration::from_millis(1));
    let _server = TestServer::start(engine_with(exec, PipelineDepth::Async), info(VOCAB, 512));
    rt().block_on(async {
        let leaver = Client::connect(&_server.endpoint).await;
        for i in 0..8 {
            leaver
                .submit(&format!("l{i}"), vec![1, 2, 3], seeded(400, i))
                .await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(leaver); // says Goodbye
        let mut watcher = Client::connect(&_server.endpoint).await;
        let stats = watcher.wait_kv_free().await;
        assert!(
            stats.generation_tokens_total < 8 * 400,
            "the departed front end's requests stopped early"
        );
    });
}

#[test]
fn shutdown_aborts_in_flight_requests_and_exits_cleanly() {
    // 1 ms steps: 400 tokens take at least 0.4 s, so none can finish before the shutdown
    // 200 ms in (an instant executor finished them first on an idle machine).
    let exec = NullExecutor::new(VOCAB, 16).with_step_time(Duration::from_millis(1));
    let mut server = TestServer::start(engine_with(exec, PipelineDepth::Async), info(VOCAB, 512));
    rt().block_on(async {
        let mut c = Client::connect(&server.endpoint).await;
        let ids: Vec<String> = (0..6).map(|i| format!("s{i}")).collect();
        for (i, id) in ids.iter().enumerate() {
            c.submit(id, vec![1, 2], seeded(400, i as u64)).await;
        }
        c.pump(Duration::from_millis(200)).await;
        server.stop().expect("graceful shutdown returns Ok");
        c.wait_all(&ids, Duration::from_secs(5)).await;
        for id in &ids {
            assert_eq!(c.results[id].finish, Some(FinishReason::Abort), "{id}");
        }
    });
}

#[test]
fn backend_failure_after_dispatch_is_fatal_and_answers_everyone() {
    for fault in [
        Fault::FailWait(3),
        Fault::FailSampling(2),
        Fault::FailLaunch(4),
    ] {
        // Slow steps, so that every request is accepted before the fault hits.
        let exec = FaultyExecutor::new(
            NullExecutor::new(VOCAB, 16).with_step_time(Duration::from_millis(20)),
            fault,
        );
        let mut server =
            TestServer::start(engine_with(exec, PipelineDepth::Async), info(VOCAB, 512));
        rt().block_on(async {
            let mut c = Client::connect(&server.endpoint).await;
            let ids: Vec<String> = (0..5).map(|i| format!("f{i}")).collect();
            for (i, id) in ids.iter().enumerate() {
                c.submit(id, vec![1, 2, 3], seeded(50, i as u64)).await;
            }
            c.wait_all(&ids, Duration::from_secs(10)).await;
            for id in &ids {
                assert_eq!(
                    c.results[id].finish,
                    Some(FinishReason::Error),
                    "{id} under {fault:?}"
                );
            }
        });
        assert!(
            server.join().is_err(),
            "serve reports the fatal error ({fault:?})"
        );
    }
}

#[test]
fn rejected_launch_rolls_back_and_the_engine_goes_on() {
    let exec = FaultyExecutor::new(NullExecutor::new(VOCAB, 16), Fault::RejectLaunch(0));
    let _server = TestServer::start(engine_with(exec, PipelineDepth::Async), info(VOCAB, 512));
    rt().block_on(async {
        let mut c = Client::connect(&_server.endpoint).await;
        c.submit("victim", vec![1, 2, 3], seeded(5, 1)).await;
        c.wait_all(&["victim".to_string()], Duration::from_secs(10))
            .await;
        assert_eq!(c.results["victim"].finish, Some(FinishReason::Error));
        c.submit("survivor", vec![1, 2, 3], seeded(5, 2)).await;
        c.wait_all(&["survivor".to_string()], Duration::from_secs(10))
            .await;
        assert_eq!(c.results["survivor"].tokens, expected(2, 5));
        c.wait_kv_free().await;
    });
}

#[test]
fn pause_drains_and_resume_continues() {
    use harrier_shared::protocol::{UtilityCall, UtilityResult};
    let exec = NullExecutor::new(VOCAB, 16).with_step_time(Duration::from_millis(2));
    let _server = TestServer::start(engine_with(exec, PipelineDepth::Async), info(VOCAB, 512));
    rt().block_on(async {
        let mut c = Client::connect(&_server.endpoint).await;
        let ids: Vec<String> = (0..4).map(|i| format!("p{i}")).collect();
        for (i, id) in ids.iter().enumerate() {
            c.submit(id, vec![1, 2, 3], seeded(200, i as u64)).await;
        }
        while c.results.values().map(|r| r.tokens.len()).sum::<usize>() < 8 {
            c.pump(Duration::from_secs(5)).await;
        }
        assert_eq!(
            c.utility(UtilityCall::Pause).await,
            UtilityResult::Done,
            "pause is acknowledged once drained"
        );
        let before = c.stats().await.generation_tokens_total;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let paused = c.stats().await;
        assert_eq!(
            paused.generation_tokens_total, before,
            "nothing runs while paused"
        );
        assert_eq!(paused.num_running, 4, "requests wait, none is lost");
        // A request arriving while paused waits too.
        c.submit("late", vec![4, 5], seeded(3, 9)).await;
        assert_eq!(
            c.utility(UtilityCall::ResetPrefixCache).await,
            UtilityResult::Done
        );
        assert_eq!(c.utility(UtilityCall::Resume).await, UtilityResult::Done);
        let mut all = ids.clone();
        all.push("late".into());
        c.wait_all(&all, Duration::from_secs(30)).await;
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(c.results[id].tokens, expected(i as u64, 200), "{id}");
        }
        assert_eq!(c.results["late"].tokens, expected(9, 3));
        c.wait_kv_free().await;
    });
}
