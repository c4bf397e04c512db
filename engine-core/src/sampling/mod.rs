//! Logits processing and seeded sampling for one row (the CPU backend's sampler; the CUDA
//! sampler implements the same order and the same random stream).
//!
//! Order, as vLLM applies it:
//! 1. logprobs, if asked, from the *raw* model logits (log-softmax; top-n; rank of the sample);
//! 2. `logit_bias` added to the named tokens' logits;
//! 3. penalties: repetition (prompt and output tokens, HF's divide-or-multiply), then
//!    frequency and presence (OpenAI's, over output tokens);
//! 4. while fewer than `min_tokens` tokens were generated, EOS and stop ids are masked;
//! 5. greedy (`temperature == 0`): argmax, ties to the lowest id. Otherwise: temperature,
//!    top-k, softmax, top-p, min-p, then inverse-CDF sampling in token-id order with the
//!    uniform `philox(seed, n)` for the request's `n`-th generated token.
//!
//! Because the uniform depends only on (seed, n), a seeded request gets the same tokens
//! whatever its batch mates, arrival order or preemptions.

pub mod philox;
pub mod spec;

use std::collections::HashMap;

use harrier_shared::protocol::{SamplingParams, TokenId, TokenLogprobs};

use crate::batch::RowInit;

/// Per-row sampling state, owned by the backend (it advances with every *launched* sample,
/// committed or not, so it matches what the device knows).
#[derive(Debug, Clone)]
pub struct RowSampler {
    params: SamplingParams,
    seed: u64,
    min_tokens_mask: Vec<TokenId>,
    /// Tokens generated so far (the RNG counter of the next draw).
    generated: u32,
    /// Occurrences of each prompt and output token (repetition penalty: present or not);
    /// empty unless that penalty is on. Counts, not a set, so that a record can be undone.
    seen: HashMap<TokenId, u32>,
    /// Output token counts (frequency/presence penalties); empty unless one is on.
    output_counts: HashMap<TokenId, u32>,
}

/// What [`RowSampler::process`] made of a row of logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Dist {
    /// Greedy: the chosen token (argmax of the processed logits, ties to the lowest id).
    Greedy(TokenId),
    /// The logits now hold unnormalised probabilities (0 for filtered tokens) summing to
    /// `total` (> 0).
    Probs { total: f64 },
}

/// Reusable buffers for [`RowSampler::sample`].
#[derive(Debug, Default)]
pub struct SamplerScratch {
    raw: Vec<f32>,
    values: Vec<f32>,
    order: Vec<(f32, u32)>,
}

impl RowSampler {
    pub fn new(init: &RowInit) -> Self {
        let RowInit {
            row: _,
            sampling,
            seed,
            min_tokens_mask,
            prompt,
            output,
        } = init;
        let mut s = Self {
            params: sampling.clone(),
            seed: *seed,
            min_tokens_mask: min_tokens_mask.clone(),
            generated: 0,
            seen: HashMap::new(),
            output_counts: HashMap::new(),
        };
        if s.repetition_on() {
            for &t in prompt {
                *s.seen.entry(t).or_insert(0) += 1;
            }
        }
        for &t in output {
            s.record(t);
        }
        s
    }

    fn repetition_on(&self) -> bool {
        self.params.repetition_penalty != 1.0
    }

    fn counts_on(&self) -> bool {
        self.params.frequency_penalty != 0.0 || self.params.presence_penalty != 0.0
    }

