//! Host-side sizing of the CUDA executor: capacities, the per-slot metadata layout, scratch and
//! KV-cache sizes. Pure arithmetic, unit tested on the CPU.
//!
//! Every decode input lives in a per-slot buffer at a fixed device address, refilled each step,
//! so a CUDA graph captured over these addresses replays any decode step of its size. The
//! metadata of a step is one array of `i32` with sections at fixed offsets:
//!
//! ```text
//!   tok_src[T]       token id from the host, or -1 - row: the row's pending (sampled) token
//!   positions[T]     position of each token in its sequence (-1: a graph batch's padding row)
//!   slot_mapping[T]  KV cache slot (block * block_size + offset) of each token
//!   tok_row[T]       backend row of each token (selects its block table)
//!   logit_rows[S]    token row whose hidden state gives each sampled sequence's logits
//!   sample_rows[S]   backend row of each sampled sequence
//!   init_rows[S]     rows re-initialised before this step (parallel to the RowParams buffer)
//!   (speculative decoding only; empty sections otherwise, see `super::spec`)
//!   samp_first[S]    first logits row of each sampled sequence ...
//!   samp_draft[S]    ... and its proposals (a round's 1 + draft rows are consecutive)
//!   place_first[S]   decode entries, placed on the device: first token ...
//!   place_n[S]       ... and token count
//!   d_*[D]           the draft's first forward of a step: tok_src, positions, slot_mapping,
//!                    tok_row (prefill chunks as above, 2 tokens per decode entry: the
//!                    token before the pending one, and the pending one)
//!   d_place[S]       first draft token of each decode entry
//!   d_logit_rows[S]  the draft token whose logits give each speculating row's 1st proposal
//!   b_*[S]           the draft's later forwards (one token per speculating row): tok_src,
//!                    positions, slot_mapping (device-written), tok_row, logit_rows
//!   bt_index[U]      new block-table entries of this step: row * B + j ...
//!   bt_value[U]      ... and the block id written there
//!   pf_tiles[2P]     prefill attention tiles: (first token, count) of up to 64 consecutive
//!                    tokens of one sequence (steps with prefill chunks only)
//!   att_list[T]      the tokens the tiles leave, for the per-token attention kernel
//! ```
//! with T = max tokens per step, S = max sequences per step (logit_rows: [`Capacities::max_logits`]),
//! D = T + S, B = max blocks per sequence,
//! U = S * B (a step may hand a whole table to every row: prefix-cache hits arrive at once) and
//! P = [`prefill_tile_cap`]. The head (up to `bt_index`) is uploaded every step; the last two
//! sections only by steps with tiles.
//!
//! Block tables live on the device per row (`(rows + 1) * B` words; the extra row belongs to
//! padding), updated by scattering only the step's new entries: the host never re-sends a
//! table, and a graph's attention reads the same address whatever the batch.

use crate::model::ModelConfig;

/// Capacities of one executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacities {
    /// Tokens per step (max_num_batched_tokens).
    pub max_tokens: usize,
    /// Sequences per step and backend rows (max_num_seqs).
    pub max_seqs: usize,
    /// Blocks per sequence: ceil(max_model_len / block_size).
    pub max_blocks_per_seq: usize,
    pub block_size: usize,
    /// Sliding-window layers keep their KV in a pool of their own, addressed through a second
    /// block table per row (`crate::scheduler::LocalKvConfig`).
    pub hybrid: bool,
    /// Speculative decoding: proposals per round (0: off).
    pub spec_k: usize,
}

impl Capacities {
    pub fn new(
        max_tokens: usize,
        max_seqs: usize,
        max_model_len: usize,
        block_size: usize,
    ) -> Self {
        Self {
            max_tokens,
            max_seqs,
            max_blocks_per_seq: max_model_len.div_ceil(block_size).max(1),
            block_size,
            hybrid: false,
            spec_k: 0,
        }
    }

    /// Capacities for speculative rounds of `k` proposals: a round's KV may reach `k`
    /// positions past `max_model_len` (its last round may overrun; the tokens are dropped).
    pub fn with_spec(mut self, k: usize, max_model_len: usize) -> Self {
        self.spec_k = k;
        self.max_blocks_per_seq = (max_model_len + k).div_ceil(self.block_size).max(1);
        self
    }

