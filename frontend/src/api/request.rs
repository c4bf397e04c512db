//! OpenAI (and vLLM-extension) request bodies, and their validation into engine parameters.
//!
//! Parsing is two-stage: serde (with `serde_path_to_error`, so a type error names its field)
//! into loosely typed structs (numbers as i64/f64 so that "-1" is a range error with a clear
//! message, not a type error), then [`SamplingFields::validate`] into the engine's
//! [`SamplingParams`] plus the front end's [`OutputParams`]. Unknown fields are ignored, as
//! OpenAI and vLLM do; known-but-unsupported ones are rejected rather than silently ignored.

use harrier_shared::protocol::{SamplingParams, StructuredOutput, TokenId};
use serde::Deserialize;

use crate::error::ApiError;

/// `stop`: a string or a list of strings.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

/// `prompt`: text, a batch of texts, token ids, or a batch of token-id lists.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<i64>),
    IdLists(Vec<Vec<i64>>),
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// Sampling and output fields shared by completions and chat completions.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default)]
pub struct SamplingFields {
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<StopField>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<i64>,
    pub n: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub skip_special_tokens: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub user: Option<String>,
    /// vLLM's `cache_salt`: only requests with the same salt share prefix-cache blocks.
    pub cache_salt: Option<String>,
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    pub best_of: Option<i64>,
    /// OpenAI's `response_format`: `{"type": "text" | "json_object" | "json_schema", ...}`.
    pub response_format: Option<serde_json::Value>,
    /// vLLM's `structured_outputs`: one of `json` (a schema), `regex`, `choice`, `grammar`
    /// (Lark), `json_object`.
    pub structured_outputs: Option<serde_json::Value>,
    /// vLLM's older spellings of the same (`guided_json`, ...).
    pub guided_json: Option<serde_json::Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Option<PromptField>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Completions: the number of top alternatives per token (0..=max_logprobs).
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub add_special_tokens: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ChatRequest {
    pub model: Option<String>,
    /// Kept as template values (key order preserved for `tojson`); checked by
    /// [`crate::template::normalize_messages`].
    pub messages: Option<Vec<minijinja::Value>>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub tools: Option<Vec<minijinja::Value>>,
    pub tool_choice: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    pub add_special_tokens: Option<bool>,
}

/// `/tokenize`: a prompt or chat messages.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<minijinja::Value>>,
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Option<Vec<i64>>,
}

/// Parses a JSON body, naming the offending field in type errors.
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::bad_request(format!("The request body is not valid UTF-8: {e}")))?;
    if text.trim().is_empty() {
        return Err(ApiError::bad_request(
            "The request body is empty; expected a JSON object.",
        ));
    }
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| ApiError::bad_request(format!("The request body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request(
            "The request body must be a JSON object.",
        ));
    }
    let mut de = serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let mut path = e.path().to_string();
        let mut inner = e.into_inner().to_string();
        if path == "." || path.is_empty() {
            // Errors inside `#[serde(flatten)]` fields lose their path: find it by parsing
            // the shared sampling fields alone.
            let mut de = serde_json::Deserializer::from_str(text);
            if let Err(e) = serde_path_to_error::deserialize::<_, SamplingFields>(&mut de) {
                path = e.path().to_string();
                inner = e.into_inner().to_string();
            }
        }
        if path == "." || path.is_empty() {
            ApiError::bad_request(format!("Invalid request: {inner}"))
        } else {
            ApiError::invalid(
                top_level(&path),
                format!("Invalid value for `{path}`: {inner}"),
            )
        }
    })
}

fn top_level(path: &str) -> &str {
    path.split(['.', '[']).next().unwrap_or(path)
}

/// How the front end shapes the text of each choice.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OutputParams {
    pub stops: Vec<String>,
    pub include_stop_str: bool,
    pub skip_special_tokens: bool,
    /// Whether logprobs were asked for (the engine returns `sampling.logprobs` alternatives).
    pub logprobs: bool,
}