    pub fn generated(&self) -> u32 {
        self.generated
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Advances the row past `token` (the RNG counter and the penalty state).
    pub fn record(&mut self, token: TokenId) {
        self.generated += 1;
        if self.repetition_on() {
            *self.seen.entry(token).or_insert(0) += 1;
        }
        if self.counts_on() {
            *self.output_counts.entry(token).or_insert(0) += 1;
        }
    }

    /// Undoes the latest [`Self::record`] of `token` (speculative decoding drafts ahead and
    /// takes its drafted tokens back before verification).
    pub fn unrecord(&mut self, token: TokenId) {
        debug_assert!(self.generated > 0, "unrecord without a record");
        self.generated -= 1;
        fn dec(m: &mut HashMap<TokenId, u32>, t: TokenId) {
            if let Some(c) = m.get_mut(&t) {
                *c -= 1;
                if *c == 0 {
                    m.remove(&t);
                }
            }
        }
        if self.repetition_on() {
            dec(&mut self.seen, token);
        }
        if self.counts_on() {
            dec(&mut self.output_counts, token);
        }
    }

    /// Samples the next token from `logits` (modified in place) and advances the row.
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        scratch: &mut SamplerScratch,
    ) -> (TokenId, Option<TokenLogprobs>) {
        let want_logprobs = self.params.logprobs;
        if want_logprobs.is_some() {
            scratch.raw.clear();
            scratch.raw.extend_from_slice(logits);
        }
        let token = match self.process(logits, scratch) {
            Dist::Greedy(t) => t,
            Dist::Probs { total } => draw(
                logits,
                total,
                philox::uniform(self.seed, self.generated as u64),
            ),
        };
        let logprobs =
            want_logprobs.map(|n| logprobs_of(&scratch.raw, token, n as usize, &mut scratch.order));
        self.record(token);
        (token, logprobs)
    }

    /// The whole processing of the row's next-token logits, in vLLM's order, given the row's
    /// state (tokens recorded so far): logit_bias, penalties, the min_tokens mask, then for
    /// greedy rows the argmax, otherwise temperature, top-k, softmax, top-p and min-p (the
    /// logits become unnormalised probabilities). The row does not advance.
    pub fn process(&self, logits: &mut [f32], scratch: &mut SamplerScratch) -> Dist {
        for &(t, bias) in &self.params.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += bias;
            }
        }
        self.apply_penalties(logits);
        if self.generated < self.params.min_tokens {
            for &t in &self.min_tokens_mask {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        if self.params.is_greedy() {
            Dist::Greedy(argmax(logits))
        } else {
            self.to_probs(logits, scratch)
        }
    }

    fn apply_penalties(&self, logits: &mut [f32]) {
        let rep = self.params.repetition_penalty;
        if self.repetition_on() {
            for &t in self.seen.keys() {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / rep } else { *l * rep };
                }
            }
        }
        if self.counts_on() {
            for (&t, &count) in &self.output_counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -=
                        self.params.frequency_penalty * count as f32 + self.params.presence_penalty;
                }
            }
        }
    }

    /// Temperature, top-k, softmax, top-p and min-p in place.
    fn to_probs(&self, logits: &mut [f32], scratch: &mut SamplerScratch) -> Dist {
        let inv_t = 1.0 / self.params.temperature;
        for l in logits.iter_mut() {
            *l *= inv_t;
        }
        if let Some(k) = self.params.top_k {
            let k = k as usize;
            if k < logits.len() {
                scratch.values.clear();
                scratch.values.extend_from_slice(logits);
                let (_, kth, _) = scratch
                    .values
                    .select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
                let threshold = *kth;
                for l in logits.iter_mut() {
                    if *l < threshold {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
        }
        // Softmax in place: logits become unnormalised probabilities.
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            // Everything masked: the lowest id, as greedy would pick (a point mass).
            let t = argmax(logits);
            logits.fill(0.0);
            logits[t as usize] = 1.0;
            return Dist::Probs { total: 1.0 };
        }
        let mut sum = 0.0f64;
        for l in logits.iter_mut() {
            *l = (*l - max).exp();
            sum += *l as f64;
        }
        if self.params.top_p < 1.0 {
            scratch.order.clear();
            scratch.order.extend(
                logits
                    .iter()
                    .enumerate()
                    .filter(|(_, &p)| p > 0.0)
                    .map(|(i, &p)| (p, i as u32)),
            );
            scratch
                .order
                .sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let target = self.params.top_p as f64 * sum;
            let mut cum = 0.0f64;
            let mut keep = scratch.order.len();
            for (i, &(p, _)) in scratch.order.iter().enumerate() {
                cum += p as f64;
                if cum >= target {
                    keep = i + 1;
                    break;
                }
            }
            for &(_, id) in &scratch.order[keep..] {
                logits[id as usize] = 0.0;
            }
        }
        if self.params.min_p > 0.0 {
            // The largest probability is exp(0) = 1 before normalisation.
            let threshold = self.params.min_p;
            for p in logits.iter_mut() {
                if *p < threshold {
                    *p = 0.0;
                }
            }
        }
        let total: f64 = logits.iter().map(|&p| p as f64).sum();
        Dist::Probs { total }
    }
}

/// Inverse-CDF draw in token-id order from unnormalised probabilities summing to `total`.
pub fn draw(probs: &[f32], total: f64, u: f64) -> TokenId {
    let target = u * total;
    let mut cum = 0.0f64;
    let mut last_kept = 0;
    for (i, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            cum += p as f64;
            last_kept = i;
            if cum > target {
                return i as TokenId;
            }
        }
    }
    last_kept as TokenId
}

