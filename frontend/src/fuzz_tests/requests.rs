//! Request bodies of every endpoint (`/v1/completions`, `/v1/chat/completions`, `/tokenize`,
//! `/detokenize`) through the stages their handlers run before the engine: parse, check
//! against the engine's limits, tokenize (templates included), fit the context. Bodies are
//! arbitrary bytes, arbitrary JSON, requests built from every known field with plausible and
//! hostile values, and valid requests with damaged bytes; each goes to all four endpoints.
//!
//! Every outcome must be an OpenAI error with status 400 (404 only for an unknown `model`),
//! or requests the engine accepts: prompts non-empty, inside the vocabulary and the context,
//! sampling parameters that pass the engine's own check. Never a panic, a hang, a 500.

use harrier_shared::protocol::{EngineInfo, EngineLimits, SamplingParams, TokenId};
use hyper::StatusCode;
use proptest::strategy::Union;

use super::*;
use crate::api::request::{
    parse_json, ChatRequest, CompletionRequest, DetokenizeRequest, Limits, TokenizeRequest,
    Validated,
};
use crate::error::ApiError;
use crate::handlers::{
    chat_prompt, check_chat, check_completion, check_detokenize, check_lengths, check_tokenize,
    completion_prompts, tokenize_prompt, COMPLETION_MAX_TOKENS,
};
use crate::stream::Kind;

const MODEL: &str = "harrier-cpu";

fn info(max_model_len: u32, vocab_size: u32) -> EngineInfo {
    EngineInfo {
        protocol_version: harrier_shared::protocol::PROTOCOL_VERSION,
        engine_version: "fuzz".into(),
        model_name: MODEL.into(),
        max_model_len,
        vocab_size,
        eos_token_ids: vec![1, 8, 9],
        limits: EngineLimits {
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_logprobs: 20,
            block_size: 16,
            num_kv_blocks: 1024,
            num_speculative_tokens: 0,
        },
    }
}

fn limits(info: &EngineInfo) -> Limits {
    Limits {
        max_logprobs: info.limits.max_logprobs,
        max_n: 128,
        vocab_size: info.vocab_size,
    }
}

/// What the engine would be sent: the prompts and each request's sampling parameters.
type Submitted = (Vec<Vec<TokenId>>, Vec<SamplingParams>);

/// The engine requests `generate` would build (sampling.max_tokens filled in per prompt).
fn submitted(
    info: &EngineInfo,
    prompts: Vec<Vec<TokenId>>,
    v: &Validated,
    default_max_tokens: u32,
) -> Submitted {
    let sampling = prompts
        .iter()
        .map(|p| {
            let mut s = v.sampling.clone();
            let room = info.max_model_len - p.len() as u32;
            s.max_tokens = v.max_tokens.unwrap_or(default_max_tokens.min(room));
            s
        })
        .collect();
    (prompts, sampling)
}

fn completions(body: &[u8], info: &EngineInfo) -> Result<Submitted, ApiError> {
    let text = text_model();
    let req: CompletionRequest = parse_json(body)?;
    let (v, prompts) = check_completion(&req, info, limits(info))?;
    let prompts = completion_prompts(&text, prompts, req.add_special_tokens.unwrap_or(true))?;
    check_lengths(Kind::Completion, info, &prompts, &v, COMPLETION_MAX_TOKENS)?;
    Ok(submitted(info, prompts, &v, COMPLETION_MAX_TOKENS))
}

fn chat(body: &[u8], info: &EngineInfo) -> Result<Submitted, ApiError> {
    let text = text_model();
    let req: ChatRequest = parse_json(body)?;
    // Tool calling on, so that fuzzed `tools` / `tool_choice` reach the planner.
    let tools = crate::tools::ToolConfig {
        parser: Some(crate::tools::ToolCallParser::Hermes),
        enable_auto: true,
    };
    let v = check_chat(&req, info, limits(info), tools)?;
    crate::handlers::check_structured(&text, &v, info)?;
    let prompts = vec![chat_prompt(&text, &req, v.template_tools)?];
    check_lengths(Kind::Chat, info, &prompts, &v, u32::MAX)?;
    Ok(submitted(info, prompts, &v, u32::MAX))
}

