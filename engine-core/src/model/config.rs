//! Hugging Face model directories: `config.json` and `generation_config.json`.
//!
//! We accept the two decoder-only architectures the engine implements:
//!
//! | `architectures[0]`  | notes                                                        |
//! |---------------------|--------------------------------------------------------------|
//! | `LlamaForCausalLM`  | optional `rope_scaling` of `rope_type: "llama3"`; `head_dim`   |
//! |                     | optional (defaults to `hidden_size / num_attention_heads`)   |
//! | `Qwen3ForCausalLM`  | explicit `head_dim`, per-head q/k RMSNorm, no rope scaling   |
//!
//! Both the transformers 4.x keys (`rope_theta`, `rope_scaling`, `torch_dtype`) and the 5.x
//! ones (`rope_parameters`, `dtype`) are read. Every error names the file and the problem.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

/// Everything that can go wrong opening or loading a model directory.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A free-form problem (kept for callers that build their own messages).
    #[error("{0}")]
    Invalid(String),
    #[error("{}: missing file (expected a Hugging Face model directory)", path.display())]
    MissingFile { path: PathBuf },
    #[error("{}: cannot read: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not valid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "{}: unknown architecture {name:?} (supported: LlamaForCausalLM, Qwen3ForCausalLM)",
        path.display()
    )]
    UnknownArchitecture { path: PathBuf, name: String },
    #[error("{}: field `{field}`: {problem}", path.display())]
    Field {
        path: PathBuf,
        field: String,
        problem: String,
    },
    #[error("{}: inconsistent dimensions: {problem}", path.display())]
    Inconsistent { path: PathBuf, problem: String },
    #[error("{}: unsupported: {problem}", path.display())]
    Unsupported { path: PathBuf, problem: String },
    #[error("{}: {problem}", path.display())]
    Safetensors { path: PathBuf, problem: String },
    #[error("tensor `{name}` missing (looked in {})", file.display())]
    MissingTensor { name: String, file: PathBuf },
    #[error("{}: tensor `{name}` has shape {found:?}, expected {expected:?}", file.display())]
    Shape {
        name: String,
        file: PathBuf,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{}: tensor `{name}` has dtype {dtype}, expected BF16, F16 or F32", file.display())]
    Dtype {
        name: String,
        file: PathBuf,
        dtype: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen3,
}

impl Architecture {
    /// The `architectures[0]` string of `config.json`.
    pub fn hf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
        }
    }
    /// The `model_type` string of `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen3 => "qwen3",
        }
    }
    fn from_hf_name(name: &str) -> Option<Architecture> {
        match name {
            "LlamaForCausalLM" => Some(Architecture::Llama),
            "Qwen3ForCausalLM" => Some(Architecture::Qwen3),
            _ => None,
        }
    }
}

/// Llama 3 RoPE frequency scaling (`rope_type: "llama3"`).
#[derive(Debug, Clone, PartialEq)]
pub struct RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

/// Storage type of the checkpoint's weights as `config.json` declares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    F16,
    Bf16,
}