    /// Rows of logits one step can ask for: one per sampled sequence, `1 + k` per speculative
    /// round (within the token budget).
    pub fn max_logits(&self) -> usize {
        if self.spec_k == 0 {
            self.max_seqs
        } else {
            (self.max_seqs * (1 + self.spec_k))
                .min(self.max_tokens)
                .max(self.max_seqs)
        }
    }

    /// Tokens of the draft's first forward in a step: the step's prefill tokens and 2 per
    /// decode entry.
    pub fn max_draft_tokens(&self) -> usize {
        self.max_tokens + self.max_seqs
    }

    /// Words of one block-table array, `[max_seqs + 1, max_blocks_per_seq]` (the last row is
    /// the graph padding rows'). A hybrid cache's local tables follow the full ones.
    pub fn bt_words(&self) -> usize {
        (self.max_seqs + 1) * self.max_blocks_per_seq
    }
}

/// Offsets (in `i32` words) of the metadata sections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaLayout {
    pub tok_src: usize,
    pub positions: usize,
    pub slot_mapping: usize,
    /// The sliding layers' KV slots (hybrid caches; an empty section otherwise).
    pub slot_mapping_local: usize,
    pub tok_row: usize,
    pub logit_rows: usize,
    pub sample_rows: usize,
    pub init_rows: usize,
    pub samp_first: usize,
    pub samp_draft: usize,
    pub place_first: usize,
    pub place_n: usize,
    pub d_tok_src: usize,
    pub d_positions: usize,
    pub d_slot_mapping: usize,
    pub d_tok_row: usize,
    pub d_place: usize,
    pub d_logit_rows: usize,
    pub b_tok_src: usize,
    pub b_positions: usize,
    pub b_slot_mapping: usize,
    pub b_tok_row: usize,
    pub b_logit_rows: usize,
    pub bt_index: usize,
    pub bt_value: usize,
    /// Capacity of the two block-table update sections.
    pub bt_cap: usize,
    pub pf_tiles: usize,
    pub att_list: usize,
    /// Total words.
    pub len: usize,
}

impl MetaLayout {
    pub fn new(c: &Capacities) -> Self {
        // Sections start on 64-word (256-byte) boundaries.
        let round = |x: usize| x.div_ceil(64) * 64;
        let (t, s) = (round(c.max_tokens), round(c.max_seqs));
        let tok_src = 0;
        let positions = tok_src + t;
        let slot_mapping = positions + t;
        let slot_mapping_local = slot_mapping + t;
        let tok_row = slot_mapping_local + if c.hybrid { t } else { 0 };
        let logit_rows = tok_row + t;
        let sample_rows = logit_rows + round(c.max_logits());
        let init_rows = sample_rows + s;
        // Speculative sections: empty without speculation.
        let on = c.spec_k > 0;
        let (ss, d) = if on {
            (s, round(c.max_draft_tokens()))
        } else {
            (0, 0)
        };
        let samp_first = init_rows + s;
        let samp_draft = samp_first + ss;
        let place_first = samp_draft + ss;
        let place_n = place_first + ss;
        let d_tok_src = place_n + ss;
        let d_positions = d_tok_src + d;
        let d_slot_mapping = d_positions + d;
        let d_tok_row = d_slot_mapping + d;
        let d_place = d_tok_row + d;
        let d_logit_rows = d_place + ss;
        let b_tok_src = d_logit_rows + ss;
        let b_positions = b_tok_src + ss;
        let b_slot_mapping = b_positions + ss;
        let b_tok_row = b_slot_mapping + ss;
        let b_logit_rows = b_tok_row + ss;
        // A row's whole table (twice with local tables) may arrive in one step.
        let bt_cap = c.max_seqs * c.max_blocks_per_seq * if c.hybrid { 2 } else { 1 };
        let bt_index = b_logit_rows + ss;
        let bt_value = bt_index + round(bt_cap);
        let pf_tiles = bt_value + round(bt_cap);
        let att_list = pf_tiles + round(2 * prefill_tile_cap(c));
        let len = att_list + t;
        Self {
            tok_src,
            positions,
            slot_mapping,
            slot_mapping_local,
            tok_row,
            logit_rows,
            sample_rows,
            init_rows,
            samp_first,
            samp_draft,
            place_first,
            place_n,
            d_tok_src,
            d_positions,
            d_slot_mapping,
            d_tok_row,
            d_place,
            d_logit_rows,
            b_tok_src,
            b_positions,
            b_slot_mapping,
            b_tok_row,
            b_logit_rows,
            bt_index,
            bt_value,
            bt_cap,
            pf_tiles,
            att_list,
            len,
        }
    }