/// A validated request, before tokenization fixes `max_tokens`.
#[derive(Debug, Clone, PartialEq)]
pub struct Validated {
    pub sampling: SamplingParams,
    /// The field the output constraint came from (errors name it), if any.
    pub structured_param: Option<&'static str>,
    /// Chat: how the reply uses tools (set by the handler from `tools` / `tool_choice`).
    pub tools: crate::tools::ToolMode,
    /// Chat: whether the tools go to the chat template.
    pub template_tools: bool,
    /// `None`: fill in from the context left after the prompt (chat) or 16 (completions).
    pub max_tokens: Option<u32>,
    pub output: OutputParams,
    pub n: u32,
    pub stream: bool,
    pub include_usage: bool,
    pub cache_salt: Option<String>,
}

/// Limits the validation needs from the engine and the front end's options.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_logprobs: u32,
    pub max_n: u32,
    pub vocab_size: u32,
}

fn to_u32(param: &str, v: i64, min: i64) -> Result<u32, ApiError> {
    if v < min {
        return Err(ApiError::invalid(
            param,
            format!("`{param}` must be at least {min}, got {v}."),
        ));
    }
    u32::try_from(v).map_err(|_| ApiError::invalid(param, format!("`{param}` is too large: {v}.")))
}

/// A JSON schema given as an object (or as its text) to the schema's text.
fn json_text(v: &serde_json::Value) -> Result<String, String> {
    match v {
        serde_json::Value::String(s) => Ok(s.clone()),
        serde_json::Value::Object(_) | serde_json::Value::Bool(_) => Ok(v.to_string()),
        _ => Err("a JSON schema must be an object (or its JSON text)".into()),
    }
}

