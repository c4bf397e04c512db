//! Model presets: the shapes and JSON files of the checkpoints `gen-model` writes.
//!
//! | preset        | arch  | hidden | layers | heads/kv | head_dim | inter | vocab  | dtype | tied |
//! |---------------|-------|--------|--------|----------|----------|-------|--------|-------|------|
//! | micro         | Llama |     64 |      2 |   4 / 2  |       16 |   128 |   1024 | f32   | no   |
//! | micro-qwen3   | Qwen3 |     64 |      2 |   4 / 2  |       32 |   128 |   1024 | f16   | yes  |
//! | tiny          | Llama |    256 |      4 |   8 / 2  |       32 |   768 | 128256 | bf16  | yes  |
//! | llama-3.2-1b  | Llama |   2048 |     16 |  32 / 8  |       64 |  8192 | 128256 | bf16  | yes  |
//! | llama-3.2-3b  | Llama |   3072 |     28 |  24 / 8  |      128 |  8192 | 128256 | bf16  | yes  |
//! | llama-3.1-8b  | Llama |   4096 |     32 |  32 / 8  |      128 | 14336 | 128256 | bf16  | no   |
//! | qwen3-0.6b    | Qwen3 |   1024 |     28 |  16 / 8  |      128 |  3072 | 151936 | bf16  | yes  |
//! | qwen3-4b      | Qwen3 |   2560 |     36 |  32 / 8  |      128 |  9728 | 151936 | bf16  | yes  |
//! | micro-gemma3  | Gemma3|     64 |      6 |   4 / 2  |       64 |   128 |   1024 | f32   | yes  |
//! | gemma-3-1b    | Gemma3|   1152 |     26 |   4 / 1  |      256 |  6912 | 262144 | bf16  | yes  |
//! | gemma-3-4b    | Gemma3|   2560 |     34 |   8 / 4  |      256 | 10240 | 262208 | bf16  | yes  |
//!
//! Gemma 3 presets: five sliding layers to one full (`sliding_window_pattern` 6), bases 1e4
//! (sliding) and 1e6 (full), `query_pre_attn_scalar` 256, windows 512 (1B) and 1024 (4B), the
//! 4B's full layers with linear RoPE scaling 8 (its text tower as released). micro-gemma3 has a
//! window of 32 (test prompts cross it), `query_pre_attn_scalar` 48 (not head_dim, so a wrong
//! scale shows), linear scaling 8 on its full layer, and writes the 5.x form of the config
//! (`layer_types`, `rope_parameters` per layer type) where the release presets write the 4.x
//! keys their Hugging Face releases carry; both are parsed.
//!
//! Llama presets use Llama 3 RoPE scaling: the real-model presets as released (factor 32 for
//! 3.2, 8 for 3.1, original context 8192); `tiny` factor 8 over an original context of 2048
//! (transformers warns when the original context is not below `max_position_embeddings`, and
//! the shorter original context puts more of tiny's 16 frequencies in the interpolated band).
//! The real-model presets write `config.json` / `generation_config.json` as the Hugging Face
//! Instruct releases do.

use serde_json::{json, Map, Value};

use crate::model::{
    Activation, Architecture, LayerAttention, Llama3Scaling, ModelConfig, RopeScaling,
    SlidingWindow, WeightDtype,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    Micro,
    MicroQwen3,
    Tiny,
    Llama32_1b,
    Llama32_3b,
    Llama31_8b,
    Qwen3_0_6b,
    Qwen3_4b,
    MicroGemma3,
    Gemma3_1b,
    Gemma3_4b,
}

/// Token ids a preset declares.
#[derive(Debug, Clone)]
pub struct SpecialIds {
    pub bos: u32,
    /// `eos_token_id` of config.json (an int or a list, as the real model has it).
    pub config_eos: Value,
    /// `eos_token_id` of generation_config.json.
    pub generation_eos: Vec<u32>,
    pub pad: Option<u32>,
}

