//! The CPU forward pass (f32) of Llama 3.x, Qwen3 and Gemma 3.
//!
//! One call runs a batch of [`SeqChunk`]s laid end to end as rows `0 .. T`:
//!
//! ```text
//!   x = embed[tokens]                                   [T, hidden]
//!   per layer:
//!     h    = rms_norm(x) * w_in
//!     qkv  = h · W_qkvᵀ                                  [T, (nh + 2 nkv) hd]   (fused q|k|v)
//!     (Qwen3) q, k = per-head rms_norm(q) * w_qn, rms_norm(k) * w_kn
//!     q, k = rope(q, k, row positions)
//!     cache[block_table[p / bs], p % bs] = k, v           (this chunk's positions)
//!     attn = paged_attention(q, cache)                   [nh, T, hd] -> [T, nh hd]
//!     x   += attn · W_oᵀ
//!     h    = rms_norm(x) * w_post
//!     x   += (silu(h · W_gateᵀ) * (h · W_upᵀ)) · W_downᵀ  (fused gate|up)
//!   logits rows = rms_norm(x[last logit_rows rows of each chunk]) · W_lm_headᵀ
//! ```
//!
//! Gemma 3 differs in: embeddings times `sqrt(hidden)`; every RMSNorm scales by `1 + w` (folded
//! into the weights at load, exact in f32 as transformers computes it); q/k norms as Qwen3;
//! sliding layers attend to the last `window` positions with their own RoPE base; scores
//! scaled by `query_pre_attn_scalar^-1/2`; the attention and MLP outputs are normed before
//! their residual adds (`x += rms_norm(attn · W_oᵀ) * w_post`, MLP input norm `w_pre_ff`,
//! output norm `w_post_ff`); the MLP gate is GELU-tanh.
//!
//! Scratch buffers live in the model and only grow, so a steady stream of similar batches
//! allocates nothing.

use anyhow::{bail, ensure};

use super::attention::{paged_attention, AttnShape};
use super::config::{Activation, LayerAttention, ModelConfig, ModelError};
use super::linear::{linear, PackedWeight};
use super::ops::{gelu_tanh_mul, rms_norm, rms_norm_in_place, silu_mul};
use super::rope::{self, Rope};
use super::weights::{Checkpoint, LayerTensor, EMBED, FINAL_NORM, LM_HEAD};
use super::{KvCache, ModelDir};

/// One sequence's chunk of input tokens in a forward batch.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    /// Position of `tokens[0]` (= tokens already in the cache for this sequence).
    pub position: usize,
    pub block_table: &'a [u32],
    /// The sliding-window layers' block table when the cache is hybrid (else empty; see
    /// `KvCache::hybrid`).
    pub local_block_table: &'a [u32],
    /// The chunk's last `logit_rows` tokens produce logits (0: none; 1: the next token's, as
    /// for prefill and decode; more: a speculative verification scores every position).
    pub logit_rows: usize,
}

/// One decoder layer. Projections are packed for `linear` (see `linear.rs`).
struct LayerWeights {
    input_norm: Vec<f32>,
    /// Fused `[q; k; v]`: hidden -> (nh + 2 nkv) hd.
    qkv: PackedWeight,
    /// Qwen3 and Gemma 3: per-head norms of q and k (`[head_dim]`).
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    o: PackedWeight,
    post_norm: Vec<f32>,
    /// Gemma 3: the MLP's input and output norms (`post_norm` then norms the attention output).
    ff_norms: Option<(Vec<f32>, Vec<f32>)>,
    /// Fused `[gate; up]`: hidden -> 2 intermediate.
    gate_up: PackedWeight,
    down: PackedWeight,
    /// `Some(w)`: sliding-window attention over the last `w` positions, with the sliding RoPE.
    window: Option<usize>,
}

#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    qkv: Vec<f32>,
    attn_hm: Vec<f32>,
    attn: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    /// A projection's output before its norm (Gemma 3's sandwich norms).
    delta: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// The sliding layers' RoPE tables (Gemma 3).
    cos_local: Vec<f32>,
    sin_local: Vec<f32>,
    row_seq: Vec<u32>,
    row_pos: Vec<u32>,
    logit_rows: Vec<f32>,
}

