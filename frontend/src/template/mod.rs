//! Chat templates: Hugging Face's Jinja templates rendered with minijinja the way
//! `transformers`' `apply_chat_template` renders them with Python's jinja2.
//!
//! Environment, as in transformers: `trim_blocks`, `lstrip_blocks`, loop controls, Python
//! string/dict methods (minijinja-contrib's pycompat callback), `raise_exception`,
//! `strftime_now`, and a `tojson` filter with `json.dumps` semantics (Python's separators,
//! `ensure_ascii=False`, `indent`, `sort_keys`). Context: `messages`, `tools` (none when not
//! given), `add_generation_prompt`, the special tokens (`bos_token`, `eos_token`, ...) and any
//! `chat_template_kwargs`. Fixture tests compare the output with jinja2's
//! (`scripts/gen_chat_template_fixtures.py`).

use std::path::Path;

use anyhow::{bail, Context};
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};

use crate::error::ApiError;

/// A compiled chat template and the special tokens it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    special_tokens: Vec<(String, String)>,
}

/// What `apply_chat_template` is asked to render.
pub struct ChatInput<'a> {
    pub messages: &'a [Value],
    pub tools: Option<&'a [Value]>,
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    pub extra: Option<&'a serde_json::Map<String, serde_json::Value>>,
}

impl ChatTemplate {
    /// Compiles `source`; `special_tokens` are (name, text) pairs such as ("bos_token", "<s>").
    pub fn new(source: &str, special_tokens: Vec<(String, String)>) -> anyhow::Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source.to_owned())
            .context("compiling the chat template")?;
        Ok(Self {
            env,
            special_tokens,
        })
    }

    /// Loads the template of a Hugging Face model directory: `chat_template.jinja`,
    /// `chat_template.json`, or `chat_template` in `tokenizer_config.json` (a string or a list
    /// of named templates, `default` preferred). `None` when the model has none.
    pub fn from_model_dir(
        dir: &Path,
        override_path: Option<&Path>,
    ) -> anyhow::Result<Option<Self>> {
        let config: serde_json::Value =
            match std::fs::read_to_string(dir.join("tokenizer_config.json")) {
                Ok(s) => serde_json::from_str(&s).context("parsing tokenizer_config.json")?,
                Err(_) => serde_json::Value::Null,
            };
        let special_tokens = special_tokens(&config);
        let source = if let Some(p) = override_path {
            Some(read_override(p)?)
        } else if let Ok(s) = std::fs::read_to_string(dir.join("chat_template.jinja")) {
            Some(s)
        } else if let Ok(s) = std::fs::read_to_string(dir.join("chat_template.json")) {
            let v: serde_json::Value =
                serde_json::from_str(&s).context("parsing chat_template.json")?;
            template_field(&v["chat_template"])?
        } else {
            template_field(&config["chat_template"])?
        };
        source.map(|s| Self::new(&s, special_tokens)).transpose()
    }

    /// Renders a conversation. Template errors (including `raise_exception`) are 400s.
    pub fn render(&self, input: &ChatInput<'_>) -> Result<String, ApiError> {
        let ChatInput {
            messages,
            tools,
            add_generation_prompt,
            continue_final_message,
            extra,
        } = input;
        let messages = normalize_messages(messages)?;
        if *continue_final_message && *add_generation_prompt {
            return Err(ApiError::bad_request(
                "`continue_final_message` and `add_generation_prompt` cannot both be true.",
            ));
        }
        let mut ctx: Vec<(String, Value)> = Vec::new();
        if let Some(extra) = extra {
            for (k, v) in extra.iter() {
                ctx.push((k.clone(), Value::from_serialize(v)));
            }
        }
        for (k, v) in &self.special_tokens {
            ctx.push((k.clone(), Value::from(v.clone())));
        }
        ctx.push(("messages".into(), Value::from(messages.clone())));
        ctx.push((
            "tools".into(),
            tools
                .map(|t| Value::from(t.to_vec()))
                .unwrap_or(Value::from(())),
        ));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(*add_generation_prompt),
        ));
        let ctx = Value::from_iter(ctx);
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| ApiError::internal(format!("chat template: {e}")))?;
        let mut text = tmpl.render(ctx).map_err(|e| {
            ApiError::bad_request(format!(
                "Cannot render the chat template: {}",
                error_chain(&e)
            ))
        })?;
        if *continue_final_message {
            // As transformers does: cut the rendering after the final message's content.
            let last = messages
                .last()
                .and_then(|m| m.get_attr("content").ok())
                .and_then(|c| c.as_str().map(str::to_owned));
            if let Some(last) = last.filter(|l| !l.trim().is_empty()) {
                let needle = last.trim_end();
                if let Some(pos) = text.rfind(needle) {
                    text.truncate(pos + needle.len());
                }
            }
        }
        Ok(text)
    }
}