impl Preset {
    pub const ALL: [Preset; 11] = [
        Preset::Micro,
        Preset::MicroQwen3,
        Preset::Tiny,
        Preset::Llama32_1b,
        Preset::Llama32_3b,
        Preset::Llama31_8b,
        Preset::Qwen3_0_6b,
        Preset::Qwen3_4b,
        Preset::MicroGemma3,
        Preset::Gemma3_1b,
        Preset::Gemma3_4b,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Preset::Micro => "micro",
            Preset::MicroQwen3 => "micro-qwen3",
            Preset::Tiny => "tiny",
            Preset::Llama32_1b => "llama-3.2-1b",
            Preset::Llama32_3b => "llama-3.2-3b",
            Preset::Llama31_8b => "llama-3.1-8b",
            Preset::Qwen3_0_6b => "qwen3-0.6b",
            Preset::Qwen3_4b => "qwen3-4b",
            Preset::MicroGemma3 => "micro-gemma3",
            Preset::Gemma3_1b => "gemma-3-1b",
            Preset::Gemma3_4b => "gemma-3-4b",
        }
    }

    pub fn from_name(name: &str) -> Option<Preset> {
        Preset::ALL.into_iter().find(|p| p.name() == name)
    }

    /// The preset's `ModelConfig` (the table of the module doc).
    #[rustfmt::skip]
    pub fn config(self) -> ModelConfig {
        use Architecture::{Gemma3, Llama, Qwen3};
        use WeightDtype::{Bf16, F16, F32};
        let linear8 = Some(RopeScaling::Linear { factor: 8.0 });
        match self {
            Preset::Micro => dims(Llama, 64, 2, 4, 2, 16, 128, 1024, F32, false, None, 2048),
            Preset::MicroQwen3 => dims(Qwen3, 64, 2, 4, 2, 32, 128, 1024, F16, true, None, 2048),
            Preset::Tiny => dims(Llama, 256, 4, 8, 2, 32, 768, 128256, Bf16, true, llama3_rope(8.0, 2048), 8192),
            Preset::Llama32_1b => dims(Llama, 2048, 16, 32, 8, 64, 8192, 128256, Bf16, true, llama3_rope(32.0, 8192), 131072),
            Preset::Llama32_3b => dims(Llama, 3072, 28, 24, 8, 128, 8192, 128256, Bf16, true, llama3_rope(32.0, 8192), 131072),
            Preset::Llama31_8b => dims(Llama, 4096, 32, 32, 8, 128, 14336, 128256, Bf16, false, llama3_rope(8.0, 8192), 131072),
            Preset::Qwen3_0_6b => dims(Qwen3, 1024, 28, 16, 8, 128, 3072, 151936, Bf16, true, None, 40960),
            Preset::Qwen3_4b => dims(Qwen3, 2560, 36, 32, 8, 128, 9728, 151936, Bf16, true, None, 40960),
            Preset::MicroGemma3 => gemma3(dims(Gemma3, 64, 6, 4, 2, 64, 128, 1024, F32, true, linear8, 2048), 32, 48.0),
            Preset::Gemma3_1b => gemma3(dims(Gemma3, 1152, 26, 4, 1, 256, 6912, 262144, Bf16, true, None, 32768), 512, 256.0),
            Preset::Gemma3_4b => gemma3(dims(Gemma3, 2560, 34, 8, 4, 256, 10240, 262208, Bf16, true, linear8, 131072), 1024, 256.0),
        }
    }

    pub fn special_ids(self) -> SpecialIds {
        let llama3 = SpecialIds {
            bos: 128000,
            config_eos: json!([128001, 128008, 128009]),
            generation_eos: vec![128001, 128008, 128009],
            pad: None,
        };
        match self {
            Preset::Micro => SpecialIds {
                bos: 1022,
                config_eos: json!(1023),
                generation_eos: vec![1023],
                pad: None,
            },
            Preset::MicroQwen3 => SpecialIds {
                bos: 1022,
                config_eos: json!(1023),
                generation_eos: vec![1023, 1022],
                pad: Some(1022),
            },
            Preset::Tiny | Preset::Llama32_1b | Preset::Llama32_3b | Preset::Llama31_8b => llama3,
            Preset::Qwen3_0_6b | Preset::Qwen3_4b => SpecialIds {
                bos: 151643,
                config_eos: json!(151645),
                generation_eos: vec![151645, 151643],
                pad: Some(151643),
            },
            Preset::MicroGemma3 => SpecialIds {
                bos: 1022,
                config_eos: json!([1023, 1021]),
                generation_eos: vec![1023, 1021],
                pad: Some(0),
            },
            // <bos> 2, <eos> 1, <end_of_turn> 106, <pad> 0.
            Preset::Gemma3_1b | Preset::Gemma3_4b => SpecialIds {
                bos: 2,
                config_eos: json!([1, 106]),
                generation_eos: vec![1, 106],
                pad: Some(0),
            },
        }
    }

    fn is_qwen_release(self) -> bool {
        matches!(self, Preset::Qwen3_0_6b | Preset::Qwen3_4b)
    }

    fn is_gemma_release(self) -> bool {
        matches!(self, Preset::Gemma3_1b | Preset::Gemma3_4b)
    }

    /// `config.json` of this preset under config `c` (the preset's, maybe with another dtype).
    pub fn config_json(self, c: &ModelConfig) -> Value {
        if c.architecture == Architecture::Gemma3 {
            return gemma3_config_json(c, &self.special_ids(), self == Preset::MicroGemma3);
        }
        // Llama 3.1 8B's config has no head_dim (it is hidden / heads); the others spell it out.
        config_json(c, &self.special_ids(), self == Preset::Llama31_8b)
    }
}

