//! Turning a generation's events into OpenAI's SSE chunks or one JSON response.
//!
//! Stream order, per OpenAI: (chat only) a first chunk per choice with
//! `delta: {"role": "assistant", "content": ""}`; text chunks with `finish_reason: null`;
//! a final chunk per choice with an empty delta (chat) / empty text (completions) and its
//! `finish_reason`; the usage chunk (`choices: []`) when `stream_options.include_usage`;
//! then `data: [DONE]`. If the engine fails, an error event
//! `data: {"error": {...}}` and `data: [DONE]` end the stream.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::mpsc;

use crate::api::response::{
    sse_json, ChatChoice, ChatChunk, ChatChunkChoice, ChatCompletion, ChatLogprobs, ChatMessage,
    ChatTokenLogprob, Completion, CompletionChoice, CompletionLogprobs, Delta, FunctionCall,
    OrderedMap, ToolCallDelta, ToolCallOut, Usage, SSE_DONE,
};
use crate::engine::CancelGuard;
use crate::error::ApiError;
use crate::output::{ChoiceDelta, Event, TokenLogprob};
use crate::tools::{self, ToolCall, ToolMode, ToolStream};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

/// A submitted request: its events and the guard that aborts it if we stop listening.
pub struct Generation {
    pub events: mpsc::UnboundedReceiver<Event>,
    pub guard: CancelGuard,
    pub num_choices: u32,
    /// Choices per prompt (`n`): choice `i` belongs to prompt `i / n`.
    pub choices_per_prompt: u32,
    pub prompt_tokens: u32,
}

impl Generation {
    /// Cached prompt tokens are counted once per prompt (from its first choice), as
    /// `prompt_tokens` is.
    fn counts_cached(&self, index: u32) -> bool {
        index.is_multiple_of(self.choices_per_prompt.max(1))
    }
}

/// What every chunk of one response repeats.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub kind: Kind,
    pub logprobs: bool,
    pub include_usage: bool,
    /// Chat: how replies use tools (parsed into tool calls, or plain text).
    pub tools: crate::tools::ToolMode,
}

/// Per-choice bookkeeping shared by both output modes.
#[derive(Default, Clone)]
struct ChoiceAcc {
    text: String,
    tokens: u32,
    finish: Option<&'static str>,
    completion_lp: CompletionLogprobs,
    chat_lp: Vec<ChatTokenLogprob>,
    text_offset: usize,
}

impl ChoiceAcc {
    fn add_logprobs(&mut self, lps: &[TokenLogprob]) {
        for lp in lps {
            self.completion_lp.tokens.push(lp.token.clone());
            self.completion_lp.token_logprobs.push(lp.logprob);
            self.completion_lp
                .top_logprobs
                .push(OrderedMap(lp.top.clone()));
            self.completion_lp.text_offset.push(self.text_offset);
            self.text_offset += lp.token.len();
            self.chat_lp.push(chat_logprob(lp));
        }
    }
}

fn chat_logprob(lp: &TokenLogprob) -> ChatTokenLogprob {
    ChatTokenLogprob {
        token: lp.token.clone(),
        logprob: lp.logprob,
        bytes: lp.token.as_bytes().to_vec(),
        top_logprobs: Some(
            lp.top
                .iter()
                .map(|(t, l)| ChatTokenLogprob {
                    token: t.clone(),
                    logprob: *l,
                    bytes: t.as_bytes().to_vec(),
                    top_logprobs: None,
                })
                .collect(),
        ),
    }
}

/// Serializes chunks of one response.
struct ChunkWriter<'a> {
    meta: &'a ResponseMeta,
}

