//! Stop strings: matched on the accumulated output text, across token boundaries.
//!
//! The matcher owns the whole output text of one choice and an `emitted` offset (how much of
//! it the client has been sent). After each detokenized delta it searches only the window
//! where a new match can begin (the last `max_stop_len - 1` bytes of the old text plus the
//! delta), so a step costs O(delta + longest stop) whatever the output length.
//!
//! Hold-back: while no stop string matched, the last `max_stop_len - 1` bytes (rounded down
//! to a char boundary) are not released, because they may be the start of a stop string
//! that the next token completes. When the choice ends for another reason the held text is
//! flushed with [`StopMatcher::flush`].
//!
//! The match that ends the choice is the one complete first (smallest end, then earliest
//! start, then list order), so the result does not depend on how the text is split.
//! On a match the output is cut at the match start (or after the stop string with
//! `include_stop_str_in_output`); text after it is never sent.
//!
//! ```text
//!   text:  ....... already sent ........|.. held back ..|<- delta ->
//!                                     emitted    len - (max_stop_len - 1)
//! ```

/// What one [`StopMatcher::push`] releases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopStep {
    /// Text to send now (possibly empty).
    pub text: String,
    /// The stop string that matched, if one did: the choice is finished.
    pub matched: Option<String>,
}

#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    include_stop: bool,
    /// Bytes held back while streaming: the longest stop string's length minus one.
    hold: usize,
    text: String,
    emitted: usize,
    finished: bool,
}

impl StopMatcher {
    /// `stops` empty strings are ignored (they would match everywhere).
    pub fn new(stops: &[String], include_stop: bool) -> Self {
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        let hold = stops
            .iter()
            .map(|s| s.len())
            .max()
            .unwrap_or(0)
            .saturating_sub(1);
        Self {
            stops,
            include_stop,
            hold,
            text: String::new(),
            emitted: 0,
            finished: false,
        }
    }

    /// The whole output text so far (emitted or held, up to a matched stop string).
    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Appends a detokenized delta; returns what may be released now.
    pub fn push(&mut self, delta: &str) -> StopStep {
        if self.finished {
            return StopStep {
                text: String::new(),
                matched: None,
            };
        }
        let old_len = self.text.len();
        self.text.push_str(delta);
        if !self.stops.is_empty() && !delta.is_empty() {
            // A match that ends inside the delta starts at most `hold` bytes before it.
            let start = floor_char_boundary(&self.text, old_len.saturating_sub(self.hold));
            if let Some((pos, stop)) = self.find_earliest(start) {
                let end = if self.include_stop {
                    pos + stop.len()
                } else {
                    pos
                };
                self.text.truncate(end);
                self.finished = true;
                let text = self.text[self.emitted.min(end)..].to_string();
                self.emitted = self.text.len();
                return StopStep {
                    text,
                    matched: Some(stop),
                };
            }
        }
        let safe = floor_char_boundary(&self.text, self.text.len().saturating_sub(self.hold))
            .max(self.emitted);
        let text = self.text[self.emitted..safe].to_string();
        self.emitted = safe;
        StopStep {
            text,
            matched: None,
        }
    }

    /// Releases everything held back (the choice ended for another reason).
    pub fn flush(&mut self) -> String {
        let text = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        self.finished = true;
        text
    }

    /// The match at or after byte `start` that is complete first (smallest end), then the one
    /// starting first, then the stop listed first. "Complete first" is what makes the result
    /// independent of how the text is split into deltas: a stop string that a later delta
    /// would extend into a longer one at the same position has already ended the choice
    /// when it arrived alone.
    fn find_earliest(&self, start: usize) -> Option<(usize, String)> {
        let window = &self.text[start..];
        self.stops
            .iter()
            .filter_map(|s| window.find(s.as_str()).map(|p| (start + p, s)))
            .min_by_key(|(p, s)| (p + s.len(), *p))
            .map(|(p, s)| (p, s.clone()))
    }
}

