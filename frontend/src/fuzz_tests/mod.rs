//! Fuzz harnesses of the front end's untrusted inputs (docs/fuzzing.md), on the embedded
//! default model's real tokenizer and Llama 3.1 chat template (`engine-core/models/harrier-cpu`):
//!
//! - [`requests`]: every endpoint's body, through the same stages the handlers run;
//! - [`template`]: hostile conversations rendered by the chat template;
//! - [`detok`]: the incremental detokenizer over arbitrary id sequences.
//!
//! This module holds what they share: the text model, and strategies for arbitrary and
//! hostile JSON (deep nesting, edge numbers, special-token text, long strings).

mod detok;
mod requests;
mod template;

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use harrier_shared::fuzz;
use proptest::prelude::*;
use serde_json::{json, Map, Value};

use crate::text::{TextModel, TextSource};

#[global_allocator]
static ALLOC: fuzz::TrackingAlloc = fuzz::TrackingAlloc;

/// The embedded default model's directory (tokenizer.json, tokenizer_config.json).
fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../engine-core/models/harrier-cpu")
}

/// The default model's tokenizer and chat template, loaded once per test binary.
fn text_model() -> Arc<TextModel> {
    static TEXT: OnceLock<Arc<TextModel>> = OnceLock::new();
    TEXT.get_or_init(|| {
        let src = TextSource {
            model_dir: model_dir(),
            tokenizer: None,
            chat_template: None,
        };
        let text = TextModel::load(&src, 1).expect("loading the harrier-cpu tokenizer");
        assert!(
            text.has_chat_template(),
            "harrier-cpu has the Llama 3.1 template"
        );
        Arc::new(text)
    })
    .clone()
}

/// Text a client might send to confuse a template or a tokenizer.
fn hostile_text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => ".{0,24}",
        2 => "\\PC{0,40}",
        1 => prop::sample::select(vec![
            "<|begin_of_text|>",
            "<|eot_id|>",
            "<|start_header_id|>system<|end_header_id|>",
            "<|python_tag|>",
            "{{ raise_exception('x') }}",
            "{% for x in range(99999999) %}{% endfor %}",
            "\u{0}",
            "\u{FFFD}",
            "\u{202E}",
            "  \n\t ",
            "🦅𠜎👩‍👩‍👧",
            "",
        ])
        .prop_map(String::from),
        // Long runs, some with no spaces (one pre-tokenizer word).
        1 => (prop::sample::select(vec!["a", "🦅", " ", "ab ", "\n"]), 1usize..4096)
            .prop_map(|(s, n)| s.repeat(n)),
    ]
}

/// Integers and floats at the edges of what the API converts them to.
fn edge_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        (-3i64..40).prop_map(Value::from),
        prop::sample::select(vec![
            json!(0),
            json!(-1),
            json!(i64::MIN),
            json!(i64::MAX),
            json!(u64::MAX),
            json!(u32::MAX),
            json!(u64::from(u32::MAX) + 1),
            json!(8191),
            json!(8192),
            json!(2047),
            json!(2048),
            json!(0.0),
            json!(-0.0),
            json!(1e-320),
            json!(1e300),
            json!(-1e300),
            json!(3.5e38),
            json!(0.5),
            json!(1.0000001),
            json!(100),
            json!(101),
        ]),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
            .prop_map(Value::from),
    ]
}