    pub fn bytes(&self) -> usize {
        self.len * 4
    }
}

/// Fewest tokens of one sequence in a step that go to the tiled prefill attention kernel
/// (`prefill_attention`, 64 queries per tile); shorter runs (decodes, small chunks) use the
/// per-token kernel.
pub const PREFILL_TILE_MIN: usize = 8;

/// Tiles one step can have: full tiles of the token budget plus one partial tile per sequence
/// with at least [`PREFILL_TILE_MIN`] tokens.
pub fn prefill_tile_cap(c: &Capacities) -> usize {
    c.max_tokens.div_ceil(harrier_kernels::PREFILL_TILE)
        + c.max_seqs.min(c.max_tokens / PREFILL_TILE_MIN)
}

/// Cuts a sequence's `count` tokens starting at step token `first` into prefill tiles
/// (`(first token, count)` pairs of at most 64), or `None` when it is too short for them.
pub fn prefill_tiles(first: usize, count: usize) -> Option<impl Iterator<Item = (usize, usize)>> {
    let tile = harrier_kernels::PREFILL_TILE;
    (count >= PREFILL_TILE_MIN).then(|| {
        (0..count.div_ceil(tile)).map(move |i| (first + i * tile, tile.min(count - i * tile)))
    })
}

/// (token, KV head) blocks from which single-split decode attention reads each KV head once for
/// its whole query group (`paged_attention_gqa`) instead of once per query head: below this
/// the per-head kernel's 4-8x more blocks hide latency better; above it, K/V traffic rules.
/// Measured in graphs on the H100 (session 14, 1B, context 512, ms per step, grouped vs per
/// head): batch 8 (64 blocks) 1.481 vs 1.402, batch 16 (128) 1.698 vs 1.809; docs/benchmarks.md
/// has the 3B and 8B. (It was 256 before.)
pub const GQA_MIN_BLOCKS: usize = 128;

/// Whether `tokens` per-token attention rows (no splits) whose heads have no
/// `paged_attention_grp*` instance use the grouped kernel (`paged_attention_gqa`). Where grp has
/// one it takes every count (`per_token_kernels`): at 8 warps a block from 133 blocks and 4
/// from 265 on an H200 it beat gqa by 9-19% (session 38: 1B batch 32 1.503-1.513 vs 1.367 ms a
/// step, 256 3.969-3.970 vs 3.219; 3B batch 64 4.184 vs 3.836 and 256 9.726 vs 8.407 at 8
/// warps; session 35 had measured grp at 16 warps only, where gqa won from 256 blocks).
pub fn use_grouped_attention(tokens: usize, num_kv_heads: usize) -> bool {
    tokens * num_kv_heads >= GQA_MIN_BLOCKS
}

/// Whether every token at `positions` attends to at most `keys` keys (its position + 1;
/// padding rows, at -1, to none): a split attention launch over them writes every output
/// directly and needs no `attention_combine` (short-context graphs).
pub fn fits_one_split(positions: &[i32], keys: usize) -> bool {
    positions.iter().all(|&p| i64::from(p) < keys as i64)
}

/// Most context splits of one decode attention launch (`paged_attention`).
pub const MAX_DECODE_SPLITS: usize = harrier_kernels::ATTN_MAX_SPLITS as usize;

/// Blocks a decode attention launch aims for: (token, head) pairs times splits. A decode batch
/// with fewer (token, head) pairs splits each token's context so that one block per (token,
/// head) does not leave most SMs idle (measured on the H200, 1B shape at 4,096 keys, batch 1:
/// 1.69 ms per step split vs 2.53 unsplit; at batch 8, two splits were no faster than one, so
/// 32-head models split only below batch 8; docs/benchmarks.md).
pub const DECODE_TARGET_BLOCKS: usize = 256;

