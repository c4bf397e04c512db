//! End to end: the `harrier serve` launcher's life cycle. SIGTERM drains (an in-flight
//! stream finishes, new connections are refused) and exits 0 leaving no process behind; a
//! dead engine core makes the launcher exit non-zero, again leaving nothing behind.

mod common;

use std::time::{Duration, Instant};

use common::{group_alive, runtime, Api, Proc};
use hyper::StatusCode;
use serde_json::json;

/// Starts `harrier serve` with 2 front ends; returns it, its port and the engine's pid (= the
/// children's group).
fn serve(extra: &[&str]) -> (Proc, u16, i32) {
    let mut args = vec!["--api-server-count", "2"];
    args.extend_from_slice(extra);
    let s = common::serve(&args);
    (s.proc, s.port, s.engine_pid)
}

fn wait_group_gone(pgid: i32, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while group_alive(pgid) {
        assert!(
            Instant::now() < deadline,
            "processes of group {pgid} are still alive"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Tokens of the stream that must still be in flight when SIGTERM arrives: enough to outlast
/// noticing that it runs (a quarter second or so) on the small default model.
const DRAIN_TOKENS: u32 = 200;

#[test]
fn sigterm_drains_in_flight_streams_and_leaves_no_orphans() {
    let (mut launcher, port, children) = serve(&["--drain-timeout", "20"]);
    let rt = runtime();
    let api = Api::new(port, None);
    rt.block_on(async {
        let stream = {
            let api = api.clone();
            tokio::spawn(async move { api.stream("/v1/completions", &json!({"prompt": "drain me", "max_tokens": DRAIN_TOKENS, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}})).await })
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while api.metric("harrier_engine_num_requests_running").await < 1.0 {
            assert!(Instant::now() < deadline, "the stream never started");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        launcher.signal(libc::SIGTERM);
        // Draining: the listeners close, so new connections are refused soon.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
                break;
            }
            assert!(Instant::now() < deadline, "still accepting connections while draining");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let st = stream.await.unwrap();
        assert_eq!(st.status, StatusCode::OK);
        assert_eq!(st.finish_reasons(1), vec![Some("length".into())], "the in-flight stream was cut: {:?}", st.events);
        assert_eq!(st.chunks().last().unwrap()["usage"]["completion_tokens"], DRAIN_TOKENS);
        assert_eq!(st.events.last().unwrap(), "[DONE]");
    });
    let status = launcher
        .wait_timeout(Duration::from_secs(30))
        .expect("the launcher did not exit");
    assert!(status.success(), "launcher exit: {status}");
    wait_group_gone(children, Duration::from_secs(2));
}

#[test]
fn engine_death_makes_the_launcher_exit_non_zero() {
    let (mut launcher, port, children) = serve(&[]);
    let rt = runtime();
    rt.block_on(async {
        assert_eq!(Api::new(port, None).get("/health").await.0, StatusCode::OK);
    });
    // SAFETY: kill with plain integers; `children` is the engine's pid.
    unsafe {
        libc::kill(children, libc::SIGKILL);
    }
    let status = launcher
        .wait_timeout(Duration::from_secs(20))
        .expect("the launcher did not exit");
    assert!(
        !status.success(),
        "launcher exit after the engine died: {status}"
    );
    wait_group_gone(children, Duration::from_secs(2));
}

#[test]
fn a_killed_launcher_takes_its_children_along() {
    let (launcher, _port, children) = serve(&["--drain-timeout", "2"]);
    // SIGKILL cannot be forwarded: the children learn of it through PR_SET_PDEATHSIG.
    launcher.signal(libc::SIGKILL);
    wait_group_gone(children, Duration::from_secs(15));
}
