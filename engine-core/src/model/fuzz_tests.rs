//! Fuzz harness of the model-directory loader (docs/fuzzing.md): `config.json` and
//! `generation_config.json` with fields deleted or replaced by arbitrary JSON, or their bytes
//! mutated; safetensors files (single and sharded) with the header length, the header's
//! dtypes, shapes, offsets and names, the index's weight map, or raw bytes mutated. Each
//! directory is opened, checked and loaded the way the engine does it (`ModelDir::open`,
//! `Checkpoint::open`, `check`, `CpuModel::load`). Every failure must be a `ModelError` that
//! names the file it is about; nothing may panic, hang, or allocate past [`alloc_bound`].

use std::path::Path;

use harrier_shared::fuzz;
use proptest::prelude::*;
use serde_json::{json, Map, Value};

use super::*;

#[global_allocator]
static ALLOC: fuzz::TrackingAlloc = fuzz::TrackingAlloc;

/// The tiny Llama the harness loads: 2 layers, hidden 8, 2 query heads and 1 KV head of 4,
/// vocabulary 32, tied embeddings, bf16.
fn base_config() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "vocab_size": 32,
        "tie_word_embeddings": true, "torch_dtype": "bfloat16", "hidden_act": "silu",
        "attention_bias": false, "mlp_bias": false, "eos_token_id": [1, 2],
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        "rope_theta": 500000.0
    })
}

fn base_model_config() -> ModelConfig {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), base_config().to_string()).unwrap();
    ModelDir::open(dir.path()).unwrap().config
}

/// The safetensors header (as JSON) and data of the tiny model: every expected tensor in
/// bf16, in order, with small deterministic values.
fn base_checkpoint() -> (Map<String, Value>, Vec<u8>) {
    checkpoint_for(&base_model_config())
}

/// A tiny Gemma 3 (5.x config form): 3 layers (sliding, full, sliding) with a window of 4,
/// hidden 8, head_dim 4, nested per-type RoPE with linear scaling on the full layer.
fn gemma_config() -> Value {
    json!({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 3,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 64, "vocab_size": 32,
        "torch_dtype": "bfloat16", "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 4, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}
        },
        "final_logit_softcapping": null, "attn_logit_softcapping": null, "eos_token_id": [1, 2]
    })
}

/// Keys the Gemma 3 parser reads beyond the common ones.
const GEMMA_KEYS: &[&str] = &[
    "layer_types",
    "sliding_window",
    "sliding_window_pattern",
    "query_pre_attn_scalar",
    "hidden_activation",
    "rope_parameters",
    "rope_local_base_freq",
    "rope_theta",
    "rope_scaling",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "use_bidirectional_attention",
    "head_dim",
    "num_hidden_layers",
    "tie_word_embeddings",
];