impl WeightDtype {
    /// The torch name (`"float32"`, `"float16"`, `"bfloat16"`).
    pub fn torch_name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "float32",
            WeightDtype::F16 => "float16",
            WeightDtype::Bf16 => "bfloat16",
        }
    }
    pub fn size_bytes(self) -> usize {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::F16 | WeightDtype::Bf16 => 2,
        }
    }
    pub fn from_torch_name(name: &str) -> Option<WeightDtype> {
        match name {
            "float32" | "fp32" => Some(WeightDtype::F32),
            "float16" | "fp16" | "half" => Some(WeightDtype::F16),
            "bfloat16" | "bf16" => Some(WeightDtype::Bf16),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Declared storage dtype (`torch_dtype` / `dtype`); `None` when absent.
    pub dtype: Option<WeightDtype>,
}

impl ModelConfig {
    /// Width of the fused q|k|v projection output.
    pub fn qkv_dim(&self) -> usize {
        (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    }

    /// The number of weights (every tensor of [`super::expected_tensors`]), or `None` when it
    /// overflows `usize` even as a count of f32 bytes (times 4). Checked by [`Self::validate`]
    /// so that the loaders can multiply dimensions freely.
    pub fn checked_parameter_count(&self) -> Option<usize> {
        let Self {
            architecture,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            tie_word_embeddings,
            ..
        } = *self;
        let q = num_heads.checked_mul(head_dim)?;
        let kv = num_kv_heads.checked_mul(head_dim)?;
        let qk_norms = match architecture {
            Architecture::Qwen3 => 2 * head_dim,
            Architecture::Llama => 0,
        };
        // q and o projections, k and v, gate, up and down, the two norms.
        let per_layer = [
            q.checked_mul(hidden_size)?.checked_mul(2)?,
            kv.checked_mul(hidden_size)?.checked_mul(2)?,
            intermediate_size.checked_mul(hidden_size)?.checked_mul(3)?,
            hidden_size.checked_mul(2)?,
            qk_norms,
        ]
        .into_iter()
        .try_fold(0usize, usize::checked_add)?;
        let embeddings = vocab_size
            .checked_mul(hidden_size)?
            .checked_mul(if tie_word_embeddings { 1 } else { 2 })?;
        let total = num_layers
            .checked_mul(per_layer)?
            .checked_add(embeddings)?
            .checked_add(hidden_size)?;
        total.checked_mul(4)?;
        Some(total)
    }

    /// Checks the dimensions agree with each other; `path` names the file in errors.
    pub fn validate(&self, path: &Path) -> Result<(), ModelError> {
        let bad = |problem: String| {
            Err(ModelError::Inconsistent {
                path: path.to_path_buf(),
                problem,
            })
        };
        let Self {
            vocab_size,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            ref rope_scaling,
            max_position_embeddings,
            ..
        } = *self;
        for (name, v) in [
            ("vocab_size", vocab_size),
            ("hidden_size", hidden_size),
            ("intermediate_size", intermediate_size),
            ("num_hidden_layers", num_layers),
            ("num_attention_heads", num_heads),
            ("num_key_value_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("max_position_embeddings", max_position_embeddings),
        ] {
            if v == 0 {
                return bad(format!("{name} is 0"));
            }
        }
        if num_heads % num_kv_heads != 0 {
            return bad(format!(
                "num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})"
            ));
        }
        if head_dim % 2 != 0 {
            return bad(format!("head_dim ({head_dim}) is odd; RoPE needs pairs"));
        }
        if self.checked_parameter_count().is_none() {
            return bad(format!(
                "the dimensions are too large: the parameter count overflows (vocab_size \
                 {vocab_size}, hidden_size {hidden_size}, intermediate_size {intermediate_size}, \
                 num_hidden_layers {num_layers}, {num_heads} query and {num_kv_heads} KV heads \
                 of head_dim {head_dim})"
            ));
        }
        if vocab_size > u32::MAX as usize {
            return bad(format!(
                "vocab_size ({vocab_size}) does not fit token ids (u32)"
            ));
        }
        if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
            return bad(format!("rms_norm_eps ({rms_norm_eps}) must be positive"));
        }
        if !(rope_theta.is_finite() && rope_theta > 0.0) {
            return bad(format!("rope_theta ({rope_theta}) must be positive"));
        }
        if let Some(s) = rope_scaling {
            if !(s.factor > 0.0
                && s.low_freq_factor > 0.0
                && s.high_freq_factor > s.low_freq_factor)
            {
                return bad(format!(
                    "rope_scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0, got {s:?}"
                ));
            }
            if s.original_max_position_embeddings == 0 {
                return bad("rope_scaling.original_max_position_embeddings is 0".into());
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenerationConfig {
    pub eos_token_ids: Vec<u32>,
}

#[derive(Debug, Clone)]
pub struct ModelDir {
    pub path: PathBuf,
    /// Served model name (the directory's file name).
    pub name: String,
    pub config: ModelConfig,
    pub generation: GenerationConfig,
}

impl ModelDir {
    /// Reads and validates `config.json` and (optionally) `generation_config.json`.
    pub fn open(path: &Path) -> Result<ModelDir, ModelError> {
        let config_path = path.join("config.json");
        let raw = read_json(&config_path)?;
        let config = parse_config(&raw, &config_path)?;
        let gen_path = path.join("generation_config.json");
        let eos = if gen_path.is_file() {
            let gen = read_json(&gen_path)?;
            parse_eos(&gen, &gen_path, config.vocab_size)?
        } else {
            None
        };
        let eos = match eos {
            Some(ids) => ids,
            None => parse_eos(&raw, &config_path, config.vocab_size)?.unwrap_or_default(),
        };
        let name = path
            .canonicalize()
            .ok()
            .as_deref()
            .unwrap_or(path)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".to_string());
        Ok(ModelDir {
            path: path.to_path_buf(),
            name,
            config,
            generation: GenerationConfig { eos_token_ids: eos },
        })
    }
}

impl ModelError {
    /// A failed read of `path`: missing files get their own variant.
    pub(crate) fn io(path: &Path, e: std::io::Error) -> ModelError {
        if e.kind() == std::io::ErrorKind::NotFound {
            ModelError::MissingFile {
                path: path.to_path_buf(),
            }
        } else {
            ModelError::Io {
                path: path.to_path_buf(),
                source: e,
            }
        }
    }
}

fn read_json(path: &Path) -> Result<Map<String, Value>, ModelError> {
    let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
    let value: Value = serde_json::from_slice(&bytes).map_err(|e| ModelError::Json {
        path: path.to_path_buf(),
        source: e,
    })?;
    match value {
        Value::Object(map) => Ok(map),
        _ => Err(ModelError::Field {
            path: path.to_path_buf(),
            field: "<root>".into(),
            problem: "expected a JSON object".into(),
        }),
    }
}

/// Typed access to one JSON object, naming the file in every error.
struct Fields<'a> {
    map: &'a Map<String, Value>,
    path: &'a Path,
}

impl Fields<'_> {
    fn err(&self, field: &str, problem: impl Into<String>) -> ModelError {
        ModelError::Field {
            path: self.path.to_path_buf(),
            field: field.into(),
            problem: problem.into(),
        }
    }
    /// The field, treating JSON `null` as absent.
    fn get(&self, field: &str) -> Option<&Value> {
        self.map.get(field).filter(|v| !v.is_null())
    }
    fn usize_opt(&self, field: &str) -> Result<Option<usize>, ModelError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| {
                    self.err(field, format!("expected a non-negative integer, got {v}"))
                }),
        }
    }
    fn usize(&self, field: &str) -> Result<usize, ModelError> {
        self.usize_opt(field)?
            .ok_or_else(|| self.err(field, "missing"))
    }
    fn f32_opt(&self, field: &str) -> Result<Option<f32>, ModelError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| self.err(field, format!("expected a number, got {v}"))),
        }
    }
    fn f32(&self, field: &str) -> Result<f32, ModelError> {
        self.f32_opt(field)?
            .ok_or_else(|| self.err(field, "missing"))
    }
    fn bool_opt(&self, field: &str) -> Result<Option<bool>, ModelError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(field, format!("expected true or false, got {v}"))),
        }
    }
    fn str_opt(&self, field: &str) -> Result<Option<&str>, ModelError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(field, format!("expected a string, got {v}"))),
        }
    }
}