fn tokenize(body: &[u8], info: &EngineInfo) -> Result<Vec<TokenId>, ApiError> {
    let text = text_model();
    let req: TokenizeRequest = parse_json(body)?;
    check_tokenize(&req, Some(info))?;
    tokenize_prompt(&text, &req)
}

fn detokenize(body: &[u8], info: &EngineInfo) -> Result<String, ApiError> {
    let text = text_model();
    let req: DetokenizeRequest = parse_json(body)?;
    let ids = check_detokenize(&req, Some(info), text.vocab_size)?;
    text.decode(&ids, false)
}

/// A 400 (or a 404 for another model's name) in OpenAI's shape.
fn check_error(endpoint: &str, e: &ApiError) -> Result<(), TestCaseError> {
    let not_found = e.status == StatusCode::NOT_FOUND
        && e.code == Some("model_not_found")
        && e.param.as_deref() == Some("model");
    prop_assert!(
        e.status == StatusCode::BAD_REQUEST || not_found,
        "{endpoint}: status {} for {e:?}",
        e.status
    );
    prop_assert_eq!(e.kind, "invalid_request_error");
    prop_assert!(!e.message.is_empty(), "{}: an empty message", endpoint);
    let body: Value = serde_json::from_str(&e.to_json()).expect("error JSON");
    prop_assert!(body["error"]["message"].is_string(), "{}", body);
    Ok(())
}

/// What the engine's `add_request` checks, and the front end's own promises on top.
fn check_submitted(
    endpoint: &str,
    info: &EngineInfo,
    (prompts, sampling): &Submitted,
) -> Result<(), TestCaseError> {
    prop_assert!(
        !prompts.is_empty() && prompts.len() <= 64,
        "{endpoint}: {} prompts",
        prompts.len()
    );
    for (p, s) in prompts.iter().zip(sampling) {
        prop_assert!(!p.is_empty(), "{endpoint}: an empty prompt");
        prop_assert!(
            (p.len() as u32) < info.max_model_len,
            "{endpoint}: {} tokens",
            p.len()
        );
        prop_assert!(
            p.iter().all(|&t| t < info.vocab_size),
            "{endpoint}: ids {p:?}"
        );
        if let Err(e) = s.validate(info.limits.max_logprobs) {
            prop_assert!(false, "{endpoint}: the engine would reject {s:?}: {e}");
        }
        prop_assert!(
            p.len() as u64 + u64::from(s.max_tokens) <= u64::from(info.max_model_len),
            "{endpoint}: {} + {} tokens overflow the context",
            p.len(),
            s.max_tokens
        );
        prop_assert!(s.stop_token_ids.iter().all(|&t| t < info.vocab_size));
        prop_assert!(s.logit_bias.iter().all(|&(t, _)| t < info.vocab_size));
    }
    Ok(())
}

/// Runs `body` through every endpoint and checks each outcome.
fn check_body(body: &[u8], info: &EngineInfo) -> Result<(), TestCaseError> {
    let _watch = fuzz::watch("requests", &String::from_utf8_lossy(body));
    let bound = (8 << 20) + 64 * body.len();
    let (outcome, largest) = fuzz::largest_allocation(|| {
        (
            completions(body, info),
            chat(body, info),
            tokenize(body, info),
            detokenize(body, info),
        )
    });
    prop_assert!(
        largest <= bound,
        "a {}-byte body allocated {largest} bytes at once",
        body.len()
    );
    let (completion, chat, tokens, text) = outcome;
    match completion {
        Ok(s) => check_submitted("completions", info, &s)?,
        Err(e) => check_error("completions", &e)?,
    }
    match chat {
        Ok(s) => check_submitted("chat", info, &s)?,
        Err(e) => check_error("chat", &e)?,
    }
    match tokens {
        Ok(ids) => {
            let vocab = text_model().vocab_size;
            prop_assert!(ids.iter().all(|&t| t < vocab), "tokenize: {ids:?}");
        }
        Err(e) => check_error("tokenize", &e)?,
    }
    if let Err(e) = text {
        check_error("detokenize", &e)?;
    }
    Ok(())
}

