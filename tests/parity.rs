//! Parity of the CPU forward pass with Hugging Face transformers (float32).
//!
//! The fixtures `tests/fixtures/parity_<name>.json` are written by
//! `scripts/gpu/parity_fixtures.py` on the GPU machine: it runs transformers on a model
//! directory and records for each prompt the greedy continuation (32 tokens) and each step's
//! top-5 `(id, logit)`, with the model's config and a weight checksum.
//!
//! Two kinds of model are checked:
//! - random-weight presets (`scripts/gpu/parity.sh` generates each with `harrier gen-model` and a
//!   fixed seed; `scripts/gpu/gemma3_check.sh` micro-gemma3): here the same preset is regenerated with the fixture's seed (the generator is
//!   deterministic on any machine);
//! - the committed trained models (`engine-core/models/<name>`, fixtures from
//!   `scripts/gpu/train.sh` on held-out text prompts, `"seed": null`): loaded as they are.
//!
//! Either way the directory's config and weight checksum must match the fixture's, and the
//! model runs through `CpuModel::forward` — all prompts in one batch, prefill then
//! token-by-token decode through the paged cache. Greedy ids must be identical and every
//! recorded top-5 logit within 1e-3 relative.

#[path = "model_support.rs"]
mod model_support;

use std::path::PathBuf;

use harrier_engine::model::{
    expected_tensors, Checkpoint, CpuModel, ModelConfig, ModelDir, RopeScaling,
};
use model_support::{gen_preset, greedy_batch};
use serde_json::Value;

const LOGIT_RTOL: f64 = 1e-3;

fn fixture(preset: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(format!("parity_{preset}.json"));
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => panic!(
            "parity fixture {} is missing ({e}).\nGenerate it with transformers on the GPU machine: run \
             scripts/gpu/parity.sh there (see ../shared/GPU.md; it writes $OUT/parity_*.json) and commit the \
             files into tests/fixtures/.",
            path.display()
        ),
    };
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: invalid JSON: {e}", path.display()))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// `(sum, sum of |x|)` over every distinct parameter, as the fixture script computes it.
fn checksum(md: &ModelDir) -> (f64, f64) {
    let ck = Checkpoint::open(&md.path).expect("checkpoint");
    let (mut s, mut a) = (0.0f64, 0.0f64);
    for (name, shape) in expected_tensors(&md.config) {
        for v in ck.get(&name, &shape).expect("tensor").to_f32() {
            s += v as f64;
            a += (v as f64).abs();
        }
    }
    (s, a)
}

/// Regenerates the random-weight `preset` with the fixture's seed and checks it.
fn check_preset(preset: &str) {
    let fx = fixture(preset);
    assert_eq!(fx["preset"], preset, "fixture of another preset");
    let seed = fx["seed"].as_u64().expect("seed");
    let dir = tempfile::tempdir().expect("tempdir");
    let md = gen_preset(preset, seed, dir.path()).expect("generate");
    check_model(
        preset,
        &fx,
        &md,
        "the generator changed: regenerate the fixtures with scripts/gpu/parity.sh",
    );
}

/// Checks the trained model committed in `engine-core/models/<name>` as it is.
fn check_committed(name: &str) {
    let fx = fixture(name);
    assert_eq!(fx["preset"], name, "fixture of another model");
    assert!(
        fx["seed"].is_null(),
        "{name}: the fixture is of a generated preset (seed {}), not the committed model",
        fx["seed"]
    );
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../engine-core/models")
        .join(name);
    let md = ModelDir::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    check_model(
        name,
        &fx,
        &md,
        "the committed weights changed: regenerate the fixture with scripts/gpu/parity_fixtures.py",
    );
}

