//! A step's metadata, filled on the host into the slot's pinned buffer (pure: no CUDA calls,
//! unit tested on the CPU). The section layout is [`MetaLayout`]'s.

use std::ops::Range;

use super::layout::{prefill_tiles, Capacities, MetaLayout};
use crate::batch::{ExecBatch, RowInit, StepOutput};
use crate::sampling::RowSampler;
use harrier_kernels::{LOGIT_BIAS_CAP, MASK_CAP};
use harrier_shared::protocol::{TokenId, TokenLogprobs};

/// Host mirror of a backend row.
pub(crate) struct HostRow {
    /// The row's block table as the device holds it (entries are appended, never rewritten,
    /// until the row is re-initialised).
    pub block_table: Vec<u32>,
    /// The sliding-window layers' table (hybrid caches); entries the scheduler gave back stay
    /// here stale (no token reads them).
    pub local_block_table: Vec<u32>,
    /// A sample was launched for this row: its pending token exists on the device.
    pub has_pending: bool,
    /// `Some` when this row samples on the host.
    pub host_sampler: Option<RowSampler>,
}

impl HostRow {
    pub fn new(host_sampler: Option<RowSampler>) -> Self {
        Self {
            block_table: Vec::new(),
            local_block_table: Vec::new(),
            has_pending: false,
            host_sampler,
        }
    }
}

/// How much of each section [`fill_step`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StepCounts {
    pub tokens: usize,
    pub samples: usize,
    /// Logits rows (`samples` without speculation; `1 + draft` per speculative round).
    pub logits: usize,
    /// Decode entries placed on the device (`place_first` / `place_n`; speculation only).
    pub placed: usize,
    /// New block-table entries (`bt_index` / `bt_value`).
    pub bt_updates: usize,
    /// Prefill attention tiles (`pf_tiles`) and the tokens they leave (`att_list`); both 0
    /// unless tiling was asked for and some sequence has a long enough run.
    pub pf_tiles: usize,
    pub att_listed: usize,
}

// Every logit_bias the API accepts fits the device's per-row capacity.
const _: () = assert!(LOGIT_BIAS_CAP >= harrier_shared::protocol::MAX_LOGIT_BIAS);

/// Where a row init's sampling runs, decided at its init (pure; the executor acts on it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RowPlan {
    /// Sampled on the host (`RowSampler`): logprobs, a min_tokens mask longer than
    /// `MASK_CAP`, or device state that does not fit this step's staging.
    pub host: bool,
    /// Device penalties (prompt bits and output counts kept for the row).
    pub penalties: bool,
    /// logit_bias entries on the device.
    pub bias: usize,
    /// Words the init stages for `init_row_state` (0: nothing to stage).
    pub words: usize,
}

impl RowPlan {
    /// The plan for `init` when `words_left` staging words remain in this step.
    pub fn new(init: &RowInit, words_left: usize) -> RowPlan {
        let p = &init.sampling;
        let penalties =
            p.repetition_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0;
        let bias = p.logit_bias.len();
        let words = if penalties {
            init.prompt.len() + init.output.len()
        } else {
            0
        } + 2 * bias;
        let host = p.logprobs.is_some()
            || init.min_tokens_mask.len() > MASK_CAP
            || bias > LOGIT_BIAS_CAP
            || words > words_left;
        if host {
            return RowPlan {
                host,
                penalties: false,
                bias: 0,
                words: 0,
            };
        }
        RowPlan {
            host,
            penalties,
            bias,
            words,
        }
    }
}

/// Stages the `i`-th device-state row init of a step for `init_row_state` in the slot's
/// buffer, laid out as `[rows (max_rows) | offsets (3 max_rows + 1) | data]`: rows[i] = the row;
/// offsets[3i..3i+4] = where its prompt tokens, its earlier output tokens and its logit_bias
/// (token, f32 bits) pairs start in the data section, and where they end (the next row's
/// start). Data starts at `before` words; the caller checked that `plan.words` fit.
pub(crate) fn stage_row_state(
    buf: &mut [i32],
    max_rows: usize,
    i: usize,
    before: usize,
    init: &RowInit,
    plan: &RowPlan,
) {
    let (offs, base) = (max_rows, 4 * max_rows + 1);
    let (np, no) = if plan.penalties {
        (init.prompt.len(), init.output.len())
    } else {
        (0, 0)
    };
    buf[i] = init.row.0 as i32;
    buf[offs + 3 * i] = before as i32;
    buf[offs + 3 * i + 1] = (before + np) as i32;
    buf[offs + 3 * i + 2] = (before + np + no) as i32;
    buf[offs + 3 * i + 3] = (before + plan.words) as i32;
    let data = &mut buf[base + before..base + before + plan.words];
    let (tokens, pairs) = data.split_at_mut(np + no);
    for (d, &t) in tokens
        .iter_mut()
        .zip(init.prompt.iter().take(np).chain(&init.output[..no]))
    {
        *d = t as i32;
    }
    for (d, &(t, b)) in pairs.chunks_exact_mut(2).zip(&init.sampling.logit_bias) {
        d[0] = t as i32;
        d[1] = b.to_bits() as i32;
    }
}

/// Whether every sequence of `batch` decodes one token and samples it: a step a captured
/// decode graph can run.
pub(crate) fn is_decode_only(batch: &ExecBatch) -> bool {
    !batch.seqs.is_empty() && batch.seqs.iter().all(|q| q.num_tokens == 1 && q.sample)
}