/// The largest char boundary `<= i` (str::floor_char_boundary is unstable).
fn floor_char_boundary(s: &str, i: usize) -> usize {
    let mut i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// Feeds the pieces, returning (everything released, matched stop).
    fn run(pieces: &[&str], stop_list: &[&str], include: bool) -> (Vec<String>, Option<String>) {
        let mut m = StopMatcher::new(&stops(stop_list), include);
        let mut out = Vec::new();
        for p in pieces {
            let step = m.push(p);
            out.push(step.text);
            if step.matched.is_some() {
                return (out, step.matched);
            }
        }
        out.push(m.flush());
        (out, None)
    }

    #[test]
    fn no_stops_releases_everything_at_once() {
        let (out, matched) = run(&["Hel", "lo", " wor", "ld"], &[], false);
        assert_eq!(out, ["Hel", "lo", " wor", "ld", ""]);
        assert_eq!(matched, None);
    }

    #[test]
    fn match_across_token_boundaries_is_cut() {
        let (out, matched) = run(&["Hello", " wo", "rl", "d and more"], &["world"], false);
        assert_eq!(out.concat(), "Hello ");
        assert_eq!(matched.as_deref(), Some("world"));
    }

    #[test]
    fn include_stop_str_in_output() {
        let (out, matched) = run(&["Hello", " wo", "rl", "d and more"], &["world"], true);
        assert_eq!(out.concat(), "Hello world");
        assert_eq!(matched.as_deref(), Some("world"));
    }

    #[test]
    fn hold_back_is_len_minus_one() {
        let mut m = StopMatcher::new(&stops(&["STOP"]), false);
        // 3 bytes are held back: "abcdef" releases "abc".
        assert_eq!(m.push("abcdef").text, "abc");
        // "ST" could begin the stop string: it stays held with the rest of the window.
        assert_eq!(m.push("ST").text, "de");
        // Not a match after all: released up to the new hold window.
        assert_eq!(m.push("x").text, "f");
        assert_eq!(m.flush(), "STx");
        assert_eq!(m.text(), "abcdefSTx");
    }

    #[test]
    fn held_text_never_contains_a_released_stop_prefix() {
        // A partial stop prefix at the end is never released before the match is decided.
        let mut m = StopMatcher::new(&stops(&["\n\n"]), false);
        assert_eq!(m.push("a\n").text, "a");
        let step = m.push("\nb");
        assert_eq!(step.text, "");
        assert_eq!(step.matched.as_deref(), Some("\n\n"));
    }

    #[test]
    fn first_completed_match_wins_then_earliest_start_then_list_order() {
        let (out, matched) = run(&["xx abc def"], &["def", "abc"], false);
        assert_eq!(out.concat(), "xx ");
        assert_eq!(matched.as_deref(), Some("abc"));
        // "abc" is complete before "abcd", however the text arrives.
        for pieces in [&["xx abcdef"][..], &["xx abc", "def"][..]] {
            let (out, matched) = run(pieces, &["abcd", "abc"], true);
            assert_eq!(out.concat(), "xx abc");
            assert_eq!(matched.as_deref(), Some("abc"));
        }
        // Same end: the longer (earlier-starting) one.
        let (_, matched) = run(&["xbcd"], &["cd", "bcd"], false);
        assert_eq!(matched.as_deref(), Some("bcd"));
        // Found by the property test: "€é" and "€" both at 0; "€" completes first.
        for pieces in [&["€é"][..], &["€", "é"][..]] {
            let (out, matched) = run(pieces, &["€é", "€"], true);
            assert_eq!(
                (out.concat().as_str(), matched.as_deref()),
                ("€", Some("€"))
            );
        }
    }

    #[test]
    fn stop_at_the_very_start_gives_empty_text() {
        let (out, matched) = run(&["STOP", "more"], &["STOP"], false);
        assert_eq!(out.concat(), "");
        assert_eq!(matched.as_deref(), Some("STOP"));
    }

    #[test]
    fn multibyte_text_is_held_on_char_boundaries() {
        // The stop string is 6 bytes; the held window must not split a char.
        let mut m = StopMatcher::new(&stops(&["éé€"]), false);
        let step = m.push("ab€€");
        assert!(step.text.len() <= "ab€€".len() - 6);
        let step2 = m.push("éé€tail");
        assert_eq!(step2.matched.as_deref(), Some("éé€"));
        assert_eq!(format!("{}{}", step.text, step2.text), "ab€€");
    }

    #[test]
    fn matching_is_independent_of_how_text_is_split() {
        let text = "The quick brown fox jumps over the lazy dog. END of story";
        let stop_list = ["lazy dog", "END", "zz"];
        for split in 1..text.len() {
            let pieces: Vec<&str> = text
                .as_bytes()
                .chunks(split)
                .map(|c| std::str::from_utf8(c).unwrap())
                .collect();
            let (out, matched) = run(&pieces, &stop_list, false);
            assert_eq!(
                out.concat(),
                "The quick brown fox jumps over the ",
                "split {split}"
            );
            assert_eq!(matched.as_deref(), Some("lazy dog"));
        }
    }

    #[test]
    fn empty_stop_strings_are_ignored() {
        let (out, matched) = run(&["abc"], &[""], false);
        assert_eq!(out, ["abc", ""]);
        assert_eq!(matched, None);
    }

    #[test]
    fn push_after_finish_is_empty() {
        let mut m = StopMatcher::new(&stops(&["x"]), false);
        assert_eq!(m.push("axb").matched.as_deref(), Some("x"));
        assert_eq!(m.push("more").text, "");
        assert!(m.is_finished());
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use proptest::prelude::*;

    /// The naive reference: cut the whole text at the match that is complete first (then
    /// the earliest start).
    fn reference(text: &str, stops: &[String], include: bool) -> (String, bool) {
        let best = stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| text.find(s.as_str()).map(|p| (p, s)))
            .min_by_key(|(p, s)| (p + s.len(), *p));
        match best {
            Some((p, s)) => (
                text[..if include { p + s.len() } else { p }].to_string(),
                true,
            ),
            None => (text.to_string(), false),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn any_split_matches_the_reference(
            text in "[abé€ \n]{0,40}",
            stops in proptest::collection::vec("[abé€ \n]{1,4}", 0..3),
            cuts in proptest::collection::vec(0usize..50, 0..8),
            include in any::<bool>(),
        ) {
            let mut bounds: Vec<usize> = cuts.into_iter().map(|c| c.min(text.len())).filter(|&c| text.is_char_boundary(c)).collect();
            bounds.push(0);
            bounds.push(text.len());
            bounds.sort();
            bounds.dedup();
            let mut m = StopMatcher::new(&stops, include);
            let mut out = String::new();
            let mut matched = false;
            for w in bounds.windows(2) {
                let step = m.push(&text[w[0]..w[1]]);
                out.push_str(&step.text);
                if step.matched.is_some() {
                    matched = true;
                    break;
                }
            }
            if !matched {
                out.push_str(&m.flush());
            }
            prop_assert_eq!((out, matched), reference(&text, &stops, include));
        }
    }
}
