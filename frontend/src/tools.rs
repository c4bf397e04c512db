//! Tool calling on chat completions: OpenAI's `tools`, `tool_choice` and
//! `parallel_tool_calls`, vLLM's `--tool-call-parser` and `--enable-auto-tool-choice`.
//!
//! - The tools reach the chat template (`tools`), which renders them the model's way; with
//!   `tool_choice: "none"` they are left out and the reply is plain text.
//! - `"auto"` (the default when tools are given) needs `--enable-auto-tool-choice` and a
//!   parser, as in vLLM: the model decides, and the parser finds tool calls in its text.
//! - `"required"` and a named function are enforced with a grammar in the parser's format
//!   (a structured-output constraint built here), so those replies always parse; with
//!   `parallel_tool_calls: false` exactly one call.
//! - Parsers: `hermes` (Qwen3 and Hermes: `<tool_call>{"name": ..., "arguments": {...}}
//!   </tool_call>` blocks, text before them is content) and `llama3_json` (Llama 3.1/3.2: the
//!   whole reply is `{"name": ..., "parameters": {...}}`, several joined by `;`, optionally
//!   after `<|python_tag|>`).
//! - Streaming ([`ToolStream`]): text that cannot be a tool call streams as content at once;
//!   from where a call may begin the text is held back, and at the end it goes out either as
//!   OpenAI tool-call deltas (one per call, with its id, name and complete arguments) with
//!   finish_reason "tool_calls", or as content if it did not parse.

use harrier_shared::protocol::StructuredOutput;
use serde_json::{json, Value};

use crate::error::ApiError;

/// `--tool-call-parser`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ToolCallParser {
    /// Llama 3.1/3.2 JSON calls (`{"name": ..., "parameters": ...}`).
    #[value(name = "llama3_json")]
    Llama3Json,
    /// Hermes / Qwen3 `<tool_call>` blocks.
    #[value(name = "hermes")]
    Hermes,
}

/// The server's tool-calling options.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ToolConfig {
    pub parser: Option<ToolCallParser>,
    pub enable_auto: bool,
}

/// How a request uses its tools.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolMode {
    /// No tools, or `tool_choice: "none"`: plain text.
    Off,
    /// The model may call tools; the parser looks for calls.
    Auto(ToolCallParser),
    /// At least one call (exactly one without parallel calls), enforced by a grammar.
    Required(ToolCallParser),
}

impl ToolMode {
    pub fn parser(&self) -> Option<ToolCallParser> {
        match self {
            ToolMode::Off => None,
            ToolMode::Auto(p) | ToolMode::Required(p) => Some(*p),
        }
    }
}

/// One parsed call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as JSON text (OpenAI sends a string).
    pub arguments: String,
}

/// A checked `tools` entry.
struct Function {
    name: String,
    parameters: Value,
}

fn functions(tools: &[Value]) -> Result<Vec<Function>, ApiError> {
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let p = "tools";
            let bad = |m: &str| ApiError::invalid(p, format!("tools[{i}]: {m}"));
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad("`type` must be \"function\"."));
            }
            let f = t
                .get("function")
                .filter(|f| f.is_object())
                .ok_or_else(|| bad("`function` must be an object."))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .ok_or_else(|| bad("`function.name` must be a non-empty string."))?;
            let parameters = match f.get("parameters") {
                None | Some(Value::Null) => json!({"type": "object"}),
                Some(v @ Value::Object(_)) => v.clone(),
                Some(_) => return Err(bad("`function.parameters` must be a JSON schema object.")),
            };
            Ok(Function {
                name: name.to_owned(),
                parameters,
            })
        })
        .collect()
}