/// Splits per token for a decode step of `batch` rows (the padded batch when a graph bucket
/// holds it) and `num_heads` query heads; 1 means no split.
///
/// The batch is rounded up to a power of two first, so a batch and the graph bucket it pads to
/// split alike whenever no power of two lies between them (the default buckets hold every power
/// of two): a graph run and an all-eager run of the same requests then compute bit-identical
/// attention. Without the rounding a model with few heads (Gemma 3 1B: 4) split a batch of 25
/// three ways eagerly and two ways in its bucket of 32, and greedy text could differ at a near
/// tie (check-graphs' oversize scenario, H100, 2026-11-24).
pub fn decode_attention_splits(batch: usize, num_heads: usize) -> usize {
    let batch = batch.max(1).next_power_of_two();
    DECODE_TARGET_BLOCKS
        .div_ceil(batch * num_heads.max(1))
        .clamp(1, MAX_DECODE_SPLITS)
}

/// (token, KV head, split) blocks a decode launch of `paged_attention_grp*` aims for: one wave
/// (the kernel runs one block an SM). Measured on an H200 (session 35, graphs, context 512, ms a
/// step, the per-head kernel's splits vs these): 1B batch 8 (1 -> 2 splits) 1.049-1.057 vs
/// 1.022-1.030, batch 4 (2 -> 4) 0.983-0.985 vs 0.981-0.982; 3B batch 4 (3 -> 4) 2.387-2.389 vs
/// 2.414-2.417, batch 8 (2 either way) a tie; a target of 256 lost 4-7% everywhere.
pub const GRP_TARGET_BLOCKS: usize = 128;

/// Splits per token for a decode step of `batch` rows whose attention runs
/// `paged_attention_grp*` ([`GRP_TARGET_BLOCKS`] over the (token, KV head) pairs), the batch
/// rounded up to a power of two as [`decode_attention_splits`] does, and never more partials
/// (`batch * num_heads * splits`) than the buffer holds (`2 * DECODE_TARGET_BLOCKS`).
pub fn grp_decode_splits(batch: usize, num_heads: usize, num_kv_heads: usize) -> usize {
    let batch = batch.max(1).next_power_of_two();
    let cap = (2 * DECODE_TARGET_BLOCKS / (batch * num_heads.max(1))).max(1);
    GRP_TARGET_BLOCKS
        .div_ceil(batch * num_kv_heads.max(1))
        .min(cap)
        .clamp(1, MAX_DECODE_SPLITS)
}

/// The batch sizes with a captured decode graph, and the padding decision as a table lookup.
///
/// A decode-only step of `n` sequences replays the graph of the smallest bucket `>= n`
/// (padding rows fill the rest); `n` above the largest bucket runs eagerly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphBuckets {
    sizes: Vec<usize>,
    /// `by_batch[n]` = index in `sizes` of the bucket for `n` sequences (`n` in 1..=largest).
    by_batch: Vec<u16>,
}

impl GraphBuckets {
    /// Buckets from `sizes` (any order, duplicates and zeros ignored), capped at `max_batch`
    /// (sizes above it are dropped; `max_batch` = min(max_num_seqs, max_num_batched_tokens)).
    pub fn new(sizes: &[usize], max_batch: usize) -> Self {
        let mut sizes: Vec<usize> = sizes
            .iter()
            .copied()
            .filter(|&s| s >= 1 && s <= max_batch)
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        let largest = sizes.last().copied().unwrap_or(0);
        let mut by_batch = vec![0u16; largest + 1];
        let mut i = 0;
        for (n, b) in by_batch.iter_mut().enumerate().skip(1) {
            while sizes[i] < n {
                i += 1;
            }
            *b = i as u16;
        }
        Self { sizes, by_batch }
    }

    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    pub fn is_empty(&self) -> bool {
        self.sizes.is_empty()
    }

    /// `(bucket index, bucket size)` for a decode batch of `n`; `None`: run eagerly.
    pub fn bucket_for(&self, n: usize) -> Option<(usize, usize)> {
        if n == 0 || n >= self.by_batch.len() {
            return None;
        }
        let i = self.by_batch[n] as usize;
        Some((i, self.sizes[i]))
    }
}