/// Index of the largest value, ties to the lowest index; NaN never wins.
pub fn argmax(values: &[f32]) -> TokenId {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in values.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best as TokenId
}

/// `log(sum(exp(raw)))`, shifted by the maximum.
fn log_sum_exp(raw: &[f32]) -> f64 {
    let max = raw.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    max as f64
        + raw
            .iter()
            .map(|&l| ((l - max) as f64).exp())
            .sum::<f64>()
            .ln()
}

/// The log-softmax of `raw` at `i`.
pub fn log_softmax_at(raw: &[f32], i: usize) -> f64 {
    raw[i] as f64 - log_sum_exp(raw)
}

/// Log-softmax facts about `raw` for the sampled `token` and the top `n`.
fn logprobs_of(
    raw: &[f32],
    token: TokenId,
    n: usize,
    order: &mut Vec<(f32, u32)>,
) -> TokenLogprobs {
    let lse = log_sum_exp(raw);
    let lp = |l: f32| (l as f64 - lse) as f32;
    let sampled = raw[token as usize];
    let rank = 1 + raw.iter().filter(|&&l| l > sampled).count() as u32;
    let mut top = Vec::with_capacity(n);
    if n > 0 {
        order.clear();
        order.extend(raw.iter().enumerate().map(|(i, &l)| (l, i as u32)));
        let n = n.min(order.len());
        order.select_nth_unstable_by(n - 1, |a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        order[..n].sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        top.extend(order[..n].iter().map(|&(l, i)| (i, lp(l))));
    }
    TokenLogprobs {
        token_id: token,
        logprob: lp(sampled),
        rank,
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::RowId;

    fn row(params: SamplingParams, seed: u64) -> RowSampler {
        RowSampler::new(&RowInit {
            row: RowId(0),
            sampling: params,
            seed,
            min_tokens_mask: vec![3],
            prompt: vec![1, 1, 2],
            output: vec![],
        })
    }

    fn sample(r: &mut RowSampler, logits: &[f32]) -> TokenId {
        r.sample(&mut logits.to_vec(), &mut SamplerScratch::default())
            .0
    }

    #[test]
    fn greedy_is_argmax_with_low_ties() {
        let mut r = row(SamplingParams::greedy(10), 0);
        assert_eq!(sample(&mut r, &[0.0, 2.0, 2.0, 1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0]), 1);
    }

    #[test]
    fn seeded_draws_depend_only_on_seed_and_position() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..SamplingParams::default()
        };
        let a: Vec<_> = {
            let mut r = row(p.clone(), 7);
            (0..20).map(|_| sample(&mut r, &logits)).collect()
        };
        let b: Vec<_> = {
            let mut r = row(p.clone(), 7);
            (0..20).map(|_| sample(&mut r, &logits)).collect()
        };
        assert_eq!(a, b);
        let c: Vec<_> = {
            let mut r = row(p, 8);
            (0..20).map(|_| sample(&mut r, &logits)).collect()
        };
        assert_ne!(a, c);
    }

    /// Chi-square of 20,000 draws against softmax(logits / T).
    fn chi_square(params: SamplingParams, logits: &[f32], expected_probs: &[f64]) -> f64 {
        let n = 20_000;
        let mut counts = vec![0u32; logits.len()];
        let mut r = row(params, 1234);
        let mut scratch = SamplerScratch::default();
        for _ in 0..n {
            let t = r.sample(&mut logits.to_vec(), &mut scratch).0;
            counts[t as usize] += 1;
        }
        let mut chi2 = 0.0;
        for (c, &p) in counts.iter().zip(expected_probs) {
            if p == 0.0 {
                assert_eq!(*c, 0, "a filtered token was sampled");
            } else {
                let e = p * n as f64;
                chi2 += (*c as f64 - e).powi(2) / e;
            }
        }
        chi2
    }

    fn softmax(l: &[f64]) -> Vec<f64> {
        let m = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = l.iter().map(|x| (x - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    }

    const LOGITS: [f32; 5] = [1.0, 2.0, 0.5, -1.0, 1.5];

    #[test]
    fn logit_bias_shifts_the_distribution_and_the_greedy_choice() {
        // Greedy: -100 on the argmax moves the choice; ids past the vocabulary are ignored.
        let greedy = SamplingParams {
            logit_bias: vec![(1, -100.0), (99, 5.0)],
            ..SamplingParams::greedy(10)
        };
        assert_eq!(sample(&mut row(greedy, 0), &[0.0, 2.0, 1.5, 1.0]), 2);
        // Sampling: the bias is added before the softmax, so +ln(4) makes token 0 four
        // times likelier relative to the rest.
        let b = 4f64.ln();
        let mut biased = LOGITS.map(|l| l as f64);
        biased[0] += b;
        let expected = softmax(&biased);
        let chi2 = chi_square(
            SamplingParams {
                logit_bias: vec![(0, b as f32)],
                ..SamplingParams::default()
            },
            &LOGITS,
            &expected,
        );
        assert!(chi2 < 18.5, "chi2 {chi2} (4 dof, p=0.001)");
        // Logprobs stay those of the raw logits.
        let p = SamplingParams {
            logprobs: Some(1),
            logit_bias: vec![(0, 100.0)],
            ..SamplingParams::greedy(10)
        };
        let logits = [0.0f32, 2.0, 1.0];
        let (tok, lp) = row(p, 0).sample(&mut logits.to_vec(), &mut SamplerScratch::default());
        let lp = lp.expect("logprobs");
        assert_eq!((tok, lp.top[0].0, lp.rank), (0, 1, 3));
    }

    #[test]
    fn temperature_distribution() {
        let t = 0.7;
        let expected = softmax(&LOGITS.map(|l| l as f64 / t));
        let chi2 = chi_square(
            SamplingParams {
                temperature: t as f32,
                ..SamplingParams::default()
            },
            &LOGITS,
            &expected,
        );
        assert!(chi2 < 18.5, "chi2 {chi2} (4 dof, p=0.001)");
    }

    #[test]
    fn top_k_distribution() {
        let full = softmax(&LOGITS.map(|l| l as f64));
        // top-2: tokens 1 (2.0) and 4 (1.5).
        let s = full[1] + full[4];
        let expected = [0.0, full[1] / s, 0.0, 0.0, full[4] / s];
        let chi2 = chi_square(
            SamplingParams {
                top_k: Some(2),
                ..SamplingParams::default()
            },
            &LOGITS,
            &expected,
        );
        assert!(chi2 < 10.8, "chi2 {chi2} (1 dof)");
    }

    #[test]
    fn top_p_distribution() {
        let full = softmax(&LOGITS.map(|l| l as f64));
        // Sorted: 1 (0.38), 4 (0.23), 0 (0.14), ...; top_p 0.6 keeps {1, 4} (0.61 >= 0.6).
        let s = full[1] + full[4];
        let expected = [0.0, full[1] / s, 0.0, 0.0, full[4] / s];
        let chi2 = chi_square(
            SamplingParams {
                top_p: 0.6,
                ..SamplingParams::default()
            },
            &LOGITS,
            &expected,
        );
        assert!(chi2 < 10.8, "chi2 {chi2}");
    }

    #[test]
    fn min_p_distribution() {
        let full = softmax(&LOGITS.map(|l| l as f64));
        // min_p 0.5: keep tokens with p >= 0.5 * p_max: exp(l - 2) >= 0.5 -> l >= 1.307: {1, 4}.
        let s = full[1] + full[4];
        let expected = [0.0, full[1] / s, 0.0, 0.0, full[4] / s];
        let chi2 = chi_square(
            SamplingParams {
                min_p: 0.5,
                ..SamplingParams::default()
            },
            &LOGITS,
            &expected,
        );
        assert!(chi2 < 10.8, "chi2 {chi2}");
    }

    #[test]
    fn penalties() {
        // Repetition: prompt tokens 1 and 2 are penalised once each.
        let r = row(
            SamplingParams {
                repetition_penalty: 2.0,
                ..SamplingParams::greedy(10)
            },
            0,
        );
        let mut l = vec![1.0, 4.0, -1.0, 0.0];
        r.apply_penalties(&mut l);
        assert_eq!(l, vec![1.0, 2.0, -2.0, 0.0]);
        // Frequency and presence over output tokens only.
        let mut r = row(
            SamplingParams {
                frequency_penalty: 0.5,
                presence_penalty: 0.25,
                ..SamplingParams::greedy(10)
            },
            0,
        );
        r.record(0);
        r.record(0);
        r.record(2);
        let mut l = vec![1.0, 1.0, 1.0, 1.0];
        r.apply_penalties(&mut l);
        assert_eq!(l, vec![1.0 - 1.0 - 0.25, 1.0, 1.0 - 0.5 - 0.25, 1.0]);
    }

    #[test]
    fn min_tokens_masks_stop_ids() {
        let mut r = row(
            SamplingParams {
                min_tokens: 2,
                ..SamplingParams::greedy(10)
            },
            0,
        );
        let logits = [0.0, 0.0, 0.0, 9.0];
        assert_ne!(sample(&mut r, &logits), 3);
        assert_ne!(sample(&mut r, &logits), 3);
        assert_eq!(sample(&mut r, &logits), 3);
    }

    #[test]
    fn logprobs_are_raw_log_softmax() {
        let p = SamplingParams {
            logprobs: Some(2),
            repetition_penalty: 5.0,
            ..SamplingParams::greedy(10)
        };
        let mut r = row(p, 0);
        let logits = [1.0f32, 3.0, 2.0, 0.0];
        let (t, lp) = r.sample(&mut logits.to_vec(), &mut SamplerScratch::default());
        let lp = lp.unwrap();
        // Prompt tokens 1 and 2 are penalised (3/5, 2/5), so greedy picks token 0; logprobs
        // still describe the raw logits.
        assert_eq!(t, 0);
        let lse = logits.iter().map(|&l| (l as f64).exp()).sum::<f64>().ln();
        assert!((lp.logprob as f64 - (1.0 - lse)).abs() < 1e-6);
        assert_eq!(lp.rank, 3);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
    }

    #[test]
    fn resumed_row_continues_the_stream() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.11).cos()).collect();
        let p = SamplingParams {
            temperature: 0.9,
            ..SamplingParams::default()
        };
        let mut r = row(p.clone(), 99);
        let first: Vec<_> = (0..6).map(|_| sample(&mut r, &logits)).collect();
        let mut resumed = RowSampler::new(&RowInit {
            row: RowId(0),
            sampling: p,
            seed: 99,
            min_tokens_mask: vec![3],
            prompt: vec![1, 1, 2],
            output: first[..3].to_vec(),
        });
        let rest: Vec<_> = (0..3).map(|_| sample(&mut resumed, &logits)).collect();
        assert_eq!(rest, first[3..]);
    }
}
