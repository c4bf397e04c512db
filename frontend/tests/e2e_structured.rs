//! End to end: structured outputs through `harrier serve` on the CPU (the embedded
//! harrier-cpu): `response_format` json_schema and json_object on chat, vLLM's
//! `structured_outputs` regex / choice / grammar on completions (streamed and not, greedy and
//! sampled, n > 1), and invalid constraints answered with a 400 naming the field.

mod common;

use common::{runtime, MODEL_NAME};
use hyper::StatusCode;
use serde_json::{json, Value};

#[test]
fn constraints_hold_over_http() {
    let common::Served { proc: _p, api, .. } = common::serve(&[]);
    runtime().block_on(async {
        // JSON schema on chat, sampled.
        let schema = json!({"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer", "minimum": 0}},
            "required": ["city", "population"], "additionalProperties": false});
        let body = json!({"model": MODEL_NAME, "max_tokens": 200, "temperature": 0.8, "seed": 7,
            "n": 3, "messages": [{"role": "user", "content": "A city as JSON."}],
            "response_format": {"type": "json_schema",
                "json_schema": {"name": "city", "schema": schema, "strict": true}}});
        let (s, v) = api.post_json("/v1/chat/completions", &body).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        for c in v["choices"].as_array().unwrap() {
            let text = c["message"]["content"].as_str().unwrap();
            let obj: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(obj["city"].is_string() && obj["population"].as_u64().is_some(), "{obj}");
            assert_eq!(obj.as_object().unwrap().len(), 2);
            assert_eq!(c["finish_reason"], "stop");
        }
        // Any JSON object, greedy.
        let body = json!({"model": MODEL_NAME, "max_tokens": 300, "temperature": 0,
            "messages": [{"role": "user", "content": "JSON please"}],
            "response_format": {"type": "json_object"}});
        let (s, v) = api.post_json("/v1/chat/completions", &body).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        if v["choices"][0]["finish_reason"] == "stop" {
            assert!(serde_json::from_str::<Value>(text).unwrap().is_object(), "{text:?}");
        } else {
            assert!(text.trim_start().starts_with('{'), "{text:?}");
        }
        // A regex, streamed: the streamed text matches, whole.
        let body = json!({"model": MODEL_NAME, "prompt": "Order number:", "max_tokens": 40,
            "temperature": 1.0, "seed": 3, "stream": true,
            "structured_outputs": {"regex": "[A-Z]{2}-[0-9]{4}"}});
        let st = api.stream("/v1/completions", &body).await;
        assert_eq!(st.status, StatusCode::OK);
        let text = &st.texts(1)[0];
        let b = text.as_bytes();
        assert!(
            b.len() == 7
                && b[..2].iter().all(u8::is_ascii_uppercase)
                && b[2] == b'-'
                && b[3..].iter().all(u8::is_ascii_digit),
            "{text:?}"
        );
        assert_eq!(st.finish_reasons(1)[0].as_deref(), Some("stop"));
        // A choice, sampled four times.
        let body = json!({"model": MODEL_NAME, "prompt": "Sentiment:", "max_tokens": 10,
            "temperature": 1.0, "n": 4, "seed": 1,
            "structured_outputs": {"choice": ["positive", "negative", "neutral"]}});
        let (s, v) = api.post_json("/v1/completions", &body).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        for c in v["choices"].as_array().unwrap() {
            let t = c["text"].as_str().unwrap();
            assert!(["positive", "negative", "neutral"].contains(&t), "{t:?}");
        }
        // A Lark grammar.
        let body = json!({"model": MODEL_NAME, "prompt": "def", "max_tokens": 30,
            "temperature": 0,
            "structured_outputs": {"grammar": "start: \"def \" NAME \"():\"\nNAME: /[a-z]{1,10}/"}});
        let (s, v) = api.post_json("/v1/completions", &body).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let t = v["choices"][0]["text"].as_str().unwrap();
        assert!(t.starts_with("def ") && t.ends_with("():"), "{t:?}");
        // Invalid constraints: 400 naming the field and the problem.
        for (body, param, needle) in [
            (
                json!({"model": MODEL_NAME, "prompt": "x", "structured_outputs": {"regex": "(a"}}),
                "structured_outputs",
                "regex",
            ),
            (
                json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
                    "response_format": {"type": "json_schema",
                        "json_schema": {"name": "a", "schema": {"type": "nope"}}}}),
                "response_format",
                "nope",
            ),
            (
                json!({"model": MODEL_NAME, "prompt": "x",
                    "structured_outputs": {"grammar": "start: missing_rule"}}),
                "structured_outputs",
                "missing_rule",
            ),
        ] {
            let path = if body.get("messages").is_some() {
                "/v1/chat/completions"
            } else {
                "/v1/completions"
            };
            let (s, v) = api.post_json(path, &body).await;
            assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
            assert_eq!(v["error"]["param"], param, "{v}");
            let msg = v["error"]["message"].as_str().unwrap();
            assert!(msg.contains(needle), "{msg}");
        }
    });
}