fn parse_config(map: &Map<String, Value>, path: &Path) -> Result<ModelConfig, ModelError> {
    let f = Fields { map, path };
    let arch_name = match f.get("architectures") {
        Some(Value::Array(a)) => match a.first().and_then(Value::as_str) {
            Some(s) => s.to_string(),
            None => return Err(f.err("architectures", "expected a non-empty list of strings")),
        },
        Some(v) => return Err(f.err("architectures", format!("expected a list, got {v}"))),
        None => return Err(f.err("architectures", "missing")),
    };
    let architecture =
        Architecture::from_hf_name(&arch_name).ok_or_else(|| ModelError::UnknownArchitecture {
            path: path.to_path_buf(),
            name: arch_name.clone(),
        })?;
    let unsupported = |problem: String| ModelError::Unsupported {
        path: path.to_path_buf(),
        problem,
    };
    if let Some(act) = f.str_opt("hidden_act")? {
        if act != "silu" {
            return Err(unsupported(format!("hidden_act {act:?} (only \"silu\")")));
        }
    }
    for key in ["attention_bias", "mlp_bias"] {
        if f.bool_opt(key)? == Some(true) {
            return Err(unsupported(format!("{key}: true")));
        }
    }
    if f.bool_opt("use_sliding_window")? == Some(true) {
        return Err(unsupported("use_sliding_window: true".into()));
    }

    let hidden_size = f.usize("hidden_size")?;
    let num_heads = f.usize("num_attention_heads")?;
    let num_kv_heads = f.usize_opt("num_key_value_heads")?.unwrap_or(num_heads);
    let head_dim = match (f.usize_opt("head_dim")?, architecture) {
        (Some(d), _) => d,
        (None, Architecture::Qwen3) => return Err(f.err("head_dim", "missing (Qwen3 needs it)")),
        (None, Architecture::Llama) => {
            if num_heads == 0 || hidden_size % num_heads != 0 {
                return Err(ModelError::Inconsistent {
                    path: path.to_path_buf(),
                    problem: format!(
                        "hidden_size ({hidden_size}) is not a multiple of num_attention_heads ({num_heads}) and head_dim is absent"
                    ),
                });
            }
            hidden_size / num_heads
        }
    };
    let (rope_theta, rope_scaling) = parse_rope(&f, architecture)?;
    let dtype = match f.str_opt("torch_dtype")?.or(f.str_opt("dtype")?) {
        None => None,
        Some(s) => Some(
            WeightDtype::from_torch_name(s)
                .ok_or_else(|| f.err("torch_dtype", format!("unknown dtype {s:?}")))?,
        ),
    };
    let config = ModelConfig {
        architecture,
        vocab_size: f.usize("vocab_size")?,
        hidden_size,
        intermediate_size: f.usize("intermediate_size")?,
        num_layers: f.usize("num_hidden_layers")?,
        num_heads,
        num_kv_heads,
        head_dim,
        rms_norm_eps: f.f32("rms_norm_eps")?,
        rope_theta,
        rope_scaling,
        max_position_embeddings: f.usize("max_position_embeddings")?,
        tie_word_embeddings: f.bool_opt("tie_word_embeddings")?.unwrap_or(false),
        dtype,
    };
    config.validate(path)?;
    Ok(config)
}

