//! Incremental detokenization with prefix/read offsets (as vLLM and TGI do it).
//!
//! Decoding tokens one at a time is wrong for byte-level BPE (a character may span tokens)
//! and for SentencePiece (leading spaces depend on the previous token). So each step decodes
//! a short window twice:
//!
//! ```text
//!   ids:  [ ... | prefix_offset ......... read_offset ...... new ids ]
//!                 \__ prefix_text ______/
//!                 \__ full_text ___________________________________/
//!   delta = full_text[prefix_text.len()..]   once full_text grew and does not end in U+FFFD
//! ```
//!
//! A text ending in U+FFFD is an incomplete UTF-8 sequence: nothing is released until the
//! next token completes it. [`Detokenizer::finish`] releases whatever is still pending, so the
//! deltas always concatenate to the decode of all output ids.
//!
//! Ids at or past the tokenizer's vocabulary (padded model vocabularies, e.g. 151,936 vs
//! 128,256) decode as empty text and are otherwise ignored.
//!
//! The window is seeded with the last few prompt ids so that the first output token decodes
//! in context (SentencePiece's leading space); the prompt's text itself is never emitted. A
//! context that ends inside a character (a prompt of ids cut mid-character) is dropped at the
//! first push: the output's first bytes would otherwise complete that character inside the
//! prompt's text and never be emitted.

use tokenizers::Tokenizer;

/// Prompt ids kept as left context for the first output token.
const PROMPT_CONTEXT: usize = 5;

#[derive(Debug, Clone)]
pub struct Detokenizer {
    skip_special: bool,
    vocab_size: u32,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    /// Whether the prompt context was checked for an unfinished character (first push).
    context_checked: bool,
}

impl Detokenizer {
    /// `vocab_size`: the tokenizer's, added tokens included (compute it once:
    /// `Tokenizer::get_vocab_size(true)` builds the whole vocabulary map).
    pub fn new(vocab_size: u32, prompt_ids: &[u32], skip_special: bool) -> Self {
        let tail = &prompt_ids[prompt_ids.len().saturating_sub(PROMPT_CONTEXT)..];
        let ids: Vec<u32> = tail.iter().copied().filter(|&id| id < vocab_size).collect();
        let n = ids.len();
        Self {
            skip_special,
            vocab_size,
            ids,
            prefix_offset: 0,
            read_offset: n,
            context_checked: false,
        }
    }

