//! End to end: tool calling on chat completions through `harrier serve` (the embedded
//! harrier-cpu, whose template is Llama 3.1's) with `--tool-call-parser hermes` and with
//! `llama3_json`: forced calls (`"required"`, a named function, `parallel_tool_calls: false`)
//! always parse into OpenAI `tool_calls` whose arguments satisfy the function's schema,
//! streamed as tool-call deltas; `"auto"` needs `--enable-auto-tool-choice`; tool results go
//! back through the template.

mod common;

use common::{runtime, Api, Proc, MODEL_NAME};
use hyper::StatusCode;
use serde_json::{json, Value};

fn serve(extra: &[&str]) -> (Proc, Api) {
    let s = common::serve(extra);
    (s.proc, s.api)
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"]}}},
        {"type": "function", "function": {"name": "add",
            "parameters": {"type": "object", "properties": {
                "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
    ])
}

fn check_call(call: &Value) -> String {
    assert_eq!(call["type"], "function", "{call}");
    assert!(call["id"].as_str().unwrap().starts_with("call"), "{call}");
    let name = call["function"]["name"].as_str().unwrap().to_owned();
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap())
        .unwrap_or_else(|e| panic!("{call}: {e}"));
    match name.as_str() {
        "get_weather" => {
            assert!(args["city"].is_string(), "{args}");
            assert!(["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap()));
        }
        "add" => assert!(args["a"].is_i64() && args["b"].is_i64(), "{args}"),
        other => panic!("unknown function {other}"),
    }
    name
}

async fn forced_calls(api: &Api) {
    let messages = json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    // Required, sampled, several choices, one call each.
    let body = json!({"model": MODEL_NAME, "messages": messages, "tools": tools(),
        "tool_choice": "required", "parallel_tool_calls": false, "max_tokens": 200,
        "temperature": 0.8, "seed": 5, "n": 3});
    let (s, v) = api.post_json("/v1/chat/completions", &body).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    for c in v["choices"].as_array().unwrap() {
        assert_eq!(c["finish_reason"], "tool_calls", "{c}");
        let calls = c["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{c}");
        check_call(&calls[0]);
        assert!(c["message"]["content"].is_null(), "{c}");
    }
    // A named function, streamed: the call arrives as a tool-call delta.
    let body = json!({"model": MODEL_NAME, "messages": messages, "tools": tools(),
        "tool_choice": {"type": "function", "function": {"name": "add"}},
        "max_tokens": 200, "temperature": 0, "stream": true});
    let st = api.stream("/v1/chat/completions", &body).await;
    assert_eq!(st.status, StatusCode::OK);
    let deltas: Vec<Value> = st
        .chunks()
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls").cloned())
        .collect();
    assert_eq!(deltas.len(), 1, "{:?}", st.events);
    let call = &deltas[0][0];
    assert_eq!(call["index"], 0);
    assert_eq!(check_call(call), "add");
    assert_eq!(st.finish_reasons(1)[0].as_deref(), Some("tool_calls"));
    // The same non-streamed gives the same call (greedy).
    let mut b = body.clone();
    b["stream"] = json!(false);
    let (s, v) = api.post_json("/v1/chat/completions", &b).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let got = &v["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(got["name"], call["function"]["name"]);
    assert_eq!(got["arguments"], call["function"]["arguments"]);
    // The call and its result go back through the template.
    let followup = json!([
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    ]);
    let body = json!({"model": MODEL_NAME, "messages": followup, "tools": tools(),
        "tool_choice": "none", "max_tokens": 8, "temperature": 0});
    let (s, v) = api.post_json("/v1/chat/completions", &body).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(v["choices"][0]["message"]["content"].is_string());
}

#[test]
fn tool_calls_over_http() {
    let (_h, hermes) = serve(&["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]);
    let (_l, llama) = serve(&["--tool-call-parser", "llama3_json"]);
    let (_p, plain) = serve(&[]);
    runtime().block_on(async {
        forced_calls(&hermes).await;
        forced_calls(&llama).await;
        // Auto with the option on: 200, the reply is content or tool calls.
        let body = json!({"model": MODEL_NAME, "tools": tools(), "max_tokens": 16,
            "messages": [{"role": "user", "content": "Hi"}]});
        let (s, v) = hermes.post_json("/v1/chat/completions", &body).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        // Auto without --enable-auto-tool-choice, forced calls without a parser, a name not in
        // the tools: 400 naming tool_choice.
        let cases = [
            (&llama, body.clone()),
            (&plain, {
                let mut b = body.clone();
                b["tool_choice"] = json!("required");
                b
            }),
            (&hermes, {
                let mut b = body.clone();
                b["tool_choice"] = json!({"type": "function", "function": {"name": "nope"}});
                b
            }),
        ];
        for (api, body) in cases {
            let (s, v) = api.post_json("/v1/chat/completions", &body).await;
            assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
            assert_eq!(v["error"]["param"], "tool_choice", "{v}");
        }
        // tool_choice none: plain text, no tools in the prompt.
        let mut b = body.clone();
        b["tool_choice"] = json!("none");
        let (s, v) = plain.post_json("/v1/chat/completions", &b).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert!(v["choices"][0]["message"].get("tool_calls").is_none());
    });
}