/// Prompt ids: valid ones, special ones, and edge numbers.
fn id_list() -> impl Strategy<Value = Value> {
    prop::collection::vec(
        prop_oneof![4 => (0i64..8192).prop_map(Value::from), 1 => edge_number()],
        0..12,
    )
    .prop_map(Value::from)
}

/// One known field with a value of roughly the right shape (or anything).
fn field() -> impl Strategy<Value = (String, Value)> {
    fn f(
        name: &'static str,
        s: impl Strategy<Value = Value> + 'static,
    ) -> BoxedStrategy<(String, Value)> {
        prop_oneof![4 => s, 1 => any_json()]
            .prop_map(move |v| (name.to_string(), v))
            .boxed()
    }
    let num = || edge_number();
    let flag = || any::<bool>().prop_map(Value::from);
    let text = || hostile_text().prop_map(Value::from);
    let prompt = prop_oneof![
        4 => hostile_text().prop_map(Value::from),
        1 => prop::collection::vec(hostile_text(), 0..4).prop_map(|v| json!(v)),
        2 => id_list(),
        1 => prop::collection::vec(id_list(), 0..3).prop_map(Value::from),
        1 => (1usize..80).prop_map(|n| json!(vec!["x"; n])),
    ];
    let stop = prop_oneof![
        text(),
        prop::collection::vec(hostile_text(), 0..20).prop_map(|v| json!(v)),
    ];
    let logit_bias = prop::collection::vec(
        (
            prop_oneof![(0u32..9000).prop_map(|i| i.to_string()), ".{0,6}"],
            num(),
        ),
        0..4,
    )
    .prop_map(|kv| Value::Object(kv.into_iter().collect()));
    let model = prop_oneof![4 => Just(json!(MODEL)), 1 => text()];
    let response_format = prop::sample::select(vec![
        json!({"type": "text"}),
        json!({"type": "json_object"}),
        json!("text"),
    ]);
    Union::new(vec![
        f("model", model),
        f("prompt", prompt),
        f("messages", messages()),
        f("max_tokens", num()),
        f("max_completion_tokens", num()),
        f("temperature", num()),
        f("top_p", num()),
        f("top_k", num()),
        f("min_p", num()),
        f("seed", num()),
        f("stop", stop),
        f("stop_token_ids", id_list()),
        f("ignore_eos", flag()),
        f("min_tokens", num()),
        f("n", num()),
        f("best_of", num()),
        f("presence_penalty", num()),
        f("frequency_penalty", num()),
        f("repetition_penalty", num()),
        f("skip_special_tokens", flag()),
        f("include_stop_str_in_output", flag()),
        f("stream", flag()),
        f(
            "stream_options",
            flag().prop_map(|b| json!({ "include_usage": b })),
        ),
        f("user", text()),
        f("cache_salt", text()),
        f("logit_bias", logit_bias),
        f("logprobs", prop_oneof![flag(), num()]),
        f("top_logprobs", num()),
        f("echo", flag()),
        f("suffix", text()),
        f("add_special_tokens", flag()),
        f("add_generation_prompt", flag()),
        f("continue_final_message", flag()),
        f("tools", tools()),
        f("tool_choice", any_json()),
        f("chat_template_kwargs", template_kwargs()),
        f("response_format", response_format),
        f("tokens", id_list()),
    ])
}