/// Grows `v` to at least `n` elements (never shrinks) and returns the first `n`.
fn grow(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

pub struct CpuModel {
    config: ModelConfig,
    /// `[vocab, hidden]`; `None` when tied (and not rounded to FP8): rows then come from
    /// `lm_head`.
    embed: Option<Vec<f32>>,
    layers: Vec<LayerWeights>,
    final_norm: Vec<f32>,
    lm_head: PackedWeight,
    rope: Rope,
    /// The sliding layers' RoPE (Gemma 3).
    rope_local: Option<Rope>,
    /// The embedding multiplier (Gemma 3: `sqrt(hidden)`).
    embed_scale: f32,
    scratch: Scratch,
}

/// How [`CpuModel::load_with`] treats the checkpoint's weights.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Round the projections and the output head to per-channel FP8 values (`--quantization
    /// fp8`): what the CUDA backend's FP8 weights hold, computed in f32. An accuracy model,
    /// not a speedup; the embeddings stay as stored.
    pub round_fp8: bool,
}

impl CpuModel {
    /// Maps the checkpoint, checks every tensor, converts to f32 (FP8 checkpoints:
    /// dequantizes), fuses q|k|v and gate|up, and packs the projections for `linear`.
    pub fn load(dir: &ModelDir) -> Result<CpuModel, ModelError> {
        Self::load_with(dir, LoadOptions::default())
    }

