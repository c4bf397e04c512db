//! Structured outputs: grammars compiled with llguidance, token masks per step.
//!
//! - [`GrammarCompiler`] holds llguidance's token trie, built once per tokenizer from the
//!   model's `tokenizer.json` (its vocabulary as bytes; no tokenizer library needed), and a
//!   bounded cache of compiled grammars keyed by the constraint's text: a new request with a
//!   cached constraint gets a clone of the compiled matcher.
//! - The engine compiles off its thread ([`CompileWorker`]): a request with a constraint
//!   waits outside the scheduler until its grammar is ready (or fails, finishing the request
//!   with an error that names the problem).
//! - Each step, the scheduler asks every constrained row's matcher for the tokens allowed next
//!   ([`Grammar::fill_mask`]) while the step's forward runs; the backend sets the others'
//!   logits to -inf before the normal sampling (penalties, temperature, seeds still apply).
//!   EOS is allowed only where the grammar accepts. The grammar advances when the step
//!   commits; a finished grammar ends the request with finish_reason "stop".
//! - A constrained row gives up run-ahead for itself: it is in at most one step in flight, so
//!   its mask is computed after its previous token was committed (reference 001's closing
//!   remarks); it does not speculate. Other rows keep the 2-deep pipeline.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::{mpsc, Arc, Mutex};

use anyhow::{bail, Context};
use harrier_shared::protocol::{StructuredOutput, TokenId};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

/// Compiled grammars kept for reuse.
const CACHE_ENTRIES: usize = 256;

/// The grammar of a constraint, before compilation.
pub fn top_level(spec: &StructuredOutput) -> Result<TopLevelGrammar, String> {
    Ok(match spec {
        StructuredOutput::JsonSchema(text) => {
            let schema: serde_json::Value = serde_json::from_str(text)
                .map_err(|e| format!("the JSON schema is not valid JSON: {e}"))?;
            TopLevelGrammar::from_json_schema(compact(schema))
        }
        StructuredOutput::JsonObject => {
            TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
        }
        StructuredOutput::Regex(rx) => TopLevelGrammar::from_regex(rx),
        StructuredOutput::Choice(choices) => {
            if choices.is_empty() {
                return Err("a choice constraint needs at least one choice".into());
            }
            let alternatives: Vec<String> = choices.iter().map(|c| escape_regex(c)).collect();
            TopLevelGrammar::from_regex(&format!("(?:{})", alternatives.join("|")))
        }
        StructuredOutput::Grammar(lark) => TopLevelGrammar::from_lark(lark.clone()),
    })
}

/// JSON output is laid out like `json.dumps` (", " and ": ", no other whitespace) unless the
/// schema says otherwise in llguidance's `x-guidance` options: with free whitespace a model
/// may emit newlines forever and never close the object (small models do).
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    schema
}

/// `text` as a regex matching itself (the meta characters `regex_syntax::escape` escapes).
fn escape_regex(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A compiled constraint for one request: which tokens may come next.
pub struct Grammar(Matcher);

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammar")
    }
}

impl Clone for Grammar {
    fn clone(&self) -> Self {
        Grammar(self.0.deep_clone())
    }
}

impl Grammar {
    /// Writes the allowed-token bitmask (bit `t % 32` of word `t / 32`) into `words`. A
    /// matcher in an error state allows only EOS, so the request ends.
    pub fn fill_mask(&mut self, words: &mut [u32], eos: &[TokenId]) {
        match self.0.compute_mask_or_eos() {
            Ok(mask) => {
                let src = mask.as_slice();
                let n = src.len().min(words.len());
                words[..n].copy_from_slice(&src[..n]);
                words[n..].fill(0);
            }
            Err(e) => {
                tracing::warn!("grammar mask failed, allowing only EOS: {e:#}");
                words.fill(0);
                for &t in eos {
                    if let Some(w) = words.get_mut(t as usize / 32) {
                        *w |= 1 << (t % 32);
                    }
                }
            }
        }
    }