/// Bytes of each persistent activation buffer for `max_tokens` rows (elements of the model's
/// storage type, `elem` bytes each, unless noted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScratchSizes {
    pub x: usize,
    pub h: usize,
    pub qkv: usize,
    pub attn: usize,
    pub delta: usize,
    pub gate_up: usize,
    pub act: usize,
    /// f32 logits, [`Capacities::max_logits`] rows.
    pub logits: usize,
    /// Final-normed rows that want logits, as many rows.
    pub final_h: usize,
    /// f32 partials of split decode attention: `max_seqs * nh * splits * (hd + 2)`.
    pub attn_part: usize,
    /// f32 partial sums of squares of a deferred RMSNorm (fused steps of up to
    /// `SKINNY_MAX_M` rows; `harrier_kernels::deferred_norm_partials`).
    pub norm_ss: usize,
    /// Penalty state of every row: u16 output counts `[max_seqs, vocab]` and prompt bits
    /// `[max_seqs, ceil(vocab / 32)]` u32 (see `init_row_state` in harrier.cu).
    pub penalty_counts: usize,
    pub penalty_seen: usize,
    /// logit_bias entries of every row: i32 ids and f32 values, `[max_seqs, LOGIT_BIAS_CAP]`
    /// each (this is both).
    pub logit_bias: usize,
}

impl ScratchSizes {
    pub fn new(m: &ModelConfig, c: &Capacities, elem: usize) -> Self {
        let t = c.max_tokens;
        Self {
            x: t * m.hidden_size * elem,
            h: t * m.hidden_size * elem,
            qkv: t * m.qkv_dim() * elem,
            attn: t * m.num_heads * m.head_dim * elem,
            delta: t * m.hidden_size * elem,
            gate_up: t * 2 * m.intermediate_size * elem,
            act: t * m.intermediate_size * elem,
            logits: c.max_logits() * m.vocab_size * 4,
            final_h: c.max_logits() * m.hidden_size * elem,
            // Splits only when batch * heads < DECODE_TARGET_BLOCKS, so batch * heads * splits
            // < 2 * DECODE_TARGET_BLOCKS.
            attn_part: 2 * DECODE_TARGET_BLOCKS * (m.head_dim + 2) * 4,
            norm_ss: harrier_kernels::deferred_norm_partials(
                t.min(harrier_kernels::SKINNY_MAX_M),
                m.hidden_size,
            ) * 4,
            penalty_counts: c.max_seqs * m.vocab_size * 2,
            penalty_seen: c.max_seqs * m.vocab_size.div_ceil(32) * 4,
            logit_bias: 2 * c.max_seqs * harrier_kernels::LOGIT_BIAS_CAP * 4,
        }
    }

    pub fn total(&self) -> usize {
        self.x
            + self.h
            + self.qkv
            + self.attn
            + self.delta
            + self.gate_up
            + self.act
            + self.logits
            + self.final_h
            + self.attn_part
            + self.norm_ss
            + self.penalty_counts
            + self.penalty_seen
            + self.logit_bias
    }
}

/// Bytes of one KV block (K and V of every layer), `elem` bytes per element.
pub fn kv_bytes_per_block(m: &ModelConfig, block_size: usize, elem: usize) -> usize {
    m.num_layers * 2 * block_size * m.num_kv_heads * m.head_dim * elem
}

/// Bytes of one block of the sliding layers' pool of a hybrid cache (their K and V only).
pub fn local_kv_bytes_per_block(m: &ModelConfig, block_size: usize, elem: usize) -> usize {
    m.num_sliding_layers() * 2 * block_size * m.num_kv_heads * m.head_dim * elem
}

/// Bytes of the weights as uploaded, `elem` bytes per element (fused q|k|v and gate|up;
/// lm_head only when untied).
pub fn weight_bytes(m: &ModelConfig, elem: usize) -> usize {
    let (h, i) = (m.hidden_size, m.intermediate_size);
    let per_layer = m.qkv_dim() * h
        + m.num_heads * m.head_dim * h
        + 3 * i * h
        + if m.architecture.sandwich_norms() {
            4
        } else {
            2
        } * h
        + if m.architecture.has_qk_norm() {
            2 * m.head_dim
        } else {
            0
        };
    let embed = m.vocab_size * h;
    let head = if m.tie_word_embeddings {
        0
    } else {
        m.vocab_size * h
    };
    elem * (m.num_layers * per_layer + embed + head + h)
}

