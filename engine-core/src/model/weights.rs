//! Safetensors checkpoints: memory-mapped, checked tensor by tensor, converted to f32.
//!
//! A model directory holds either `model.safetensors` or shards listed by
//! `model.safetensors.index.json` (`{"weight_map": {tensor name: shard file}}`). Each file is
//! mapped read-only; its header is parsed and validated by the `safetensors` crate; tensors are
//! then looked up by name and checked against the shape the config implies
//! ([`expected_tensors`]) before any byte is converted.
//!
//! Backends other than the CPU one can use [`Checkpoint::get`] to reach the raw bytes (e.g. to
//! upload bf16 as is).

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::{Dtype, SafeTensors};

use super::config::{Architecture, ModelConfig, ModelError, WeightDtype};
use super::fp8::{self, Fp8Checkpoint, ScaleLayout};

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Role of a tensor in a decoder layer (or the model), to build names from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerTensor {
    InputNorm,
    QProj,
    KProj,
    VProj,
    OProj,
    QNorm,
    KNorm,
    /// `post_attention_layernorm`: the MLP input norm of Llama and Qwen3, the attention
    /// output norm of Gemma 3.
    PostNorm,
    /// Gemma 3's MLP input norm.
    PreFfNorm,
    /// Gemma 3's MLP output norm.
    PostFfNorm,
    GateProj,
    UpProj,
    DownProj,
}

impl LayerTensor {
    fn suffix(self) -> &'static str {
        match self {
            LayerTensor::InputNorm => "input_layernorm.weight",
            LayerTensor::QProj => "self_attn.q_proj.weight",
            LayerTensor::KProj => "self_attn.k_proj.weight",
            LayerTensor::VProj => "self_attn.v_proj.weight",
            LayerTensor::OProj => "self_attn.o_proj.weight",
            LayerTensor::QNorm => "self_attn.q_norm.weight",
            LayerTensor::KNorm => "self_attn.k_norm.weight",
            LayerTensor::PostNorm => "post_attention_layernorm.weight",
            LayerTensor::PreFfNorm => "pre_feedforward_layernorm.weight",
            LayerTensor::PostFfNorm => "post_feedforward_layernorm.weight",
            LayerTensor::GateProj => "mlp.gate_proj.weight",
            LayerTensor::UpProj => "mlp.up_proj.weight",
            LayerTensor::DownProj => "mlp.down_proj.weight",
        }
    }
    /// Hugging Face name of this tensor in layer `layer`.
    pub fn name(self, layer: usize) -> String {
        format!("model.layers.{layer}.{}", self.suffix())
    }
    /// Shape `[rows, cols]` (or `[len]` for norms) under `c`.
    pub fn shape(self, c: &ModelConfig) -> Vec<usize> {
        let (h, q, kv, i) = (
            c.hidden_size,
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
            c.intermediate_size,
        );
        match self {
            LayerTensor::InputNorm
            | LayerTensor::PostNorm
            | LayerTensor::PreFfNorm
            | LayerTensor::PostFfNorm => vec![h],
            LayerTensor::QProj => vec![q, h],
            LayerTensor::KProj | LayerTensor::VProj => vec![kv, h],
            LayerTensor::OProj => vec![h, q],
            LayerTensor::QNorm | LayerTensor::KNorm => vec![c.head_dim],
            LayerTensor::GateProj | LayerTensor::UpProj => vec![i, h],
            LayerTensor::DownProj => vec![h, i],
        }
    }
    /// The tensors of one layer of `arch`, in checkpoint order.
    pub fn all(arch: Architecture) -> &'static [LayerTensor] {
        use LayerTensor::*;
        match arch {
            Architecture::Llama => &[
                InputNorm, QProj, KProj, VProj, OProj, PostNorm, GateProj, UpProj, DownProj,
            ],
            Architecture::Qwen3 => &[
                InputNorm, QProj, KProj, VProj, OProj, QNorm, KNorm, PostNorm, GateProj, UpProj,
                DownProj,
            ],
            Architecture::Gemma3 => &[
                InputNorm, QProj, KProj, VProj, OProj, QNorm, KNorm, PostNorm, PreFfNorm,
                PostFfNorm, GateProj, UpProj, DownProj,
            ],
        }
    }
    /// Norm weights (1-D) as opposed to projection matrices.
    pub fn is_norm(self) -> bool {
        matches!(
            self,
            LayerTensor::InputNorm
                | LayerTensor::PostNorm
                | LayerTensor::PreFfNorm
                | LayerTensor::PostFfNorm
                | LayerTensor::QNorm
                | LayerTensor::KNorm
        )
    }
}

