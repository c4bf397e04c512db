//! Prometheus metrics of one front-end process (text format at `/metrics`).
//!
//! Request metrics are this front end's own (with SO_REUSEPORT a scrape reaches one front end;
//! each series carries a `frontend` label so several scrapes can be told apart). Engine
//! gauges mirror the engine's latest `EngineStats` (every step's outputs and every 250 ms
//! heartbeat), so every front end reports the same engine values.

use harrier_shared::protocol::EngineStats;
use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub http_responses: IntCounterVec,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub running_here: IntGauge,
    pub aborts_sent: IntCounter,
    engine_up: IntGauge,
    engine_running: IntGauge,
    engine_waiting: IntGauge,
    engine_kv_used: IntGauge,
    engine_kv_total: IntGauge,
    engine_kv_usage: Gauge,
    engine_step_seconds: Gauge,
    engine_steps: IntGauge,
    engine_preemptions: IntGauge,
    engine_prefix_queries: IntGauge,
    engine_prefix_hits: IntGauge,
    engine_prefix_hit_rate: Gauge,
    engine_graph_replays: IntGauge,
    engine_eager_decode: IntGauge,
    engine_reconnects: IntCounter,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0,
];

impl Metrics {
    pub fn new(frontend: &str) -> Self {
        let registry = Registry::new_custom(
            Some("harrier".into()),
            Some([("frontend".to_string(), frontend.to_string())].into()),
        )
        .expect("registry");
        macro_rules! reg {
            ($m:expr) => {{
                let m = $m;
                registry
                    .register(Box::new(m.clone()))
                    .expect("metric registration");
                m
            }};
        }
        let hist = |name: &str, help: &str, buckets: &[f64]| {
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
                .expect("histogram")
        };
        let gauge = |name: &str, help: &str| IntGauge::new(name, help).expect("gauge");
        let fgauge = |name: &str, help: &str| Gauge::new(name, help).expect("gauge");
        Self {
            requests: reg!(IntCounterVec::new(
                Opts::new(
                    "requests_total",
                    "Finished engine requests (choices) by finish reason"
                ),
                &["finish_reason"]
            )
            .expect("counter")),
            http_responses: reg!(IntCounterVec::new(
                Opts::new(
                    "http_responses_total",
                    "HTTP responses by endpoint and status"
                ),
                &["endpoint", "status"]
            )
            .expect("counter")),
            prompt_tokens: reg!(IntCounter::new(
                "prompt_tokens_total",
                "Prompt tokens of finished requests"
            )
            .expect("counter")),
            generation_tokens: reg!(
                IntCounter::new("generation_tokens_total", "Generated tokens").expect("counter")
            ),
            ttft: reg!(hist(
                "time_to_first_token_seconds",
                "Time from arrival to the first output token",
                LATENCY_BUCKETS
            )),
            itl: reg!(hist(
                "inter_token_latency_seconds",
                "Time between consecutive output tokens",
                LATENCY_BUCKETS
            )),
            e2e: reg!(hist(
                "e2e_request_latency_seconds",
                "Time from arrival to the last output",
                E2E_BUCKETS
            )),
            running_here: reg!(gauge(
                "frontend_requests_in_flight",
                "Engine requests of this front end not yet finished"
            )),
            aborts_sent: reg!(IntCounter::new(
                "aborts_sent_total",
                "Requests aborted in the engine by this front end (stop strings, disconnects)"
            )
            .expect("counter")),
            engine_up: reg!(gauge(
                "engine_up",
                "1 while the engine core answers, else 0"
            )),
            engine_running: reg!(gauge(
                "engine_num_requests_running",
                "Requests the engine is running"
            )),
            engine_waiting: reg!(gauge(
                "engine_num_requests_waiting",
                "Requests waiting in the engine"
            )),
            engine_kv_used: reg!(gauge("engine_kv_blocks_used", "KV cache blocks in use")),
            engine_kv_total: reg!(gauge("engine_kv_blocks_total", "KV cache blocks")),
            engine_kv_usage: reg!(fgauge(
                "engine_kv_cache_usage_ratio",
                "KV cache usage (0..1)"
            )),
            engine_step_seconds: reg!(fgauge(
                "engine_step_seconds",
                "Duration of the engine's last step"
            )),
            engine_steps: reg!(gauge("engine_steps_total", "Engine steps so far")),
            engine_preemptions: reg!(gauge(
                "engine_preemptions_total",
                "Preemptions so far (engine counter)"
            )),
            engine_prefix_queries: reg!(gauge(
                "engine_prefix_cache_queries_total",
                "Prefix-cache block queries (engine counter)"
            )),
            engine_prefix_hits: reg!(gauge(
                "engine_prefix_cache_hits_total",
                "Prefix-cache block hits (engine counter)"
            )),
            engine_prefix_hit_rate: reg!(fgauge(
                "engine_prefix_cache_hit_rate",
                "Prefix-cache hits / queries since the engine started"
            )),
            engine_graph_replays: reg!(gauge(
                "engine_cuda_graph_replays_total",
                "Decode steps replayed from a CUDA graph (engine counter)"
            )),
            engine_eager_decode: reg!(gauge(
                "engine_eager_decode_steps_total",
                "Decode-only steps launched eagerly: too large for every graph, or graphs off (engine counter)"
            )),
            engine_reconnects: reg!(IntCounter::new(
                "engine_connections_total",
                "Successful connections (handshakes) to an engine core"
            )
            .expect("counter")),
            registry,
        }
    }

