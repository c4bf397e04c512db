//! Speculative decoding on the CUDA backend (docs/speculative.md): a draft model proposes,
//! the target verifies every round in one forward, and rejection sampling accepts, all on the
//! compute stream, so the host never waits for a round before launching the next.
//!
//! A step with speculative rounds enqueues, in stream order:
//!
//! ```text
//!   spec_place(draft, off -1)   decode entries of the draft's first forward: the token before
//!                               the pending one and the pending one, at kv_len - 1 and kv_len
//!   draft forward               prefill chunks (the draft's KV keeps up with the target's) and
//!                               those 2 tokens per decode entry
//!   draft_sample(0)             proposal 1 (and its distribution q) per drafting row
//!   k - 1 times:                spec_place(off i): proposal i at kv_len + i; draft forward;
//!                               draft_sample(i)
//!   spec_place(target, off 0)   decode entries at kv_len ..: [pending, proposals]
//!   target forward              logits of every round position
//!   spec_verify                 accept / resample / bonus per row; pending, kv_len, prev_tok
//! ```
//!
//! The rows' true lengths (`kv_len`) and the tokens at `kv_len - 1` (`prev_tok`) live on the
//! device beside `pending`: the host's positions for a decode entry are upper bounds while
//! earlier rounds are in flight, and the placement kernel puts every decode entry (plain ones
//! too) where its row really is. The draft's KV sits in its own cache indexed by the same block
//! ids: one block table serves both.
//!
//! With n-gram lookup (`--speculative-method ngram`) there is no draft model: the step
//! records its host tokens (prefill chunks) in per-row token histories on the device
//! (`ngram_record`), `ngram_propose` looks up each round's proposals there (one block per
//! row; the reference is `crate::spec::ngram_propose`, and check-spec compares the device's
//! lookups with the CPU backend's), and `spec_verify` appends the tokens each round kept.
//! Proposals are point masses (`q` null); a row that finds fewer than booked verifies fewer
//! (its count per row), and the output word carries the count verified. A row init stages its
//! cached prefix (`meta::stage_ngram_inits`); one that does not fit the step's staging starts
//! its history at its first chunk (fewer matches, same output).
//!
//! CUDA graphs (`HARRIER_SPEC_GRAPHS`: on unless 0): a step whose sequences are all rounds of
//! `k` (up to [`ROUND_GRAPH_MAX_SEQS`] sequences) replays a graph of everything above but the
//! verification (which runs after it with the real rows), padded to its bucket; a step of
//! plain decodes without proposer work replays a graph of the placement and the target's
//! forward (a decode step with proposer work, a one-token prefill after a prefix-cache hit,
//! runs eagerly). Padding rows belong to the padding row, whose `kv_len` is -1: the placement
//! leaves their metadata as the host wrote it (position -1, KV into the scratch block), and
//! placement entries past the step's own are no-ops. Other steps (prefill chunks, mixed
//! steps) run eagerly.
//!
//! Session 9's graphs diverged on the device. The one bug found since: a decode graph placed
//! its whole bucket's entries while a one-token prefill had left fewer entries than tokens,
//! so the entries past the step's own were what an earlier step of rounds had left there,
//! and moved other rows' tokens (`meta::fill_padding` now makes them no-ops; tested). Every
//! device check passes with graphs since (docs/speculative.md), though the failing runs had
//! prefix caching off, so that bug may not have been all of it.

//! Host-sampled rows (logprobs) draft like the others, so that a step of rounds keeps its
//! shapes, but verify none of their proposals: their round emits one token. A step without
//! rounds (speculation turned off by batch size) skips the draft, whose KV then misses those
//! positions (acceptance falls for them; the output does not change).

use anyhow::Context;
use harrier_kernels::cudarc::driver::{result as dr, sys};
use harrier_kernels::{
    BlockTables, Dtype, Kernels, NgramHist, PlaceEntries, SamplerState, SpecRows, TokenMeta,
};

