//! End to end: two front ends (separate ports, one shared `--metrics-dir`) in front of one
//! engine core. Requests go to each front end explicitly; a scrape of either must report the
//! whole server's totals, under Harrier's and vLLM's names, and keep a stopped front end's
//! counts.

mod common;

use std::time::Duration;

use common::{default_model, free_port, runtime, Api, Proc, MODEL_NAME};
use hyper::StatusCode;
use serde_json::json;

/// The value of the series `name{labels}` (labels in the exposition's order) in a scrape.
fn series(text: &str, name_and_labels: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name_and_labels) && l[name_and_labels.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("series {name_and_labels} not found in:\n{text}"))
}

async fn scrape(api: &Api) -> String {
    let (s, body) = api.get("/metrics").await;
    assert_eq!(s, StatusCode::OK);
    String::from_utf8(body.to_vec()).unwrap()
}

#[test]
fn any_front_end_reports_the_whole_server() {
    let model = default_model();
    let model = model.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("ipc://{}/engine.sock", dir.path().display());
    let metrics_dir = dir.path().join("metrics");
    let mut engine = Proc::spawn(
        "engine-core",
        &[
            "engine-core",
            "--model",
            model,
            "--endpoint",
            &endpoint,
            "--kv-cache-mib",
            "64",
        ],
    );
    let ports = [free_port(), free_port()];
    let mut fronts: Vec<Proc> = ports
        .iter()
        .enumerate()
        .map(|(i, port)| {
            let port = port.to_string();
            let extra = [
                "--port",
                &port,
                "--metrics-dir",
                metrics_dir.to_str().unwrap(),
            ];
            Proc::frontend(model, &endpoint, i, &extra)
        })
        .collect();
    for f in &mut fronts {
        f.wait_for_line("HARRIER_FRONTEND_READY", Duration::from_secs(120));
    }
    let apis = [Api::new(ports[0], None), Api::new(ports[1], None)];
    let rt = runtime();
    rt.block_on(async {
        // 7 requests through front end 0, 13 through front end 1; 4 tokens each.
        let mut prompt_tokens = 0.0;
        for (api, n) in apis.iter().zip([7, 13]) {
            for i in 0..n {
                let body =
                    json!({"prompt": format!("def f{i}(x):"), "max_tokens": 4, "ignore_eos": true});
                let (s, r) = api.post_json("/v1/completions", &body).await;
                assert_eq!(s, StatusCode::OK, "{r}");
                prompt_tokens += r["usage"]["prompt_tokens"].as_f64().unwrap();
            }
        }
        // Each front end publishes every 100 ms; wait well past that.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let model_label = format!("model_name=\"{MODEL_NAME}\"");
        for api in &apis {
            let text = scrape(api).await;
            assert_eq!(
                series(&text, "harrier_requests_total{finish_reason=\"length\"}"),
                20.0
            );
            assert_eq!(series(&text, "harrier_generation_tokens_total"), 80.0);
            assert_eq!(series(&text, "harrier_prompt_tokens_total"), prompt_tokens);
            assert_eq!(
                series(&text, "harrier_e2e_request_latency_seconds_count"),
                20.0
            );
            assert_eq!(
                series(&text, "harrier_request_queue_time_seconds_count"),
                20.0
            );
            assert_eq!(series(&text, "harrier_request_generation_tokens_sum"), 80.0);
            assert_eq!(series(&text, "harrier_frontend_requests_in_flight"), 0.0);
            // vLLM's names, as its dashboard queries them.
            assert_eq!(
                series(
                    &text,
                    &format!(
                        "vllm:request_success_total{{finished_reason=\"length\",{model_label}}}"
                    )
                ),
                20.0
            );
            assert_eq!(
                series(
                    &text,
                    &format!("vllm:generation_tokens_total{{{model_label}}}")
                ),
                80.0
            );
            assert_eq!(
                series(&text, &format!("vllm:prompt_tokens_total{{{model_label}}}")),
                prompt_tokens
            );
            for h in [
                "vllm:time_to_first_token_seconds_count",
                "vllm:e2e_request_latency_seconds_count",
                "vllm:request_queue_time_seconds_count",
                "vllm:request_prefill_time_seconds_count",
                "vllm:request_decode_time_seconds_count",
                "vllm:request_prompt_tokens_count",
                "vllm:request_generation_tokens_count",
            ] {
                assert_eq!(series(&text, &format!("{h}{{{model_label}}}")), 20.0, "{h}");
            }
            // 3 inter-token gaps per request.
            assert_eq!(
                series(
                    &text,
                    &format!("vllm:inter_token_latency_seconds_count{{{model_label}}}")
                ),
                60.0
            );
            for g in [
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc",
            ] {
                assert_eq!(series(&text, &format!("{g}{{{model_label}}}")), 0.0, "{g}");
            }
            assert!(text.contains("# TYPE vllm:prefix_cache_queries_total counter"));
        }

        // Front end 1 stops (SIGTERM: drains, publishes its final counts, exits): front end
        // 0 still reports the server's totals.
        fronts[1].signal(libc::SIGTERM);
        let status = fronts[1].wait_timeout(Duration::from_secs(20));
        assert!(
            status.is_some_and(|s| s.success()),
            "front end 1 did not stop cleanly: {status:?}"
        );
        let text = scrape(&apis[0]).await;
        assert_eq!(
            series(&text, "harrier_requests_total{finish_reason=\"length\"}"),
            20.0
        );
        assert_eq!(series(&text, "harrier_generation_tokens_total"), 80.0);
    });
    engine.signal(libc::SIGTERM);
    let _ = engine.wait_timeout(Duration::from_secs(20));
}
