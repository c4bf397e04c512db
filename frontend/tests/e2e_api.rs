//! End to end: `harrier serve` with 2 front ends on one port (SO_REUSEPORT) in front of the
//! embedded default model (`harrier-cpu`), driven over HTTP. One server for every scenario
//! (start-up dominates).

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{default_model, free_port, runtime, Api, Proc, MODEL_NAME};
use hyper::{Method, StatusCode};
use serde_json::{json, Value};

const KEY: &str = "sk-test-key";
const MAX_MODEL_LEN: u32 = 1024;
const MAX_BODY: usize = 1 << 20;

fn start_server() -> (Proc, u16) {
    let model = default_model();
    let port = free_port();
    let mut p = Proc::spawn(
        "harrier serve",
        &[
            "serve",
            "--model",
            model.to_str().unwrap(),
            "--api-server-count",
            "2",
            "--port",
            &port.to_string(),
            "--api-key",
            KEY,
            "--max-model-len",
            &MAX_MODEL_LEN.to_string(),
            "--kv-cache-mib",
            "64",
            "--max-body-bytes",
            &MAX_BODY.to_string(),
            "--drain-timeout",
            "5",
        ],
    );
    p.wait_for_line("Harrier is serving", Duration::from_secs(300));
    (p, port)
}

#[test]
fn serve_end_to_end() {
    let (server, port) = start_server();
    let rt = runtime();
    let api = Api::new(port, Some(KEY));
    rt.block_on(async {
        let t = Instant::now();
        basics(&api).await;
        eprintln!("basics: {:?}", t.elapsed());
        stream_equals_non_stream(&api).await;
        eprintln!("stream == non-stream: {:?}", t.elapsed());
        n_and_seeds(&api).await;
        eprintln!("n and seeds: {:?}", t.elapsed());
        logprobs(&api).await;
        eprintln!("logprobs: {:?}", t.elapsed());
        prefix_cache_and_salt(&api).await;
        eprintln!("prefix cache: {:?}", t.elapsed());
        concurrent_streams(&api).await;
        eprintln!("32 concurrent streams: {:?}", t.elapsed());
        bad_input_table(&api).await;
        eprintln!("bad input: {:?}", t.elapsed());
        disconnects_free_blocks(&api).await;
        eprintln!("disconnects: {:?}", t.elapsed());
        health_stays_fast_while_tokenizing(&api).await;
        eprintln!("health under tokenizer load: {:?}", t.elapsed());
        metrics(&api).await;
        bench_serve(port).await;
        eprintln!("bench serve: {:?}", t.elapsed());
    });
    drop(server);
}

async fn basics(api: &Api) {
    let anon = Api {
        key: None,
        ..api.clone()
    };
    assert_eq!(
        anon.get("/health").await.0,
        StatusCode::OK,
        "/health needs no key"
    );
    assert_eq!(anon.get("/v1/models").await.0, StatusCode::UNAUTHORIZED);
    let (s, body) = api.get("/version").await;
    assert_eq!(s, StatusCode::OK);
    assert!(serde_json::from_slice::<Value>(&body).unwrap()["version"].is_string());
    let (s, body) = api.get("/v1/models").await;
    assert_eq!(s, StatusCode::OK);
    let models: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL_NAME);
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(models["data"][0]["max_model_len"], MAX_MODEL_LEN);
    assert_eq!(
        api.get(&format!("/v1/models/{MODEL_NAME}")).await.0,
        StatusCode::OK
    );
    assert_eq!(api.get("/v1/models/other").await.0, StatusCode::NOT_FOUND);
    // A prompt gets the tokenizer's special tokens (`<|begin_of_text|>`, id 0) unless asked
    // not to; /detokenize keeps special tokens (as vLLM's does), so both round-trip exactly.
    let (s, tok) = api
        .post_json("/tokenize", &json!({"prompt": "Hello, world!"}))
        .await;
    assert_eq!(s, StatusCode::OK, "{tok}");
    assert_eq!(tok["count"], tok["tokens"].as_array().unwrap().len());
    assert_eq!(tok["tokens"][0], 0, "starts with <|begin_of_text|>: {tok}");
    let (s, de) = api
        .post_json("/detokenize", &json!({"tokens": tok["tokens"]}))
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(de["prompt"], "<|begin_of_text|>Hello, world!");
    let (s, plain) = api
        .post_json(
            "/tokenize",
            &json!({"prompt": "Hello, world!", "add_special_tokens": false}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{plain}");
    assert_eq!(
        plain["tokens"].as_array().unwrap()[..],
        tok["tokens"].as_array().unwrap()[1..]
    );
    let (s, de) = api
        .post_json("/detokenize", &json!({"tokens": plain["tokens"]}))
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(de["prompt"], "Hello, world!");
    let (s, chat_tok) = api
        .post_json(
            "/tokenize",
            &json!({"messages": [{"role": "user", "content": "Hi"}]}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    assert!(
        chat_tok["count"].as_u64().unwrap() > 10,
        "rendered with the Llama 3.1 template: {chat_tok}"
    );
}

fn completion(prompt: &str, max_tokens: u32, extra: Value) -> Value {
    let mut v = json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens});
    v.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    v
}

fn chat(content: &str, max_tokens: u32, extra: Value) -> Value {
    let mut v = json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens});
    v.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    v
}