use super::layout::{Capacities, MetaLayout, ScratchSizes};
use super::meta::DraftCounts;
use super::model::{GpuModel, StepMeta};
use super::{ck, decode_split_count, per_token_kernels, DevBuf};
use crate::model::ModelDir;

/// Steps of rounds of up to this many sequences replay captured graphs (larger ones are
/// rarely worth speculating: `--speculative-disable-by-batch-size`).
pub(crate) const ROUND_GRAPH_MAX_SEQS: usize = 64;

/// Which CUDA graphs a speculative engine captures (`HARRIER_SPEC_GRAPHS`, for debugging and
/// measurement): unset, `1` or `all` both kinds, `rounds` only steps of rounds, `decode` only
/// placed plain decode steps, `0` none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SpecGraphs {
    pub rounds: bool,
    pub decode: bool,
}

impl SpecGraphs {
    pub fn from_env() -> anyhow::Result<SpecGraphs> {
        let v = std::env::var("HARRIER_SPEC_GRAPHS").unwrap_or_default();
        Self::parse(&v)
    }

    fn parse(v: &str) -> anyhow::Result<SpecGraphs> {
        let (rounds, decode) = match v {
            "0" => (false, false),
            "" | "1" | "all" => (true, true),
            "rounds" => (true, false),
            "decode" => (false, true),
            other => anyhow::bail!(
                "HARRIER_SPEC_GRAPHS={other:?}: expected 0, 1 (all), rounds or decode"
            ),
        };
        Ok(SpecGraphs { rounds, decode })
    }

    pub fn any(&self) -> bool {
        self.rounds || self.decode
    }
}

/// What proposes (the executor's configuration).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaProposer {
    /// A draft model's directory.
    Draft(std::path::PathBuf),
    /// N-gram lookup over suffixes of `min ..= max` tokens.
    Ngram { min: usize, max: usize },
}

/// Speculative decoding on the CUDA backend: the proposer and the proposals per round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaSpecConfig {
    pub proposer: CudaProposer,
    pub k: usize,
}

/// A draft model and the distributions its proposals were drawn from.
pub(crate) struct DraftProposer {
    pub model: GpuModel,
    /// `[rows, k, vocab]` f32: the draft's distribution of each proposal (sampled rows).
    q: DevBuf,
}

/// N-gram lookup: per-row token histories on the device (see `ngram_propose` in the
/// kernels' source) and how many proposals each row found.
pub(crate) struct NgramProposer {
    min: usize,
    max: usize,
    /// `[rows, stride]` i32: row r's token at each position below its `kv_len`.
    hist: DevBuf,
    stride: usize,
    /// `[rows]` i32: the first position the history knows (0 unless a row's cached prefix did
    /// not fit its step's staging).
    start: DevBuf,
    /// `[rows]` i32: proposals found in the last lookup.
    count: DevBuf,
}

pub(crate) enum Proposer {
    Draft(Box<DraftProposer>),
    Ngram(NgramProposer),
}

/// The proposer and the per-row state of speculative rounds.
pub(crate) struct SpecDecoder {
    pub proposer: Proposer,
    /// Proposals per round.
    pub k: usize,
    kv_len: DevBuf,
    prev_tok: DevBuf,
    proposals: DevBuf,
}

/// A fresh device allocation of `bytes`, zeroed on `stream`.
fn zeroed(bytes: usize, stream: sys::CUstream) -> anyhow::Result<DevBuf> {
    let b = DevBuf::new(bytes)?;
    ck(
        // SAFETY: a fresh allocation of `bytes`, zeroed on our stream.
        unsafe { dr::memset_d8_async(b.ptr, 0, b.bytes, stream) },
        "memset",
    )?;
    Ok(b)
}