/// `rope_theta` and llama3 scaling, from `rope_scaling` (4.x) or `rope_parameters` (5.x).
fn parse_rope(
    f: &Fields<'_>,
    arch: Architecture,
) -> Result<(f32, Option<RopeScaling>), ModelError> {
    let (params_key, params) = match (f.get("rope_parameters"), f.get("rope_scaling")) {
        (Some(p), _) => ("rope_parameters", Some(p)),
        (None, Some(s)) => ("rope_scaling", Some(s)),
        (None, None) => ("rope_scaling", None),
    };
    let params = match params {
        None => None,
        Some(Value::Object(m)) => Some(Fields {
            map: m,
            path: f.path,
        }),
        Some(v) => return Err(f.err(params_key, format!("expected an object or null, got {v}"))),
    };
    let theta = match params
        .as_ref()
        .map(|p| p.f32_opt("rope_theta"))
        .transpose()?
        .flatten()
    {
        Some(t) => t,
        None => f.f32_opt("rope_theta")?.unwrap_or(10_000.0),
    };
    let Some(p) = params else {
        return Ok((theta, None));
    };
    let rope_type = match p.str_opt("rope_type")? {
        Some(t) => t,
        None => p.str_opt("type")?.unwrap_or("default"),
    };
    let field = |k: &str| format!("{params_key}.{k}");
    match rope_type {
        "default" => Ok((theta, None)),
        "llama3" if arch == Architecture::Llama => {
            let need = |k: &str| {
                p.f32_opt(k)?
                    .ok_or_else(|| f.err(&field(k), "missing (needed by rope_type llama3)"))
            };
            let orig = p
                .usize_opt("original_max_position_embeddings")?
                .ok_or_else(|| {
                    f.err(
                        &field("original_max_position_embeddings"),
                        "missing (needed by rope_type llama3)",
                    )
                })?;
            Ok((
                theta,
                Some(RopeScaling {
                    factor: need("factor")?,
                    low_freq_factor: need("low_freq_factor")?,
                    high_freq_factor: need("high_freq_factor")?,
                    original_max_position_embeddings: orig,
                }),
            ))
        }
        other => Err(ModelError::Unsupported {
            path: f.path.to_path_buf(),
            problem: format!("{} rope_type {other:?} for {}", params_key, arch.hf_name()),
        }),
    }
}

