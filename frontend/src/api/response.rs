//! Response bodies and stream chunks, field for field as OpenAI sends them.

use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
    /// Speculative decoding (Harrier's extension; only when the server speculates): tokens
    /// proposed for this response, those accepted, and their ratio.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative_decoding: Option<SpecUsage>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct SpecUsage {
    pub draft_tokens: u32,
    pub accepted_tokens: u32,
    /// `accepted_tokens / draft_tokens` (0 with no proposals).
    pub acceptance_rate: f32,
}

/// OpenAI's `usage.prompt_tokens_details`: prompt tokens served from the prefix cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

impl Usage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails::default(),
            speculative_decoding: None,
        }
    }

    pub fn with_spec(mut self, spec: Option<harrier_shared::protocol::SpecDecodeCounts>) -> Self {
        self.speculative_decoding = spec.map(|s| SpecUsage {
            draft_tokens: s.draft_tokens,
            accepted_tokens: s.accepted_tokens,
            acceptance_rate: if s.draft_tokens == 0 {
                0.0
            } else {
                s.accepted_tokens as f32 / s.draft_tokens as f32
            },
        });
        self
    }

    pub fn with_cached_tokens(mut self, cached_tokens: u32) -> Self {
        self.prompt_tokens_details.cached_tokens = cached_tokens;
        self
    }
}

/// A JSON object whose entries keep the given order (`{"token": logprob, ...}`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OrderedMap(pub Vec<(String, f32)>);

impl Serialize for OrderedMap {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

/// Completions `logprobs`: parallel lists, one entry per token.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<OrderedMap>,
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// `text_completion`: the non-streamed response and each stream chunk (same shape).
#[derive(Debug, Clone, Serialize)]
pub struct Completion<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<CompletionChoice>,
    /// Absent, `null` (stream chunks when usage was asked for), or the usage.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
    pub system_fingerprint: Option<&'static str>,
}

/// Chat `logprobs.content[i]` and its `top_logprobs[j]`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<Vec<ChatTokenLogprob>>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatMessage {
    pub role: &'static str,
    /// `null` when the reply is only tool calls.
    pub content: Option<String>,
    pub refusal: Option<&'static str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

/// A tool call in a response (`message.tool_calls[i]`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: String,
}

/// A tool call in a stream chunk (`delta.tool_calls[i]`): all of it in one delta.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallDelta {
    pub index: u32,
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: ChatMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    pub system_fingerprint: Option<&'static str>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// `chat.completion.chunk`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunk<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub system_fingerprint: Option<&'static str>,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

/// One server-sent event carrying JSON: `data: {...}\n\n`.
pub fn sse_json<T: Serialize>(value: &T) -> bytes::Bytes {
    let mut buf = b"data: ".to_vec();
    serde_json::to_writer(&mut buf, value).expect("chunk JSON");
    buf.extend_from_slice(b"\n\n");
    buf.into()
}

/// The stream terminator.
pub const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

#[derive(Debug, Clone, Serialize)]
pub struct ModelCard<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub root: &'a str,
    pub parent: Option<&'static str>,
    pub max_model_len: u32,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelList<'a> {
    pub object: &'static str,
    pub data: Vec<ModelCard<'a>>,
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn completion_chunk_format() {
        let c = Completion {
            id: "cmpl-1",
            object: "text_completion",
            created: 7,
            model: "m",
            choices: vec![CompletionChoice {
                index: 0,
                text: "hi".into(),
                logprobs: None,
                finish_reason: None,
            }],
            usage: Some(None),
            system_fingerprint: None,
        };
        let b = sse_json(&c);
        let s = std::str::from_utf8(&b).unwrap();
        assert!(s.starts_with("data: {") && s.ends_with("}\n\n"), "{s}");
        let v: serde_json::Value = serde_json::from_str(&s[6..]).unwrap();
        assert_eq!(
            v,
            json!({"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
                   "choices": [{"index": 0, "text": "hi", "logprobs": null, "finish_reason": null}],
                   "usage": null, "system_fingerprint": null})
        );
        // Without include_usage the field is absent.
        let v = serde_json::to_value(Completion { usage: None, ..c }).unwrap();
        assert!(v.get("usage").is_none());
    }

    #[test]
    fn chat_chunk_format() {
        let c = ChatChunk {
            id: "chatcmpl-1",
            object: "chat.completion.chunk",
            created: 1,
            model: "m",
            system_fingerprint: None,
            choices: vec![ChatChunkChoice {
                index: 1,
                delta: Delta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                    tool_calls: None,
                },
                logprobs: None,
                finish_reason: None,
            }],
            usage: None,
        };
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(
            v,
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "system_fingerprint": null,
                   "choices": [{"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]})
        );
        let last = ChatChunkChoice {
            index: 0,
            delta: Delta::default(),
            logprobs: None,
            finish_reason: Some("stop"),
        };
        assert_eq!(
            serde_json::to_value(last).unwrap(),
            json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": "stop"})
        );
    }

    #[test]
    fn usage_and_logprob_maps() {
        assert_eq!(
            serde_json::to_value(Usage::new(3, 4)).unwrap(),
            json!({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}})
        );
        let m = OrderedMap(vec![("z".into(), -0.5), ("a".into(), -1.0)]);
        assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"z":-0.5,"a":-1.0}"#);
        assert_eq!(SSE_DONE, b"data: [DONE]\n\n");
    }
}