/// A request object: a handful of known fields (duplicates: the last one wins, as in serde).
fn request() -> impl Strategy<Value = Value> {
    prop::collection::vec(field(), 0..8)
        .prop_map(|fields| Value::Object(fields.into_iter().collect()))
}

/// A request most of whose values are in range, so that many pass and the promises about
/// what reaches the engine are checked often (the fields above mostly fail validation).
fn plausible_request() -> impl Strategy<Value = Value> {
    let message = (
        prop::sample::select(vec!["system", "user", "assistant"]),
        hostile_text(),
    )
        .prop_map(|(role, content)| json!({"role": role, "content": content}));
    let base = prop_oneof![
        hostile_text().prop_map(|t| json!({ "prompt": t })),
        prop::collection::vec(0i64..8192, 1..40).prop_map(|ids| json!({ "prompt": ids })),
        prop::collection::vec(prop::collection::vec(0i64..8192, 1..20), 1..3)
            .prop_map(|ids| json!({ "prompt": ids })),
        prop::collection::vec(message, 1..4).prop_map(|m| json!({ "messages": m })),
    ];
    let pair = |name: &'static str, s: BoxedStrategy<Value>| s.prop_map(move |v| (name, v)).boxed();
    let field = Union::new(vec![
        pair("max_tokens", (1i64..3000).prop_map(Value::from).boxed()),
        pair(
            "max_completion_tokens",
            (1i64..3000).prop_map(Value::from).boxed(),
        ),
        pair("min_tokens", (0i64..40).prop_map(Value::from).boxed()),
        pair("n", (1i64..5).prop_map(Value::from).boxed()),
        pair("temperature", (0.0f64..2.5).prop_map(Value::from).boxed()),
        pair("top_p", (0.0f64..1.1).prop_map(Value::from).boxed()),
        pair("top_k", (-1i64..60).prop_map(Value::from).boxed()),
        pair("min_p", (0.0f64..1.0).prop_map(Value::from).boxed()),
        pair("seed", any::<i64>().prop_map(Value::from).boxed()),
        pair(
            "stop",
            prop::collection::vec("[a-z\n]{1,3}", 0..4)
                .prop_map(|v| json!(v))
                .boxed(),
        ),
        pair(
            "stop_token_ids",
            prop::collection::vec(0u32..8192, 0..4)
                .prop_map(|v| json!(v))
                .boxed(),
        ),
        pair(
            "logprobs",
            prop_oneof![
                (0i64..24).prop_map(Value::from),
                any::<bool>().prop_map(Value::from)
            ]
            .boxed(),
        ),
        pair("top_logprobs", (0i64..24).prop_map(Value::from).boxed()),
        pair(
            "presence_penalty",
            (-2.5f64..2.5).prop_map(Value::from).boxed(),
        ),
        pair(
            "frequency_penalty",
            (-2.5f64..2.5).prop_map(Value::from).boxed(),
        ),
        pair(
            "repetition_penalty",
            (0.0f64..2.0).prop_map(Value::from).boxed(),
        ),
        pair(
            "logit_bias",
            prop::collection::vec((0u32..8192, -120.0f64..120.0), 0..4)
                .prop_map(|kv| {
                    Value::Object(
                        kv.into_iter()
                            .map(|(k, v)| (k.to_string(), v.into()))
                            .collect(),
                    )
                })
                .boxed(),
        ),
        pair("ignore_eos", any::<bool>().prop_map(Value::from).boxed()),
        pair("stream", any::<bool>().prop_map(Value::from).boxed()),
        pair(
            "skip_special_tokens",
            any::<bool>().prop_map(Value::from).boxed(),
        ),
        pair(
            "add_special_tokens",
            any::<bool>().prop_map(Value::from).boxed(),
        ),
        pair("model", Just(json!(MODEL)).boxed()),
    ]);
    (base, prop::collection::vec(field, 0..6)).prop_map(|(mut base, fields)| {
        let obj = base.as_object_mut().expect("an object");
        for (k, v) in fields {
            obj.insert(k.to_string(), v);
        }
        base
    })
}