/// KV blocks that fit: `total * utilization - used` bytes (used: everything allocated so far,
/// by us and anyone else), at least 0.
pub fn kv_blocks_for(total: usize, used: usize, utilization: f64, bytes_per_block: usize) -> usize {
    let budget = (total as f64 * utilization) as usize;
    budget.saturating_sub(used) / bytes_per_block.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama1b() -> ModelConfig {
        crate::gen_model::Preset::from_name("llama-3.2-1b")
            .unwrap()
            .config()
    }

    #[test]
    fn layout_sections_do_not_overlap() {
        let c = Capacities::new(2048, 256, 131_072, 16);
        assert_eq!(c.max_blocks_per_seq, 8192);
        let l = MetaLayout::new(&c);
        assert_eq!(l.bt_cap, 256 * 8192);
        let sections = [
            (l.tok_src, 2048),
            (l.positions, 2048),
            (l.slot_mapping, 2048),
            (l.tok_row, 2048),
            (l.logit_rows, 256),
            (l.sample_rows, 256),
            (l.init_rows, 256),
            (l.bt_index, l.bt_cap),
            (l.bt_value, l.bt_cap),
            (l.pf_tiles, 2 * prefill_tile_cap(&c)),
            (l.att_list, 2048),
        ];
        for w in sections.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{sections:?}");
        }
        assert_eq!(prefill_tile_cap(&c), 32 + 256);
        assert_eq!(l.att_list + 2048, l.len);
        for (off, _) in sections {
            assert_eq!(off % 64, 0);
        }
        // Odd capacities round up.
        let l = MetaLayout::new(&Capacities::new(3, 1, 17, 16));
        assert_eq!((l.positions, l.bt_index), (64, 4 * 64 + 3 * 64));
        assert_eq!((l.bt_cap, l.bt_value), (2, 8 * 64));
        assert_eq!((l.pf_tiles, l.att_list, l.len), (9 * 64, 10 * 64, 11 * 64));
    }

    #[test]
    fn speculative_sections_fit_their_capacities() {
        let c = Capacities::new(2048, 256, 4096, 16).with_spec(4, 4096);
        // The KV of a last round may reach k positions past max_model_len.
        assert_eq!(c.max_blocks_per_seq, (4096 + 4usize).div_ceil(16));
        assert_eq!(c.max_logits(), 1280);
        assert_eq!(c.max_draft_tokens(), 2048 + 256);
        let l = MetaLayout::new(&c);
        let d = c.max_draft_tokens();
        let sections = [
            (l.tok_src, 2048),
            (l.positions, 2048),
            (l.slot_mapping, 2048),
            (l.tok_row, 2048),
            (l.logit_rows, 1280),
            (l.sample_rows, 256),
            (l.init_rows, 256),
            (l.samp_first, 256),
            (l.samp_draft, 256),
            (l.place_first, 256),
            (l.place_n, 256),
            (l.d_tok_src, d),
            (l.d_positions, d),
            (l.d_slot_mapping, d),
            (l.d_tok_row, d),
            (l.d_place, 256),
            (l.d_logit_rows, 256),
            (l.b_tok_src, 256),
            (l.b_positions, 256),
            (l.b_slot_mapping, 256),
            (l.b_tok_row, 256),
            (l.b_logit_rows, 256),
            (l.bt_index, l.bt_cap),
        ];
        for w in sections.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{sections:?}");
        }
        // Logits: 1 + k rows per round, capped by the token budget.
        assert_eq!(
            Capacities::new(64, 32, 256, 16)
                .with_spec(4, 256)
                .max_logits(),
            64
        );
        assert_eq!(
            Capacities::new(8, 32, 256, 16)
                .with_spec(4, 256)
                .max_logits(),
            32
        );
        // Without speculation the sections are empty.
        let l = MetaLayout::new(&Capacities::new(2048, 256, 4096, 16));
        assert_eq!(l.bt_index, l.samp_first);
    }

    #[test]
    fn short_contexts_fit_one_split() {
        // 512 keys: positions 0..=511 (the token's own key included).
        assert!(fits_one_split(&[0, 511, -1], 512));
        assert!(!fits_one_split(&[3, 512], 512));
        assert!(fits_one_split(&[], 512));
        assert!(!fits_one_split(&[0], 0));
        assert!(fits_one_split(&[-1, -1], 0));
    }

    #[test]
    fn grp_splits_fill_a_wave_within_the_partials_buffer() {
        // Llama 1B (32 heads over 8): 4 rows 4 splits, 8 rows 2, 16 rows 1; 5 rows as 8.
        assert_eq!(grp_decode_splits(4, 32, 8), 4);
        assert_eq!(grp_decode_splits(8, 32, 8), 2);
        assert_eq!(grp_decode_splits(5, 32, 8), 2);
        assert_eq!(grp_decode_splits(16, 32, 8), 1);
        assert_eq!(grp_decode_splits(64, 32, 8), 1);
        // 3B (24 over 8): 4 rows 4 splits.
        assert_eq!(grp_decode_splits(4, 24, 8), 4);
        for (nh, nkv) in [(32, 8), (24, 8), (16, 8), (8, 2), (4, 1), (64, 8), (12, 3)] {
            for b in 1..=64 {
                let n = grp_decode_splits(b, nh, nkv);
                let padded = b.next_power_of_two();
                assert!((1..=MAX_DECODE_SPLITS).contains(&n));
                assert!(
                    padded * nh * n <= 2 * DECODE_TARGET_BLOCKS || n == 1,
                    "{b} {nh} {nkv}"
                );
                assert_eq!(n, grp_decode_splits(padded, nh, nkv));
            }
        }
    }

    #[test]
    fn grouped_attention_from_enough_blocks() {
        assert!(!use_grouped_attention(15, 8));
        assert!(use_grouped_attention(16, 8));
        assert!(use_grouped_attention(256, 1));
        assert!(!use_grouped_attention(0, 8));
    }

    #[test]
    fn prefill_tiles_cover_long_runs_only() {
        assert!(prefill_tiles(5, PREFILL_TILE_MIN - 1).is_none());
        let t: Vec<_> = prefill_tiles(3, 8).unwrap().collect();
        assert_eq!(t, [(3, 8)]);
        let t: Vec<_> = prefill_tiles(10, 130).unwrap().collect();
        assert_eq!(t, [(10, 64), (74, 64), (138, 2)]);
        let t: Vec<_> = prefill_tiles(0, 128).unwrap().collect();
        assert_eq!(t, [(0, 64), (64, 64)]);
        // The capacity holds the worst case: every sequence just long enough, plus full tiles.
        let c = Capacities::new(100, 20, 64, 16);
        let worst = 100 / PREFILL_TILE_MIN; // 12 sequences of 8 tokens
        assert!(prefill_tile_cap(&c) >= worst);
    }

    #[test]
    fn decode_attention_splits_by_batch() {
        // 32 heads (1B/3B/8B): 8 splits at batch 1, 2 at batch 3-4, none from 5 (rounded to 8).
        let s = |b| decode_attention_splits(b, 32);
        assert_eq!([1, 2, 3, 4, 5, 7, 8, 256].map(s), [8, 4, 2, 2, 1, 1, 1, 1]);
        // A batch and the default bucket it pads to split alike, for any head count.
        let buckets = GraphBuckets::new(&crate::config::default_graph_sizes(256), 256);
        for heads in [1usize, 4, 8, 16, 32] {
            for b in 1..=256 {
                let (_, padded) = buckets.bucket_for(b).expect("bucket");
                assert_eq!(
                    decode_attention_splits(b, heads),
                    decode_attention_splits(padded, heads),
                    "batch {b} (bucket {padded}), {heads} heads"
                );
            }
        }
        // 16 heads (0.6B): 16 at batch 1; 4 heads: the cap.
        assert_eq!(decode_attention_splits(1, 16), 16);
        assert_eq!(decode_attention_splits(1, 4), MAX_DECODE_SPLITS);
        // The partial buffer holds every split launch.
        for heads in [4usize, 16, 32, 64] {
            for b in 1..=256 {
                let n = decode_attention_splits(b, heads);
                if n > 1 {
                    assert!(b * heads * n < 2 * DECODE_TARGET_BLOCKS, "{b} {heads}");
                }
            }
        }
    }

    #[test]
    fn graph_buckets_pad_to_the_next_size() {
        assert_eq!(
            crate::config::default_graph_sizes(256),
            [
                1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224,
                240, 256
            ]
        );
        assert_eq!(
            crate::config::default_graph_sizes(40),
            [1, 2, 4, 8, 16, 24, 32, 40]
        );
        assert_eq!(
            crate::config::default_graph_sizes(50),
            [1, 2, 4, 8, 16, 24, 32, 48, 50]
        );
        assert_eq!(crate::config::default_graph_sizes(4), [1, 2, 4]);
        let b = GraphBuckets::new(&crate::config::default_graph_sizes(256), 256);
        let pad = |n| b.bucket_for(n).map(|(_, s)| s);
        assert_eq!(
            [1, 3, 5, 8, 9, 17, 33, 49, 255, 256].map(pad),
            [1, 4, 8, 8, 16, 24, 48, 64, 256, 256].map(Some)
        );
        assert_eq!((pad(0), pad(257)), (None, None));
        // Every batch gets the smallest bucket that holds it.
        for n in 1..=256 {
            let (i, s) = b.bucket_for(n).unwrap();
            assert_eq!(b.sizes()[i], s);
            assert!(s >= n && (i == 0 || b.sizes()[i - 1] < n), "{n} -> {s}");
        }
        // User sizes: unsorted, duplicates, zero and sizes above the cap dropped.
        let b = GraphBuckets::new(&[8, 0, 2, 8, 300, 5], 64);
        assert_eq!(b.sizes(), [2, 5, 8]);
        assert_eq!(b.bucket_for(1), Some((0, 2)));
        assert_eq!(b.bucket_for(9), None);
        let none = GraphBuckets::new(&[], 64);
        assert!(none.is_empty() && none.bucket_for(1).is_none());
    }

    #[test]
    fn sizes_of_the_1b_shape() {
        let m = llama1b();
        // Llama 3.2 1B: 1.236e9 parameters incl. the tied embedding -> ~2.47 GB in bf16.
        let w = weight_bytes(&m, 2);
        assert!((2_400_000_000..2_520_000_000).contains(&w), "{w}");
        assert_eq!(weight_bytes(&m, 4), 2 * w);
        // 16 layers * 2 * 16 tokens * 8 heads * 64 dims * 2 bytes = 512 KiB per block.
        assert_eq!(kv_bytes_per_block(&m, 16, 2), 16 * 2 * 16 * 8 * 64 * 2);
        assert_eq!(kv_bytes_per_block(&m, 16, 4), 16 * 2 * 16 * 8 * 64 * 4);
        let caps = Capacities::new(2048, 256, 4096, 16);
        let s = ScratchSizes::new(&m, &caps, 2);
        assert_eq!(s.logits, 256 * 128_256 * 4);
        assert_eq!(s.gate_up, 2048 * 2 * 8192 * 2);
        assert!(s.total() > s.logits);
        assert_eq!(s.attn_part, 2 * 256 * 66 * 4);
        // A deferred norm's partials: 64 rows x 2,048 / 16 columns.
        assert_eq!(s.norm_ss, 64 * 128 * 4);
        // Penalty state: 2 bytes per (row, token) plus one bit.
        assert_eq!(s.penalty_counts, 256 * 128_256 * 2);
        assert_eq!(s.penalty_seen, 256 * 4008 * 4);
        assert_eq!(s.logit_bias, 2 * 256 * 1024 * 4);
        // fp32 doubles the activations, not the f32 logits, partials or penalty state.
        let s4 = ScratchSizes::new(&m, &caps, 4);
        assert_eq!(s4.gate_up, 2 * s.gate_up);
        assert_eq!(s4.final_h, 2 * s.final_h);
        assert_eq!(
            (s4.logits, s4.attn_part, s4.penalty_counts),
            (s.logits, s.attn_part, s.penalty_counts)
        );
    }

    #[test]
    fn kv_budget() {
        assert_eq!(kv_blocks_for(100, 50, 0.9, 10), 4);
        assert_eq!(kv_blocks_for(100, 95, 0.9, 10), 0);
        assert_eq!(
            kv_blocks_for(80 << 30, 10 << 30, 0.9, 1 << 20),
            ((72usize << 30) - (10 << 30)) >> 20
        );
    }
}