impl ChunkWriter<'_> {
    fn usage_field(&self) -> Option<Option<Usage>> {
        self.meta.include_usage.then_some(None)
    }

    fn role(&self, index: u32) -> Bytes {
        self.chat(ChatChunkChoice {
            index,
            delta: Delta {
                role: Some("assistant"),
                content: Some(String::new()),
                tool_calls: None,
            },
            logprobs: None,
            finish_reason: None,
        })
    }

    fn text(&self, d: &ChoiceDelta, offset: &mut usize) -> Bytes {
        match self.meta.kind {
            Kind::Completion => {
                let logprobs = self.meta.logprobs.then(|| {
                    let mut acc = ChoiceAcc {
                        text_offset: *offset,
                        ..Default::default()
                    };
                    acc.add_logprobs(&d.logprobs);
                    *offset = acc.text_offset;
                    acc.completion_lp
                });
                self.completion(CompletionChoice {
                    index: d.index,
                    text: d.text.clone(),
                    logprobs,
                    finish_reason: None,
                })
            }
            Kind::Chat => {
                let logprobs = self.meta.logprobs.then(|| ChatLogprobs {
                    content: d.logprobs.iter().map(chat_logprob).collect(),
                });
                self.chat(ChatChunkChoice {
                    index: d.index,
                    delta: Delta {
                        role: None,
                        content: Some(d.text.clone()),
                        tool_calls: None,
                    },
                    logprobs,
                    finish_reason: None,
                })
            }
        }
    }

    /// One chunk with every tool call of a chat choice, each complete (OpenAI's delta shape).
    fn tool_calls(&self, index: u32, calls: Vec<ToolCall>) -> Bytes {
        let deltas = calls
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                let out = tool_call_out(c);
                ToolCallDelta {
                    index: i as u32,
                    id: out.id,
                    kind: out.kind,
                    function: out.function,
                }
            })
            .collect();
        self.chat(ChatChunkChoice {
            index,
            delta: Delta {
                role: None,
                content: None,
                tool_calls: Some(deltas),
            },
            logprobs: None,
            finish_reason: None,
        })
    }

    fn finish(&self, index: u32, reason: &'static str) -> Bytes {
        match self.meta.kind {
            Kind::Completion => self.completion(CompletionChoice {
                index,
                text: String::new(),
                logprobs: None,
                finish_reason: Some(reason),
            }),
            Kind::Chat => self.chat(ChatChunkChoice {
                index,
                delta: Delta::default(),
                logprobs: None,
                finish_reason: Some(reason),
            }),
        }
    }

    fn usage(&self, usage: Usage) -> Bytes {
        let m = self.meta;
        match m.kind {
            Kind::Completion => sse_json(&Completion {
                id: &m.id,
                object: "text_completion",
                created: m.created,
                model: &m.model,
                choices: vec![],
                usage: Some(Some(usage)),
                system_fingerprint: None,
            }),
            Kind::Chat => sse_json(&ChatChunk {
                id: &m.id,
                object: "chat.completion.chunk",
                created: m.created,
                model: &m.model,
                system_fingerprint: None,
                choices: vec![],
                usage: Some(Some(usage)),
            }),
        }
    }

    fn completion(&self, choice: CompletionChoice) -> Bytes {
        let m = self.meta;
        sse_json(&Completion {
            id: &m.id,
            object: "text_completion",
            created: m.created,
            model: &m.model,
            choices: vec![choice],
            usage: self.usage_field(),
            system_fingerprint: None,
        })
    }

    fn chat(&self, choice: ChatChunkChoice) -> Bytes {
        let m = self.meta;
        sse_json(&ChatChunk {
            id: &m.id,
            object: "chat.completion.chunk",
            created: m.created,
            model: &m.model,
            system_fingerprint: None,
            choices: vec![choice],
            usage: self.usage_field(),
        })
    }
}