impl SpecDecoder {
    /// Sets up speculation as `cfg` asks: a draft model is loaded from its directory (same
    /// dtype as the target) with activations for the draft's first forward of a step
    /// ([`Capacities::max_draft_tokens`]); n-gram lookup gets its token histories.
    pub fn load(
        cfg: &CudaSpecConfig,
        target: &ModelDir,
        stream: sys::CUstream,
        caps: &Capacities,
        dtype: Dtype,
    ) -> anyhow::Result<SpecDecoder> {
        let (k, rows) = (cfg.k, caps.max_seqs + 1);
        let vocab = target.config.vocab_size;
        let proposer = match &cfg.proposer {
            CudaProposer::Draft(path) => {
                let dir = ModelDir::open(path).with_context(|| {
                    format!("opening the draft model directory {}", path.display())
                })?;
                crate::spec::check_draft(target, &dir)?;
                super::check_head_layout(&dir.config)
                    .with_context(|| format!("draft model {}", path.display()))?;
                let mut dcaps = Capacities::new(
                    caps.max_draft_tokens(),
                    caps.max_seqs,
                    caps.max_blocks_per_seq * caps.block_size,
                    caps.block_size,
                );
                dcaps.max_blocks_per_seq = caps.max_blocks_per_seq;
                let sizes = ScratchSizes::new(&dir.config, &dcaps, dtype.size());
                let model = GpuModel::load(&dir, stream, &dcaps, &sizes, dtype, false)
                    .with_context(|| format!("loading the draft model {}", path.display()))?;
                let q = DevBuf::new(rows * k * vocab * 4)
                    .context("allocating the draft distributions")?;
                Proposer::Draft(Box::new(DraftProposer { model, q }))
            }
            &CudaProposer::Ngram { min, max } => {
                // Positions up to the booked length of a round past the model length.
                let stride = caps.max_blocks_per_seq * caps.block_size;
                Proposer::Ngram(NgramProposer {
                    min,
                    max,
                    hist: zeroed(rows * stride * 4, stream)
                        .context("allocating the n-gram token histories")?,
                    stride,
                    start: zeroed(rows * 4, stream)?,
                    count: zeroed(rows * 4, stream)?,
                })
            }
        };
        let kv_len = zeroed(rows * 4, stream)?;
        ck(
            // SAFETY: the last entry (the graph padding row) of our allocation: -1, so that
            // `spec_place` leaves padding where the host put it.
            unsafe { dr::memset_d8_async(kv_len.at(caps.max_seqs * 4), 0xff, 4, stream) },
            "memset",
        )?;
        Ok(SpecDecoder {
            proposer,
            k,
            kv_len,
            prev_tok: zeroed(rows * 4, stream)?,
            // Zeroed: a proposal slot never drafted (host-sampled rows) still embeds a valid id.
            proposals: zeroed(rows * k * 4, stream)?,
        })
    }

    /// The draft model, if one proposes.
    pub fn draft(&self) -> Option<&GpuModel> {
        match &self.proposer {
            Proposer::Draft(d) => Some(&d.model),
            Proposer::Ngram(_) => None,
        }
    }

    pub fn draft_mut(&mut self) -> Option<&mut GpuModel> {
        match &mut self.proposer {
            Proposer::Draft(d) => Some(&mut d.model),
            Proposer::Ngram(_) => None,
        }
    }

    /// The n-gram histories, if n-gram lookup proposes.
    pub fn ngram_hist(&self) -> Option<NgramHist> {
        match &self.proposer {
            Proposer::Ngram(n) => Some(n.hist()),
            Proposer::Draft(_) => None,
        }
    }

    /// Device bytes of the per-row state (a draft's q buffer dominates).
    pub fn state_bytes(&self) -> usize {
        let own = self.kv_len.bytes + self.prev_tok.bytes + self.proposals.bytes;
        own + match &self.proposer {
            Proposer::Draft(d) => d.q.bytes,
            Proposer::Ngram(n) => n.hist.bytes + n.start.bytes + n.count.bytes,
        }
    }

