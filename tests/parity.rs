//! Parity of the CPU forward pass with Hugging Face transformers (float32).
//!
//! The fixtures `tests/fixtures/parity_<preset>.json` are written by `scripts/gpu/parity.sh`
//! on the GPU machine: it generates each preset with `harrier gen-model` and a fixed seed, runs
//! transformers on it (`scripts/gpu/parity_fixtures.py`), and records for 8 prompts the greedy
//! continuation (32 tokens) and each step's top-5 `(id, logit)`.
//!
//! Here the same preset is regenerated with the fixture's seed (the generator is deterministic
//! on any machine), checked against the fixture's weight checksum, and run through
//! `CpuModel::forward` — all prompts in one batch, prefill then token-by-token decode through
//! the paged cache. Greedy ids must be identical and every recorded top-5 logit within 1e-3
//! relative.

#[path = "model_support.rs"]
mod model_support;

use std::path::PathBuf;

use harrier_engine::model::{expected_tensors, Checkpoint, CpuModel, ModelDir};
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

fn check_preset(preset: &str) {
    let fx = fixture(preset);
    assert_eq!(fx["preset"], preset, "fixture of another preset");
    let seed = fx["seed"].as_u64().expect("seed");
    let dir = tempfile::tempdir().expect("tempdir");
    let md = gen_preset(preset, seed, dir.path()).expect("generate");
    let c = &md.config;
    let cfg = &fx["config"];
    for (key, ours) in [
        ("vocab_size", c.vocab_size),
        ("hidden_size", c.hidden_size),
        ("num_hidden_layers", c.num_layers),
        ("num_attention_heads", c.num_heads),
        ("num_key_value_heads", c.num_kv_heads),
        ("head_dim", c.head_dim),
        ("intermediate_size", c.intermediate_size),
    ] {
        assert_eq!(
            cfg[key].as_u64(),
            Some(ours as u64),
            "{preset}: config {key} differs from the fixture's"
        );
    }
    let (sum, abs_sum) = checksum(&md);
    let (fs, fa) = (
        fx["param_checksum"]["sum"].as_f64().expect("sum"),
        fx["param_checksum"]["abs_sum"].as_f64().expect("abs"),
    );
    assert!(
        (abs_sum - fa).abs() <= 1e-7 * fa && (sum - fs).abs() <= 1e-7 * fa,
        "{preset}: generated weights differ from the fixture's (checksum {sum}/{abs_sum} vs {fs}/{fa}); \
         the generator changed: regenerate the fixtures with scripts/gpu/parity.sh"
    );

    let prompts_fx = fx["prompts"].as_array().expect("prompts");
    let prompts: Vec<Vec<u32>> = prompts_fx.iter().map(|p| ids(&p["prompt_ids"])).collect();
    let want_greedy: Vec<Vec<u32>> = prompts_fx.iter().map(|p| ids(&p["greedy_ids"])).collect();
    let steps = want_greedy[0].len();
    let mut model = CpuModel::load(&md).expect("load");
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
        "{preset}: {} prompts x {steps} steps, worst top-5 logit rel err {worst:.2e}",
        prompts.len()
    );
    assert!(
        problems.is_empty(),
        "{preset}: {} mismatches with transformers:\n{}",
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