/// The fixture's config fields as ModelConfig reads them.
fn check_config(name: &str, cfg: &Value, c: &ModelConfig) {
    assert_eq!(
        cfg["architectures"][0].as_str(),
        Some(c.architecture.hf_name()),
        "{name}: architecture differs from the fixture's"
    );
    for (key, ours) in [
        ("vocab_size", c.vocab_size),
        ("hidden_size", c.hidden_size),
        ("num_hidden_layers", c.num_layers),
        ("num_attention_heads", c.num_heads),
        ("num_key_value_heads", c.num_kv_heads),
        ("head_dim", c.head_dim),
        ("intermediate_size", c.intermediate_size),
        ("max_position_embeddings", c.max_position_embeddings),
    ] {
        assert_eq!(
            cfg[key].as_u64(),
            Some(ours as u64),
            "{name}: config {key} differs from the fixture's"
        );
    }
    assert_eq!(
        cfg["tie_word_embeddings"].as_bool(),
        Some(c.tie_word_embeddings),
        "{name}: config tie_word_embeddings differs from the fixture's"
    );
    // Gemma 3 nests its RoPE by layer type; the full layers' is ModelConfig's rope_theta.
    let gemma = c.sliding.is_some();
    let rope = match gemma {
        true => &cfg["rope_parameters"]["full_attention"],
        false => &cfg["rope_parameters"],
    };
    if let Some(s) = &c.sliding {
        let local = cfg["rope_parameters"]["sliding_attention"]["rope_theta"].as_f64();
        assert_eq!(
            local,
            Some(s.rope_theta as f64),
            "{name}: sliding rope_theta"
        );
        assert_eq!(
            cfg["sliding_window"].as_u64(),
            Some(s.window as u64),
            "{name}: window"
        );
        let types: Vec<&str> = s.layers.iter().map(|l| l.hf_name()).collect();
        assert_eq!(
            cfg["layer_types"],
            serde_json::json!(types),
            "{name}: layer_types"
        );
        assert_eq!(
            cfg["query_pre_attn_scalar"].as_f64(),
            c.query_pre_attn_scalar.map(f64::from),
            "{name}: query_pre_attn_scalar"
        );
        assert_eq!(
            cfg["hidden_activation"], "gelu_pytorch_tanh",
            "{name}: activation"
        );
    }
    for (key, want, ours) in [
        ("rms_norm_eps", &cfg["rms_norm_eps"], c.rms_norm_eps),
        ("rope_theta", &rope["rope_theta"], c.rope_theta),
    ] {
        let want = want
            .as_f64()
            .unwrap_or_else(|| panic!("{name}: fixture has no {key}"));
        assert!(
            (ours as f64 - want).abs() <= 1e-6 * want.abs(),
            "{name}: config {key} {ours} differs from the fixture's {want}"
        );
    }
    match (rope["rope_type"].as_str(), &c.rope_scaling) {
        (Some("default"), None) => {}
        (Some("linear"), Some(RopeScaling::Linear { factor })) => {
            assert_eq!(
                rope["factor"].as_f64(),
                Some(*factor as f64),
                "{name}: rope factor"
            );
        }
        (Some("llama3"), Some(RopeScaling::Llama3(s))) => {
            for (key, ours) in [
                ("factor", s.factor as f64),
                ("low_freq_factor", s.low_freq_factor as f64),
                ("high_freq_factor", s.high_freq_factor as f64),
                (
                    "original_max_position_embeddings",
                    s.original_max_position_embeddings as f64,
                ),
            ] {
                assert_eq!(
                    rope[key].as_f64(),
                    Some(ours),
                    "{name}: rope {key} differs from the fixture's"
                );
            }
        }
        (t, ours) => panic!("{name}: fixture rope_type {t:?}, ours {ours:?}"),
    }
}

/// Config, weight checksum, greedy ids and top-5 logits of `md` against the fixture `fx`;
/// `stale` says what a checksum mismatch means.
fn check_model(name: &str, fx: &Value, md: &ModelDir, stale: &str) {
    check_config(name, &fx["config"], &md.config);
    let (sum, abs_sum) = checksum(md);
    let (fs, fa) = (
        fx["param_checksum"]["sum"].as_f64().expect("sum"),
        fx["param_checksum"]["abs_sum"].as_f64().expect("abs"),
    );
    assert!(
        (abs_sum - fa).abs() <= 1e-7 * fa && (sum - fs).abs() <= 1e-7 * fa,
        "{name}: weights differ from the fixture's (checksum {sum}/{abs_sum} vs {fs}/{fa}); {stale}"
    );

    let prompts_fx = fx["prompts"].as_array().expect("prompts");
    let prompts: Vec<Vec<u32>> = prompts_fx.iter().map(|p| ids(&p["prompt_ids"])).collect();
    let want_greedy: Vec<Vec<u32>> = prompts_fx.iter().map(|p| ids(&p["greedy_ids"])).collect();
    let steps = want_greedy[0].len();
    let mut model = CpuModel::load(md).expect("load");
    let mut problems = Vec::new();
    let mut worst = 0.0f64;
    let got = greedy_batch(&mut model, &prompts, steps, |p, step, row| {
        let top5 = prompts_fx[p]["top5"][step].as_array().expect("top5");
        let scale = top5.iter().map(|e| e[1].as_f64().expect("logit").abs()).fold(0.0, f64::max);
        for e in top5 {
            let (id, want) = (e[0].as_u64().expect("id") as usize, e[1].as_f64().expect("logit"));
            let ours = row[id] as f64;
            let rel = (ours - want).abs() / scale.max(1e-6);
            worst = worst.max(rel);
            if rel > LOGIT_RTOL {
                problems.push(format!("prompt {p} step {step} token {id}: logit {ours} vs transformers {want} (rel {rel:.2e})"));
            }
        }
    })
    .expect("greedy");
    for (p, (g, w)) in got.iter().zip(&want_greedy).enumerate() {
        if g != w {
            let at = g.iter().zip(w).position(|(a, b)| a != b).unwrap_or(0);
            problems.push(format!("prompt {p} (len {}): greedy ids diverge at step {at}: ours {g:?} vs transformers {w:?}", prompts[p].len()));
        }
    }
    eprintln!(
        "{name}: {} prompts x {steps} steps, worst top-5 logit rel err {worst:.2e}",
        prompts.len()
    );
    assert!(
        problems.is_empty(),
        "{name}: {} mismatches with transformers:\n{}",
        problems.len(),
        problems[..problems.len().min(20)].join("\n")
    );
}

#[test]
fn parity_micro() {
    check_preset("micro");
}

#[test]
fn parity_micro_qwen3() {
    check_preset("micro-qwen3");
}

#[test]
fn parity_tiny() {
    check_preset("tiny");
}

/// Gemma 3 (window 32, so the prompts of 100 and 200 tokens and their decodes cross it).
#[test]
fn parity_micro_gemma3() {
    check_preset("micro-gemma3");
}

#[test]
fn harrier_cpu_matches_transformers() {
    check_committed("harrier-cpu");
}

#[test]
fn harrier_cpu_draft_matches_transformers() {
    check_committed("harrier-cpu-draft");
}
