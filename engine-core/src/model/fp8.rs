//! FP8 (e4m3) weights: the checkpoint formats that hold them, and quantization at load.
//!
//! Harrier's FP8 is weight-only: projection weights are stored as e4m3 with one f32 scale per
//! output channel (`w ≈ scale[n] * q[n, k]`), activations stay in the compute type (bf16 on
//! CUDA, f32 on the CPU). Decode, where FP8 pays, is bound by reading weights, so halving
//! their bytes is the whole gain; quantizing activations per token as well would buy tensor-core
//! FP8 throughput only for large batches and prefill, at the cost of a second rounding of every
//! input (docs/fp8.md).
//!
//! Checkpoints that are already FP8 load as they are written by:
//! - compressed-tensors (`quant_method: "compressed-tensors"`, float 8-bit weights, `tensor`,
//!   `channel` or `block` strategy): `<module>.weight` in `F8_E4M3`, `<module>.weight_scale` of
//!   shape `[]`, `[1]`, `[N, 1]`, `[N]` or (blocks of `block_structure`) `[ceil(N / bn),
//!   ceil(K / bk)]`; `input_scale` (static activation scales) is not used;
//! - transformers' `fbgemm_fp8`: per-channel `weight_scale` `[N, 1]`;
//! - `fp8` with `weight_block_size` (transformers' fine-grained FP8, DeepSeek style):
//!   `weight_scale_inv` per block (`[ceil(N / bn), ceil(K / bk)]`); despite its name it
//!   multiplies too; `fp8` without it (AutoFP8 and vLLM's serialized FP8): a per-tensor
//!   `weight_scale`, as vLLM reads them.
//!
//! Any tensor stored as `F8_E4M3` must have its scale beside it; every other tensor is read as
//! usual, so a checkpoint's ignore list (often `lm_head`) needs no parsing.

use std::path::Path;

use float8::F8E4M3;
use serde_json::Value;

use super::config::ModelError;

/// The largest finite e4m3 value: a channel's largest magnitude maps to it.
pub const E4M3_MAX: f32 = 448.0;

/// An FP8 checkpoint's declaration (`quantization_config`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fp8Checkpoint {
    /// The method as the config names it (for messages).
    pub method: String,
    /// The suffix of a weight's scale tensor: `weight_scale` or `weight_scale_inv`.
    pub scale_suffix: &'static str,
    /// Fine-grained checkpoints: the block of weights one scale covers, `(rows, cols)`.
    pub block: Option<(usize, usize)>,
}

impl Fp8Checkpoint {
    /// The scale tensor's name for weight `name` (`...q_proj.weight` -> `...q_proj.weight_scale`).
    pub fn scale_name(&self, weight: &str) -> String {
        let module = weight.strip_suffix(".weight").unwrap_or(weight);
        format!("{module}.{}", self.scale_suffix)
    }

    /// Parses `quantization_config` (absent or null: `None`). Methods other than FP8 ones, and
    /// FP8 schemes we cannot read exactly, are errors that name the field.
    pub fn parse(q: Option<&Value>, path: &Path) -> Result<Option<Fp8Checkpoint>, ModelError> {
        let Some(q) = q.filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        let err = |field: &str, problem: String| ModelError::Field {
            path: path.to_path_buf(),
            field: format!("quantization_config.{field}"),
            problem,
        };
        let method = q
            .get("quant_method")
            .and_then(Value::as_str)
            .ok_or_else(|| err("quant_method", "missing or not a string".into()))?;
        let unsupported = |problem: String| ModelError::Unsupported {
            path: path.to_path_buf(),
            problem,
        };
        match method {
            "compressed-tensors" => {
                let groups = q
                    .get("config_groups")
                    .and_then(Value::as_object)
                    .filter(|g| !g.is_empty())
                    .ok_or_else(|| err("config_groups", "missing or empty".into()))?;
                let mut block = None;
                for (name, group) in groups {
                    let field = |f: &str| format!("config_groups.{name}.weights.{f}");
                    let w = group
                        .get("weights")
                        .filter(|v| !v.is_null())
                        .ok_or_else(|| {
                            err(&format!("config_groups.{name}.weights"), "missing".into())
                        })?;
                    let (bits, kind) = (w.get("num_bits"), w.get("type"));
                    if bits.and_then(Value::as_u64) != Some(8)
                        || kind.and_then(Value::as_str) != Some("float")
                    {
                        return Err(unsupported(format!(
                            "compressed-tensors weights of num_bits {} and type {} (only 8-bit \
                             float, FP8, is supported)",
                            bits.unwrap_or(&Value::Null),
                            kind.unwrap_or(&Value::Null)
                        )));
                    }
                    match w.get("strategy").and_then(Value::as_str) {
                        Some("tensor" | "channel") => {}
                        Some("block") => {
                            let b = block_size(w.get("block_structure")).ok_or_else(|| {
                                err(
                                    &field("block_structure"),
                                    "expected two positive integers".into(),
                                )
                            })?;
                            if block.is_some_and(|other| other != b) {
                                return Err(unsupported(
                                    "compressed-tensors groups with different FP8 block sizes"
                                        .into(),
                                ));
                            }
                            block = Some(b);
                        }
                        other => {
                            return Err(unsupported(format!(
                                "compressed-tensors FP8 weight strategy {other:?} (supported: \
                                 \"tensor\", \"channel\", \"block\")"
                            )))
                        }
                    }
                }
                Ok(Some(Fp8Checkpoint {
                    method: method.into(),
                    scale_suffix: "weight_scale",
                    block,
                }))
            }
            "fbgemm_fp8" => Ok(Some(Fp8Checkpoint {
                method: method.into(),
                scale_suffix: "weight_scale",
                block: None,
            })),
            "fp8" => {
                let block = match q.get("weight_block_size").filter(|v| !v.is_null()) {
                    None => None,
                    v => Some(block_size(v).ok_or_else(|| {
                        err("weight_block_size", "expected two positive integers".into())
                    })?),
                };
                Ok(Some(Fp8Checkpoint {
                    method: method.into(),
                    scale_suffix: match block {
                        Some(_) => "weight_scale_inv",
                        None => "weight_scale",
                    },
                    block,
                }))
            }
            other => Err(unsupported(format!(
                "quantization method {other:?} (supported: FP8 checkpoints of compressed-tensors, \
                 fbgemm_fp8 and fp8)"
            ))),
        }
    }