/// Checks `tools` / `tool_choice` / `parallel_tool_calls` against the server's options.
/// Returns the mode, whether the tools go to the template, and for `"required"` or a named
/// function the constraint that enforces the call.
pub fn plan(
    tools: Option<&[Value]>,
    tool_choice: Option<&Value>,
    parallel: Option<bool>,
    cfg: ToolConfig,
) -> Result<(ToolMode, bool, Option<StructuredOutput>), ApiError> {
    let tools = tools.unwrap_or_default();
    let fns = functions(tools)?;
    let p = "tool_choice";
    let choice = match tool_choice {
        None if fns.is_empty() => "none",
        None => "auto",
        Some(Value::String(s)) => s.as_str(),
        Some(v @ Value::Object(_)) => {
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    ApiError::invalid(
                        p,
                        "`tool_choice` must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                    )
                })?;
            let f = fns.iter().find(|f| f.name == name).ok_or_else(|| {
                ApiError::invalid(
                    p,
                    format!("`tool_choice` names `{name}`, which is not in `tools`."),
                )
            })?;
            let parser = need_parser(cfg)?;
            let grammar = call_grammar(parser, std::slice::from_ref(f), false);
            return Ok((ToolMode::Required(parser), true, Some(grammar)));
        }
        Some(_) => {
            return Err(ApiError::invalid(
                p,
                "`tool_choice` must be a string or an object.",
            ))
        }
    };
    match choice {
        "none" => Ok((ToolMode::Off, false, None)),
        "auto" if fns.is_empty() => Ok((ToolMode::Off, false, None)),
        "auto" => {
            if !cfg.enable_auto || cfg.parser.is_none() {
                return Err(ApiError::invalid(
                    p,
                    "\"auto\" tool choice requires the server to run with --enable-auto-tool-choice and --tool-call-parser.",
                ));
            }
            Ok((ToolMode::Auto(cfg.parser.expect("checked")), true, None))
        }
        "required" => {
            if fns.is_empty() {
                return Err(ApiError::invalid(
                    p,
                    "`tool_choice` \"required\" needs `tools`.",
                ));
            }
            let parser = need_parser(cfg)?;
            let grammar = call_grammar(parser, &fns, parallel.unwrap_or(true));
            Ok((ToolMode::Required(parser), true, Some(grammar)))
        }
        other => Err(ApiError::invalid(
            p,
            format!("`tool_choice` must be \"none\", \"auto\" or \"required\", got \"{other}\"."),
        )),
    }
}

fn need_parser(cfg: ToolConfig) -> Result<ToolCallParser, ApiError> {
    cfg.parser.ok_or_else(|| {
        ApiError::invalid(
            "tool_choice",
            "forced tool calls need the server to run with --tool-call-parser.",
        )
    })
}

/// A grammar (llguidance Lark) whose sentences are tool calls to `fns` in the parser's
/// format: one call, or one or more when `many`.
fn call_grammar(parser: ToolCallParser, fns: &[Function], many: bool) -> StructuredOutput {
    let args_key = match parser {
        ToolCallParser::Hermes => "arguments",
        ToolCallParser::Llama3Json => "parameters",
    };
    let alternatives: Vec<Value> = fns
        .iter()
        .map(|f| {
            json!({"type": "object",
                "properties": {"name": {"const": f.name}, args_key: f.parameters},
                "required": ["name", args_key], "additionalProperties": false})
        })
        .collect();
    let mut schema = if alternatives.len() == 1 {
        alternatives.into_iter().next().expect("one")
    } else {
        json!({"anyOf": alternatives})
    };
    schema["x-guidance"] =
        json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
    let (call, sep) = match parser {
        ToolCallParser::Hermes => (
            format!("\"<tool_call>\\n\" %json {schema} \"\\n</tool_call>\""),
            "\"\\n\"",
        ),
        ToolCallParser::Llama3Json => (format!("%json {schema}"), "\"; \""),
    };
    let start = if many {
        format!("start: call ({sep} call)*")
    } else {
        "start: call".to_string()
    };
    StructuredOutput::Grammar(format!("{start}\ncall: {call}\n"))
}

fn call_id() -> String {
    crate::engine::new_request_id("call")
}

/// The tool calls in a complete reply, and the content left (`None` when the reply is not
/// tool calls in the parser's format).
pub fn parse(parser: ToolCallParser, text: &str) -> Option<(String, Vec<ToolCall>)> {
    match parser {
        ToolCallParser::Hermes => parse_hermes(text),
        ToolCallParser::Llama3Json => parse_llama3(text),
    }
}

fn call_from(v: &Value, args_keys: &[&str]) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_owned();
    let args = args_keys
        .iter()
        .find_map(|k| v.get(*k))
        .cloned()
        .unwrap_or_else(|| json!({}));
    let arguments = match args {
        Value::String(s) => s,
        other => other.to_string(),
    };
    Some(ToolCall {
        id: call_id(),
        name,
        arguments,
    })
}