    pub fn rows(&self, pending: u64) -> SpecRows {
        let (q, prop_count, hist) = match &self.proposer {
            Proposer::Draft(d) => (d.q.ptr, 0, NgramHist::default()),
            Proposer::Ngram(n) => (0, n.count.ptr, n.hist()),
        };
        SpecRows {
            kv_len: self.kv_len.ptr,
            prev_tok: self.prev_tok.ptr,
            pending,
            proposals: self.proposals.ptr,
            q,
            k: self.k as i32,
            prop_count,
            hist,
        }
    }

    /// Enqueues a speculative step's forward work, eagerly or under graph capture (the same
    /// launches either way): proposing when `draft` has work, the `placed` decode entries put
    /// at their rows' true lengths, then the target's forward over `m`. `mark` (eager timing
    /// only) is recorded between the proposer's work and the target's.
    ///
    /// # Safety
    /// As [`DraftProposer::propose`]; `m` is the target's view of the slot's metadata.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn enqueue_step(
        &mut self,
        kn: &Kernels,
        st: sys::CUstream,
        target: &mut GpuModel,
        (meta, l): (&DevBuf, &MetaLayout),
        (draft, placed): (DraftCounts, usize),
        m: &StepMeta,
        (rows_d, state): (u64, SamplerState),
        (bt, mark): (BlockTables, Option<sys::CUevent>),
    ) -> anyhow::Result<()> {
        let target_meta = TokenMeta {
            tok_src: m.tok_src,
            positions: m.positions,
            slots: m.slot_mapping,
            tok_row: m.tok_row,
        };
        // SAFETY: forwarded from the caller; the placement entries are the slot's sections.
        unsafe {
            if draft.any() {
                let spec = self.rows(m.pending);
                match &mut self.proposer {
                    Proposer::Draft(d) => {
                        d.propose(kn, st, (meta, l), draft, m, (rows_d, state), (spec, bt))?
                    }
                    Proposer::Ngram(ng) => {
                        // The step's host tokens (prefill chunks) before placement (decode
                        // entries still read `pending`), then the lookups. Steps of rounds
                        // (graphs included) have none to record.
                        if draft.prefill() {
                            kn.ngram_record(st, ng.hist(), target_meta, m.n_tokens as u32)?;
                        }
                        if draft.drafting > 0 {
                            kn.ngram_propose(
                                st,
                                spec,
                                meta.at(l.b_tok_row * 4),
                                (ng.min as i32, ng.max as i32),
                                draft.drafting as u32,
                            )?;
                        }
                    }
                }
            }
            if let Some(ev) = mark {
                ck(dr::event::record(ev, st), "event record")?;
            }
            kn.spec_place(
                st,
                target_meta,
                PlaceEntries {
                    first: meta.at(l.place_first * 4),
                    ntok: meta.at(l.place_n * 4),
                    n_const: 0,
                    n: placed as u32,
                    off0: 0,
                },
                self.rows(m.pending),
                bt,
            )?;
            target.forward(kn, st, m)
        }
    }
}