    /// The scale layout a scale tensor of `scale_shape` gives an `[n, k]` weight, or why not.
    pub fn layout(
        &self,
        (n, k): (usize, usize),
        scale_shape: &[usize],
    ) -> Result<ScaleLayout, String> {
        let numel: usize = scale_shape.iter().product();
        if let Some((br, bc)) = self.block {
            let (gr, gc) = (n.div_ceil(br), k.div_ceil(bc));
            if scale_shape == [gr, gc] {
                return Ok(ScaleLayout::Block { rows: br, cols: bc });
            }
            return Err(format!(
                "a {br} x {bc}-block scale of an [{n}, {k}] weight has shape [{gr}, {gc}], not \
                 {scale_shape:?}"
            ));
        }
        match scale_shape {
            _ if numel == 1 && scale_shape.len() <= 2 => Ok(ScaleLayout::Tensor),
            [r, 1] | [r] if *r == n => Ok(ScaleLayout::Channel),
            _ => Err(format!(
                "a scale of an [{n}, {k}] weight has shape [], [1], [{n}, 1] or [{n}], not \
                 {scale_shape:?}"
            )),
        }
    }
}

/// `[rows, cols]` of positive integers.
fn block_size(v: Option<&Value>) -> Option<(usize, usize)> {
    match v?.as_array()?.as_slice() {
        [r, c] => match (r.as_u64()?, c.as_u64()?) {
            (r, c) if r > 0 && c > 0 => Some((r as usize, c as usize)),
            _ => None,
        },
        _ => None,
    }
}

/// How one FP8 weight's scales map onto it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleLayout {
    /// One scale.
    Tensor,
    /// One per output row.
    Channel,
    /// One per `rows x cols` block, row-major over the blocks.
    Block { rows: usize, cols: usize },
}

/// The e4m3 value of `bits` (finite for every byte a quantizer writes; 0x7f/0xff are NaN).
pub fn decode(bits: u8) -> f32 {
    F8E4M3::from_bits(bits).to_f32()
}

/// `v` rounded to the nearest e4m3 (ties to even), saturating at ±448: what CUDA's
/// `__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)` gives.
pub fn encode(v: f32) -> u8 {
    F8E4M3::from_f32(v).to_bits()
}

/// Dequantizes an FP8 weight of `[n, k]` into `out` (row-major): `out = decode(q) * scale`.
/// `scales` holds one value (Tensor), `n` (Channel) or one per block, row-major.
pub fn dequantize(q: &[u8], scales: &[f32], layout: ScaleLayout, k: usize, out: &mut [f32]) {
    assert_eq!(q.len(), out.len(), "dequantize: lengths");
    let grid_cols = match layout {
        ScaleLayout::Block { cols, .. } => k.div_ceil(cols),
        _ => 0,
    };
    for (row, (o, q)) in out.chunks_exact_mut(k).zip(q.chunks_exact(k)).enumerate() {
        for (col, (o, &q)) in o.iter_mut().zip(q).enumerate() {
            let s = match layout {
                ScaleLayout::Tensor => scales[0],
                ScaleLayout::Channel => scales[row],
                ScaleLayout::Block { rows, cols } => scales[(row / rows) * grid_cols + col / cols],
            };
            *o = decode(q) * s;
        }
    }
}

