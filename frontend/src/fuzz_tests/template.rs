//! Hostile conversations through the real chat template (the embedded model's Llama 3.1
//! template): roles, contents, names, tool calls, tools and template variables, deeply nested
//! values, long strings. Parsed from JSON text as the API parses them, then rendered with
//! every combination of `add_generation_prompt` and `continue_final_message`: an `Ok` text
//! of bounded size that renders the same twice and tokenizes, or a 400; never a panic or hang.

use crate::api::request::{parse_json, ChatRequest};
use crate::template::ChatInput;

use super::*;

/// Replaces message `at`'s content (if it has messages) with `len` bytes of `unit`.
fn with_long_content(messages: &mut Value, at: usize, unit: &str, len: usize) {
    if let Some(list) = messages.as_array_mut() {
        let n = list.len();
        if let Some(Value::Object(m)) = list.get_mut(at % n.max(1)) {
            let text = unit.repeat(len / unit.len().max(1) + 1);
            m.insert("content".into(), Value::from(text));
        }
    }
}

proptest! {
    #![proptest_config(fuzz::config(2048))]

    #[test]
    fn fuzz_template_hostile_conversations(
        mut messages in messages(),
        tools in prop::option::weighted(0.3, tools()),
        kwargs in prop::option::weighted(0.3, template_kwargs()),
        add_generation_prompt in any::<bool>(),
        continue_final_message in prop::bool::weighted(0.2),
        long in prop::option::weighted(
            0.05,
            (any::<usize>(), prop::sample::select(vec!["a", "word ", "🦅", "<|eot_id|>"]), 1usize..(256 << 10)),
        ),
    ) {
        if let Some((at, unit, len)) = long {
            with_long_content(&mut messages, at, unit, len);
        }
        let body = json!({
            "messages": messages,
            "tools": tools,
            "chat_template_kwargs": kwargs,
        })
        .to_string();
        let _watch = fuzz::watch("template", &body);
        let req: ChatRequest = match parse_json(body.as_bytes()) {
            Ok(r) => r,
            // Not a request the API would render (e.g. `messages` is not a list).
            Err(e) => {
                prop_assert_eq!(e.status, hyper::StatusCode::BAD_REQUEST);
                return Ok(());
            }
        };
        let text = text_model();
        let input = ChatInput {
            messages: req.messages.as_deref().unwrap_or_default(),
            tools: req.tools.as_deref(),
            add_generation_prompt,
            continue_final_message,
            extra: req.chat_template_kwargs.as_ref(),
        };
        match text.render_chat(&input) {
            Ok(rendered) => {
                // tojson(indent=4) of a value 128 levels deep indents each line up to 512
                // columns: quadratic in the depth, which serde_json caps at 128.
                let bound = 64 * body.len() + (128 << 10);
                prop_assert!(
                    rendered.len() <= bound,
                    "a {}-byte request rendered {} bytes", body.len(), rendered.len()
                );
                let again = text.render_chat(&input);
                prop_assert_eq!(again.as_ref().ok(), Some(&rendered), "rendering is deterministic");
                prop_assert!(text.encode(&rendered, false).is_ok());
            }
            Err(e) => {
                prop_assert_eq!(e.status, hyper::StatusCode::BAD_REQUEST, "{:?}", e);
                prop_assert!(!e.message.is_empty());
            }
        }
    }
}

/// Values nested close to serde_json's limit (128) render, in tool-call arguments (`tojson`)
/// and in tools (`tojson(indent=4)`): the recursion stays within the stack. Deeper bodies are
/// a 400 from the parser.
#[test]
fn fuzz_template_deepest_values() {
    let text = text_model();
    for depth in [100usize, 118, 119, 200, 5000] {
        // Written as text: building (or dropping) a 5,000-deep `serde_json::Value` would
        // itself overflow the test's stack.
        let v = format!("{}\"x\"{}", "[".repeat(depth), "]".repeat(depth));
        // The body adds 7 levels around `v` in the tool call, 5 in the tools.
        let body = format!(
            r#"{{"messages": [{{"role": "user", "content": "hi"}}, {{"role": "assistant", "tool_calls": [{{"function": {{"name": "f", "arguments": {{"a": {v}}}}}}}]}}], "tools": [{{"type": "function", "function": {{"name": "f", "parameters": {v}}}}}]}}"#
        );
        match parse_json::<ChatRequest>(body.as_bytes()) {
            Ok(req) => {
                let input = ChatInput {
                    messages: req.messages.as_deref().unwrap(),
                    tools: req.tools.as_deref(),
                    add_generation_prompt: true,
                    continue_final_message: false,
                    extra: None,
                };
                let rendered = text.render_chat(&input).expect("renders");
                assert!(rendered.matches("\"x\"").count() == 2, "depth {depth}");
                assert!(depth <= 120, "depth {depth} parsed");
            }
            Err(e) => {
                assert!(depth > 118, "depth {depth}: {e:?}");
                assert_eq!(e.status, hyper::StatusCode::BAD_REQUEST);
                assert!(e.message.contains("recursion limit"), "{e:?}");
            }
        }
    }
}
