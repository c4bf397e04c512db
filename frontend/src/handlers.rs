//! The endpoints: parse, validate, tokenize (blocking pool), submit, then stream or collect.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use harrier_shared::protocol::{EngineCoreRequest, EngineInfo, TokenId};
use http_body_util::{BodyExt, Full};
use hyper::{Response, StatusCode};
use serde_json::json;
use tokio::sync::mpsc;

use crate::api::request::{
    parse_json, ChatRequest, CompletionRequest, DetokenizeRequest, Limits, PromptInput,
    TokenizeRequest, Validated,
};
use crate::api::response::{unix_now, ModelCard, ModelList};
use crate::engine::new_request_id;
use crate::error::ApiError;
use crate::output::ChoiceSpec;
use crate::server::{AppState, RespBody};
use crate::stream::{collect, stream_events, ChannelBody, Generation, Kind, ResponseMeta};
use crate::template::ChatInput;
use crate::text::TextModel;

pub fn json_response(status: StatusCode, body: String) -> Response<RespBody> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)).map_err(|e| match e {}).boxed())
        .expect("response")
}

pub fn error_response(e: &ApiError) -> Response<RespBody> {
    json_response(e.status, e.to_json())
}

fn limits(state: &AppState, info: &EngineInfo) -> Limits {
    Limits {
        max_logprobs: info.limits.max_logprobs,
        max_n: state.cfg.max_n,
        vocab_size: info.vocab_size,
    }
}

fn check_model(requested: Option<&str>, info: &EngineInfo) -> Result<(), ApiError> {
    match requested {
        Some(m) if m != info.model_name => Err(ApiError::model_not_found(m)),
        _ => Ok(()),
    }
}

/// The one model this server serves, as `/v1/models` lists it.
fn model_card<'a>(state: &AppState, info: &'a EngineInfo) -> ModelCard<'a> {
    ModelCard {
        id: &info.model_name,
        object: "model",
        created: state.started_unix,
        owned_by: "harrier",
        root: &info.model_name,
        parent: None,
        max_model_len: info.max_model_len,
    }
}

pub async fn models(state: &AppState) -> Result<Response<RespBody>, ApiError> {
    let info = state
        .engine
        .info()
        .ok_or_else(|| ApiError::engine_unavailable(&state.engine.last_error()))?;
    let card = model_card(state, &info);
    let body = serde_json::to_string(&ModelList {
        object: "list",
        data: vec![card],
    })
    .expect("json");
    Ok(json_response(StatusCode::OK, body))
}

pub async fn model(state: &AppState, id: &str) -> Result<Response<RespBody>, ApiError> {
    let info = state
        .engine
        .info()
        .ok_or_else(|| ApiError::engine_unavailable(&state.engine.last_error()))?;
    check_model(Some(id), &info)?;
    let card = model_card(state, &info);
    Ok(json_response(
        StatusCode::OK,
        serde_json::to_string(&card).expect("json"),
    ))
}

// Each endpoint runs the same stages, each a function of its own (the fuzz harness in
// `fuzz_tests::requests` calls them in the same order): parse the body (a 400 even while the
// engine is down), check it against the engine (`check_*`), tokenize on the blocking pool
// (`*_prompt(s)`), then fit the lengths into the context (`check_lengths`) and submit.

/// `/v1/completions` after parsing: the model, the sampling fields, the prompts.
pub(crate) fn check_completion(
    req: &CompletionRequest,
    info: &EngineInfo,
    limits: Limits,
) -> Result<(Validated, Vec<PromptInput>), ApiError> {
    check_model(req.model.as_deref(), info)?;
    let v = req.validate(limits)?;
    let prompts = req.prompts(info.vocab_size)?;
    Ok((v, prompts))
}

/// `/v1/completions` on the blocking pool: texts to ids (id prompts are already checked).
pub(crate) fn completion_prompts(
    t: &TextModel,
    prompts: Vec<PromptInput>,
    add_special: bool,
) -> Result<Vec<Vec<TokenId>>, ApiError> {
    prompts
        .into_iter()
        .map(|p| match p {
            PromptInput::Text(s) => t.encode(&s, add_special),
            PromptInput::Ids(ids) => Ok(ids),
        })
        .collect()
}