/// The output constraint from `response_format`, `structured_outputs` or vLLM's `guided_*`
/// fields, with the field it came from; at most one of them may constrain.
fn parse_structured(
    response_format: Option<&serde_json::Value>,
    structured_outputs: Option<&serde_json::Value>,
    guided: [Option<(&'static str, Result<StructuredOutput, String>)>; 4],
) -> Result<Option<(&'static str, StructuredOutput)>, ApiError> {
    let mut found: Vec<(&'static str, Result<StructuredOutput, String>)> = Vec::new();
    if let Some(rf) = response_format {
        let p = "response_format";
        match rf.get("type").and_then(|t| t.as_str()) {
            Some("text") => {}
            Some("json_object") => found.push((p, Ok(StructuredOutput::JsonObject))),
            Some("json_schema") => {
                let schema = rf
                    .get("json_schema")
                    .and_then(|j| j.get("schema"))
                    .ok_or_else(|| {
                        ApiError::invalid(
                            p,
                            "`response_format` of type json_schema needs `json_schema.schema`.",
                        )
                    })?;
                found.push((p, json_text(schema).map(StructuredOutput::JsonSchema)));
            }
            _ => {
                return Err(ApiError::invalid(
                    p,
                    "`response_format.type` must be one of text, json_object, json_schema.",
                ))
            }
        }
    }
    if let Some(so) = structured_outputs {
        let p = "structured_outputs";
        let obj = so
            .as_object()
            .ok_or_else(|| ApiError::invalid(p, "`structured_outputs` must be an object."))?;
        for (k, v) in obj {
            let c = match (k.as_str(), v) {
                (_, serde_json::Value::Null) => continue,
                ("json", v) => json_text(v).map(StructuredOutput::JsonSchema),
                ("regex", serde_json::Value::String(r)) => Ok(StructuredOutput::Regex(r.clone())),
                ("grammar", serde_json::Value::String(g)) => {
                    Ok(StructuredOutput::Grammar(g.clone()))
                }
                ("choice", serde_json::Value::Array(a)) => a
                    .iter()
                    .map(|c| c.as_str().map(str::to_owned))
                    .collect::<Option<Vec<_>>>()
                    .map(StructuredOutput::Choice)
                    .ok_or_else(|| "`choice` must be a list of strings".to_string()),
                ("json_object", serde_json::Value::Bool(true)) => Ok(StructuredOutput::JsonObject),
                ("json_object", serde_json::Value::Bool(false)) => continue,
                ("regex" | "grammar" | "choice" | "json_object", _) => {
                    Err(format!("`structured_outputs.{k}` has the wrong type"))
                }
                // vLLM's options that do not constrain by themselves.
                ("disable_fallback" | "disable_any_whitespace" | "disable_additional_properties"
                | "whitespace_pattern", _) => continue,
                (other, _) => Err(format!(
                    "unknown `structured_outputs` field `{other}` (json, regex, choice, grammar, json_object)"
                )),
            };
            found.push((p, c));
        }
    }
    found.extend(guided.into_iter().flatten());
    match found.len() {
        0 => Ok(None),
        1 => {
            let (p, c) = found.pop().expect("one");
            c.map(|c| Some((p, c))).map_err(|e| ApiError::invalid(p, e))
        }
        _ => Err(ApiError::invalid(
            found[1].0,
            format!(
                "Only one output constraint is allowed; got {}.",
                found.iter().map(|f| f.0).collect::<Vec<_>>().join(", ")
            ),
        )),
    }
}

impl SamplingFields {
    /// Checks every field and builds the engine's parameters. `logprobs`: the number of top
    /// alternatives asked for, if any (already range-checked by the caller's field rules).
    pub fn validate(&self, logprobs: Option<i64>, limits: Limits) -> Result<Validated, ApiError> {
        let Self {
            max_tokens,
            temperature,
            top_p,
            top_k,
            min_p,
            seed,
            stop,
            stop_token_ids,
            ignore_eos,
            min_tokens,
            n,
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            skip_special_tokens,
            include_stop_str_in_output,
            stream,
            stream_options,
            user: _,
            cache_salt,
            logit_bias,
            best_of,
            response_format,
            structured_outputs,
            guided_json,
            guided_regex,
            guided_choice,
            guided_grammar,
        } = self;
        let structured = parse_structured(
            response_format.as_ref(),
            structured_outputs.as_ref(),
            [
                guided_json.as_ref().map(|v| {
                    (
                        "guided_json",
                        json_text(v).map(StructuredOutput::JsonSchema),
                    )
                }),
                guided_regex
                    .as_ref()
                    .map(|r| ("guided_regex", Ok(StructuredOutput::Regex(r.clone())))),
                guided_choice
                    .as_ref()
                    .map(|c| ("guided_choice", Ok(StructuredOutput::Choice(c.clone())))),
                guided_grammar
                    .as_ref()
                    .map(|g| ("guided_grammar", Ok(StructuredOutput::Grammar(g.clone())))),
            ],
        )?;
        let max_tokens = max_tokens.map(|v| to_u32("max_tokens", v, 1)).transpose()?;
        let n = to_u32("n", n.unwrap_or(1), 1)?;
        if n > limits.max_n {
            return Err(ApiError::invalid(
                "n",
                format!("`n` must be at most {}, got {n}.", limits.max_n),
            ));
        }
        if let Some(b) = best_of {
            if *b != i64::from(n) {
                return Err(ApiError::invalid(
                    "best_of",
                    "`best_of` is not supported (only best_of == n).",
                ));
            }
        }
        let logit_bias = parse_logit_bias(logit_bias.as_ref(), limits.vocab_size)?;
        let top_k = match top_k {
            None | Some(-1) => None,
            Some(k) if *k < -1 => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("`top_k` must be -1 (disabled) or at least 1, got {k}."),
                ))
            }
            Some(0) => {
                return Err(ApiError::invalid(
                    "top_k",
                    "`top_k` must be -1 (disabled) or at least 1, got 0.",
                ))
            }
            Some(k) => Some(to_u32("top_k", *k, 1)?),
        };
        let stop_token_ids = stop_token_ids
            .iter()
            .flatten()
            .map(|&id| {
                if id < 0 || id >= i64::from(limits.vocab_size) {
                    Err(ApiError::invalid(
                        "stop_token_ids",
                        format!(
                            "Token id {id} is outside the vocabulary (0..{}).",
                            limits.vocab_size
                        ),
                    ))
                } else {
                    Ok(id as TokenId)
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        let stops = match stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(v)) => v.clone(),
        };
        if stops.len() > 16 {
            return Err(ApiError::invalid(
                "stop",
                format!("At most 16 stop strings are allowed, got {}.", stops.len()),
            ));
        }
        if stops.iter().any(|s| s.is_empty()) {
            return Err(ApiError::invalid("stop", "Stop strings must not be empty."));
        }
        let logprobs = logprobs.map(|v| to_u32("logprobs", v, 0)).transpose()?;
        let stream = stream.unwrap_or(false);
        if stream_options.is_some() && !stream {
            return Err(ApiError::invalid(
                "stream_options",
                "`stream_options` is only allowed when `stream` is true.",
            ));
        }
        let sampling = SamplingParams {
            temperature: temperature.unwrap_or(1.0) as f32,
            top_p: top_p.unwrap_or(1.0) as f32,
            top_k,
            min_p: min_p.unwrap_or(0.0) as f32,
            seed: seed.map(|s| s as u64),
            presence_penalty: presence_penalty.unwrap_or(0.0) as f32,
            frequency_penalty: frequency_penalty.unwrap_or(0.0) as f32,
            repetition_penalty: repetition_penalty.unwrap_or(1.0) as f32,
            // Placeholder until the prompt length is known; checked below with the real value.
            max_tokens: max_tokens.unwrap_or(1),
            min_tokens: min_tokens
                .map(|v| to_u32("min_tokens", v, 0))
                .transpose()?
                .unwrap_or(0),
            stop_token_ids,
            ignore_eos: ignore_eos.unwrap_or(false),
            logprobs,
            logit_bias,
            structured: structured.as_ref().map(|s| Box::new(s.1.clone())),
        };
        // f64 -> f32 may overflow to inf; validate() rejects non-finite values.
        let mut check = sampling.clone();
        if max_tokens.is_none() {
            check.max_tokens = check.max_tokens.max(check.min_tokens);
        }
        check
            .validate(limits.max_logprobs)
            .map_err(|e| ApiError::invalid(e.param, e.message))?;
        Ok(Validated {
            structured_param: structured.map(|s| s.0),
            tools: crate::tools::ToolMode::Off,
            template_tools: false,
            sampling,
            max_tokens,
            output: OutputParams {
                stops,
                include_stop_str: include_stop_str_in_output.unwrap_or(false),
                skip_special_tokens: skip_special_tokens.unwrap_or(true),
                logprobs: logprobs.is_some(),
            },
            n,
            stream,
            cache_salt: cache_salt.clone(),
            include_usage: stream
                && stream_options
                    .as_ref()
                    .and_then(|o| o.include_usage)
                    .unwrap_or(false),
        })
    }
}

impl CompletionRequest {
    pub fn validate(&self, limits: Limits) -> Result<Validated, ApiError> {
        if self.prompt.is_none() {
            return Err(ApiError::invalid(
                "prompt",
                "Missing required field `prompt`.",
            ));
        }
        if self.echo == Some(true) {
            return Err(ApiError::invalid("echo", "`echo` is not supported."));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid("suffix", "`suffix` is not supported."));
        }
        self.sampling.validate(self.logprobs, limits)
    }

    /// The prompts as texts or id lists (a batch gives several).
    pub fn prompts(&self, vocab_size: u32) -> Result<Vec<PromptInput>, ApiError> {
        let ids = |v: &[i64]| -> Result<Vec<TokenId>, ApiError> {
            if v.is_empty() {
                return Err(ApiError::invalid("prompt", "The prompt must not be empty."));
            }
            v.iter()
                .map(|&id| {
                    if id < 0 || id >= i64::from(vocab_size) {
                        Err(ApiError::invalid(
                            "prompt",
                            format!("Token id {id} is outside the vocabulary (0..{vocab_size})."),
                        ))
                    } else {
                        Ok(id as TokenId)
                    }
                })
                .collect()
        };
        let out = match &self.prompt {
            None => {
                return Err(ApiError::invalid(
                    "prompt",
                    "Missing required field `prompt`.",
                ))
            }
            Some(PromptField::Text(t)) => vec![PromptInput::Text(t.clone())],
            Some(PromptField::Texts(ts)) => {
                ts.iter().map(|t| PromptInput::Text(t.clone())).collect()
            }
            Some(PromptField::Ids(v)) => vec![PromptInput::Ids(ids(v)?)],
            Some(PromptField::IdLists(vs)) => vs
                .iter()
                .map(|v| ids(v).map(PromptInput::Ids))
                .collect::<Result<_, _>>()?,
        };
        if out.is_empty() {
            return Err(ApiError::invalid(
                "prompt",
                "The prompt list must not be empty.",
            ));
        }
        if out.len() > 64 {
            return Err(ApiError::invalid(
                "prompt",
                format!("At most 64 prompts per request, got {}.", out.len()),
            ));
        }
        Ok(out)
    }
}

