//! Speculative sampling for one row (reference 003, D5): drafting over the row's processed
//! distribution, then lossless verification by rejection sampling.
//!
//! Both sides use [`RowSampler::process`], so a drafted token is drawn from, and judged
//! against, the same processed distributions that plain sampling uses (logit_bias, penalties,
//! the min_tokens mask, temperature, top-k/p, min-p). The row's state advances token by token:
//! while drafting, each drafted token is recorded so that the next position sees it (the
//! caller takes the records back with [`RowSampler::unrecord`] before verification); while
//! verifying, each emitted token is recorded for good, so position `i` of the verify step is
//! processed exactly as a plain decode step after the first `i` emitted tokens would be.
//!
//! Verification of proposals `t_1..t_k` against the target's rows `0..=k`:
//! - greedy rows: accept while `t_i` equals the processed argmax; the first mismatch emits
//!   the argmax instead; a bonus token (the argmax of row `k`) when all `k` pass. The output is
//!   exactly the non-speculative greedy output.
//! - sampled rows: accept `t_i` with probability `min(1, p(t_i) / q(t_i))`; on a rejection,
//!   emit a draw from `norm(max(0, p - q))` and stop; a bonus draw from row `k` when all pass.
//!   `q` is the draft's processed distribution, or a point mass on `t_i` for proposers without
//!   a model (n-gram lookup). The emitted tokens are distributed as the target's.
//!
//! Random numbers: each draw is `philox(key, n)` for the request's `n`-th generated token,
//! with one key per purpose: the request's seed for the emitted token's draw (so a round that
//! proposes nothing draws exactly what plain sampling draws), and the seed xor
//! [`DRAFT_KEY`] / [`ACCEPT_KEY`] for the draft's draw and the acceptance test. A seeded request
//! therefore gives the same text on every run with speculation on; it is not the text of the
//! same seed with speculation off (greedy requests excepted), because accepted tokens come from
//! the draft's draws.

use harrier_shared::protocol::TokenId;

use crate::batch::StepOutput;

use super::{draw, logprobs_of, philox, Dist, RowSampler, SamplerScratch};

/// Xored into a request's seed for the draft's draws.
pub const DRAFT_KEY: u64 = 0xd4af_7d4a_f7d4_af7d;
/// Xored into a request's seed for the acceptance tests.
pub const ACCEPT_KEY: u64 = 0xacce_97ac_ce97_acce;

/// The distribution each proposal was drawn from.
#[derive(Debug, Clone, Copy)]
pub enum Proposals<'a> {
    /// A draft model's normalised processed distributions, `k` rows of `vocab` (rows of
    /// greedy requests are not read).
    Model(&'a [f32]),
    /// Proposals without a distribution (n-gram lookup): a point mass on each token.
    PointMass,
}

/// The acceptance test of a sampled row (a knob only so that tests can show a wrong rule is
/// caught by the distribution test).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AcceptRule {
    /// Accept with `min(1, p / q)`; resample from `norm(max(0, p - q))` (lossless).
    #[default]
    Lossless,
    /// Wrong on purpose: accept with `p` (ignores `q`), resample from `p`.
    #[cfg(test)]
    IgnoreDraft,
}

impl RowSampler {
    /// Draft side: chooses the drafted token from the draft model's `logits` for the next
    /// position (modified in place), given the tokens drafted so far (recorded by the caller).
    /// For sampled rows `q` receives the normalised processed distribution the token was
    /// drawn from. The row does not advance.
    pub fn draft(
        &self,
        logits: &mut [f32],
        q: &mut [f32],
        scratch: &mut SamplerScratch,
    ) -> TokenId {
        match self.process(logits, scratch) {
            Dist::Greedy(t) => t,
            Dist::Probs { total } => {
                let u = philox::uniform(self.seed ^ DRAFT_KEY, self.generated as u64);
                let inv = 1.0 / total;
                for (q, &p) in q.iter_mut().zip(logits.iter()) {
                    *q = (p as f64 * inv) as f32;
                }
                draw(logits, total, u)
            }
        }
    }

    /// Verifies `proposals` against the target's logits (`proposals.len() + 1` rows of
    /// `vocab`, modified in place), records the emitted tokens (1 to `proposals.len() + 1`)
    /// and pushes them and their logprobs (from the raw target logits) onto `out.tokens` and
    /// `out.logprobs` (the caller pushes the count); returns how many proposals were
    /// accepted.
    pub fn verify(
        &mut self,
        target: &mut [f32],
        proposals: &[TokenId],
        dist: Proposals<'_>,
        rule: AcceptRule,
        scratch: &mut SamplerScratch,
        out: &mut StepOutput,
    ) -> u32 {
        let StepOutput {
            tokens, logprobs, ..
        } = out;
        let k = proposals.len();
        let vocab = target.len() / (k + 1);
        debug_assert_eq!(target.len(), vocab * (k + 1));
        let mut accepted = 0;
        for (i, row) in target.chunks_exact_mut(vocab).enumerate() {
            let want_logprobs = self.params.logprobs;
            if want_logprobs.is_some() {
                scratch.raw.clear();
                scratch.raw.extend_from_slice(row);
            }
            let n = self.generated as u64;
            let proposal = proposals.get(i).copied();
            let (token, stop) = match (self.process(row, scratch), proposal) {
                (Dist::Greedy(g), Some(t)) => (g, g != t),
                (Dist::Greedy(g), None) => (g, true),
                (Dist::Probs { total }, None) => {
                    (draw(row, total, philox::uniform(self.seed, n)), true)
                }
                (Dist::Probs { total }, Some(t)) => {
                    let q_at = |x: usize| match dist {
                        Proposals::Model(q) => q[i * vocab + x],
                        Proposals::PointMass => (x == t as usize) as u32 as f32,
                    };
                    let p_t = row[t as usize] as f64 / total;
                    let u = philox::uniform(self.seed ^ ACCEPT_KEY, n);
                    let accept = match rule {
                        AcceptRule::Lossless => u * (q_at(t as usize) as f64) < p_t,
                        #[cfg(test)]
                        AcceptRule::IgnoreDraft => u < p_t,
                    };
                    if accept {
                        (t, false)
                    } else {
                        let u = philox::uniform(self.seed, n);
                        let inv = 1.0 / total;
                        let residual = &mut scratch.values;
                        residual.clear();
                        let mut sum = 0.0f64;
                        for (x, &p) in row.iter().enumerate() {
                            let q = match rule {
                                AcceptRule::Lossless => q_at(x) as f64,
                                #[cfg(test)]
                                AcceptRule::IgnoreDraft => 0.0,
                            };
                            let r = (p as f64 * inv - q).max(0.0);
                            sum += r;
                            residual.push(r as f32);
                        }
                        // p == q up to rounding leaves nothing: the target's own draw.
                        let token = if sum > 0.0 {
                            draw(residual, sum, u)
                        } else {
                            draw(row, total, u)
                        };
                        (token, true)
                    }
                }
            };
            if let Some(n) = want_logprobs {
                logprobs.push(Some(logprobs_of(
                    &scratch.raw,
                    token,
                    n as usize,
                    &mut scratch.order,
                )));
            } else {
                logprobs.push(None);
            }
            tokens.push(token);
            self.record(token);
            if stop {
                break;
            }
            accepted += 1;
        }
        accepted
    }
}

#[cfg(test)]
#[path = "spec_tests.rs"]
mod tests;