pub const EMBED: &str = "model.embed_tokens.weight";
pub const FINAL_NORM: &str = "model.norm.weight";
pub const LM_HEAD: &str = "lm_head.weight";

/// Every tensor a checkpoint of `config` must hold, with its shape, in checkpoint order
/// (embedding, layers, final norm, then `lm_head` unless the embeddings are tied).
pub fn expected_tensors(config: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    expected_tensor_iter(config).collect()
}

/// [`expected_tensors`] one at a time: a check that stops at the first missing tensor costs
/// nothing for the layers a config claims and the checkpoint lacks.
fn expected_tensor_iter(config: &ModelConfig) -> impl Iterator<Item = (String, Vec<usize>)> + '_ {
    let embed = (
        EMBED.to_string(),
        vec![config.vocab_size, config.hidden_size],
    );
    let layers = (0..config.num_layers).flat_map(move |layer| {
        LayerTensor::all(config.architecture)
            .iter()
            .map(move |&t| (t.name(layer), t.shape(config)))
    });
    let lm_head = (!config.tie_word_embeddings).then(|| {
        (
            LM_HEAD.to_string(),
            vec![config.vocab_size, config.hidden_size],
        )
    });
    std::iter::once(embed)
        .chain(layers)
        .chain(std::iter::once((
            FINAL_NORM.to_string(),
            vec![config.hidden_size],
        )))
        .chain(lm_head)
}

/// One stored tensor: its raw little-endian bytes and where it came from.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub file: &'a Path,
    pub dtype: WeightDtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

impl TensorRef<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Converts into `out` (exactly `numel` long), in parallel for large tensors.
    pub fn write_f32(&self, out: &mut [f32]) {
        assert_eq!(out.len(), self.numel(), "write_f32: output length");
        const CHUNK: usize = 1 << 16;
        let size = self.dtype.size_bytes();
        let convert = |(dst, src): (&mut [f32], &[u8])| match self.dtype {
            WeightDtype::F32 => {
                for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                    *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                }
            }
            WeightDtype::Bf16 => {
                for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                    *d = bf16::from_le_bytes([s[0], s[1]]).to_f32();
                }
            }
            WeightDtype::F16 => {
                for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                    *d = f16::from_le_bytes([s[0], s[1]]).to_f32();
                }
            }
        };
        if out.len() <= CHUNK {
            convert((out, self.bytes));
        } else {
            out.par_chunks_mut(CHUNK)
                .zip(self.bytes.par_chunks(CHUNK * size))
                .for_each(convert);
        }
    }

    pub fn to_f32(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.numel()];
        self.write_f32(&mut v);
        v
    }
}

/// A weight as its checkpoint stores it.
#[derive(Debug)]
pub enum WeightRef<'a> {
    /// f32, f16 or bf16 values.
    Float(TensorRef<'a>),
    /// e4m3 values of a `[n, k]` matrix and their scales (see [`fp8::dequantize`]).
    Fp8 {
        q: &'a [u8],
        scales: Vec<f32>,
        layout: ScaleLayout,
        k: usize,
    },
}

