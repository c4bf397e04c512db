//! Hugging Face model directories: `config.json` and `generation_config.json`.
//!
//! We accept the two decoder-only architectures the engine implements:
//!
//! | `architectures[0]`  | notes                                                        |
//! |---------------------|--------------------------------------------------------------|
//! | `LlamaForCausalLM`  | optional `rope_scaling` of `rope_type: "llama3"`; `head_dim`   |
//! |                     | optional (defaults to `hidden_size / num_attention_heads`)   |
//! | `Qwen3ForCausalLM`  | explicit `head_dim`, per-head q/k RMSNorm, no rope scaling   |
//! | `Gemma3ForCausalLM` | text Gemma 3: sliding and full layers (`layer_types` or       |
//! |                     | `sliding_window_pattern`), a RoPE base per layer type, q/k    |
//! |                     | norms, four (1 + w) norms per block, GELU-tanh, scaled        |
//! |                     | embeddings, `query_pre_attn_scalar`                          |
//!
//! Gemma 3 keys that a config leaves out take `Gemma3TextConfig`'s defaults (head_dim 256,
//! window 4096, pattern 6, bases 1e6 / 1e4, `query_pre_attn_scalar` 256), as transformers does.
//! Its RoPE comes either as 4.x keys (`rope_theta` and `rope_scaling` for full layers,
//! `rope_local_base_freq` for sliding ones) or as 5.x `rope_parameters` keyed by layer type.
//!
//! Both the transformers 4.x keys (`rope_theta`, `rope_scaling`, `torch_dtype`) and the 5.x
//! ones (`rope_parameters`, `dtype`) are read. Every error names the file and the problem.

use std::path::{Path, PathBuf};

use super::fp8::Fp8Checkpoint;
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
        "{}: unknown architecture {name:?} (supported: LlamaForCausalLM, Qwen3ForCausalLM, \
         Gemma3ForCausalLM)",
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
    #[error(
        "{}: tensor `{name}` has dtype {dtype}, expected BF16, F16 or F32 (or F8_E4M3 for the \
         projections of an FP8 checkpoint)",
        file.display()
    )]
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
    Gemma3,
}

