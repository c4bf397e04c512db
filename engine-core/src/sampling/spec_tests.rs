use harrier_shared::protocol::SamplingParams;

use super::*;
use crate::batch::{RowId, RowInit, StepOutput};

fn row(params: SamplingParams, seed: u64) -> RowSampler {
    RowSampler::new(&RowInit {
        row: RowId(0),
        sampling: params,
        seed,
        min_tokens_mask: vec![],
        prompt: vec![0],
        output: vec![],
    })
}

fn softmax(l: &[f32]) -> Vec<f64> {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = l.iter().map(|&x| (x as f64 - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

/// Runs one verification of `proposals` against `target` rows; returns the emitted tokens.
fn verify(r: &mut RowSampler, target: &[f32], proposals: &[u32], dist: Proposals) -> Vec<u32> {
    let mut out = StepOutput::default();
    let accepted = r.verify(
        &mut target.to_vec(),
        proposals,
        dist,
        AcceptRule::Lossless,
        &mut SamplerScratch::default(),
        &mut out,
    );
    assert_eq!(accepted as usize + 1, out.tokens.len());
    assert_eq!(out.logprobs.len(), out.tokens.len());
    out.tokens
}

#[test]
fn greedy_accepts_while_the_argmax_matches() {
    // Three rows of 4 tokens: argmax 2, then 1, then 3 (the bonus).
    let target = [0., 1., 5., 2., 0., 4., 1., 2., 1., 0., 0., 9.];
    let g = SamplingParams::greedy(10);
    assert_eq!(
        verify(
            &mut row(g.clone(), 0),
            &target,
            &[2, 1],
            Proposals::PointMass
        ),
        [2, 1, 3]
    );
    assert_eq!(
        verify(
            &mut row(g.clone(), 0),
            &target,
            &[2, 0],
            Proposals::PointMass
        ),
        [2, 1]
    );
    assert_eq!(
        verify(
            &mut row(g.clone(), 0),
            &target,
            &[3, 1],
            Proposals::PointMass
        ),
        [2]
    );
    // No proposals: plain greedy decoding.
    assert_eq!(
        verify(&mut row(g, 0), &target[..4], &[], Proposals::PointMass),
        [2]
    );
}

#[test]
fn greedy_verification_sees_the_emitted_tokens_penalties() {
    // With a repetition penalty, position 1 is processed after token 2 was recorded: its
    // logit 5 -> 5/10 falls below token 1's 4, so the argmax of row 1 is 1 although the raw
    // argmax of row 1 is 2.
    let p = SamplingParams {
        repetition_penalty: 10.0,
        ..SamplingParams::greedy(10)
    };
    let target = [0., 1., 5., 2., 0., 4., 5., 2.];
    assert_eq!(
        verify(&mut row(p.clone(), 0), &target, &[2], Proposals::PointMass),
        [2, 1]
    );
    // The same as two plain greedy steps.
    let mut plain = row(p, 0);
    let mut s = SamplerScratch::default();
    let a = plain.sample(&mut target[..4].to_vec(), &mut s).0;
    let b = plain.sample(&mut target[4..].to_vec(), &mut s).0;
    assert_eq!([a, b], [2, 1]);
}

#[test]
fn no_proposals_draws_what_plain_sampling_draws() {
    let logits: Vec<f32> = (0..40).map(|i| (i as f32 * 0.7).sin() * 2.0).collect();
    let p = SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        ..SamplingParams::default()
    };
    for seed in 0..50 {
        let mut a = row(p.clone(), seed);
        let mut b = row(p.clone(), seed);
        let plain = a
            .sample(&mut logits.clone(), &mut SamplerScratch::default())
            .0;
        assert_eq!(verify(&mut b, &logits, &[], Proposals::PointMass), [plain]);
        assert_eq!(a.generated(), b.generated());
    }
}

const TARGET: [f32; 6] = [1.0, 2.0, 0.5, -1.0, 1.5, 0.0];
const DRAFT: [f32; 6] = [2.0, 0.0, 1.5, 1.0, -1.0, 0.5];

/// First emitted token of `n` seeded rounds (one drafted token from `DRAFT`, verified against
/// `TARGET`) under `rule`; chi-square of their counts against softmax(TARGET).
fn first_token_chi2(rule: AcceptRule, n: u64) -> f64 {
    let p = SamplingParams {
        temperature: 1.0,
        ..SamplingParams::default()
    };
    let v = TARGET.len();
    let mut counts = vec![0u32; v];
    let mut scratch = SamplerScratch::default();
    let mut target = vec![0.0; 2 * v];
    for seed in 0..n {
        let mut r = row(p.clone(), seed);
        let mut q = vec![0.0; v];
        let t = r.draft(&mut DRAFT.to_vec(), &mut q, &mut scratch);
        target[..v].copy_from_slice(&TARGET);
        target[v..].copy_from_slice(&TARGET);
        let mut out = StepOutput::default();
        r.verify(
            &mut target,
            &[t],
            Proposals::Model(&q),
            rule,
            &mut scratch,
            &mut out,
        );
        counts[out.tokens[0] as usize] += 1;
    }
    let expected = softmax(&TARGET);
    counts
        .iter()
        .zip(&expected)
        .map(|(&c, &p)| {
            let e = p * n as f64;
            (c as f64 - e).powi(2) / e
        })
        .sum()
}

/// The 99.9th percentile of chi-square with 5 degrees of freedom.
const CHI2_5_999: f64 = 20.52;

#[test]
fn rejection_sampling_keeps_the_target_distribution() {
    let chi2 = first_token_chi2(AcceptRule::Lossless, 40_000);
    assert!(chi2 < CHI2_5_999, "chi2 {chi2}");
}

#[test]
fn the_distribution_test_catches_a_wrong_acceptance_rule() {
    // Accepting with p(t) instead of p(t)/q(t) skews the output towards the draft: the same
    // test must reject it by far.
    let chi2 = first_token_chi2(AcceptRule::IgnoreDraft, 40_000);
    assert!(chi2 > 10.0 * CHI2_5_999, "chi2 {chi2}");
}

#[test]
fn point_mass_proposals_keep_the_target_distribution() {
    // An n-gram proposal of token 3 (unlikely under the target) and of token 1 (likely).
    let p = SamplingParams {
        temperature: 1.0,
        ..SamplingParams::default()
    };
    let v = TARGET.len();
    let n = 40_000u64;
    let expected = softmax(&TARGET);
    for proposal in [3u32, 1] {
        let mut counts = vec![0u32; v];
        for seed in 0..n {
            let mut r = row(p.clone(), seed);
            let target: Vec<f32> = TARGET.iter().chain(&TARGET).copied().collect();
            let t = verify(&mut r, &target, &[proposal], Proposals::PointMass);
            counts[t[0] as usize] += 1;
        }
        let chi2: f64 = counts
            .iter()
            .zip(&expected)
            .map(|(&c, &p)| (c as f64 - p * n as f64).powi(2) / (p * n as f64))
            .sum();
        assert!(chi2 < CHI2_5_999, "proposal {proposal}: chi2 {chi2}");
    }
}

#[test]
fn acceptance_rate_is_the_overlap_of_p_and_q() {
    // P(accept) = sum_x min(p(x), q(x)) (Leviathan et al.): check it within 1%.
    let p = SamplingParams {
        temperature: 1.0,
        ..SamplingParams::default()
    };
    let (pt, qd) = (softmax(&TARGET), softmax(&DRAFT));
    let overlap: f64 = pt.iter().zip(&qd).map(|(a, b)| a.min(*b)).sum();
    let n = 40_000u64;
    let mut accepted = 0;
    let v = TARGET.len();
    let mut scratch = SamplerScratch::default();
    for seed in 0..n {
        let mut r = row(p.clone(), seed);
        let mut q = vec![0.0; v];
        let t = r.draft(&mut DRAFT.to_vec(), &mut q, &mut scratch);
        let mut target: Vec<f32> = TARGET.iter().chain(&TARGET).copied().collect();
        accepted += r.verify(
            &mut target,
            &[t],
            Proposals::Model(&q),
            AcceptRule::Lossless,
            &mut scratch,
            &mut StepOutput::default(),
        );
    }
    let rate = accepted as f64 / n as f64;
    assert!(
        (rate - overlap).abs() < 0.01,
        "rate {rate} vs overlap {overlap}"
    );
}

#[test]
fn drafting_records_and_unrecords_cleanly() {
    let p = SamplingParams {
        temperature: 1.0,
        repetition_penalty: 1.3,
        frequency_penalty: 0.5,
        ..SamplingParams::default()
    };
    let mut r = row(p, 5);
    let mut scratch = SamplerScratch::default();
    let processed = |r: &RowSampler, scratch: &mut SamplerScratch| {
        let mut l = TARGET.to_vec();
        r.process(&mut l, scratch);
        (l, r.generated())
    };
    let before = processed(&r, &mut scratch);
    for t in [3, 3, 1] {
        r.record(t);
    }
    assert_ne!(processed(&r, &mut scratch), before);
    for t in [1, 3, 3] {
        r.unrecord(t);
    }
    assert_eq!(processed(&r, &mut scratch), before);
}