/// Requests that pass, to damage byte by byte.
const VALID: &[&str] = &[
    r#"{"model": "harrier-cpu", "prompt": "def main():", "max_tokens": 8, "temperature": 0.5, "stop": ["\n"], "logprobs": 2}"#,
    r#"{"prompt": [[1, 2, 3], [4, 5]], "n": 2, "seed": 7, "logit_bias": {"17": -100}, "stream": true, "stream_options": {"include_usage": true}}"#,
    r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_completion_tokens": 5, "logprobs": true, "top_logprobs": 3}"#,
    r#"{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}, {"role": "tool", "content": "{\"r\": [1]}"}], "tools": [{"type": "function", "function": {"name": "f"}}]}"#,
    r#"{"tokens": [0, 9, 100, 8191]}"#,
];

/// One edit of a valid body's bytes.
fn byte_edits() -> impl Strategy<Value = Vec<(usize, usize, Vec<u8>)>> {
    // (position, bytes to remove, bytes to insert)
    prop::collection::vec(
        (
            any::<usize>(),
            0usize..4,
            prop_oneof![
                prop::collection::vec(any::<u8>(), 0..3),
                prop::sample::select(vec![
                    b"\"".to_vec(),
                    b"{".to_vec(),
                    b"]".to_vec(),
                    b"-1".to_vec(),
                    b"1e999".to_vec(),
                    b"null".to_vec(),
                    b"\\u0000".to_vec(),
                    b"\\ud800".to_vec(),
                ]),
            ],
        ),
        1..5,
    )
}

fn damaged(base: &str, edits: &[(usize, usize, Vec<u8>)]) -> Vec<u8> {
    let mut b = base.as_bytes().to_vec();
    for (pos, remove, insert) in edits {
        let i = pos % (b.len() + 1);
        let end = (i + remove).min(b.len());
        b.splice(i..end, insert.iter().copied());
    }
    b
}

fn engine_info() -> impl Strategy<Value = EngineInfo> {
    (
        prop::sample::select(vec![2048u32, 24]),
        prop::sample::select(vec![8192u32, 8320]),
    )
        .prop_map(|(len, vocab)| info(len, vocab))
}

proptest! {
    #![proptest_config(fuzz::config(2048))]

    /// Requests assembled from the known fields.
    #[test]
    fn fuzz_requests_structured(req in request(), info in engine_info()) {
        check_body(req.to_string().as_bytes(), &info)?;
    }

    /// Requests with values mostly in range.
    #[test]
    fn fuzz_requests_plausible(req in plausible_request(), info in engine_info()) {
        check_body(req.to_string().as_bytes(), &info)?;
    }

    /// Valid requests with damaged bytes.
    #[test]
    fn fuzz_requests_damaged(which in 0..VALID.len(), edits in byte_edits(), info in engine_info()) {
        check_body(&damaged(VALID[which], &edits), &info)?;
    }

    /// Arbitrary JSON values and arbitrary bytes.
    #[test]
    fn fuzz_requests_arbitrary(
        body in prop_oneof![
            any_json().prop_map(|v| v.to_string().into_bytes()),
            deep_json().prop_map(|v| v.to_string().into_bytes()),
            prop::collection::vec(any::<u8>(), 0..256),
        ],
        info in engine_info(),
    ) {
        check_body(&body, &info)?;
    }
}

/// The valid bodies are valid: the damaged ones start from requests that pass.
#[test]
fn fuzz_requests_valid_bodies_pass() {
    let info = info(2048, 8192);
    for body in &VALID[..4] {
        let completion = completions(body.as_bytes(), &info);
        let chat = chat(body.as_bytes(), &info);
        assert!(
            completion.is_ok() || chat.is_ok(),
            "{body}: {completion:?} {chat:?}"
        );
    }
    assert!(detokenize(VALID[4].as_bytes(), &info).is_ok());
}