/// A repeated long prompt is served from the prefix cache and says so in
/// `usage.prompt_tokens_details.cached_tokens`; another `cache_salt` shares nothing.
async fn prefix_cache_and_salt(api: &Api) {
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(12);
    let cached = |v: &Value| {
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    let (status, first) = api
        .post_json(
            "/v1/completions",
            &completion(&prompt, 2, json!({"cache_salt": "e2e-a", "temperature": 0})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{first}");
    let (_, second) = api
        .post_json(
            "/v1/completions",
            &completion(&prompt, 2, json!({"cache_salt": "e2e-a", "temperature": 0})),
        )
        .await;
    let prompt_tokens = second["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached(&second) >= 16 && cached(&second) < prompt_tokens,
        "second request hits the cache: {second}"
    );
    assert_eq!(
        first["choices"][0]["text"], second["choices"][0]["text"],
        "cached KV gives the same greedy text"
    );
    let (_, other) = api
        .post_json(
            "/v1/completions",
            &completion(&prompt, 2, json!({"cache_salt": "e2e-b", "temperature": 0})),
        )
        .await;
    assert_eq!(cached(&other), 0, "another salt shares nothing: {other}");
}

async fn stream_equals_non_stream(api: &Api) {
    for (path, body) in [
        (
            "/v1/completions",
            completion(
                "Once upon a time",
                12,
                json!({"temperature": 0.9, "seed": 7}),
            ),
        ),
        (
            "/v1/chat/completions",
            chat(
                "Tell me a story",
                12,
                json!({"temperature": 0.9, "seed": 11}),
            ),
        ),
        (
            "/v1/completions",
            completion("Greedy", 12, json!({"temperature": 0})),
        ),
    ] {
        let (s, full) = api.post_json(path, &body).await;
        assert_eq!(s, StatusCode::OK, "{full}");
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        sb["stream_options"] = json!({"include_usage": true});
        let st = api.stream(path, &sb).await;
        assert_eq!(st.status, StatusCode::OK);
        assert_eq!(st.events.last().unwrap(), "[DONE]");
        let choice = &full["choices"][0];
        let text = choice["text"]
            .as_str()
            .or(choice["message"]["content"].as_str())
            .unwrap();
        assert_eq!(st.texts(1)[0], text, "{path}: streamed text differs");
        assert_eq!(
            st.finish_reasons(1)[0].as_deref(),
            choice["finish_reason"].as_str()
        );
        let usage_chunk = &st.chunks()[st.chunks().len() - 1];
        assert_eq!(usage_chunk["choices"], json!([]));
        // The same request a second time may be served from the prefix cache: compare all
        // but the cached count, which the streamed (second) run reports.
        let strip = |u: &Value| {
            let mut u = u.clone();
            u.as_object_mut().unwrap().remove("prompt_tokens_details");
            u
        };
        assert_eq!(strip(&usage_chunk["usage"]), strip(&full["usage"]));
        assert!(usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
        // Shapes, as OpenAI sends them.
        if path == "/v1/chat/completions" {
            assert_eq!(full["object"], "chat.completion");
            assert!(full["id"].as_str().unwrap().starts_with("chatcmpl-"));
            assert_eq!(full["choices"][0]["message"]["role"], "assistant");
            let first = &st.chunks()[0];
            assert_eq!(first["object"], "chat.completion.chunk");
            assert_eq!(
                first["choices"][0]["delta"],
                json!({"role": "assistant", "content": ""})
            );
        } else {
            assert_eq!(full["object"], "text_completion");
            assert!(full["id"].as_str().unwrap().starts_with("cmpl-"));
        }
        assert!(full["created"].as_u64().unwrap() > 1_700_000_000);
        assert_eq!(full["model"], MODEL_NAME);
        let u = &full["usage"];
        assert_eq!(
            u["total_tokens"].as_u64().unwrap(),
            u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
        );
    }
}

async fn n_and_seeds(api: &Api) {
    let body = completion(
        "The weather today",
        8,
        json!({"n": 2, "seed": 100, "temperature": 1.0, "ignore_eos": true}),
    );
    let (s, both) = api.post_json("/v1/completions", &body).await;
    assert_eq!(s, StatusCode::OK, "{both}");
    assert_eq!(both["choices"].as_array().unwrap().len(), 2);
    assert_eq!(
        both["usage"]["completion_tokens"], 16,
        "n=2 × 8 tokens with ignore_eos"
    );
    // Choice i is the request with seed + i.
    for i in 0..2u64 {
        let one = completion(
            "The weather today",
            8,
            json!({"seed": 100 + i, "temperature": 1.0, "ignore_eos": true}),
        );
        let (_, r) = api.post_json("/v1/completions", &one).await;
        assert_eq!(
            r["choices"][0]["text"], both["choices"][i as usize]["text"],
            "choice {i}"
        );
        assert_eq!(both["choices"][i as usize]["index"], i);
    }
    // Batch prompts: choices are prompt-major.
    let body = json!({"model": MODEL_NAME, "prompt": [[1000, 2000, 3000, 4000], [5000, 6000, 7000]], "n": 2, "max_tokens": 3, "ignore_eos": true, "temperature": 0});
    let (s, r) = api.post_json("/v1/completions", &body).await;
    assert_eq!(s, StatusCode::OK, "{r}");
    assert_eq!(r["choices"].as_array().unwrap().len(), 4);
    assert_eq!(
        r["choices"][0]["text"], r["choices"][1]["text"],
        "greedy choices of one prompt agree"
    );
    assert_eq!(r["usage"]["prompt_tokens"], 4 + 3);
    let (s, r) = api
        .post_json(
            "/v1/completions",
            &json!({"prompt": ["one", "two words"], "max_tokens": 2}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{r}");
    assert_eq!(r["choices"].as_array().unwrap().len(), 2);
}

async fn logprobs(api: &Api) {
    let (s, r) = api
        .post_json(
            "/v1/completions",
            &completion("Hi", 5, json!({"logprobs": 2, "ignore_eos": true})),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{r}");
    let lp = &r["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 5);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 5);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
    assert!(lp["token_logprobs"][0].as_f64().unwrap() <= 0.0);
    let (s, r) = api
        .post_json(
            "/v1/chat/completions",
            &chat(
                "Hi",
                4,
                json!({"logprobs": true, "top_logprobs": 3, "ignore_eos": true}),
            ),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{r}");
    let content = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4);
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 3);
    assert!(content[0]["bytes"].is_array());
    let (_, r) = api
        .post_json("/v1/completions", &completion("Hi", 2, json!({})))
        .await;
    assert!(r["choices"][0]["logprobs"].is_null());
}

/// 32 streaming clients at once: completions and chat, stop strings, n=2, seeds, usage.
async fn concurrent_streams(api: &Api) {
    // References, one at a time: greedy texts to cut stop strings from.
    let mut refs = Vec::new();
    for k in 0..4 {
        let prompt = format!("Reference prompt number {k}:");
        let (s, r) = api
            .post_json(
                "/v1/completions",
                &completion(&prompt, 16, json!({"temperature": 0, "seed": k})),
            )
            .await;
        assert_eq!(s, StatusCode::OK);
        refs.push((
            prompt,
            r["choices"][0]["text"].as_str().unwrap().to_owned(),
            r["choices"][0]["finish_reason"]
                .as_str()
                .unwrap()
                .to_owned(),
        ));
    }
    let mut tasks = Vec::new();
    for i in 0..32usize {
        let api = api.clone();
        let refs = refs.clone();
        tasks.push(tokio::spawn(async move {
            let (prompt, reference, ref_finish) = &refs[i % refs.len()];
            match i % 4 {
                // Completions with a stop string cut from the reference text.
                0 => {
                    let chars: Vec<char> = reference.chars().collect();
                    let at = chars.len() / 3;
                    let stop: String = chars[at..(at + 3).min(chars.len())].iter().collect();
                    let body = completion(prompt, 16, json!({"temperature": 0, "stream": true, "stop": [stop.clone(), "\u{0}never"], "stream_options": {"include_usage": true}}));
                    let st = api.stream("/v1/completions", &body).await;
                    let text = &st.texts(1)[0];
                    if stop.is_empty() {
                        return;
                    }
                    let cut = &reference[..reference.find(&stop).unwrap()];
                    assert_eq!(text, cut, "stream {i}: stop {stop:?}");
                    assert_eq!(st.finish_reasons(1)[0].as_deref(), Some("stop"));
                    assert!(st.chunks().last().unwrap()["usage"]["completion_tokens"].as_u64().unwrap() <= 16);
                }
                // The same with include_stop_str_in_output.
                1 => {
                    let chars: Vec<char> = reference.chars().collect();
                    let at = chars.len() / 2;
                    let stop: String = chars[at..(at + 2).min(chars.len())].iter().collect();
                    let body = completion(prompt, 16, json!({"temperature": 0, "stream": true, "stop": stop, "include_stop_str_in_output": true}));
                    let st = api.stream("/v1/completions", &body).await;
                    if stop.is_empty() {
                        return;
                    }
                    let end = reference.find(&stop).unwrap() + stop.len();
                    assert_eq!(st.texts(1)[0], reference[..end], "stream {i}");
                    assert_eq!(st.finish_reasons(1)[0].as_deref(), Some("stop"));
                    let _ = ref_finish;
                }
                // Chat, n=2, seeded, usage.
                2 => {
                    let body = chat(prompt, 6, json!({"n": 2, "seed": i, "temperature": 1.0, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}}));
                    let st = api.stream("/v1/chat/completions", &body).await;
                    assert_eq!(st.status, StatusCode::OK);
                    assert_eq!(st.finish_reasons(2), vec![Some("length".into()), Some("length".into())]);
                    let usage = st.chunks().last().unwrap()["usage"].clone();
                    assert_eq!(usage["completion_tokens"], 12);
                    // Every chunk but the usage chunk carries `usage: null`.
                    assert!(st.chunks()[..st.chunks().len() - 1].iter().all(|c| c["usage"].is_null() && c.get("usage").is_some()));
                }
                // Completions without usage: no usage field at all.
                _ => {
                    let body = completion(prompt, 8, json!({"seed": i, "stream": true, "ignore_eos": true}));
                    let st = api.stream("/v1/completions", &body).await;
                    assert_eq!(st.finish_reasons(1), vec![Some("length".into())]);
                    assert!(st.chunks().iter().all(|c| c.get("usage").is_none()));
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// Every bad request gets the right status and an OpenAI error object; nothing else suffers.
async fn bad_input_table(api: &Api) {
    // A long stream runs through the whole table and must end normally.
    let bystander = {
        let api = api.clone();
        tokio::spawn(async move {
            api.stream(
                "/v1/completions",
                &completion("bystander", 40, json!({"stream": true, "ignore_eos": true})),
            )
            .await
        })
    };
    let big = format!("{{\"prompt\": \"{}\"}}", "a".repeat(MAX_BODY + 10));
    // (case, path, body, status, param)
    type Case<'a> = (&'a str, &'a str, Vec<u8>, StatusCode, Option<&'a str>);
    let cases: Vec<Case> = vec![
        ("malformed JSON", "/v1/completions", b"{\"prompt\": ".to_vec(), StatusCode::BAD_REQUEST, None),
        ("not an object", "/v1/completions", b"[1, 2]".to_vec(), StatusCode::BAD_REQUEST, None),
        ("empty body", "/v1/completions", b"".to_vec(), StatusCode::BAD_REQUEST, None),
        ("non-UTF-8 body", "/v1/completions", b"{\"prompt\": \"\xff\xfe\"}".to_vec(), StatusCode::BAD_REQUEST, None),
        ("wrong type", "/v1/completions", br#"{"prompt": "x", "temperature": "hot"}"#.to_vec(), StatusCode::BAD_REQUEST, Some("temperature")),
        ("wrong prompt type", "/v1/completions", br#"{"prompt": {"a": 1}}"#.to_vec(), StatusCode::BAD_REQUEST, Some("prompt")),
        ("missing prompt", "/v1/completions", json!({"model": MODEL_NAME}).to_string().into_bytes(), StatusCode::BAD_REQUEST, Some("prompt")),
        ("missing messages", "/v1/chat/completions", json!({"model": MODEL_NAME}).to_string().into_bytes(), StatusCode::BAD_REQUEST, Some("messages")),
        ("messages not a list", "/v1/chat/completions", br#"{"messages": "hi"}"#.to_vec(), StatusCode::BAD_REQUEST, Some("messages")),
        ("message without role", "/v1/chat/completions", br#"{"messages": [{"content": "hi"}]}"#.to_vec(), StatusCode::BAD_REQUEST, Some("messages[0]")),
        ("unknown model", "/v1/completions", br#"{"model": "gpt-9", "prompt": "x"}"#.to_vec(), StatusCode::NOT_FOUND, Some("model")),
        ("unknown model (chat)", "/v1/chat/completions", br#"{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}"#.to_vec(), StatusCode::NOT_FOUND, Some("model")),
        ("over max model len", "/v1/completions", br#"{"prompt": "x", "max_tokens": 5000}"#.to_vec(), StatusCode::BAD_REQUEST, Some("max_tokens")),
        ("prompt too long", "/v1/completions", format!("{{\"prompt\": {:?}}}", vec![1000; MAX_MODEL_LEN as usize]).into_bytes(), StatusCode::BAD_REQUEST, Some("prompt")),
        ("max_tokens 0", "/v1/completions", br#"{"prompt": "x", "max_tokens": 0}"#.to_vec(), StatusCode::BAD_REQUEST, Some("max_tokens")),
        ("max_tokens negative", "/v1/completions", br#"{"prompt": "x", "max_tokens": -3}"#.to_vec(), StatusCode::BAD_REQUEST, Some("max_tokens")),
        ("max_completion_tokens 0", "/v1/chat/completions", br#"{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}"#.to_vec(), StatusCode::BAD_REQUEST, Some("max_completion_tokens")),
        ("temperature < 0", "/v1/completions", br#"{"prompt": "x", "temperature": -0.5}"#.to_vec(), StatusCode::BAD_REQUEST, Some("temperature")),
        ("top_p 0", "/v1/completions", br#"{"prompt": "x", "top_p": 0}"#.to_vec(), StatusCode::BAD_REQUEST, Some("top_p")),
        ("top_p > 1", "/v1/completions", br#"{"prompt": "x", "top_p": 1.5}"#.to_vec(), StatusCode::BAD_REQUEST, Some("top_p")),
        ("top_k < -1", "/v1/completions", br#"{"prompt": "x", "top_k": -2}"#.to_vec(), StatusCode::BAD_REQUEST, Some("top_k")),
        ("n 0", "/v1/completions", br#"{"prompt": "x", "n": 0}"#.to_vec(), StatusCode::BAD_REQUEST, Some("n")),
        ("n over the limit", "/v1/completions", br#"{"prompt": "x", "n": 1000}"#.to_vec(), StatusCode::BAD_REQUEST, Some("n")),
        ("presence_penalty out of range", "/v1/completions", br#"{"prompt": "x", "presence_penalty": 3}"#.to_vec(), StatusCode::BAD_REQUEST, Some("presence_penalty")),
        ("too many logprobs", "/v1/completions", br#"{"prompt": "x", "logprobs": 50}"#.to_vec(), StatusCode::BAD_REQUEST, Some("logprobs")),
        ("top_logprobs without logprobs", "/v1/chat/completions", br#"{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}"#.to_vec(), StatusCode::BAD_REQUEST, Some("top_logprobs")),
        ("stream_options without stream", "/v1/completions", br#"{"prompt": "x", "stream_options": {"include_usage": true}}"#.to_vec(), StatusCode::BAD_REQUEST, Some("stream_options")),
        ("token id past the vocab", "/v1/completions", br#"{"prompt": [1, 999999]}"#.to_vec(), StatusCode::BAD_REQUEST, Some("prompt")),
        ("empty token list", "/v1/completions", br#"{"prompt": []}"#.to_vec(), StatusCode::BAD_REQUEST, Some("prompt")),
        ("stop_token_ids past the vocab", "/v1/completions", br#"{"prompt": "x", "stop_token_ids": [-1]}"#.to_vec(), StatusCode::BAD_REQUEST, Some("stop_token_ids")),
        ("min_tokens > max_tokens", "/v1/completions", br#"{"prompt": "x", "max_tokens": 2, "min_tokens": 5}"#.to_vec(), StatusCode::BAD_REQUEST, Some("min_tokens")),
        ("template error", "/v1/chat/completions", br#"{"messages": [{"role": "system", "content": "s"}], "tools": [{"type": "function", "function": {"name": "f"}}]}"#.to_vec(), StatusCode::BAD_REQUEST, None),
        ("body over the limit", "/v1/completions", big.into_bytes(), StatusCode::PAYLOAD_TOO_LARGE, None),
        ("bad detokenize ids", "/detokenize", br#"{"tokens": [-5]}"#.to_vec(), StatusCode::BAD_REQUEST, Some("tokens")),
    ];
    for (name, path, body, want, param) in cases {
        let (status, bytes) = api.call(Method::POST, path, Some(Bytes::from(body))).await;
        assert_eq!(status, want, "{name}: {}", String::from_utf8_lossy(&bytes));
        check_error_object(name, &bytes, param);
    }
    for (name, method, path, key, want) in [
        (
            "no key",
            Method::POST,
            "/v1/completions",
            None,
            StatusCode::UNAUTHORIZED,
        ),
        (
            "wrong key",
            Method::POST,
            "/v1/completions",
            Some("sk-wrong"),
            StatusCode::UNAUTHORIZED,
        ),
        (
            "wrong key, /metrics",
            Method::GET,
            "/metrics",
            Some("nope"),
            StatusCode::UNAUTHORIZED,
        ),
        (
            "GET on a POST route",
            Method::GET,
            "/v1/completions",
            Some(KEY),
            StatusCode::METHOD_NOT_ALLOWED,
        ),
        (
            "unknown route",
            Method::GET,
            "/v2/nothing",
            Some(KEY),
            StatusCode::NOT_FOUND,
        ),
    ] {
        let other = Api {
            key: key.map(str::to_owned),
            ..api.clone()
        };
        let (status, bytes) = other
            .call(
                method,
                path,
                Some(Bytes::from_static(br#"{"prompt": "x"}"#)),
            )
            .await;
        assert_eq!(status, want, "{name}");
        check_error_object(name, &bytes, None);
    }
    let st = bystander.await.unwrap();
    assert_eq!(
        st.finish_reasons(1),
        vec![Some("length".into())],
        "the bystander stream was disturbed"
    );
    assert_eq!(st.events.last().unwrap(), "[DONE]");
}

fn check_error_object(name: &str, bytes: &[u8], param: Option<&str>) {
    let v: Value = serde_json::from_slice(bytes)
        .unwrap_or_else(|e| panic!("{name}: not JSON ({e}): {}", String::from_utf8_lossy(bytes)));
    let err = &v["error"];
    assert!(
        err["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{name}: {v}"
    );
    assert!(err["type"].is_string(), "{name}: {v}");
    assert!(
        err.get("param").is_some() && err.get("code").is_some(),
        "{name}: {v}"
    );
    if let Some(p) = param {
        assert_eq!(err["param"], p, "{name}: {v}");
    }
}

/// A client that goes away mid-stream (or mid non-stream request) frees its engine request.
async fn disconnects_free_blocks(api: &Api) {
    wait_engine_idle(api, None).await;
    let baseline = api.metric("harrier_engine_kv_blocks_used").await;
    // Streaming: read two chunks, then drop the connection.
    {
        let mut c = harrier_frontend::http_client::Conn::connect(&api.base, api.key.as_deref())
            .await
            .unwrap();
        let body = completion(
            "disconnect me",
            900,
            json!({"stream": true, "ignore_eos": true}),
        );
        let (s, body) = c
            .send(
                Method::POST,
                "/v1/completions",
                Some(Bytes::from(body.to_string())),
            )
            .await
            .unwrap();
        assert_eq!(s, StatusCode::OK);
        let mut sse = harrier_frontend::http_client::SseReader::new(body);
        sse.next().await.unwrap();
        sse.next().await.unwrap();
        // Stats reach the other front end with the next heartbeat (250 ms).
        let deadline = Instant::now() + Duration::from_secs(3);
        while api.metric("harrier_engine_num_requests_running").await < 1.0 {
            assert!(Instant::now() < deadline, "the request is not running");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let t = Instant::now();
    wait_engine_idle(api, Some(baseline)).await;
    eprintln!("stream disconnect freed in {:?}", t.elapsed());
    let used = api.metric("harrier_engine_kv_blocks_used").await;
    assert!(
        used <= baseline,
        "blocks not freed: {used} used, {baseline} before"
    );
    // Non-streaming: the handler is dropped with the connection.
    {
        let api2 = api.clone();
        let h = tokio::spawn(async move {
            api2.post_json(
                "/v1/completions",
                &completion("disconnect me too", 900, json!({"ignore_eos": true})),
            )
            .await
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while api.metric("harrier_engine_num_requests_running").await < 1.0 {
            assert!(Instant::now() < deadline, "the request never started");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        h.abort();
        let _ = h.await;
    }
    let t = Instant::now();
    wait_engine_idle(api, Some(baseline)).await;
    eprintln!("non-stream disconnect freed in {:?}", t.elapsed());
    let used = api.metric("harrier_engine_kv_blocks_used").await;
    assert!(
        used <= baseline,
        "blocks not freed: {used} used, {baseline} before"
    );
}

/// Waits until the engine runs nothing and (with `blocks`) holds at most that many KV blocks.
async fn wait_engine_idle(api: &Api, blocks: Option<f64>) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        // Stats arrive with each step and every 250 ms heartbeat; an aborted request's blocks
        // are released when its last in-flight step completes.
        let running = api.metric("harrier_engine_num_requests_running").await
            + api.metric("harrier_engine_num_requests_waiting").await;
        let used = api.metric("harrier_engine_kv_blocks_used").await;
        if running == 0.0 && blocks.is_none_or(|b| used <= b) {
            // A scrape may reach the front end whose last heartbeat is up to 250 ms old:
            // confirm after a fresh one.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let running = api.metric("harrier_engine_num_requests_running").await;
            let used = api.metric("harrier_engine_kv_blocks_used").await;
            if running == 0.0 && blocks.is_none_or(|b| used <= b) {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "engine requests still running after 5 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Big prompts are tokenized on the blocking pool: /health and /metrics keep answering fast.
async fn health_stays_fast_while_tokenizing(api: &Api) {
    let text = "All work and no play makes Jack a dull boy. ".repeat(20_000);
    let mut jobs = Vec::new();
    for _ in 0..4 {
        let (api, text) = (api.clone(), text.clone());
        jobs.push(tokio::spawn(async move {
            let start = Instant::now();
            let (s, v) = api.post_json("/tokenize", &json!({"prompt": text})).await;
            assert_eq!(s, StatusCode::OK);
            assert!(v["count"].as_u64().unwrap() > 100_000);
            start.elapsed()
        }));
    }
    let mut worst = Duration::ZERO;
    let mut probes = 0;
    while !jobs.iter().all(|j| j.is_finished()) {
        let start = Instant::now();
        assert_eq!(api.get("/health").await.0, StatusCode::OK);
        worst = worst.max(start.elapsed());
        probes += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut slowest_job = Duration::ZERO;
    for j in jobs {
        slowest_job = slowest_job.max(j.await.unwrap());
    }
    eprintln!("tokenize jobs took up to {slowest_job:?}; {probes} /health probes, worst {worst:?}");
    assert!(
        worst < Duration::from_millis(500),
        "/health took {worst:?} while tokenizing"
    );
}

async fn metrics(api: &Api) {
    let (s, body) = api.get("/metrics").await;
    assert_eq!(s, StatusCode::OK);
    let text = String::from_utf8(body.to_vec()).unwrap();
    for name in [
        "harrier_requests_total",
        "harrier_prompt_tokens_total",
        "harrier_generation_tokens_total",
        "harrier_time_to_first_token_seconds_bucket",
        "harrier_inter_token_latency_seconds_bucket",
        "harrier_e2e_request_latency_seconds_bucket",
        "harrier_engine_num_requests_running",
        "harrier_engine_num_requests_waiting",
        "harrier_engine_kv_cache_usage_ratio",
        "harrier_engine_prefix_cache_hit_rate",
        "harrier_engine_preemptions_total",
        "harrier_engine_step_seconds",
        "harrier_engine_cuda_graph_replays_total",
        "harrier_engine_eager_decode_steps_total",
        "harrier_engine_up",
    ] {
        assert!(text.contains(name), "missing {name}");
    }
    assert_eq!(api.metric("harrier_engine_up").await, 1.0);
    assert!(api.metric("harrier_generation_tokens_total").await > 0.0);
    // Every scrape reaches one of the 2 front ends (each on a new connection, SO_REUSEPORT
    // spreads them): once their snapshots are published (every 100 ms), all report the same
    // server totals (tests/e2e_metrics.rs checks the sums themselves).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut seen = Vec::new();
    for _ in 0..8 {
        seen.push((
            api.metric("harrier_generation_tokens_total").await,
            api.metric("harrier_e2e_request_latency_seconds_count")
                .await,
            api.metric("vllm:generation_tokens_total").await,
        ));
    }
    assert!(
        seen.iter().all(|s| *s == seen[0]),
        "scrapes disagree: {seen:?}"
    );
    assert_eq!(seen[0].0, seen[0].2, "vLLM's name carries the same count");
}

/// `harrier bench serve` against the server: Poisson arrivals, exact token counts.
async fn bench_serve(port: u16) {
    let args = harrier_frontend::bench::BenchServeArgs {
        base_url: format!("http://127.0.0.1:{port}"),
        engine_endpoint: None,
        model: None,
        num_prompts: 12,
        input_len: 20,
        output_len: 5,
        request_rate: 40.0,
        max_concurrency: Some(4),
        token_id_range: (100, 1000),
        seed: 1,
        api_key: Some(KEY.into()),
        json: None,
        label: "e2e".into(),
        no_progress: true,
        ..harrier_frontend::bench::BenchServeArgs::defaults()
    };
    let r = harrier_frontend::bench::bench(args).await.unwrap();
    assert_eq!((r.completed, r.failed), (12, 0), "{:?}", r.errors);
    assert_eq!(r.total_output_tokens, 12 * 5);
    assert_eq!(r.total_input_tokens, 12 * 20);
    assert!(r.ttft_ms.p50 > 0.0 && r.itl_ms.p50 > 0.0 && r.tpot_ms.p99 >= r.tpot_ms.p50);
    assert!(r.output_throughput > 0.0);
}