/// The safetensors header and data of every tensor `config` expects, in bf16.
fn checkpoint_for(config: &ModelConfig) -> (Map<String, Value>, Vec<u8>) {
    let mut header = Map::new();
    let mut data = Vec::new();
    for (name, shape) in expected_tensors(config) {
        let n: usize = shape.iter().product();
        let start = data.len();
        for i in 0..n {
            let v = half::bf16::from_f32(((i % 7) as f32 - 3.0) / 8.0);
            data.extend_from_slice(&v.to_le_bytes());
        }
        header.insert(
            name,
            json!({"dtype": "BF16", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    (header, data)
}

/// A safetensors file: 8-byte little-endian header length, the header, the data.
fn safetensors_bytes(header: &Map<String, Value>, data: &[u8]) -> Vec<u8> {
    let text = serde_json::to_string(header).unwrap();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(data);
    out
}

/// The largest single allocation loading a directory of `file_bytes` may make: the f32 copy
/// of its largest tensor and its packed form are a small multiple of the file, and nothing
/// the files claim (lengths, shapes, layer counts) may cost more than they hold.
fn alloc_bound(file_bytes: usize) -> usize {
    (1 << 20) + 16 * file_bytes
}

/// Opens, checks and loads `dir` as the engine does; `Err` is the loader's error text.
fn load(dir: &Path) -> Result<(), String> {
    let model = ModelDir::open(dir).map_err(|e| e.to_string())?;
    let ckpt = Checkpoint::open(dir).map_err(|e| e.to_string())?;
    ckpt.check(&model.config).map_err(|e| e.to_string())?;
    CpuModel::load(&model).map_err(|e| e.to_string())?;
    Ok(())
}

/// Writes `files` into a fresh directory, loads it, and checks the outcome: no panic (the
/// property fails), an allocation within bounds, and an error that names one of the files.
fn check_dir(files: &[(&str, Vec<u8>)]) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let mut total = 0;
    for (name, bytes) in files {
        std::fs::write(dir.path().join(name), bytes).unwrap();
        total += bytes.len();
    }
    let _watch = fuzz::watch("model loader", &Files(files));
    let (result, largest) = fuzz::largest_allocation(|| load(dir.path()));
    prop_assert!(
        largest <= alloc_bound(total),
        "loading {total} bytes of files allocated {largest} bytes at once ({result:?})"
    );
    if let Err(e) = result {
        // Every path in an error is the file's full path, inside the directory.
        let dir = dir.path().to_string_lossy();
        prop_assert!(e.contains(dir.as_ref()), "the error names no file: {e}");
    }
    Ok(())
}

/// The files of a case as the watchdog prints them: names and (lossy) text.
struct Files<'a>(&'a [(&'a str, Vec<u8>)]);

impl std::fmt::Debug for Files<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut m = f.debug_map();
        for (name, bytes) in self.0 {
            m.entry(name, &String::from_utf8_lossy(bytes));
        }
        m.finish()
    }
}

/// Integers at the edges of every width the loader converts to, and small ones.
fn edge_int() -> impl Strategy<Value = Value> {
    prop_oneof![
        (0i64..70).prop_map(Value::from),
        prop::sample::select(vec![
            json!(-1),
            json!(i64::MIN),
            json!(u32::MAX),
            json!(u64::from(u32::MAX) + 1),
            json!(1u64 << 31),
            json!(1u64 << 40),
            json!(1u64 << 62),
            json!(u64::MAX),
            json!(usize::MAX / 2 + 1),
            json!(100_000),
            json!(1_000_000_000_000u64),
        ]),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
    ]
}

/// Arbitrary JSON: edge numbers, strings, and nested lists and objects.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        edge_int(),
        prop::sample::select(vec![
            0.0, -0.0, 1e-300, 1e300, -1e300, 0.5, -2.5, 3.4e38, 1e39
        ])
        .prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
        prop::sample::select(vec![
            "LlamaForCausalLM",
            "Qwen3ForCausalLM",
            "bfloat16",
            "float16",
            "float32",
            "llama3",
            "default",
            "silu",
            "gelu",
        ])
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// The keys the loader reads (and a few it does not).
const CONFIG_KEYS: &[&str] = &[
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
    "torch_dtype",
    "dtype",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "eos_token_id",
    "rope_scaling",
    "rope_parameters",
    "rope_theta",
    "model_type",
    "unknown_key",
];

/// Keys inside `rope_scaling` / `rope_parameters`.
const ROPE_KEYS: &[&str] = &[
    "rope_type",
    "type",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "rope_theta",
];

#[derive(Debug, Clone)]
enum ConfigEdit {
    Remove(usize),
    Set(usize, Value),
    /// An edge integer where the loader wants a size (the likeliest to pass validation).
    SetInt(usize, Value),
    SetRope(usize, Value),
    RemoveRope(usize),
}

fn config_edit() -> impl Strategy<Value = ConfigEdit> {
    let key = 0..CONFIG_KEYS.len();
    let rope = 0..ROPE_KEYS.len();
    prop_oneof![
        1 => key.clone().prop_map(ConfigEdit::Remove),
        2 => (key.clone(), any_json()).prop_map(|(k, v)| ConfigEdit::Set(k, v)),
        3 => (key, edge_int()).prop_map(|(k, v)| ConfigEdit::SetInt(k, v)),
        1 => (rope.clone(), any_json()).prop_map(|(k, v)| ConfigEdit::SetRope(k, v)),
        1 => rope.prop_map(ConfigEdit::RemoveRope),
    ]
}

fn edited_config(edits: &[ConfigEdit]) -> Value {
    let mut c = base_config();
    let obj = c.as_object_mut().unwrap();
    for e in edits {
        match e {
            ConfigEdit::Remove(k) => {
                obj.remove(CONFIG_KEYS[*k]);
            }
            ConfigEdit::Set(k, v) | ConfigEdit::SetInt(k, v) => {
                obj.insert(CONFIG_KEYS[*k].into(), v.clone());
            }
            ConfigEdit::SetRope(k, v) => {
                if let Some(Value::Object(r)) = obj.get_mut("rope_scaling") {
                    r.insert(ROPE_KEYS[*k].into(), v.clone());
                }
            }
            ConfigEdit::RemoveRope(k) => {
                if let Some(Value::Object(r)) = obj.get_mut("rope_scaling") {
                    r.remove(ROPE_KEYS[*k]);
                }
            }
        }
    }
    c
}

/// Byte-level damage to a file's text.
#[derive(Debug, Clone)]
enum ByteEdit {
    Set(usize, u8),
    Delete(usize, usize),
    Insert(usize, Vec<u8>),
    Truncate(usize),
}

fn byte_edit() -> impl Strategy<Value = ByteEdit> {
    prop_oneof![
        3 => (any::<usize>(), any::<u8>()).prop_map(|(p, b)| ByteEdit::Set(p, b)),
        1 => (any::<usize>(), 1usize..16).prop_map(|(p, n)| ByteEdit::Delete(p, n)),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(p, b)| ByteEdit::Insert(p, b)),
        1 => any::<usize>().prop_map(ByteEdit::Truncate),
    ]
}

fn apply_bytes(bytes: &mut Vec<u8>, edits: &[ByteEdit], within: usize) {
    for e in edits {
        let n = bytes.len().min(within.max(1));
        let at = |p: usize| if n == 0 { 0 } else { p % n };
        match e {
            ByteEdit::Set(p, b) => {
                if !bytes.is_empty() {
                    let i = at(*p);
                    bytes[i] = *b;
                }
            }
            ByteEdit::Delete(p, k) => {
                let i = at(*p);
                let end = (i + k).min(bytes.len());
                bytes.drain(i..end);
            }
            ByteEdit::Insert(p, b) => {
                let i = at(*p);
                bytes.splice(i..i, b.iter().copied());
            }
            ByteEdit::Truncate(p) => {
                let i = at(*p);
                bytes.truncate(i);
            }
        }
    }
}

/// An edit of one tensor's header entry (by index into the sorted names), or of the header.
#[derive(Debug, Clone)]
enum HeaderEdit {
    Dtype(usize, String),
    Shape(usize, Vec<usize>),
    Offsets(usize, Value),
    /// Offsets rewritten for every tensor so they chain and match each shape and dtype (what
    /// a well-formed but lying header looks like): the only way past the crate's validation.
    Rechain,
    /// The first `count` tensors claim `dim` bytes each (U8), the rest none; then rechained:
    /// ranges that together reach past the file, or past 2^64.
    Claim(usize, usize),
    /// The shape reversed ([out, in] -> [in, out]): well-formed, but not what the config says.
    Transpose(usize),
    Remove(usize),
    Rename(usize, String),
    Entry(usize, Value),
    Metadata(Value),
    /// The header length field, as it is written.
    Length(u64),
    /// Bytes appended to or cut from the data.
    DataLen(i64),
}

const DTYPES: &[&str] = &[
    "BF16", "F16", "F32", "F64", "I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64", "BOOL",
    "F4", "F6_E2M3", "F6_E3M2", "F8_E5M2", "F8_E4M3", "F8_E8M0", "C64", "bf16", "Q4", "",
];

fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => 0usize..40,
        1 => prop::sample::select(vec![
            1usize << 20,
            1 << 31,
            1 << 32,
            1 << 40,
            (1 << 61) - 1,
            1 << 61,
            1 << 62,
            usize::MAX / 2,
            usize::MAX / 4 + 1,
            usize::MAX / 8,
            usize::MAX,
        ]),
        1 => any::<usize>(),
    ]
}

