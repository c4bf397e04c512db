//! Streams deterministic random tensors into safetensors files, sharding like Hugging Face.
//!
//! File layout (the safetensors format):
//!
//! ```text
//!   u64 LE header length N | N bytes of JSON header (space padded to 8) | tensor bytes ...
//!   header = {"__metadata__": {"format": "pt"},
//!             "<name>": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...}
//! ```
//!
//! Sizes are known from the shapes, so the header is written first and the data is then
//! generated chunk by chunk (each chunk in parallel) straight into the file: peak memory is one
//! chunk, whatever the model size. Shards split between tensors when the next tensor would push
//! a shard past `max_shard_size` (a tensor larger than that gets a shard of its own), named
//! `model-00001-of-0000N.safetensors` and listed by `model.safetensors.index.json`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use half::{bf16, f16};
use rayon::prelude::*;
use serde_json::{json, Map, Value};

use super::rng::{fill_normal, StreamKey};
use crate::model::{
    expected_tensors, ModelConfig, WeightDtype, EMBED, INDEX_FILE, LM_HEAD, SINGLE_FILE,
};

/// How random weights are drawn:
/// - embedding and `lm_head`: `N(0, matrix_std)`;
/// - projections (`[out, in]`): `N(0, max(matrix_std, 1 / sqrt(in)))`. At real sizes this is
///   `matrix_std` (0.02); on small presets it keeps every layer's output O(1), so the layers,
///   not the token's own embedding, decide the next token. (With 0.02 throughout, a small
///   model with tied embeddings mostly predicts its input token: logits degenerate into
///   "repeat the last token".)
/// - norm weights: `1 + N(0, norm_std)` (never all ones, so a skipped or misread norm shows);
///   Gemma's, which scale by `1 + w`, `N(0, norm_std)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WeightInit {
    pub matrix_std: f32,
    pub norm_std: f32,
}

impl Default for WeightInit {
    fn default() -> Self {
        WeightInit {
            matrix_std: 0.02,
            norm_std: 0.1,
        }
    }
}

/// One tensor to write: values `mean + std * N(0, 1)`.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub mean: f32,
    pub std: f32,
}

impl TensorSpec {
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The tensors of a checkpoint of `config`, in order, with their distributions.
pub fn tensor_specs(config: &ModelConfig, init: WeightInit) -> Vec<TensorSpec> {
    let norm_mean = 1.0 - config.architecture.norm_weight_offset();
    expected_tensors(config)
        .into_iter()
        .map(|(name, shape)| {
            let (mean, std) = match shape[..] {
                [_] => (norm_mean, init.norm_std),
                _ if name == EMBED || name == LM_HEAD => (0.0, init.matrix_std),
                [_, fan_in] => (0.0, init.matrix_std.max(1.0 / (fan_in as f32).sqrt())),
                _ => (0.0, init.matrix_std),
            };
            TensorSpec {
                name,
                shape,
                mean,
                std,
            }
        })
        .collect()
}

fn st_dtype(d: WeightDtype) -> &'static str {
    match d {
        WeightDtype::F32 => "F32",
        WeightDtype::F16 => "F16",
        WeightDtype::Bf16 => "BF16",
    }
}

/// Writes `specs` into `dir` (single file or shards + index); returns the files written.
pub fn write_safetensors(
    dir: &Path,
    specs: &[TensorSpec],
    dtype: WeightDtype,
    seed: u64,
    max_shard_size: u64,
) -> anyhow::Result<Vec<PathBuf>> {
    let size = dtype.size_bytes();
    // Plan shards.
    let mut shards: Vec<Vec<&TensorSpec>> = vec![Vec::new()];
    let mut cur = 0u64;
    for spec in specs {
        let bytes = (spec.numel() * size) as u64;
        let last = shards.last_mut().expect("at least one shard");
        if !last.is_empty() && cur + bytes > max_shard_size {
            shards.push(vec![spec]);
            cur = bytes;
        } else {
            last.push(spec);
            cur += bytes;
        }
    }
    let n = shards.len();
    let names: Vec<String> = if n == 1 {
        vec![SINGLE_FILE.to_string()]
    } else {
        (1..=n)
            .map(|i| format!("model-{i:05}-of-{n:05}.safetensors"))
            .collect()
    };
    let mut written = Vec::new();
    let mut weight_map = Map::new();
    for (shard, name) in shards.iter().zip(&names) {
        let path = dir.join(name);
        write_one(&path, shard, dtype, seed)
            .with_context(|| format!("writing {}", path.display()))?;
        for spec in shard {
            weight_map.insert(spec.name.clone(), json!(name));
        }
        written.push(path);
    }
    if n > 1 {
        let total: usize = specs.iter().map(|s| s.numel() * size).sum();
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        let path = dir.join(INDEX_FILE);
        std::fs::write(&path, serde_json::to_string_pretty(&index)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

fn write_one(
    path: &Path,
    specs: &[&TensorSpec],
    dtype: WeightDtype,
    seed: u64,
) -> anyhow::Result<()> {
    let size = dtype.size_bytes();
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0usize;
    for spec in specs {
        let end = offset + spec.numel() * size;
        header.insert(
            spec.name.clone(),
            json!({"dtype": st_dtype(dtype), "shape": spec.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut header = serde_json::to_string(&Value::Object(header))?;
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut out = BufWriter::with_capacity(1 << 20, File::create(path)?);
    out.write_all(&(header.len() as u64).to_le_bytes())?;
    out.write_all(header.as_bytes())?;

    const CHUNK: usize = 1 << 22; // elements generated per write
    const PIECE: usize = 1 << 14; // elements per parallel work item
    let mut buf = vec![0u8; CHUNK.min(specs.iter().map(|s| s.numel()).max().unwrap_or(0)) * size];
    for spec in specs {
        let key = StreamKey::new(seed, &spec.name);
        let (mean, std) = (spec.mean as f64, spec.std as f64);
        let numel = spec.numel();
        let mut start = 0;
        while start < numel {
            let count = CHUNK.min(numel - start);
            let bytes = &mut buf[..count * size];
            bytes
                .par_chunks_mut(PIECE * size)
                .enumerate()
                .for_each_init(
                    || vec![0.0f64; PIECE],
                    |z, (i, out)| {
                        let z = &mut z[..out.len() / size];
                        fill_normal(key, (start + i * PIECE) as u64, z);
                        encode(z, mean, std, dtype, out);
                    },
                );
            out.write_all(bytes)?;
            start += count;
        }
    }
    out.flush()?;
    Ok(())
}

fn encode(z: &[f64], mean: f64, std: f64, dtype: WeightDtype, out: &mut [u8]) {
    match dtype {
        WeightDtype::F32 => {
            for (&v, o) in z.iter().zip(out.chunks_exact_mut(4)) {
                o.copy_from_slice(&((mean + std * v) as f32).to_le_bytes());
            }
        }
        WeightDtype::Bf16 => {
            for (&v, o) in z.iter().zip(out.chunks_exact_mut(2)) {
                o.copy_from_slice(&bf16::from_f32((mean + std * v) as f32).to_le_bytes());
            }
        }
        WeightDtype::F16 => {
            for (&v, o) in z.iter().zip(out.chunks_exact_mut(2)) {
                o.copy_from_slice(&f16::from_f32((mean + std * v) as f32).to_le_bytes());
            }
        }
    }
}