/// Writes `batch`'s token and sequence sections and its new block-table entries
/// (`row * max_blocks_per_seq + index`, block) into `meta`, appends the new blocks to the
/// rows' mirrors and marks sampled rows as having a pending token. `host_samples` gets
/// (sample index, row) of the rows that sample on the host. With `tiled`, runs of a
/// sequence's tokens long enough for the tiled prefill attention kernel are cut into tiles and
/// the other tokens listed for the per-token kernel (see [`prefill_tiles`]). The batch must
/// have been validated: every row initialised, every table long enough for its positions.
pub(crate) fn fill_step(
    meta: &mut [i32],
    l: &MetaLayout,
    caps: &Capacities,
    batch: &ExecBatch,
    rows: &mut [Option<HostRow>],
    host_samples: &mut Vec<(usize, u32)>,
    tiled: bool,
) -> StepCounts {
    let (bs, stride) = (caps.block_size, caps.max_blocks_per_seq);
    let spec = caps.spec_k > 0;
    let mut n = StepCounts {
        tokens: 0,
        samples: 0,
        logits: 0,
        placed: 0,
        bt_updates: 0,
        pf_tiles: 0,
        att_listed: 0,
    };
    host_samples.clear();
    for seq in &batch.seqs {
        let r = seq.row.0 as usize;
        let row = rows[r].as_mut().expect("validated: the row is initialised");
        let mid = (seq.blocks_start + seq.blocks_len) as usize;
        for &b in &batch.new_blocks[seq.blocks_start as usize..mid] {
            meta[l.bt_index + n.bt_updates] = (r * stride + row.block_table.len()) as i32;
            meta[l.bt_value + n.bt_updates] = b as i32;
            row.block_table.push(b);
            n.bt_updates += 1;
        }
        // Local tables live after the full ones in the same device array.
        let local_base = caps.bt_words();
        for &b in &batch.new_blocks[mid..mid + seq.local_blocks_len as usize] {
            meta[l.bt_index + n.bt_updates] =
                (local_base + r * stride + row.local_block_table.len()) as i32;
            meta[l.bt_value + n.bt_updates] = b as i32;
            row.local_block_table.push(b);
            n.bt_updates += 1;
        }
        let first = n.tokens;
        // Rounds are short: never tiled (a round graph's shapes stay fixed).
        match prefill_tiles(first, seq.num_tokens as usize).filter(|_| tiled && seq.draft == 0) {
            Some(tiles) => {
                for (t0, count) in tiles {
                    meta[l.pf_tiles + 2 * n.pf_tiles] = t0 as i32;
                    meta[l.pf_tiles + 2 * n.pf_tiles + 1] = count as i32;
                    n.pf_tiles += 1;
                }
            }
            None if tiled => {
                for t in first..first + seq.num_tokens as usize {
                    meta[l.att_list + n.att_listed] = t as i32;
                    n.att_listed += 1;
                }
            }
            None => {}
        }
        for j in 0..seq.num_tokens as usize {
            let t = n.tokens;
            let pos = seq.position as usize + j;
            meta[l.tok_src + t] = if j < seq.host_len as usize {
                batch.host_tokens[seq.host_start as usize + j] as i32
            } else {
                -1 - r as i32
            };
            meta[l.positions + t] = pos as i32;
            meta[l.slot_mapping + t] = (row.block_table[pos / bs] as usize * bs + pos % bs) as i32;
            if caps.hybrid {
                meta[l.slot_mapping_local + t] =
                    (row.local_block_table[pos / bs] as usize * bs + pos % bs) as i32;
            }
            meta[l.tok_row + t] = r as i32;
            n.tokens += 1;
        }
        // With speculation a decode entry's host positions are upper bounds: `spec_place`
        // rewrites its positions, slots and tokens on the device (the host's slots above
        // stay inside the booked blocks).
        let placed = spec && seq.host_len == 0;
        if placed {
            meta[l.place_first + n.placed] = first as i32;
            meta[l.place_n + n.placed] = seq.num_tokens as i32;
            n.placed += 1;
        }
        if seq.sample {
            let host = row.host_sampler.is_some();
            // A round's tokens all give logits (a graph's shapes stay fixed); host-sampled rows
            // verify none of their proposals: their first row is their plain sample.
            let logits = 1 + seq.draft as usize;
            let draft = if host { 0 } else { seq.draft };
            if spec {
                meta[l.samp_first + n.samples] = n.logits as i32;
                meta[l.samp_draft + n.samples] = draft as i32;
            }
            // A round's rows start at its pending token; a plain sample's is its last token.
            let start = if seq.draft > 0 { first } else { n.tokens - 1 };
            for j in 0..logits {
                meta[l.logit_rows + n.logits + j] = (start + j) as i32;
            }
            meta[l.sample_rows + n.samples] = r as i32;
            if host {
                host_samples.push((n.samples, seq.row.0));
            }
            row.has_pending = true;
            n.samples += 1;
            n.logits += logits;
        }
    }
    if n.pf_tiles == 0 {
        // No tiles: the per-token kernel takes every token, unlisted.
        n.att_listed = 0;
    }
    n
}

/// How much of the draft's sections [`fill_draft_step`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DraftCounts {
    /// Tokens of the draft's first forward.
    pub tokens: usize,
    /// Decode entries in it (`d_place`).
    pub entries: usize,
    /// Rows that draft proposals (`d_logit_rows`, `b_tok_row`, `b_logit_rows`).
    pub drafting: usize,
}

impl DraftCounts {
    /// No draft work.
    pub const NONE: DraftCounts = DraftCounts {
        tokens: 0,
        entries: 0,
        drafting: 0,
    };

    /// The counts [`fill_draft_step`] gives a step of `n` rounds (a round graph's bucket).
    pub fn rounds(n: usize) -> DraftCounts {
        DraftCounts {
            tokens: 2 * n,
            entries: n,
            drafting: n,
        }
    }

    /// Whether the step has prefill tokens (beyond the decode entries' two each) for the
    /// proposer to take in.
    pub fn prefill(&self) -> bool {
        self.tokens > 2 * self.entries
    }

    /// Whether the proposer has work: prefill tokens to take in, or proposals to make.
    pub fn any(&self) -> bool {
        self.drafting > 0 || self.prefill()
    }
}

/// Writes the draft's sections of a speculative step, after [`fill_step`] wrote the target's
/// (see `super::spec`): the draft's first forward takes every prefill chunk's tokens as the
/// target does (so its KV is ready when the row decodes) and 2 tokens per decode entry, the
/// token before the pending one and the pending one (positions and ids from the device; the
/// first is usually in the draft's KV already, but not after a round that accepted every
/// proposal). Rounds take the logits of their pending token and one token per later draft
/// forward.
pub(crate) fn fill_draft_step(meta: &mut [i32], l: &MetaLayout, batch: &ExecBatch) -> DraftCounts {
    let mut c = DraftCounts {
        tokens: 0,
        entries: 0,
        drafting: 0,
    };
    let mut t = 0;
    for seq in &batch.seqs {
        let (r, n) = (seq.row.0 as usize, seq.num_tokens as usize);
        let d = c.tokens;
        if seq.host_len == 0 {
            meta[l.d_place + c.entries] = d as i32;
            c.entries += 1;
            for j in d..d + 2 {
                meta[l.d_tok_src + j] = -1 - r as i32;
                meta[l.d_positions + j] = 0;
                meta[l.d_slot_mapping + j] = 0;
                meta[l.d_tok_row + j] = r as i32;
            }
            // Host-sampled rows draft too (their proposals go unverified), so that a step of
            // rounds has fixed shapes for its graph.
            if seq.draft > 0 {
                let m = c.drafting;
                meta[l.d_logit_rows + m] = (d + 1) as i32;
                meta[l.b_tok_row + m] = r as i32;
                meta[l.b_logit_rows + m] = m as i32;
                c.drafting += 1;
            }
            c.tokens += 2;
        } else {
            for (from, to) in [
                (l.tok_src, l.d_tok_src),
                (l.positions, l.d_positions),
                (l.slot_mapping, l.d_slot_mapping),
                (l.tok_row, l.d_tok_row),
            ] {
                meta.copy_within(from + t..from + t + n, to + d);
            }
            c.tokens += n;
        }
        t += n;
    }
    c
}

/// Tokens of n-gram history one step can stage for its row inits (256 KiB of pinned memory
/// per slot): a row whose cached prefix does not fit starts its history at its first chunk.
pub(crate) const NGRAM_STAGE_TOKENS: usize = 1 << 16;

/// Offsets of the n-gram staging sections (`[rows: R | starts: R | offsets: R + 1 |
/// tokens]`, R = `max_rows`): (rows, starts, offsets, tokens).
pub(crate) fn ngram_stage_sections(max_rows: usize) -> (usize, usize, usize, usize) {
    (0, max_rows, 2 * max_rows, 3 * max_rows + 1)
}

/// Words of an n-gram staging buffer.
pub(crate) fn ngram_stage_words(max_rows: usize) -> usize {
    ngram_stage_sections(max_rows).3 + NGRAM_STAGE_TOKENS
}

/// Stages the n-gram histories of `batch`'s row inits into `buf` for `ngram_init`: per init
/// its row, the tokens before its first chunk in this step (prompt then earlier output: the
/// cached prefix, or everything when the row has no chunk) and the history's first known
/// position (0, or that chunk's position when its tokens did not fit). Later positions come
/// from the chunks themselves (`ngram_record`). Returns the number of inits staged.
pub(crate) fn stage_ngram_inits(buf: &mut [i32], max_rows: usize, batch: &ExecBatch) -> usize {
    let (rows, starts, offsets, tokens) = ngram_stage_sections(max_rows);
    let mut used = 0;
    for (i, init) in batch.row_inits.iter().enumerate() {
        let context = init.prompt.iter().chain(&init.output);
        let known = init.prompt.len() + init.output.len();
        let before = batch
            .seqs
            .iter()
            .find(|q| q.row == init.row)
            .map_or(known, |q| (q.position as usize).min(known));
        let fits = used + before <= NGRAM_STAGE_TOKENS;
        buf[rows + i] = init.row.0 as i32;
        buf[offsets + i] = used as i32;
        if fits {
            for (dst, &t) in buf[tokens + used..tokens + used + before]
                .iter_mut()
                .zip(context)
            {
                *dst = t as i32;
            }
            used += before;
            buf[starts + i] = 0;
        } else {
            tracing::debug!(
                row = init.row.0,
                tokens = before,
                "n-gram history: the cached prefix does not fit this step's staging; the row's lookups start at its first chunk"
            );
            buf[starts + i] = before as i32;
        }
    }
    let n = batch.row_inits.len();
    buf[offsets + n] = used as i32;
    n
}

