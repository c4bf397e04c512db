//! Prometheus metrics of the server (text format at `/metrics`).
//!
//! Front ends share one port (SO_REUSEPORT), so a scrape reaches any one of them: each reports
//! the whole server. A front end's own request-level series (requests by finish reason, tokens,
//! latency histograms, its in-flight gauge) live in `local`; with a shared directory
//! (`--metrics-dir`; `harrier serve` gives its front ends one) it publishes them there and a
//! scrape merges every front end's (see [`shared`]). Engine series mirror the engine's latest
//! `EngineStats` (every step's outputs and every 250 ms heartbeat), the same on every front end.
//!
//! Names: the `harrier_*` series, and under vLLM's names (`vllm:*`, with a `model_name` label)
//! the series vLLM's Grafana dashboard reads, so that dashboard works unchanged ([`vllm`]).

pub mod shared;
pub mod vllm;

use harrier_shared::protocol::{EngineStats, RequestTiming};
use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};

use shared::SharedDir;

pub struct Metrics {
    /// This front end's request-level series (published to the shared directory).
    local: Registry,
    /// The engine's series and this process's own (never merged): its connection counter and
    /// `harrier_frontend_info{frontend}`, which names the front end that answered a scrape.
    engine: Registry,
    shared: Option<SharedDir>,
    /// The last publish failed (warn once per failure streak, not every interval).
    publish_failing: std::sync::atomic::AtomicBool,
    /// The served model's name (the vLLM series' `model_name`), from the engine's handshake.
    model_name: std::sync::RwLock<String>,
    pub requests: IntCounterVec,
    pub http_responses: IntCounterVec,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub queue_time: Histogram,
    pub prefill_time: Histogram,
    pub decode_time: Histogram,
    pub request_prompt_tokens: Histogram,
    pub request_generation_tokens: Histogram,
    pub running_here: IntGauge,
    pub aborts_sent: IntCounter,
    engine_up: IntGauge,
    /// Per engine core (data parallelism): up, and its running and waiting requests.
    engine_core_up: IntGaugeVec,
    engine_core_requests: IntGaugeVec,
    engine_core_generation_tokens: IntGaugeVec,
    /// Each engine core's latest stats (the engine series are their sums).
    engine_stats: std::sync::Mutex<Vec<Option<EngineStats>>>,
    engine_running: IntGauge,
    engine_waiting: IntGauge,
    engine_kv_used: IntGauge,
    engine_kv_total: IntGauge,
    engine_sliding_kv_used: IntGauge,
    engine_sliding_kv_total: IntGauge,
    engine_kv_usage: Gauge,
    engine_step_seconds: Gauge,
    engine_steps: IntGauge,
    engine_preemptions: IntGauge,
    engine_prefix_queries: IntGauge,
    engine_prefix_hits: IntGauge,
    engine_prefix_hit_rate: Gauge,
    engine_graph_replays: IntGauge,
    engine_eager_decode: IntGauge,
    engine_spec_drafts: IntGauge,
    engine_spec_draft_tokens: IntGauge,
    engine_spec_accepted_tokens: IntGauge,
    engine_spec_accepted_per_pos: IntGaugeVec,
    /// Tokens per speculative round (from the handshake): the per-position series shown.
    spec_positions: std::sync::atomic::AtomicU32,
    engine_reconnects: IntCounter,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0,
];
/// Request phases (queue, prefill, decode): from a millisecond to ten minutes.
const PHASE_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
    320.0, 640.0,
];
/// Token counts per request (vLLM's 1-2-5 series).
const TOKEN_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
    50000.0, 100000.0, 200000.0,
];

/// Engine cores' stats added up (the last step's duration: the largest).
fn sum_stats<'a>(all: impl Iterator<Item = &'a EngineStats>) -> EngineStats {
    let mut t = EngineStats::default();
    for s in all {
        t.num_running += s.num_running;
        t.num_waiting += s.num_waiting;
        t.kv_blocks_used += s.kv_blocks_used;
        t.kv_blocks_total += s.kv_blocks_total;
        t.sliding_kv_blocks_used += s.sliding_kv_blocks_used;
        t.sliding_kv_blocks_total += s.sliding_kv_blocks_total;
        t.last_step_us = t.last_step_us.max(s.last_step_us);
        t.steps_total += s.steps_total;
        t.preemptions_total += s.preemptions_total;
        t.prefix_cache_queries_total += s.prefix_cache_queries_total;
        t.prefix_cache_hits_total += s.prefix_cache_hits_total;
        t.prompt_tokens_total += s.prompt_tokens_total;
        t.generation_tokens_total += s.generation_tokens_total;
        t.graph_replays_total += s.graph_replays_total;
        t.eager_decode_steps_total += s.eager_decode_steps_total;
        t.spec_drafts_total += s.spec_drafts_total;
        t.spec_draft_tokens_total += s.spec_draft_tokens_total;
        t.spec_accepted_tokens_total += s.spec_accepted_tokens_total;
        for (a, b) in t
            .spec_accepted_per_pos_total
            .iter_mut()
            .zip(&s.spec_accepted_per_pos_total)
        {
            *a += b;
        }
    }
    t
}