/// Writes the SSE stream of `gen` into `tx` until every choice finished, the engine failed,
/// or the client went away (`tx` closed: dropping `gen` then aborts the engine requests).
pub async fn stream_events(meta: ResponseMeta, mut gen: Generation, tx: mpsc::Sender<Bytes>) {
    let w = ChunkWriter { meta: &meta };
    let send = |b: Bytes| {
        let tx = tx.clone();
        async move { tx.send(b).await.is_ok() }
    };
    if meta.kind == Kind::Chat {
        for i in 0..gen.num_choices {
            if !send(w.role(i)).await {
                return;
            }
        }
    }
    let mut open = gen.num_choices;
    let mut completion_tokens = 0u32;
    let mut cached_tokens = 0u32;
    let mut spec = None;
    let mut offsets = vec![0usize; gen.num_choices as usize];
    // Chat replies that may hold tool calls: per choice, what is held back.
    let mut tool_streams: Vec<ToolStream> = match (&meta.kind, &meta.tools) {
        (Kind::Chat, ToolMode::Auto(_) | ToolMode::Required(_)) => (0..gen.num_choices)
            .map(|_| ToolStream::new(meta.tools.clone()))
            .collect(),
        _ => Vec::new(),
    };
    while open > 0 {
        let event = tokio::select! {
            ev = gen.events.recv() => ev,
            _ = tx.closed() => return,
        };
        let chunk_ok = match event {
            Some(Event::Delta(d)) => {
                completion_tokens += d.num_tokens;
                add_spec(&mut spec, d.spec);
                if gen.counts_cached(d.index) {
                    cached_tokens += d.cached_tokens.unwrap_or(0);
                }
                let mut ok = true;
                let mut d = d;
                let mut reason = d.finish_reason;
                let mut calls = Vec::new();
                if let Some(ts) = tool_streams.get_mut(d.index as usize) {
                    d.text = ts.push(&d.text);
                    if reason.is_some() {
                        let (rest, c) = ts.finish();
                        d.text.push_str(&rest);
                        if !c.is_empty() {
                            reason = Some("tool_calls");
                        }
                        calls = c;
                    }
                }
                if !d.text.is_empty() || !d.logprobs.is_empty() {
                    ok = send(w.text(&d, &mut offsets[d.index as usize])).await;
                }
                if !calls.is_empty() {
                    ok = ok && send(w.tool_calls(d.index, calls)).await;
                }
                if let Some(reason) = reason {
                    open -= 1;
                    ok = ok && send(w.finish(d.index, reason)).await;
                }
                ok
            }
            Some(Event::Failed(e)) => {
                let _ = send(Bytes::from(format!("data: {}\n\n", e.to_json()))).await;
                let _ = send(Bytes::from_static(SSE_DONE)).await;
                return;
            }
            None => {
                let e = ApiError::internal("the request's output channel closed");
                let _ = send(Bytes::from(format!("data: {}\n\n", e.to_json()))).await;
                let _ = send(Bytes::from_static(SSE_DONE)).await;
                return;
            }
        };
        if !chunk_ok {
            return;
        }
    }
    if meta.include_usage
        && !send(
            w.usage(
                Usage::new(gen.prompt_tokens, completion_tokens)
                    .with_cached_tokens(cached_tokens)
                    .with_spec(spec),
            ),
        )
        .await
    {
        return;
    }
    let _ = send(Bytes::from_static(SSE_DONE)).await;
}

/// A finished chat reply as content and tool calls: parsed when the request used tools
/// (finish_reason "tool_calls" when it made any), plain content otherwise.
fn reply(
    mode: &ToolMode,
    text: String,
    finish: Option<&'static str>,
) -> (Option<String>, Vec<ToolCallOut>, Option<&'static str>) {
    if let Some((content, calls)) = mode.parser().and_then(|p| tools::parse(p, &text)) {
        let calls = calls.into_iter().map(tool_call_out).collect();
        let content = (!content.is_empty()).then_some(content);
        return (content, calls, Some("tool_calls"));
    }
    (Some(text), Vec::new(), finish)
}

fn tool_call_out(c: ToolCall) -> ToolCallOut {
    ToolCallOut {
        id: c.id,
        kind: "function",
        function: FunctionCall {
            name: c.name,
            arguments: c.arguments,
        },
    }
}

/// Sums the choices' speculative decoding counts (absent when the engine does not speculate).
fn add_spec(
    total: &mut Option<harrier_shared::protocol::SpecDecodeCounts>,
    choice: Option<harrier_shared::protocol::SpecDecodeCounts>,
) {
    if let Some(c) = choice {
        let t = total.get_or_insert_with(Default::default);
        t.draft_tokens += c.draft_tokens;
        t.accepted_tokens += c.accepted_tokens;
    }
}

