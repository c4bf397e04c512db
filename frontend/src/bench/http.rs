//! The benchmark's requests over HTTP: one fresh connection per request, streamed, checked.

use std::time::Instant;

use anyhow::{bail, Context};
use bytes::Bytes;
use hyper::{Method, StatusCode};

use super::workload::{Plan, Prompt, RequestSpec, BAD_REQUESTS};
use super::{BenchServeArgs, Outcome, Sample, Target};
use crate::http_client::{BaseUrl, Conn, SseReader};

pub(super) struct HttpTarget {
    base: BaseUrl,
    model: String,
    api_key: Option<String>,
}

impl HttpTarget {
    pub(super) async fn new(args: &BenchServeArgs) -> anyhow::Result<Self> {
        let base = BaseUrl::parse(&args.base_url).await?;
        let model = match &args.model {
            Some(m) => m.clone(),
            None => {
                let mut conn = Conn::connect(&base, args.api_key.as_deref()).await?;
                let (status, body) = conn.call(Method::GET, "/v1/models", None).await?;
                if status != StatusCode::OK {
                    bail!(
                        "GET /v1/models answered {status}: {}",
                        String::from_utf8_lossy(&body)
                    );
                }
                let v: serde_json::Value = serde_json::from_slice(&body)?;
                v["data"][0]["id"]
                    .as_str()
                    .context("no model in /v1/models")?
                    .to_owned()
            }
        };
        Ok(Self {
            base,
            model,
            api_key: args.api_key.clone(),
        })
    }

    async fn request(&self, spec: RequestSpec) -> anyhow::Result<Sample> {
        let start = Instant::now();
        let mut conn = Conn::connect(&self.base, self.api_key.as_deref()).await?;
        let cut_after = match spec.plan {
            Plan::Bad(i) => return self.bad(conn, i).await,
            Plan::Disconnect { after } => Some(after),
            Plan::Complete => None,
        };
        let common = serde_json::json!({
            "model": self.model, "max_tokens": spec.output_len, "ignore_eos": true,
            "temperature": 0.0, "stream": true, "stream_options": {"include_usage": true},
        });
        let (path, mut body) = match &spec.prompt {
            Prompt::Tokens(ids) => ("/v1/completions", serde_json::json!({ "prompt": ids })),
            Prompt::Chat(text) => (
                "/v1/chat/completions",
                serde_json::json!({ "messages": [{"role": "user", "content": text}] }),
            ),
        };
        for (k, v) in common.as_object().expect("object") {
            body[k] = v.clone();
        }
        let (status, body) = conn
            .send(Method::POST, path, Some(Bytes::from(body.to_string())))
            .await?;
        if status != StatusCode::OK {
            use http_body_util::BodyExt;
            let text = body
                .collect()
                .await
                .map(|c| c.to_bytes())
                .unwrap_or_default();
            bail!("HTTP {status}: {}", String::from_utf8_lossy(&text));
        }
        let mut s = Sample::new(spec.plan);
        if let Prompt::Tokens(ids) = &spec.prompt {
            s.input_tokens = ids.len() as u32;
        }
        if cut_after == Some(0) {
            s.outcome = Outcome::Disconnected;
            return Ok(s); // dropping the body and the connection hangs up
        }
        let mut sse = SseReader::new(body);
        let (mut last, mut chunks, mut finish, mut done) = (None, 0, None::<String>, false);
        while let Some(data) = sse.next().await? {
            if data == "[DONE]" {
                done = true;
                break;
            }
            let v: serde_json::Value = serde_json::from_str(&data)?;
            if let Some(e) = v.get("error") {
                bail!("error event: {e}");
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                s.output_tokens = u["completion_tokens"].as_u64().unwrap_or(0) as u32;
                s.input_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as u32;
            }
            let mut has_text = false;
            for c in v["choices"].as_array().into_iter().flatten() {
                let text = c["text"].as_str().or(c["delta"]["content"].as_str());
                has_text |= text.is_some_and(|t| !t.is_empty());
                if let Some(r) = c["finish_reason"].as_str() {
                    if let Some(first) = finish.replace(r.to_owned()) {
                        bail!("two finish reasons ({first}, {r})");
                    }
                }
            }
            if has_text {
                s.text_chunk(start, &mut last, Instant::now());
                chunks += 1;
                if cut_after == Some(chunks) {
                    s.outcome = Outcome::Disconnected;
                    return Ok(s);
                }
            }
        }
        if !done {
            bail!("the stream ended without [DONE]");
        }
        let Some(reason) = finish else {
            bail!("the stream ended without a finish reason");
        };
        if reason != "length" || s.output_tokens != spec.output_len {
            bail!(
                "finish_reason {reason:?} after {} tokens; asked for {} with ignore_eos",
                s.output_tokens,
                spec.output_len
            );
        }
        s.latency = start.elapsed().as_secs_f64();
        s.outcome = Outcome::Completed;
        Ok(s)
    }

    /// Invalid request `BAD_REQUESTS[i]`: it must get its status and an OpenAI error object.
    async fn bad(&self, mut conn: Conn, i: usize) -> anyhow::Result<Sample> {
        let bad = &BAD_REQUESTS[i];
        let body = Bytes::from((bad.body)(&self.model));
        let (status, body) = conn.call(Method::POST, bad.path, Some(body)).await?;
        let text = String::from_utf8_lossy(&body);
        if status.as_u16() != bad.status {
            bail!(
                "{}: HTTP {status} (wanted {}): {text}",
                bad.name,
                bad.status
            );
        }
        let v: serde_json::Value = serde_json::from_slice(&body)
            .with_context(|| format!("{}: the error is not JSON: {text}", bad.name))?;
        if !(v["error"]["message"].is_string() && v["error"]["type"].is_string()) {
            bail!("{}: not an OpenAI error object: {text}", bad.name);
        }
        Ok(Sample::ended(Plan::Bad(i), Outcome::Rejected))
    }
}

impl Target for HttpTarget {
    fn describe(&self) -> String {
        format!("http://{}{}", self.base.host, self.base.prefix)
    }

    fn try_run(&self, spec: RequestSpec) -> futures::future::BoxFuture<'_, anyhow::Result<Sample>> {
        Box::pin(self.request(spec))
    }
}