impl Metrics {
    /// The metrics of front end `frontend` (its index), reporting only itself until
    /// [`Metrics::share`] names a shared directory.
    pub fn new(frontend: &str) -> Self {
        let local = Registry::new_custom(Some("harrier".into()), None).expect("registry");
        let engine = Registry::new_custom(Some("harrier".into()), None).expect("registry");
        macro_rules! reg {
            ($m:expr) => {{
                reg!(local, $m)
            }};
            ($r:ident, $m:expr) => {{
                let m = $m;
                $r.register(Box::new(m.clone()))
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
        let info = IntGaugeVec::new(
            Opts::new(
                "frontend_info",
                "1, labelled with the index of the front end that answered this scrape",
            ),
            &["frontend"],
        )
        .expect("gauge");
        info.with_label_values(&[frontend]).set(1);
        engine
            .register(Box::new(info))
            .expect("metric registration");
        Self {
            shared: None,
            publish_failing: Default::default(),
            model_name: Default::default(),
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
            queue_time: reg!(hist(
                "request_queue_time_seconds",
                "Time a request waited in the engine before its first admission",
                PHASE_BUCKETS
            )),
            prefill_time: reg!(hist(
                "request_prefill_time_seconds",
                "Time from a request's first admission to its first output token",
                PHASE_BUCKETS
            )),
            decode_time: reg!(hist(
                "request_decode_time_seconds",
                "Time from a request's first output token to its finish",
                PHASE_BUCKETS
            )),
            request_prompt_tokens: reg!(hist(
                "request_prompt_tokens",
                "Prompt tokens per finished request",
                TOKEN_BUCKETS
            )),
            request_generation_tokens: reg!(hist(
                "request_generation_tokens",
                "Generated tokens per finished request",
                TOKEN_BUCKETS
            )),
            running_here: reg!(gauge(
                "frontend_requests_in_flight",
                "Engine requests of the front ends not yet finished"
            )),
            aborts_sent: reg!(IntCounter::new(
                "aborts_sent_total",
                "Requests aborted in the engine by this front end (stop strings, disconnects)"
            )
            .expect("counter")),
            engine_up: reg!(engine, gauge(
                "engine_up",
                "Engine cores that answer (1 without data parallelism; 0 when none does)"
            )),
            engine_core_up: reg!(engine, IntGaugeVec::new(
                Opts::new("engine_core_up", "1 while this engine core answers, else 0"),
                &["engine"]
            )
            .expect("gauge")),
            engine_core_requests: reg!(engine, IntGaugeVec::new(
                Opts::new(
                    "engine_core_requests",
                    "Requests running or waiting in this engine core"
                ),
                &["engine", "state"]
            )
            .expect("gauge")),
            engine_core_generation_tokens: reg!(engine, IntGaugeVec::new(
                Opts::new(
                    "engine_core_generation_tokens_total",
                    "Tokens this engine core generated (engine counter)"
                ),
                &["engine"]
            )
            .expect("gauge")),
            engine_stats: std::sync::Mutex::new(vec![None]),
            engine_running: reg!(engine, gauge(
                "engine_num_requests_running",
                "Requests the engine is running"
            )),
            engine_waiting: reg!(engine, gauge(
                "engine_num_requests_waiting",
                "Requests waiting in the engine"
            )),
            engine_kv_used: reg!(engine, gauge("engine_kv_blocks_used", "KV cache blocks in use")),
            engine_kv_total: reg!(engine, gauge("engine_kv_blocks_total", "KV cache blocks")),
            engine_sliding_kv_used: reg!(engine, gauge(
                "engine_sliding_kv_blocks_used",
                "Blocks in use in the sliding-window layers' own KV pool (window-sized KV)"
            )),
            engine_sliding_kv_total: reg!(engine, gauge(
                "engine_sliding_kv_blocks_total",
                "Blocks of the sliding-window layers' own KV pool (0: none)"
            )),
            engine_kv_usage: reg!(engine, fgauge(
                "engine_kv_cache_usage_ratio",
                "KV cache usage (0..1; with a sliding-window pool, the fuller of the two pools)"
            )),
            engine_step_seconds: reg!(engine, fgauge(
                "engine_step_seconds",
                "Duration of the engine's last step"
            )),
            engine_steps: reg!(engine, gauge("engine_steps_total", "Engine steps so far")),
            engine_preemptions: reg!(engine, gauge(
                "engine_preemptions_total",
                "Preemptions so far (engine counter)"
            )),
            engine_prefix_queries: reg!(engine, gauge(
                "engine_prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache (engine counter)"
            )),
            engine_prefix_hits: reg!(engine, gauge(
                "engine_prefix_cache_hits_total",
                "Prompt tokens served from the prefix cache (engine counter)"
            )),
            engine_prefix_hit_rate: reg!(engine, fgauge(
                "engine_prefix_cache_hit_rate",
                "Prefix-cache hits / queries since the engine started"
            )),
            engine_graph_replays: reg!(engine, gauge(
                "engine_cuda_graph_replays_total",
                "Decode steps replayed from a CUDA graph (engine counter)"
            )),
            engine_eager_decode: reg!(engine, gauge(
                "engine_eager_decode_steps_total",
                "Decode-only steps launched eagerly: too large for every graph, or graphs off (engine counter)"
            )),
            engine_spec_drafts: reg!(engine, gauge(
                "engine_spec_decode_num_drafts_total",
                "Speculative rounds that verified at least one proposal (engine counter)"
            )),
            engine_spec_draft_tokens: reg!(engine, gauge(
                "engine_spec_decode_num_draft_tokens_total",
                "Proposed tokens verified (engine counter)"
            )),
            engine_spec_accepted_tokens: reg!(engine, gauge(
                "engine_spec_decode_num_accepted_tokens_total",
                "Proposed tokens accepted (engine counter)"
            )),
            engine_spec_accepted_per_pos: reg!(engine, IntGaugeVec::new(
                Opts::new(
                    "engine_spec_decode_num_accepted_tokens_per_pos_total",
                    "Proposed tokens accepted at each position of a round, from 0 (engine counter)"
                ),
                &["position"]
            )
            .expect("gauge")),
            spec_positions: Default::default(),
            engine_reconnects: reg!(engine, IntCounter::new(
                "engine_connections_total",
                "Successful connections (handshakes) to an engine core"
            )
            .expect("counter")),
            local,
            engine,
        }
    }

    /// Publishes this front end's series to `dir` and merges the other front ends' there into
    /// every scrape. `identity` must be unique per process start.
    pub fn share(mut self, dir: &std::path::Path, identity: String) -> std::io::Result<Self> {
        self.shared = Some(SharedDir::new(dir, identity)?);
        Ok(self)
    }

    /// Writes this front end's snapshot to the shared directory (a no-op without one). Called
    /// every [`shared::SNAPSHOT_INTERVAL`] and at exit.
    pub fn publish(&self) {
        use std::sync::atomic::Ordering;
        if let Some(dir) = &self.shared {
            match dir.publish(shared::from_proto(&self.local.gather())) {
                Ok(()) => self.publish_failing.store(false, Ordering::Relaxed),
                Err(e) => {
                    if !self.publish_failing.swap(true, Ordering::Relaxed) {
                        tracing::warn!(error = %e, "could not publish the metrics snapshot; other front ends' /metrics miss this one's counts until it can");
                    }
                }
            }
        }
    }

    /// Records a finished request (one choice): its finish reason, token counts, end-to-end
    /// latency and, when the engine reported them, its queue, prefill and decode times.
    pub fn observe_finish(
        &self,
        reason: &str,
        prompt_tokens: u32,
        generated_tokens: u32,
        e2e_s: f64,
        timing: Option<RequestTiming>,
    ) {
        self.requests.with_label_values(&[reason]).inc();
        self.prompt_tokens.inc_by(u64::from(prompt_tokens));
        self.request_prompt_tokens.observe(f64::from(prompt_tokens));
        self.request_generation_tokens
            .observe(f64::from(generated_tokens));
        self.e2e.observe(e2e_s);
        if let Some(t) = timing {
            self.queue_time.observe(f64::from(t.queue_s));
            self.prefill_time.observe(f64::from(t.prefill_s));
            self.decode_time.observe(f64::from(t.decode_s));
        }
    }

    /// How many engine cores this front end talks to (data parallelism).
    pub fn set_engine_count(&self, n: usize) {
        *self.engine_stats.lock().expect("stats lock") = vec![None; n.max(1)];
        for i in 0..n {
            self.engine_core_up
                .with_label_values(&[&i.to_string()])
                .set(0);
        }
    }

    /// Records engine core `index`'s stats; the engine series report the sum over engine
    /// cores (counters of a core that went away keep their last value).
    pub fn set_engine_stats(&self, index: usize, s: &EngineStats) {
        let e = index.to_string();
        self.engine_core_requests
            .with_label_values(&[&e, "running"])
            .set(s.num_running.into());
        self.engine_core_requests
            .with_label_values(&[&e, "waiting"])
            .set(s.num_waiting.into());
        self.engine_core_generation_tokens
            .with_label_values(&[&e])
            .set(s.generation_tokens_total as i64);
        let total = {
            let mut all = self.engine_stats.lock().expect("stats lock");
            if index >= all.len() {
                all.resize(index + 1, None);
            }
            all[index] = Some(*s);
            sum_stats(all.iter().flatten())
        };
        self.set_total_stats(&total);
    }

    fn set_total_stats(&self, s: &EngineStats) {
        let EngineStats {
            num_running,
            num_waiting,
            kv_blocks_used,
            kv_blocks_total,
            sliding_kv_blocks_used,
            sliding_kv_blocks_total,
            last_step_us,
            steps_total,
            preemptions_total,
            prefix_cache_queries_total,
            prefix_cache_hits_total,
            prompt_tokens_total: _,
            generation_tokens_total: _,
            graph_replays_total,
            eager_decode_steps_total,
            spec_drafts_total,
            spec_draft_tokens_total,
            spec_accepted_tokens_total,
            spec_accepted_per_pos_total,
        } = *s;
        let k = self
            .spec_positions
            .load(std::sync::atomic::Ordering::Relaxed) as usize;
        if k > 0 {
            self.engine_spec_drafts.set(spec_drafts_total as i64);
            self.engine_spec_draft_tokens
                .set(spec_draft_tokens_total as i64);
            self.engine_spec_accepted_tokens
                .set(spec_accepted_tokens_total as i64);
            for (pos, &n) in spec_accepted_per_pos_total.iter().enumerate().take(k) {
                self.engine_spec_accepted_per_pos
                    .with_label_values(&[&pos.to_string()])
                    .set(n as i64);
            }
        }
        self.engine_graph_replays.set(graph_replays_total as i64);
        self.engine_eager_decode
            .set(eager_decode_steps_total as i64);
        self.engine_running.set(num_running.into());
        self.engine_waiting.set(num_waiting.into());
        self.engine_kv_used.set(kv_blocks_used.into());
        self.engine_kv_total.set(kv_blocks_total.into());
        self.engine_sliding_kv_used
            .set(sliding_kv_blocks_used.into());
        self.engine_sliding_kv_total
            .set(sliding_kv_blocks_total.into());
        // The fuller pool is what limits admission.
        let ratio = |used: u32, total: u32| match total {
            0 => 0.0,
            t => f64::from(used) / f64::from(t),
        };
        self.engine_kv_usage.set(
            ratio(kv_blocks_used, kv_blocks_total)
                .max(ratio(sliding_kv_blocks_used, sliding_kv_blocks_total)),
        );
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

    /// Tokens per speculative round, from the engine's handshake (0: speculation off, no
    /// per-position series).
    pub fn set_speculative_tokens(&self, k: u32) {
        self.spec_positions
            .store(k, std::sync::atomic::Ordering::Relaxed);
    }

    /// The served model's name, from the engine's handshake.
    pub fn set_model_name(&self, name: &str) {
        *self.model_name.write().expect("model name lock") = name.to_string();
    }

    pub fn set_engine_up(&self, index: usize, up: bool) {
        let e = index.to_string();
        self.engine_core_up
            .with_label_values(&[&e])
            .set(i64::from(up));
        self.engine_up.add(if up { 1 } else { -1 });
        if up {
            self.engine_reconnects.inc();
        } else {
            // A core that went away runs nothing and holds no KV any more.
            let mut all = self.engine_stats.lock().expect("stats lock");
            if let Some(Some(st)) = all.get_mut(index) {
                st.num_running = 0;
                st.num_waiting = 0;
                st.kv_blocks_used = 0;
                st.kv_blocks_total = 0;
            }
            let total = sum_stats(all.iter().flatten());
            drop(all);
            self.set_total_stats(&total);
            for state in ["running", "waiting"] {
                self.engine_core_requests
                    .with_label_values(&[&e, state])
                    .set(0);
            }
        }
    }

    /// Every series of the server: this front end's live request series merged with the other
    /// front ends' snapshots, the engine's series, and the vLLM-named copies.
    pub fn families(&self) -> Vec<shared::Family> {
        let mut families = shared::from_proto(&self.local.gather());
        if let Some(dir) = &self.shared {
            dir.merge_others(&mut families);
        }
        families.extend(shared::from_proto(&self.engine.gather()));
        let model_name = self.model_name.read().expect("model name lock").clone();
        let aliases = vllm::aliases(&families, &model_name);
        families.extend(aliases);
        families
    }

    /// The Prometheus text exposition of [`Metrics::families`].
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&shared::to_proto(&self.families()), &mut buf)
            .expect("text encoding");
        String::from_utf8(buf).expect("utf-8 metrics")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With a sliding-window pool the usage ratio is the fuller pool's, and both pools' blocks
    /// are exported.
    #[test]
    fn sliding_window_pool_in_the_kv_series() {
        let m = Metrics::new("0");
        m.set_model_name("m");
        m.set_engine_stats(
            0,
            &EngineStats {
                kv_blocks_used: 10,
                kv_blocks_total: 100,
                sliding_kv_blocks_used: 30,
                sliding_kv_blocks_total: 40,
                ..Default::default()
            },
        );
        let text = m.render();
        for want in [
            "harrier_engine_kv_cache_usage_ratio 0.75",
            "harrier_engine_sliding_kv_blocks_used 30",
            "harrier_engine_sliding_kv_blocks_total 40",
            "harrier_engine_kv_blocks_used 10",
            "vllm:kv_cache_usage_perc{model_name=\"m\"} 0.75",
        ] {
            assert!(text.contains(want), "{want}: {text}");
        }
    }

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::new("0");
        m.set_model_name("m");
        m.requests.with_label_values(&["stop"]).inc();
        m.ttft.observe(0.05);
        m.set_engine_stats(
            0,
            &EngineStats {
                num_running: 3,
                kv_blocks_used: 5,
                kv_blocks_total: 10,
                prefix_cache_queries_total: 4,
                prefix_cache_hits_total: 1,
                graph_replays_total: 7,
                eager_decode_steps_total: 2,
                ..Default::default()
            },
        );
        // A second engine core (data parallelism): the engine series are sums.
        m.set_engine_up(0, true);
        m.set_engine_up(1, true);
        m.set_engine_stats(
            1,
            &EngineStats {
                num_running: 2,
                kv_blocks_total: 30,
                ..Default::default()
            },
        );
        let text = m.render();
        assert!(
            text.contains("harrier_engine_num_requests_running 5"),
            "{text}"
        );
        assert!(
            text.contains("harrier_engine_kv_cache_usage_ratio 0.125"),
            "{text}"
        );
        assert!(text.contains("harrier_engine_up 2"), "{text}");
        assert!(
            text.contains("harrier_engine_core_requests{engine=\"1\",state=\"running\"} 2"),
            "{text}"
        );
        m.set_engine_up(1, false);
        let text = m.render();
        assert!(
            text.contains("harrier_engine_num_requests_running 3"),
            "{text}"
        );
        assert!(
            text.contains("harrier_engine_core_up{engine=\"1\"} 0"),
            "{text}"
        );
        m.set_engine_stats(1, &EngineStats::default());
        let text = m.render();
        assert!(
            text.contains("harrier_requests_total{finish_reason=\"stop\"} 1"),
            "{text}"
        );
        assert!(text.contains("harrier_engine_num_requests_running 3"));
        assert!(text.contains("harrier_engine_kv_cache_usage_ratio 0.5"));
        assert!(text.contains("harrier_engine_prefix_cache_hit_rate 0.25"));
        assert!(text.contains("harrier_engine_cuda_graph_replays_total 7"));
        assert!(text.contains("harrier_engine_eager_decode_steps_total 2"));
        assert!(text.contains("harrier_time_to_first_token_seconds_bucket"));
        assert!(text.contains("harrier_frontend_info{frontend=\"0\"} 1"));
        assert!(text.contains("# TYPE harrier_e2e_request_latency_seconds histogram"));
    }
}