impl WeightRef<'_> {
    pub fn numel(&self) -> usize {
        match self {
            WeightRef::Float(t) => t.numel(),
            WeightRef::Fp8 { q, .. } => q.len(),
        }
    }

    /// Converts (FP8: dequantizes) into `out`, exactly `numel` long.
    pub fn write_f32(&self, out: &mut [f32]) {
        match self {
            WeightRef::Float(t) => t.write_f32(out),
            WeightRef::Fp8 {
                q,
                scales,
                layout,
                k,
            } => fp8::dequantize(q, scales, *layout, *k, out),
        }
    }

    pub fn to_f32(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.numel()];
        self.write_f32(&mut v);
        v
    }
}

/// How a tensor the loader can read is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stored {
    Float(WeightDtype),
    /// e4m3: read through [`Checkpoint::weight`] with its scale.
    F8E4M3,
}

/// A stored tensor, its shape checked: what [`Checkpoint::get`] and [`Checkpoint::weight`]
/// read.
struct Raw<'a> {
    name: &'a str,
    file: &'a Path,
    dtype: Stored,
    shape: &'a [usize],
    bytes: &'a [u8],
}

impl<'a> Raw<'a> {
    fn float(self, dtype: WeightDtype) -> TensorRef<'a> {
        TensorRef {
            name: self.name,
            file: self.file,
            dtype,
            shape: self.shape,
            bytes: self.bytes,
        }
    }
}

enum Entry {
    Stored {
        file: usize,
        dtype: Stored,
        shape: Vec<usize>,
        start: usize,
        end: usize,
    },
    /// Stored in a dtype we do not convert (an error only if the model needs it).
    BadDtype { file: usize, dtype: String },
    /// Listed by the index but absent from its shard.
    NotInShard { file: usize },
}

/// The memory-mapped safetensors files of one model directory.
pub struct Checkpoint {
    files: Vec<(PathBuf, Mmap)>,
    entries: HashMap<String, Entry>,
    /// The file to name when a tensor is absent: the index, or the single file.
    listing: PathBuf,
}

