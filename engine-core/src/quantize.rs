//! `harrier quantize`: an FP8 copy of a model directory, in the compressed-tensors format
//! (`quant_method: "compressed-tensors"`, `format: "float-quantized"`, per-channel weights).
//!
//! The layers' projections and the output head are quantized exactly as `--quantization fp8`
//! quantizes them at load ([`crate::model::fp8::quantize_rows`]): `<module>.weight` in
//! `F8_E4M3` and `<module>.weight_scale` `[N, 1]` in f32. A tied output head is written as its
//! own `lm_head.weight` (and `tie_word_embeddings` becomes false) so the embedding rows stay
//! as stored. With `--keep-head` the head stays as stored instead (tied or not; `"ignore":
//! ["lm_head"]`), as llm-compressor's FP8 recipes and most published FP8 checkpoints keep it.
//! Every other tensor is copied as stored, and every other file of the directory (tokenizer,
//! generation config, chat template) is copied unchanged.
//!
//! The whole output is built in memory before it is written (one file): fine for the models
//! the tests and the device scripts quantize; an 8B model needs about 9 GB of RAM.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;

use crate::model::fp8::quantize_rows;
use crate::model::{
    expected_tensors, Checkpoint, ModelDir, WeightDtype, EMBED, INDEX_FILE, LM_HEAD, SINGLE_FILE,
};

#[derive(Debug, clap::Args)]
pub struct QuantizeArgs {
    /// The model directory to quantize (bf16, f16 or f32 weights).
    #[arg(long)]
    pub model: PathBuf,
    /// Where to write the FP8 copy (created; must not exist or be empty).
    #[arg(long)]
    pub out: PathBuf,
    /// Keep the output head as stored (bf16, tied or not) instead of quantizing it.
    #[arg(long)]
    pub keep_head: bool,
}

pub fn run(args: &QuantizeArgs) -> anyhow::Result<()> {
    let n = quantize_dir(&args.model, &args.out, args.keep_head)?;
    println!(
        "wrote {} ({n} weight matrices in FP8, per-channel scales)",
        args.out.display()
    );
    Ok(())
}

/// The `quantization_config` this writer puts in `config.json` (the head quantized, or in
/// the ignore list).
pub fn compressed_tensors_config(keep_head: bool) -> serde_json::Value {
    json!({
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                        "symmetric": true, "dynamic": false, "observer": "minmax"},
            "input_activations": null,
            "output_activations": null
        }},
        "ignore": if keep_head { json!(["lm_head"]) } else { json!([]) }
    })
}