/// Words of `buf` to upload after [`stage_ngram_inits`] staged `n` inits.
pub(crate) fn ngram_staged_words(buf: &[i32], max_rows: usize, n: usize) -> usize {
    let (_, _, offsets, tokens) = ngram_stage_sections(max_rows);
    tokens + buf[offsets + n] as usize
}

/// Reads a speculative step's output words (`[counts: max_seqs | tokens: n × (k + 1)]`, from
/// `spec_verify`) into `out`: per sampled sequence its emitted tokens and the proposals it
/// verified (`drafts`, as `fill_step` wrote them: 0 for host-sampled rows, whose one token
/// is in `host`, drained here). A count outside `1..=1 + draft` means the device state is
/// corrupt: an error, not a guess.
pub(crate) fn read_spec_output(
    words: &[i32],
    (max_seqs, k): (usize, usize),
    drafts: &[i32],
    host: &mut Vec<(usize, TokenId, Option<TokenLogprobs>)>,
    out: &mut StepOutput,
) -> anyhow::Result<()> {
    let mut host = host.drain(..).peekable();
    for (j, &d) in drafts.iter().enumerate() {
        if let Some((_, tok, lp)) = host.next_if(|h| h.0 == j) {
            out.push_one(tok, lp);
            continue;
        }
        // The count word: emitted tokens, and above bit 16 the proposals verified (fewer
        // than booked when an n-gram lookup found fewer).
        let (c, v) = (words[j] & 0xffff, words[j] >> 16);
        anyhow::ensure!(
            (0..=d).contains(&v) && c >= 1 && c <= 1 + v,
            "sequence {j} of the step emitted {c} tokens for a round of {v} proposals ({d} booked)"
        );
        let at = max_seqs + j * (k + 1);
        out.tokens
            .extend(words[at..at + c as usize].iter().map(|&t| t as TokenId));
        out.logprobs.extend((0..c).map(|_| None));
        out.counts.push(c as u32);
        out.proposed.push(v as u32);
    }
    Ok(())
}

/// Fills token rows `range` with graph padding: token 0, position -1 (attention reads
/// nothing and writes zeros), a KV slot in `scratch_block` (never a request's block), the
/// padding row's block table, and logits from the row itself.
///
/// With speculation the graph also places `range.end` decode entries, of which the step
/// wrote `placed`: the rest become no-ops (no tokens). They are not `range`'s tokens: a
/// sequence with host tokens (a one-token prefill after a prefix-cache hit) is a decode-only
/// step's token but no placement entry, so entries and tokens need not line up, and a stale
/// entry from an earlier step would move another row's tokens.
pub(crate) fn fill_padding(
    meta: &mut [i32],
    l: &MetaLayout,
    (range, placed): (Range<usize>, usize),
    (scratch_block, local_scratch): (usize, Option<usize>),
    block_size: usize,
    pad_row: usize,
) {
    if l.place_n > l.place_first {
        for e in placed..range.end {
            meta[l.place_first + e] = 0;
            meta[l.place_n + e] = 0;
        }
    }
    for i in range {
        meta[l.tok_src + i] = 0;
        meta[l.positions + i] = -1;
        meta[l.slot_mapping + i] = (scratch_block * block_size + i % block_size) as i32;
        if let Some(b) = local_scratch {
            meta[l.slot_mapping_local + i] = (b * block_size + i % block_size) as i32;
        }
        meta[l.tok_row + i] = pad_row as i32;
        meta[l.logit_rows + i] = i as i32;
    }
}

/// Fills sequences `range` of a step of speculative rounds (`1 + k` tokens each) with graph
/// padding, in every section a round graph reads: the target's tokens and logits rows, the
/// placement entries, the draft's first forward (2 tokens each) and its later forwards. The
/// padding row's `kv_len` is negative, so `spec_place` leaves these as written: position -1
/// (attention reads nothing), KV into `scratch_block`, token 0.
pub(crate) fn fill_round_padding(
    meta: &mut [i32],
    l: &MetaLayout,
    range: Range<usize>,
    k: usize,
    (scratch_block, block_size): (usize, usize),
    pad_row: usize,
) {
    let slot = |i: usize| (scratch_block * block_size + i % block_size) as i32;
    for e in range {
        let t0 = e * (1 + k);
        for t in t0..t0 + 1 + k {
            meta[l.tok_src + t] = 0;
            meta[l.positions + t] = -1;
            meta[l.slot_mapping + t] = slot(t);
            meta[l.tok_row + t] = pad_row as i32;
            meta[l.logit_rows + t] = t as i32;
        }
        meta[l.place_first + e] = t0 as i32;
        meta[l.place_n + e] = (1 + k) as i32;
        for d in 2 * e..2 * e + 2 {
            meta[l.d_tok_src + d] = 0;
            meta[l.d_positions + d] = -1;
            meta[l.d_slot_mapping + d] = slot(d);
            meta[l.d_tok_row + d] = pad_row as i32;
        }
        meta[l.d_place + e] = (2 * e) as i32;
        meta[l.d_logit_rows + e] = (2 * e + 1) as i32;
        meta[l.b_tok_src + e] = 0;
        meta[l.b_positions + e] = -1;
        meta[l.b_slot_mapping + e] = slot(e);
        meta[l.b_tok_row + e] = pad_row as i32;
        meta[l.b_logit_rows + e] = e as i32;
    }
}

/// Whether every sequence of `batch` is a speculative round of `k` proposals: a step a
/// captured round graph can run.
pub(crate) fn is_round_only(batch: &ExecBatch, k: usize) -> bool {
    k > 0
        && !batch.seqs.is_empty()
        && batch
            .seqs
            .iter()
            .all(|q| q.draft as usize == k && q.host_len == 0 && q.sample)
}

/// What a step may use: capacities, the vocabulary and the engine's KV blocks (of both pools
/// with a hybrid cache).
pub(crate) struct Limits {
    pub caps: Capacities,
    pub vocab: u32,
    pub kv_blocks: u32,
    pub local_kv_blocks: u32,
}

const MARK_SEEN: u8 = 1;
const MARK_REINIT: u8 = 2;

/// Everything that can refuse a batch, before any state changes. `marks` (one per row, all
/// zero) is scratch for the duplicate-row and re-initialised-row checks, so a step allocates
/// nothing; it is zero again on return.
pub(crate) fn validate(
    batch: &ExecBatch,
    lim: &Limits,
    rows: &[Option<HostRow>],
    marks: &mut [u8],
) -> Result<(), String> {
    let result = check_batch(batch, lim, rows, marks);
    for r in batch
        .row_inits
        .iter()
        .map(|i| i.row.0 as usize)
        .chain(batch.seqs.iter().map(|s| s.row.0 as usize))
    {
        if let Some(m) = marks.get_mut(r) {
            *m = 0;
        }
    }
    result
}