impl Checkpoint {
    /// Maps `model.safetensors`, or every shard named by `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Checkpoint, ModelError> {
        let index_path = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        let (listing, shard_names, weight_map) = if index_path.is_file() {
            let (names, map) = read_index(&index_path)?;
            (index_path, names, Some(map))
        } else if single.is_file() {
            (single, vec![SINGLE_FILE.to_string()], None)
        } else {
            return Err(ModelError::MissingFile { path: single });
        };
        let mut files = Vec::with_capacity(shard_names.len());
        let mut entries = HashMap::new();
        for (file_idx, shard) in shard_names.iter().enumerate() {
            let path = dir.join(shard);
            let mmap = map_file(&path)?;
            let st_err = |problem: String| ModelError::Safetensors {
                path: path.clone(),
                problem,
            };
            check_data_offsets(&mmap).map_err(st_err)?;
            let (n, metadata) = SafeTensors::read_metadata(&mmap)
                .map_err(|e| st_err(format!("bad safetensors header: {e}")))?;
            let base = 8 + n;
            for (name, info) in metadata.tensors() {
                if let Some(map) = &weight_map {
                    // The index decides which shard owns a tensor; ignore strays.
                    if map.get(&name).map(String::as_str) != Some(shard.as_str()) {
                        continue;
                    }
                }
                let dtype = match info.dtype {
                    Dtype::F32 => Some(Stored::Float(WeightDtype::F32)),
                    Dtype::F16 => Some(Stored::Float(WeightDtype::F16)),
                    Dtype::BF16 => Some(Stored::Float(WeightDtype::Bf16)),
                    Dtype::F8_E4M3 => Some(Stored::F8E4M3),
                    _ => None,
                };
                let (start, end) = info.data_offsets;
                let entry = match dtype {
                    Some(dtype) => Entry::Stored {
                        file: file_idx,
                        dtype,
                        shape: info.shape.clone(),
                        start: base + start,
                        end: base + end,
                    },
                    None => Entry::BadDtype {
                        file: file_idx,
                        dtype: format!("{:?}", info.dtype),
                    },
                };
                entries.insert(name, entry);
            }
            files.push((path, mmap));
        }
        if let Some(map) = &weight_map {
            // A tensor the index promises but its shard lacks: name the shard.
            for (name, shard) in map {
                if !entries.contains_key(name) {
                    let file = shard_names.iter().position(|s| s == shard).unwrap_or(0);
                    entries.insert(name.clone(), Entry::NotInShard { file });
                }
            }
        }
        Ok(Checkpoint {
            files,
            entries,
            listing,
        })
    }

    /// The float tensor `name`, checked to have exactly `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<TensorRef<'_>, ModelError> {
        self.lookup(name, Some(shape))
    }

    /// The weight `name` of `shape` as stored: floats, or (FP8 checkpoints, declared by
    /// `fp8`) e4m3 values with their scales, whose layout is checked against `shape`.
    pub fn weight(
        &self,
        name: &str,
        shape: &[usize],
        fp8: Option<&Fp8Checkpoint>,
    ) -> Result<WeightRef<'_>, ModelError> {
        let raw = self.raw(name, Some(shape))?;
        if let Stored::Float(dtype) = raw.dtype {
            return Ok(WeightRef::Float(raw.float(dtype)));
        }
        let (name, path) = (raw.name, raw.file);
        let bad = |problem: String| ModelError::Safetensors {
            path: path.to_path_buf(),
            problem,
        };
        let Some(fp8) = fp8 else {
            return Err(bad(format!(
                "tensor `{name}` is F8_E4M3 but config.json declares no FP8 quantization_config"
            )));
        };
        let &[n, k] = shape else {
            return Err(bad(format!(
                "tensor `{name}` is F8_E4M3 but only matrices are stored in FP8"
            )));
        };
        let scale_name = fp8.scale_name(name);
        let scale = self.lookup(&scale_name, None)?;
        let layout = fp8.layout((n, k), scale.shape).map_err(|e| {
            bad(format!(
                "tensor `{scale_name}` ({} checkpoint): {e}",
                fp8.method
            ))
        })?;
        let scales = scale.to_f32();
        if let Some(s) = scales.iter().find(|s| !s.is_finite()) {
            return Err(bad(format!("tensor `{scale_name}` holds the scale {s}")));
        }
        Ok(WeightRef::Fp8 {
            q: raw.bytes,
            scales,
            layout,
            k,
        })
    }

    /// The float tensor `name`, checked to have `shape` when given.
    fn lookup(&self, name: &str, shape: Option<&[usize]>) -> Result<TensorRef<'_>, ModelError> {
        let raw = self.raw(name, shape)?;
        match raw.dtype {
            Stored::Float(dtype) => Ok(raw.float(dtype)),
            Stored::F8E4M3 => Err(ModelError::Dtype {
                name: raw.name.to_string(),
                file: raw.file.to_path_buf(),
                dtype: "F8_E4M3".into(),
            }),
        }
    }

    /// The stored tensor `name`, checked to have `shape` when given.
    fn raw(&self, name: &str, shape: Option<&[usize]>) -> Result<Raw<'_>, ModelError> {
        let (name, entry) =
            self.entries
                .get_key_value(name)
                .ok_or_else(|| ModelError::MissingTensor {
                    name: name.to_string(),
                    file: self.listing.clone(),
                })?;
        match entry {
            Entry::BadDtype { file, dtype } => Err(ModelError::Dtype {
                name: name.clone(),
                file: self.files[*file].0.clone(),
                dtype: dtype.clone(),
            }),
            Entry::NotInShard { file } => Err(ModelError::MissingTensor {
                name: name.clone(),
                file: self.files[*file].0.clone(),
            }),
            Entry::Stored {
                file,
                dtype,
                shape: found,
                start,
                end,
            } => {
                let (path, mmap) = &self.files[*file];
                if let Some(shape) = shape.filter(|&shape| found != shape) {
                    return Err(ModelError::Shape {
                        name: name.clone(),
                        file: path.clone(),
                        expected: shape.to_vec(),
                        found: found.clone(),
                    });
                }
                Ok(Raw {
                    name,
                    file: path,
                    dtype: *dtype,
                    shape: found,
                    bytes: &mmap[*start..*end],
                })
            }
        }
    }

    /// Checks every tensor `config` needs is present with the right shape, stopping at the
    /// first that is not (a config claiming a trillion layers fails at the first missing one).
    pub fn check(&self, config: &ModelConfig) -> Result<(), ModelError> {
        for (name, shape) in expected_tensor_iter(config) {
            self.weight(&name, &shape, config.fp8.as_ref())?;
        }
        Ok(())
    }
}

