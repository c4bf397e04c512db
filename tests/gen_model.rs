//! `harrier gen-model`: generated checkpoints are deterministic, load in every dtype and
//! sharding, and behave like a language model should at random init (finite, non-degenerate
//! logits; greedy decoding that moves).

#[path = "model_support.rs"]
mod model_support;

use harrier_engine::gen_model::{self, GenModelArgs};
use harrier_engine::model::{CpuModel, ModelDir, WeightDtype};
use model_support::{gen_preset, greedy_batch};

fn logits_of(model: &mut CpuModel, prompt: &[u32]) -> Vec<f32> {
    let mut out = Vec::new();
    greedy_batch(model, &[prompt.to_vec()], 1, |_, _, row| out = row.to_vec()).expect("forward");
    out
}

#[test]
fn micro_logits_are_sane_and_greedy_moves() {
    for preset in ["micro", "micro-qwen3", "tiny"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let md = gen_preset(preset, 7, dir.path()).expect("generate");
        let mut model = CpuModel::load(&md).expect("load");
        let prompts: Vec<Vec<u32>> = vec![
            vec![5, 77, 300, 12, 900],
            vec![42],
            (0..40).map(|i| i * 25 % 1000).collect(),
        ];
        let mut stds = Vec::new();
        let outs = greedy_batch(&mut model, &prompts, 24, |_, _, row| {
            assert!(
                row.iter().all(|v| v.is_finite()),
                "{preset}: non-finite logits"
            );
            let n = row.len() as f64;
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / n;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
            stds.push(var.sqrt());
        })
        .expect("greedy");
        eprintln!(
            "{preset}: logits std {:.3}..{:.3}",
            stds.iter().cloned().fold(f64::MAX, f64::min),
            stds.iter().cloned().fold(0.0, f64::max)
        );
        for s in &stds {
            assert!((0.1..50.0).contains(s), "{preset}: logits std {s}");
        }
        for (p, o) in prompts.iter().zip(&outs) {
            let distinct: std::collections::BTreeSet<_> = o.iter().collect();
            assert!(
                distinct.len() > 1,
                "{preset}: greedy continuation of {p:?} is one token: {o:?}"
            );
        }
    }
}

#[test]
fn generation_is_deterministic_and_seeded() {
    let read = |seed: u64| {
        let dir = tempfile::tempdir().expect("tempdir");
        gen_preset("micro", seed, dir.path()).expect("generate");
        std::fs::read(dir.path().join("model.safetensors")).expect("read")
    };
    let a = read(3);
    assert_eq!(a, read(3), "same seed, same bytes");
    assert_ne!(a, read(4), "another seed, other weights");
}

#[test]
fn dtypes_and_shards_load_to_the_same_model() {
    let prompt: Vec<u32> = (0..19).map(|i| (i * 37 + 5) % 1024).collect();
    let gen = |dtype: Option<gen_model::DtypeArg>, shard: Option<u64>| {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut args = GenModelArgs::new("micro", dir.path());
        args.seed = 9;
        args.no_tokenizer = true;
        args.dtype = dtype;
        args.max_shard_size = shard;
        gen_model::run(&args).expect("generate");
        let md = ModelDir::open(dir.path()).expect("open");
        let mut model = CpuModel::load(&md).expect("load");
        (logits_of(&mut model, &prompt), md, dir)
    };
    let (single, md, _d1) = gen(None, None);
    assert_eq!(md.config.dtype, Some(WeightDtype::F32));
    let (sharded, _, d2) = gen(None, Some(100_000));
    let shards = std::fs::read_dir(d2.path())
        .expect("ls")
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().starts_with("model-"))
        })
        .count();
    assert!(shards > 2, "expected several shards, got {shards}");
    assert!(d2.path().join("model.safetensors.index.json").is_file());
    assert!(!d2.path().join("model.safetensors").exists());
    assert_eq!(single, sharded, "sharded checkpoint must load identically");

    let scale = single.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (dtype, want, tol) in [
        (gen_model::DtypeArg::Bf16, WeightDtype::Bf16, 0.1),
        (gen_model::DtypeArg::F16, WeightDtype::F16, 0.01),
    ] {
        let (got, md, _d) = gen(Some(dtype), None);
        assert_eq!(md.config.dtype, Some(want));
        let err = got
            .iter()
            .zip(&single)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err / scale < tol,
            "{want:?}: logits differ from f32 by {} (rel)",
            err / scale
        );
    }
}

#[test]
fn preset_configs_open_as_written() {
    // Every preset's config.json / generation_config.json round-trips through ModelDir::open
    // (weights of the big presets are not generated here).
    for p in gen_model::Preset::ALL {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = p.config();
        std::fs::write(
            dir.path().join("config.json"),
            p.config_json(&c).to_string(),
        )
        .expect("write");
        std::fs::write(
            dir.path().join("generation_config.json"),
            gen_model::generation_config_json(p).to_string(),
        )
        .expect("write");
        let md = ModelDir::open(dir.path()).expect("open");
        assert_eq!(md.config, c, "{}", p.name());
        assert_eq!(md.generation.eos_token_ids, p.special_ids().generation_eos);
    }
}

#[test]
fn tokenizer_files_are_written_when_a_tokenizer_is_given() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tok = dir.path().join("tokenizer.json");
    std::fs::write(
        &tok,
        r#"{"added_tokens": [{"id": 128009, "content": "<|eot_id|>", "special": true}]}"#,
    )
    .expect("write");
    let out = dir.path().join("m");
    let mut args = GenModelArgs::new("micro", &out);
    args.tokenizer = Some(tok);
    gen_model::run(&args).expect("generate");
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("tokenizer_config.json")).expect("read"))
            .expect("json");
    assert_eq!(cfg["bos_token"], "<|begin_of_text|>");
    assert_eq!(
        cfg["added_tokens_decoder"]["128009"]["content"],
        "<|eot_id|>"
    );
    assert!(out.join("tokenizer.json").is_file());
    assert!(cfg["chat_template"]
        .as_str()
        .is_some_and(|t| t.contains("<|start_header_id|>")));

    // The Gemma presets get Gemma 3's template (user/model turns).
    let out = dir.path().join("g");
    let mut args = GenModelArgs::new("micro-gemma3", &out);
    args.tokenizer = Some(dir.path().join("tokenizer.json"));
    gen_model::run(&args).expect("generate");
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("tokenizer_config.json")).expect("read"))
            .expect("json");
    let t = cfg["chat_template"].as_str().expect("template");
    assert!(t.contains("<start_of_turn>") && t.contains("model"), "{t}");
}