    /// Advances past a committed token. Errors if the grammar does not allow it.
    pub fn consume(&mut self, token: TokenId) -> Result<(), String> {
        self.0.consume_token(token).map_err(|e| format!("{e:#}"))
    }

    /// The grammar is complete and allows nothing more (not even EOS is needed).
    pub fn is_finished(&self) -> bool {
        self.0.is_stopped()
    }
}

/// llguidance's parser factory for one tokenizer, with a cache of compiled grammars.
pub struct GrammarCompiler {
    factory: ParserFactory,
    eos: Vec<TokenId>,
    cache: Mutex<(
        HashMap<StructuredOutput, Matcher>,
        VecDeque<StructuredOutput>,
    )>,
}

impl GrammarCompiler {
    /// Reads `tokenizer.json` and builds the token trie over `vocab_size` ids (the model's:
    /// ids past the tokenizer's vocabulary are never allowed).
    pub fn from_tokenizer_json(
        path: &Path,
        vocab_size: usize,
        eos: &[TokenId],
    ) -> anyhow::Result<GrammarCompiler> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
            .with_context(|| format!("reading the vocabulary of {}", path.display()))?;
        if words.len() > vocab_size {
            bail!(
                "{} has {} tokens but the model's vocabulary has {vocab_size}",
                path.display(),
                words.len()
            );
        }
        words.resize(vocab_size, Vec::new());
        let eos: Vec<TokenId> = eos
            .iter()
            .copied()
            .filter(|&t| (t as usize) < vocab_size)
            .collect();
        let Some(&first) = eos.first() else {
            bail!("structured outputs need an EOS token id inside the vocabulary");
        };
        let info = TokRxInfo::new(vocab_size as u32, first);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(GrammarCompiler {
            factory,
            eos,
            cache: Mutex::new((HashMap::new(), VecDeque::new())),
        })
    }

    /// Width of the masks, in 32-bit words.
    pub fn mask_words(&self) -> usize {
        self.factory.tok_env().tok_trie().vocab_size().div_ceil(32)
    }

    pub fn eos(&self) -> &[TokenId] {
        &self.eos
    }

    /// The bytes of `ids` (special tokens as their text), for tests and logs.
    pub fn decode(&self, ids: &[TokenId]) -> Vec<u8> {
        self.factory.tok_env().tok_trie().decode(ids)
    }

    /// Compiles `spec` (or clones the cached compilation). The error names the problem.
    pub fn compile(&self, spec: &StructuredOutput) -> Result<Grammar, String> {
        if let Some(m) = self.lock().0.get(spec) {
            return Ok(Grammar(m.deep_clone()));
        }
        let grammar = top_level(spec)?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| format!("{e:#}"))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        let mut cache = self.lock();
        let (map, order) = &mut *cache;
        if !map.contains_key(spec) {
            if order.len() >= CACHE_ENTRIES {
                if let Some(old) = order.pop_front() {
                    map.remove(&old);
                }
            }
            order.push_back(spec.clone());
            map.insert(spec.clone(), matcher.deep_clone());
        }
        Ok(Grammar(matcher))
    }

    fn lock(
        &self,
    ) -> std::sync::MutexGuard<
        '_,
        (
            HashMap<StructuredOutput, Matcher>,
            VecDeque<StructuredOutput>,
        ),
    > {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A background thread that compiles grammars for the engine, so that a slow schema never
/// stalls the engine loop. `wake` is called after each result (the server uses it to wake an
/// idle engine thread).
pub struct CompileWorker {
    jobs: Option<mpsc::Sender<(u64, StructuredOutput)>>,
    done: mpsc::Receiver<(u64, Result<Grammar, String>)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Called by the compile thread when a result is ready.
pub type Waker = Arc<dyn Fn() + Send + Sync>;

impl CompileWorker {
    pub fn start(compiler: Arc<GrammarCompiler>, wake: Waker) -> anyhow::Result<CompileWorker> {
        let (jobs, rx) = mpsc::channel::<(u64, StructuredOutput)>();
        let (tx, done) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("harrier-grammar".into())
            .spawn(move || {
                while let Ok((id, spec)) = rx.recv() {
                    let started = std::time::Instant::now();
                    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        compiler.compile(&spec)
                    }))
                    .unwrap_or_else(|_| Err("the grammar compiler panicked".into()));
                    tracing::debug!(
                        ms = started.elapsed().as_millis() as u64,
                        ok = result.is_ok(),
                        "grammar compiled"
                    );
                    if tx.send((id, result)).is_err() {
                        break;
                    }
                    wake();
                }
            })
            .context("spawning the grammar compiler thread")?;
        Ok(CompileWorker {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
        })
    }

    pub fn submit(&self, id: u64, spec: StructuredOutput) {
        if let Some(j) = &self.jobs {
            let _ = j.send((id, spec));
        }
    }

    pub fn try_recv(&self) -> Option<(u64, Result<Grammar, String>)> {
        self.done.try_recv().ok()
    }
}