/// The safetensors crate's header limit (larger headers are its error to report).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Checks that every tensor's byte range ends inside the file's data section, before the
/// safetensors crate reads the header: safetensors 0.8 adds the ranges up unchecked
/// (`buffer_end + 8 + n`), so a header whose ranges chain up to 2^64 panics in builds with
/// overflow checks (found by the loader fuzz harness). The error also names the tensor, which
/// the crate's `MetadataIncompleteBuffer` does not. Headers this cannot read are left to the
/// crate to reject.
pub(crate) fn check_data_offsets(file: &[u8]) -> Result<(), String> {
    let Some(len) = file.get(..8) else {
        return Ok(());
    };
    let n = u64::from_le_bytes(len.try_into().expect("8 bytes"));
    if n > MAX_HEADER_BYTES {
        return Ok(());
    }
    let header_end = 8 + n as usize;
    let Some(header) = file.get(8..header_end) else {
        return Ok(());
    };
    let data_len = (file.len() - header_end) as u64;
    let Ok(entries) = serde_json::from_slice::<HashMap<String, serde_json::Value>>(header) else {
        return Ok(());
    };
    for (name, info) in &entries {
        if name == "__metadata__" {
            continue;
        }
        if let Some(end) = info["data_offsets"][1].as_u64() {
            if end > data_len {
                return Err(format!(
                    "bad safetensors header: tensor `{name}` ends at byte {end} of a \
                     {data_len}-byte data section (a truncated or damaged file)"
                ));
            }
        }
    }
    Ok(())
}

fn map_file(path: &Path) -> Result<Mmap, ModelError> {
    let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
    // SAFETY: the map is read-only and private to this process. Another process truncating or
    // rewriting a checkpoint while it is loaded is outside what we can guard against (every
    // mmap-based loader, transformers' included, shares this caveat).
    unsafe { Mmap::map(&file) }.map_err(|e| ModelError::Io {
        path: path.to_path_buf(),
        source: e,
    })
}

