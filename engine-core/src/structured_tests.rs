//! Structured outputs through the real engine loop and the CPU backend on the committed
//! harrier-cpu: JSON schema, JSON object, regex, choice and grammar constraints hold for
//! greedy and sampled requests (with and without speculative decoding), unconstrained batch
//! mates are unaffected, invalid constraints and aborts while compiling finish cleanly.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use harrier_shared::protocol::{
    EngineCoreRequest, FinishReason, SamplingParams, StructuredOutput, TokenId,
};

use crate::config::EngineConfig;
use crate::engine::{EngineCore, ModelFacts, Progress};
use crate::executor::cpu::{CpuExecutor, CpuExecutorConfig, CpuProposer};
use crate::model::{CpuModel, ModelDir};
use crate::request::Origin;
use crate::structured::GrammarCompiler;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/harrier-cpu")
}

fn engine(spec: bool) -> (EngineCore<CpuExecutor>, Arc<GrammarCompiler>) {
    let d = ModelDir::open(&dir()).unwrap();
    let proposer = spec.then(|| {
        let dd = ModelDir::open(&dir().with_file_name("harrier-cpu-draft")).unwrap();
        CpuProposer::Draft(Box::new(CpuModel::load(&dd).unwrap()))
    });
    let exec = CpuExecutor::new(
        CpuModel::load(&d).unwrap(),
        &d.config,
        CpuExecutorConfig {
            num_kv_blocks: 1024,
            num_local_kv_blocks: None,
            block_size: 16,
            max_rows: 32,
        },
        proposer,
    )
    .unwrap();
    let cfg = EngineConfig {
        max_num_seqs: 32,
        max_model_len: 1024,
        num_kv_blocks: 1024,
        num_speculative_tokens: if spec { 4 } else { 0 },
        ..EngineConfig::default()
    };
    let eos = d.generation.eos_token_ids.clone();
    let mut e = EngineCore::new(
        cfg,
        ModelFacts {
            vocab_size: d.config.vocab_size as u32,
            eos_token_ids: eos.clone(),
        },
        exec,
    )
    .unwrap();
    let c = Arc::new(
        GrammarCompiler::from_tokenizer_json(&dir().join("tokenizer.json"), 8192, &eos).unwrap(),
    );
    e.enable_structured_outputs(c.clone());
    (e, c)
}

#[derive(Debug, Default, Clone)]
struct Out {
    tokens: Vec<TokenId>,
    finish: Option<FinishReason>,
    message: Option<String>,
}

