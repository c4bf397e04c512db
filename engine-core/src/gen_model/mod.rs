//! `harrier gen-model`: writes a Hugging Face model directory with deterministic random weights.
//!
//! ```text
//!   OUT/config.json                 as the real release (architectures, model_type, rope, ...)
//!   OUT/generation_config.json      eos ids etc.
//!   OUT/model.safetensors           or model-0000i-of-0000n.safetensors + index (> max shard)
//!   OUT/tokenizer.json              copied (the Llama 3 tokenizer) unless --no-tokenizer
//!   OUT/tokenizer_config.json       bos <|begin_of_text|>, eos <|eot_id|>, Llama 3.1 template
//! ```
//!
//! Weights are a pure function of `(seed, tensor name, element index)` (see `rng`), so the
//! same command gives the same bytes on any machine and thread count, and the parity fixtures
//! computed by transformers on one machine hold for a checkpoint regenerated on another.

mod presets;
mod rng;
mod tokenizer;

pub use tokenizer::{builtin_chat_template, BUILTIN_CHAT_TEMPLATES};
mod writer;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

pub use presets::{config_json, gemma3_config_json, generation_config_json, Preset, SpecialIds};
pub use writer::{tensor_specs, write_safetensors, TensorSpec, WeightInit};

use crate::model::{ModelConfig, WeightDtype, INDEX_FILE, SINGLE_FILE};

/// Storage dtype on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DtypeArg {
    F32,
    Bf16,
    F16,
}

impl From<DtypeArg> for WeightDtype {
    fn from(d: DtypeArg) -> WeightDtype {
        match d {
            DtypeArg::F32 => WeightDtype::F32,
            DtypeArg::Bf16 => WeightDtype::Bf16,
            DtypeArg::F16 => WeightDtype::F16,
        }
    }
}

/// Hugging Face's default shard size (5 GB).
pub const DEFAULT_MAX_SHARD_SIZE: u64 = 5_000_000_000;

#[derive(Debug, Clone, clap::Args)]
pub struct GenModelArgs {
    /// Preset: micro, micro-qwen3, tiny, llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, qwen3-0.6b, qwen3-4b.
    #[arg(long)]
    pub preset: String,
    /// Output directory (created).
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Storage dtype of the weights (default: the preset's).
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
    /// Largest shard in bytes (suffixes KB, MB, GB, KiB, MiB, GiB accepted); default 5GB.
    #[arg(long, value_parser = parse_size)]
    pub max_shard_size: Option<u64>,
    /// tokenizer.json to copy (default: $HARRIER_HOME/llama3/tokenizer.json).
    #[arg(long, conflicts_with = "no_tokenizer")]
    pub tokenizer: Option<PathBuf>,
    /// Write no tokenizer files.
    #[arg(long)]
    pub no_tokenizer: bool,
}

impl GenModelArgs {
    /// The arguments of `gen-model --preset PRESET --out OUT` (seed 0, defaults elsewhere).
    pub fn new(preset: &str, out: &Path) -> GenModelArgs {
        GenModelArgs {
            preset: preset.to_string(),
            out: out.to_path_buf(),
            seed: 0,
            dtype: None,
            max_shard_size: None,
            tokenizer: None,
            no_tokenizer: false,
        }
    }
}

/// Parses `123`, `5GB`, `500MB`, `64KiB`, ... into bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size in bytes"))?;
    let mult: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        other => return Err(format!("unknown size unit {other:?} in {s:?}")),
    };
    n.checked_mul(mult)
        .filter(|&b| b > 0)
        .ok_or_else(|| format!("{s:?} is not a positive size that fits in 64 bits"))
}

/// Harrier's data folder: `$HARRIER_HOME`, or `~/.cache/harrier`.
pub fn harrier_home() -> PathBuf {
    if let Some(h) = std::env::var_os("HARRIER_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("harrier")
}

/// Where `scripts/setup.sh` installs the Llama 3 tokenizer: `<harrier_home>/llama3/tokenizer.json`.
pub fn default_tokenizer_path() -> PathBuf {
    harrier_home().join("llama3").join("tokenizer.json")
}

/// What one generated model is made of; [`run`] builds it from a preset.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    pub config: ModelConfig,
    pub config_json: serde_json::Value,
    pub generation_json: serde_json::Value,
    pub dtype: WeightDtype,
    pub seed: u64,
    pub init: WeightInit,
    pub max_shard_size: u64,
}

impl ModelSpec {
    /// The spec of `preset` at its own dtype, with the default init and shard size.
    pub fn from_preset(preset: Preset, seed: u64) -> ModelSpec {
        let config = preset.config();
        ModelSpec {
            config_json: preset.config_json(&config),
            generation_json: generation_config_json(preset),
            dtype: config.dtype.unwrap_or(WeightDtype::Bf16),
            config,
            seed,
            init: WeightInit::default(),
            max_shard_size: DEFAULT_MAX_SHARD_SIZE,
        }
    }

