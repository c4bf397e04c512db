//! Causal GQA attention over the paged KV cache (CPU).
//!
//! The batch is a flat list of rows (query tokens) from any mix of prefill chunks and single-
//! token decodes. Row `r` belongs to sequence `row_seq[r]` at absolute position `row_pos[r]`;
//! its K/V (and those of every earlier position of its sequence) are already in the cache, so
//! causality is simply "attend to positions `0 ..= row_pos[r]`" — within a chunk that is the
//! causal mask, across chunks it is the cached prefix. A sliding-window layer (window `w`)
//! attends to `row_pos[r] - w + 1 ..= row_pos[r]` only.
//!
//! For each (query head `h`, row `r`), with `g = num_heads / num_kv_heads`:
//!
//! ```text
//!   kvh = h / g
//!   for each block b of the row's block table (until position row_pos[r]):
//!       for each slot o in block b:  s_j = q · K[b, o, kvh, :] / sqrt(head_dim)
//!   p = softmax(s)                       (max-subtracted, f32)
//!   out[h, r, :] = Σ_j p_j V[b_j, o_j, kvh, :]
//! ```
//!
//! K/V are read in place from the blocks; nothing is gathered. The (head, row) items are
//! independent and run on rayon (a sequence with many rows or heads spreads over all cores;
//! rayon groups adjacent rows when items are small). The output is head-major
//! `[num_heads, rows, head_dim]` so each item owns one contiguous slice.

use std::cell::RefCell;

use rayon::prelude::*;

use super::kv_cache::KvCache;
use super::ops::{axpy, dot};
use super::SeqChunk;

/// Below this many multiply-adds the whole batch runs on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 16;

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Shapes of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Row stride of `q` (the fused q|k|v row width).
    pub q_stride: usize,
    /// Softmax scale of the scores (`head_dim^-1/2`, or Gemma's `query_pre_attn_scalar^-1/2`).
    pub scale: f32,
    /// Sliding window: the row at `p` attends to positions `p - w + 1 ..= p` only.
    pub window: Option<usize>,
}

/// Attention of layer `layer` for every row; see the module doc.
///
/// `q` holds the rows' (roped, normed) queries at column `h * head_dim` of each row;
/// `out_hm` is `[num_heads, rows, head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &[f32],
    cache: &KvCache,
    layer: usize,
    seqs: &[SeqChunk<'_>],
    row_seq: &[u32],
    row_pos: &[u32],
    shape: AttnShape,
    out_hm: &mut [f32],
) {
    let AttnShape {
        num_heads,
        num_kv_heads,
        head_dim,
        q_stride,
        scale,
        window,
    } = shape;
    let rows = row_seq.len();
    debug_assert_eq!(out_hm.len(), num_heads * rows * head_dim);
    let group = num_heads / num_kv_heads;
    let (k_cache, v_cache) = cache.layer(layer);
    let local = cache.is_local(layer);

    let item = |idx: usize, out: &mut [f32]| {
        let (h, r) = (idx / rows, idx % rows);
        let seq = &seqs[row_seq[r] as usize];
        let ctx = row_pos[r] as usize + 1;
        let start = window.map_or(0, |w| ctx.saturating_sub(w));
        let kv_off = (h / group) * head_dim;
        let qv = &q[r * q_stride + h * head_dim..][..head_dim];
        // Offsets of the K/V rows of positions start..ctx, read through the block table.
        let table = if local {
            seq.local_block_table
        } else {
            seq.block_table
        };
        let rows_of = || (start..ctx).map(|p| cache.slot_offset(table, p) + kv_off);
        SCORES.with_borrow_mut(|scores| {
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for off in rows_of() {
                let s = dot(qv, &k_cache[off..][..head_dim]) * scale;
                max = max.max(s);
                scores.push(s);
            }
            let mut sum = 0.0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let inv = 1.0 / sum;
            out.fill(0.0);
            for (off, &s) in rows_of().zip(scores.iter()) {
                axpy(s * inv, &v_cache[off..][..head_dim], out);
            }
        });
    };

    let visible = |p: u32| {
        let ctx = p as usize + 1;
        window.map_or(ctx, |w| ctx.min(w))
    };
    let work: usize = row_pos.iter().map(|&p| visible(p)).sum::<usize>() * num_heads * head_dim;
    if work < PARALLEL_MIN_WORK {
        out_hm
            .chunks_mut(head_dim)
            .enumerate()
            .for_each(|(i, o)| item(i, o));
    } else {
        let avg_ctx = work / (num_heads * head_dim * rows.max(1));
        let min_len = (4096 / (avg_ctx * head_dim).max(1)).max(1);
        out_hm
            .par_chunks_mut(head_dim)
            .enumerate()
            .with_min_len(min_len)
            .for_each(|(i, o)| item(i, o));
    }
}