/// Waits for every choice and builds the non-streamed JSON response.
pub async fn collect(meta: &ResponseMeta, mut gen: Generation) -> Result<String, ApiError> {
    let mut acc = vec![ChoiceAcc::default(); gen.num_choices as usize];
    let mut open = gen.num_choices;
    let mut cached_tokens = 0u32;
    let mut spec = None;
    while open > 0 {
        match gen.events.recv().await {
            Some(Event::Delta(d)) => {
                add_spec(&mut spec, d.spec);
                if gen.counts_cached(d.index) {
                    cached_tokens += d.cached_tokens.unwrap_or(0);
                }
                let a = &mut acc[d.index as usize];
                a.text.push_str(&d.text);
                a.tokens += d.num_tokens;
                a.add_logprobs(&d.logprobs);
                if d.finish_reason.is_some() {
                    a.finish = d.finish_reason;
                    open -= 1;
                }
            }
            Some(Event::Failed(e)) => return Err(e),
            None => return Err(ApiError::internal("the request's output channel closed")),
        }
    }
    let usage = Usage::new(gen.prompt_tokens, acc.iter().map(|a| a.tokens).sum())
        .with_cached_tokens(cached_tokens)
        .with_spec(spec);
    let body = match meta.kind {
        Kind::Completion => serde_json::to_string(&Completion {
            id: &meta.id,
            object: "text_completion",
            created: meta.created,
            model: &meta.model,
            choices: acc
                .into_iter()
                .enumerate()
                .map(|(i, a)| CompletionChoice {
                    index: i as u32,
                    text: a.text,
                    logprobs: meta.logprobs.then_some(a.completion_lp),
                    finish_reason: a.finish,
                })
                .collect(),
            usage: Some(Some(usage)),
            system_fingerprint: None,
        }),
        Kind::Chat => serde_json::to_string(&ChatCompletion {
            id: &meta.id,
            object: "chat.completion",
            created: meta.created,
            model: &meta.model,
            choices: acc
                .into_iter()
                .enumerate()
                .map(|(i, a)| {
                    let (content, tool_calls, finish) = reply(&meta.tools, a.text, a.finish);
                    ChatChoice {
                        index: i as u32,
                        message: ChatMessage {
                            role: "assistant",
                            content,
                            refusal: None,
                            tool_calls,
                        },
                        logprobs: meta.logprobs.then_some(ChatLogprobs { content: a.chat_lp }),
                        finish_reason: finish,
                    }
                })
                .collect(),
            usage,
            system_fingerprint: None,
        }),
    };
    body.map_err(|e| ApiError::internal(format!("serializing the response: {e}")))
}

/// A response body fed by a channel (SSE). Dropping it (client gone) closes the channel.
pub struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
}

impl ChannelBody {
    pub fn new(rx: mpsc::Receiver<Bytes>) -> Self {
        Self { rx }
    }
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::ProcessorInput;

    fn gen(
        n: u32,
    ) -> (
        Generation,
        mpsc::UnboundedSender<Event>,
        std::sync::mpsc::Receiver<ProcessorInput>,
    ) {
        let (tx, events) = mpsc::unbounded_channel();
        let (ptx, prx) = std::sync::mpsc::channel();
        let guard = crate::engine::tests_support::guard(vec!["x".into()], ptx);
        (
            Generation {
                events,
                guard,
                num_choices: n,
                choices_per_prompt: n,
                prompt_tokens: 5,
            },
            tx,
            prx,
        )
    }

    fn meta(kind: Kind, include_usage: bool) -> ResponseMeta {
        ResponseMeta {
            id: "id-1".into(),
            created: 9,
            model: "m".into(),
            kind,
            logprobs: false,
            include_usage,
            tools: ToolMode::Off,
        }
    }

    fn cached(e: Event, n: u32) -> Event {
        match e {
            Event::Delta(d) => Event::Delta(ChoiceDelta {
                cached_tokens: Some(n),
                ..d
            }),
            other => other,
        }
    }

    fn delta(index: u32, text: &str, finish: Option<&'static str>) -> Event {
        Event::Delta(ChoiceDelta {
            index,
            text: text.into(),
            num_tokens: 1,
            logprobs: vec![],
            finish_reason: finish,
            cached_tokens: None,
            spec: None,
        })
    }

    async fn run_stream(m: ResponseMeta, n: u32, events: Vec<Event>) -> Vec<String> {
        let (g, etx, _prx) = gen(n);
        for e in events {
            etx.send(e).unwrap();
        }
        let (tx, mut rx) = mpsc::channel(100);
        stream_events(m, g, tx).await;
        let mut out = Vec::new();
        while let Ok(b) = rx.try_recv() {
            out.push(String::from_utf8(b.to_vec()).unwrap());
        }
        out
    }