fn header_edit() -> impl Strategy<Value = HeaderEdit> {
    let t = || any::<usize>();
    let offsets = prop_oneof![(dim(), dim()).prop_map(|(a, b)| json!([a, b])), any_json()];
    let name = prop_oneof![
        Just("lm_head.weight".to_string()),
        ".{0,20}".prop_map(String::from),
    ];
    let length = prop_oneof![
        prop::sample::select(vec![
            0u64,
            1,
            2,
            u64::MAX,
            1 << 63,
            100_000_000,
            100_000_001,
            u64::from(u32::MAX),
        ]),
        any::<u64>(),
        0u64..20_000,
    ];
    prop_oneof![
        2 => (t(), prop::sample::select(DTYPES).prop_map(String::from))
            .prop_map(|(i, d)| HeaderEdit::Dtype(i, d)),
        3 => (t(), prop::collection::vec(dim(), 0..4))
            .prop_map(|(i, s)| HeaderEdit::Shape(i, s)),
        2 => (t(), offsets).prop_map(|(i, o)| HeaderEdit::Offsets(i, o)),
        3 => Just(HeaderEdit::Rechain),
        1 => (0usize..24, dim()).prop_map(|(n, d)| HeaderEdit::Claim(n, d)),
        2 => t().prop_map(HeaderEdit::Transpose),
        1 => t().prop_map(HeaderEdit::Remove),
        1 => (t(), name).prop_map(|(i, n)| HeaderEdit::Rename(i, n)),
        1 => (t(), any_json()).prop_map(|(i, v)| HeaderEdit::Entry(i, v)),
        1 => any_json().prop_map(HeaderEdit::Metadata),
        2 => length.prop_map(HeaderEdit::Length),
        1 => (-64i64..64).prop_map(HeaderEdit::DataLen),
    ]
}

