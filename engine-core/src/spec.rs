//! Speculative decoding (reference 003): the proposers and the checks made at start-up.
//!
//! Where each part lives:
//! - the scheduler books a round of `1 + k` tokens per decoding row before the previous
//!   round's acceptance is known ([`crate::scheduler::Scheduler::spec_len`]) and commits what
//!   the round produced;
//! - the backend proposes (a draft model or an n-gram lookup, here), verifies the pending
//!   token and its proposals in one target forward, and accepts by rejection sampling
//!   ([`crate::sampling::spec`]) on its own thread or stream: the host never waits for a
//!   round's result before launching the next one;
//! - the draft model's KV lives in its own cache indexed by the same block ids as the
//!   target's, so one block table, one allocation and one free serve both (the KV budget is
//!   split by bytes per block; the start-up log states the split).
//!
//! Draft prefill runs beside the target's: every prefill chunk also goes through the draft
//! in the same step, so its KV is ready when decoding starts. A round feeds the draft the
//! tokens it has not seen (usually just the pending token; two after a round that accepted
//! every proposal, because the last proposal's KV is never computed by the draft) and then
//! one token per further proposal.

use std::path::Path;

use anyhow::{bail, Context};

use crate::model::ModelDir;

/// `--speculative-method`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SpecMethod {
    /// A smaller model with the target's vocabulary proposes (`--speculative-model`).
    Draft,
    /// Prompt lookup: the tokens that followed the latest earlier occurrence of the
    /// sequence's last n tokens (no model; pays off when outputs repeat their context).
    Ngram,
}

/// N-gram prompt lookup: finds the longest suffix of `context` (from `max` tokens down to
/// `min`) that also occurs earlier in it, takes its latest earlier occurrence and proposes
/// the up to `k` tokens that followed it. Nothing when no suffix of at least `min` tokens
/// recurs.
pub fn ngram_propose(context: &[u32], min: usize, max: usize, k: usize, out: &mut Vec<u32>) {
    out.clear();
    let len = context.len();
    if k == 0 || min == 0 || len < min + 1 {
        return;
    }
    for n in (min..=max.min(len - 1)).rev() {
        let suffix = &context[len - n..];
        // Latest start `s < len - n` with context[s..s + n] == suffix.
        if let Some(s) = (0..len - n).rev().find(|&s| &context[s..s + n] == suffix) {
            let from = s + n;
            let to = (from + k).min(len);
            out.extend_from_slice(&context[from..to]);
            return;
        }
    }
}

/// Checks that a draft model can propose for `target`: the same vocabulary size and, when
/// both directories carry a `tokenizer.json`, the same tokenizer model (vocabulary and
/// merges). The error names both directories.
pub fn check_draft(target: &ModelDir, draft: &ModelDir) -> anyhow::Result<()> {
    let (t, d) = (&target.config, &draft.config);
    if t.vocab_size != d.vocab_size {
        bail!(
            "the draft model {} has a vocabulary of {} tokens but the target {} has {}: a draft must share the target's vocabulary and tokenizer",
            draft.path.display(),
            d.vocab_size,
            target.path.display(),
            t.vocab_size
        );
    }
    let (tt, dt) = (
        tokenizer_model(&target.path).context("reading the target's tokenizer.json")?,
        tokenizer_model(&draft.path).context("reading the draft's tokenizer.json")?,
    );
    if let (Some(tt), Some(dt)) = (tt, dt) {
        if tt != dt {
            bail!(
                "the draft model {} has a different tokenizer from the target {} (their tokenizer.json vocabularies or merges differ): a draft must share the target's tokenizer",
                draft.path.display(),
                target.path.display()
            );
        }
    }
    Ok(())
}

/// The `model` section of `dir/tokenizer.json` (vocabulary and merges), if the file exists.
fn tokenizer_model(dir: &Path) -> anyhow::Result<Option<serde_json::Value>> {
    let path = dir.join("tokenizer.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let mut json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    Ok(json.get_mut("model").map(serde_json::Value::take))
}

#[cfg(test)]
#[path = "spec_tests.rs"]
mod engine_tests;

#[cfg(test)]
mod tests {
    use super::*;

    fn propose(ctx: &[u32], min: usize, max: usize, k: usize) -> Vec<u32> {
        let mut out = vec![99];
        ngram_propose(ctx, min, max, k, &mut out);
        out
    }

    #[test]
    fn ngram_takes_the_longest_recurring_suffix() {
        // Suffix [2, 3] recurs at 1; [3] alone would also match at 2 and 6.
        let ctx = [1, 2, 3, 4, 5, 3, 9, 2, 3];
        assert_eq!(propose(&ctx, 1, 3, 3), [4, 5, 3]);
        // Limited to max 1: the latest earlier [3] is at 5, followed by 9, 2, 3.
        assert_eq!(propose(&ctx, 1, 1, 3), [9, 2, 3]);
        // k caps the proposal; the context's end caps it too.
        assert_eq!(propose(&ctx, 1, 3, 1), [4]);
        assert_eq!(propose(&[7, 8, 7], 1, 2, 5), [8, 7]);
    }

    #[test]
    fn ngram_proposes_nothing_without_a_match() {
        assert!(propose(&[1, 2, 3, 4], 1, 3, 4).is_empty());
        // The suffix [3, 4] recurs, but min is 3.
        assert!(propose(&[3, 4, 0, 3, 4], 3, 4, 4).is_empty());
        assert!(propose(&[5], 1, 3, 4).is_empty());
        assert!(propose(&[5, 5], 1, 3, 0).is_empty());
    }

    #[test]
    fn ngram_prefers_the_latest_occurrence() {
        let ctx = [1, 2, 10, 1, 2, 20, 1, 2];
        assert_eq!(propose(&ctx, 2, 2, 2), [20, 1]);
    }
}