    /// Adds output ids; returns the text they complete (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, new_ids: &[u32]) -> String {
        if !self.context_checked {
            self.context_checked = true;
            let context = self.decode(tokenizer, 0, self.read_offset);
            if context.ends_with('\u{FFFD}') {
                self.ids.clear();
                self.read_offset = 0;
            }
        }
        let before = self.ids.len();
        self.ids
            .extend(new_ids.iter().copied().filter(|&id| id < self.vocab_size));
        if self.ids.len() == before {
            return String::new();
        }
        let prefix = self.decode(tokenizer, self.prefix_offset, self.read_offset);
        let full = self.decode(tokenizer, self.prefix_offset, self.ids.len());
        if full.len() <= prefix.len() || full.ends_with('\u{FFFD}') {
            return String::new();
        }
        let delta = match full.strip_prefix(prefix.as_str()) {
            Some(d) => d.to_string(),
            // The prefix decodes differently in a longer context (rare normalizer cases):
            // emit the part past the prefix's length, on a char boundary.
            None => full[ceil_char_boundary(&full, prefix.len())..].to_string(),
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        // Keep the window short: nothing before prefix_offset is decoded again.
        if self.prefix_offset > 64 {
            self.ids.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
        delta
    }

    /// Releases text held back for an incomplete character (the request ended).
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> String {
        if self.read_offset == self.ids.len() {
            return String::new();
        }
        let prefix = self.decode(tokenizer, self.prefix_offset, self.read_offset);
        let full = self.decode(tokenizer, self.prefix_offset, self.ids.len());
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        match full.strip_prefix(prefix.as_str()) {
            Some(d) => d.to_string(),
            None => full[ceil_char_boundary(&full, prefix.len())..].to_string(),
        }
    }

    fn decode(&self, tokenizer: &Tokenizer, from: usize, to: usize) -> String {
        if from >= to {
            return String::new();
        }
        tokenizer
            .decode(&self.ids[from..to], self.skip_special)
            .unwrap_or_default()
    }
}

fn ceil_char_boundary(s: &str, i: usize) -> usize {
    let mut i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::llama3_tokenizer;

    fn deltas(tok: &Tokenizer, prompt: &[u32], ids: &[u32], skip: bool) -> Vec<String> {
        let mut d = Detokenizer::new(tok.get_vocab_size(true) as u32, prompt, skip);
        let mut out: Vec<String> = ids.iter().map(|&id| d.push(tok, &[id])).collect();
        out.push(d.finish(tok));
        out
    }

    #[test]
    fn deltas_concatenate_to_the_full_decode() {
        let tok = llama3_tokenizer();
        for text in [
            "Hello, world! This is a test of incremental detokenization.",
            "  leading spaces and\nnewlines\n\n\ttabs",
            "Unicode: héllo wörld — “quotes” 日本語のテキスト 🦅🚀 👩‍👩‍👧",
            "code: fn main() { println!(\"{}\", 1 + 2); }",
        ] {
            let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
            let prompt = tok
                .encode("Say something:", true)
                .unwrap()
                .get_ids()
                .to_vec();
            let out = deltas(&tok, &prompt, &ids, true);
            assert_eq!(out.concat(), text);
            assert_eq!(out.concat(), tok.decode(&ids, true).unwrap());
        }
    }

    #[test]
    fn multibyte_chars_split_across_tokens_are_held_until_complete() {
        let tok = llama3_tokenizer();
        // Rare CJK characters and emoji are split into several byte-level tokens.
        let text = "🦅𠜎";
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert!(ids.len() > 2, "want a char split over tokens, got {ids:?}");
        let out = deltas(&tok, &[], &ids, true);
        assert_eq!(out.concat(), text);
        // No delta ever carries a replacement character or half a char.
        assert!(out.iter().all(|d| !d.contains('\u{FFFD}')), "{out:?}");
        assert!(out.iter().filter(|d| !d.is_empty()).count() <= 2);
    }

    #[test]
    fn ids_past_the_vocab_decode_as_empty() {
        let tok = llama3_tokenizer();
        let vocab = tok.get_vocab_size(true) as u32;
        let hello = tok.encode("Hello there", false).unwrap().get_ids().to_vec();
        let ids = [hello[0], vocab, vocab + 5000, hello[1]];
        let out = deltas(&tok, &[vocab + 1, 1], &ids, true);
        assert_eq!(out.concat(), "Hello there");
        assert_eq!(out[1], "");
        assert_eq!(out[2], "");
    }

    #[test]
    fn special_tokens_are_skipped_or_kept() {
        let tok = llama3_tokenizer();
        let eot = tok.token_to_id("<|eot_id|>").unwrap();
        let hi = tok.encode("Hi", false).unwrap().get_ids().to_vec();
        let ids = [hi.as_slice(), &[eot]].concat();
        assert_eq!(deltas(&tok, &[], &ids, true).concat(), "Hi");
        assert_eq!(deltas(&tok, &[], &ids, false).concat(), "Hi<|eot_id|>");
    }

    /// Found by the fuzz harness: a prompt of ids ending inside a character (here the first
    /// byte of "🦅") swallowed the output's first bytes, which completed that character in
    /// the prompt's text and so were never emitted.
    #[test]
    fn a_prompt_cut_mid_character_does_not_swallow_the_output() {
        let tok = llama3_tokenizer();
        let ids = tok.encode("🦅 flies", false).unwrap().get_ids().to_vec();
        assert!(tok.decode(&ids[..1], true).unwrap().ends_with('\u{FFFD}'));
        let (prompt, output) = ids.split_at(1);
        let expected = tok.decode(output, true).unwrap();
        assert!(expected.starts_with('\u{FFFD}') && expected.ends_with(" flies"));
        assert_eq!(deltas(&tok, prompt, output, true).concat(), expected);
        // A prompt ending on a whole character still gives the first token its context.
        let hello = tok.encode("Hello there", false).unwrap().get_ids().to_vec();
        let (prompt, output) = hello.split_at(1);
        assert_eq!(deltas(&tok, prompt, output, true).concat(), " there");
    }

    #[test]
    fn long_outputs_keep_a_short_window() {
        let tok = llama3_tokenizer();
        let text = "word ".repeat(500);
        let ids = tok.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        let mut d = Detokenizer::new(tok.get_vocab_size(true) as u32, &[], true);
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&d.push(&tok, &[id]));
            assert!(d.ids.len() < 200);
        }
        out.push_str(&d.finish(&tok));
        assert_eq!(out, text);
    }

    #[test]
    fn batched_ids_give_the_same_text() {
        let tok = llama3_tokenizer();
        let text = "Batches of 🦅 tokens arrive together sometimes.";
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        let mut d = Detokenizer::new(tok.get_vocab_size(true) as u32, &[], true);
        let mut out = String::new();
        for chunk in ids.chunks(3) {
            out.push_str(&d.push(&tok, chunk));
        }
        out.push_str(&d.finish(&tok));
        assert_eq!(out, text);
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use crate::testutil::llama3_tokenizer;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Any printable text, tokenized and fed back one id at a time, comes back exactly.
        #[test]
        fn deltas_reassemble_any_text(text in "\\PC{0,40}", batch in 1usize..4) {
            let tok = llama3_tokenizer();
            let ids = tok.encode(text.as_str(), false).unwrap().get_ids().to_vec();
            let mut d = Detokenizer::new(tok.get_vocab_size(true) as u32, &[], true);
            let mut out = String::new();
            for chunk in ids.chunks(batch) {
                let delta = d.push(&tok, chunk);
                let clean = !delta.contains(char::REPLACEMENT_CHARACTER) || text.contains(char::REPLACEMENT_CHARACTER);
                prop_assert!(clean, "a delta carries U+FFFD: {:?}", delta);
                out.push_str(&delta);
            }
            out.push_str(&d.finish(&tok));
            prop_assert_eq!(out, text);
        }
    }
}