fn error_chain(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// `--chat-template`: a Jinja file, or the name of a built-in template (`llama3.1`, `gemma3`)
/// when no file has that name.
fn read_override(p: &Path) -> anyhow::Result<String> {
    match std::fs::read_to_string(p) {
        Ok(s) => Ok(s),
        Err(e) => {
            let name = p.to_string_lossy();
            if let Some(t) = harrier_engine::gen_model::builtin_chat_template(&name) {
                return Ok(t.to_string());
            }
            let names: Vec<&str> = harrier_engine::gen_model::BUILTIN_CHAT_TEMPLATES
                .iter()
                .map(|(n, _)| *n)
                .collect();
            Err(anyhow::anyhow!(
                "chat template {}: {e}, and no built-in template has that name (built-in: {})",
                p.display(),
                names.join(", ")
            ))
        }
    }
}

fn template_field(v: &serde_json::Value) -> anyhow::Result<Option<String>> {
    match v {
        serde_json::Value::Null => Ok(None),
        serde_json::Value::String(s) => Ok(Some(s.clone())),
        serde_json::Value::Array(list) => {
            let named = |name: &str| {
                list.iter()
                    .find(|t| t["name"] == name)
                    .and_then(|t| t["template"].as_str())
            };
            match named("default").or_else(|| list.first().and_then(|t| t["template"].as_str())) {
                Some(s) => Ok(Some(s.to_owned())),
                None => bail!("chat_template is an empty or malformed list"),
            }
        }
        other => bail!("chat_template must be a string or a list, got {other}"),
    }
}

/// `bos_token`, `eos_token`, ... from tokenizer_config.json (strings or AddedToken objects).
fn special_tokens(config: &serde_json::Value) -> Vec<(String, String)> {
    [
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "sep_token",
        "cls_token",
        "mask_token",
    ]
    .iter()
    .filter_map(|&name| {
        let v = &config[name];
        let text = v.as_str().or_else(|| v["content"].as_str())?;
        Some((name.to_owned(), text.to_owned()))
    })
    .collect()
}

/// Checks each message and flattens list content (`[{"type": "text", "text": ...}]`) into one
/// string joined by newlines, as vLLM does for templates that expect string content.
/// Other keys are kept as sent, in order.
pub fn normalize_messages(messages: &[Value]) -> Result<Vec<Value>, ApiError> {
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let param = format!("messages[{i}]");
            if m.kind() != ValueKind::Map {
                return Err(ApiError::invalid(
                    &param,
                    format!("{param} must be an object."),
                ));
            }
            let role = m
                .get_attr("role")
                .ok()
                .filter(|r| r.kind() == ValueKind::String);
            if role.is_none() {
                return Err(ApiError::invalid(
                    &param,
                    format!("{param}.role must be a string."),
                ));
            }
            let mut out: Vec<(Value, Value)> = Vec::new();
            for key in m
                .try_iter()
                .map_err(|e| ApiError::invalid(&param, e.to_string()))?
            {
                let val = m.get_item(&key).unwrap_or_default();
                if key.as_str() == Some("content") {
                    out.push((key, flatten_content(&val, &param)?));
                } else if key.as_str() == Some("tool_calls") {
                    out.push((key, tool_call_arguments_as_objects(val)));
                } else {
                    out.push((key, val));
                }
            }
            Ok(Value::from_iter(out))
        })
        .collect()
}

/// OpenAI sends a tool call's `function.arguments` as JSON text; chat templates (as
/// transformers renders them) expect the object. Text that is not a JSON object stays text.
fn tool_call_arguments_as_objects(calls: Value) -> Value {
    let Ok(mut json) = serde_json::to_value(&calls) else {
        return calls;
    };
    let Some(list) = json.as_array_mut() else {
        return calls;
    };
    for call in list {
        if let Some(args) = call.pointer_mut("/function/arguments") {
            if let Some(obj) = args
                .as_str()
                .and_then(|s| serde_json::from_str::<serde_json::Value>(s).ok())
                .filter(serde_json::Value::is_object)
            {
                *args = obj;
            }
        }
    }
    Value::from_serialize(&json)
}