/// Arbitrary JSON, a few levels deep.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        edge_number(),
        hostile_text().prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::vec(("[a-z_]{1,10}|type|text|role|content|name", inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// A value nested `depth` lists or objects deep (serde_json parses at most 128 levels).
fn deep_json() -> impl Strategy<Value = Value> {
    (1usize..140, any::<bool>(), any_json()).prop_map(|(depth, objects, core)| {
        let mut v = core;
        for i in 0..depth {
            v = if objects && i % 2 == 0 {
                json!({ "k": v })
            } else {
                json!([v])
            };
        }
        v
    })
}

/// One chat message: roles, contents, names and tool fields, plausible and hostile.
fn message() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        6 => prop::sample::select(vec!["system", "user", "assistant", "tool", "ipython"])
            .prop_map(Value::from),
        1 => hostile_text().prop_map(Value::from),
        1 => any_json(),
    ];
    let part = prop_oneof![
        4 => hostile_text().prop_map(|t| json!({"type": "text", "text": t})),
        1 => Just(json!({"type": "image_url", "image_url": {"url": "data:,"}})),
        1 => any_json(),
    ];
    let content = prop_oneof![
        6 => hostile_text().prop_map(Value::from),
        2 => prop::collection::vec(part, 0..4).prop_map(Value::from),
        1 => Just(Value::Null),
        1 => any_json(),
        1 => deep_json(),
    ];
    let arguments = prop_oneof![
        2 => prop::collection::vec(("[a-z]{1,6}", hostile_text()), 0..3)
            .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k, Value::from(v))).collect())),
        1 => hostile_text().prop_map(Value::from),
        1 => any_json(),
        1 => deep_json(),
    ];
    let tool_call = (hostile_text(), arguments).prop_map(|(name, args)| {
        json!({"id": "call_0", "type": "function", "function": {"name": name, "arguments": args}})
    });
    let tool_calls = prop_oneof![
        3 => prop::collection::vec(tool_call, 0..3).prop_map(Value::from),
        1 => any_json(),
    ];
    (
        role,
        prop::option::weighted(0.9, content),
        prop::option::weighted(0.2, hostile_text()),
        prop::option::weighted(0.2, tool_calls),
        prop::option::weighted(0.1, hostile_text()),
        prop::option::weighted(0.1, ("[a-z_]{1,8}", any_json())),
    )
        .prop_map(|(role, content, name, tool_calls, call_id, extra)| {
            let mut m = Map::new();
            m.insert("role".into(), role);
            if let Some(c) = content {
                m.insert("content".into(), c);
            }
            if let Some(n) = name {
                m.insert("name".into(), n.into());
            }
            if let Some(t) = tool_calls {
                m.insert("tool_calls".into(), t);
            }
            if let Some(id) = call_id {
                m.insert("tool_call_id".into(), id.into());
            }
            if let Some((k, v)) = extra {
                m.insert(k, v);
            }
            Value::Object(m)
        })
}

/// A conversation: mostly lists of messages, sometimes anything.
fn messages() -> impl Strategy<Value = Value> {
    prop_oneof![
        8 => prop::collection::vec(message(), 0..6).prop_map(Value::from),
        1 => any_json(),
    ]
}

/// A tool definition as the OpenAI API sends them, or anything.
fn tools() -> impl Strategy<Value = Value> {
    let tool = prop_oneof![
        3 => (hostile_text(), hostile_text(), any_json()).prop_map(|(name, desc, params)| json!({
            "type": "function",
            "function": {"name": name, "description": desc, "parameters": params}
        })),
        1 => any_json(),
        1 => deep_json(),
    ];
    prop_oneof![
        4 => prop::collection::vec(tool, 0..3).prop_map(Value::from),
        1 => any_json(),
    ]
}

/// `chat_template_kwargs`, including the variables the Llama 3.1 template reads.
fn template_kwargs() -> impl Strategy<Value = Value> {
    let key = prop::sample::select(vec![
        "custom_tools",
        "builtin_tools",
        "tools_in_user_message",
        "date_string",
        "messages",
        "bos_token",
        "add_generation_prompt",
        "tools",
        "other",
    ]);
    let value = prop_oneof![
        1 => tools(),
        1 => prop::collection::vec(
            prop::sample::select(vec!["brave_search", "wolfram_alpha", "code_interpreter"]),
            0..3,
        )
        .prop_map(|v| json!(v)),
        1 => any::<bool>().prop_map(Value::from),
        1 => hostile_text().prop_map(Value::from),
        1 => any_json(),
    ];
    prop_oneof![
        4 => prop::collection::vec((key, value), 0..4)
            .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
        1 => any_json(),
    ]
}