/// Bits per element of a dtype name (0 for unknown names).
fn bits(dtype: &str) -> usize {
    match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        "BF16" | "F16" | "I16" | "U16" => 16,
        "F32" | "I32" | "U32" => 32,
        "F64" | "I64" | "U64" | "C64" => 64,
        _ => 0,
    }
}

/// Sets `key` of the header entry `name` (replacing an entry that is not an object).
fn set_field(header: &mut Map<String, Value>, name: &str, key: &str, v: Value) {
    let entry = header.entry(name).or_insert_with(|| json!({}));
    if !entry.is_object() {
        *entry = json!({});
    }
    entry.as_object_mut().unwrap().insert(key.into(), v);
}

/// Rewrites every tensor's offsets so they chain in their current order and each range is
/// as long as its shape and dtype say (wrapping where the claims overflow).
fn rechain(header: &mut Map<String, Value>) {
    let mut sorted: Vec<(String, u64)> = header
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .map(|(k, v)| (k.clone(), v["data_offsets"][0].as_u64().unwrap_or(0)))
        .collect();
    sorted.sort_by_key(|&(_, s)| s);
    let mut at: usize = 0;
    for (n, _) in sorted {
        let entry = &header[&n];
        let numel = entry["shape"].as_array().map(|s| {
            s.iter()
                .map(|d| d.as_u64().unwrap_or(0) as usize)
                .fold(1usize, usize::wrapping_mul)
        });
        let b = entry["dtype"].as_str().map(bits).unwrap_or(0);
        let size = numel.unwrap_or(0).wrapping_mul(b) / 8;
        let end = at.wrapping_add(size);
        set_field(header, &n, "data_offsets", json!([at, end]));
        at = end;
    }
}