    fn json(chunk: &str) -> serde_json::Value {
        serde_json::from_str(chunk.strip_prefix("data: ").unwrap().trim_end()).unwrap()
    }

    #[tokio::test]
    async fn chat_stream_order_and_usage() {
        let out = run_stream(
            meta(Kind::Chat, true),
            2,
            vec![
                cached(delta(0, "He", None), 4),
                cached(delta(1, "Yo", Some("length")), 4),
                delta(0, "llo", Some("stop")),
            ],
        )
        .await;
        assert_eq!(out.len(), 2 + 2 + 2 + 1 + 1 + 1, "{out:#?}");
        assert_eq!(
            json(&out[0])["choices"][0]["delta"],
            serde_json::json!({"role": "assistant", "content": ""})
        );
        assert_eq!(json(&out[2])["choices"][0]["delta"]["content"], "He");
        assert_eq!(json(&out[2])["usage"], serde_json::Value::Null);
        assert_eq!(
            json(&out[4])["choices"][0],
            serde_json::json!({"index": 1, "delta": {}, "logprobs": null, "finish_reason": "length"})
        );
        let usage = json(&out[7]);
        assert_eq!(usage["choices"], serde_json::json!([]));
        assert_eq!(
            usage["usage"],
            serde_json::json!({"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                "prompt_tokens_details": {"cached_tokens": 4}}),
            "cached prompt tokens count once per prompt, like prompt_tokens"
        );
        assert_eq!(out[8], "data: [DONE]\n\n");
        // Every chunk but the usage one has exactly one choice; finish reasons only on finals.
        let finals: Vec<_> = out[..7]
            .iter()
            .map(|c| json(c)["choices"][0]["finish_reason"].clone())
            .filter(|f| !f.is_null())
            .collect();
        assert_eq!(finals.len(), 2);
    }

    #[tokio::test]
    async fn completion_stream_without_usage() {
        let out = run_stream(
            meta(Kind::Completion, false),
            1,
            vec![delta(0, "a", None), delta(0, "", Some("stop"))],
        )
        .await;
        assert_eq!(out.len(), 3);
        let first = json(&out[0]);
        assert_eq!(first["object"], "text_completion");
        assert!(first.get("usage").is_none());
        assert_eq!(first["choices"][0]["text"], "a");
        assert_eq!(json(&out[1])["choices"][0]["finish_reason"], "stop");
        assert_eq!(out[2], "data: [DONE]\n\n");
    }

    #[tokio::test]
    async fn failure_ends_with_error_event_and_done() {
        let out = run_stream(
            meta(Kind::Completion, true),
            1,
            vec![
                delta(0, "a", None),
                Event::Failed(ApiError::engine_unavailable("gone")),
            ],
        )
        .await;
        assert_eq!(out.len(), 3);
        assert_eq!(json(&out[1])["error"]["code"], "engine_unavailable");
        assert_eq!(out[2], "data: [DONE]\n\n");
    }

    #[tokio::test]
    async fn collect_builds_the_response() {
        let (g, etx, _p) = gen(2);
        for e in [
            delta(1, "B", Some("length")),
            delta(0, "A", None),
            delta(0, "a", Some("stop")),
        ] {
            etx.send(e).unwrap();
        }
        let body = collect(&meta(Kind::Chat, false), g).await.unwrap();
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["content"], "Aa");
        assert_eq!(v["choices"][1]["finish_reason"], "length");
        assert_eq!(v["usage"]["completion_tokens"], 3);
        let (g, etx, _p) = gen(1);
        etx.send(Event::Failed(ApiError::engine_unavailable("x")))
            .unwrap();
        assert_eq!(
            collect(&meta(Kind::Completion, false), g)
                .await
                .unwrap_err()
                .status,
            hyper::StatusCode::SERVICE_UNAVAILABLE
        );
    }

    #[tokio::test]
    async fn closed_client_stops_the_stream_and_cancels() {
        let (g, _etx, prx) = gen(1);
        let (tx, rx) = mpsc::channel(1);
        drop(rx);
        stream_events(meta(Kind::Chat, false), g, tx).await;
        assert!(matches!(prx.try_recv().unwrap(), ProcessorInput::Cancel(ids) if ids == ["x"]));
    }
}