/// The shard file names (sorted) and the name -> shard map of an index.
fn read_index(path: &Path) -> Result<(Vec<String>, HashMap<String, String>), ModelError> {
    let bytes = std::fs::read(path).map_err(|e| ModelError::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| ModelError::Json {
            path: path.to_path_buf(),
            source: e,
        })?;
    let bad = |problem: &str| ModelError::Field {
        path: path.to_path_buf(),
        field: "weight_map".into(),
        problem: problem.into(),
    };
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("missing or not an object"))?;
    let mut shards: Vec<String> = Vec::new();
    let mut out = HashMap::with_capacity(map.len());
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad("values must be file names"))?;
        if file.is_empty() || file.contains('/') || file.contains('\\') || file.starts_with('.') {
            return Err(bad(&format!(
                "shard name {file:?} must be a plain file name"
            )));
        }
        if !shards.iter().any(|s| s == file) {
            shards.push(file.to_string());
        }
        out.insert(name.clone(), file.to_string());
    }
    shards.sort();
    Ok((shards, out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelDir;

    /// A directory holding a 2-layer Llama (hidden 8, vocabulary 32) in bf16 zeros.
    fn tiny_dir() -> (tempfile::TempDir, ModelConfig) {
        let dir = tempfile::tempdir().unwrap();
        let config = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "vocab_size": 32,
            "tie_word_embeddings": true
        });
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        let config = ModelDir::open(dir.path()).unwrap().config;
        let mut header = serde_json::Map::new();
        let mut len = 0;
        for (name, shape) in expected_tensors(&config) {
            let bytes = 2 * shape.iter().product::<usize>();
            header.insert(
                name,
                serde_json::json!({"dtype": "BF16", "shape": shape, "data_offsets": [len, len + bytes]}),
            );
            len += bytes;
        }
        let header = serde_json::to_string(&header).unwrap();
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header.as_bytes());
        file.resize(file.len() + len, 0);
        std::fs::write(dir.path().join(SINGLE_FILE), file).unwrap();
        (dir, config)
    }

    /// Found by the fuzz harness: `check` listed every tensor of every claimed layer before
    /// looking at the first, so `num_hidden_layers: 9567572673499565809` hung (and would
    /// have allocated without bound) instead of failing at layer 2.
    #[test]
    fn check_stops_at_the_first_missing_layer() {
        let (dir, mut config) = tiny_dir();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        ckpt.check(&config).unwrap();
        config.num_layers = 1 << 40;
        let started = std::time::Instant::now();
        let e = ckpt.check(&config).unwrap_err().to_string();
        assert!(
            e.contains("model.layers.2.input_layernorm.weight") && e.contains(SINGLE_FILE),
            "{e}"
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
    }

    /// Found by the fuzz harness: an index naming the shard "" mapped the directory itself and
    /// failed with "No such device"; the error now says what is wrong with the index.
    #[test]
    fn an_empty_shard_name_is_named_as_the_problem() {
        let (dir, _) = tiny_dir();
        let index = serde_json::json!({"weight_map": {EMBED: ""}});
        std::fs::write(dir.path().join(INDEX_FILE), index.to_string()).unwrap();
        let e = Checkpoint::open(dir.path())
            .err()
            .expect("an error")
            .to_string();
        assert!(
            e.contains(INDEX_FILE) && e.contains("shard name \"\" must be a plain file name"),
            "{e}"
        );
    }

    /// Found by the fuzz harness: eight tensors of 2^61 - 1 bytes each, chained, end 8 bytes
    /// short of 2^64; safetensors 0.8 then overflows adding the header's length and panicked
    /// (builds with overflow checks). Now an error that names a tensor past the data.
    #[test]
    fn ranges_summing_past_the_address_space_are_an_error() {
        let mut header = serde_json::Map::new();
        let size: u64 = (1 << 61) - 1;
        for i in 0..8u64 {
            header.insert(
                format!("t{i}"),
                serde_json::json!({"dtype": "U8", "shape": [size], "data_offsets": [i * size, (i + 1) * size]}),
            );
        }
        let header = serde_json::to_string(&header).unwrap();
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header.as_bytes());
        file.extend_from_slice(&[0; 16]);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(SINGLE_FILE), file).unwrap();
        let e = Checkpoint::open(dir.path())
            .err()
            .expect("an error")
            .to_string();
        assert!(
            e.contains(SINGLE_FILE) && e.contains("ends at byte") && e.contains("16-byte data"),
            "{e}"
        );
        // A well-formed file still opens, and one cut short names the cut tensor.
        let (dir, config) = tiny_dir();
        Checkpoint::open(dir.path())
            .unwrap()
            .check(&config)
            .unwrap();
        let path = dir.path().join(SINGLE_FILE);
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        let e = Checkpoint::open(dir.path())
            .err()
            .expect("an error")
            .to_string();
        assert!(e.contains("ends at byte"), "{e}");
    }
}

/// FP8 checkpoints written by compressed-tensors itself (`scripts/fp8_fixtures.py`: the micro
/// model's projections quantized per channel and in 32 x 32 blocks by the library's own scale
/// rule and compressor): every weight reads back as the library decompresses it.
#[cfg(test)]
mod fp8_fixture_tests {
    use super::*;
    use crate::model::{CpuModel, ModelDir};