/// The safetensors file of `edits` applied to the tiny model's.
fn edited_safetensors(edits: &[HeaderEdit]) -> Vec<u8> {
    let (mut header, mut data) = base_checkpoint();
    let mut length = None;
    for e in edits {
        let names: Vec<String> = header.keys().cloned().collect();
        let name = |i: &usize| names.get(i % names.len().max(1)).cloned();
        match e {
            HeaderEdit::Dtype(i, d) => {
                if let Some(n) = name(i) {
                    set_field(&mut header, &n, "dtype", json!(d));
                }
            }
            HeaderEdit::Shape(i, s) => {
                if let Some(n) = name(i) {
                    set_field(&mut header, &n, "shape", json!(s));
                }
            }
            HeaderEdit::Offsets(i, o) => {
                if let Some(n) = name(i) {
                    set_field(&mut header, &n, "data_offsets", o.clone());
                }
            }
            HeaderEdit::Rechain => rechain(&mut header),
            HeaderEdit::Claim(count, dim) => {
                for (i, n) in names.iter().enumerate() {
                    let shape = if i < *count { *dim } else { 0 };
                    set_field(&mut header, n, "dtype", json!("U8"));
                    set_field(&mut header, n, "shape", json!([shape]));
                }
                rechain(&mut header);
            }
            HeaderEdit::Transpose(i) => {
                if let Some(n) = name(i) {
                    if let Some(shape) = header[&n]["shape"].as_array() {
                        let reversed: Vec<Value> = shape.iter().rev().cloned().collect();
                        set_field(&mut header, &n, "shape", Value::from(reversed));
                    }
                }
            }
            HeaderEdit::Remove(i) => {
                if let Some(n) = name(i) {
                    header.remove(&n);
                }
            }
            HeaderEdit::Rename(i, new) => {
                if let Some(n) = name(i) {
                    if let Some(v) = header.remove(&n) {
                        header.insert(new.clone(), v);
                    }
                }
            }
            HeaderEdit::Entry(i, v) => {
                if let Some(n) = name(i) {
                    header[&n] = v.clone();
                }
            }
            HeaderEdit::Metadata(v) => {
                header.insert("__metadata__".into(), v.clone());
            }
            HeaderEdit::Length(l) => length = Some(*l),
            HeaderEdit::DataLen(d) => {
                if *d >= 0 {
                    data.extend(std::iter::repeat_n(0x3f, *d as usize));
                } else {
                    data.truncate(data.len().saturating_sub(d.unsigned_abs() as usize));
                }
            }
        }
    }
    let mut bytes = safetensors_bytes(&header, &data);
    if let Some(l) = length {
        bytes[..8].copy_from_slice(&l.to_le_bytes());
    }
    bytes
}

fn generation_config() -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        2 => Just(None),
        1 => Just(Some(json!({"eos_token_id": [1, 2]}))),
        2 => prop_oneof![edge_int(), any_json()].prop_map(|v| Some(json!({"eos_token_id": v}))),
        1 => any_json().prop_map(Some),
    ]
}

proptest! {
    #![proptest_config(fuzz::config(512))]

    /// A Gemma 3 config.json with its keys removed or replaced (the per-type RoPE objects
    /// too), over the tiny Gemma's valid weights.
    #[test]
    fn fuzz_gemma3_config_fields(
        edits in prop::collection::vec(
            (0..GEMMA_KEYS.len(), prop_oneof![Just(None), any_json().prop_map(Some), edge_int().prop_map(Some)]),
            1..5,
        ),
        rope in prop::option::of((prop::sample::select(vec!["full_attention", "sliding_attention"]),
                                  0..ROPE_KEYS.len(), any_json())),
    ) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), gemma_config().to_string()).unwrap();
        let c = ModelDir::open(dir.path()).unwrap().config;
        let (header, data) = checkpoint_for(&c);
        let mut cfg = gemma_config();
        let obj = cfg.as_object_mut().unwrap();
        for (k, v) in &edits {
            match v {
                None => obj.remove(GEMMA_KEYS[*k]),
                Some(v) => obj.insert(GEMMA_KEYS[*k].into(), v.clone()),
            };
        }
        if let Some((kind, key, v)) = rope {
            if let Some(Value::Object(r)) = obj.get_mut("rope_parameters").and_then(|p| p.get_mut(kind)) {
                r.insert(ROPE_KEYS[key].into(), v);
            }
        }
        check_dir(&[
            ("config.json", cfg.to_string().into_bytes()),
            ("model.safetensors", safetensors_bytes(&header, &data)),
        ])?;
    }
}