/// Writes the FP8 copy of `src` to `out` (the output head as stored with `keep_head`); returns
/// how many matrices were quantized.
pub fn quantize_dir(src: &Path, out: &Path, keep_head: bool) -> anyhow::Result<usize> {
    let dir = ModelDir::open(src)
        .with_context(|| format!("opening model directory {}", src.display()))?;
    let c = &dir.config;
    if let Some(fp8) = &c.fp8 {
        bail!(
            "{} is an FP8 checkpoint already ({})",
            src.display(),
            fp8.method
        );
    }
    let ckpt = Checkpoint::open(&dir.path)?;
    ckpt.check(c)?;
    if out.exists()
        && std::fs::read_dir(out)
            .with_context(|| format!("reading {}", out.display()))?
            .next()
            .is_some()
    {
        bail!("{} exists and is not empty", out.display());
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;

    // Every file but the weights and config.json, as it is.
    for entry in std::fs::read_dir(src).with_context(|| format!("reading {}", src.display()))? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !entry.file_type()?.is_file()
            || name == "config.json"
            || name == INDEX_FILE
            || name.ends_with(".safetensors")
        {
            continue;
        }
        std::fs::copy(entry.path(), out.join(&*name)).with_context(|| format!("copying {name}"))?;
    }
    let config_path = src.join("config.json");
    let mut config: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(
        &std::fs::read(&config_path)
            .with_context(|| format!("reading {}", config_path.display()))?,
    )
    .with_context(|| format!("parsing {}", config_path.display()))?;
    config.insert(
        "quantization_config".into(),
        compressed_tensors_config(keep_head),
    );
    if !keep_head {
        config.insert("tie_word_embeddings".into(), json!(false));
    }
    std::fs::write(
        out.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;

    // The tensors to write; the ones kept as stored borrow the map.
    type Out<'a> = (String, Dtype, Vec<usize>, Cow<'a, [u8]>);
    let mut tensors: Vec<Out> = Vec::new();
    let mut quantized = 0;
    let mut push_fp8 = |tensors: &mut Vec<_>, name: &str, w: &[f32], n: usize, k: usize| {
        let (q, scales) = quantize_rows(w, k);
        let module = name.strip_suffix(".weight").unwrap_or(name);
        let scale_bytes = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        tensors.push((name.to_string(), Dtype::F8_E4M3, vec![n, k], Cow::Owned(q)));
        tensors.push((
            format!("{module}.weight_scale"),
            Dtype::F32,
            vec![n, 1],
            Cow::Owned(scale_bytes),
        ));
        quantized += 1;
    };
    for (name, shape) in expected_tensors(c) {
        let t = ckpt.get(&name, &shape)?;
        // Every matrix but the embedding: the layers' projections and an untied head unless
        // kept (norms are vectors).
        if shape.len() == 2 && name != EMBED && !(keep_head && name == LM_HEAD) {
            push_fp8(&mut tensors, &name, &t.to_f32(), shape[0], shape[1]);
            continue;
        }
        let dtype = match t.dtype {
            WeightDtype::F32 => Dtype::F32,
            WeightDtype::F16 => Dtype::F16,
            WeightDtype::Bf16 => Dtype::BF16,
        };
        tensors.push((name.clone(), dtype, shape.clone(), Cow::Borrowed(t.bytes)));
        if name == EMBED && c.tie_word_embeddings && !keep_head {
            push_fp8(&mut tensors, LM_HEAD, &t.to_f32(), shape[0], shape[1]);
        }
    }
    let views = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            TensorView::new(*dtype, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .with_context(|| format!("tensor {name}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let weights = out.join(SINGLE_FILE);
    safetensors::serialize_to_file(views, Some(metadata), &weights)
        .with_context(|| format!("writing {}", weights.display()))?;
    // The safetensors writer creates the file private to its owner; give it the permissions
    // of the source's config (a service user that could read the source can read the copy).
    let perms = std::fs::metadata(&config_path)?.permissions();
    std::fs::set_permissions(&weights, perms)
        .with_context(|| format!("setting the permissions of {}", weights.display()))?;
    Ok(quantized)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{CpuModel, KvCache, LayerTensor, LoadOptions, SeqChunk, WeightRef};
    use crate::sampling::{argmax, log_softmax_at};

    fn embedded_model() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("models/harrier-cpu")
    }

    /// Logits of every position of `tokens` (one prefill chunk).
    fn logits(model: &mut CpuModel, tokens: &[u32]) -> Vec<f32> {
        let c = model.config().clone();
        let bs = 16;
        let blocks = tokens.len().div_ceil(bs);
        let mut cache = KvCache::new(&c, blocks, bs);
        let table: Vec<u32> = (0..blocks as u32).collect();
        let mut out = vec![0.0; tokens.len() * c.vocab_size];
        model
            .forward(
                &[SeqChunk {
                    tokens,
                    position: 0,
                    block_table: &table,
                    local_block_table: &[],
                    logit_rows: tokens.len(),
                }],
                &mut cache,
                &mut out,
            )
            .unwrap();
        out
    }

    fn prompts(vocab: usize) -> Vec<Vec<u32>> {
        let mut rng = crate::splitmix::SplitMix64(0xf8);
        (0..6)
            .map(|_| {
                (0..48)
                    .map(|_| (rng.next_u64() % vocab as u64) as u32)
                    .collect()
            })
            .collect()
    }

    /// The FP8 checkpoint holds what `--quantization fp8` computes at load: the CPU model
    /// loaded from it gives the same logits, bit for bit, as the original loaded with
    /// `round_fp8`; and its files say what they are.
    #[test]
    fn the_fp8_checkpoint_equals_quantizing_at_load() {
        let out = tempfile::tempdir().unwrap();
        let q = out.path().join("fp8");
        let n = quantize_dir(&embedded_model(), &q, false).unwrap();
        let src = ModelDir::open(&embedded_model()).unwrap();
        let c = &src.config;
        // Seven projections a layer, and the (untied) output head.
        assert_eq!(n, 7 * c.num_layers + 1);
        let dq = ModelDir::open(&q).unwrap();
        assert_eq!(dq.config.fp8.as_ref().unwrap().method, "compressed-tensors");
        assert!(!dq.config.tie_word_embeddings);
        assert!(q.join("tokenizer.json").is_file());
        let mode = |p: &Path| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::metadata(p).unwrap().permissions().mode() & 0o777
        };
        assert_eq!(
            mode(&q.join(SINGLE_FILE)),
            mode(&embedded_model().join("config.json"))
        );
        let ckpt = Checkpoint::open(&q).unwrap();
        let w = ckpt
            .weight(
                &LayerTensor::DownProj.name(0),
                &LayerTensor::DownProj.shape(c),
                dq.config.fp8.as_ref(),
            )
            .unwrap();
        assert!(matches!(w, WeightRef::Fp8 { .. }));
        // The embedding stays bf16, as stored.
        let e = ckpt.get(EMBED, &[c.vocab_size, c.hidden_size]).unwrap();
        assert_eq!(e.dtype, WeightDtype::Bf16);
        // FP8 checkpoint vs rounding at load vs the original.
        let mut from_ckpt = CpuModel::load(&dq).unwrap();
        let mut rounded = CpuModel::load_with(&src, LoadOptions { round_fp8: true }).unwrap();
        let mut original = CpuModel::load(&src).unwrap();
        for p in prompts(c.vocab_size) {
            let a = logits(&mut from_ckpt, &p);
            assert_eq!(a, logits(&mut rounded, &p));
            assert_ne!(a, logits(&mut original, &p), "FP8 changed nothing");
        }
        // Quantizing twice, or into a directory with files in it, is refused.
        let e = quantize_dir(&q, &out.path().join("again"), false).unwrap_err();
        assert!(e.to_string().contains("FP8 checkpoint already"), "{e:#}");
        let e = quantize_dir(&embedded_model(), &q, false).unwrap_err();
        assert!(e.to_string().contains("not empty"), "{e:#}");
    }

    /// `--keep-head`: the output head stays as stored (tied stays tied; an untied head keeps
    /// its dtype and has no scale) and is in the ignore list; the layers are quantized as
    /// without it, so the logits are neither the original's nor the all-FP8 checkpoint's.
    #[test]
    fn keep_head_leaves_the_output_head_as_stored() {
        use crate::gen_model::{write_model, ModelSpec, Preset};
        let dir = tempfile::tempdir().unwrap();
        let gemma = dir.path().join("gemma");
        std::fs::create_dir_all(&gemma).unwrap();
        write_model(&gemma, &ModelSpec::from_preset(Preset::MicroGemma3, 3)).unwrap();
        for (i, src_dir) in [embedded_model(), gemma].iter().enumerate() {
            let src = ModelDir::open(src_dir).unwrap();
            let c = &src.config;
            let (kept, all) = (
                dir.path().join(format!("kept{i}")),
                dir.path().join(format!("all{i}")),
            );
            let n = quantize_dir(src_dir, &kept, true).unwrap();
            assert_eq!(n, 7 * c.num_layers, "{}", src_dir.display());
            quantize_dir(src_dir, &all, false).unwrap();
            let dq = ModelDir::open(&kept).unwrap();
            assert_eq!(dq.config.tie_word_embeddings, c.tie_word_embeddings);
            let config: serde_json::Value =
                serde_json::from_slice(&std::fs::read(kept.join("config.json")).unwrap()).unwrap();
            assert_eq!(config["quantization_config"]["ignore"], json!(["lm_head"]));
            let ckpt = Checkpoint::open(&kept).unwrap();
            let head = [c.vocab_size, c.hidden_size];
            assert!(ckpt
                .get("lm_head.weight_scale", &[c.vocab_size, 1])
                .is_err());
            if c.tie_word_embeddings {
                assert!(ckpt.get(LM_HEAD, &head).is_err(), "a tied head stays tied");
            } else {
                let stored = Checkpoint::open(src_dir).unwrap();
                assert_eq!(
                    ckpt.get(LM_HEAD, &head).unwrap().bytes,
                    stored.get(LM_HEAD, &head).unwrap().bytes
                );
            }
            let mut from_kept = CpuModel::load(&dq).unwrap();
            let mut from_all = CpuModel::load(&ModelDir::open(&all).unwrap()).unwrap();
            let mut original = CpuModel::load(&src).unwrap();
            let p = &prompts(c.vocab_size)[0];
            let a = logits(&mut from_kept, p);
            assert_ne!(a, logits(&mut from_all, p), "the head was quantized");
            assert_ne!(a, logits(&mut original, p), "the layers were not");
        }
    }

    /// Qwen3's q/k norms and Gemma 3's sandwich norms and tied head (f16 and bf16 weights):
    /// the FP8 checkpoint equals quantizing at load there too.
    #[test]
    fn every_architecture_quantizes_as_at_load() {
        use crate::gen_model::{write_model, ModelSpec, Preset};
        for preset in [Preset::MicroQwen3, Preset::MicroGemma3] {
            let dir = tempfile::tempdir().unwrap();
            let src_dir = dir.path().join("src");
            std::fs::create_dir_all(&src_dir).unwrap();
            write_model(&src_dir, &ModelSpec::from_preset(preset, 3)).unwrap();
            let q = dir.path().join("fp8");
            quantize_dir(&src_dir, &q, false).unwrap();
            let src = ModelDir::open(&src_dir).unwrap();
            let mut a = CpuModel::load(&ModelDir::open(&q).unwrap()).unwrap();
            let mut b = CpuModel::load_with(&src, LoadOptions { round_fp8: true }).unwrap();
            for p in prompts(src.config.vocab_size) {
                assert_eq!(logits(&mut a, &p), logits(&mut b, &p), "{preset:?}");
            }
        }
    }

    /// FP8 accuracy on the trained committed models (the embedded `harrier-cpu` and its draft),
    /// teacher-forced on each bf16 model's own greedy text: how often the FP8 model's top token
    /// is the bf16 model's, and the log-probability error of the bf16 model's choice
    /// (docs/fp8.md records the numbers).
    #[test]
    fn fp8_keeps_the_trained_models_choices() {
        for name in ["harrier-cpu", "harrier-cpu-draft"] {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("models")
                .join(name);
            let (rate, mean, max, total) = fp8_accuracy(&ModelDir::open(&dir).unwrap());
            eprintln!(
                "fp8 vs bf16 ({name}, {total} positions): top-1 agreement {rate:.3}, \
                 |logprob error| mean {mean:.4} max {max:.4}"
            );
            // Measured: 0.979 / 0.041 (harrier-cpu), 0.946 / 0.057 (its 2-layer draft).
            assert!(rate >= 0.93, "{name}: top-1 agreement {rate}");
            assert!(mean <= 0.07, "{name}: mean logprob error {mean}");
        }
    }

    /// (top-1 agreement, mean and max |logprob error|, positions) of FP8 vs stored weights.
    fn fp8_accuracy(src: &ModelDir) -> (f64, f64, f64, usize) {
        let v = src.config.vocab_size;
        let mut original = CpuModel::load(src).unwrap();
        let mut fp8 = CpuModel::load_with(src, LoadOptions { round_fp8: true }).unwrap();
        let (mut agree, mut total, mut err_sum, mut err_max) = (0, 0, 0.0f64, 0.0f64);
        for mut p in prompts(v) {
            p.truncate(8);
            // The stored model's greedy continuation, 40 tokens.
            for _ in 0..40 {
                let l = logits(&mut original, &p);
                p.push(argmax(&l[l.len() - v..]));
            }
            let (a, b) = (logits(&mut original, &p), logits(&mut fp8, &p));
            for pos in 7..p.len() - 1 {
                let (ra, rb) = (&a[pos * v..(pos + 1) * v], &b[pos * v..(pos + 1) * v]);
                let want = argmax(ra);
                agree += (argmax(rb) == want) as usize;
                total += 1;
                let e =
                    (log_softmax_at(ra, want as usize) - log_softmax_at(rb, want as usize)).abs();
                err_sum += e;
                err_max = err_max.max(e);
            }
        }
        (
            agree as f64 / total as f64,
            err_sum / total as f64,
            err_max,
            total,
        )
    }

    /// Rewrites `dir`'s single safetensors file through `edit` (name, dtype, shape, bytes).
    fn rewrite(dir: &Path, edit: impl Fn(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>)) {
        let path = dir.join(SINGLE_FILE);
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut t: Vec<_> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
            .collect();
        edit(&mut t);
        let views: Vec<_> = t
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &path).unwrap();
    }

    /// A broken FP8 checkpoint names what is wrong: no quantization_config, a missing scale,
    /// a scale of the wrong shape, a non-finite scale.
    #[test]
    fn broken_fp8_checkpoints_name_the_problem() {
        let out = tempfile::tempdir().unwrap();
        let q = out.path().join("fp8");
        quantize_dir(&embedded_model(), &q, false).unwrap();
        let good_config = std::fs::read_to_string(q.join("config.json")).unwrap();
        let good_weights = std::fs::read(q.join(SINGLE_FILE)).unwrap();
        let scale = "model.layers.1.mlp.up_proj.weight_scale";
        let load_err = || {
            let e = ModelDir::open(&q)
                .map_err(anyhow::Error::from)
                .and_then(|d| CpuModel::load(&d).map_err(anyhow::Error::from));
            format!("{:#}", e.err().expect("an error"))
        };
        let mut config: serde_json::Value = serde_json::from_str(&good_config).unwrap();
        config
            .as_object_mut()
            .unwrap()
            .remove("quantization_config");
        std::fs::write(q.join("config.json"), config.to_string()).unwrap();
        let e = load_err();
        assert!(
            e.contains("F8_E4M3") && e.contains("no FP8 quantization_config"),
            "{e}"
        );
        std::fs::write(q.join("config.json"), &good_config).unwrap();

        rewrite(&q, |t| t.retain(|x| x.0 != scale));
        let e = load_err();
        assert!(e.contains(scale) && e.contains("missing"), "{e}");

        std::fs::write(q.join(SINGLE_FILE), &good_weights).unwrap();
        rewrite(&q, |t| {
            let s = t.iter_mut().find(|x| x.0 == scale).unwrap();
            s.2 = vec![s.2[0] / 2, 2];
        });
        let e = load_err();
        assert!(e.contains(scale) && e.contains("[384, 2]"), "{e}");

        std::fs::write(q.join(SINGLE_FILE), &good_weights).unwrap();
        rewrite(&q, |t| {
            let s = t.iter_mut().find(|x| x.0 == scale).unwrap();
            s.3[..4].copy_from_slice(&f32::NAN.to_le_bytes());
        });
        let e = load_err();
        assert!(e.contains(scale) && e.contains("NaN"), "{e}");
    }
}