fn flatten_content(content: &Value, param: &str) -> Result<Value, ApiError> {
    match content.kind() {
        ValueKind::String | ValueKind::None | ValueKind::Undefined => Ok(content.clone()),
        ValueKind::Seq => {
            let mut parts = Vec::new();
            for part in content
                .try_iter()
                .map_err(|e| ApiError::invalid(param, e.to_string()))?
            {
                let kind = part.get_attr("type").ok();
                let text = part.get_attr("text").ok();
                match (kind.as_ref().and_then(|k| k.as_str()), text.as_ref().and_then(|t| t.as_str())) {
                    (Some("text"), Some(t)) => parts.push(t.to_owned()),
                    (Some(other), _) if other != "text" => {
                        return Err(ApiError::invalid(param, format!("{param}.content: content parts of type `{other}` are not supported.")))
                    }
                    _ => return Err(ApiError::invalid(param, format!("{param}.content: each part must be {{\"type\": \"text\", \"text\": string}}."))),
                }
            }
            Ok(Value::from(parts.join("\n")))
        }
        _ => Err(ApiError::invalid(
            param,
            format!("{param}.content must be a string or a list of text parts."),
        )),
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(format)`: the local time formatted by the C library's strftime, as Python's
/// `datetime.now().strftime(format)` does.
fn strftime_now(format: String) -> Result<String, Error> {
    let fmt = std::ffi::CString::new(format)
        .map_err(|_| Error::new(ErrorKind::InvalidOperation, "strftime_now: NUL in format"))?;
    // SAFETY: time(NULL) only returns the clock; localtime_r writes into our zeroed `tm`;
    // strftime writes at most buf.len() bytes into `buf` and returns how many it wrote;
    // `fmt` is a valid NUL-terminated C string that outlives the call.
    unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&now, &mut tm).is_null() {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "strftime_now: localtime failed",
            ));
        }
        let mut buf = vec![0u8; 256];
        let n = libc::strftime(buf.as_mut_ptr().cast(), buf.len(), fmt.as_ptr(), &tm);
        buf.truncate(n);
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }
}

/// `tojson` with Python's `json.dumps` output (transformers overrides jinja2's HTML-escaping
/// filter with `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
/// sort_keys=sort_keys)`).
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let _ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.max(0) as usize)),
            (None, Some(s)) => Some(s.to_owned()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an int or a string",
                ))
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let parts: Vec<String> = v
                .try_iter()?
                .filter_map(|p| p.as_str().map(str::to_owned))
                .collect();
            match parts.as_slice() {
                [a, b] => (a.clone(), b.clone()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ))
                }
            }
        }
        _ if indent.is_some() => (",".into(), ": ".into()),
        _ => (", ".into(), ": ".into()),
    };
    let fmt = PyJson {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    fmt.write(&value, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct PyJson {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl PyJson {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    }

    fn write(&self, v: &Value, level: usize, out: &mut String) -> Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::String => out.push_str(
                &serde_json::to_string(v.as_str().unwrap_or_default()).expect("string JSON"),
            ),
            ValueKind::Number => {
                if let Some(i) = v.as_i64() {
                    out.push_str(&i.to_string());
                } else {
                    let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                    out.push_str(&python_float(f));
                }
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    self.write(item, level + 1, out)?;
                }
                self.newline(level, out);
                out.push(']');
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                if self.sort_keys {
                    keys.sort_by_key(|k| k.to_string());
                }
                out.push('{');
                for (i, key) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    let key_text = match key.as_str() {
                        Some(s) => s.to_owned(),
                        None => key.to_string(),
                    };
                    out.push_str(&serde_json::to_string(&key_text).expect("string JSON"));
                    out.push_str(&self.key_sep);
                    self.write(&v.get_item(key)?, level + 1, out)?;
                }
                self.newline(level, out);
                out.push('}');
            }
            _ => out.push_str(&serde_json::to_string(&v.to_string()).expect("string JSON")),
        }
        Ok(())
    }
}

/// Python's `repr(float)` as json.dumps writes it: `1.0`, `0.5`, `1e+20`, `NaN`.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    let abs = f.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        // Python: shortest repr in exponent form, exponent with a sign and at least 2 digits.
        let s = format!("{f:e}");
        let (mant, exp) = s.split_once('e').expect("exponent form");
        let exp: i32 = exp.parse().expect("exponent");
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mant}e{sign}{:02}", exp.abs());
    }
    let s = format!("{f:?}");
    if s.contains('.') || s.contains('e') {
        s
    } else {
        format!("{s}.0")
    }
}

#[cfg(test)]
mod tests;