proptest! {
    #![proptest_config(fuzz::config(1024))]

    /// config.json with fields removed or replaced, over the tiny model's valid weights.
    #[test]
    fn fuzz_config_json_fields(
        edits in prop::collection::vec(config_edit(), 1..5),
        gen in generation_config(),
    ) {
        let (header, data) = base_checkpoint();
        let mut files = vec![
            ("config.json", edited_config(&edits).to_string().into_bytes()),
            ("model.safetensors", safetensors_bytes(&header, &data)),
        ];
        if let Some(g) = gen {
            files.push(("generation_config.json", g.to_string().into_bytes()));
        }
        check_dir(&files)?;
    }

    /// config.json and generation_config.json with damaged bytes.
    #[test]
    fn fuzz_config_json_bytes(
        edits in prop::collection::vec(byte_edit(), 1..6),
        which in 0usize..2,
    ) {
        let (header, data) = base_checkpoint();
        let mut config = base_config().to_string().into_bytes();
        let mut gen = br#"{"eos_token_id": [1, 2], "bos_token_id": 0}"#.to_vec();
        let target = if which == 0 { &mut config } else { &mut gen };
        apply_bytes(target, &edits, usize::MAX);
        check_dir(&[
            ("config.json", config),
            ("generation_config.json", gen),
            ("model.safetensors", safetensors_bytes(&header, &data)),
        ])?;
    }

    /// The safetensors header: dtypes, shapes, offsets, names, length field, data length.
    /// Half the cases end with the offsets rechained to match the edited shapes and dtypes,
    /// so that they get past the safetensors crate's own checks to the loader's.
    #[test]
    fn fuzz_safetensors_header(
        mut edits in prop::collection::vec(header_edit(), 1..5),
        rechain in any::<bool>(),
    ) {
        if rechain {
            edits.push(HeaderEdit::Rechain);
        }
        check_dir(&[
            ("config.json", base_config().to_string().into_bytes()),
            ("model.safetensors", edited_safetensors(&edits)),
        ])?;
    }

    /// Raw bytes of the safetensors header region (and the length field before it).
    #[test]
    fn fuzz_safetensors_bytes(edits in prop::collection::vec(byte_edit(), 1..6)) {
        let (header, data) = base_checkpoint();
        let mut bytes = safetensors_bytes(&header, &data);
        let header_end = bytes.len() - data.len();
        apply_bytes(&mut bytes, &edits, header_end);
        check_dir(&[
            ("config.json", base_config().to_string().into_bytes()),
            ("model.safetensors", bytes),
        ])?;
    }

    /// A sharded checkpoint: the index's weight map and the shards' headers mutated.
    #[test]
    fn fuzz_sharded_index(
        map_edits in prop::collection::vec(
            (any::<usize>(), prop_oneof![
                6 => prop::sample::select(vec![
                    "model-00001-of-00002.safetensors",
                    "model-00002-of-00002.safetensors",
                    "missing.safetensors",
                    "../config.json",
                    ".hidden",
                    "config.json",
                    "",
                ]).prop_map(Value::from),
                1 => any_json(),
            ]),
            0..4,
        ),
        index_root in prop_oneof![4 => Just(None), 1 => any_json().prop_map(Some)],
        shard_edits in prop::collection::vec(header_edit(), 0..3),
    ) {
        let (header, data) = base_checkpoint();
        // Split at the second tensor: shard 1 holds the first, shard 2 the rest.
        let names: Vec<String> = header.keys().cloned().collect();
        let mut first = Map::new();
        first.insert(names[0].clone(), header[&names[0]].clone());
        let end = header[&names[0]]["data_offsets"][1].as_u64().unwrap() as usize;
        let mut rest = Map::new();
        for n in &names[1..] {
            let mut v = header[n].clone();
            let (s, e) = (v["data_offsets"][0].as_u64().unwrap(), v["data_offsets"][1].as_u64().unwrap());
            v["data_offsets"] = json!([s - end as u64, e - end as u64]);
            rest.insert(n.clone(), v);
        }
        let shard1 = safetensors_bytes(&first, &data[..end]);
        let shard2 = if shard_edits.is_empty() {
            safetensors_bytes(&rest, &data[end..])
        } else {
            edited_safetensors(&shard_edits)
        };
        let mut weight_map: Map<String, Value> = names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let shard = if i == 0 { 1 } else { 2 };
                (n.clone(), json!(format!("model-0000{shard}-of-00002.safetensors")))
            })
            .collect();
        for (i, v) in &map_edits {
            let n = names[i % names.len()].clone();
            weight_map.insert(n, v.clone());
        }
        let index = index_root.unwrap_or_else(|| json!({"metadata": {}, "weight_map": weight_map}));
        check_dir(&[
            ("config.json", base_config().to_string().into_bytes()),
            ("model.safetensors.index.json", index.to_string().into_bytes()),
            ("model-00001-of-00002.safetensors", shard1),
            ("model-00002-of-00002.safetensors", shard2),
        ])?;
    }
}

