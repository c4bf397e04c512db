//! The incremental detokenizer over arbitrary id sequences with the embedded model's real
//! tokenizer: ordinary ids, special ids, ids at and past the vocabulary, runs of byte tokens
//! that split or never complete a character, delivered in batches of any size, after any
//! prompt. The deltas never panic and concatenate to the one-shot decode of the ids inside
//! the vocabulary (detok.rs's contract).

use crate::detok::Detokenizer;

use super::*;

/// Ids: mostly ordinary, some special (0..=10), some at or past the vocabulary.
fn id() -> impl Strategy<Value = u32> {
    prop_oneof![
        12 => 11u32..8192,
        3 => 0u32..=10,
        // The 256 byte tokens of a byte-level BPE are the first ordinary ids.
        3 => 11u32..267,
        1 => prop::sample::select(vec![8192u32, 8193, 65_535, u32::MAX]),
    ]
}

/// Ids of real text with stray ids spliced in, or arbitrary ids.
fn ids() -> impl Strategy<Value = Vec<u32>> {
    prop_oneof![
        1 => prop::collection::vec(id(), 0..48),
        1 => (hostile_text(), prop::collection::vec((any::<usize>(), id()), 0..4)).prop_map(
            |(text, strays)| {
                let mut ids = text_model()
                    .tokenizer
                    .encode(text.as_str(), false)
                    .map(|e| e.get_ids().to_vec())
                    .unwrap_or_default();
                ids.truncate(256);
                for (at, id) in strays {
                    let at = at % (ids.len() + 1);
                    ids.insert(at, id);
                }
                ids
            }
        ),
    ]
}

proptest! {
    #![proptest_config(fuzz::config(2048))]

    #[test]
    fn fuzz_detok_arbitrary_ids(
        prompt in prop::collection::vec(id(), 0..8),
        ids in ids(),
        batches in prop::collection::vec(1usize..5, 1..8),
        skip_special in any::<bool>(),
    ) {
        let text = text_model();
        let tok = &text.tokenizer;
        let _watch = fuzz::watch("detok", &(&prompt, &ids, skip_special));
        let mut d = Detokenizer::new(text.vocab_size, &prompt, skip_special);
        let mut out = String::new();
        let mut rest = ids.as_slice();
        for &b in batches.iter().cycle() {
            if rest.is_empty() {
                break;
            }
            let (now, later) = rest.split_at(b.min(rest.len()));
            out.push_str(&d.push(tok, now));
            rest = later;
        }
        out.push_str(&d.finish(tok));
        let valid: Vec<u32> = ids.iter().copied().filter(|&id| id < text.vocab_size).collect();
        let expected = tok.decode(&valid, skip_special).expect("decodes");
        prop_assert_eq!(out, expected, "ids {:?}", valid);
    }
}
