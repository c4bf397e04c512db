//! End to end: speculative decoding through `harrier serve` on the CPU, the embedded
//! harrier-cpu with the committed harrier-cpu-draft (and with n-gram lookup), against a server
//! without speculation: greedy text equal streamed and not, completions and chat, stop strings
//! inside a round, logprobs per token, usage's speculative counts, bursts of several tokens
//! per SSE chunk, the vLLM-named metrics; and a draft with another vocabulary refused at
//! start-up with an error naming both models.

mod common;

use std::path::PathBuf;

use common::{default_model, runtime, Api, Proc, BIN, MODEL_NAME};
use hyper::StatusCode;
use serde_json::{json, Value};

fn draft_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../engine-core/models/harrier-cpu-draft")
}

fn serve(extra: &[&str]) -> (Proc, Api) {
    let s = common::serve(extra);
    (s.proc, s.api)
}

const PROMPTS: &[&str] = &[
    "import os\nimport sys\n\n\ndef main():\n",
    "class Config:\n    def __init__(self, path):\n",
    "# Copyright 2020 The Authors. All rights reserved.\n#\n# Licensed under",
    "    for i in range(len(items)):\n        if items[i]",
    "def test_parse_empty_string(self):\n",
    "return self._cache[key]\n\n    def",
];

async fn completion(api: &Api, body: Value) -> Value {
    let (s, v) = api.post_json("/v1/completions", &body).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v
}

#[test]
fn speculative_decoding_over_http_matches_plain_decoding() {
    let (_plain, plain) = serve(&[]);
    let draft_s = draft_dir();
    let (_draft, draft) = serve(&["--speculative-model", draft_s.to_str().unwrap()]);
    let (_ngram, ngram) = serve(&[
        "--speculative-method",
        "ngram",
        "--num-speculative-tokens",
        "3",
    ]);
    runtime().block_on(async {
        let mut chunks_vs_tokens = (0usize, 0u64);
        for p in PROMPTS {
            let body = json!({"model": MODEL_NAME, "prompt": p, "max_tokens": 48,
                "temperature": 0, "ignore_eos": true, "stream": true,
                "stream_options": {"include_usage": true}});
            let want = plain.stream("/v1/completions", &body).await;
            assert_eq!(want.status, StatusCode::OK);
            for (name, api) in [("draft", &draft), ("ngram", &ngram)] {
                let got = api.stream("/v1/completions", &body).await;
                assert_eq!(got.texts(1), want.texts(1), "{name}: {p:?}");
                assert_eq!(got.events.last().map(String::as_str), Some("[DONE]"));
                let usage = got.chunks().last().unwrap()["usage"].clone();
                assert_eq!(usage["completion_tokens"], 48, "{name}: {usage}");
                if name == "draft" {
                    let text_chunks = got
                        .chunks()
                        .iter()
                        .filter(|c| {
                            c["choices"][0]["text"]
                                .as_str()
                                .is_some_and(|t| !t.is_empty())
                        })
                        .count();
                    chunks_vs_tokens.0 += text_chunks;
                    chunks_vs_tokens.1 += 48;
                }
            }
            // Not streamed: the same text, and the response's speculative counts.
            let mut b = body.clone();
            b["stream"] = json!(false);
            b.as_object_mut().unwrap().remove("stream_options");
            let v = completion(&draft, b).await;
            assert_eq!(v["choices"][0]["text"], json!(want.texts(1)[0]));
            let spec = &v["usage"]["speculative_decoding"];
            assert!(spec["draft_tokens"].as_u64().unwrap() > 0, "{v}");
            assert!(
                spec["accepted_tokens"].as_u64().unwrap() <= spec["draft_tokens"].as_u64().unwrap()
            );
            let plain_v = completion(&plain, {
                let mut b = body.clone();
                b["stream"] = json!(false);
                b.as_object_mut().unwrap().remove("stream_options");
                b
            })
            .await;
            assert!(
                plain_v["usage"].get("speculative_decoding").is_none(),
                "{plain_v}"
            );
        }
        // Rounds arrive as bursts: fewer text chunks than tokens.
        assert!(
            (chunks_vs_tokens.0 as u64) < chunks_vs_tokens.1,
            "no multi-token chunk: {chunks_vs_tokens:?}"
        );

        // Chat, greedy: equal content.
        for p in &PROMPTS[..3] {
            let body = json!({"model": MODEL_NAME, "max_tokens": 32, "temperature": 0,
                "messages": [{"role": "user", "content": p}]});
            let (s, want) = plain.post_json("/v1/chat/completions", &body).await;
            assert_eq!(s, StatusCode::OK);
            let (s, got) = draft.post_json("/v1/chat/completions", &body).await;
            assert_eq!(s, StatusCode::OK);
            assert_eq!(got["choices"][0]["message"], want["choices"][0]["message"]);
            assert_eq!(
                got["usage"]["completion_tokens"],
                want["usage"]["completion_tokens"]
            );
        }

        // A stop string inside a round ends the text where it ends without speculation.
        let p = PROMPTS[1];
        let full = completion(
            &plain,
            json!({"model": MODEL_NAME, "prompt": p,
            "max_tokens": 40, "temperature": 0, "ignore_eos": true}),
        )
        .await["choices"][0]["text"]
            .as_str()
            .unwrap()
            .to_owned();
        let stop: String = full.chars().skip(full.len() / 2).take(4).collect();
        let body = json!({"model": MODEL_NAME, "prompt": p, "max_tokens": 40,
            "temperature": 0, "ignore_eos": true, "stop": [stop]});
        let want = completion(&plain, body.clone()).await;
        let got = completion(&draft, body).await;
        assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"]);
        assert_eq!(got["choices"][0]["finish_reason"], "stop");

        // Logprobs: one entry per token, the target's (within float noise of plain decoding).
        let body = json!({"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 24,
            "temperature": 0, "ignore_eos": true, "logprobs": 2});
        let want = completion(&plain, body.clone()).await;
        let got = completion(&draft, body).await;
        let (w, g) = (
            &want["choices"][0]["logprobs"],
            &got["choices"][0]["logprobs"],
        );
        assert_eq!(g["tokens"], w["tokens"]);
        let (wl, gl) = (
            w["token_logprobs"].as_array().unwrap(),
            g["token_logprobs"].as_array().unwrap(),
        );
        assert_eq!(gl.len(), 24);
        for (a, b) in wl.iter().zip(gl) {
            let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            assert!((a - b).abs() < 1e-3, "{a} vs {b}");
        }

        // Metrics under vLLM's names.
        let accepted = draft
            .metric("vllm:spec_decode_num_accepted_tokens_total")
            .await;
        let proposed = draft
            .metric("vllm:spec_decode_num_draft_tokens_total")
            .await;
        let drafts = draft.metric("vllm:spec_decode_num_drafts_total").await;
        assert!(
            accepted > 0.0 && accepted <= proposed,
            "{accepted} / {proposed}"
        );
        assert!(drafts > 0.0 && proposed <= 4.0 * drafts);
        let (_, text) = draft.get("/metrics").await;
        let text = String::from_utf8(text.to_vec()).unwrap();
        let per_pos: Vec<(String, f64)> = text
            .lines()
            .filter(|l| l.starts_with("vllm:spec_decode_num_accepted_tokens_per_pos_total{"))
            .map(|l| {
                let (series, v) = l.rsplit_once(' ').unwrap();
                (series.to_owned(), v.parse().unwrap())
            })
            .collect();
        // K = 4 (the default): positions 0 to 3, accepted counts falling along the round.
        assert_eq!(per_pos.len(), 4, "{per_pos:?}");
        let pos = |p: usize| {
            per_pos
                .iter()
                .find(|(s, _)| {
                    s.contains(&format!("position=\"{p}\""))
                        && s.contains("model_name=\"harrier-cpu\"")
                })
                .unwrap_or_else(|| panic!("position {p}: {per_pos:?}"))
                .1
        };
        assert!((1..4).all(|p| pos(p) <= pos(p - 1)), "{per_pos:?}");
        assert_eq!((0..4).map(pos).sum::<f64>(), accepted);
        let pos0 = pos(0);
        assert!(pos0 > 0.0 && pos0 <= drafts);
        assert!(
            ngram
                .metric("harrier_engine_spec_decode_num_draft_tokens_total")
                .await
                > 0.0
        );
    });
}