/// One tensor of a constructed checkpoint: name, safetensors dtype name, shape, bytes.
type RawTensor = (String, &'static str, Vec<usize>, Vec<u8>);

/// The tiny Llama as an FP8 checkpoint (compressed-tensors, per channel): every projection in
/// F8_E4M3 with an f32 `[n, 1]` scale, the rest in bf16.
fn fp8_tensors() -> Vec<RawTensor> {
    let c = base_model_config();
    let mut out = Vec::new();
    for (name, shape) in expected_tensors(&c) {
        let n: usize = shape.iter().product();
        let projection = shape.len() == 2 && name.starts_with("model.layers.");
        if projection {
            let q = (0..n)
                .map(|i| super::fp8::encode((i % 9) as f32 - 4.0))
                .collect();
            out.push((name.clone(), "F8_E4M3", shape.clone(), q));
            let module = name.strip_suffix(".weight").unwrap();
            let scales = (0..shape[0]).flat_map(|_| 0.01f32.to_le_bytes()).collect();
            out.push((
                format!("{module}.weight_scale"),
                "F32",
                vec![shape[0], 1],
                scales,
            ));
        } else {
            let v = (0..n)
                .flat_map(|i| half::bf16::from_f32(((i % 7) as f32 - 3.0) / 8.0).to_le_bytes())
                .collect();
            out.push((name, "BF16", shape, v));
        }
    }
    out
}

/// A safetensors file of `tensors`, offsets chained.
fn raw_safetensors(tensors: &[RawTensor]) -> Vec<u8> {
    let (mut header, mut data) = (Map::new(), Vec::new());
    for (name, dtype, shape, bytes) in tensors {
        let start = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            name.clone(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    safetensors_bytes(&header, &data)
}

/// What an FP8 case changes: `quantization_config` keys and its weights' keys, and scale
/// tensors (shape and contents consistent for the safetensors crate, so the loader's own
/// checks see them), dropped scales, projections stored as bf16 or scales as other dtypes.
#[derive(Debug, Clone)]
enum Fp8Edit {
    Quant(usize, Option<Value>),
    Weights(usize, Option<Value>),
    ScaleShape(usize, Vec<usize>, f32),
    ScaleDtype(usize, &'static str),
    DropScale(usize),
}

const QUANT_KEYS: &[&str] = &[
    "quant_method",
    "format",
    "config_groups",
    "weight_block_size",
];
const WEIGHT_KEYS: &[&str] = &[
    "num_bits",
    "type",
    "strategy",
    "block_structure",
    "symmetric",
];

fn fp8_edit() -> impl Strategy<Value = Fp8Edit> {
    let value = || {
        prop_oneof![
            1 => Just(None),
            2 => prop::sample::select(vec![
                json!("compressed-tensors"), json!("fp8"), json!("fbgemm_fp8"), json!("awq"),
                json!("channel"), json!("tensor"), json!("block"), json!("group"),
                json!("float"), json!("int"), json!(8), json!(4), json!([1, 1]), json!([2, 4]),
                json!([8, 8]), json!([0, 4]), json!([u64::MAX, 1]), json!([3]),
            ]).prop_map(Some),
            1 => any_json().prop_map(Some),
            1 => edge_int().prop_map(Some),
        ]
    };
    let shape = prop_oneof![
        prop::collection::vec(0usize..20, 0..3),
        prop::sample::select(vec![
            vec![],
            vec![1],
            vec![16, 1],
            vec![8, 1],
            vec![16],
            vec![2, 1],
            vec![4, 2],
            vec![2, 2],
            vec![16, 8],
            vec![1, 1, 1]
        ]),
    ];
    let scale = prop::sample::select(vec![
        0.01f32,
        0.0,
        -1.0,
        f32::NAN,
        f32::INFINITY,
        1e38,
        1e-45,
    ]);
    prop_oneof![
        2 => (0..QUANT_KEYS.len(), value()).prop_map(|(k, v)| Fp8Edit::Quant(k, v)),
        2 => (0..WEIGHT_KEYS.len(), value()).prop_map(|(k, v)| Fp8Edit::Weights(k, v)),
        3 => (any::<usize>(), shape, scale).prop_map(|(i, s, v)| Fp8Edit::ScaleShape(i, s, v)),
        1 => (any::<usize>(), prop::sample::select(vec!["BF16", "F16", "F8_E4M3", "I32", "F64"]))
            .prop_map(|(i, d)| Fp8Edit::ScaleDtype(i, d)),
        1 => any::<usize>().prop_map(Fp8Edit::DropScale),
    ]
}

proptest! {
    #![proptest_config(fuzz::config(512))]

    /// FP8 checkpoints: `quantization_config` and its weights' fields replaced or removed,
    /// scale tensors reshaped (to channel, tensor, block and nonsense shapes), refilled with
    /// zeros, NaN, infinities, retyped or dropped.
    #[test]
    fn fuzz_fp8_checkpoints(edits in prop::collection::vec(fp8_edit(), 1..5)) {
        let mut config = base_config();
        config["quantization_config"] = crate::quantize::compressed_tensors_config(false);
        let mut tensors = fp8_tensors();
        let scales: Vec<usize> = (0..tensors.len())
            .filter(|&i| tensors[i].0.ends_with("weight_scale"))
            .collect();
        let mut dropped = Vec::new();
        for e in &edits {
            let q = config["quantization_config"].as_object_mut().unwrap();
            match e {
                Fp8Edit::Quant(k, v) => match v {
                    None => { q.remove(QUANT_KEYS[*k]); }
                    Some(v) => { q.insert(QUANT_KEYS[*k].into(), v.clone()); }
                },
                Fp8Edit::Weights(k, v) => {
                    if let Some(Value::Object(w)) = q
                        .get_mut("config_groups")
                        .and_then(|g| g.get_mut("group_0"))
                        .and_then(|g| g.get_mut("weights"))
                    {
                        match v {
                            None => { w.remove(WEIGHT_KEYS[*k]); }
                            Some(v) => { w.insert(WEIGHT_KEYS[*k].into(), v.clone()); }
                        }
                    }
                }
                Fp8Edit::ScaleShape(i, shape, v) => {
                    let t = &mut tensors[scales[i % scales.len()]];
                    let n: usize = shape.iter().product();
                    t.1 = "F32";
                    t.2 = shape.clone();
                    t.3 = (0..n).flat_map(|_| v.to_le_bytes()).collect();
                }
                Fp8Edit::ScaleDtype(i, d) => {
                    let t = &mut tensors[scales[i % scales.len()]];
                    let n: usize = t.2.iter().product();
                    let size = match *d { "F8_E4M3" => 1, "BF16" | "F16" => 2, "F64" => 8, _ => 4 };
                    t.1 = d;
                    t.3 = vec![0x3c; n * size];
                }
                Fp8Edit::DropScale(i) => dropped.push(scales[i % scales.len()]),
            }
        }
        let kept: Vec<RawTensor> = tensors
            .into_iter()
            .enumerate()
            .filter(|(i, _)| !dropped.contains(i))
            .map(|(_, t)| t)
            .collect();
        check_dir(&[
            ("config.json", config.to_string().into_bytes()),
            ("model.safetensors", raw_safetensors(&kept)),
        ])?;
    }
}

/// The harness's starting points load: the mutations start from a valid directory.
#[test]
fn fuzz_base_model_loads() {
    let (header, data) = base_checkpoint();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), base_config().to_string()).unwrap();
    std::fs::write(
        dir.path().join("model.safetensors"),
        safetensors_bytes(&header, &data),
    )
    .unwrap();
    load(dir.path()).unwrap();
    assert_eq!(edited_safetensors(&[HeaderEdit::Rechain]), {
        safetensors_bytes(&header, &data)
    });
    // The FP8 starting point loads with its projections in FP8.
    let mut config = base_config();
    config["quantization_config"] = crate::quantize::compressed_tensors_config(false);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    std::fs::write(
        dir.path().join("model.safetensors"),
        raw_safetensors(&fp8_tensors()),
    )
    .unwrap();
    load(dir.path()).unwrap();
    let md = ModelDir::open(dir.path()).unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let w = ckpt
        .weight(
            &LayerTensor::DownProj.name(1),
            &LayerTensor::DownProj.shape(&md.config),
            md.config.fp8.as_ref(),
        )
        .unwrap();
    assert!(matches!(w, WeightRef::Fp8 { .. }));
}