/// The per-channel scale of a row: its largest magnitude over [`E4M3_MAX`] (1 for a row of
/// zeros, so every row divides by something finite and non-zero).
pub fn channel_scale(row: &[f32]) -> f32 {
    let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax > 0.0 && amax.is_finite() {
        amax / E4M3_MAX
    } else {
        1.0
    }
}

/// Quantizes `w` (`[n, k]`, row-major) per output channel: e4m3 bytes and `n` scales, with
/// `q = encode(w / scale)`. The CUDA quantizer (`quantize_fp8_rows`) computes the same.
pub fn quantize_rows(w: &[f32], k: usize) -> (Vec<u8>, Vec<f32>) {
    use rayon::prelude::*;
    let mut q = vec![0u8; w.len()];
    let scales = q
        .par_chunks_mut(k)
        .zip(w.par_chunks(k))
        .map(|(q, row)| {
            let s = channel_scale(row);
            q.iter_mut().zip(row).for_each(|(q, &v)| *q = encode(v / s));
            s
        })
        .collect();
    (q, scales)
}

/// Rounds `w` (`[n, k]`) in place to what per-channel FP8 keeps of it: `decode(q) * scale`.
/// The CPU backend's `--quantization fp8` (an accuracy model of the CUDA path).
pub fn round_rows(w: &mut [f32], k: usize) {
    let (q, scales) = quantize_rows(w, k);
    dequantize(&q, &scales, ScaleLayout::Channel, k, w);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn e4m3_rounds_to_nearest_even_and_saturates() {
        assert_eq!(decode(encode(1.0)), 1.0);
        assert_eq!(decode(encode(448.0)), 448.0);
        assert_eq!(decode(encode(1e6)), 448.0);
        assert_eq!(decode(encode(-1e6)), -448.0);
        // 17 lies halfway between 16 and 18: the even mantissa (16) wins; 19 -> 20.
        assert_eq!(decode(encode(17.0)), 16.0);
        assert_eq!(decode(encode(19.0)), 20.0);
        // The smallest subnormal is 2^-9; half of it rounds to 0 (even).
        assert_eq!(decode(encode(2f32.powi(-9))), 2f32.powi(-9));
        assert_eq!(decode(encode(2f32.powi(-10))), 0.0);
        // Every finite byte decodes and re-encodes to itself (0x7f and 0xff are NaN).
        for b in 0..=255u8 {
            if b & 0x7f != 0x7f {
                let v = decode(b);
                assert!(v.is_finite(), "{b:#x}");
                assert_eq!(encode(v), if v == 0.0 { b & 0x80 } else { b }, "{b:#x}");
            }
        }
    }

    /// The CUDA kernels' e4m3 -> bf16 conversion (`e4m3x2_bf16x2` in kernels/cuda/harrier.cu:
    /// the byte moved to the top of a 16-bit half by `prmt`, sign kept, the rest shifted right
    /// by 4, then times 2^120), mirrored bit for bit: exact for every finite byte, subnormals
    /// and both zeros included.
    #[test]
    fn the_kernels_bit_conversion_is_exact() {
        let convert = |byte: u8| -> f32 {
            let y = (byte as u32) << 8; // __byte_perm(x, 0, 0x1404), low half
            let h = (y & 0x8000) | ((y >> 4) & 0x07ff);
            // bf16 bits h read as f32 (subnormals included), times 2^120: exact.
            f32::from_bits(h << 16) * 2f32.powi(120)
        };
        for b in 0..=255u8 {
            if b & 0x7f != 0x7f {
                let (want, got) = (decode(b), convert(b));
                assert_eq!(want.to_bits(), got.to_bits(), "{b:#04x}: {want} vs {got}");
            }
        }
    }

    #[test]
    fn per_channel_quantization_maps_each_rows_largest_value_to_448() {
        let w = [
            0.5, -2.0, 0.25, 1.0, /* row 2 */ 0.0, 0.0, 0.0, 0.0, /* row 3 */ 3.0, 1e-3,
            -1.5, 0.7,
        ];
        let (q, s) = quantize_rows(&w, 4);
        assert_eq!(s, vec![2.0 / 448.0, 1.0, 3.0 / 448.0]);
        assert_eq!(decode(q[1]), -448.0);
        assert_eq!(decode(q[8]), 448.0);
        assert!(q[4..8].iter().all(|&b| decode(b) == 0.0));
        let mut back = vec![0.0; 12];
        dequantize(&q, &s, ScaleLayout::Channel, 4, &mut back);
        // e4m3 keeps 3 mantissa bits: relative error at most 2^-4 for normal values.
        for (a, b) in w.iter().zip(&back) {
            assert!((a - b).abs() <= a.abs() / 16.0 + 1e-6, "{a} vs {b}");
        }
        let mut r = w;
        round_rows(&mut r, 4);
        assert_eq!(r.to_vec(), back);
    }

    #[test]
    fn block_and_tensor_scales_dequantize_by_position() {
        // A [3, 4] weight, 2 x 2 blocks: a 2 x 2 grid of scales.
        let q: Vec<u8> = [1.0f32; 12].iter().map(|&v| encode(v)).collect();
        let mut out = vec![0.0; 12];
        let layout = ScaleLayout::Block { rows: 2, cols: 2 };
        dequantize(&q, &[1.0, 2.0, 3.0, 4.0], layout, 4, &mut out);
        assert_eq!(out, vec![1., 1., 2., 2., 1., 1., 2., 2., 3., 3., 4., 4.]);
        dequantize(&q, &[0.5], ScaleLayout::Tensor, 4, &mut out);
        assert!(out.iter().all(|&v| v == 0.5));
    }

    #[test]
    fn parses_the_fp8_checkpoint_formats() {
        let p = Path::new("config.json");
        let ct = json!({"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true}}},
            "ignore": ["lm_head"]});
        let c = Fp8Checkpoint::parse(Some(&ct), p).unwrap().unwrap();
        assert_eq!(
            c.scale_name("model.layers.0.mlp.up_proj.weight"),
            "model.layers.0.mlp.up_proj.weight_scale"
        );
        assert_eq!(c.layout((8, 4), &[8, 1]), Ok(ScaleLayout::Channel));
        assert_eq!(c.layout((8, 4), &[]), Ok(ScaleLayout::Tensor));
        assert!(c.layout((8, 4), &[4, 1]).unwrap_err().contains("[8, 1]"));
        let cb = json!({"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8,
                "type": "float", "strategy": "block", "block_structure": [128, 128]}}}});
        let c = Fp8Checkpoint::parse(Some(&cb), p).unwrap().unwrap();
        assert_eq!(
            (c.block, c.scale_suffix),
            (Some((128, 128)), "weight_scale")
        );
        let fg = json!({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]});
        let c = Fp8Checkpoint::parse(Some(&fg), p).unwrap().unwrap();
        assert_eq!(c.scale_name("lm_head.weight"), "lm_head.weight_scale_inv");
        assert_eq!(
            c.layout((300, 256), &[3, 2]),
            Ok(ScaleLayout::Block {
                rows: 128,
                cols: 128
            })
        );
        assert!(c.layout((300, 256), &[2, 2]).is_err());
        let auto = json!({"quant_method": "fp8", "activation_scheme": "static"});
        let c = Fp8Checkpoint::parse(Some(&auto), p).unwrap().unwrap();
        assert_eq!(c.scale_name("lm_head.weight"), "lm_head.weight_scale");
        assert_eq!(c.layout((8, 4), &[]), Ok(ScaleLayout::Tensor));
        let fb = json!({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0});
        assert_eq!(
            Fp8Checkpoint::parse(Some(&fb), p).unwrap().unwrap().block,
            None
        );
        assert_eq!(Fp8Checkpoint::parse(None, p).unwrap(), None);
        assert_eq!(Fp8Checkpoint::parse(Some(&Value::Null), p).unwrap(), None);
    }

    #[test]
    fn other_quantizations_are_errors_that_say_what_is_supported() {
        let p = Path::new("/m/config.json");
        let err = |q: Value| Fp8Checkpoint::parse(Some(&q), p).unwrap_err().to_string();
        let e = err(json!({"quant_method": "awq", "bits": 4}));
        assert!(
            e.contains("\"awq\"") && e.contains("compressed-tensors"),
            "{e}"
        );
        let e = err(
            json!({"quant_method": "compressed-tensors", "config_groups": {"g": {
            "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}),
        );
        assert!(e.contains("num_bits 4") && e.contains("FP8"), "{e}");
        let e = err(
            json!({"quant_method": "compressed-tensors", "config_groups": {"g": {
            "weights": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}}}}),
        );
        assert!(e.contains("\"group\""), "{e}");
        let e = err(
            json!({"quant_method": "compressed-tensors", "config_groups": {"g": {
            "weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}}),
        );
        assert!(e.contains("config_groups.g.weights.block_structure"), "{e}");
        let e = err(json!({"quant_method": "fp8", "weight_block_size": [128]}));
        assert!(e.contains("quantization_config.weight_block_size"), "{e}");
        let e = err(json!({"bits": 8}));
        assert!(e.contains("quantization_config.quant_method"), "{e}");
    }
}