/// On the blocking pool: an output constraint must compile (a 400 naming the field and the
/// problem otherwise; the engine compiles it again, off its loop, from its cache).
pub(crate) fn check_structured(
    t: &TextModel,
    v: &Validated,
    info: &EngineInfo,
) -> Result<(), ApiError> {
    match (v.sampling.structured.as_deref(), v.structured_param) {
        (Some(s), Some(p)) => t.check_structured(s, p, info.vocab_size, &info.eos_token_ids),
        _ => Ok(()),
    }
}

pub async fn completions(
    state: Arc<AppState>,
    body: Bytes,
) -> Result<Response<RespBody>, ApiError> {
    let arrival = Instant::now();
    let req: CompletionRequest = parse_json(&body)?;
    let info = state.engine.connected_info()?;
    let (v, prompts) = check_completion(&req, &info, limits(&state, &info))?;
    let add_special = req.add_special_tokens.unwrap_or(true);
    let (checked, info2) = (v.clone(), info.clone());
    let prompts = state
        .text
        .run(move |t| {
            check_structured(t, &checked, &info2)?;
            completion_prompts(t, prompts, add_special)
        })
        .await??;
    check_lengths(Kind::Completion, &info, &prompts, &v, COMPLETION_MAX_TOKENS)?;
    let id = new_request_id("cmpl");
    generate(
        state,
        id,
        Kind::Completion,
        &info,
        prompts,
        v,
        COMPLETION_MAX_TOKENS,
        arrival,
    )
    .await
}

/// `max_tokens` when a completion request gives none (OpenAI's default); chat fills the
/// context left.
pub(crate) const COMPLETION_MAX_TOKENS: u32 = 16;