fn check_batch(
    batch: &ExecBatch,
    lim: &Limits,
    rows: &[Option<HostRow>],
    marks: &mut [u8],
) -> Result<(), String> {
    batch.check()?;
    let c = &lim.caps;
    let t = batch.num_tokens();
    if t > c.max_tokens {
        return Err(format!(
            "{t} tokens exceed the step capacity {}",
            c.max_tokens
        ));
    }
    if batch.seqs.len() > c.max_seqs {
        return Err(format!(
            "{} sequences exceed max_num_seqs {}",
            batch.seqs.len(),
            c.max_seqs
        ));
    }
    if batch.row_inits.len() > c.max_seqs {
        return Err("too many row inits".into());
    }
    if let Some(s) = batch.seqs.iter().find(|s| s.draft as usize > c.spec_k) {
        return Err(format!(
            "a speculative entry of {} proposals; this backend speculates {}",
            s.draft, c.spec_k
        ));
    }
    let logits: usize = batch
        .seqs
        .iter()
        .filter(|s| s.sample)
        .map(|s| 1 + s.draft as usize)
        .sum();
    if logits > c.max_logits() {
        return Err(format!(
            "{logits} logits rows exceed the step capacity {}",
            c.max_logits()
        ));
    }
    if let Some(&tok) = batch.host_tokens.iter().find(|&&x| x >= lim.vocab) {
        return Err(format!(
            "token id {tok} outside the vocabulary ({})",
            lim.vocab
        ));
    }
    for s in &batch.seqs {
        let mid = (s.blocks_start + s.blocks_len) as usize;
        let full = &batch.new_blocks[s.blocks_start as usize..mid];
        let local = &batch.new_blocks[mid..mid + s.local_blocks_len as usize];
        if let Some(&b) = full.iter().find(|&&b| b >= lim.kv_blocks) {
            return Err(format!(
                "block {b} outside the cache ({} blocks)",
                lim.kv_blocks
            ));
        }
        if !c.hybrid && !local.is_empty() {
            return Err("sliding-window blocks for a cache without a sliding-window pool".into());
        }
        if let Some(&b) = local.iter().find(|&&b| b >= lim.local_kv_blocks) {
            return Err(format!(
                "sliding-window block {b} outside the cache ({} blocks)",
                lim.local_kv_blocks
            ));
        }
    }
    for init in &batch.row_inits {
        let r = init.row.0 as usize;
        if r >= rows.len() {
            return Err(format!("row {r} out of range"));
        }
        marks[r] |= MARK_REINIT;
    }
    for s in &batch.seqs {
        let r = s.row.0 as usize;
        if r >= rows.len() {
            return Err(format!("row {r} out of range"));
        }
        if marks[r] & MARK_SEEN != 0 {
            return Err(format!("row {r} appears twice in one step"));
        }
        marks[r] |= MARK_SEEN;
        let (have, have_local, pending) = match (&rows[r], marks[r] & MARK_REINIT != 0) {
            (_, true) => (0, 0, false),
            (Some(row), false) => (
                row.block_table.len(),
                row.local_block_table.len(),
                row.has_pending,
            ),
            (None, false) => return Err(format!("step names uninitialised row {r}")),
        };
        if s.uses_pending_token() && !pending {
            return Err(format!("decode on row {r} without a sampled token"));
        }
        let blocks = have + s.blocks_len as usize;
        if blocks > c.max_blocks_per_seq {
            return Err(format!("row {r}: {blocks} blocks exceed max_model_len"));
        }
        let end = (s.position + s.num_tokens) as usize;
        if end.div_ceil(c.block_size) > blocks {
            return Err(format!(
                "row {r}: block table of {blocks} blocks too short for position {end}"
            ));
        }
        if c.hybrid {
            let local = have_local + s.local_blocks_len as usize;
            if local > c.max_blocks_per_seq || end.div_ceil(c.block_size) > local {
                return Err(format!(
                    "row {r}: sliding-window table of {local} blocks does not fit position {end}"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{RowId, RowInit, SeqInput};
    use harrier_shared::protocol::SamplingParams;

    fn seq(
        row: u32,
        position: u32,
        num_tokens: u32,
        host: (u32, u32),
        blocks: (u32, u32),
    ) -> SeqInput {
        SeqInput {
            row: RowId(row),
            position,
            num_tokens,
            host_start: host.0,
            host_len: host.1,
            blocks_start: blocks.0,
            blocks_len: blocks.1,
            local_blocks_len: 0,
            sample: true,
            draft: 0,
        }
    }

    /// A speculative round: `1 + draft` tokens of `row` from `pos`, all from the device.
    fn round(row: u32, pos: u32, draft: u32) -> SeqInput {
        SeqInput {
            draft,
            ..seq(row, pos, 1 + draft, (0, 0), (0, 0))
        }
    }

    /// Four initialised rows, each with block table `blocks` and a pending token.
    fn decoding_rows(blocks: &[u32]) -> Vec<Option<HostRow>> {
        (0..4)
            .map(|_| {
                let mut r = HostRow::new(None);
                r.block_table = blocks.to_vec();
                r.has_pending = true;
                Some(r)
            })
            .collect()
    }

    fn setup() -> (Capacities, MetaLayout, Vec<i32>) {
        // 4-token blocks, 16 blocks per sequence, 4 rows.
        let caps = Capacities::new(64, 4, 64, 4);
        let l = MetaLayout::new(&caps);
        (caps, l, vec![i32::MIN; l.len])
    }

    fn row_init(row: u32, sampling: SamplingParams, prompt: Vec<u32>, output: Vec<u32>) -> RowInit {
        RowInit {
            row: RowId(row),
            sampling,
            seed: 0,
            min_tokens_mask: vec![],
            prompt,
            output,
        }
    }

    #[test]
    fn row_plans_keep_what_the_device_can_do_there() {
        let pen = SamplingParams {
            frequency_penalty: 0.5,
            ..SamplingParams::greedy(8)
        };
        let bias = SamplingParams {
            logit_bias: vec![(3, 1.5), (9, -100.0)],
            ..SamplingParams::greedy(8)
        };
        let plain = row_init(0, SamplingParams::greedy(8), vec![1, 2], vec![]);
        assert_eq!(
            RowPlan::new(&plain, 0),
            RowPlan {
                host: false,
                penalties: false,
                bias: 0,
                words: 0
            }
        );
        // Penalties stage prompt + earlier outputs; bias stages two words per entry.
        let p = RowPlan::new(&row_init(0, pen.clone(), vec![1, 2, 3], vec![4]), 100);
        assert_eq!((p.host, p.penalties, p.words), (false, true, 4));
        let b = RowPlan::new(&row_init(0, bias.clone(), vec![1, 2, 3], vec![]), 100);
        assert_eq!((b.host, b.penalties, b.bias, b.words), (false, false, 2, 4));
        // Too little staging room, logprobs, or a long min_tokens mask: the host sampler.
        assert!(RowPlan::new(&row_init(0, pen, vec![1, 2, 3], vec![4]), 3).host);
        let lp = SamplingParams {
            logprobs: Some(2),
            ..bias
        };
        let h = RowPlan::new(&row_init(0, lp, vec![1], vec![]), 100);
        assert_eq!((h.host, h.bias, h.words), (true, 0, 0));
        let mut long = row_init(0, SamplingParams::greedy(8), vec![1], vec![]);
        long.min_tokens_mask = (0..MASK_CAP as u32 + 1).collect();
        assert!(RowPlan::new(&long, 100).host);
    }

    #[test]
    fn row_state_is_staged_back_to_back() {
        let pen = SamplingParams {
            repetition_penalty: 1.2,
            ..SamplingParams::greedy(8)
        };
        let both = SamplingParams {
            logit_bias: vec![(7, 2.0)],
            ..pen.clone()
        };
        let bias_only = SamplingParams {
            logit_bias: vec![(5, -1.0)],
            ..SamplingParams::greedy(8)
        };
        let inits = [
            row_init(2, pen, vec![5, 6, 7], vec![]),
            row_init(0, both, vec![9], vec![4, 4]),
            row_init(1, bias_only, vec![8, 8], vec![3]),
        ];
        let max_rows = 3;
        let mut buf = vec![-7; 4 * max_rows + 1 + 12];
        let mut before = 0;
        for (i, init) in inits.iter().enumerate() {
            let plan = RowPlan::new(init, 100);
            stage_row_state(&mut buf, max_rows, i, before, init, &plan);
            before += plan.words;
        }
        assert_eq!(before, 3 + (3 + 2) + 2);
        // rows | offsets (prompt, output, bias starts; end = next start) | data.
        assert_eq!(&buf[..max_rows], &[2, 0, 1]);
        assert_eq!(
            &buf[max_rows..4 * max_rows + 1],
            &[0, 3, 3, 3, 4, 6, 8, 8, 8, 10]
        );
        let f = |x: f32| x.to_bits() as i32;
        assert_eq!(
            &buf[4 * max_rows + 1..],
            &[5, 6, 7, 9, 4, 4, 7, f(2.0), 5, f(-1.0), -7, -7]
        );
    }

    #[test]
    fn prefill_and_decodes_fill_every_section() {
        let (caps, l, mut meta) = setup();
        let penalty = SamplingParams {
            repetition_penalty: 1.2,
            ..SamplingParams::greedy(8)
        };
        let init = RowInit {
            row: RowId(1),
            sampling: penalty,
            seed: 0,
            min_tokens_mask: vec![],
            prompt: vec![1],
            output: vec![],
        };
        let mut rows: Vec<Option<HostRow>> = vec![
            Some(HostRow::new(None)),
            Some(HostRow::new(Some(RowSampler::new(&init)))),
            Some(HostRow::new(None)),
            None,
        ];
        rows[1].as_mut().unwrap().block_table = vec![1, 2];
        rows[2].as_mut().unwrap().block_table = vec![4, 6];
        let batch = ExecBatch {
            // Row 0: prefill of 6 host tokens into new blocks 7 and 3; row 1: decode at 5
            // (block 2); row 2: decode at 8 into its new third block 5.
            seqs: vec![
                seq(0, 0, 6, (0, 6), (0, 2)),
                seq(1, 5, 1, (0, 0), (2, 0)),
                seq(2, 8, 1, (0, 0), (2, 1)),
            ],
            host_tokens: vec![10, 11, 12, 13, 14, 15],
            new_blocks: vec![7, 3, 5],
            ..Default::default()
        };
        assert!(!is_decode_only(&batch));
        let mut host = vec![(9, 9)];
        let n = fill_step(&mut meta, &l, &caps, &batch, &mut rows, &mut host, true);
        assert_eq!(
            n,
            StepCounts {
                tokens: 8,
                samples: 3,
                logits: 3,
                placed: 0,
                bt_updates: 3,
                pf_tiles: 0,
                att_listed: 0,
            }
        );
        let sec = |off: usize, len: usize| meta[off..off + len].to_vec();
        assert_eq!(sec(l.tok_src, 8), [10, 11, 12, 13, 14, 15, -2, -3]);
        assert_eq!(sec(l.positions, 8), [0, 1, 2, 3, 4, 5, 5, 8]);
        assert_eq!(sec(l.slot_mapping, 8), [28, 29, 30, 31, 12, 13, 9, 20]);
        assert_eq!(sec(l.tok_row, 8), [0, 0, 0, 0, 0, 0, 1, 2]);
        assert_eq!(sec(l.logit_rows, 3), [5, 6, 7]);
        assert_eq!(sec(l.sample_rows, 3), [0, 1, 2]);
        assert_eq!(sec(l.bt_index, 3), [0, 1, 2 * 16 + 2]);
        assert_eq!(sec(l.bt_value, 3), [7, 3, 5]);
        assert_eq!(host, [(1, 1)], "cleared, then the host-sampled row");
        assert_eq!(rows[0].as_ref().unwrap().block_table, [7, 3]);
        assert_eq!(rows[2].as_ref().unwrap().block_table, [4, 6, 5]);
        assert!(rows.iter().take(3).all(|r| r.as_ref().unwrap().has_pending));
        // Nothing past the counts was touched.
        assert_eq!(meta[l.tok_src + 8], i32::MIN);
        assert_eq!(meta[l.bt_index + 3], i32::MIN);
    }

    #[test]
    fn decode_steps_and_unsampled_chunks() {
        let (caps, l, mut meta) = setup();
        let mut rows: Vec<Option<HostRow>> = (0..4).map(|_| Some(HostRow::new(None))).collect();
        rows[3].as_mut().unwrap().block_table = vec![8];
        let decode = ExecBatch {
            seqs: vec![seq(3, 2, 1, (0, 0), (0, 0))],
            ..Default::default()
        };
        assert!(is_decode_only(&decode));
        let mut host = Vec::new();
        let n = fill_step(&mut meta, &l, &caps, &decode, &mut rows, &mut host, true);
        assert_eq!(
            n,
            StepCounts {
                tokens: 1,
                samples: 1,
                logits: 1,
                placed: 0,
                bt_updates: 0,
                pf_tiles: 0,
                att_listed: 0,
            }
        );
        assert_eq!((meta[l.tok_src], meta[l.slot_mapping]), (-4, 34));
        // A prefill chunk that does not sample (more of the prompt follows).
        let mut chunk = ExecBatch {
            seqs: vec![seq(0, 0, 3, (0, 3), (0, 1))],
            host_tokens: vec![1, 2, 3],
            new_blocks: vec![11],
            ..Default::default()
        };
        chunk.seqs[0].sample = false;
        assert!(!is_decode_only(&chunk));
        let n = fill_step(&mut meta, &l, &caps, &chunk, &mut rows, &mut host, true);
        assert_eq!(
            n,
            StepCounts {
                tokens: 3,
                samples: 0,
                logits: 0,
                placed: 0,
                bt_updates: 1,
                pf_tiles: 0,
                att_listed: 0,
            }
        );
        assert!(!rows[0].as_ref().unwrap().has_pending);
        assert!(!is_decode_only(&ExecBatch::default()));
    }

    #[test]
    fn long_runs_become_prefill_tiles_and_the_rest_is_listed() {
        let (caps, l, mut meta) = setup();
        let fresh = || -> Vec<Option<HostRow>> {
            let mut rows: Vec<Option<HostRow>> = (0..4).map(|_| Some(HostRow::new(None))).collect();
            rows[1].as_mut().unwrap().block_table = vec![1, 2];
            rows[2].as_mut().unwrap().block_table = vec![4, 6, 5];
            rows
        };
        // t=0: row 1 decodes; t=1..=10: row 0 prefills 10 tokens; t=11: row 2 decodes.
        let batch = ExecBatch {
            seqs: vec![
                seq(1, 5, 1, (0, 0), (0, 0)),
                seq(0, 0, 10, (0, 10), (0, 3)),
                seq(2, 8, 1, (0, 0), (3, 0)),
            ],
            host_tokens: (100..110).collect(),
            new_blocks: vec![7, 3, 9],
            ..Default::default()
        };
        let mut host = Vec::new();
        let mut rows = fresh();
        let n = fill_step(&mut meta, &l, &caps, &batch, &mut rows, &mut host, true);
        assert_eq!((n.tokens, n.pf_tiles, n.att_listed), (12, 1, 2));
        assert_eq!(&meta[l.pf_tiles..l.pf_tiles + 2], [1, 10]);
        assert_eq!(&meta[l.att_list..l.att_list + 2], [0, 11]);
        assert_eq!(
            &meta[l.positions + 1..l.positions + 11],
            (0..10).collect::<Vec<i32>>()
        );
        // Without tiling (f32 model, other head dims) nothing is tiled or listed.
        let mut rows = fresh();
        let n = fill_step(&mut meta, &l, &caps, &batch, &mut rows, &mut host, false);
        assert_eq!((n.tokens, n.pf_tiles, n.att_listed), (12, 0, 0));
        // Short runs only: no tiles, so no list either (every token unlisted).
        let short = ExecBatch {
            seqs: vec![seq(0, 0, 7, (0, 7), (0, 2))],
            host_tokens: (0..7).collect(),
            new_blocks: vec![7, 3],
            ..Default::default()
        };
        let mut rows = fresh();
        let n = fill_step(&mut meta, &l, &caps, &short, &mut rows, &mut host, true);
        assert_eq!((n.tokens, n.pf_tiles, n.att_listed), (7, 0, 0));
    }

    #[test]
    fn padding_rows_touch_only_the_scratch_block() {
        let (_, l, mut meta) = setup();
        fill_padding(&mut meta, &l, (3..6, 3), (9, None), 4, 4);
        assert_eq!(&meta[l.positions + 3..l.positions + 6], [-1, -1, -1]);
        assert_eq!(&meta[l.slot_mapping + 3..l.slot_mapping + 6], [39, 36, 37]);
        assert_eq!(&meta[l.tok_row + 3..l.tok_row + 6], [4, 4, 4]);
        assert_eq!(&meta[l.logit_rows + 3..l.logit_rows + 6], [3, 4, 5]);
        assert_eq!(&meta[l.tok_src + 3..l.tok_src + 6], [0, 0, 0]);
        assert_eq!(meta[l.positions + 2], i32::MIN);
        assert_eq!(meta[l.positions + 6], i32::MIN);
    }

    fn init(row: u32) -> RowInit {
        RowInit {
            row: RowId(row),
            sampling: SamplingParams::greedy(4),
            seed: 0,
            min_tokens_mask: vec![],
            prompt: vec![1],
            output: vec![],
        }
    }

    /// A hybrid cache: local blocks follow a row's full ones in `new_blocks`, land in the local
    /// half of the block-table array, and give the sliding layers their own slots; padding
    /// writes into the local pool's scratch block too; validation checks the local pool.
    #[test]
    fn hybrid_caches_fill_local_tables_and_slots() {
        let mut caps = Capacities::new(64, 4, 64, 4);
        caps.hybrid = true;
        let l = MetaLayout::new(&caps);
        assert_eq!(l.tok_row - l.slot_mapping_local, 64);
        let mut meta = vec![i32::MIN; l.len];
        let mut rows: Vec<Option<HostRow>> = vec![Some(HostRow::new(None)), None, None, None];
        // A prefill of 6 tokens at position 0: full blocks 7, 3; local blocks 2, 5.
        let mut s = seq(0, 0, 6, (0, 6), (0, 2));
        s.local_blocks_len = 2;
        let batch = ExecBatch {
            seqs: vec![s],
            host_tokens: vec![10, 11, 12, 13, 14, 15],
            new_blocks: vec![7, 3, 2, 5],
            ..Default::default()
        };
        let n = fill_step(
            &mut meta,
            &l,
            &caps,
            &batch,
            &mut rows,
            &mut Vec::new(),
            false,
        );
        assert_eq!(n.bt_updates, 4);
        let base = caps.bt_words() as i32;
        assert_eq!(&meta[l.bt_index..l.bt_index + 4], [0, 1, base, base + 1]);
        assert_eq!(&meta[l.bt_value..l.bt_value + 4], [7, 3, 2, 5]);
        assert_eq!(
            &meta[l.slot_mapping..l.slot_mapping + 6],
            [28, 29, 30, 31, 12, 13]
        );
        assert_eq!(
            &meta[l.slot_mapping_local..l.slot_mapping_local + 6],
            [8, 9, 10, 11, 20, 21]
        );
        assert_eq!(rows[0].as_ref().unwrap().local_block_table, [2, 5]);
        fill_padding(&mut meta, &l, (6..8, 6), (9, Some(11)), 4, 4);
        assert_eq!(
            &meta[l.slot_mapping_local + 6..l.slot_mapping_local + 8],
            [46, 47]
        );

        let lim = Limits {
            caps,
            vocab: 100,
            kv_blocks: 10,
            local_kv_blocks: 5,
        };
        let mut marks = vec![0u8; 4];
        let mut rows: Vec<Option<HostRow>> = vec![Some(HostRow::new(None)), None, None, None];
        let e = validate(&batch, &lim, &rows, &mut marks).unwrap_err();
        assert!(e.contains("sliding-window block 5 outside"), "{e}");
        let mut short = batch.clone();
        short.seqs[0].local_blocks_len = 1;
        short.new_blocks.pop();
        let e = validate(&short, &lim, &rows, &mut marks).unwrap_err();
        assert!(e.contains("sliding-window table of 1 blocks"), "{e}");
        rows[0] = Some(HostRow::new(None));
        let lim = Limits {
            local_kv_blocks: 6,
            ..lim
        };
        assert!(validate(&batch, &lim, &rows, &mut marks).is_ok());
    }

    #[test]
    fn validate_refuses_what_the_kernels_cannot_run() {
        let caps = Capacities::new(16, 4, 16, 4); // 4 blocks of 4 per sequence
        let lim = Limits {
            caps,
            vocab: 100,
            kv_blocks: 10,
            local_kv_blocks: 0,
        };
        let mut rows: Vec<Option<HostRow>> = vec![None, Some(HostRow::new(None)), None, None];
        rows[1].as_mut().unwrap().block_table = vec![3];
        rows[1].as_mut().unwrap().has_pending = true;
        let mut marks = vec![0u8; 4];
        let prefill = |row: u32, len: u32, blocks: u32| ExecBatch {
            row_inits: vec![init(row)],
            seqs: vec![seq(row, 0, len, (0, len), (0, blocks))],
            host_tokens: vec![5; len as usize],
            new_blocks: (0..blocks).collect(),
        };
        let decode = |row: u32, pos: u32| seq(row, pos, 1, (0, 0), (0, 0));
        let mut check = |b: &ExecBatch| {
            let r = validate(b, &lim, &rows, &mut marks);
            assert!(marks.iter().all(|&m| m == 0), "marks cleared: {marks:?}");
            r
        };
        // Accepted: a prefill on a fresh row, a decode on a live one, both in one step.
        let mut both = prefill(0, 5, 2);
        both.seqs.push(decode(1, 3));
        assert_eq!(check(&both), Ok(()));
        let err = |b: &ExecBatch, what: &str| {
            let e = validate(b, &lim, &rows, &mut [0u8; 4]).unwrap_err();
            assert!(e.contains(what), "{e}");
        };
        err(&prefill(0, 17, 4), "step capacity");
        err(&prefill(0, 5, 1), "too short for position 5");
        err(&prefill(0, 5, 5), "exceed max_model_len");
        let mut b = prefill(0, 2, 1);
        b.host_tokens[1] = 100;
        err(&b, "outside the vocabulary");
        let mut b = prefill(0, 2, 1);
        b.new_blocks[0] = 10;
        err(&b, "outside the cache");
        err(&prefill(4, 2, 1), "out of range");
        let twice = ExecBatch {
            seqs: vec![decode(1, 3), decode(1, 3)],
            ..Default::default()
        };
        err(&twice, "twice");
        let fresh = ExecBatch {
            seqs: vec![decode(2, 0)],
            ..Default::default()
        };
        err(&fresh, "uninitialised row 2");
        // A re-initialised row has no pending token and an empty table.
        let mut reinit = prefill(1, 1, 0);
        reinit.seqs[0] = decode(1, 3);
        err(&reinit, "without a sampled token");
        // Errors leave the marks clear too.
        assert!(check(&twice).is_err());
        assert!(check(&reinit).is_err());
    }

    /// A step with a prefill chunk (row 0, samples), a speculative round (row 1, 3
    /// proposals), a plain decode (row 2) and a host-sampled round (row 3).
    fn spec_step() -> (
        Capacities,
        MetaLayout,
        Vec<i32>,
        Vec<Option<HostRow>>,
        ExecBatch,
    ) {
        let caps = Capacities::new(64, 4, 64, 4).with_spec(3, 64);
        let l = MetaLayout::new(&caps);
        let mut rows: Vec<Option<HostRow>> = (0..4).map(|_| Some(HostRow::new(None))).collect();
        for (r, row) in rows.iter_mut().enumerate().skip(1) {
            let row = row.as_mut().unwrap();
            row.block_table = vec![4 + r as u32, 8 + r as u32];
            row.has_pending = true;
        }
        rows[3].as_mut().unwrap().host_sampler = Some(RowSampler::new(&row_init(
            3,
            SamplingParams::greedy(8),
            vec![1],
            vec![],
        )));
        let batch = ExecBatch {
            seqs: vec![
                seq(0, 0, 3, (0, 3), (0, 1)),
                round(1, 4, 3),
                seq(2, 5, 1, (0, 0), (1, 0)),
                round(3, 2, 3),
            ],
            host_tokens: vec![10, 11, 12],
            new_blocks: vec![2],
            ..Default::default()
        };
        (caps, l, vec![i32::MIN; l.len], rows, batch)
    }

    #[test]
    fn speculative_rounds_take_a_logits_row_per_position() {
        let (caps, l, mut meta, mut rows, batch) = spec_step();
        let mut host = Vec::new();
        let n = fill_step(&mut meta, &l, &caps, &batch, &mut rows, &mut host, false);
        // Tokens: 3 prefill (0..3), round 1 (3..7), decode (7), host round (8..12).
        assert_eq!(
            (n.tokens, n.samples, n.logits, n.placed),
            (12, 4, 1 + 4 + 1 + 4, 3)
        );
        let sec = |off: usize, len: usize| meta[off..off + len].to_vec();
        // The prefill's last token; the round's 4 positions; the decode; the host round's 4
        // (it verifies none: its first row is its plain sample).
        assert_eq!(sec(l.logit_rows, 10), [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
        assert_eq!(sec(l.samp_first, 4), [0, 1, 5, 6]);
        assert_eq!(sec(l.samp_draft, 4), [0, 3, 0, 0]);
        assert_eq!(sec(l.sample_rows, 4), [0, 1, 2, 3]);
        // Every decode entry (plain ones too) is placed on the device.
        assert_eq!(sec(l.place_first, 3), [3, 7, 8]);
        assert_eq!(sec(l.place_n, 3), [4, 1, 4]);
        assert_eq!(host, [(3, 3)]);
        // Host positions are upper bounds, inside the booked blocks.
        assert_eq!(sec(l.positions + 3, 4), [4, 5, 6, 7]);
        assert_eq!(sec(l.slot_mapping + 3, 4), [36, 37, 38, 39]);

        let d = fill_draft_step(&mut meta, &l, &batch);
        let sec = |off: usize, len: usize| meta[off..off + len].to_vec();
        // The prefill's 3 tokens, then 2 per decode entry; both rounds draft (the host row's
        // proposals go unverified).
        assert_eq!(
            d,
            DraftCounts {
                tokens: 3 + 2 * 3,
                entries: 3,
                drafting: 2,
            }
        );
        assert!(d.any());
        assert_eq!(sec(l.d_tok_src, 3), [10, 11, 12]);
        assert_eq!(sec(l.d_positions, 3), [0, 1, 2]);
        assert_eq!(sec(l.d_slot_mapping, 3), sec(l.slot_mapping, 3));
        assert_eq!(sec(l.d_tok_row, 9), [0, 0, 0, 1, 1, 2, 2, 3, 3]);
        assert_eq!(sec(l.d_tok_src + 3, 2), [-2, -2]);
        assert_eq!(sec(l.d_place, 3), [3, 5, 7]);
        assert_eq!(sec(l.d_logit_rows, 2), [4, 8]);
        assert_eq!(sec(l.b_tok_row, 2), [1, 3]);
        assert_eq!(sec(l.b_logit_rows, 2), [0, 1]);
        // A decode-only step without rounds leaves the draft idle.
        let plain = ExecBatch {
            seqs: vec![seq(2, 6, 1, (0, 0), (0, 0))],
            ..Default::default()
        };
        assert!(!fill_draft_step(&mut meta, &l, &plain).any());
        assert!(!is_round_only(&batch, 3));
    }

    #[test]
    fn speculative_outputs_are_read_per_sequence() {
        let (max_seqs, k) = (4, 3);
        let mut words = vec![0; max_seqs * (k + 2)];
        // Counts of 3 sequences: a prefill's sample, a round accepting 2 of 3, a host row
        // (emitted | verified << 16).
        words[..3].copy_from_slice(&[1, 3 | 3 << 16, 1]);
        let tok = |j: usize| max_seqs + j * (k + 1);
        words[tok(0)] = 70;
        words[tok(1)..tok(1) + 3].copy_from_slice(&[71, 72, 73]);
        words[tok(2)] = -5; // not written for host rows
        let mut host = vec![(2, 99, None)];
        let mut out = StepOutput::default();
        read_spec_output(&words, (max_seqs, k), &[0, 3, 0], &mut host, &mut out).unwrap();
        assert_eq!(out.tokens, [70, 71, 72, 73, 99]);
        assert_eq!(out.counts, [1, 3, 1]);
        assert_eq!(out.proposed, [0, 3, 0]);
        assert_eq!(out.logprobs.len(), 5);
        assert!(host.is_empty());
        // An n-gram round that found 1 proposal of the 3 booked, and accepted it.
        words[1] = 2 | 1 << 16;
        let mut out = StepOutput::default();
        read_spec_output(
            &words,
            (max_seqs, k),
            &[0, 3, 0],
            &mut vec![(2, 99, None)],
            &mut out,
        )
        .unwrap();
        assert_eq!(
            (&out.counts[..], &out.proposed[..]),
            (&[1, 2, 1][..], &[0, 1, 0][..])
        );
        // A count the round cannot produce is an error, not a guess.
        for bad in [5 | 3 << 16, 3 | 1 << 16, 1 | 4 << 16] {
            words[1] = bad;
            let e = read_spec_output(&words, (max_seqs, k), &[0, 3, 0], &mut vec![], &mut out);
            assert!(e.unwrap_err().to_string().contains("tokens for a round of"));
        }
        words[1] = 0;
        assert!(read_spec_output(&words, (max_seqs, k), &[0, 3], &mut vec![], &mut out).is_err());
    }

    #[test]
    fn validate_bounds_speculative_rounds() {
        let lim = |k: usize| Limits {
            caps: Capacities::new(16, 4, 16, 4).with_spec(k, 16),
            vocab: 100,
            kv_blocks: 10,
            local_kv_blocks: 0,
        };
        let rows = decoding_rows(&[1, 2, 3]);
        let round = |row: u32, draft: u32| round(row, 2, draft);
        let b = ExecBatch {
            seqs: vec![round(0, 3)],
            ..Default::default()
        };
        assert_eq!(validate(&b, &lim(3), &rows, &mut [0; 4]), Ok(()));
        let e = validate(&b, &lim(2), &rows, &mut [0; 4]).unwrap_err();
        assert!(e.contains("speculates 2"), "{e}");
        let e = validate(&b, &lim(0), &rows, &mut [0; 4]).unwrap_err();
        assert!(e.contains("speculates 0"), "{e}");
        // Rounds fill the token budget exactly: 4 x (1 + 3) = 16 tokens and logits rows.
        let four = ExecBatch {
            seqs: (0..4).map(|r| round(r, 3)).collect(),
            ..Default::default()
        };
        assert_eq!(validate(&four, &lim(3), &rows, &mut [0; 4]), Ok(()));
    }

    #[test]
    fn round_graph_padding_matches_the_real_rounds_layout() {
        let caps = Capacities::new(64, 4, 64, 4).with_spec(3, 64);
        let l = MetaLayout::new(&caps);
        let mut meta = vec![i32::MIN; l.len];
        let mut rows = decoding_rows(&[1, 2]);
        let round = |row: u32| round(row, 4, 3);
        // Two real rounds padded to a bucket of 4.
        let batch = ExecBatch {
            seqs: vec![round(2), round(0)],
            ..Default::default()
        };
        assert!(is_round_only(&batch, 3));
        assert!(!is_round_only(&batch, 4));
        let n = fill_step(&mut meta, &l, &caps, &batch, &mut rows, &mut vec![], true);
        let d = fill_draft_step(&mut meta, &l, &batch);
        assert_eq!(
            (n.tokens, n.logits, n.pf_tiles, d.tokens, d.drafting),
            (8, 8, 0, 4, 2)
        );
        assert_eq!(d, DraftCounts::rounds(2));
        assert!(!d.prefill());
        fill_round_padding(&mut meta, &l, 2..4, 3, (9, 4), 4);
        let sec = |off: usize, len: usize| meta[off..off + len].to_vec();
        // Every section continues the real entries' pattern over the bucket.
        assert_eq!(sec(l.place_first, 4), [0, 4, 8, 12]);
        assert_eq!(sec(l.place_n, 4), [4; 4]);
        assert_eq!(sec(l.logit_rows, 16), (0..16).collect::<Vec<_>>());
        assert_eq!(sec(l.d_place, 4), [0, 2, 4, 6]);
        assert_eq!(sec(l.d_logit_rows, 4), [1, 3, 5, 7]);
        assert_eq!(sec(l.b_logit_rows, 4), [0, 1, 2, 3]);
        assert_eq!(sec(l.b_tok_row, 4), [2, 0, 4, 4]);
        assert_eq!(sec(l.tok_row + 8, 8), [4; 8]);
        assert_eq!(sec(l.positions + 8, 8), [-1; 8]);
        assert_eq!(sec(l.d_positions + 4, 4), [-1; 4]);
        assert_eq!(sec(l.b_positions + 2, 2), [-1; 2]);
        // Padding KV goes to the scratch block only.
        for (off, len) in [
            (l.slot_mapping + 8, 8),
            (l.d_slot_mapping + 4, 4),
            (l.b_slot_mapping + 2, 2),
        ] {
            assert!(sec(off, len).iter().all(|&s| (36..40).contains(&s)));
        }
    }

    /// The token rows `spec_place` rewrites for `entries` placement entries (as the kernel
    /// walks them: rows whose `kv_len` is negative, here `pad_row`, keep theirs).
    fn placed_tokens(meta: &[i32], l: &MetaLayout, entries: usize, pad_row: i32) -> Vec<usize> {
        let mut out = vec![];
        for e in 0..entries {
            let (t0, n) = (
                meta[l.place_first + e] as usize,
                meta[l.place_n + e] as usize,
            );
            if meta[l.tok_row + t0] != pad_row {
                out.extend(t0..t0 + n);
            }
        }
        out
    }

    /// A decode graph of a speculative engine places its bucket's entries. A one-token
    /// prefill (host token, no entry) among decode rows leaves fewer entries than tokens: the
    /// entries after the step's own must not be what a step of rounds left there (the graph
    /// would then move the prefill's token to another row's length: wrong first tokens).
    #[test]
    fn decode_graph_padding_places_only_the_steps_entries() {
        let caps = Capacities::new(64, 4, 64, 4).with_spec(3, 64);
        let l = MetaLayout::new(&caps);
        let mut meta = vec![i32::MIN; l.len];
        let mut rows = decoding_rows(&[1, 2, 3]);
        let round = |row: u32| round(row, 4, 3);
        let rounds = ExecBatch {
            seqs: vec![round(0), round(1), round(2)],
            ..Default::default()
        };
        fill_step(&mut meta, &l, &caps, &rounds, &mut rows, &mut vec![], true);
        // Rows 0 and 2 decode; row 3 prefills its last prompt token (the rest was cached).
        let step = ExecBatch {
            seqs: vec![
                seq(0, 8, 1, (0, 0), (0, 0)),
                seq(3, 5, 1, (0, 1), (0, 0)),
                seq(2, 8, 1, (0, 0), (0, 0)),
            ],
            host_tokens: vec![7],
            ..Default::default()
        };
        assert!(is_decode_only(&step));
        let n = fill_step(&mut meta, &l, &caps, &step, &mut rows, &mut vec![], true);
        assert_eq!((n.tokens, n.placed), (3, 2));
        fill_padding(&mut meta, &l, (3..4, n.placed), (9, None), 4, 4);
        assert_eq!(placed_tokens(&meta, &l, 4, 4), [0, 2]);
        assert_eq!(meta[l.tok_src + 1], 7);
        // Capture-time padding of a whole bucket places nothing.
        fill_padding(&mut meta, &l, (0..4, 0), (9, None), 4, 4);
        assert_eq!(placed_tokens(&meta, &l, 4, 4), Vec::<usize>::new());
    }

    /// Row inits stage the tokens before their first chunk (the cached prefix; everything
    /// for a row without a chunk), prompt then output; a prefix past the staging capacity is
    /// left out and its row's history starts at the chunk.
    #[test]
    fn ngram_inits_stage_the_tokens_before_the_first_chunk() {
        let max_rows = 4;
        let mut buf = vec![-7; ngram_stage_words(max_rows)];
        let (rows, starts, offsets, tokens) = ngram_stage_sections(max_rows);
        let batch = ExecBatch {
            row_inits: vec![
                row_init(2, SamplingParams::greedy(4), vec![10, 11, 12, 13], vec![]),
                row_init(0, SamplingParams::greedy(4), vec![20, 21], vec![22, 23]),
                row_init(3, SamplingParams::greedy(4), vec![30, 31, 32], vec![]),
            ],
            seqs: vec![
                seq(2, 3, 1, (0, 1), (0, 0)),
                seq(0, 0, 4, (1, 4), (0, 0)),
                // Row 3 has no chunk this step: its whole context is staged.
            ],
            host_tokens: vec![13, 20, 21, 22, 23],
            ..Default::default()
        };
        let n = stage_ngram_inits(&mut buf, max_rows, &batch);
        assert_eq!(n, 3);
        assert_eq!(&buf[rows..rows + 3], [2, 0, 3]);
        assert_eq!(&buf[starts..starts + 3], [0, 0, 0]);
        assert_eq!(&buf[offsets..offsets + 4], [0, 3, 3, 6]);
        assert_eq!(&buf[tokens..tokens + 6], [10, 11, 12, 30, 31, 32]);
        assert_eq!(ngram_staged_words(&buf, max_rows, n), tokens + 6);
        // A cached prefix larger than what is left: nothing staged, the history starts at
        // the chunk.
        let long: Vec<u32> = (0..NGRAM_STAGE_TOKENS as u32 + 8).collect();
        let batch = ExecBatch {
            row_inits: vec![
                row_init(1, SamplingParams::greedy(4), vec![5, 6], vec![]),
                row_init(2, SamplingParams::greedy(4), long, vec![]),
            ],
            seqs: vec![
                seq(1, 1, 1, (0, 1), (0, 0)),
                seq(2, NGRAM_STAGE_TOKENS as u32 + 4, 4, (1, 4), (0, 0)),
            ],
            host_tokens: vec![6, 1, 2, 3, 4],
            ..Default::default()
        };
        let n = stage_ngram_inits(&mut buf, max_rows, &batch);
        assert_eq!(&buf[starts..starts + 2], [0, NGRAM_STAGE_TOKENS as i32 + 4]);
        assert_eq!(&buf[offsets..offsets + 3], [0, 1, 1]);
        assert_eq!(buf[tokens], 5);
        assert_eq!(ngram_staged_words(&buf, max_rows, n), tokens + 1);
    }
}