    /// [`CpuModel::load`] with `opts`.
    pub fn load_with(dir: &ModelDir, opts: LoadOptions) -> Result<CpuModel, ModelError> {
        let config = dir.config.clone();
        let ckpt = Checkpoint::open(&dir.path)?;
        ckpt.check(&config)?;
        let fp8 = config.fp8.as_ref();
        let get = |name: &str, shape: Vec<usize>| -> Result<Vec<f32>, ModelError> {
            Ok(ckpt.weight(name, &shape, fp8)?.to_f32())
        };
        // A projection's [out, in] rows, rounded to FP8 when asked.
        let round = |mut w: Vec<f32>, cols: usize| {
            if opts.round_fp8 {
                super::fp8::round_rows(&mut w, cols);
            }
            w
        };
        // Norm weights with Gemma's `1 + w` folded in (f32, as transformers computes it).
        let offset = config.architecture.norm_weight_offset();
        let norm = |name: &str, len: usize| -> Result<Vec<f32>, ModelError> {
            let mut w = get(name, vec![len])?;
            w.iter_mut().for_each(|v| *v += offset);
            Ok(w)
        };
        // [out, in] tensors stacked along `out`, packed.
        let fuse = |layer: usize, parts: &[LayerTensor]| -> Result<PackedWeight, ModelError> {
            let rows: usize = parts.iter().map(|t| t.shape(&config)[0]).sum();
            let mut out = vec![0.0; rows * config.hidden_size];
            let mut at = 0;
            for &t in parts {
                let r = ckpt.weight(&t.name(layer), &t.shape(&config), fp8)?;
                r.write_f32(&mut out[at..at + r.numel()]);
                at += r.numel();
            }
            let out = round(out, config.hidden_size);
            Ok(PackedWeight::from_rows(&out, rows, config.hidden_size))
        };
        let packed = |layer: usize, t: LayerTensor| -> Result<PackedWeight, ModelError> {
            let shape = t.shape(&config);
            let w = round(get(&t.name(layer), shape.clone())?, shape[1]);
            Ok(PackedWeight::from_rows(&w, shape[0], shape[1]))
        };
        let mut layers = Vec::with_capacity(config.num_layers);
        let mut progress = crate::progress::StartupProgress::new(
            format!("loading {} (layers)", dir.name),
            config.num_layers as u64,
            crate::progress::Unit::Items,
        );
        for l in 0..config.num_layers {
            progress.inc(1);
            // The layer's norm weights (every 1-D tensor of a layer is a norm).
            let one = |t: LayerTensor| norm(&t.name(l), t.shape(&config)[0]);
            let qk_norm = match config.architecture.has_qk_norm() {
                true => Some((one(LayerTensor::QNorm)?, one(LayerTensor::KNorm)?)),
                false => None,
            };
            let ff_norms = match config.architecture.sandwich_norms() {
                true => Some((one(LayerTensor::PreFfNorm)?, one(LayerTensor::PostFfNorm)?)),
                false => None,
            };
            layers.push(LayerWeights {
                input_norm: one(LayerTensor::InputNorm)?,
                qkv: fuse(
                    l,
                    &[LayerTensor::QProj, LayerTensor::KProj, LayerTensor::VProj],
                )?,
                qk_norm,
                o: packed(l, LayerTensor::OProj)?,
                post_norm: one(LayerTensor::PostNorm)?,
                ff_norms,
                gate_up: fuse(l, &[LayerTensor::GateProj, LayerTensor::UpProj])?,
                down: packed(l, LayerTensor::DownProj)?,
                window: config.layer_window(l),
            });
        }
        progress.finish();
        let (v, h) = (config.vocab_size, config.hidden_size);
        let embed = get(EMBED, vec![v, h])?;
        let (embed, lm_head) = match (config.tie_word_embeddings, opts.round_fp8) {
            (true, false) => (None, PackedWeight::from_rows(&embed, v, h)),
            // A rounded output head keeps the embedding rows as stored beside it.
            (true, true) => {
                let head = round(embed.clone(), h);
                (Some(embed), PackedWeight::from_rows(&head, v, h))
            }
            (false, _) => (
                Some(embed),
                PackedWeight::from_rows(&round(get(LM_HEAD, vec![v, h])?, h), v, h),
            ),
        };
        Ok(CpuModel {
            embed,
            layers,
            final_norm: norm(FINAL_NORM, h)?,
            lm_head,
            rope: Rope::new(&config, LayerAttention::Full),
            rope_local: config
                .sliding
                .as_ref()
                .map(|_| Rope::new(&config, LayerAttention::Sliding)),
            // The f32 model computes as transformers' fp32 one does.
            embed_scale: config.embed_scale(crate::model::WeightDtype::F32),
            scratch: Scratch::default(),
            config,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Runs one batch; see the module doc and the contract in `model/mod.rs`.
    ///
    /// `logits` must hold at least `vocab_size` values per logits row; rows are written in
    /// chunk order, a chunk's rows in position order. Errors (before anything is written to the cache) on a token
    /// outside the vocabulary, a block table too short for the chunk or naming a block outside
    /// the cache, an empty chunk that wants logits, a too-short `logits`, or a cache built for
    /// another model.
    pub fn forward(
        &mut self,
        seqs: &[SeqChunk<'_>],
        cache: &mut KvCache,
        logits: &mut [f32],
    ) -> anyhow::Result<()> {
        let n_logits = self.validate(seqs, cache, logits.len())?;
        let rows: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        if rows == 0 {
            return Ok(());
        }
        self.embed_rows(seqs, rows);
        for layer in 0..self.layers.len() {
            self.layer_forward(layer, seqs, cache, rows);
        }
        self.final_logits(seqs, n_logits, logits);
        Ok(())
    }

    /// Row bookkeeping, the rows' embeddings into `x`, and their RoPE tables (used by every
    /// layer).
    fn embed_rows(&mut self, seqs: &[SeqChunk<'_>], rows: usize) {
        let Self {
            config,
            embed,
            lm_head,
            rope,
            rope_local,
            embed_scale,
            scratch: s,
            ..
        } = self;
        let (hidden, half) = (config.hidden_size, config.head_dim / 2);
        s.row_seq.clear();
        s.row_pos.clear();
        let cos = grow(&mut s.cos, rows * half);
        let sin = grow(&mut s.sin, rows * half);
        let local_len = if rope_local.is_some() { rows * half } else { 0 };
        let cos_l = grow(&mut s.cos_local, local_len);
        let sin_l = grow(&mut s.sin_local, local_len);
        let x = grow(&mut s.x, rows * hidden);
        let mut r = 0;
        for (i, seq) in seqs.iter().enumerate() {
            for (t, &tok) in seq.tokens.iter().enumerate() {
                let pos = seq.position + t;
                s.row_seq.push(i as u32);
                s.row_pos.push(pos as u32);
                let row = &mut x[r * hidden..(r + 1) * hidden];
                match embed {
                    Some(e) => row.copy_from_slice(&e[tok as usize * hidden..][..hidden]),
                    None => lm_head.row_into(tok as usize, row),
                }
                if *embed_scale != 1.0 {
                    row.iter_mut().for_each(|v| *v *= *embed_scale);
                }
                let (c, sn) = (&mut cos[r * half..][..half], &mut sin[r * half..][..half]);
                rope.cos_sin(pos, c, sn);
                if let Some(rl) = rope_local {
                    let (c, sn) = (
                        &mut cos_l[r * half..][..half],
                        &mut sin_l[r * half..][..half],
                    );
                    rl.cos_sin(pos, c, sn);
                }
                r += 1;
            }
        }
    }

    /// One decoder layer over all `rows` of the batch, in place on `x`.
    fn layer_forward(
        &mut self,
        layer: usize,
        seqs: &[SeqChunk<'_>],
        cache: &mut KvCache,
        rows: usize,
    ) {
        let Self {
            config: c,
            layers,
            scratch: s,
            ..
        } = self;
        let w = &layers[layer];
        let (hidden, hd, nh, nkv) = (c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads);
        let (inter, qkv_dim, eps, half) =
            (c.intermediate_size, c.qkv_dim(), c.rms_norm_eps, hd / 2);
        let x = &mut s.x[..rows * hidden];
        let h = grow(&mut s.h, rows * hidden);
        let qkv = grow(&mut s.qkv, rows * qkv_dim);
        let attn_hm = grow(&mut s.attn_hm, rows * nh * hd);
        let attn = grow(&mut s.attn, rows * nh * hd);
        let gate_up = grow(&mut s.gate_up, rows * 2 * inter);
        let act = grow(&mut s.act, rows * inter);
        let (cos, sin) = match w.window {
            Some(_) => (&s.cos_local, &s.sin_local),
            None => (&s.cos, &s.sin),
        };

        rms_norm(x, &w.input_norm, eps, h);
        linear(h, &w.qkv, qkv, rows, false);
        for r in 0..rows {
            let row = &mut qkv[r * qkv_dim..][..(nh + nkv) * hd];
            let (q, k) = row.split_at_mut(nh * hd);
            if let Some((qn, kn)) = &w.qk_norm {
                rms_norm_in_place(q, qn, eps);
                rms_norm_in_place(k, kn, eps);
            }
            let (cr, sr) = (&cos[r * half..][..half], &sin[r * half..][..half]);
            rope::apply(q, hd, cr, sr);
            rope::apply(k, hd, cr, sr);
        }
        write_kv(cache, layer, seqs, qkv, qkv_dim, nh * hd, nkv * hd);
        let shape = AttnShape {
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            q_stride: qkv_dim,
            scale: c.attention_scale(),
            window: w.window,
        };
        paged_attention(
            qkv, cache, layer, seqs, &s.row_seq, &s.row_pos, shape, attn_hm,
        );
        // [nh, T, hd] -> [T, nh * hd]
        for (hh, head) in attn_hm.chunks_exact(rows * hd).enumerate() {
            for (r, src) in head.chunks_exact(hd).enumerate() {
                attn[r * nh * hd + hh * hd..][..hd].copy_from_slice(src);
            }
        }
        let act_fn = match c.hidden_act {
            Activation::Silu => silu_mul,
            Activation::GeluTanh => gelu_tanh_mul,
        };
        match &w.ff_norms {
            None => {
                linear(attn, &w.o, x, rows, true);
                rms_norm(x, &w.post_norm, eps, h);
                linear(h, &w.gate_up, gate_up, rows, false);
                act_fn(gate_up, inter, act);
                linear(act, &w.down, x, rows, true);
            }
            Some((pre_ff, post_ff)) => {
                let delta = grow(&mut s.delta, rows * hidden);
                linear(attn, &w.o, delta, rows, false);
                rms_norm_in_place(delta, &w.post_norm, eps);
                add(x, delta);
                rms_norm(x, pre_ff, eps, h);
                linear(h, &w.gate_up, gate_up, rows, false);
                act_fn(gate_up, inter, act);
                linear(act, &w.down, delta, rows, false);
                rms_norm_in_place(delta, post_ff, eps);
                add(x, delta);
            }
        }
    }

    /// Final norm and `lm_head` on the rows that want logits (the last `logit_rows` of each
    /// chunk), only.
    fn final_logits(&mut self, seqs: &[SeqChunk<'_>], n_logits: usize, logits: &mut [f32]) {
        let (hidden, vocab) = (self.config.hidden_size, self.config.vocab_size);
        let s = &mut self.scratch;
        let final_rows = grow(&mut s.logit_rows, n_logits * hidden);
        let mut r_end = 0;
        let mut j = 0;
        for seq in seqs {
            r_end += seq.tokens.len();
            for r in r_end - seq.logit_rows..r_end {
                let row = &s.x[r * hidden..(r + 1) * hidden];
                let out = &mut final_rows[j * hidden..][..hidden];
                rms_norm(row, &self.final_norm, self.config.rms_norm_eps, out);
                j += 1;
            }
        }
        let out = &mut logits[..n_logits * vocab];
        linear(final_rows, &self.lm_head, out, n_logits, false);
    }

    /// Checks a batch against the model and cache; returns how many logits rows it writes.
    fn validate(
        &self,
        seqs: &[SeqChunk<'_>],
        cache: &KvCache,
        logits_len: usize,
    ) -> anyhow::Result<usize> {
        let c = &self.config;
        ensure!(
            cache.num_layers() == c.num_layers && cache.token_stride() == c.num_kv_heads * c.head_dim,
            "KV cache shape ({} layers, {} floats per token) does not match the model ({} layers, {})",
            cache.num_layers(),
            cache.token_stride(),
            c.num_layers,
            c.num_kv_heads * c.head_dim
        );
        let mut n_logits = 0;
        for (i, s) in seqs.iter().enumerate() {
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                bail!(
                    "chunk {i}: token id {t} outside the vocabulary ({})",
                    c.vocab_size
                );
            }
            let end = s.position + s.tokens.len();
            let need = end.div_ceil(cache.block_size());
            let tables = [
                ("", s.block_table, cache.num_blocks()),
                ("local ", s.local_block_table, cache.num_local_blocks()),
            ];
            let hybrid = cache.num_local_blocks() > 0;
            for (kind, table, blocks) in tables.into_iter().take(1 + hybrid as usize) {
                ensure!(
                    table.len() >= need,
                    "chunk {i}: {kind}block table has {} blocks, positions up to {end} need {need}",
                    table.len()
                );
                if let Some(&b) = table[..need].iter().find(|&&b| b as usize >= blocks) {
                    bail!("chunk {i}: {kind}block {b} outside the cache ({blocks} blocks)");
                }
            }
            ensure!(
                s.logit_rows <= s.tokens.len(),
                "chunk {i}: wants {} logits rows but has {} tokens",
                s.logit_rows,
                s.tokens.len()
            );
            n_logits += s.logit_rows;
        }
        ensure!(
            logits_len >= n_logits * c.vocab_size,
            "logits buffer holds {logits_len} values, {n_logits} rows of {} needed",
            c.vocab_size
        );
        Ok(n_logits)
    }
}

/// `x += d`.
fn add(x: &mut [f32], d: &[f32]) {
    for (a, b) in x.iter_mut().zip(d) {
        *a += b;
    }
}

/// Stores each row's K and V (columns `k_at..` and `k_at + kv_width..` of `qkv`) in its slot.
fn write_kv(
    cache: &mut KvCache,
    layer: usize,
    seqs: &[SeqChunk<'_>],
    qkv: &[f32],
    qkv_dim: usize,
    k_at: usize,
    kv_width: usize,
) {
    let mut r = 0;
    let local = cache.is_local(layer);
    for seq in seqs {
        let table = if local {
            seq.local_block_table
        } else {
            seq.block_table
        };
        for t in 0..seq.tokens.len() {
            let off = cache.slot_offset(table, seq.position + t);
            let row = &qkv[r * qkv_dim..][..qkv_dim];
            let (kc, vc) = cache.layer_mut(layer);
            kc[off..off + kv_width].copy_from_slice(&row[k_at..k_at + kv_width]);
            vc[off..off + kv_width].copy_from_slice(&row[k_at + kv_width..k_at + 2 * kv_width]);
            r += 1;
        }
    }
}
