//! End to end: data parallelism on the CPU. `harrier serve --data-parallel-size 2` starts two
//! engine cores behind two front ends; requests spread over both, requests sharing a prompt
//! prefix go to one, an engine core killed with SIGKILL fails only its own requests while the
//! other keeps serving, and it is restarted and takes requests again.

mod common;

use std::time::{Duration, Instant};

use common::{runtime, Api, MODEL_NAME};
use hyper::StatusCode;
use serde_json::json;

async fn per_engine_tokens(api: &Api) -> [f64; 2] {
    let mut out = [0.0; 2];
    for (i, o) in out.iter_mut().enumerate() {
        *o = api
            .metric(&format!(
                "harrier_engine_core_generation_tokens_total{{engine=\"{i}\"}}"
            ))
            .await;
    }
    out
}

/// Waits until every front end reports the engine stats caught up (stats ride on outputs
/// and 250 ms heartbeats).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(700)).await;
}

fn engine_pids(launcher: i32) -> Vec<(i32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains("engine-core") && cmd.contains(&format!("engine-{launcher}-")) {
            out.push((pid, cmd));
        }
    }
    out
}

#[test]
fn requests_spread_and_a_dead_engine_core_fails_only_its_own() {
    let common::Served {
        proc: mut serve,
        line,
        api,
        ..
    } = common::serve(&[
        "--device",
        "cpu",
        "--data-parallel-size",
        "2",
        "--api-server-count",
        "2",
    ]);
    assert!(line.contains("2 engine cores"), "{line}");
    let launcher = serve.pid();
    let pids = engine_pids(launcher);
    assert_eq!(pids.len(), 2, "{pids:?}");
    runtime().block_on(async {
        // Distinct prompts spread over both engine cores.
        let mut tasks = Vec::new();
        for i in 0..24 {
            let api = api.clone();
            tasks.push(tokio::spawn(async move {
                let body = json!({"model": MODEL_NAME, "prompt": format!("Request number {i}: def f{i}("),
                    "max_tokens": 8, "ignore_eos": true});
                api.post_json("/v1/completions", &body).await
            }));
        }
        for t in tasks {
            let (s, v) = t.await.unwrap();
            assert_eq!(s, StatusCode::OK, "{v}");
        }
        settle().await;
        let spread = per_engine_tokens(&api).await;
        assert!(spread[0] > 0.0 && spread[1] > 0.0, "{spread:?}");
        assert_eq!(spread[0] + spread[1], 24.0 * 8.0);
        // One long shared prefix, sent one at a time: all to the same engine core.
        let prefix = "import os\nimport sys\n".repeat(20);
        for i in 0..6 {
            let body = json!({"model": MODEL_NAME, "prompt": format!("{prefix}# {i}"),
                "max_tokens": 4, "ignore_eos": true});
            let (s, v) = api.post_json("/v1/completions", &body).await;
            assert_eq!(s, StatusCode::OK, "{v}");
        }
        settle().await;
        let after = per_engine_tokens(&api).await;
        let grew: Vec<f64> = (0..2).map(|i| after[i] - spread[i]).collect();
        assert!(grew.contains(&24.0) && grew.contains(&0.0), "{grew:?}");

        // Long streams on both engine cores, then SIGKILL one.
        let mut streams = Vec::new();
        for i in 0..8 {
            let api = api.clone();
            streams.push(tokio::spawn(async move {
                let body = json!({"model": MODEL_NAME, "prompt": format!("Stream {i}: class C{i}:"),
                    "max_tokens": 1500, "ignore_eos": true, "stream": true});
                api.stream("/v1/completions", &body).await
            }));
        }
        tokio::time::sleep(Duration::from_millis(800)).await;
        let (victim, _) = pids.iter().find(|(_, c)| c.contains("-1.sock")).unwrap().clone();
        // SAFETY: a plain kill of a child process of the launcher under test.
        unsafe {
            libc::kill(victim, libc::SIGKILL);
        }
        let (mut failed, mut finished) = (0, 0);
        for s in streams {
            let st = s.await.unwrap();
            let last = st.events.iter().rev().nth(1).cloned().unwrap_or_default();
            if last.contains("\"error\"") {
                failed += 1;
            } else {
                assert_eq!(st.finish_reasons(1)[0].as_deref(), Some("length"), "{last}");
                finished += 1;
            }
        }
        assert!(failed > 0 && finished > 0, "failed {failed}, finished {finished}");
        // The other engine core serves at once.
        let body = json!({"model": MODEL_NAME, "prompt": "still here?", "max_tokens": 4});
        for _ in 0..4 {
            let (s, v) = api.post_json("/v1/completions", &body).await;
            assert_eq!(s, StatusCode::OK, "{v}");
        }
        // The launcher restarts it and the front ends reconnect.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let up = api
                .metric("harrier_engine_core_up{engine=\"1\"}")
                .await;
            if up == 1.0 {
                break;
            }
            assert!(Instant::now() < deadline, "engine core 1 did not come back");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let restarted = engine_pids(launcher);
        assert!(restarted.iter().all(|(p, _)| *p != victim), "{restarted:?}");
        let before = per_engine_tokens(&api).await;
        let mut tasks = Vec::new();
        for i in 0..24 {
            let api = api.clone();
            tasks.push(tokio::spawn(async move {
                let body = json!({"model": MODEL_NAME, "prompt": format!("Again {i}: x{i} ="),
                    "max_tokens": 8, "ignore_eos": true});
                api.post_json("/v1/completions", &body).await
            }));
        }
        for t in tasks {
            assert_eq!(t.await.unwrap().0, StatusCode::OK);
        }
        settle().await;
        let after = per_engine_tokens(&api).await;
        assert!(after[1] > 0.0 && after[0] > before[0], "{before:?} -> {after:?}");
    });
    serve.signal(libc::SIGTERM);
    let status = serve
        .wait_timeout(Duration::from_secs(60))
        .expect("serve exits");
    assert!(status.success(), "{status:?}");
}