fn parse_hermes(text: &str) -> Option<(String, Vec<ToolCall>)> {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let first = text.find(OPEN)?;
    let content = text[..first].trim().to_owned();
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(at) = rest.find(OPEN) {
        let body = &rest[at + OPEN.len()..];
        let (inner, after) = match body.find(CLOSE) {
            Some(end) => (&body[..end], &body[end + CLOSE.len()..]),
            None => (body, ""),
        };
        let v: Value = serde_json::from_str(inner.trim()).ok()?;
        calls.push(call_from(&v, &["arguments", "parameters"])?);
        rest = after;
    }
    (!calls.is_empty()).then_some((content, calls))
}

fn parse_llama3(text: &str) -> Option<(String, Vec<ToolCall>)> {
    let body = text.trim_start();
    let body = body.strip_prefix("<|python_tag|>").unwrap_or(body).trim();
    if !body.starts_with('{') {
        return None;
    }
    let mut calls = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let mut it = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let v = it.next()?.ok()?;
        calls.push(call_from(&v, &["parameters", "arguments"])?);
        rest = rest[it.byte_offset()..].trim_start();
        rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
    }
    (!calls.is_empty()).then_some((String::new(), calls))
}

/// Per-choice streaming state: what may be sent as content now, and what is held back
/// because it may be (part of) a tool call.
#[derive(Debug)]
pub struct ToolStream {
    mode: ToolMode,
    held: String,
    /// The held text is (the start of) tool calls, not content.
    in_call: bool,
}

impl ToolStream {
    pub fn new(mode: ToolMode) -> Self {
        let in_call = matches!(mode, ToolMode::Required(_));
        Self {
            mode,
            held: String::new(),
            in_call,
        }
    }

    /// Takes new text; returns the part that can be sent as content now.
    pub fn push(&mut self, text: &str) -> String {
        let parser = match &self.mode {
            ToolMode::Off => return text.to_owned(),
            ToolMode::Required(_) => {
                self.held.push_str(text);
                return String::new();
            }
            ToolMode::Auto(p) => *p,
        };
        self.held.push_str(text);
        if self.in_call {
            return String::new();
        }
        match parser {
            ToolCallParser::Hermes => {
                const OPEN: &str = "<tool_call>";
                if let Some(at) = self.held.find(OPEN) {
                    self.in_call = true;
                    let out = self.held[..at].to_owned();
                    self.held.drain(..at);
                    return out;
                }
                // Keep back a tail that may be the start of the tag.
                let keep = (1..OPEN.len())
                    .rev()
                    .find(|&n| self.held.ends_with(&OPEN[..n]))
                    .unwrap_or(0);
                let cut = self.held.len() - keep;
                let out = self.held[..cut].to_owned();
                self.held.drain(..cut);
                out
            }
            ToolCallParser::Llama3Json => {
                let t = self.held.trim_start();
                if t.is_empty() || "<|python_tag|>".starts_with(t) {
                    return String::new();
                }
                if t.starts_with('{') || t.starts_with("<|python_tag|>") {
                    self.in_call = true;
                    return String::new();
                }
                std::mem::take(&mut self.held)
            }
        }
    }

