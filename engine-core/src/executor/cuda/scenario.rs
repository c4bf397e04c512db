//! Request scenarios driven through a real CUDA engine by the device checks
//! (`graph_check`, `spec_check`): arrivals at given engine steps, run to completion.

use anyhow::{ensure, Context};
use harrier_shared::protocol::{EngineCoreRequest, FinishReason, SamplingParams, TokenId};

use crate::engine::{EngineCore, Progress};
use crate::executor::Executor;
use crate::request::Origin;

/// One request: arrives before engine step `at`.
pub struct Arrival {
    pub at: u64,
    pub prompt: Vec<TokenId>,
    pub sampling: SamplingParams,
}

/// Runs `reqs` to completion (request ids `{tag}-{index}`); returns each request's tokens.
/// Fails on a request that ends in error, an engine that idles with work left, or a run
/// that does not finish.
pub fn run<E: Executor>(
    engine: &mut EngineCore<E>,
    reqs: &[Arrival],
    tag: &str,
) -> anyhow::Result<Vec<Vec<TokenId>>> {
    let mut out = vec![Vec::new(); reqs.len()];
    let (mut done, mut step, mut next) = (0, 0u64, 0);
    while done < reqs.len() {
        while next < reqs.len() && reqs[next].at <= step {
            let r = &reqs[next];
            engine.add_request(
                Origin(0),
                EngineCoreRequest {
                    request_id: format!("{tag}-{next}"),
                    prompt_token_ids: r.prompt.clone(),
                    sampling: r.sampling.clone(),
                    arrival_time: 0.0,
                    cache_salt: None,
                },
            );
            next += 1;
        }
        let progress = engine.step().map_err(|e| anyhow::anyhow!("{}", e.0))?;
        step += 1;
        for (_, o) in engine.take_outputs() {
            let i: usize = o
                .request_id
                .rsplit('-')
                .next()
                .and_then(|x| x.parse().ok())
                .context("request id")?;
            out[i].extend_from_slice(&o.new_token_ids);
            if let Some(f) = &o.finish {
                ensure!(
                    f.reason != FinishReason::Error,
                    "request {i} failed: {:?}",
                    f.message
                );
                done += 1;
            }
        }
        ensure!(
            progress == Progress::Worked || engine.has_work() || next < reqs.len(),
            "engine idle with {} of {} requests unfinished",
            reqs.len() - done,
            reqs.len()
        );
        ensure!(step < 200_000, "scenario did not finish");
    }
    Ok(out)
}

/// Greedy sampling of `max_tokens` tokens, EOS ignored (every run has the same length).
pub fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    }
}