#[test]
fn a_draft_with_another_vocabulary_is_refused_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("micro");
    let gen = std::process::Command::new(BIN)
        .args(["gen-model", "--preset", "micro", "--no-tokenizer", "--out"])
        .arg(&other)
        .output()
        .unwrap();
    assert!(gen.status.success(), "{gen:?}");
    let model = default_model();
    let out = std::process::Command::new(BIN)
        .args(["engine-core", "--device", "cpu", "--model"])
        .arg(&model)
        .arg("--speculative-model")
        .arg(&other)
        .arg("--endpoint")
        .arg(format!("ipc://{}/e.sock", dir.path().display()))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("vocabulary") && err.contains("micro") && err.contains("harrier-cpu"),
        "{err}"
    );
    // And the option checks.
    for (args, needle) in [
        (
            vec!["--speculative-method", "draft"],
            "needs --speculative-model",
        ),
        (
            vec![
                "--speculative-method",
                "ngram",
                "--num-speculative-tokens",
                "0",
            ],
            "--num-speculative-tokens",
        ),
        (
            vec![
                "--speculative-method",
                "ngram",
                "--ngram-min",
                "5",
                "--ngram-max",
                "2",
            ],
            "--ngram-min",
        ),
    ] {
        let out = std::process::Command::new(BIN)
            .args(["engine-core", "--device", "cpu", "--model"])
            .arg(&model)
            .args(&args)
            .arg("--endpoint")
            .arg(format!("ipc://{}/e.sock", dir.path().display()))
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}