impl ChatRequest {
    pub fn validate(&self, limits: Limits) -> Result<Validated, ApiError> {
        match &self.messages {
            None => {
                return Err(ApiError::invalid(
                    "messages",
                    "Missing required field `messages`.",
                ))
            }
            Some(m) if m.is_empty() => {
                return Err(ApiError::invalid(
                    "messages",
                    "`messages` must not be empty.",
                ))
            }
            Some(_) => {}
        }
        let mut fields = self.sampling.clone();
        if let Some(m) = self.max_completion_tokens {
            fields.max_tokens = Some(m);
        }
        let logprobs = match (self.logprobs, self.top_logprobs) {
            (Some(true), top) => Some(top.unwrap_or(0)),
            (_, Some(top)) if top > 0 => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "`top_logprobs` requires `logprobs` to be true.",
                ))
            }
            _ => None,
        };
        fields.validate(logprobs, limits).map_err(|mut e| {
            if e.param.as_deref() == Some("logprobs") && self.top_logprobs.is_some() {
                e.param = Some("top_logprobs".into());
            }
            if e.param.as_deref() == Some("max_tokens") && self.max_completion_tokens.is_some() {
                e.param = Some("max_completion_tokens".into());
                e.message = e.message.replace("max_tokens", "max_completion_tokens");
            }
            e
        })
    }
}