    /// At the end of the choice: the content still to send and the parsed calls (empty when
    /// the held text was not tool calls: it is then content).
    pub fn finish(&mut self) -> (String, Vec<ToolCall>) {
        let held = std::mem::take(&mut self.held);
        if let (true, Some(parser)) = (self.in_call, self.mode.parser()) {
            if let Some((content, calls)) = parse(parser, &held) {
                return (content, calls);
            }
        }
        (held, Vec::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "get_weather", "description": "d",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]}}}),
            json!({"type": "function", "function": {"name": "add"}}),
        ]
    }

    const AUTO: ToolConfig = ToolConfig {
        parser: Some(ToolCallParser::Hermes),
        enable_auto: true,
    };

    #[test]
    fn plans_follow_tool_choice() {
        let t = tools();
        let (m, templ, g) = plan(Some(&t), None, None, AUTO).unwrap();
        assert_eq!(
            (m, templ, g),
            (ToolMode::Auto(ToolCallParser::Hermes), true, None)
        );
        let (m, templ, _) = plan(Some(&t), Some(&json!("none")), None, AUTO).unwrap();
        assert_eq!((m, templ), (ToolMode::Off, false));
        let (m, _, g) = plan(Some(&t), Some(&json!("required")), Some(false), AUTO).unwrap();
        assert_eq!(m, ToolMode::Required(ToolCallParser::Hermes));
        let Some(StructuredOutput::Grammar(g)) = g else {
            panic!()
        };
        assert!(
            g.starts_with("start: call\n") && g.contains("get_weather") && g.contains("add"),
            "{g}"
        );
        let named = json!({"type": "function", "function": {"name": "add"}});
        let (_, _, g) = plan(Some(&t), Some(&named), None, AUTO).unwrap();
        let Some(StructuredOutput::Grammar(g)) = g else {
            panic!()
        };
        assert!(!g.contains("get_weather"), "{g}");
        assert_eq!(
            plan(None, None, None, ToolConfig::default()).unwrap().0,
            ToolMode::Off
        );
        for (tools, choice, cfg, needle) in [
            (
                Some(t.clone()),
                None,
                ToolConfig::default(),
                "--enable-auto-tool-choice",
            ),
            (
                Some(t.clone()),
                Some(json!("required")),
                ToolConfig::default(),
                "--tool-call-parser",
            ),
            (
                Some(t.clone()),
                Some(json!({"type": "function", "function": {"name": "nope"}})),
                AUTO,
                "not in `tools`",
            ),
            (Some(t.clone()), Some(json!("sometimes")), AUTO, "sometimes"),
            (None, Some(json!("required")), AUTO, "needs `tools`"),
            (
                Some(vec![json!({"type": "function", "function": {}})]),
                None,
                AUTO,
                "function.name",
            ),
        ] {
            let e = plan(tools.as_deref(), choice.as_ref(), None, cfg).unwrap_err();
            assert!(e.message.contains(needle), "{needle}: {e:?}");
        }
    }

    #[test]
    fn parses_hermes_and_llama3_calls() {
        let (c, calls) = parse(
            ToolCallParser::Hermes,
            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>",
        )
        .unwrap();
        assert_eq!(c, "Let me check.");
        assert_eq!(calls.len(), 2);
        assert_eq!(
            (calls[0].name.as_str(), calls[0].arguments.as_str()),
            ("get_weather", r#"{"city":"Oslo"}"#)
        );
        assert_ne!(calls[0].id, calls[1].id);
        assert!(parse(ToolCallParser::Hermes, "no calls here").is_none());
        assert!(parse(ToolCallParser::Hermes, "<tool_call>{not json</tool_call>").is_none());
        let (c, calls) = parse(
            ToolCallParser::Llama3Json,
            "<|python_tag|>{\"name\": \"add\", \"parameters\": {\"a\": 1}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}",
        )
        .unwrap();
        assert_eq!((c.as_str(), calls.len()), ("", 2));
        assert_eq!(calls[0].arguments, r#"{"a":1}"#);
        assert!(parse(ToolCallParser::Llama3Json, "Hello {\"name\": \"add\"}").is_none());
        assert!(parse(ToolCallParser::Llama3Json, "{\"name\": \"add\"} trailing").is_none());
    }

    #[test]
    fn streams_content_and_holds_back_calls() {
        let mut s = ToolStream::new(ToolMode::Auto(ToolCallParser::Hermes));
        let mut sent = String::new();
        for piece in [
            "Sure",
            ", one moment.",
            "\n<tool",
            "_call>\n{\"name\": \"add\", ",
            "\"arguments\": {}}\n</tool_call>",
        ] {
            sent.push_str(&s.push(piece));
        }
        assert_eq!(sent, "Sure, one moment.\n");
        let (rest, calls) = s.finish();
        assert_eq!((rest.as_str(), calls.len()), ("", 1));
        // A '<' that is not a tag is released once it cannot be one.
        let mut s = ToolStream::new(ToolMode::Auto(ToolCallParser::Hermes));
        assert_eq!(s.push("a <to"), "a ");
        assert_eq!(s.push("p> b"), "<top> b");
        assert_eq!(s.finish(), (String::new(), vec![]));
        // llama3_json: a reply that starts like JSON is held; plain text streams.
        let mut s = ToolStream::new(ToolMode::Auto(ToolCallParser::Llama3Json));
        assert_eq!(s.push("  "), "");
        assert_eq!(s.push("{\"name\": \"add\", \"parameters\": {}}"), "");
        assert_eq!(s.finish().1.len(), 1);
        let mut s = ToolStream::new(ToolMode::Auto(ToolCallParser::Llama3Json));
        assert_eq!(s.push("Hi"), "Hi");
        // A held reply that does not parse goes out as content at the end.
        let mut s = ToolStream::new(ToolMode::Auto(ToolCallParser::Llama3Json));
        assert_eq!(s.push("{oops"), "");
        assert_eq!(s.finish(), ("{oops".to_string(), vec![]));
    }
}