/// `/v1/chat/completions` after parsing: the model and the sampling fields.
pub(crate) fn check_chat(
    req: &ChatRequest,
    info: &EngineInfo,
    limits: Limits,
    tool_cfg: crate::tools::ToolConfig,
) -> Result<Validated, ApiError> {
    check_model(req.model.as_deref(), info)?;
    let mut v = req.validate(limits)?;
    let tools: Option<Vec<serde_json::Value>> = req
        .tools
        .as_ref()
        .map(|t| {
            t.iter()
                .map(serde_json::to_value)
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()
        .map_err(|e| ApiError::invalid("tools", format!("`tools` is not valid JSON: {e}")))?;
    let (mode, template_tools, grammar) = crate::tools::plan(
        tools.as_deref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
        tool_cfg,
    )?;
    if let Some(g) = grammar {
        if v.sampling.structured.is_some() {
            return Err(ApiError::invalid(
                "tool_choice",
                "A forced `tool_choice` cannot be combined with another output constraint.",
            ));
        }
        v.sampling.structured = Some(Box::new(g));
        v.structured_param = Some("tool_choice");
    }
    v.tools = mode;
    v.template_tools = template_tools;
    Ok(v)
}

/// `/v1/chat/completions` on the blocking pool: the rendered template, tokenized.
pub(crate) fn chat_prompt(
    t: &TextModel,
    req: &ChatRequest,
    template_tools: bool,
) -> Result<Vec<TokenId>, ApiError> {
    let input = ChatInput {
        messages: req.messages.as_deref().unwrap_or_default(),
        tools: req.tools.as_deref().filter(|_| template_tools),
        add_generation_prompt: req.add_generation_prompt.unwrap_or(true),
        continue_final_message: req.continue_final_message.unwrap_or(false),
        extra: req.chat_template_kwargs.as_ref(),
    };
    let text = t.render_chat(&input)?;
    t.encode(&text, req.add_special_tokens.unwrap_or(false))
}

pub async fn chat(state: Arc<AppState>, body: Bytes) -> Result<Response<RespBody>, ApiError> {
    let arrival = Instant::now();
    let req: ChatRequest = parse_json(&body)?;
    let info = state.engine.connected_info()?;
    let v = check_chat(&req, &info, limits(&state, &info), state.cfg.tools)?;
    let (checked, info2) = (v.clone(), info.clone());
    let prompt = state
        .text
        .run(move |t| {
            check_structured(t, &checked, &info2)?;
            chat_prompt(t, &req, checked.template_tools)
        })
        .await??;
    let prompts = vec![prompt];
    check_lengths(Kind::Chat, &info, &prompts, &v, u32::MAX)?;
    let id = new_request_id("chatcmpl");
    generate(state, id, Kind::Chat, &info, prompts, v, u32::MAX, arrival).await
}

/// Every prompt fits the context with room for the tokens asked for (`default_max_tokens`
/// when the request gave none, capped by the room left) and at least `min_tokens`.
pub(crate) fn check_lengths(
    kind: Kind,
    info: &EngineInfo,
    prompts: &[Vec<TokenId>],
    v: &Validated,
    default_max_tokens: u32,
) -> Result<(), ApiError> {
    let max_len = info.max_model_len;
    for p in prompts {
        let len = p.len() as u32;
        if len == 0 {
            return Err(ApiError::invalid("prompt", "The prompt is empty."));
        }
        if len >= max_len {
            let param = if kind == Kind::Chat {
                "messages"
            } else {
                "prompt"
            };
            return Err(ApiError::invalid(param, format!("The prompt has {len} tokens; this model's maximum context length is {max_len} tokens, and at least one token must be generated.")));
        }
        let room = max_len - len;
        let want = match v.max_tokens {
            Some(m) if m > room => {
                return Err(ApiError::invalid(
                    "max_tokens",
                    format!("This model's maximum context length is {max_len} tokens. However, you requested {} tokens ({len} in the prompt, {m} for the completion).", len + m),
                ))
            }
            Some(m) => m,
            None => default_max_tokens.min(room),
        };
        if v.sampling.min_tokens > want {
            return Err(ApiError::invalid(
                "min_tokens",
                format!(
                    "min_tokens ({}) exceeds the {want} tokens that can be generated.",
                    v.sampling.min_tokens
                ),
            ));
        }
    }
    Ok(())
}

/// Fans out `n` engine requests per prompt (their lengths checked by [`check_lengths`]) and
/// answers with a stream or JSON. `default_max_tokens`: used when the request gave none
/// (capped by the context left).
#[allow(clippy::too_many_arguments)]
async fn generate(
    state: Arc<AppState>,
    id: String,
    kind: Kind,
    info: &EngineInfo,
    prompts: Vec<Vec<TokenId>>,
    v: Validated,
    default_max_tokens: u32,
    arrival: Instant,
) -> Result<Response<RespBody>, ApiError> {
    let max_len = info.max_model_len;
    if state.draining() {
        return Err(ApiError::draining());
    }
    let n = v.n;
    let num_choices = n * prompts.len() as u32;
    let prompt_tokens: u32 = prompts.iter().map(|p| p.len() as u32).sum();
    let output = Arc::new(v.output.clone());
    let (tx, events) = mpsc::unbounded_channel();
    let arrival_time = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let mut requests = Vec::with_capacity(num_choices as usize);
    let mut specs = Vec::with_capacity(num_choices as usize);
    for (p, prompt) in prompts.into_iter().enumerate() {
        let prompt = Arc::new(prompt);
        for i in 0..n {
            let index = p as u32 * n + i;
            let engine_id = format!("{id}-{index}");
            let mut sampling = v.sampling.clone();
            let room = max_len - prompt.len() as u32;
            sampling.max_tokens = v.max_tokens.unwrap_or(default_max_tokens.min(room));
            sampling.seed = v.sampling.seed.map(|s| s.wrapping_add(u64::from(i)));
            requests.push(EngineCoreRequest {
                request_id: engine_id.clone(),
                prompt_token_ids: prompt.to_vec(),
                sampling,
                arrival_time,
                cache_salt: v.cache_salt.clone(),
            });
            specs.push(ChoiceSpec {
                engine_id,
                link: 0, // set by Engine::submit
                index,
                prompt_ids: prompt.clone(),
                output: output.clone(),
                tx: tx.clone(),
                arrival,
            });
        }
    }
    drop(tx);
    let guard = state.engine.submit(requests, specs).await?;
    let gen = Generation {
        events,
        guard,
        num_choices,
        choices_per_prompt: n,
        prompt_tokens,
    };
    let meta = ResponseMeta {
        id,
        created: unix_now(),
        model: info.model_name.clone(),
        kind,
        logprobs: v.output.logprobs,
        include_usage: v.include_usage,
        tools: v.tools.clone(),
    };
    if v.stream {
        let (btx, brx) = mpsc::channel(64);
        tokio::spawn(stream_events(meta, gen, btx));
        Ok(Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "text/event-stream")
            .header("cache-control", "no-cache")
            .body(ChannelBody::new(brx).boxed())
            .expect("response"))
    } else {
        let body = collect(&meta, gen).await?;
        Ok(json_response(StatusCode::OK, body))
    }
}

/// `/tokenize` after parsing: the model, when an engine answered (tokenizing needs none).
pub(crate) fn check_tokenize(
    req: &TokenizeRequest,
    info: Option<&EngineInfo>,
) -> Result<(), ApiError> {
    match info {
        Some(info) => check_model(req.model.as_deref(), info),
        None => Ok(()),
    }
}

/// `/tokenize` on the blocking pool: a prompt, or messages rendered by the chat template.
pub(crate) fn tokenize_prompt(
    t: &TextModel,
    req: &TokenizeRequest,
) -> Result<Vec<TokenId>, ApiError> {
    match (&req.prompt, &req.messages) {
        (Some(p), None) => t.encode(p, req.add_special_tokens.unwrap_or(true)),
        (None, Some(m)) => {
            let input = ChatInput {
                messages: m,
                tools: None,
                add_generation_prompt: req.add_generation_prompt.unwrap_or(true),
                continue_final_message: false,
                extra: None,
            };
            let text = t.render_chat(&input)?;
            t.encode(&text, req.add_special_tokens.unwrap_or(false))
        }
        _ => Err(ApiError::bad_request(
            "Give exactly one of `prompt` or `messages`.",
        )),
    }
}

pub async fn tokenize(state: Arc<AppState>, body: Bytes) -> Result<Response<RespBody>, ApiError> {
    let req: TokenizeRequest = parse_json(&body)?;
    let info = state.engine.info();
    check_tokenize(&req, info.as_ref())?;
    let tokens = state.text.run(move |t| tokenize_prompt(t, &req)).await??;
    let max_model_len = info.map(|i| i.max_model_len);
    Ok(json_response(
        StatusCode::OK,
        json!({"count": tokens.len(), "max_model_len": max_model_len, "tokens": tokens})
            .to_string(),
    ))
}

/// `/detokenize` after parsing: the model (when an engine answered) and the ids, each inside
/// the tokenizer's vocabulary.
pub(crate) fn check_detokenize(
    req: &DetokenizeRequest,
    info: Option<&EngineInfo>,
    vocab_size: u32,
) -> Result<Vec<TokenId>, ApiError> {
    if let Some(info) = info {
        check_model(req.model.as_deref(), info)?;
    }
    let Some(tokens) = &req.tokens else {
        return Err(ApiError::invalid(
            "tokens",
            "Missing required field `tokens`.",
        ));
    };
    let vocab = i64::from(vocab_size);
    tokens
        .iter()
        .map(|&t| {
            if (0..vocab).contains(&t) {
                Ok(t as TokenId)
            } else {
                Err(ApiError::invalid(
                    "tokens",
                    format!("Token id {t} is outside the vocabulary (0..{vocab})."),
                ))
            }
        })
        .collect()
}

pub async fn detokenize(state: Arc<AppState>, body: Bytes) -> Result<Response<RespBody>, ApiError> {
    let req: DetokenizeRequest = parse_json(&body)?;
    let ids = check_detokenize(&req, state.engine.info().as_ref(), state.text.vocab_size)?;
    let text = state.text.run(move |t| t.decode(&ids, false)).await??;
    Ok(json_response(
        StatusCode::OK,
        json!({"prompt": text}).to_string(),
    ))
}