fn run(
    e: &mut EngineCore<CpuExecutor>,
    work: &[(&str, Vec<TokenId>, SamplingParams)],
    abort_at_once: &[&str],
) -> HashMap<String, Out> {
    for (id, prompt, sampling) in work {
        e.add_request(
            Origin(0),
            EngineCoreRequest {
                request_id: id.to_string(),
                prompt_token_ids: prompt.clone(),
                sampling: sampling.clone(),
                arrival_time: 0.0,
                cache_salt: None,
            },
        );
    }
    let ids: Vec<String> = abort_at_once.iter().map(|s| s.to_string()).collect();
    e.abort(Origin(0), &ids);
    let mut outs: HashMap<String, Out> = HashMap::new();
    loop {
        let p = e.step().unwrap();
        for (_, o) in e.take_outputs() {
            let out = outs.entry(o.request_id.clone()).or_default();
            assert!(
                out.finish.is_none(),
                "{}: output after the finish",
                o.request_id
            );
            out.tokens.extend_from_slice(&o.new_token_ids);
            if let Some(f) = o.finish {
                out.finish = Some(f.reason);
                out.message = f.message;
            }
        }
        if p == Progress::Idle && !e.has_work() {
            break;
        }
        if p == Progress::Idle {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    assert_eq!(e.scheduler().kv().num_used(), 0);
    outs
}

fn text(c: &GrammarCompiler, o: &Out) -> String {
    String::from_utf8(c.decode(&o.tokens)).unwrap()
}

const PROMPT: [TokenId; 6] = [300, 301, 302, 303, 304, 305];

fn params(temperature: f32, seed: u64, s: StructuredOutput) -> SamplingParams {
    SamplingParams {
        temperature,
        seed: Some(seed),
        max_tokens: 300,
        structured: Some(Box::new(s)),
        ..SamplingParams::default()
    }
}

#[test]
fn constraints_hold_with_unconstrained_batch_mates_unaffected() {
    let schema = r#"{"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150}, "tags": {"type": "array",
        "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}, "required": ["name", "age", "tags"],
        "additionalProperties": false}"#;
    for spec in [false, true] {
        let (mut e, c) = engine(spec);
        let plain = |i: u64| SamplingParams::greedy(24 + i as u32);
        let mut work: Vec<(&str, Vec<TokenId>, SamplingParams)> = Vec::new();
        let names: Vec<String> = (0..24).map(|i| format!("r{i}")).collect();
        for (i, name) in names.iter().enumerate() {
            let i = i as u64;
            let t = if i.is_multiple_of(2) { 0.0 } else { 0.9 };
            let sampling = match i % 6 {
                0 => params(t, i, StructuredOutput::JsonSchema(schema.into())),
                1 => params(t, i, StructuredOutput::JsonObject),
                2 => params(t, i, StructuredOutput::Regex("[0-9]{3}-[a-z]{2,4}".into())),
                3 => params(
                    t,
                    i,
                    StructuredOutput::Choice(vec!["positive".into(), "negative".into()]),
                ),
                4 => params(
                    t,
                    i,
                    StructuredOutput::Grammar(
                        "start: \"def \" NAME \"(\" NAME \"):\"\nNAME: /[a-z_]{1,8}/".into(),
                    ),
                ),
                _ => plain(i),
            };
            work.push((name, PROMPT.to_vec(), sampling));
        }
        let outs = run(&mut e, &work, &[]);
        for (i, name) in names.iter().enumerate() {
            let o = &outs[name];
            let s = text(&c, o);
            match i % 6 {
                0 => {
                    assert_eq!(o.finish, Some(FinishReason::Stop), "{name}: {s:?}");
                    let v: serde_json::Value =
                        serde_json::from_str(&s).unwrap_or_else(|e| panic!("{name}: {s:?}: {e}"));
                    assert!(
                        v["name"].is_string() && v["name"].as_str().unwrap().chars().count() <= 12,
                        "{s}"
                    );
                    let age = v["age"].as_i64().unwrap();
                    assert!((0..=150).contains(&age), "{s}");
                    assert!(v["tags"].as_array().unwrap().len() <= 3, "{s}");
                    assert_eq!(v.as_object().unwrap().len(), 3, "{s}");
                }
                1 => {
                    if o.finish == Some(FinishReason::Stop) {
                        let v: serde_json::Value = serde_json::from_str(&s)
                            .unwrap_or_else(|e| panic!("{name}: {s:?}: {e}"));
                        assert!(v.is_object());
                    } else {
                        // Out of tokens mid-object: still a prefix of one.
                        assert_eq!(o.finish, Some(FinishReason::Length));
                        assert!(s.trim_start().starts_with('{'), "{s:?}");
                    }
                }
                2 => {
                    let (num, word) = s.split_once('-').unwrap_or_else(|| panic!("{s:?}"));
                    assert!(
                        num.len() == 3 && num.bytes().all(|b| b.is_ascii_digit()),
                        "{s:?}"
                    );
                    assert!(
                        (2..=4).contains(&word.len())
                            && word.bytes().all(|b| b.is_ascii_lowercase()),
                        "{s:?}"
                    );
                    assert_eq!(o.finish, Some(FinishReason::Stop));
                }
                3 => {
                    assert!(s == "positive" || s == "negative", "{s:?}");
                    assert_eq!(o.finish, Some(FinishReason::Stop));
                }
                4 => {
                    assert!(s.starts_with("def ") && s.ends_with("):"), "{s:?}");
                    assert_eq!(o.finish, Some(FinishReason::Stop));
                }
                _ => {}
            }
        }
        // The unconstrained requests alone give what they gave in the mixed batch.
        let alone: Vec<_> = work
            .iter()
            .filter(|w| w.2.structured.is_none())
            .cloned()
            .collect();
        let outs_alone = run(&mut engine(spec).0, &alone, &[]);
        for (id, _, _) in &alone {
            assert_eq!(outs_alone[*id].tokens, outs[*id].tokens, "{id}");
        }
    }
}

#[test]
fn invalid_constraints_and_aborts_while_compiling_finish_cleanly() {
    let (mut e, c) = engine(false);
    let work = vec![
        (
            "bad",
            PROMPT.to_vec(),
            params(0.0, 0, StructuredOutput::Regex("(".into())),
        ),
        (
            "gone",
            PROMPT.to_vec(),
            params(0.0, 0, StructuredOutput::JsonObject),
        ),
        (
            "ok",
            PROMPT.to_vec(),
            params(0.0, 0, StructuredOutput::Regex("[ab]{4}".into())),
        ),
    ];
    let outs = run(&mut e, &work, &["gone"]);
    assert_eq!(outs["bad"].finish, Some(FinishReason::Error));
    assert!(
        outs["bad"]
            .message
            .as_deref()
            .unwrap()
            .contains("invalid structured-output constraint"),
        "{:?}",
        outs["bad"].message
    );
    assert_eq!(outs["gone"].finish, Some(FinishReason::Abort));
    assert!(outs["gone"].tokens.is_empty());
    assert_eq!(outs["ok"].finish, Some(FinishReason::Stop));
    let ok = text(&c, &outs["ok"]);
    assert!(
        ok.len() == 4 && ok.bytes().all(|b| b == b'a' || b == b'b'),
        "{ok:?}"
    );
}

#[test]
fn shutdown_answers_requests_still_compiling() {
    let (mut e, _) = engine(false);
    // A schema large enough to take a moment; shut down at once.
    let props: Vec<String> = (0..200)
        .map(|i| format!("\"p{i}\": {{\"type\": \"integer\"}}"))
        .collect();
    let schema = format!(
        "{{\"type\": \"object\", \"properties\": {{{}}}}}",
        props.join(", ")
    );
    e.add_request(
        Origin(0),
        EngineCoreRequest {
            request_id: "s".into(),
            prompt_token_ids: PROMPT.to_vec(),
            sampling: params(0.0, 0, StructuredOutput::JsonSchema(schema)),
            arrival_time: 0.0,
            cache_salt: None,
        },
    );
    e.shutdown().unwrap();
    let outs: Vec<_> = e.take_outputs().collect();
    assert_eq!(outs.len(), 1, "{outs:?}");
    assert_eq!(
        outs[0].1.finish.as_ref().unwrap().reason,
        FinishReason::Abort
    );
}