impl Architecture {
    /// The `architectures[0]` string of `config.json`.
    pub fn hf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Gemma3 => "Gemma3ForCausalLM",
        }
    }
    /// The `model_type` string of `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen3 => "qwen3",
            Architecture::Gemma3 => "gemma3_text",
        }
    }
    fn from_hf_name(name: &str) -> Option<Architecture> {
        match name {
            "LlamaForCausalLM" => Some(Architecture::Llama),
            "Qwen3ForCausalLM" => Some(Architecture::Qwen3),
            "Gemma3ForCausalLM" => Some(Architecture::Gemma3),
            _ => None,
        }
    }
    /// Per-head RMSNorm of q and k before RoPE.
    pub fn has_qk_norm(self) -> bool {
        matches!(self, Architecture::Qwen3 | Architecture::Gemma3)
    }
    /// Gemma's block: the attention and MLP outputs are normed before their residual adds
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`), and the MLP input norm is
    /// `pre_feedforward_layernorm`. Llama and Qwen3 name their MLP input norm
    /// `post_attention_layernorm`.
    pub fn sandwich_norms(self) -> bool {
        self == Architecture::Gemma3
    }
    /// Gemma's RMSNorm scales by `1 + w` (weights are stored centred on 0); the others by `w`.
    pub fn norm_weight_offset(self) -> f32 {
        match self {
            Architecture::Gemma3 => 1.0,
            Architecture::Llama | Architecture::Qwen3 => 0.0,
        }
    }
    /// Gemma multiplies the embeddings by `sqrt(hidden_size)` (rounded to the weights' dtype).
    pub fn scales_embeddings(self) -> bool {
        self == Architecture::Gemma3
    }
}

/// The MLP's gate activation (`hidden_act` / Gemma's `hidden_activation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu`: `x * sigmoid(x)`.
    Silu,
    /// `gelu_pytorch_tanh`: `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`.
    GeluTanh,
}

/// The attention of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerAttention {
    /// Causal attention over every earlier position.
    Full,
    /// Causal attention over the last `window` positions (the token's own included).
    Sliding,
}

impl LayerAttention {
    /// The `layer_types` entry of transformers' configs.
    pub fn hf_name(self) -> &'static str {
        match self {
            LayerAttention::Full => "full_attention",
            LayerAttention::Sliding => "sliding_attention",
        }
    }
}

/// Interleaved sliding-window and full attention (Gemma 3).
#[derive(Debug, Clone, PartialEq)]
pub struct SlidingWindow {
    /// A token at position `p` attends to positions `p - window + 1 ..= p` in sliding layers
    /// (transformers' `kv_idx > q_idx - sliding_window`).
    pub window: usize,
    /// One entry per layer.
    pub layers: Vec<LayerAttention>,
    /// RoPE base of the sliding layers (unscaled); full layers use `rope_theta` and
    /// `rope_scaling`.
    pub rope_theta: f32,
}

/// RoPE frequency scaling.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// `rope_type: "llama3"`: low frequencies divided by the factor, a smooth band between.
    Llama3(Llama3Scaling),
    /// `rope_type: "linear"`: every frequency divided by `factor` (positions interpolated).
    Linear { factor: f32 },
}

/// Llama 3 RoPE frequency scaling (`rope_type: "llama3"`).
#[derive(Debug, Clone, PartialEq)]
pub struct Llama3Scaling {
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
    pub hidden_act: Activation,
    /// Gemma's `query_pre_attn_scalar`: scores are scaled by its inverse square root instead
    /// of `head_dim`'s.
    pub query_pre_attn_scalar: Option<f32>,
    /// `None`: every layer attends to the whole context.
    pub sliding: Option<SlidingWindow>,
    /// An FP8 checkpoint's `quantization_config` (its weights are read with their scales).
    pub fp8: Option<Fp8Checkpoint>,
}

impl ModelConfig {
    /// The softmax scale of attention scores.
    pub fn attention_scale(&self) -> f32 {
        let d = self.query_pre_attn_scalar.unwrap_or(self.head_dim as f32) as f64;
        d.powf(-0.5) as f32
    }

    /// The attention kind of layer `layer`.
    pub fn layer_attention(&self, layer: usize) -> LayerAttention {
        match &self.sliding {
            Some(s) => s.layers[layer],
            None => LayerAttention::Full,
        }
    }

    /// Layers of sliding-window attention (0 without a window).
    pub fn num_sliding_layers(&self) -> usize {
        self.sliding.as_ref().map_or(0, |s| {
            s.layers
                .iter()
                .filter(|&&l| l == LayerAttention::Sliding)
                .count()
        })
    }

    /// The window of layer `layer` (`None`: full attention).
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        match (&self.sliding, self.layer_attention(layer)) {
            (Some(s), LayerAttention::Sliding) => Some(s.window),
            _ => None,
        }
    }

    /// The embedding multiplier: `sqrt(hidden_size)` for Gemma, rounded to the storage type
    /// as transformers does (`embed_scale.to(weight.dtype)`: 33.94 becomes 34.0 in bf16), else 1.
    pub fn embed_scale(&self, storage: WeightDtype) -> f32 {
        if !self.architecture.scales_embeddings() {
            return 1.0;
        }
        let s = (self.hidden_size as f64).sqrt() as f32;
        match storage {
            WeightDtype::F32 => s,
            WeightDtype::Bf16 => half::bf16::from_f32(s).to_f32(),
            WeightDtype::F16 => half::f16::from_f32(s).to_f32(),
        }
    }

    /// Width of the fused q|k|v projection output.
    pub fn qkv_dim(&self) -> usize {
        (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    }

    /// The layer projections as the backends run them, `(name, n, k)` for
    /// `y[rows, n] = x[rows, k] · w[n, k]ᵀ`: q|k|v stacked, o, gate|up stacked, down.
    pub fn layer_gemm_shapes(&self) -> [(&'static str, usize, usize); 4] {
        let (h, i) = (self.hidden_size, self.intermediate_size);
        [
            ("qkv", self.qkv_dim(), h),
            ("o", h, self.num_heads * self.head_dim),
            ("gate_up", 2 * i, h),
            ("down", h, i),
        ]
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
        let qk_norms = if architecture.has_qk_norm() {
            2 * head_dim
        } else {
            0
        };
        let norms = if architecture.sandwich_norms() { 4 } else { 2 };
        // q and o projections, k and v, gate, up and down, the block's norms.
        let per_layer = [
            q.checked_mul(hidden_size)?.checked_mul(2)?,
            kv.checked_mul(hidden_size)?.checked_mul(2)?,
            intermediate_size.checked_mul(hidden_size)?.checked_mul(3)?,
            hidden_size.checked_mul(norms)?,
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
        match rope_scaling {
            None => {}
            Some(RopeScaling::Llama3(s)) => {
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
            Some(RopeScaling::Linear { factor }) if !(factor.is_finite() && *factor > 0.0) => {
                return bad(format!(
                    "linear rope scaling needs factor > 0, got {factor}"
                ));
            }
            Some(RopeScaling::Linear { .. }) => {}
        }
        if let Some(q) = self.query_pre_attn_scalar {
            if !(q.is_finite() && q > 0.0) {
                return bad(format!("query_pre_attn_scalar ({q}) must be positive"));
            }
        }
        if let Some(s) = &self.sliding {
            if s.window == 0 {
                return bad("sliding_window is 0".into());
            }
            if s.layers.len() != num_layers {
                return bad(format!(
                    "layer_types has {} entries for {num_layers} layers",
                    s.layers.len()
                ));
            }
            if !(s.rope_theta.is_finite() && s.rope_theta > 0.0) {
                return bad(format!(
                    "the sliding layers' rope_theta ({}) must be positive",
                    s.rope_theta
                ));
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
    let gemma = architecture == Architecture::Gemma3;
    let act_key = match f.get("hidden_activation") {
        Some(_) => "hidden_activation",
        None => "hidden_act",
    };
    let hidden_act = match (f.str_opt(act_key)?, gemma) {
        (None, false) | (Some("silu"), _) => Activation::Silu,
        (None, true) | (Some("gelu_pytorch_tanh"), _) => Activation::GeluTanh,
        (Some(act), _) => {
            return Err(unsupported(format!(
                "{act_key} {act:?} (only \"silu\" and \"gelu_pytorch_tanh\")"
            )))
        }
    };
    for key in ["attention_bias", "mlp_bias", "use_bidirectional_attention"] {
        if f.bool_opt(key)? == Some(true) {
            return Err(unsupported(format!("{key}: true")));
        }
    }
    for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if let Some(v) = f.f32_opt(key)? {
            return Err(unsupported(format!("{key}: {v} (no soft-capping)")));
        }
    }
    if f.bool_opt("use_sliding_window")? == Some(true) {
        return Err(unsupported("use_sliding_window: true".into()));
    }

    let hidden_size = f.usize("hidden_size")?;
    let num_heads = f.usize("num_attention_heads")?;
    let num_kv_heads = f.usize_opt("num_key_value_heads")?.unwrap_or(num_heads);
    let num_layers = f.usize("num_hidden_layers")?;
    // Per-layer tables are built from the config before any weight is seen: a layer count no
    // model has must not cost memory (found by fuzz_gemma3_config_fields: 2^32 - 1 layers
    // with the sliding pattern allocated 4 GB).
    if num_layers > MAX_LAYERS {
        return Err(f.err(
            "num_hidden_layers",
            format!("{num_layers} is more layers than any model has (at most {MAX_LAYERS})"),
        ));
    }
    let head_dim = match (f.usize_opt("head_dim")?, architecture) {
        (Some(d), _) => d,
        (None, Architecture::Qwen3) => return Err(f.err("head_dim", "missing (Qwen3 needs it)")),
        (None, Architecture::Gemma3) => GEMMA3_DEFAULT_HEAD_DIM,
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
    let (rope_theta, rope_scaling, sliding) = if gemma {
        let (global, local) = parse_gemma_rope(&f)?;
        let sliding = SlidingWindow {
            window: f
                .usize_opt("sliding_window")?
                .unwrap_or(GEMMA3_DEFAULT_WINDOW),
            layers: parse_layer_types(&f, num_layers)?,
            rope_theta: local,
        };
        (global.0, global.1, Some(sliding))
    } else {
        let (theta, scaling) = parse_rope(&f, architecture)?;
        (theta, scaling, None)
    };
    let query_pre_attn_scalar = match gemma {
        true => Some(
            f.f32_opt("query_pre_attn_scalar")?
                .unwrap_or(GEMMA3_DEFAULT_QUERY_PRE_ATTN_SCALAR),
        ),
        false => None,
    };
    let dtype = match f.str_opt("torch_dtype")?.or(f.str_opt("dtype")?) {
        None => None,
        Some(s) => Some(
            WeightDtype::from_torch_name(s)
                .ok_or_else(|| f.err("torch_dtype", format!("unknown dtype {s:?}")))?,
        ),
    };
    let rms_norm_eps = match (f.f32_opt("rms_norm_eps")?, gemma) {
        (Some(e), _) => e,
        (None, true) => 1e-6,
        (None, false) => return Err(f.err("rms_norm_eps", "missing")),
    };
    let config = ModelConfig {
        architecture,
        vocab_size: f.usize("vocab_size")?,
        hidden_size,
        intermediate_size: f.usize("intermediate_size")?,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        rms_norm_eps,
        rope_theta,
        rope_scaling,
        max_position_embeddings: f.usize("max_position_embeddings")?,
        // Gemma3TextConfig ties by default; the others do not.
        tie_word_embeddings: f.bool_opt("tie_word_embeddings")?.unwrap_or(gemma),
        dtype,
        hidden_act,
        query_pre_attn_scalar,
        sliding,
        fp8: Fp8Checkpoint::parse(f.get("quantization_config"), path)?,
    };
    config.validate(path)?;
    Ok(config)
}

/// The most decoder layers a config may claim.
const MAX_LAYERS: usize = 1 << 16;

/// `Gemma3TextConfig`'s defaults for keys a config leaves out.
const GEMMA3_DEFAULT_HEAD_DIM: usize = 256;
const GEMMA3_DEFAULT_WINDOW: usize = 4096;
const GEMMA3_DEFAULT_PATTERN: usize = 6;
const GEMMA3_DEFAULT_QUERY_PRE_ATTN_SCALAR: f32 = 256.0;
const GEMMA3_DEFAULT_GLOBAL_THETA: f32 = 1_000_000.0;
const GEMMA3_DEFAULT_LOCAL_THETA: f32 = 10_000.0;

/// Gemma 3's layer kinds: `layer_types` (5.x), else every `sliding_window_pattern`-th layer
/// full and the rest sliding (`(i + 1) % pattern != 0`, as transformers derives it).
fn parse_layer_types(f: &Fields<'_>, num_layers: usize) -> Result<Vec<LayerAttention>, ModelError> {
    match f.get("layer_types") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                [LayerAttention::Sliding, LayerAttention::Full]
                    .into_iter()
                    .find(|k| v.as_str() == Some(k.hf_name()))
                    .ok_or_else(|| {
                        f.err(
                            "layer_types",
                            format!(
                                "expected \"sliding_attention\" or \"full_attention\", got {v}"
                            ),
                        )
                    })
            })
            .collect(),
        Some(v) => Err(f.err("layer_types", format!("expected a list, got {v}"))),
        None => {
            let pattern = f
                .usize_opt("sliding_window_pattern")?
                .unwrap_or(GEMMA3_DEFAULT_PATTERN);
            if pattern == 0 {
                return Err(f.err("sliding_window_pattern", "must be at least 1"));
            }
            Ok((0..num_layers)
                .map(|i| match (i + 1) % pattern {
                    0 => LayerAttention::Full,
                    _ => LayerAttention::Sliding,
                })
                .collect())
        }
    }
}

/// Gemma 3's RoPE: `((full layers' theta, scaling), sliding layers' theta)`, from 5.x
/// `rope_parameters: {"full_attention": {...}, "sliding_attention": {...}}` or 4.x
/// `rope_theta` / `rope_scaling` / `rope_local_base_freq`.
#[allow(clippy::type_complexity)]
fn parse_gemma_rope(f: &Fields<'_>) -> Result<((f32, Option<RopeScaling>), f32), ModelError> {
    let nested = match f.get("rope_parameters") {
        Some(Value::Object(m))
            if m.contains_key("full_attention") || m.contains_key("sliding_attention") =>
        {
            Some(m)
        }
        _ => None,
    };
    let Some(nested) = nested else {
        let (theta, scaling) = match parse_rope(f, Architecture::Gemma3)? {
            // parse_rope's default when no theta is given is Llama's 10,000; Gemma's is 1e6.
            (_, s) if f.f32_opt("rope_theta")?.is_none() && !rope_params_have_theta(f) => {
                (GEMMA3_DEFAULT_GLOBAL_THETA, s)
            }
            other => other,
        };
        let local = f
            .f32_opt("rope_local_base_freq")?
            .unwrap_or(GEMMA3_DEFAULT_LOCAL_THETA);
        return Ok(((theta, scaling), local));
    };
    let sub = |key: &str| -> Result<Option<Fields<'_>>, ModelError> {
        match nested.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(m)) => Ok(Some(Fields {
                map: m,
                path: f.path,
            })),
            Some(v) => Err(f.err(
                &format!("rope_parameters.{key}"),
                format!("expected an object, got {v}"),
            )),
        }
    };
    let global = match sub("full_attention")? {
        Some(p) => {
            let theta = p
                .f32_opt("rope_theta")?
                .unwrap_or(GEMMA3_DEFAULT_GLOBAL_THETA);
            (
                theta,
                rope_scaling_of(&p, "rope_parameters.full_attention", Architecture::Gemma3)?,
            )
        }
        None => (GEMMA3_DEFAULT_GLOBAL_THETA, None),
    };
    let local = match sub("sliding_attention")? {
        Some(p) => {
            if let Some(s) = rope_scaling_of(
                &p,
                "rope_parameters.sliding_attention",
                Architecture::Gemma3,
            )? {
                return Err(ModelError::Unsupported {
                    path: f.path.to_path_buf(),
                    problem: format!("rope scaling of the sliding layers ({s:?})"),
                });
            }
            p.f32_opt("rope_theta")?
                .unwrap_or(GEMMA3_DEFAULT_LOCAL_THETA)
        }
        None => GEMMA3_DEFAULT_LOCAL_THETA,
    };
    Ok((global, local))
}

fn rope_params_have_theta(f: &Fields<'_>) -> bool {
    ["rope_parameters", "rope_scaling"].iter().any(|k| {
        f.get(k)
            .and_then(Value::as_object)
            .is_some_and(|m| m.get("rope_theta").is_some_and(|v| !v.is_null()))
    })
}

/// `rope_theta` and scaling, from `rope_scaling` (4.x) or `rope_parameters` (5.x).
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
    Ok((theta, rope_scaling_of(&p, params_key, arch)?))
}

/// The scaling a rope parameter object describes (`rope_type` or the older `type`).
fn rope_scaling_of(
    p: &Fields<'_>,
    params_key: &str,
    arch: Architecture,
) -> Result<Option<RopeScaling>, ModelError> {
    let rope_type = match p.str_opt("rope_type")? {
        Some(t) => t,
        None => p.str_opt("type")?.unwrap_or("default"),
    };
    let field = |k: &str| format!("{params_key}.{k}");
    let need = |k: &str| {
        p.f32_opt(k)?.ok_or_else(|| {
            p.err(
                &field(k),
                format!("missing (needed by rope_type {rope_type})"),
            )
        })
    };
    match rope_type {
        "default" => Ok(None),
        "linear" => Ok(Some(RopeScaling::Linear {
            factor: need("factor")?,
        })),
        "llama3" if arch == Architecture::Llama => {
            let orig = p
                .usize_opt("original_max_position_embeddings")?
                .ok_or_else(|| {
                    p.err(
                        &field("original_max_position_embeddings"),
                        "missing (needed by rope_type llama3)",
                    )
                })?;
            Ok(Some(RopeScaling::Llama3(Llama3Scaling {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                original_max_position_embeddings: orig,
            })))
        }
        other => Err(ModelError::Unsupported {
            path: p.path.to_path_buf(),
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
        let Some(RopeScaling::Llama3(s)) = &c.rope_scaling else {
            panic!("llama3 scaling expected: {:?}", c.rope_scaling)
        };
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

    /// gemma-3-1b-it's config.json as released (4.x keys), and the 4B text tower with linear
    /// RoPE scaling, written as transformers 5 does (`layer_types`, nested `rope_parameters`).
    #[test]
    fn parses_gemma3_in_both_forms() {
        let v4 = json!({
            "architectures": ["Gemma3ForCausalLM"], "attention_bias": false,
            "attn_logit_softcapping": null, "bos_token_id": 2, "eos_token_id": [1, 106],
            "final_logit_softcapping": null, "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
            "intermediate_size": 6912, "max_position_embeddings": 32768,
            "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26,
            "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": null,
            "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
            "torch_dtype": "bfloat16", "vocab_size": 262144
        });
        let c = ModelDir::open(write_dir(&v4, None).path())
            .expect("open")
            .config;
        assert_eq!(c.architecture, Architecture::Gemma3);
        assert_eq!(c.hidden_act, Activation::GeluTanh);
        assert!(c.tie_word_embeddings, "Gemma 3 ties by default");
        assert_eq!(c.rope_theta, 1_000_000.0);
        assert_eq!(c.attention_scale(), 1.0 / 16.0);
        let s = c.sliding.as_ref().expect("sliding");
        assert_eq!((s.window, s.rope_theta), (512, 10_000.0));
        let full: Vec<usize> = (0..26)
            .filter(|&l| s.layers[l] == LayerAttention::Full)
            .collect();
        assert_eq!(full, vec![5, 11, 17, 23]);
        assert_eq!(c.layer_window(0), Some(512));
        assert_eq!(c.layer_window(5), None);
        // sqrt(1152) = 33.94 is 34.0 in bf16.
        assert_eq!(c.embed_scale(WeightDtype::Bf16), 34.0);
        assert_eq!(c.embed_scale(WeightDtype::F32), (1152f64).sqrt() as f32);

        let mut v5 = v4.clone();
        let m = v5.as_object_mut().expect("obj");
        for k in [
            "rope_local_base_freq",
            "rope_scaling",
            "rope_theta",
            "sliding_window_pattern",
        ] {
            m.remove(k);
        }
        let types: Vec<&str> = (0..26)
            .map(|i| {
                if i % 2 == 0 {
                    "sliding_attention"
                } else {
                    "full_attention"
                }
            })
            .collect();
        m.insert("layer_types".into(), json!(types));
        m.insert(
            "rope_parameters".into(),
            json!({"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        );
        let c = ModelDir::open(write_dir(&v5, None).path())
            .expect("open")
            .config;
        assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 8.0 }));
        let s = c.sliding.as_ref().expect("sliding");
        assert_eq!(s.layers[0], LayerAttention::Sliding);
        assert_eq!(s.layers[1], LayerAttention::Full);

        // What Harrier does not implement is named.
        for (key, value, says) in [
            (
                "final_logit_softcapping",
                json!(30.0),
                "final_logit_softcapping",
            ),
            ("hidden_activation", json!("gelu"), "gelu"),
            (
                "use_bidirectional_attention",
                json!(true),
                "use_bidirectional_attention",
            ),
            (
                "layer_types",
                json!(["sliding_attention"]),
                "layer_types has 1 entries",
            ),
            ("layer_types", json!(["local"]), "layer_types"),
            ("sliding_window", json!(0), "sliding_window is 0"),
        ] {
            let mut c = v4.clone();
            c[key] = value;
            let e = open_err(&c);
            assert!(e.contains("config.json") && e.contains(says), "{key}: {e}");
        }
        let mut c = v5.clone();
        c["rope_parameters"]["sliding_attention"] = json!({"rope_type": "linear", "factor": 2.0});
        let e = open_err(&c);
        assert!(e.contains("sliding layers"), "{e}");
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
        // A layer count no model has is refused before anything is sized by it.
        let mut c = llama_json();
        c["num_hidden_layers"] = json!(1u64 << 60);
        let e = open_err(&c);
        assert!(
            e.contains("num_hidden_layers") && e.contains("more layers"),
            "{e}"
        );
        let c = ModelDir::open(write_dir(&llama_json(), None).path())
            .expect("open")
            .config;
        // Llama 3.2 1B: 1.24 billion weights (tied embeddings).
        assert_eq!(c.checked_parameter_count(), Some(1_235_814_400));
    }
}
