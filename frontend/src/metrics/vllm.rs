//! vLLM's metric names for the series its Grafana dashboard (and most vLLM alerting) reads.
//!
//! Each alias is a copy of a `harrier_*` family under vLLM's name with a `model_name` label, so
//! a dashboard built for vLLM works against Harrier unchanged. Semantics follow vLLM's where
//! Harrier measures the same thing: prefix-cache queries and hits count prompt tokens, the KV
//! cache usage is a fraction (0..1) despite vLLM's `_perc` name, `request_success_total` counts
//! finished requests by reason (stop, length, abort; errors are left out), and the engine's
//! totals are exposed as counters. `time_per_output_token_seconds` (vLLM's older name) and
//! `inter_token_latency_seconds` (its newer one) are the same histogram, as are
//! `gpu_cache_usage_perc` and `kv_cache_usage_perc`.

use super::shared::{Family, Kind, Series};

struct Alias {
    from: &'static str,
    to: &'static str,
    /// vLLM's type where ours differs (engine totals mirrored into gauges).
    kind: Option<Kind>,
    /// (our label, vLLM's label).
    rename: Option<(&'static str, &'static str)>,
    /// A (label, value) whose series vLLM does not count here.
    skip: Option<(&'static str, &'static str)>,
}

const fn alias(from: &'static str, to: &'static str) -> Alias {
    Alias {
        from,
        to,
        kind: None,
        rename: None,
        skip: None,
    }
}

const fn counter(from: &'static str, to: &'static str) -> Alias {
    Alias {
        kind: Some(Kind::Counter),
        ..alias(from, to)
    }
}

const ALIASES: &[Alias] = &[
    alias(
        "harrier_engine_num_requests_running",
        "vllm:num_requests_running",
    ),
    alias(
        "harrier_engine_num_requests_waiting",
        "vllm:num_requests_waiting",
    ),
    alias(
        "harrier_engine_kv_cache_usage_ratio",
        "vllm:kv_cache_usage_perc",
    ),
    alias(
        "harrier_engine_kv_cache_usage_ratio",
        "vllm:gpu_cache_usage_perc",
    ),
    counter(
        "harrier_engine_preemptions_total",
        "vllm:num_preemptions_total",
    ),
    counter(
        "harrier_engine_prefix_cache_queries_total",
        "vllm:prefix_cache_queries_total",
    ),
    counter(
        "harrier_engine_prefix_cache_hits_total",
        "vllm:prefix_cache_hits_total",
    ),
    counter(
        "harrier_engine_spec_decode_num_drafts_total",
        "vllm:spec_decode_num_drafts_total",
    ),
    counter(
        "harrier_engine_spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_draft_tokens_total",
    ),
    counter(
        "harrier_engine_spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
    ),
    counter(
        "harrier_engine_spec_decode_num_accepted_tokens_per_pos_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    ),
    alias("harrier_prompt_tokens_total", "vllm:prompt_tokens_total"),
    alias(
        "harrier_generation_tokens_total",
        "vllm:generation_tokens_total",
    ),
    Alias {
        rename: Some(("finish_reason", "finished_reason")),
        skip: Some(("finish_reason", "error")),
        ..alias("harrier_requests_total", "vllm:request_success_total")
    },
    alias(
        "harrier_time_to_first_token_seconds",
        "vllm:time_to_first_token_seconds",
    ),
    alias(
        "harrier_inter_token_latency_seconds",
        "vllm:inter_token_latency_seconds",
    ),
    alias(
        "harrier_inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ),
    alias(
        "harrier_e2e_request_latency_seconds",
        "vllm:e2e_request_latency_seconds",
    ),
    alias(
        "harrier_request_queue_time_seconds",
        "vllm:request_queue_time_seconds",
    ),
    alias(
        "harrier_request_prefill_time_seconds",
        "vllm:request_prefill_time_seconds",
    ),
    alias(
        "harrier_request_decode_time_seconds",
        "vllm:request_decode_time_seconds",
    ),
    alias(
        "harrier_request_prompt_tokens",
        "vllm:request_prompt_tokens",
    ),
    alias(
        "harrier_request_generation_tokens",
        "vllm:request_generation_tokens",
    ),
];

/// The vLLM-named copies of `families`, each series labelled `model_name`.
pub fn aliases(families: &[Family], model_name: &str) -> Vec<Family> {
    let mut out = Vec::new();
    for a in ALIASES {
        let Some(f) = families.iter().find(|f| f.name == a.from) else {
            continue;
        };
        let series = f
            .series
            .iter()
            .filter(|s| {
                a.skip
                    .is_none_or(|(k, v)| !s.labels.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|s| {
                let mut labels: Vec<(String, String)> = s
                    .labels
                    .iter()
                    .map(|(k, v)| match a.rename {
                        Some((from, to)) if k == from => (to.to_string(), v.clone()),
                        _ => (k.clone(), v.clone()),
                    })
                    .collect();
                labels.push(("model_name".into(), model_name.into()));
                Series {
                    labels,
                    value: s.value.clone(),
                }
            })
            .collect();
        out.push(Family {
            name: a.to.into(),
            help: format!("{} (vLLM's name for {})", f.help, a.from),
            kind: a.kind.unwrap_or(f.kind),
            series,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::shared::{scalar, Value};
    use super::*;

    #[test]
    fn copies_under_vllm_names_with_model_label() {
        let fams = vec![
            Family {
                name: "harrier_requests_total".into(),
                help: "Finished".into(),
                kind: Kind::Counter,
                series: vec![
                    Series {
                        labels: vec![("finish_reason".into(), "stop".into())],
                        value: Value::Scalar(3.0),
                    },
                    Series {
                        labels: vec![("finish_reason".into(), "error".into())],
                        value: Value::Scalar(1.0),
                    },
                ],
            },
            Family {
                name: "harrier_engine_preemptions_total".into(),
                help: "Preemptions".into(),
                kind: Kind::Gauge,
                series: vec![Series {
                    labels: vec![],
                    value: Value::Scalar(4.0),
                }],
            },
        ];
        let a = aliases(&fams, "m");
        assert_eq!(
            scalar(
                &a,
                "vllm:request_success_total",
                &[("finished_reason", "stop"), ("model_name", "m")]
            ),
            Some(3.0)
        );
        let success = a
            .iter()
            .find(|f| f.name == "vllm:request_success_total")
            .unwrap();
        assert_eq!(success.series.len(), 1, "errors are not successes");
        let pre = a
            .iter()
            .find(|f| f.name == "vllm:num_preemptions_total")
            .unwrap();
        assert_eq!(pre.kind, Kind::Counter);
        assert_eq!(
            scalar(&a, "vllm:num_preemptions_total", &[("model_name", "m")]),
            Some(4.0)
        );
    }
}
