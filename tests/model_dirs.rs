//! Broken model directories fail to load with an error that names the problem.

#[path = "model_support.rs"]
mod model_support;

use std::path::Path;

use harrier_engine::gen_model::{tensor_specs, write_safetensors, WeightInit};
use harrier_engine::model::{CpuModel, ModelDir, WeightDtype};
use model_support::gen_preset;

/// A `micro` directory whose weights are rewritten from `edit`ed tensor specs.
fn micro_with(
    dir: &Path,
    max_shard: u64,
    edit: impl FnOnce(&mut Vec<harrier_engine::gen_model::TensorSpec>),
) {
    let md = gen_preset("micro", 1, dir).expect("generate");
    std::fs::remove_file(dir.join("model.safetensors")).expect("rm");
    let mut specs = tensor_specs(&md.config, WeightInit::default());
    edit(&mut specs);
    write_safetensors(dir, &specs, WeightDtype::F32, 1, max_shard).expect("write");
}

fn load_err(dir: &Path) -> String {
    let md = match ModelDir::open(dir) {
        Ok(md) => md,
        Err(e) => return e.to_string(),
    };
    match CpuModel::load(&md) {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_tensor_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    micro_with(dir.path(), u64::MAX, |s| {
        s.retain(|t| t.name != "model.layers.1.mlp.down_proj.weight")
    });
    let e = load_err(dir.path());
    assert!(
        e.contains("model.layers.1.mlp.down_proj.weight") && e.contains("missing"),
        "{e}"
    );
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn missing_tensor_in_a_shard_names_the_shard() {
    let dir = tempfile::tempdir().expect("tempdir");
    micro_with(dir.path(), 100_000, |_| {});
    // Point one tensor of the index at a shard that does not hold it.
    let index_path = dir.path().join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index_path).expect("read")).expect("json");
    let name = "model.norm.weight";
    let owner = index["weight_map"][name]
        .as_str()
        .expect("listed")
        .to_string();
    let other = index["weight_map"]
        .as_object()
        .expect("map")
        .values()
        .filter_map(|v| v.as_str())
        .find(|v| *v != owner)
        .expect("several shards")
        .to_string();
    index["weight_map"][name] = serde_json::json!(other);
    std::fs::write(&index_path, index.to_string()).expect("write");
    let e = load_err(dir.path());
    assert!(
        e.contains(name) && e.contains("missing") && e.contains(&other),
        "{e}"
    );
}

#[test]
fn wrong_shape_is_named_with_both_shapes() {
    let dir = tempfile::tempdir().expect("tempdir");
    micro_with(dir.path(), u64::MAX, |s| {
        let t = s
            .iter_mut()
            .find(|t| t.name == "model.layers.0.self_attn.k_proj.weight")
            .expect("k_proj");
        t.shape = vec![33, 64];
    });
    let e = load_err(dir.path());
    assert!(e.contains("model.layers.0.self_attn.k_proj.weight"), "{e}");
    assert!(e.contains("[33, 64]") && e.contains("[32, 64]"), "{e}");
}

#[test]
fn unknown_architecture_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    gen_preset("micro", 1, dir.path()).expect("generate");
    let path = dir.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
    cfg["architectures"] = serde_json::json!(["MistralForCausalLM"]);
    std::fs::write(&path, cfg.to_string()).expect("write");
    let e = load_err(dir.path());
    assert!(
        e.contains("MistralForCausalLM") && e.contains("architecture") && e.contains("config.json"),
        "{e}"
    );
}

#[test]
fn missing_config_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    gen_preset("micro", 1, dir.path()).expect("generate");
    std::fs::remove_file(dir.path().join("config.json")).expect("rm");
    let e = load_err(dir.path());
    assert!(e.contains("config.json") && e.contains("missing"), "{e}");
}

#[test]
fn missing_weights_are_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    gen_preset("micro", 1, dir.path()).expect("generate");
    std::fs::remove_file(dir.path().join("model.safetensors")).expect("rm");
    let e = load_err(dir.path());
    assert!(
        e.contains("model.safetensors") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn truncated_weights_are_rejected() {
    let dir = tempfile::tempdir().expect("tempdir");
    gen_preset("micro", 1, dir.path()).expect("generate");
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).expect("read");
    std::fs::write(&path, &bytes[..bytes.len() - 4]).expect("write");
    let e = load_err(dir.path());
    assert!(
        e.contains("model.safetensors") && e.contains("header"),
        "{e}"
    );
}
