//! The benchmark's requests straight to an engine core over its protocol (token-id prompts
//! only; a planned hang-up becomes an `Abort`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harrier_shared::client::EngineClient;
use harrier_shared::endpoint::Endpoint;
use harrier_shared::protocol::{
    Abort, EngineCoreRequest, EngineMessage, FrontendMessage, SamplingParams,
};
use tokio::sync::mpsc;

use super::workload::{Plan, Prompt, RequestSpec};
use super::{Outcome, Sample, Target};

/// (arrival, new tokens, finished) of one engine output.
type OutputTick = (Instant, usize, bool);
type Routes = Arc<Mutex<HashMap<String, mpsc::UnboundedSender<OutputTick>>>>;

/// Straight to the engine: one connection, outputs routed to requests by id.
pub(super) struct EngineTarget {
    endpoint: Endpoint,
    client: EngineClient,
    routes: Routes,
    next: std::sync::atomic::AtomicU64,
}

impl EngineTarget {
    pub(super) async fn connect(ep: &Endpoint) -> anyhow::Result<Self> {
        let (client, mut rx, _info) =
            EngineClient::connect(ep, "bench", Duration::from_secs(10)).await?;
        let routes: Routes = Arc::default();
        let r = routes.clone();
        tokio::spawn(async move {
            while let Some(msg) = rx.recv().await {
                if let EngineMessage::Outputs(o) = msg {
                    let now = Instant::now();
                    let routes = r.lock().expect("routes");
                    for out in o.outputs {
                        if let Some(tx) = routes.get(&out.request_id) {
                            let _ = tx.send((now, out.new_token_ids.len(), out.finish.is_some()));
                        }
                    }
                }
            }
            // Connection lost: fail everyone still waiting.
            r.lock().expect("routes").clear();
        });
        Ok(Self {
            endpoint: ep.clone(),
            client,
            routes,
            next: Default::default(),
        })
    }

    async fn request(&self, spec: RequestSpec) -> anyhow::Result<Sample> {
        let Prompt::Tokens(prompt) = spec.prompt else {
            anyhow::bail!("an engine core takes token-id prompts only");
        };
        let cut_after = match spec.plan {
            Plan::Complete => None,
            Plan::Disconnect { after } => Some(after),
            Plan::Bad(_) => anyhow::bail!("invalid requests need the HTTP server"),
        };
        let id = format!(
            "bench-{}",
            self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let (tx, mut rx) = mpsc::unbounded_channel();
        self.routes.lock().expect("routes").insert(id.clone(), tx);
        let sampling = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(spec.output_len)
        };
        let start = Instant::now();
        let arrival_time = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let mut s = Sample::new(spec.plan);
        s.input_tokens = prompt.len() as u32;
        self.client
            .send(FrontendMessage::Request(EngineCoreRequest {
                request_id: id.clone(),
                prompt_token_ids: prompt,
                sampling,
                arrival_time,
                cache_salt: None,
            }))
            .await?;
        let mut last: Option<Instant> = None;
        let result = loop {
            if cut_after.is_some_and(|after| s.output_tokens >= after) {
                let abort = Abort {
                    request_ids: vec![id.clone()],
                };
                self.client.send(FrontendMessage::Abort(abort)).await?;
                s.outcome = Outcome::Disconnected;
                break Ok(());
            }
            let Some((at, n, done)) = rx.recv().await else {
                break Err(anyhow::anyhow!("engine connection lost"));
            };
            if n > 0 {
                s.text_chunk(start, &mut last, at);
                s.output_tokens += n as u32;
            }
            if done {
                s.outcome = Outcome::Completed;
                break Ok(());
            }
        };
        self.routes.lock().expect("routes").remove(&id);
        result?;
        s.latency = start.elapsed().as_secs_f64();
        Ok(s)
    }
}

impl Target for EngineTarget {
    fn describe(&self) -> String {
        format!("engine {}", self.endpoint)
    }

    fn try_run(&self, spec: RequestSpec) -> futures::future::BoxFuture<'_, anyhow::Result<Sample>> {
        Box::pin(self.request(spec))
    }
}
