//! End to end: the engine core and two front ends started on their own (as systemd or
//! compose would), then `kill -9` of the engine mid-stream: within 2 s /health answers 503,
//! new requests get 503 and every open stream ends with an error event and `[DONE]`; an
//! engine restarted on the same address is picked up without restarting the front ends.

mod common;

use std::time::{Duration, Instant};

use common::{default_model, free_port, runtime, Api, Proc};
use hyper::StatusCode;
use serde_json::{json, Value};

/// The default model's whole context (`max_position_embeddings`).
const MAX_MODEL_LEN: u32 = 2048;
/// Tokens asked of the streams that must still be running when the engine stops or dies: as
/// many as fit the context after a short prompt, so they outlast the test's waits.
const LONG_STREAM_TOKENS: u32 = MAX_MODEL_LEN - 48;

fn start_engine(model: &str, endpoint: &str) -> Proc {
    Proc::spawn(
        "engine-core",
        &[
            "engine-core",
            "--model",
            model,
            "--endpoint",
            endpoint,
            "--kv-cache-mib",
            "64",
            "--max-model-len",
            &MAX_MODEL_LEN.to_string(),
        ],
    )
}

#[test]
fn engine_death_gives_503_and_error_events_then_recovers() {
    let model = default_model();
    let model = model.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("ipc://{}/engine.sock", dir.path().display());
    let port = free_port();
    let mut engine = start_engine(model, &endpoint);
    let mut fronts: Vec<Proc> = (0..2)
        .map(|i| {
            let port = port.to_string();
            Proc::frontend(model, &endpoint, i, &["--port", &port, "--reuse-port"])
        })
        .collect();
    for f in &mut fronts {
        f.wait_for_line("HARRIER_FRONTEND_READY", Duration::from_secs(120));
    }
    let rt = runtime();
    let api = Api::new(port, None);
    rt.block_on(async {
        api.wait_health(StatusCode::OK, Duration::from_secs(10)).await;

        // A hung engine (connection open, no heartbeats): SIGSTOP. Within 2 s the front ends
        // give up on it (503, the open stream ends with an error event); after SIGCONT they
        // reconnect.
        let hung_stream = {
            let api = api.clone();
            tokio::spawn(async move { api.stream("/v1/completions", &json!({"prompt": "hang", "max_tokens": LONG_STREAM_TOKENS, "ignore_eos": true, "stream": true})).await })
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while api.metric("harrier_engine_num_requests_running").await < 1.0 {
            assert!(Instant::now() < deadline, "the stream never started");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        engine.signal(libc::SIGSTOP);
        let to_503 = api.wait_health(StatusCode::SERVICE_UNAVAILABLE, Duration::from_secs(2)).await;
        eprintln!("hung engine: /health 503 after {to_503:?}");
        let st = hung_stream.await.unwrap();
        assert_eq!(st.events.last().unwrap(), "[DONE]");
        let err: Value = serde_json::from_str(&st.events[st.events.len() - 2]).unwrap();
        assert_eq!(err["error"]["code"], "engine_unavailable", "{err}");
        engine.signal(libc::SIGCONT);
        let back = api.wait_health(StatusCode::OK, Duration::from_secs(10)).await;
        eprintln!("hung engine resumed: /health 200 after {back:?}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while api.metric("harrier_engine_num_requests_running").await > 0.0 {
            assert!(Instant::now() < deadline, "the abandoned request was not aborted");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for _ in 0..6 {
            let (s, body) = api.post_json("/v1/completions", &json!({"prompt": "after resume", "max_tokens": 2})).await;
            if s != StatusCode::OK {
                // The other front end may still be reconnecting.
                assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{body}");
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
        api.wait_health(StatusCode::OK, Duration::from_secs(10)).await;
        // Long streams (ignore_eos) that will still be running when the engine dies.
        let mut streams = Vec::new();
        for i in 0..4 {
            let api = api.clone();
            streams.push(tokio::spawn(async move {
                let body = json!({"prompt": format!("stream {i}"), "max_tokens": LONG_STREAM_TOKENS, "ignore_eos": true, "stream": true});
                let st = api.stream("/v1/completions", &body).await;
                (st, Instant::now())
            }));
        }
        // Let them produce tokens.
        let deadline = Instant::now() + Duration::from_secs(20);
        while api.metric("harrier_engine_num_requests_running").await < 4.0 {
            assert!(Instant::now() < deadline, "streams never started");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;

        engine.signal(libc::SIGKILL);
        let killed = Instant::now();
        let to_503 = api.wait_health(StatusCode::SERVICE_UNAVAILABLE, Duration::from_secs(2)).await;
        eprintln!("/health 503 after {to_503:?}");
        // Both front ends (connections are spread by the kernel): every probe is 503 now.
        for _ in 0..20 {
            assert_eq!(api.get("/health").await.0, StatusCode::SERVICE_UNAVAILABLE);
        }
        let (s, body) = api.post_json("/v1/completions", &json!({"prompt": "x", "max_tokens": 2})).await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert_eq!(body["error"]["code"], "engine_unavailable");
        for h in streams {
            let (st, ended) = h.await.unwrap();
            let since_kill = ended.duration_since(killed);
            assert!(since_kill < Duration::from_secs(2), "stream ended {since_kill:?} after the kill");
            assert_eq!(st.status, StatusCode::OK);
            assert_eq!(st.events.last().unwrap(), "[DONE]");
            let err: Value = serde_json::from_str(&st.events[st.events.len() - 2]).unwrap();
            assert_eq!(err["error"]["code"], "engine_unavailable", "{err}");
            assert!(st.events.len() > 3, "the stream had produced tokens before the kill");
        }
        assert!(killed.elapsed() < Duration::from_secs(3));
        assert_eq!(api.metric("harrier_engine_up").await, 0.0);

        // A new engine core on the same address: the front ends reconnect by themselves.
        let _ = engine.wait_timeout(Duration::from_secs(5));
        engine = start_engine(model, &endpoint);
        let back = api.wait_health(StatusCode::OK, Duration::from_secs(120)).await;
        eprintln!("/health 200 again after {back:?}");
        // Both front ends must be back: several fresh connections all succeed.
        let mut ok = 0;
        let deadline = Instant::now() + Duration::from_secs(10);
        while ok < 8 {
            let (s, body) = api.post_json("/v1/completions", &json!({"prompt": "after restart", "max_tokens": 3, "ignore_eos": true})).await;
            if s == StatusCode::OK {
                assert_eq!(body["choices"][0]["finish_reason"], "length");
                ok += 1;
            } else {
                assert!(Instant::now() < deadline, "still failing after the engine came back: {s} {body}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        // The benchmark's engine-direct mode on the same engine.
        let args = harrier_frontend::bench::BenchServeArgs {
            base_url: String::new(),
            engine_endpoint: Some(endpoint.parse().unwrap()),
            model: None,
            num_prompts: 6,
            input_len: 16,
            output_len: 4,
            request_rate: f64::INFINITY,
            max_concurrency: None,
            token_id_range: (100, 1000),
            seed: 2,
            api_key: None,
            json: None,
            label: String::new(),
            no_progress: true,
            ..harrier_frontend::bench::BenchServeArgs::defaults()
        };
        let r = harrier_frontend::bench::bench(args).await.unwrap();
        assert_eq!((r.completed, r.total_output_tokens), (6, 24), "{:?}", r.errors);
        let st = api.stream("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": true})).await;
        assert_eq!(st.finish_reasons(1).len(), 1);
        assert_eq!(st.events.last().unwrap(), "[DONE]");
    });

    // Front ends drain and exit 0 on SIGTERM.
    for f in &mut fronts {
        f.signal(libc::SIGTERM);
    }
    for f in &mut fronts {
        let status = f
            .wait_timeout(Duration::from_secs(10))
            .expect("front end did not exit on SIGTERM");
        assert!(status.success(), "front end exit: {status}");
    }
    engine.signal(libc::SIGTERM);
    let status = engine
        .wait_timeout(Duration::from_secs(10))
        .expect("engine did not exit on SIGTERM");
    assert!(status.success(), "engine exit: {status}");
}