/// `eos_token_id` as an int or a list of ints; `None` when absent.
fn parse_eos(
    map: &Map<String, Value>,
    path: &Path,
    vocab_size: usize,
) -> Result<Option<Vec<u32>>, ModelError> {
    let f = Fields { map, path };
    let to_id = |v: &Value| -> Result<u32, ModelError> {
        v.as_u64()
            .filter(|&x| (x as usize) < vocab_size)
            .map(|x| x as u32)
            .ok_or_else(|| {
                f.err(
                    "eos_token_id",
                    format!("expected a token id below vocab_size {vocab_size}, got {v}"),
                )
            })
    };
    match f.get("eos_token_id") {
        None => Ok(None),
        Some(Value::Array(a)) => a.iter().map(to_id).collect::<Result<Vec<_>, _>>().map(Some),
        Some(v) => Ok(Some(vec![to_id(v)?])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn write_dir(config: &Value, gen: Option<&Value>) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("config.json"), config.to_string()).expect("write");
        if let Some(g) = gen {
            std::fs::write(dir.path().join("generation_config.json"), g.to_string())
                .expect("write");
        }
        dir
    }

    fn llama_json() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "max_position_embeddings": 131072, "vocab_size": 128256,
            "tie_word_embeddings": true, "torch_dtype": "bfloat16", "eos_token_id": 128001,
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"}
        })
    }

    #[test]
    fn parses_llama_with_scaling_and_generation_eos() {
        let gen = json!({"eos_token_id": [128001, 128008, 128009]});
        let dir = write_dir(&llama_json(), Some(&gen));
        let m = ModelDir::open(dir.path()).expect("open");
        let c = &m.config;
        assert_eq!(c.architecture, Architecture::Llama);
        assert_eq!(c.head_dim, 64);
        assert_eq!(c.dtype, Some(WeightDtype::Bf16));
        assert!(c.tie_word_embeddings);
        let s = c.rope_scaling.as_ref().expect("scaling");
        assert_eq!(s.factor, 32.0);
        assert_eq!(s.original_max_position_embeddings, 8192);
        assert_eq!(m.generation.eos_token_ids, vec![128001, 128008, 128009]);
    }

    #[test]
    fn eos_falls_back_to_config() {
        let dir = write_dir(&llama_json(), Some(&json!({"bos_token_id": 1})));
        let m = ModelDir::open(dir.path()).expect("open");
        assert_eq!(m.generation.eos_token_ids, vec![128001]);
    }

    #[test]
    fn parses_qwen3_and_rope_parameters() {
        let cfg = json!({
            "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "head_dim": 128,
            "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
            "num_key_value_heads": 8, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
            "vocab_size": 151936, "dtype": "bfloat16", "rope_scaling": null,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}
        });
        let dir = write_dir(&cfg, None);
        let m = ModelDir::open(dir.path()).expect("open");
        assert_eq!(m.config.architecture, Architecture::Qwen3);
        assert_eq!(m.config.rope_theta, 1_000_000.0);
        assert!(m.config.rope_scaling.is_none());
        assert!(!m.config.tie_word_embeddings);
        assert!(m.generation.eos_token_ids.is_empty());
    }

    fn open_err(config: &Value) -> String {
        let dir = write_dir(config, None);
        ModelDir::open(dir.path())
            .expect_err("should fail")
            .to_string()
    }

    #[test]
    fn errors_name_file_and_problem() {
        let mut c = llama_json();
        c["architectures"] = json!(["GPT2LMHeadModel"]);
        let e = open_err(&c);
        assert!(
            e.contains("config.json") && e.contains("GPT2LMHeadModel"),
            "{e}"
        );

        let mut c = llama_json();
        c.as_object_mut().expect("obj").remove("hidden_size");
        let e = open_err(&c);
        assert!(e.contains("hidden_size") && e.contains("missing"), "{e}");

        let mut c = llama_json();
        c["num_key_value_heads"] = json!(5);
        let e = open_err(&c);
        assert!(
            e.contains("inconsistent") && e.contains("num_key_value_heads"),
            "{e}"
        );

        let mut c = llama_json();
        c["hidden_size"] = json!(2000);
        let e = open_err(&c);
        assert!(e.contains("hidden_size (2000)"), "{e}");

        let mut c = llama_json();
        c["rope_scaling"]["rope_type"] = json!("yarn");
        let e = open_err(&c);
        assert!(e.contains("yarn"), "{e}");

        let mut c = llama_json();
        c["vocab_size"] = json!("big");
        let e = open_err(&c);
        assert!(e.contains("vocab_size") && e.contains("integer"), "{e}");

        let dir = tempfile::tempdir().expect("tempdir");
        let e = ModelDir::open(dir.path())
            .expect_err("no config")
            .to_string();
        assert!(
            e.contains("config.json") && e.contains("missing file"),
            "{e}"
        );
    }

    /// Found by the fuzz harness: dimensions whose products overflow (heads x head_dim here)
    /// passed validation and panicked in `LayerTensor::shape` (debug) or wrapped (release).
    #[test]
    fn overflowing_dimensions_are_rejected() {
        for (key, value) in [
            ("num_attention_heads", json!(1u64 << 40)),
            ("hidden_size", json!(1u64 << 62)),
            ("intermediate_size", json!(u64::MAX)),
            ("vocab_size", json!(1u64 << 56)),
            ("num_hidden_layers", json!(1u64 << 60)),
        ] {
            let mut c = llama_json();
            c[key] = value;
            if key == "num_attention_heads" {
                c["num_key_value_heads"] = json!(1u64 << 40);
                c["head_dim"] = json!(1u64 << 40);
            }
            let e = open_err(&c);
            assert!(
                e.contains("config.json") && e.contains("parameter count overflows"),
                "{key}: {e}"
            );
        }
        let c = ModelDir::open(write_dir(&llama_json(), None).path())
            .expect("open")
            .config;
        // Llama 3.2 1B: 1.24 billion weights (tied embeddings).
        assert_eq!(c.checked_parameter_count(), Some(1_235_814_400));
    }
}