/// One prompt of a request, before tokenization.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    Text(String),
    Ids(Vec<TokenId>),
}

/// OpenAI `logit_bias`: `{"token id": bias}` with ids inside the vocabulary and biases in
/// [-100, 100] (range checked again by `SamplingParams::validate`), sorted by id.
fn parse_logit_bias(
    map: Option<&serde_json::Map<String, serde_json::Value>>,
    vocab_size: u32,
) -> Result<Vec<(TokenId, f32)>, ApiError> {
    let Some(map) = map else {
        return Ok(Vec::new());
    };
    let mut out = Vec::with_capacity(map.len());
    for (key, value) in map {
        let id: TokenId = key
            .trim()
            .parse()
            .ok()
            .filter(|&id| id < vocab_size)
            .ok_or_else(|| {
                ApiError::invalid(
                    "logit_bias",
                    format!("`logit_bias` keys must be token ids in 0..{vocab_size}, got {key:?}."),
                )
            })?;
        let bias = value.as_f64().ok_or_else(|| {
            ApiError::invalid(
                "logit_bias",
                format!("`logit_bias` values must be numbers, got {value} for {key:?}."),
            )
        })?;
        out.push((id, bias as f32));
    }
    out.sort_by_key(|&(id, _)| id);
    if out.windows(2).any(|w| w[0].0 == w[1].0) {
        return Err(ApiError::invalid(
            "logit_bias",
            "`logit_bias` names a token id twice.",
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::StatusCode;

    const LIMITS: Limits = Limits {
        max_logprobs: 20,
        max_n: 128,
        vocab_size: 1000,
    };

    fn completion(body: &str) -> Result<Validated, ApiError> {
        parse_json::<CompletionRequest>(body.as_bytes()).and_then(|r| {
            r.prompts(LIMITS.vocab_size)?;
            r.validate(LIMITS)
        })
    }

    fn chat(body: &str) -> Result<Validated, ApiError> {
        parse_json::<ChatRequest>(body.as_bytes()).and_then(|r| r.validate(LIMITS))
    }

    #[test]
    fn logit_bias_maps_to_sorted_ids() {
        let v = completion(r#"{"prompt": "x", "logit_bias": {"17": -100, "3": 2.5, "999": 100}}"#)
            .unwrap();
        assert_eq!(
            v.sampling.logit_bias,
            [(3, 2.5), (17, -100.0), (999, 100.0)]
        );
        let v =
            chat(r#"{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"7": 1}}"#)
                .unwrap();
        assert_eq!(v.sampling.logit_bias, [(7, 1.0)]);
        let v =
            chat(r#"{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {}}"#).unwrap();
        assert!(v.sampling.logit_bias.is_empty());
    }

    #[test]
    fn good_requests_map_to_engine_params() {
        let v = completion(
            r#"{"prompt": "x", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.1, "seed": 3,
                "stop": "END", "stop_token_ids": [5], "ignore_eos": true, "min_tokens": 2, "n": 3, "logprobs": 2,
                "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, "skip_special_tokens": false,
                "include_stop_str_in_output": true, "stream": true, "stream_options": {"include_usage": true}, "user": "u",
                "unknown_field": {"ignored": true}}"#,
        )
        .unwrap();
        let s = &v.sampling;
        assert_eq!(
            (s.temperature, s.top_p, s.top_k, s.min_p, s.seed),
            (0.5, 0.9, Some(40), 0.1, Some(3))
        );
        assert_eq!(
            (
                s.presence_penalty,
                s.frequency_penalty,
                s.repetition_penalty
            ),
            (0.5, -0.5, 1.1)
        );
        assert_eq!(
            (
                s.min_tokens,
                s.ignore_eos,
                s.logprobs,
                s.stop_token_ids.clone()
            ),
            (2, true, Some(2), vec![5])
        );
        assert_eq!(v.max_tokens, Some(7));
        assert_eq!(v.n, 3);
        assert!(v.stream && v.include_usage);
        assert_eq!(
            v.output,
            OutputParams {
                stops: vec!["END".into()],
                include_stop_str: true,
                skip_special_tokens: false,
                logprobs: true
            }
        );
        let v = completion(r#"{"prompt": [1, 2], "top_k": -1, "stop": ["a", "b"]}"#).unwrap();
        assert_eq!(v.sampling.top_k, None);
        assert_eq!(v.max_tokens, None);
        assert_eq!(v.output.stops, ["a", "b"]);
        assert!(!v.include_usage && !v.output.logprobs);
        let v = chat(r#"{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9, "logprobs": true, "top_logprobs": 4}"#).unwrap();
        assert_eq!(v.max_tokens, Some(9));
        assert_eq!(v.sampling.logprobs, Some(4));
        let v =
            chat(r#"{"messages": [{"role": "user", "content": "x"}], "logprobs": false}"#).unwrap();
        assert_eq!(v.sampling.logprobs, None);
    }

    /// (body, status, param): every rejected request names what is wrong.
    #[test]
    fn bad_requests_table() {
        let cases: &[(&str, StatusCode, Option<&str>)] = &[
            (r#"{"prompt": "#, StatusCode::BAD_REQUEST, None),
            ("", StatusCode::BAD_REQUEST, None),
            ("[]", StatusCode::BAD_REQUEST, None),
            (r#"{}"#, StatusCode::BAD_REQUEST, Some("prompt")),
            (r#"{"prompt": 5}"#, StatusCode::BAD_REQUEST, Some("prompt")),
            (r#"{"prompt": []}"#, StatusCode::BAD_REQUEST, Some("prompt")),
            (
                r#"{"prompt": [1, 1000]}"#,
                StatusCode::BAD_REQUEST,
                Some("prompt"),
            ),
            (
                r#"{"prompt": [-1]}"#,
                StatusCode::BAD_REQUEST,
                Some("prompt"),
            ),
            (
                r#"{"prompt": "x", "temperature": "hot"}"#,
                StatusCode::BAD_REQUEST,
                Some("temperature"),
            ),
            (
                r#"{"prompt": "x", "max_tokens": "5"}"#,
                StatusCode::BAD_REQUEST,
                Some("max_tokens"),
            ),
            (
                r#"{"prompt": "x", "stop": 5}"#,
                StatusCode::BAD_REQUEST,
                Some("stop"),
            ),
            (
                r#"{"prompt": "x", "stop": [""]}"#,
                StatusCode::BAD_REQUEST,
                Some("stop"),
            ),
            (
                r#"{"prompt": "x", "stream": "yes"}"#,
                StatusCode::BAD_REQUEST,
                Some("stream"),
            ),
            (
                r#"{"prompt": "x", "max_tokens": 0}"#,
                StatusCode::BAD_REQUEST,
                Some("max_tokens"),
            ),
            (
                r#"{"prompt": "x", "max_tokens": -1}"#,
                StatusCode::BAD_REQUEST,
                Some("max_tokens"),
            ),
            (
                r#"{"prompt": "x", "temperature": -1}"#,
                StatusCode::BAD_REQUEST,
                Some("temperature"),
            ),
            (
                r#"{"prompt": "x", "temperature": 1e300}"#,
                StatusCode::BAD_REQUEST,
                Some("temperature"),
            ),
            (
                r#"{"prompt": "x", "top_p": 0}"#,
                StatusCode::BAD_REQUEST,
                Some("top_p"),
            ),
            (
                r#"{"prompt": "x", "top_p": 1.01}"#,
                StatusCode::BAD_REQUEST,
                Some("top_p"),
            ),
            (
                r#"{"prompt": "x", "top_k": -2}"#,
                StatusCode::BAD_REQUEST,
                Some("top_k"),
            ),
            (
                r#"{"prompt": "x", "top_k": 0}"#,
                StatusCode::BAD_REQUEST,
                Some("top_k"),
            ),
            (
                r#"{"prompt": "x", "min_p": 2}"#,
                StatusCode::BAD_REQUEST,
                Some("min_p"),
            ),
            (
                r#"{"prompt": "x", "n": 0}"#,
                StatusCode::BAD_REQUEST,
                Some("n"),
            ),
            (
                r#"{"prompt": "x", "n": 129}"#,
                StatusCode::BAD_REQUEST,
                Some("n"),
            ),
            (
                r#"{"prompt": "x", "best_of": 3}"#,
                StatusCode::BAD_REQUEST,
                Some("best_of"),
            ),
            (
                r#"{"prompt": "x", "logprobs": 21}"#,
                StatusCode::BAD_REQUEST,
                Some("logprobs"),
            ),
            (
                r#"{"prompt": "x", "logprobs": -1}"#,
                StatusCode::BAD_REQUEST,
                Some("logprobs"),
            ),
            (
                r#"{"prompt": "x", "presence_penalty": -3}"#,
                StatusCode::BAD_REQUEST,
                Some("presence_penalty"),
            ),
            (
                r#"{"prompt": "x", "frequency_penalty": 2.5}"#,
                StatusCode::BAD_REQUEST,
                Some("frequency_penalty"),
            ),
            (
                r#"{"prompt": "x", "repetition_penalty": 0}"#,
                StatusCode::BAD_REQUEST,
                Some("repetition_penalty"),
            ),
            (
                r#"{"prompt": "x", "min_tokens": -1}"#,
                StatusCode::BAD_REQUEST,
                Some("min_tokens"),
            ),
            (
                r#"{"prompt": "x", "max_tokens": 2, "min_tokens": 3}"#,
                StatusCode::BAD_REQUEST,
                Some("min_tokens"),
            ),
            (
                r#"{"prompt": "x", "stop_token_ids": [1000]}"#,
                StatusCode::BAD_REQUEST,
                Some("stop_token_ids"),
            ),
            (
                r#"{"prompt": "x", "stream_options": {"include_usage": true}}"#,
                StatusCode::BAD_REQUEST,
                Some("stream_options"),
            ),
            (
                r#"{"prompt": "x", "echo": true}"#,
                StatusCode::BAD_REQUEST,
                Some("echo"),
            ),
            (
                r#"{"prompt": "x", "logit_bias": {"abc": 1}}"#,
                StatusCode::BAD_REQUEST,
                Some("logit_bias"),
            ),
            (
                r#"{"prompt": "x", "logit_bias": {"1000": 1}}"#,
                StatusCode::BAD_REQUEST,
                Some("logit_bias"),
            ),
            (
                r#"{"prompt": "x", "logit_bias": {"5": 101}}"#,
                StatusCode::BAD_REQUEST,
                Some("logit_bias"),
            ),
            (
                r#"{"prompt": "x", "logit_bias": {"5": "high"}}"#,
                StatusCode::BAD_REQUEST,
                Some("logit_bias"),
            ),
            (
                r#"{"prompt": "x", "logit_bias": {"5": 1, " 5": 2}}"#,
                StatusCode::BAD_REQUEST,
                Some("logit_bias"),
            ),
            (
                r#"{"prompt": "x", "suffix": "s"}"#,
                StatusCode::BAD_REQUEST,
                Some("suffix"),
            ),
        ];
        for (body, status, param) in cases {
            let e = completion(body).unwrap_err();
            assert_eq!(e.status, *status, "{body}: {e:?}");
            assert_eq!(e.param.as_deref(), *param, "{body}: {e:?}");
            assert!(!e.message.is_empty());
        }
        let non_utf8 = parse_json::<CompletionRequest>(b"{\"prompt\": \"\xff\"}").unwrap_err();
        assert!(non_utf8.message.contains("UTF-8"), "{non_utf8:?}");
        let chat_cases: &[(&str, Option<&str>)] = &[
            (r#"{}"#, Some("messages")),
            (r#"{"messages": []}"#, Some("messages")),
            (r#"{"messages": "hi"}"#, Some("messages")),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}"#,
                Some("max_completion_tokens"),
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}"#,
                Some("top_logprobs"),
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 30}"#,
                Some("top_logprobs"),
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}"#,
                Some("response_format"),
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}"#,
                Some("response_format"),
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}"#,
                Some("structured_outputs"),
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"choice": [1, 2]}}"#,
                Some("structured_outputs"),
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "a", "choice": ["b"]}}"#,
                Some("structured_outputs"),
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"jsonn": {}}}"#,
                Some("structured_outputs"),
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"choice": []}}"#,
                Some("structured_outputs"),
            ),
        ];
        for (body, param) in chat_cases {
            let e = chat(body).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.param.as_deref(), *param, "{body}: {e:?}");
        }
    }

    #[test]
    fn output_constraints_from_every_spelling() {
        let m = r#""messages": [{"role": "user", "content": "x"}]"#;
        for (extra, want, param) in [
            (r#""response_format": {"type": "text"}"#, None, None),
            (
                r#""response_format": {"type": "json_object"}"#,
                Some(StructuredOutput::JsonObject),
                Some("response_format"),
            ),
            (
                r#""response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer"}, "strict": true}}"#,
                Some(StructuredOutput::JsonSchema(r#"{"type":"integer"}"#.into())),
                Some("response_format"),
            ),
            (
                r#""structured_outputs": {"regex": "[0-9]+"}"#,
                Some(StructuredOutput::Regex("[0-9]+".into())),
                Some("structured_outputs"),
            ),
            (
                r#""structured_outputs": {"choice": ["a", "b"], "disable_fallback": true}"#,
                Some(StructuredOutput::Choice(vec!["a".into(), "b".into()])),
                Some("structured_outputs"),
            ),
            (
                r#""structured_outputs": {"grammar": "start: \"x\""}"#,
                Some(StructuredOutput::Grammar("start: \"x\"".into())),
                Some("structured_outputs"),
            ),
            (
                r#""structured_outputs": {"json": "{\"type\": \"string\"}"}"#,
                Some(StructuredOutput::JsonSchema(r#"{"type": "string"}"#.into())),
                Some("structured_outputs"),
            ),
            (
                r#""guided_choice": ["x"]"#,
                Some(StructuredOutput::Choice(vec!["x".into()])),
                Some("guided_choice"),
            ),
        ] {
            let v = chat(&format!("{{{m}, {extra}}}")).unwrap();
            assert_eq!(v.sampling.structured.map(|s| *s), want, "{extra}");
            assert_eq!(v.structured_param, param, "{extra}");
        }
    }
}