impl DraftProposer {
    /// Enqueues the draft's work of a step: its first forward (prefill chunks and the decode
    /// entries' last two tokens) and the `k` proposals of every drafting row.
    ///
    /// # Safety
    /// `meta` is the slot's device metadata holding the draft sections [`fill_draft_step`]
    /// wrote (uploaded); `base` carries the executor's shared addresses.
    ///
    /// [`fill_draft_step`]: super::meta::fill_draft_step
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn propose(
        &mut self,
        kn: &Kernels,
        st: sys::CUstream,
        (meta, l): (&DevBuf, &MetaLayout),
        c: DraftCounts,
        base: &StepMeta,
        (rows_d, state): (u64, SamplerState),
        (spec, bt): (SpecRows, BlockTables),
    ) -> anyhow::Result<()> {
        let vocab = self.model.config.vocab_size as i32;
        let at = |off: usize| meta.at(off * 4);
        // SAFETY: (all launches) the sections hold the counts `fill_draft_step` wrote; the
        // draft's activations hold `max_draft_tokens` rows and its logits `max_seqs` rows.
        unsafe {
            kn.spec_place(
                st,
                TokenMeta {
                    tok_src: at(l.d_tok_src),
                    positions: at(l.d_positions),
                    slots: at(l.d_slot_mapping),
                    tok_row: at(l.d_tok_row),
                },
                PlaceEntries {
                    first: at(l.d_place),
                    ntok: 0,
                    n_const: 2,
                    n: c.entries as u32,
                    off0: -1,
                },
                spec,
                bt,
            )?;
            // The attention plans of the first forward and of the drafting rows' decode steps.
            let cfg = &self.model.config;
            let (grouped, grp) = per_token_kernels(kn, cfg, c.tokens, false, None);
            let splits = decode_split_count(kn, cfg, c.drafting);
            let (later_grouped, later_grp) =
                per_token_kernels(kn, cfg, c.drafting, splits > 1, None);
            let first = StepMeta {
                n_tokens: c.tokens,
                n_samples: c.drafting,
                tok_src: at(l.d_tok_src),
                positions: at(l.d_positions),
                slot_mapping: at(l.d_slot_mapping),
                tok_row: at(l.d_tok_row),
                logit_rows: at(l.d_logit_rows),
                grouped_attention: grouped,
                grp_attention: grp,
                decode_splits: None,
                n_pf_tiles: 0,
                n_att_listed: 0,
                gemm_rows: None,
                ..*base
            };
            self.model.forward(kn, st, &first)?;
            let n = c.drafting as u32;
            if n == 0 {
                return Ok(());
            }
            let spec_rows = at(l.b_tok_row);
            let logits = self.model.logits_ptr();
            kn.row_argmax_parts(st, logits, vocab, state.argmax_parts, n)?;
            kn.draft_sample(st, logits, vocab, spec_rows, 0, rows_d, spec, state, n)?;
            let later = StepMeta {
                n_tokens: c.drafting,
                n_samples: c.drafting,
                tok_src: at(l.b_tok_src),
                positions: at(l.b_positions),
                slot_mapping: at(l.b_slot_mapping),
                tok_row: spec_rows,
                logit_rows: at(l.b_logit_rows),
                grouped_attention: later_grouped,
                grp_attention: later_grp,
                decode_splits: (splits > 1).then_some(splits),
                ..first
            };
            for i in 1..spec.k {
                kn.spec_place(
                    st,
                    TokenMeta {
                        tok_src: later.tok_src,
                        positions: later.positions,
                        slots: later.slot_mapping,
                        tok_row: spec_rows,
                    },
                    PlaceEntries {
                        first: 0,
                        ntok: 0,
                        n_const: 1,
                        n,
                        off0: i,
                    },
                    spec,
                    bt,
                )?;
                self.model.forward(kn, st, &later)?;
                kn.row_argmax_parts(st, logits, vocab, state.argmax_parts, n)?;
                kn.draft_sample(st, logits, vocab, spec_rows, i, rows_d, spec, state, n)?;
            }
        }
        Ok(())
    }
}

impl NgramProposer {
    fn hist(&self) -> NgramHist {
        NgramHist {
            hist: self.hist.ptr,
            stride: self.stride as i32,
            start: self.start.ptr,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SpecGraphs;

    #[test]
    fn spec_graphs_parse_every_choice_and_refuse_others() {
        let g = |v| SpecGraphs::parse(v).map(|g| (g.rounds, g.decode));
        assert_eq!(g("").unwrap(), (true, true));
        assert_eq!(g("0").unwrap(), (false, false));
        assert_eq!(g("1").unwrap(), (true, true));
        assert_eq!(g("all").unwrap(), (true, true));
        assert_eq!(g("rounds").unwrap(), (true, false));
        assert_eq!(g("decode").unwrap(), (false, true));
        let e = g("yes").unwrap_err().to_string();
        assert!(
            e.contains("HARRIER_SPEC_GRAPHS") && e.contains("rounds"),
            "{e}"
        );
    }
}