    /// Switches the storage dtype (config.json's `torch_dtype` follows).
    pub fn with_dtype(mut self, dtype: WeightDtype) -> ModelSpec {
        self.dtype = dtype;
        self.config.dtype = Some(dtype);
        self.config_json["torch_dtype"] = serde_json::json!(dtype.torch_name());
        self
    }
}

/// Writes config.json, generation_config.json and the weights of `spec` into `out` (created);
/// stale safetensors files there are removed first.
pub fn write_model(out: &Path, spec: &ModelSpec) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    remove_stale_weights(out)?;
    let write_json = |name: &str, v: &serde_json::Value| -> anyhow::Result<()> {
        let path = out.join(name);
        std::fs::write(&path, serde_json::to_string_pretty(v)? + "\n")
            .with_context(|| format!("writing {}", path.display()))
    };
    write_json("config.json", &spec.config_json)?;
    write_json("generation_config.json", &spec.generation_json)?;
    let specs = tensor_specs(&spec.config, spec.init);
    write_safetensors(out, &specs, spec.dtype, spec.seed, spec.max_shard_size)
}

fn remove_stale_weights(out: &Path) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(out).with_context(|| format!("reading {}", out.display()))? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let stale = name == SINGLE_FILE
            || name == INDEX_FILE
            || (name.starts_with("model-") && name.ends_with(".safetensors"));
        if stale {
            std::fs::remove_file(entry.path())
                .with_context(|| format!("removing stale {}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// `harrier gen-model`.
pub fn run(args: &GenModelArgs) -> anyhow::Result<()> {
    let Some(preset) = Preset::from_name(&args.preset) else {
        let names: Vec<&str> = Preset::ALL.iter().map(|p| p.name()).collect();
        bail!(
            "unknown preset {:?}; presets: {}",
            args.preset,
            names.join(", ")
        );
    };
    // Resolve the tokenizer before spending minutes on weights.
    let tokenizer = match (&args.tokenizer, args.no_tokenizer) {
        (_, true) => None,
        (Some(p), false) => Some(p.clone()),
        (None, false) => Some(default_tokenizer_path()),
    };
    if let Some(t) = &tokenizer {
        if !t.is_file() {
            bail!(
                "tokenizer not found at {}: run scripts/setup.sh to install the Llama 3 tokenizer \
                 (or pass --tokenizer PATH, or --no-tokenizer)",
                t.display()
            );
        }
    }
    let mut spec = ModelSpec::from_preset(preset, args.seed);
    if let Some(d) = args.dtype {
        spec = spec.with_dtype(d.into());
    }
    spec.max_shard_size = args.max_shard_size.unwrap_or(DEFAULT_MAX_SHARD_SIZE);
    let started = std::time::Instant::now();
    let files = write_model(&args.out, &spec)?;
    if let Some(t) = &tokenizer {
        let template = match spec.config.architecture {
            crate::model::Architecture::Gemma3 => tokenizer::GEMMA3_CHAT_TEMPLATE,
            _ => tokenizer::LLAMA31_CHAT_TEMPLATE,
        };
        tokenizer::write_tokenizer_files(
            &args.out,
            t,
            spec.config.max_position_embeddings,
            template,
        )?;
    }
    eprintln!(
        "gen-model: wrote {} ({} weight file{}, {:?}, seed {}) in {:.1}s",
        args.out.display(),
        files.len(),
        if files.len() == 1 { "" } else { "s" },
        spec.dtype,
        args.seed,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("123"), Ok(123));
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert!(parse_size("0").is_err());
        assert!(parse_size("5XB").is_err());
        assert!(parse_size("big").is_err());
    }

    #[test]
    fn presets_are_consistent() {
        for p in Preset::ALL {
            let c = p.config();
            c.validate(Path::new(p.name())).expect("valid preset");
            let ids = p.special_ids();
            assert!((ids.bos as usize) < c.vocab_size, "{}", p.name());
            assert!(ids
                .generation_eos
                .iter()
                .all(|&e| (e as usize) < c.vocab_size));
        }
    }

    #[test]
    fn missing_tokenizer_says_run_setup() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut args = GenModelArgs::new("micro", dir.path());
        args.tokenizer = Some(dir.path().join("nope.json"));
        let e = run(&args).expect_err("no tokenizer").to_string();
        assert!(e.contains("scripts/setup.sh"), "{e}");
        args.preset = "huge".into();
        let e = run(&args).expect_err("bad preset").to_string();
        assert!(e.contains("micro-qwen3"), "{e}");
    }
}
