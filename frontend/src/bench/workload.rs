//! The benchmark's requests: lengths, prompt kinds and the planned misbehaviour (hang-ups
//! mid-stream, invalid requests), drawn one at a time from a seeded generator so a run of
//! 50,000 requests holds none of them in memory and the same seed gives the same run.
//!
//! ```text
//!   u = unit draw     [0, bad)            -> Bad(one of BAD_REQUESTS, in turn)
//!                     [bad, bad + disc)   -> Disconnect { after: 0..output_len chunks }
//!                     [bad + disc, 1)     -> Complete
//!   prompt            chat_fraction of the good ones: chat messages of random words,
//!                     else completions with random token ids (exact lengths)
//! ```

use harrier_engine::splitmix::SplitMix64;

/// What the client does with one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// Read the stream to its finish reason and `[DONE]`.
    Complete,
    /// Hang up after this many text chunks (0: right after the response headers).
    Disconnect { after: u32 },
    /// Send the invalid request `BAD_REQUESTS[i]`; it must be answered with its 4xx.
    Bad(usize),
}

/// How the prompt is sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// `/v1/completions` with a token-id list (exact length; the tokenizer is skipped).
    Tokens(Vec<u32>),
    /// `/v1/chat/completions` with one user message of random words (about that many
    /// tokens; the chat template and the tokenizer run).
    Chat(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestSpec {
    pub prompt: Prompt,
    pub output_len: u32,
    pub plan: Plan,
}

/// One invalid request: a name for the report, its path, body and the status it must get.
pub struct BadRequest {
    pub name: &'static str,
    pub path: &'static str,
    /// The body, given the model name.
    pub body: fn(&str) -> Vec<u8>,
    pub status: u16,
}

/// Requests every front end must refuse with an OpenAI error, each through a different
/// check (parser, types, model lookup, ranges, tokenizer, template). All ask to stream.
pub const BAD_REQUESTS: &[BadRequest] = &[
    BadRequest {
        name: "malformed JSON",
        path: "/v1/completions",
        body: |m| format!(r#"{{"model": "{m}", "stream": true, "prompt": [1, 2"#).into_bytes(),
        status: 400,
    },
    BadRequest {
        name: "wrong type",
        path: "/v1/completions",
        body: |m| {
            format!(r#"{{"model": "{m}", "stream": true, "prompt": "x", "temperature": "hot"}}"#)
                .into_bytes()
        },
        status: 400,
    },
    BadRequest {
        name: "unknown model",
        path: "/v1/completions",
        body: |_| br#"{"model": "no-such-model", "stream": true, "prompt": "x"}"#.to_vec(),
        status: 404,
    },
    BadRequest {
        name: "max_tokens past the context",
        path: "/v1/completions",
        body: |m| {
            format!(r#"{{"model": "{m}", "stream": true, "prompt": "x", "max_tokens": 10000000}}"#)
                .into_bytes()
        },
        status: 400,
    },
    BadRequest {
        name: "token id past the vocabulary",
        path: "/v1/completions",
        body: |m| {
            format!(r#"{{"model": "{m}", "stream": true, "prompt": [1, 999999999]}}"#).into_bytes()
        },
        status: 400,
    },
    BadRequest {
        name: "top_p out of range",
        path: "/v1/completions",
        body: |m| {
            format!(r#"{{"model": "{m}", "stream": true, "prompt": "x", "top_p": 1.5}}"#)
                .into_bytes()
        },
        status: 400,
    },
    BadRequest {
        name: "message without a role",
        path: "/v1/chat/completions",
        body: |m| {
            format!(r#"{{"model": "{m}", "stream": true, "messages": [{{"content": "hi"}}]}}"#)
                .into_bytes()
        },
        status: 400,
    },
    BadRequest {
        name: "non-UTF-8 body",
        path: "/v1/completions",
        body: |m| {
            let mut b = format!(r#"{{"model": "{m}", "stream": true, "prompt": ""#).into_bytes();
            b.extend_from_slice(b"\xff\xfe\"}");
            b
        },
        status: 400,
    },
];

/// Words for chat prompts (most are one token of a byte-level BPE, some two).
const WORDS: &[&str] = &[
    "the", "model", "serves", "tokens", "from", "a", "queue", "of", "requests", "and", "each",
    "step", "runs", "one", "batch", "on", "two", "cores", "while", "front", "ends", "stream",
    "text", "back", "to", "clients", "who", "may", "leave", "early", "or", "send", "bad", "input",
];

/// The request mix: lengths vary uniformly in `[len·(1−r), len·(1+r)]` (vLLM's
/// `--random-range-ratio`), fractions as in the module note.
#[derive(Debug, Clone)]
pub struct Mix {
    pub input_len: u32,
    pub output_len: u32,
    pub range_ratio: f64,
    pub token_id_range: (u32, u32),
    pub chat_fraction: f64,
    pub disconnect_fraction: f64,
    pub bad_fraction: f64,
}

impl Mix {
    pub fn validate(&self) -> anyhow::Result<()> {
        let f = |x: f64| (0.0..=1.0).contains(&x);
        anyhow::ensure!(
            (0.0..1.0).contains(&self.range_ratio),
            "--range-ratio must be in [0, 1)"
        );
        anyhow::ensure!(
            f(self.chat_fraction) && f(self.disconnect_fraction) && f(self.bad_fraction),
            "fractions must be in [0, 1]"
        );
        anyhow::ensure!(
            self.disconnect_fraction + self.bad_fraction <= 1.0,
            "--disconnect-fraction + --bad-request-fraction must be at most 1"
        );
        anyhow::ensure!(
            self.input_len >= 1 && self.output_len >= 1,
            "lengths must be at least 1"
        );
        Ok(())
    }
}

/// Draws the requests of a run, one at a time.
pub struct Workload {
    mix: Mix,
    rng: SplitMix64,
    bad_next: usize,
}

impl Workload {
    pub fn new(mix: Mix, seed: u64) -> Self {
        Self {
            mix,
            rng: SplitMix64(seed ^ 0x5EED),
            bad_next: 0,
        }
    }

    /// A length around `len` (at least 1).
    fn length(&mut self, len: u32) -> u32 {
        let r = self.mix.range_ratio;
        let lo = ((f64::from(len) * (1.0 - r)) as u32).max(1);
        let hi = ((f64::from(len) * (1.0 + r)) as u32).max(lo);
        lo + (self.rng.next_u64() % u64::from(hi - lo + 1)) as u32
    }

    pub fn next_request(&mut self) -> RequestSpec {
        let input_len = self.length(self.mix.input_len);
        let output_len = self.length(self.mix.output_len);
        let u = self.rng.unit();
        let plan = if u < self.mix.bad_fraction {
            let i = self.bad_next;
            self.bad_next = (i + 1) % BAD_REQUESTS.len();
            Plan::Bad(i)
        } else if u < self.mix.bad_fraction + self.mix.disconnect_fraction {
            Plan::Disconnect {
                after: (self.rng.next_u64() % u64::from(output_len)) as u32,
            }
        } else {
            Plan::Complete
        };
        let prompt = if self.rng.unit() < self.mix.chat_fraction {
            let words: Vec<&str> = (0..input_len)
                .map(|_| WORDS[(self.rng.next_u64() % WORDS.len() as u64) as usize])
                .collect();
            Prompt::Chat(words.join(" "))
        } else {
            let (lo, hi) = self.mix.token_id_range;
            Prompt::Tokens(
                (0..input_len)
                    .map(|_| lo + (self.rng.next_u64() % u64::from(hi - lo)) as u32)
                    .collect(),
            )
        };
        RequestSpec {
            prompt,
            output_len,
            plan,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mix() -> Mix {
        Mix {
            input_len: 64,
            output_len: 32,
            range_ratio: 0.75,
            token_id_range: (100, 1000),
            chat_fraction: 0.2,
            disconnect_fraction: 0.1,
            bad_fraction: 0.05,
        }
    }

    #[test]
    fn the_mix_has_its_fractions_and_ranges() {
        let mut w = Workload::new(mix(), 7);
        let (mut bad, mut disc, mut chat, n) = (0, 0, 0, 20_000);
        let mut bad_kinds = vec![0; BAD_REQUESTS.len()];
        for _ in 0..n {
            let r = w.next_request();
            assert!((8..=56).contains(&r.output_len), "{}", r.output_len);
            match &r.prompt {
                Prompt::Tokens(t) => {
                    assert!((16..=112).contains(&t.len()));
                    assert!(t.iter().all(|&x| (100..1000).contains(&x)));
                }
                Prompt::Chat(_) => chat += 1,
            }
            match r.plan {
                Plan::Bad(i) => {
                    bad += 1;
                    bad_kinds[i] += 1;
                }
                Plan::Disconnect { after } => {
                    disc += 1;
                    assert!(after < r.output_len);
                }
                Plan::Complete => {}
            }
        }
        let frac = |x: usize| x as f64 / n as f64;
        assert!((frac(bad) - 0.05).abs() < 0.01, "{bad}");
        assert!((frac(disc) - 0.1).abs() < 0.01, "{disc}");
        assert!((frac(chat) - 0.2).abs() < 0.02, "{chat}");
        // The invalid requests take turns.
        assert!(bad_kinds.iter().max().unwrap() - bad_kinds.iter().min().unwrap() <= 1);
    }

    #[test]
    fn the_same_seed_gives_the_same_run() {
        let a: Vec<_> = {
            let mut w = Workload::new(mix(), 3);
            (0..100).map(|_| w.next_request()).collect()
        };
        let mut w = Workload::new(mix(), 3);
        assert!(a.iter().all(|r| *r == w.next_request()));
    }

    #[test]
    fn ratio_zero_gives_exact_lengths() {
        let mut w = Workload::new(
            Mix {
                range_ratio: 0.0,
                chat_fraction: 0.0,
                ..mix()
            },
            1,
        );
        for _ in 0..100 {
            let r = w.next_request();
            assert_eq!(r.output_len, 32);
            assert!(matches!(&r.prompt, Prompt::Tokens(t) if t.len() == 64));
        }
    }

    #[test]
    fn bad_bodies_name_the_model() {
        for b in BAD_REQUESTS {
            assert!((400..500).contains(&b.status), "{}", b.name);
            let body = (b.body)("m");
            assert!(b.name == "unknown model" || body.windows(3).any(|w| w == b"\"m\""));
        }
    }
}