    fn fixture(strategy: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/fp8")
            .join(strategy)
    }

    fn check(strategy: &str, block: Option<(usize, usize)>) {
        let dir = ModelDir::open(&fixture(strategy)).unwrap();
        let fp8 = dir.config.fp8.clone().expect("an FP8 config");
        assert_eq!(
            (fp8.method.as_str(), fp8.block),
            ("compressed-tensors", block)
        );
        let ckpt = Checkpoint::open(&dir.path).unwrap();
        ckpt.check(&dir.config).unwrap();
        let expected: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path.join("expected.json")).unwrap())
                .unwrap();
        let expected = expected.as_object().unwrap();
        assert_eq!(expected.len(), 7 * dir.config.num_layers);
        for (name, want) in expected {
            let shape = expected_tensors(&dir.config)
                .into_iter()
                .find(|(n, _)| n == name)
                .unwrap()
                .1;
            let w = ckpt.weight(name, &shape, Some(&fp8)).unwrap();
            assert!(matches!(w, WeightRef::Fp8 { .. }), "{name}");
            let v = w.to_f32();
            let sum: f64 = v.iter().map(|&x| x as f64).sum();
            let sum_sq: f64 = v.iter().map(|&x| x as f64 * x as f64).sum();
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1.0);
            assert!(
                close(sum, want["sum"].as_f64().unwrap()),
                "{name}: sum {sum}"
            );
            assert!(
                close(sum_sq, want["sum_sq"].as_f64().unwrap()),
                "{name}: sum_sq"
            );
            // f32 values (serde_json may read the last bit of an f64 differently).
            for (i, f) in want["first"].as_array().unwrap().iter().enumerate() {
                assert_eq!(v[i], f.as_f64().unwrap() as f32, "{name}[{i}]");
            }
        }
        // And the model runs on them.
        CpuModel::load(&dir).unwrap();
    }

    #[test]
    fn compressed_tensors_channel_checkpoints_read_as_the_library_means() {
        check("channel", None);
    }

    /// Our per-channel quantizer (`--quantization fp8`, `harrier quantize`) writes the bytes
    /// and scales compressed-tensors writes, from the same weights (the fixture's source is
    /// the micro preset at seed 5).
    #[test]
    fn our_quantizer_matches_compressed_tensors() {
        use crate::gen_model::{write_model, ModelSpec, Preset};
        let src = tempfile::tempdir().unwrap();
        write_model(src.path(), &ModelSpec::from_preset(Preset::Micro, 5)).unwrap();
        let src = ModelDir::open(src.path()).unwrap();
        let ours = Checkpoint::open(&src.path).unwrap();
        let dir = ModelDir::open(&fixture("channel")).unwrap();
        let theirs = Checkpoint::open(&dir.path).unwrap();
        let fp8 = dir.config.fp8.as_ref();
        let mut compared = 0;
        for layer in 0..src.config.num_layers {
            for t in LayerTensor::all(src.config.architecture) {
                if t.is_norm() {
                    continue;
                }
                let shape = t.shape(&src.config);
                let w = ours.get(&t.name(layer), &shape).unwrap().to_f32();
                let (q, scales) = fp8::quantize_rows(&w, shape[1]);
                let WeightRef::Fp8 {
                    q: tq, scales: ts, ..
                } = theirs.weight(&t.name(layer), &shape, fp8).unwrap()
                else {
                    panic!("{} is not FP8 in the fixture", t.name(layer));
                };
                assert_eq!(scales, ts, "{}: scales", t.name(layer));
                assert_eq!(q, tq, "{}: e4m3 bytes", t.name(layer));
                compared += 1;
            }
        }
        assert_eq!(compared, 7 * src.config.num_layers);
    }

    #[test]
    fn compressed_tensors_block_checkpoints_read_as_the_library_means() {
        check("block", Some((32, 32)));
    }
}