fn llama3_rope(factor: f32, original: usize) -> Option<RopeScaling> {
    Some(RopeScaling::Llama3(Llama3Scaling {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: original,
    }))
}

/// Gemma 3's additions to a `dims` row: the 5:1 sliding pattern, the window, the local RoPE
/// base, GELU-tanh and `query_pre_attn_scalar`.
fn gemma3(mut c: ModelConfig, window: usize, query_pre_attn_scalar: f32) -> ModelConfig {
    c.sliding = Some(SlidingWindow {
        window,
        layers: (0..c.num_layers)
            .map(|i| match (i + 1) % 6 {
                0 => LayerAttention::Full,
                _ => LayerAttention::Sliding,
            })
            .collect(),
        rope_theta: 10_000.0,
    });
    c.hidden_act = Activation::GeluTanh;
    c.query_pre_attn_scalar = Some(query_pre_attn_scalar);
    c
}

/// One row of the preset table (columns as in the module doc); theta and eps by architecture.
#[allow(clippy::too_many_arguments)]
fn dims(
    architecture: Architecture,
    hidden_size: usize,
    num_layers: usize,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    intermediate_size: usize,
    vocab_size: usize,
    dtype: WeightDtype,
    tie_word_embeddings: bool,
    rope_scaling: Option<RopeScaling>,
    max_position_embeddings: usize,
) -> ModelConfig {
    let (rope_theta, rms_norm_eps) = match architecture {
        Architecture::Llama => (500_000.0, 1e-5),
        Architecture::Qwen3 | Architecture::Gemma3 => (1_000_000.0, 1e-6),
    };
    ModelConfig {
        architecture,
        vocab_size,
        hidden_size,
        intermediate_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        rms_norm_eps,
        rope_theta,
        rope_scaling,
        max_position_embeddings,
        tie_word_embeddings,
        dtype: Some(dtype),
        hidden_act: Activation::Silu,
        query_pre_attn_scalar: None,
        sliding: None,
        fp8: None,
    }
}

/// `head_dim` is written unless `omit_head_dim` (Llama 3.1 8B's config has none).
pub fn config_json(c: &ModelConfig, ids: &SpecialIds, omit_head_dim: bool) -> Value {
    let dtype = c.dtype.unwrap_or(WeightDtype::Bf16).torch_name();
    let mut m = Map::new();
    let mut put = |k: &str, v: Value| {
        m.insert(k.to_string(), v);
    };
    put("architectures", json!([c.architecture.hf_name()]));
    put("model_type", json!(c.architecture.model_type()));
    put("attention_bias", json!(false));
    put("attention_dropout", json!(0.0));
    put("bos_token_id", json!(ids.bos));
    put("eos_token_id", ids.config_eos.clone());
    put("hidden_act", json!("silu"));
    put("hidden_size", json!(c.hidden_size));
    put("initializer_range", json!(0.02));
    put("intermediate_size", json!(c.intermediate_size));
    put("max_position_embeddings", json!(c.max_position_embeddings));
    put("num_attention_heads", json!(c.num_heads));
    put("num_hidden_layers", json!(c.num_layers));
    put("num_key_value_heads", json!(c.num_kv_heads));
    put("rms_norm_eps", f32_json(c.rms_norm_eps));
    put("rope_theta", f32_json(c.rope_theta));
    put("tie_word_embeddings", json!(c.tie_word_embeddings));
    put("torch_dtype", json!(dtype));
    put("transformers_version", json!("4.51.0"));
    put("use_cache", json!(true));
    put("vocab_size", json!(c.vocab_size));
    if !omit_head_dim {
        put("head_dim", json!(c.head_dim));
    }
    match c.architecture {
        Architecture::Llama => {
            put("mlp_bias", json!(false));
            put("pretraining_tp", json!(1));
            put(
                "rope_scaling",
                match &c.rope_scaling {
                    Some(RopeScaling::Linear { factor }) => json!({
                        "factor": f32_json(*factor),
                        "rope_type": "linear",
                    }),
                    Some(RopeScaling::Llama3(s)) => json!({
                        "factor": f32_json(s.factor),
                        "high_freq_factor": f32_json(s.high_freq_factor),
                        "low_freq_factor": f32_json(s.low_freq_factor),
                        "original_max_position_embeddings": s.original_max_position_embeddings,
                        "rope_type": "llama3",
                    }),
                    None => Value::Null,
                },
            );
        }
        Architecture::Qwen3 => {
            put("max_window_layers", json!(c.num_layers));
            put("rope_scaling", Value::Null);
            put("sliding_window", Value::Null);
            put("use_sliding_window", json!(false));
        }
        Architecture::Gemma3 => unreachable!("Gemma 3 configs come from gemma3_config_json"),
    }
    Value::Object(m)
}

