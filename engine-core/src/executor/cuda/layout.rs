//! Host-side sizing of the CUDA executor: capacities, the per-slot metadata layout, scratch and
//! KV-cache sizes. Pure arithmetic, unit tested on the CPU.
//!
//! Every decode input lives in a per-slot buffer at a fixed device address, refilled each step
//! (the CUDA-graphs follow-up captures the decode step over exactly these buffers). The
//! metadata of a step is one array of `i32` with sections at fixed offsets:
//!
//! ```text
//!   tok_src[T]       token id from the host, or -1 - row: the row's pending (sampled) token
//!   positions[T]     position of each token in its sequence
//!   slot_mapping[T]  KV cache slot (block * block_size + offset) of each token
//!   tok_seq[T]       sequence index of each token
//!   logit_rows[S]    token row whose hidden state gives each sampled sequence's logits
//!   sample_rows[S]   backend row of each sampled sequence
//!   init_rows[S]     rows re-initialised before this step (parallel to the RowParams buffer)
//!   block_tables[S * B]  each sequence's block table, `bt_stride` (<= B) entries apart
//! ```
//! with T = max tokens per step, S = max sequences per step, B = max blocks per sequence.

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
        }
    }
}

/// Offsets (in `i32` words) of the metadata sections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaLayout {
    pub tok_src: usize,
    pub positions: usize,
    pub slot_mapping: usize,
    pub tok_seq: usize,
    pub logit_rows: usize,
    pub sample_rows: usize,
    pub init_rows: usize,
    pub block_tables: usize,
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
        let tok_seq = slot_mapping + t;
        let logit_rows = tok_seq + t;
        let sample_rows = logit_rows + s;
        let init_rows = sample_rows + s;
        let block_tables = init_rows + s;
        let len = block_tables + round(c.max_seqs * c.max_blocks_per_seq);
        Self {
            tok_src,
            positions,
            slot_mapping,
            tok_seq,
            logit_rows,
            sample_rows,
            init_rows,
            block_tables,
            len,
        }
    }

    pub fn bytes(&self) -> usize {
        self.len * 4
    }
}

/// Bytes of each persistent activation buffer for `max_tokens` rows (bf16 unless noted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScratchSizes {
    pub x: usize,
    pub h: usize,
    pub qkv: usize,
    pub attn: usize,
    pub delta: usize,
    pub gate_up: usize,
    pub act: usize,
    /// f32 logits, `max_seqs` rows.
    pub logits: usize,
    /// Final-normed rows that want logits, `max_seqs` rows.
    pub final_h: usize,
}

impl ScratchSizes {
    pub fn new(m: &ModelConfig, c: &Capacities) -> Self {
        let t = c.max_tokens;
        Self {
            x: t * m.hidden_size * 2,
            h: t * m.hidden_size * 2,
            qkv: t * m.qkv_dim() * 2,
            attn: t * m.num_heads * m.head_dim * 2,
            delta: t * m.hidden_size * 2,
            gate_up: t * 2 * m.intermediate_size * 2,
            act: t * m.intermediate_size * 2,
            logits: c.max_seqs * m.vocab_size * 4,
            final_h: c.max_seqs * m.hidden_size * 2,
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
    }
}

/// Bytes of one KV block (K and V of every layer), bf16.
pub fn kv_bytes_per_block(m: &ModelConfig, block_size: usize) -> usize {
    m.num_layers * 2 * block_size * m.num_kv_heads * m.head_dim * 2
}

/// Bytes of the bf16 weights as uploaded (fused q|k|v and gate|up; lm_head only when untied).
pub fn weight_bytes(m: &ModelConfig) -> usize {
    let (h, i) = (m.hidden_size, m.intermediate_size);
    let per_layer = m.qkv_dim() * h
        + m.num_heads * m.head_dim * h
        + 3 * i * h
        + 2 * h
        + if matches!(m.architecture, crate::model::Architecture::Qwen3) {
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
    2 * (m.num_layers * per_layer + embed + head + h)
}

/// KV blocks that fit: `total * utilization - used` bytes (used: everything allocated so far,
/// by us and anyone else), at least 0.
pub fn kv_blocks_for(total: usize, used: usize, utilization: f64, bytes_per_block: usize) -> usize {
    let budget = (total as f64 * utilization) as usize;
    budget.saturating_sub(used) / bytes_per_block.max(1)
}

/// Llama's inverse frequencies (with Llama 3 scaling), as `model/rope.rs` and transformers.
pub fn inv_freq(m: &ModelConfig) -> Vec<f32> {
    let dim = m.head_dim;
    let base = m.rope_theta;
    (0..dim / 2)
        .map(|i| {
            let f = 1.0 / base.powf((2 * i) as f32 / dim as f32);
            match &m.rope_scaling {
                None => f,
                Some(s) => {
                    let old = s.original_max_position_embeddings as f32;
                    let low = old / s.low_freq_factor;
                    let high = old / s.high_freq_factor;
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high {
                        f
                    } else if wavelen > low {
                        f / s.factor
                    } else {
                        let smooth = (old / wavelen - s.low_freq_factor)
                            / (s.high_freq_factor - s.low_freq_factor);
                        (1.0 - smooth) * f / s.factor + smooth * f
                    }
                }
            }
        })
        .collect()
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
        let sections = [
            (l.tok_src, 2048),
            (l.positions, 2048),
            (l.slot_mapping, 2048),
            (l.tok_seq, 2048),
            (l.logit_rows, 256),
            (l.sample_rows, 256),
            (l.init_rows, 256),
            (l.block_tables, 256 * 8192),
        ];
        for w in sections.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{sections:?}");
        }
        assert!(l.block_tables + 256 * 8192 <= l.len);
        for (off, _) in sections {
            assert_eq!(off % 64, 0);
        }
        // Odd capacities round up.
        let l = MetaLayout::new(&Capacities::new(3, 1, 17, 16));
        assert_eq!((l.positions, l.block_tables), (64, 4 * 64 + 3 * 64));
    }

    #[test]
    fn sizes_of_the_1b_shape() {
        let m = llama1b();
        // Llama 3.2 1B: 1.236e9 parameters incl. the tied embedding -> ~2.47 GB in bf16.
        let w = weight_bytes(&m);
        assert!((2_400_000_000..2_520_000_000).contains(&w), "{w}");
        // 16 layers * 2 * 16 tokens * 8 heads * 64 dims * 2 bytes = 512 KiB per block.
        assert_eq!(kv_bytes_per_block(&m, 16), 16 * 2 * 16 * 8 * 64 * 2);
        let s = ScratchSizes::new(&m, &Capacities::new(2048, 256, 4096, 16));
        assert_eq!(s.logits, 256 * 128_256 * 4);
        assert_eq!(s.gate_up, 2048 * 2 * 8192 * 2);
        assert!(s.total() > s.logits);
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

    #[test]
    fn inv_freq_matches_the_formula() {
        let m = llama1b();
        let f = inv_freq(&m);
        assert_eq!(f.len(), m.head_dim / 2);
        assert_eq!(f[0], 1.0);
        // Llama 3 scaling divides the lowest frequencies by the factor (32 for 3.2).
        let raw = 1.0
            / m.rope_theta
                .powf((m.head_dim - 2) as f32 / m.head_dim as f32);
        assert!(
            (f[f.len() - 1] - raw / 32.0).abs() < 1e-12,
            "{} {}",
            f[f.len() - 1],
            raw / 32.0
        );
    }
}