    pub fn set_engine_stats(&self, s: &EngineStats) {
        let EngineStats {
            num_running,
            num_waiting,
            kv_blocks_used,
            kv_blocks_total,
            last_step_us,
            steps_total,
            preemptions_total,
            prefix_cache_queries_total,
            prefix_cache_hits_total,
            prompt_tokens_total: _,
            generation_tokens_total: _,
            graph_replays_total,
            eager_decode_steps_total,
        } = *s;
        self.engine_graph_replays.set(graph_replays_total as i64);
        self.engine_eager_decode
            .set(eager_decode_steps_total as i64);
        self.engine_running.set(num_running.into());
        self.engine_waiting.set(num_waiting.into());
        self.engine_kv_used.set(kv_blocks_used.into());
        self.engine_kv_total.set(kv_blocks_total.into());
        self.engine_kv_usage.set(if kv_blocks_total == 0 {
            0.0
        } else {
            f64::from(kv_blocks_used) / f64::from(kv_blocks_total)
        });
        self.engine_step_seconds.set(f64::from(last_step_us) / 1e6);
        self.engine_steps.set(steps_total as i64);
        self.engine_preemptions.set(preemptions_total as i64);
        self.engine_prefix_queries
            .set(prefix_cache_queries_total as i64);
        self.engine_prefix_hits.set(prefix_cache_hits_total as i64);
        self.engine_prefix_hit_rate
            .set(if prefix_cache_queries_total == 0 {
                0.0
            } else {
                prefix_cache_hits_total as f64 / prefix_cache_queries_total as f64
            });
    }

    pub fn set_engine_up(&self, up: bool) {
        self.engine_up.set(i64::from(up));
        if up {
            self.engine_reconnects.inc();
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding");
        String::from_utf8(buf).expect("utf-8 metrics")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::new("0");
        m.requests.with_label_values(&["stop"]).inc();
        m.ttft.observe(0.05);
        m.set_engine_stats(&EngineStats {
            num_running: 3,
            kv_blocks_used: 5,
            kv_blocks_total: 10,
            prefix_cache_queries_total: 4,
            prefix_cache_hits_total: 1,
            graph_replays_total: 7,
            eager_decode_steps_total: 2,
            ..Default::default()
        });
        let text = m.render();
        assert!(
            text.contains("harrier_requests_total{finish_reason=\"stop\",frontend=\"0\"} 1"),
            "{text}"
        );
        assert!(text.contains("harrier_engine_num_requests_running{frontend=\"0\"} 3"));
        assert!(text.contains("harrier_engine_kv_cache_usage_ratio{frontend=\"0\"} 0.5"));
        assert!(text.contains("harrier_engine_prefix_cache_hit_rate{frontend=\"0\"} 0.25"));
        assert!(text.contains("harrier_engine_cuda_graph_replays_total{frontend=\"0\"} 7"));
        assert!(text.contains("harrier_engine_eager_decode_steps_total{frontend=\"0\"} 2"));
        assert!(text.contains("harrier_time_to_first_token_seconds_bucket"));
        assert!(text.contains("# TYPE harrier_e2e_request_latency_seconds histogram"));
    }
}