/// `config.json` of a Gemma 3 text model: the 4.x keys of the Hugging Face release
/// (`rope_theta`, `rope_local_base_freq`, `rope_scaling`, `sliding_window_pattern`), or with
/// `v5` the form transformers 5 writes (`layer_types`, `rope_parameters` per layer type).
pub fn gemma3_config_json(c: &ModelConfig, ids: &SpecialIds, v5: bool) -> Value {
    let sliding = c
        .sliding
        .as_ref()
        .expect("a Gemma 3 config has sliding layers");
    let dtype = c.dtype.unwrap_or(WeightDtype::Bf16).torch_name();
    let scaling = match &c.rope_scaling {
        None => Value::Null,
        Some(RopeScaling::Linear { factor }) => {
            json!({"factor": f32_json(*factor), "rope_type": "linear"})
        }
        Some(other) => panic!("Gemma 3 presets use linear RoPE scaling, not {other:?}"),
    };
    let mut m = json!({
        "architectures": [c.architecture.hf_name()],
        "model_type": c.architecture.model_type(),
        "attention_bias": false,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": null,
        "bos_token_id": ids.bos,
        "eos_token_id": ids.config_eos.clone(),
        "final_logit_softcapping": null,
        "head_dim": c.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": c.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": c.intermediate_size,
        "max_position_embeddings": c.max_position_embeddings,
        "num_attention_heads": c.num_heads,
        "num_hidden_layers": c.num_layers,
        "num_key_value_heads": c.num_kv_heads,
        "pad_token_id": ids.pad,
        // transformers 5 validates this field as an int.
        "query_pre_attn_scalar": c.query_pre_attn_scalar.map(|q| match q.fract() == 0.0 {
            true => json!(q as i64),
            false => f32_json(q),
        }),
        "rms_norm_eps": f32_json(c.rms_norm_eps),
        "sliding_window": sliding.window,
        "tie_word_embeddings": c.tie_word_embeddings,
        "torch_dtype": dtype,
        "use_cache": true,
        "vocab_size": c.vocab_size,
    });
    let obj = m.as_object_mut().expect("object");
    if v5 {
        let types: Vec<&str> = sliding.layers.iter().map(|l| l.hf_name()).collect();
        let mut full = json!({"rope_type": "default", "rope_theta": f32_json(c.rope_theta)});
        if let Value::Object(s) = &scaling {
            for (k, v) in s {
                full[k] = v.clone();
            }
        }
        obj.insert("layer_types".into(), json!(types));
        obj.insert(
            "rope_parameters".into(),
            json!({
                "full_attention": full,
                "sliding_attention": {"rope_type": "default", "rope_theta": f32_json(sliding.rope_theta)},
            }),
        );
        obj.insert("transformers_version".into(), json!("5.0.0"));
    } else {
        obj.insert("cache_implementation".into(), json!("hybrid"));
        obj.insert("rope_local_base_freq".into(), f32_json(sliding.rope_theta));
        obj.insert("rope_scaling".into(), scaling);
        obj.insert("rope_theta".into(), f32_json(c.rope_theta));
        obj.insert("sliding_window_pattern".into(), json!(6));
        obj.insert("transformers_version".into(), json!("4.50.0.dev0"));
    }
    m
}

/// An f32 as the shortest decimal that reads back to it (`1e-5`, not `9.99999974e-6`).
fn f32_json(x: f32) -> Value {
    json!(x.to_string().parse::<f64>().unwrap_or(x as f64))
}

/// `generation_config.json` as the release has it.
pub fn generation_config_json(preset: Preset) -> Value {
    let ids = preset.special_ids();
    let mut g = json!({
        "bos_token_id": ids.bos,
        "do_sample": true,
        "eos_token_id": ids.generation_eos,
        "transformers_version": "4.51.0",
    });
    if preset.is_qwen_release() {
        g["pad_token_id"] = json!(ids.pad);
        g["temperature"] = json!(0.6);
        g["top_k"] = json!(20);
        g["top_p"] = json!(0.95);
    } else if preset.is_gemma_release() {
        g["cache_implementation"] = json!("hybrid");
        g["pad_token_id"] = json!(ids.pad);
        g["top_k"] = json!(64);
        g["top_p"] = json!(0.95);
    } else {
        if let Some(pad) = ids.pad {
            g["pad_token_id"] = json!(pad);
        }
        g["temperature"] = json!(0.6);
        g["top_p"] = json!(0.9);
    }
    g
}