impl Drop for CompileWorker {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
#[path = "structured_tests.rs"]
mod engine_tests;

#[cfg(test)]
mod tests {
    use super::*;

    fn compiler() -> GrammarCompiler {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/harrier-cpu");
        GrammarCompiler::from_tokenizer_json(&dir.join("tokenizer.json"), 8192, &[1, 8, 9]).unwrap()
    }

    fn allowed(g: &mut Grammar, c: &GrammarCompiler) -> Vec<u32> {
        let mut words = vec![0u32; c.mask_words()];
        g.fill_mask(&mut words, c.eos());
        (0..8192u32)
            .filter(|&t| words[t as usize / 32] >> (t % 32) & 1 == 1)
            .collect()
    }

    #[test]
    fn invalid_constraints_name_the_problem() {
        let c = compiler();
        for (spec, needle) in [
            (StructuredOutput::Regex("a(".into()), "unclosed"),
            (StructuredOutput::JsonSchema("{".into()), "not valid json"),
            (
                StructuredOutput::JsonSchema(r#"{"type": "strnig"}"#.into()),
                "strnig",
            ),
            (StructuredOutput::Grammar("start: foo".into()), "foo"),
            (StructuredOutput::Choice(vec![]), "at least one"),
        ] {
            let err = c.compile(&spec).unwrap_err();
            eprintln!("{spec:?}: {err}");
            assert!(err.to_lowercase().contains(needle), "{spec:?}: {err}");
        }
    }

    #[test]
    fn a_choice_allows_only_its_strings_then_eos() {
        let c = compiler();
        let mut g = c
            .compile(&StructuredOutput::Choice(vec!["yes".into(), "no".into()]))
            .unwrap();
        let first = allowed(&mut g, &c);
        assert!(!first.is_empty() && !first.contains(&1), "{first:?}");
        // Whatever the first token, following allowed tokens spell out a choice.
        let trie_text = |ids: &[u32]| {
            let env = c.factory.tok_env().clone();
            String::from_utf8_lossy(&env.tok_trie().decode(ids)).into_owned()
        };
        let mut text_ids = vec![first[0]];
        g.consume(first[0]).unwrap();
        loop {
            let next = allowed(&mut g, &c);
            if g.is_finished() || next.iter().all(|t| [1, 8, 9].contains(t)) {
                break;
            }
            let t = *next.iter().find(|t| ![1, 8, 9].contains(*t)).unwrap();
            g.consume(t).unwrap();
            text_ids.push(t);
        }
        let text = trie_text(&text_ids);
        assert!(text == "yes" || text == "no", "{text:?}");
    }

    #[test]
    fn compiled_grammars_are_cached_and_independent() {
        let c = compiler();
        let spec = StructuredOutput::Regex("[0-9]{3}".into());
        let mut a = c.compile(&spec).unwrap();
        let mut b = c.compile(&spec).unwrap();
        assert_eq!(c.lock().0.len(), 1);
        let t = allowed(&mut a, &c)[0];
        a.consume(t).unwrap();
        // `b` did not move with `a`.
        assert_ne!(allowed(&mut a, &c), allowed(&mut b, &c));
    }
}
