//! The model on the GPU: weights in the storage type (bf16, or f32 for exact checks; q|k|v
//! and gate|up fused at load), persistent activation buffers sized for the largest step, the
//! paged KV cache, and the forward pass as a sequence of our kernels and cuBLAS GEMMs on one
//! stream.

use anyhow::{anyhow, bail, Context};
use half::bf16;
use harrier_kernels::cudarc::driver::{result as dr, sys};
use harrier_kernels::{
    skinny_supports, AttentionInputs, Dtype, EmbedNorm, GrpLaunch, Kernels, SkinnyEpilogue as Epi,
    SkinnyInputs, SkinnyRope,
};

mod ring;
pub(crate) use ring::{ring_auto, ring_copy_bytes};

use super::blas::Blas;
use super::fp8_gemm::{Fp8Gemm, Fp8Out};
use super::layout::{Capacities, ScratchSizes};
use super::{ck, DevBuf};
use crate::model::{
    fp8, fp8::ScaleLayout, Activation, Checkpoint, LayerAttention, LayerTensor, ModelConfig,
    ModelDir, WeightDtype, WeightRef, EMBED, FINAL_NORM, LM_HEAD,
};

/// A projection's weights `[n, k]`: in the storage type, or (FP8) e4m3 bytes with one f32
/// scale per row.
struct Proj {
    w: DevBuf,
    scale: Option<DevBuf>,
}

impl Proj {
    /// The scale buffer's address, 0 for weights in the storage type (see
    /// [`SkinnyInputs::scaled`]).
    fn scale_ptr(&self) -> u64 {
        self.scale.as_ref().map_or(0, |s| s.ptr)
    }

    /// A skinny-GEMM launch over these weights (their scales included):
    /// `y[m, n] = epi(x[m, :] · w[n, :])`.
    fn skinny(
        &self,
        (x, y): (u64, u64),
        rows: usize,
        n: usize,
        k: usize,
        epi: Epi,
    ) -> SkinnyInputs {
        SkinnyInputs::new((x, self.w.ptr, y), rows, n, k, epi).scaled(self.scale_ptr())
    }
}

struct Layer {
    input_norm: DevBuf,
    qkv: Proj,
    qk_norm: Option<(DevBuf, DevBuf)>,
    o: Proj,
    post_norm: DevBuf,
    /// Gemma 3: the MLP's input and output norms (`post_norm` norms the attention output).
    ff_norms: Option<(DevBuf, DevBuf)>,
    gate_up: Proj,
    down: Proj,
    /// Sliding window in keys (0: full attention).
    window: i32,
    /// Sliding layers use `inv_freq_local`.
    local_rope: bool,
}

struct Scratch {
    x: DevBuf,
    h: DevBuf,
    qkv: DevBuf,
    attn: DevBuf,
    delta: DevBuf,
    gate_up: DevBuf,
    act: DevBuf,
    logits: DevBuf,
    final_h: DevBuf,
    attn_part: DevBuf,
    /// A deferred norm's partial sums of squares ([`NormAt::Deferred`]).
    norm_ss: DevBuf,
    /// FP8 models: a bf16 copy of one projection (or a slice of the output head) for the
    /// steps the skinny kernels do not take.
    wdq: Option<DevBuf>,
}

/// One step's device metadata (addresses inside the slot's buffer), the per-row block tables
/// and counts. For a graph step the counts are the bucket's (padding included).
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepMeta {
    pub n_tokens: usize,
    pub n_samples: usize,
    pub tok_src: u64,
    pub positions: u64,
    pub slot_mapping: u64,
    /// The sliding layers' slots and block tables (hybrid caches; else unused).
    pub slot_mapping_local: u64,
    pub row_block_tables_local: u64,
    pub tok_row: u64,
    pub logit_rows: u64,
    /// `[rows + 1, bt_stride]` block ids.
    pub row_block_tables: u64,
    pub bt_stride: usize,
    pub pending: u64,
    /// Attention splits of a decode step; `None`: one (steps with prefill work, or batches
    /// that fill the GPU without splits).
    pub decode_splits: Option<usize>,
    /// Every token's context fits one attention split (at most
    /// `Kernels::attn_one_split_keys` keys): a split launch needs no `attention_combine`.
    /// Set for the decode steps that replay short-context graphs (and their eager twins).
    pub short_context: bool,
    /// Prefill attention tiles (`[n][2]`) and the tokens they leave (per-token kernel); with
    /// no tiles the per-token kernel takes every token.
    pub pf_tiles: u64,
    pub n_pf_tiles: usize,
    pub att_list: u64,
    pub n_att_listed: usize,
    /// The per-token attention rows run `paged_attention_gqa` (one split only).
    pub grouped_attention: bool,
    /// The per-token attention rows run `paged_attention_grp*` (`Kernels::paged_attention_grouped`:
    /// any splits, or one with a token list) in blocks of this many warps
    /// (`Kernels::grp_launch_warps` for the plan's rows) instead of the per-head kernel.
    pub grp_attention: Option<u32>,
    /// An eager decode step that a graph bucket holds: its GEMMs run over the bucket's rows
    /// (the rows past the batch hold stale activations; each output row depends only on its
    /// own input row) because cuBLAS may pick another kernel, which rounds differently, for
    /// another M (gemma-3-1b's down projection at 44 vs 48 rows, check-gemm-rows). A request's
    /// tokens are then the same whether its steps replay a graph or run eagerly.
    pub gemm_rows: Option<usize>,
}

/// The weight bytes one decode step reads whatever its batch, of `loaded` bytes loaded (before
/// any copy of the decode ring's): every layer's as loaded (FP8 with its scales), the norms and
/// the output head, but not the embedding when the head is a matrix of its own (untied, or a
/// tied head's FP8 copy): a step reads one embedding row a token. The bandwidth floor's bytes
/// (`harrier-cuda-tool bench`).
pub fn step_weight_bytes(loaded: usize, embed: usize, separate_head: bool) -> usize {
    if separate_head {
        loaded - embed
    } else {
        loaded
    }
}

pub struct GpuModel {
    pub config: ModelConfig,
    pub dtype: Dtype,
    /// Every weight byte loaded (the decode ring's transposed copies added when it takes them).
    pub weight_bytes: usize,
    /// The weight bytes a decode step reads whatever its batch: see [`step_weight_bytes`].
    pub decode_bytes: usize,
    embed: DevBuf,
    /// `None` when tied to the embedding and not quantized (`--quantization fp8` gives a tied
    /// head its own FP8 copy).
    lm_head: Option<Proj>,
    /// Projections and the output head hold FP8 weights (see [`Proj`]).
    pub fp8: bool,
    final_norm: DevBuf,
    layers: Vec<Layer>,
    inv_freq: DevBuf,
    /// The sliding layers' RoPE frequencies (Gemma 3).
    inv_freq_local: Option<DevBuf>,
    /// The embedding multiplier in the storage type (Gemma 3: `sqrt(hidden)`; else 1).
    embed_scale: f32,
    scratch: Scratch,
    /// Per layer K and V: `[num_blocks * block_size, nkv, hd]` elements each (a hybrid cache's
    /// sliding layers: `num_local_blocks`).
    kv: Option<DevBuf>,
    /// Per layer: byte offsets of its K and V in `kv`, and whether it uses the local pool.
    kv_layers: Vec<(usize, usize, bool)>,
    block_size: usize,
    pub blas: Blas,
    /// FP8 tensor-core GEMMs for the steps past the skinny kernels (FP8 models on sm_89+).
    fp8_gemm: Option<Fp8Gemm>,
    /// Steps of up to this many GEMM rows take the fused small-batch path (0: never; f32
    /// models never do, see [`ProjPlan::new`]). Set by the executor after loading.
    pub fused_max_rows: usize,
    /// q and k rows (weights and K cache) are in the paired RoPE order ([`pair_rope_rows`]).
    rope_paired: bool,
    /// Skinny q|k|v GEMMs of models without q/k norms rotate q and k and write the KV cache in
    /// their epilogue instead of a `rope_kv_write` launch (`HARRIER_ROPE_EPILOGUE=0`: off, to
    /// compare).
    rope_epilogue: bool,
    /// Measurement only: launches left out of every step ([`SkipStages`]).
    skip: SkipStages,
    /// FP8 skinny steps within the fused limit take the fused path's residual epilogues and
    /// norms (deferred, or in the prologues) as bf16 ones do, on models wider than
    /// [`FP8_FUSED_NARROW`] up to this many rows (default [`FP8_FUSED_MAX_ROWS_WIDE`];
    /// `HARRIER_FP8_FUSED_WIDE_ROWS=N` to measure); `None` with `HARRIER_FP8_FUSED=0`: the
    /// plain FP8 skinny kernels, to compare ([`ProjPlan::new`] has the numbers).
    fp8_fused: Option<usize>,
    /// Measurement only: the norm prologues' row limit for every width
    /// (`HARRIER_NORM_MAX_ROWS=N`; default [`norm_prologue_max_rows`]).
    norm_max_rows: Option<usize>,
    /// Measurement only: the fused path's row limit on models 2,049-3,072 wide
    /// (`HARRIER_FUSED_WIDE_MAX_ROWS=N`; default [`fused_width_max_rows`]'s 12).
    fused_wide_rows: Option<usize>,
    /// Fused steps defer their norms ([`NormAt::Deferred`]); `HARRIER_DEFERRED_NORM=0`
    /// takes the prologues or launches instead (to compare).
    deferred_norm: bool,
    /// Layer 0's input norm, where a step would launch it, runs in the embedding launch
    /// (`HARRIER_EMBED_NORM=0`: an `add_rmsnorm` launch after it, to compare).
    embed_norm: bool,
    /// The batch-1 decode step as one persistent launch ([`ring`]), when prepared.
    ring: Option<ring::RingDecode>,
}

/// A stage of a decode step's launches, for [`SkipStages`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// The q|k|v projection (with its fused norm and RoPE).
    Qkv = 1,
    /// Per-token attention (and `attention_combine`).
    Attn = 2,
    /// The o projection.
    O = 4,
    /// The gate|up projection (with its fused norm and activation).
    GateUp = 8,
    /// The down projection.
    Down = 16,
    /// Standalone `add_rmsnorm` / `rope_kv_write` launches inside the layers.
    Norm = 32,
    /// The final norm and the output head.
    Head = 64,
}

/// Measurement only (`HARRIER_SKIP_STAGES=qkv,attn,o,gate_up,down,norm,head`): the named
/// stages' launches are left out of every step (and of captured graphs), so a `bench` run
/// without a stage against one with it gives that stage's share of a step on the critical
/// path, PDL overlap included. The step's outputs are then wrong; a warning says so at load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct SkipStages(u8);

impl SkipStages {
    /// Parses a comma-separated list of stage names.
    fn parse(list: &str) -> anyhow::Result<SkipStages> {
        let mut mask = 0;
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            mask |= match name {
                "qkv" => Stage::Qkv,
                "attn" => Stage::Attn,
                "o" => Stage::O,
                "gate_up" => Stage::GateUp,
                "down" => Stage::Down,
                "norm" => Stage::Norm,
                "head" => Stage::Head,
                _ => bail!("unknown stage {name:?} (qkv, attn, o, gate_up, down, norm, head)"),
            } as u8;
        }
        Ok(SkipStages(mask))
    }

    fn from_env() -> anyhow::Result<SkipStages> {
        let v = std::env::var("HARRIER_SKIP_STAGES").unwrap_or_default();
        let skip = SkipStages::parse(&v).context("HARRIER_SKIP_STAGES")?;
        if skip.0 != 0 {
            tracing::warn!("HARRIER_SKIP_STAGES={v}: steps leave launches out, outputs are wrong");
        }
        Ok(skip)
    }

    /// Whether `stage`'s launches run.
    fn runs(self, stage: Stage) -> bool {
        self.0 & stage as u8 == 0
    }

    /// Every launch runs.
    fn is_none(self) -> bool {
        self.0 == 0
    }
}

/// FP8 models: steps of up to this many GEMM rows run every projection through the FP8 skinny
/// kernels (the weights read once, in 1 byte each, activations bf16); larger steps take FP8
/// tensor-core GEMMs ([`super::fp8_gemm`], sm_89+) or, without them, dequantize each
/// projection to a bf16 scratch copy and run cuBLAS. The output head picks by the step's
/// sampled rows. Measured on the H100 (session 8, 1B, ms per decode step): with FP8 GEMMs,
/// batch 8 on the skinny kernels 1.587, batch 16 2.212, batch 32 on FP8 GEMMs 1.683: the GEMM
/// route already wins at 16, so its limit is 8 ([`FP8_SKINNY_MAX_ROWS_WITH_GEMM`]); without
/// them the skinny kernels beat dequantize + cuBLAS up to 16 rows (gate|up 28.7 vs ~65 us at
/// 16 rows; at 64 rows 137 vs 65).
const FP8_SKINNY_MAX_ROWS: usize = 16;
const FP8_SKINNY_MAX_ROWS_WITH_GEMM: usize = 8;

/// The most rows of a fused step on a model `hidden` wide (whatever `--fused-decode-max-rows`
/// allows): every block of a skinny launch reads all input rows of its reduction, so wider
/// models win over fewer rows. Measured on the H200 (graphs, context 512, ms per step, fused
/// vs the unfused launches):
/// - up to 2,048 wide, 16 (the skinny kernels' two n-tile instances past 8 rows; session 39):
///   the 1B 1.165-1.172 vs 1.219 at 9 rows, 1.196-1.208 vs 1.244 at 16; Qwen3-0.6B (1,024)
///   1.166 vs 1.407 and 1.236 vs 1.491;
/// - up to 3,072, 12 (session 40): the 3B 2.642-2.648 vs 2.773-2.778 at 9, 2.700-2.711 vs
///   2.791-2.792 at 10, 2.778-2.789 vs 2.814-2.816 at 12, but 2.888-2.902 vs 2.847-2.851 at 14
///   and 2.974-2.987 vs 2.877-2.880 at 16 (`wide`, when set, replaces this band's limit:
///   `HARRIER_FUSED_WIDE_MAX_ROWS=N`, to measure);
/// - wider, 1 (session 12): the 8B (4,096) loses at 2 and 8 rows (5.569 vs 5.404, 6.555 vs
///   6.402), where the 1B and 3B win or tie (`config::FUSED_DECODE_MAX_ROWS` has their numbers).
fn fused_width_max_rows(hidden: usize, wide: Option<usize>) -> usize {
    match hidden {
        0..=2048 => 16,
        2049..=3072 => wide.unwrap_or(12),
        _ => 1,
    }
}

/// FP8 steps of models at most this wide take the fusions up to the fused limit (the 1B and
/// Qwen3-0.6B gain at every row count up to 8); wider ones up to [`FP8_FUSED_MAX_ROWS_WIDE`]
/// rows. The measured boundary lies between the 1B (2,048) and the 3B (3,072).
const FP8_FUSED_NARROW: usize = 2048;

/// FP8 steps of models wider than [`FP8_FUSED_NARROW`] take the fusions up to this many
/// rows (narrower ones up to the fused limit): measured on the H200 (session 33, graphs,
/// context 512, ms per step, fused with deferred norms vs the plain FP8 skinny kernels) the 3B
/// gains at 2-4 rows (2: 1.772 vs 1.918-1.927, 3: 1.959-1.961 vs 2.039-2.046, 4: 2.085-2.090
/// vs 2.205-2.213) and loses at 5-8 (5: 2.224 vs 2.191-2.194, 6: 2.388-2.390 vs 2.379-2.380,
/// 8: 2.473-2.490 vs 2.435-2.455), where the 1B and Qwen3-0.6B gain at every row count up to
/// 8. A power of two, as the norm prologues' limits are (a batch and the graph bucket it pads
/// to take the same plan). The loss is the 4-tile `_dn` instances' (session 34: without them
/// the fused 3B ties the plain kernels at 5 and 8 rows; bf16 needs them), so no other limit
/// gains.
const FP8_FUSED_MAX_ROWS_WIDE: usize = 4;

/// Steps of at most this many rows norm inside the q|k|v and gate|up GEMMs (models up to
/// [`NORM_PROLOGUE_NARROW`] wide: [`NORM_PROLOGUE_MAX_ROWS_NARROW`]). Every block of the launch
/// normalises the whole input again: at 1 row that costs 2.5 us over the plain skinny GEMM on
/// the 1B's q|k|v, less than a separate `add_rmsnorm` launch; at 8 rows 7.7 us, more (H100,
/// `check-gemv`; docs/benchmarks.md).
const NORM_PROLOGUE_MAX_ROWS: usize = 2;
/// Models at most this wide norm in the prologues up to [`NORM_PROLOGUE_MAX_ROWS_NARROW`] rows:
/// measured on the H200 (session 28, graphs, context 512, ms per step, prologue vs
/// `add_rmsnorm` launches) the 1B shape gains at 3 to 6 rows (3: 1.030 vs 1.046, 4: 1.068 vs
/// 1.081, 5: 1.145 vs 1.163, 6: 1.164 vs 1.172) and loses at 8 (1.167 vs 1.133), Qwen3-0.6B
/// (1,024 wide) gains at 4 (1.043 vs 1.051) and loses at 6 (1.213 vs 1.190), the 3B (3,072
/// wide) loses from 4 rows (2.727 vs 2.709).
const NORM_PROLOGUE_NARROW: usize = 2048;
const NORM_PROLOGUE_MAX_ROWS_NARROW: usize = 4;

/// The norm prologues' row limit for a model `hidden` wide. (Both limits are powers of two: a
/// batch and the default graph bucket it pads to take the same plan, so graph replays and
/// eager steps normalise alike, as `layout::decode_attention_splits` rounds for attention.)
fn norm_prologue_max_rows(hidden: usize) -> usize {
    if hidden <= NORM_PROLOGUE_NARROW {
        NORM_PROLOGUE_MAX_ROWS_NARROW
    } else {
        NORM_PROLOGUE_MAX_ROWS
    }
}

/// Where a fused step's q|k|v and gate|up input norms run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NormAt {
    /// `add_rmsnorm` launches.
    Launch,
    /// In the GEMMs' prologues: every block normalises the whole input again (cheap for few
    /// rows, not for many: [`norm_prologue_max_rows`]).
    Prologue,
    /// Deferred: the o and down launches before write the residual times the norm's weights
    /// and its partial sums of squares; the q|k|v and gate|up launches multiply each row's sums
    /// by its 1 / rms in their epilogue (`SkinnyInputs::norm_out` / `norm_in`). No norm launch
    /// and no prologue (layer 0's input norm, which no GEMM precedes, runs in the embedding
    /// launch: `EmbedNorm`). The same value as RMSNorm but for rounding: the GEMM reads
    /// `bf16(w * x)` where the launch rounds `bf16(w * bf16(x * inv))`.
    Deferred,
}

/// How one step runs its projections.
///
/// ```text
///            q|k|v        o            gate|up                down          launches/layer
/// cuBLAS:    norm, gemm   gemm         norm(+add), gemm, act  gemm          9 (+ attention)
/// skinny:    norm, sk     sk           norm(+add), sk+act     sk            8
/// +residual: norm, sk     sk+add       norm, sk+act           sk+add        7
/// +norm:     norm+sk      sk+add       norm+sk+act            sk+add        5
/// +deferred: sk/inv       sk+add+ss    sk/inv+act             sk+add+ss     5
/// ```
/// (`sk`: `skinny_gemm`; `+add`: the residual add in the epilogue; `+act`: the gated
/// activation in gate|up's epilogue; `+ss`: a deferred norm's writer, `/inv` its reader:
/// [`NormAt::Deferred`].) Gemma's sandwich norms need norm(delta) before the add,
/// so its blocks stop at `skinny`. Every skinny q|k|v launch of a model without q/k norms also
/// rotates q and k and writes the KV cache in its epilogue (one `rope_kv_write` less a layer;
/// see [`pair_rope_rows`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ProjPlan {
    /// Skinny tensor-core GEMMs instead of cuBLAS / `gemv_bf16` and a separate activation.
    skinny: bool,
    /// Residual adds in the o and down epilogues (blocks without sandwich norms).
    residual: bool,
    /// Where the q|k|v and gate|up input norms run (not `Launch` implies `residual`).
    norm: NormAt,
}

impl ProjPlan {
    /// The plan for a step of `rows` GEMM rows of a model `c` stored as `(dtype, fp8)`, where
    /// `fp8` is the FP8 skinny kernels' row limit when the weights are FP8. The fused path
    /// (bf16 weights, up to `fused_max_rows` rows, every reduction width a multiple of 32)
    /// takes skinny kernels with the residual adds (blocks without sandwich norms) and the
    /// norms deferred ([`NormAt::Deferred`]) where `fits(NormAt::Deferred, rows, hidden)`;
    /// with `deferred` off (`HARRIER_DEFERRED_NORM=0`, to compare) or where it does not fit, in
    /// the prologues where the step is small enough ([`norm_prologue_max_rows`], overridden by
    /// `norm_rows`) and `fits(NormAt::Prologue, ..)`, else launched. Measured on the H200
    /// (session 29, graphs, context 512, ms per step, deferred vs prologue or launches): 1B
    /// batch 2 0.957 vs 0.981-0.985, 4 1.021-1.023 vs 1.065-1.067, 5 1.069-1.075 vs 1.112-1.114,
    /// 8 1.080-1.083 vs 1.123-1.126; 3B 2 2.268-2.272 vs 2.340-2.364, 4 2.599-2.602 vs
    /// 2.690-2.697, 8 2.894-2.896 vs 2.963-2.980; Qwen3-0.6B (batch 1 without the ring) 1
    /// 0.853-0.859 vs 0.877, 8 1.158-1.159 vs 1.207. FP8 weights take the skinny kernels up to
    /// their limit, and with `fuse_fp8` (`HARRIER_FP8_FUSED=0` turns it off, to compare) the
    /// fusions as bf16 within both limits and [`fp8_fusion_fits`]. Before the deferred norms
    /// the fusions lost or tied for FP8 (sessions 8 and 12); with them (H200, session 33, ms
    /// per step, fused vs plain FP8 skinny): the 1B 2 rows 0.741-0.742 vs 0.807-0.811, 3
    /// 0.788-0.790 vs 0.847-0.851, 4 0.797 vs 0.858-0.862, 8 0.858-0.868 vs 0.885-0.900;
    /// Qwen3-0.6B 1 0.756-0.759 vs 0.829-0.830, 8 1.077-1.080 vs 1.113-1.114; the 3B in
    /// [`FP8_FUSED_MAX_ROWS_WIDE`]'s note.
    fn new(
        c: &ModelConfig,
        (dtype, fp8): (Dtype, Option<usize>),
        (fuse_fp8, norm_rows, deferred): (Option<usize>, Option<usize>, bool),
        (fused_max_rows, wide_rows): (usize, Option<usize>),
        rows: usize,
        fits: impl Fn(NormAt, usize, usize) -> bool,
    ) -> ProjPlan {
        // FP8 weights keep the skinny kernels without the fusions: measured at 1 row (H100,
        // session 8) the norm prologue and residual epilogues cost the FP8 3B and 8B 2-2.5%
        // (3.070 vs 3.016, 5.283 vs 5.153 ms per step) where they win bf16 0.3-7.7%; with the
        // epilogue operands read early (H200, session 12) they were mixed: 1B 0.920 vs 0.913
        // at batch 1 and 1.194 vs 1.207 at 8, 3B 1.980 vs 2.039, 8B 3.942 vs 3.878.
        let fused = dtype == Dtype::Bf16
            && fp8.is_none_or(|max| {
                rows <= max && fuse_fp8.is_some_and(|wide| fp8_fusion_fits(c, rows, wide))
            })
            && rows <= fused_max_rows
            && rows <= harrier_kernels::skinny_twins_max_m(fp8.is_some())
            && rows <= fused_width_max_rows(c.hidden_size, wide_rows)
            && c.layer_gemm_shapes()
                .iter()
                .all(|&(_, _, k)| skinny_supports(rows, k));
        let skinny = fused || fp8.is_some_and(|max| (1..=max).contains(&rows));
        let residual = fused && !c.architecture.sandwich_norms();
        let hid = c.hidden_size;
        let prologue_rows = norm_rows.unwrap_or_else(|| norm_prologue_max_rows(hid));
        let norm = match residual {
            true if deferred && fits(NormAt::Deferred, rows, hid) => NormAt::Deferred,
            true if rows <= prologue_rows && fits(NormAt::Prologue, rows, hid) => NormAt::Prologue,
            _ => NormAt::Launch,
        };
        ProjPlan {
            skinny,
            residual,
            norm,
        }
    }
}

/// Where layer `layer`'s q|k|v input norm runs in a step whose projections norm `at`: layer 0's
/// deferred norm is launched (no GEMM precedes it to defer it into).
fn qkv_norm_at(at: NormAt, layer: usize) -> NormAt {
    match at {
        NormAt::Deferred if layer == 0 => NormAt::Launch,
        at => at,
    }
}

/// Whether a step whose projections norm `at` launches layer 0's input norm, which the
/// embedding launch then does instead.
fn layer0_norm_launched(at: NormAt) -> bool {
    qkv_norm_at(at, 0) == NormAt::Launch
}

/// Whether an FP8 step of `rows` rows is narrow enough for the fusions: models wider than
/// [`FP8_FUSED_NARROW`] take them up to `wide_rows` ([`FP8_FUSED_MAX_ROWS_WIDE`] by
/// default).
fn fp8_fusion_fits(c: &ModelConfig, rows: usize, wide_rows: usize) -> bool {
    c.hidden_size <= FP8_FUSED_NARROW || rows <= wide_rows
}

/// Whether a layer's q|k|v launch rotates q and k and writes the KV cache in its epilogue
/// (`SkinnyEpilogue::Rope`) instead of a `rope_kv_write` launch: skinny steps of layers
/// without q/k norms (their norm needs the whole head, which no lane holds), with the q/k rows
/// in the paired order and the epilogue not switched off (`(paired, enabled)`).
fn rope_in_epilogue(plan: ProjPlan, qk_norm: bool, (paired, enabled): (bool, bool)) -> bool {
    plan.skinny && !qk_norm && paired && enabled
}

fn upload<T: Copy>(host: &[T], stream: sys::CUstream) -> anyhow::Result<DevBuf> {
    let b = DevBuf::new(std::mem::size_of_val(host))?;
    // SAFETY: `b` holds exactly `host`; the copy is synchronised before `host` goes away by the
    // caller (GpuModel::load synchronises the stream per tensor batch).
    unsafe {
        ck(dr::memcpy_htod_async(b.ptr, host, stream), "weight upload")?;
        ck(dr::stream::synchronize(stream), "weight upload")?;
    }
    Ok(b)
}

/// Host staging of converted weights, one buffer per storage type.
enum Staging {
    Bf16(Vec<bf16>),
    F32(Vec<f32>),
}

impl Staging {
    fn new(dtype: Dtype) -> Staging {
        match dtype {
            Dtype::Bf16 => Staging::Bf16(Vec::new()),
            Dtype::F32 => Staging::F32(Vec::new()),
        }
    }

    fn clear(&mut self) {
        match self {
            Staging::Bf16(v) => v.clear(),
            Staging::F32(v) => v.clear(),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Staging::Bf16(v) => v.len() * 2,
            Staging::F32(v) => v.len() * 4,
        }
    }

    /// Appends a tensor's contents, converted to the storage type (bf16 checkpoints are copied
    /// as they are; f32/f16 ones are rounded to bf16, or widened to f32).
    fn push(&mut self, ckpt: &Checkpoint, name: &str, shape: &[usize]) -> anyhow::Result<()> {
        let t = ckpt.get(name, shape)?;
        match (self, t.dtype) {
            (Staging::Bf16(out), WeightDtype::Bf16) => out.extend(
                t.bytes
                    .chunks_exact(2)
                    .map(|b| bf16::from_le_bytes([b[0], b[1]])),
            ),
            (Staging::Bf16(out), _) => out.extend(t.to_f32().into_iter().map(bf16::from_f32)),
            (Staging::F32(out), _) => out.extend(t.to_f32()),
        }
        Ok(())
    }

    fn upload(&self, stream: sys::CUstream) -> anyhow::Result<DevBuf> {
        match self {
            Staging::Bf16(v) => upload(v, stream),
            Staging::F32(v) => upload(v, stream),
        }
    }

    /// See [`pair_rope_rows`].
    fn pair_rope_rows(&mut self, row_len: usize, heads: usize, hd: usize) {
        match self {
            Staging::Bf16(v) => pair_rope_rows(v, row_len, heads, hd),
            Staging::F32(v) => pair_rope_rows(v, row_len, heads, hd),
        }
    }
}

/// Whether q and k rows are stored in the paired RoPE order for a head width of `hd`.
fn rope_pairs(hd: usize) -> bool {
    hd > 0 && hd.is_multiple_of(16)
}

/// Reorders the first `heads * hd` rows of `rows` (rows of `row_len` values: weights, or one
/// scale per row) into the paired RoPE order of the CUDA kernels (`rope_row` in harrier.cu):
/// within each head, storage row `16a + e` holds dim `8a + e` for `e < 8` and its rotation
/// partner `hd / 2 + 8a + e - 8` otherwise, so that a skinny GEMM lane, which holds rows `g`
/// and `g + 8` of a 16-row tile, holds both halves of its RoPE pairs. Applied to the q and k
/// rows of q|k|v (the K cache then keeps that order; attention's q · k is the same in it).
fn pair_rope_rows<T: Copy>(rows: &mut [T], row_len: usize, heads: usize, hd: usize) {
    let half = hd / 2;
    let stride = hd * row_len;
    let mut head = Vec::with_capacity(stride);
    for h in 0..heads {
        let block = &mut rows[h * stride..(h + 1) * stride];
        head.clear();
        head.extend_from_slice(block);
        for s in 0..hd {
            let (a, e) = (s / 16, s % 16);
            let dim = if e < 8 {
                8 * a + e
            } else {
                half + 8 * a + e - 8
            };
            block[s * row_len..(s + 1) * row_len]
                .copy_from_slice(&head[dim * row_len..(dim + 1) * row_len]);
        }
    }
}

/// Whether an FP8 output head over `vocab` rows can take the FP8 GEMMs: cuBLASLt wants the
/// f32 logits' rows 16-byte aligned and `fp8_rescale` pairs of columns, and only widths that
/// are multiples of 16 have been checked on the device, so other vocabularies keep the
/// dequantize + cuBLAS route there (the layers' widths are multiples of 64 for any FP8 model,
/// [`check_fp8_model`]).
fn fp8_gemm_vocab(vocab: usize) -> bool {
    vocab.is_multiple_of(16)
}

/// Why `c` cannot hold FP8 weights in `dtype`, if it cannot.
fn check_fp8_model(c: &ModelConfig, dtype: Dtype) -> anyhow::Result<()> {
    if dtype != Dtype::Bf16 {
        bail!("FP8 weights compute in bf16: drop --dtype float32");
    }
    for (what, k) in [
        ("hidden_size", c.hidden_size),
        ("num_attention_heads x head_dim", c.num_heads * c.head_dim),
        ("intermediate_size", c.intermediate_size),
    ] {
        if !harrier_kernels::fp8_supports_k(k) {
            bail!("{what} ({k}) must be a multiple of 64 for the FP8 kernels");
        }
    }
    Ok(())
}

/// The stacked `[n, k]` weights `parts` as one FP8 projection: the checkpoint's FP8 tensors
/// with per-channel scales as they are, per-tensor scales repeated per row; float tensors
/// quantized per row on the host (`fp8::quantize_rows`, the function the CPU backend's
/// `--quantization fp8` and `harrier quantize` use), and block-scaled ones requantized so.
/// Returns the projection, its bytes and how many tensors were requantized.
fn load_fp8(
    ckpt: &Checkpoint,
    c: &ModelConfig,
    parts: &[(String, Vec<usize>)],
    rope_heads: usize,
    stream: sys::CUstream,
) -> anyhow::Result<(Proj, usize, usize)> {
    let (mut q, mut scales, mut requantized) = (Vec::new(), Vec::new(), 0);
    for (name, shape) in parts {
        let w = ckpt
            .weight(name, shape, c.fp8.as_ref())
            .with_context(|| format!("tensor {name}"))?;
        match w {
            WeightRef::Fp8 {
                q: bytes,
                scales: s,
                layout: ScaleLayout::Channel,
                ..
            } => {
                q.extend_from_slice(bytes);
                scales.extend(s);
            }
            WeightRef::Fp8 {
                q: bytes,
                scales: s,
                layout: ScaleLayout::Tensor,
                ..
            } => {
                q.extend_from_slice(bytes);
                scales.extend(std::iter::repeat_n(s[0], shape[0]));
            }
            w => {
                requantized += matches!(w, WeightRef::Fp8 { .. }) as usize;
                let (qq, ss) = fp8::quantize_rows(&w.to_f32(), shape[1]);
                q.extend(qq);
                scales.extend(ss);
            }
        }
    }
    if rope_heads > 0 {
        let k = parts.first().map_or(0, |(_, shape)| shape[1]);
        pair_rope_rows(&mut q, k, rope_heads, c.head_dim);
        pair_rope_rows(&mut scales, 1, rope_heads, c.head_dim);
    }
    let bytes = q.len() + 4 * scales.len();
    let p = Proj {
        w: upload(&q, stream)?,
        scale: Some(upload(&scales, stream)?),
    };
    Ok((p, bytes, requantized))
}

impl GpuModel {
    /// Loads `dir` onto the GPU in `dtype`; `quantize` (`--quantization fp8`) or an FP8
    /// checkpoint stores the projections (and, quantizing, the output head) in FP8 (bf16 only).
    pub(crate) fn load(
        dir: &ModelDir,
        stream: sys::CUstream,
        caps: &Capacities,
        sizes: &ScratchSizes,
        dtype: Dtype,
        quantize: bool,
    ) -> anyhow::Result<GpuModel> {
        let c = dir.config.clone();
        let fp8 = quantize || c.fp8.is_some();
        if fp8 {
            check_fp8_model(&c, dtype)
                .with_context(|| format!("FP8 weights for {}", dir.path.display()))?;
        }
        let ckpt = Checkpoint::open(&dir.path)?;
        ckpt.check(&c)?;
        let buf = std::cell::RefCell::new(Staging::new(dtype));
        let total = std::cell::Cell::new(0usize);
        let requantized = std::cell::Cell::new(0usize);
        // `rope_heads`: the first that many heads of rows take the paired RoPE order.
        let one_paired =
            |names: &[(String, Vec<usize>)], rope_heads: usize| -> anyhow::Result<DevBuf> {
                let mut buf = buf.borrow_mut();
                buf.clear();
                for (n, s) in names {
                    buf.push(&ckpt, n, s)
                        .with_context(|| format!("tensor {n}"))?;
                }
                if rope_heads > 0 {
                    let k = names.first().map_or(0, |(_, shape)| shape[1]);
                    buf.pair_rope_rows(k, rope_heads, c.head_dim);
                }
                total.set(total.get() + buf.bytes());
                buf.upload(stream)
            };
        let one = |names: &[(String, Vec<usize>)]| one_paired(names, 0);
        let proj_as = |names: &[(String, Vec<usize>)],
                       fp8: bool,
                       rope_heads: usize|
         -> anyhow::Result<Proj> {
            if !fp8 {
                return Ok(Proj {
                    w: one_paired(names, rope_heads)?,
                    scale: None,
                });
            }
            let (p, bytes, requant) = load_fp8(&ckpt, &c, names, rope_heads, stream)?;
            total.set(total.get() + bytes);
            requantized.set(requantized.get() + requant);
            Ok(p)
        };
        let proj = |names: &[(String, Vec<usize>)]| proj_as(names, fp8, 0);
        // q and k rows in the paired RoPE order (see `pair_rope_rows`).
        let rope_paired = rope_pairs(c.head_dim);
        let rope_heads = match rope_paired {
            true => c.num_heads + c.num_kv_heads,
            false => 0,
        };
        let lt = |t: LayerTensor, l: usize| (t.name(l), t.shape(&c));
        let mut layers = Vec::with_capacity(c.num_layers);
        let mut progress = crate::progress::StartupProgress::new(
            format!("loading {} onto the GPU (layers)", dir.name),
            c.num_layers as u64,
            crate::progress::Unit::Items,
        );
        for l in 0..c.num_layers {
            progress.inc(1);
            let qk_norm = match c.architecture.has_qk_norm() {
                true => Some((
                    one(&[lt(LayerTensor::QNorm, l)])?,
                    one(&[lt(LayerTensor::KNorm, l)])?,
                )),
                false => None,
            };
            let ff_norms = match c.architecture.sandwich_norms() {
                true => Some((
                    one(&[lt(LayerTensor::PreFfNorm, l)])?,
                    one(&[lt(LayerTensor::PostFfNorm, l)])?,
                )),
                false => None,
            };
            let qkv = proj_as(
                &[
                    lt(LayerTensor::QProj, l),
                    lt(LayerTensor::KProj, l),
                    lt(LayerTensor::VProj, l),
                ],
                fp8,
                rope_heads,
            )?;
            let o = proj(&[lt(LayerTensor::OProj, l)])?;
            let gate_up = proj(&[lt(LayerTensor::GateProj, l), lt(LayerTensor::UpProj, l)])?;
            let down = proj(&[lt(LayerTensor::DownProj, l)])?;
            layers.push(Layer {
                input_norm: one(&[lt(LayerTensor::InputNorm, l)])?,
                qkv,
                qk_norm,
                o,
                post_norm: one(&[lt(LayerTensor::PostNorm, l)])?,
                ff_norms,
                gate_up,
                down,
                window: c
                    .layer_window(l)
                    .unwrap_or(0)
                    .try_into()
                    .unwrap_or(i32::MAX),
                local_rope: c.layer_attention(l) == LayerAttention::Sliding,
            });
        }
        progress.finish();
        let (v, h) = (c.vocab_size, c.hidden_size);
        let before_embed = total.get();
        let embed = one(&[(EMBED.to_string(), vec![v, h])])?;
        let embed_bytes = total.get() - before_embed;
        // `--quantization fp8` gives the output head its own FP8 copy even when tied (the
        // embedding rows stay as stored), as the CPU's and `harrier quantize` do; an FP8
        // checkpoint's head stays as the checkpoint stores it (often bf16, its ignore list).
        let head = (LM_HEAD.to_string(), vec![v, h]);
        let head_fp8 = quantize
            || (!c.tie_word_embeddings
                && matches!(
                    ckpt.weight(&head.0, &head.1, c.fp8.as_ref())?,
                    WeightRef::Fp8 { .. }
                ));
        let lm_head = match (c.tie_word_embeddings, head_fp8) {
            (true, false) => None,
            (true, true) => Some(proj_as(&[(EMBED.to_string(), vec![v, h])], true, 0)?),
            (false, _) => Some(proj_as(&[head], head_fp8, 0)?),
        };
        let final_norm = one(&[(FINAL_NORM.to_string(), vec![h])])?;
        if requantized.get() > 0 {
            tracing::warn!(
                "{} block-scaled FP8 tensors were requantized per output channel (the CUDA \
                 kernels take one scale per row): their values differ from the checkpoint's by \
                 up to one e4m3 rounding",
                requantized.get()
            );
        }
        let inv_freq = upload(
            &crate::model::rope::inv_freq(&c, LayerAttention::Full),
            stream,
        )?;
        let inv_freq_local = match &c.sliding {
            Some(_) => Some(upload(
                &crate::model::rope::inv_freq(&c, LayerAttention::Sliding),
                stream,
            )?),
            None => None,
        };
        let _ = caps;
        let scratch = Scratch {
            x: DevBuf::new(sizes.x)?,
            h: DevBuf::new(sizes.h)?,
            qkv: DevBuf::new(sizes.qkv)?,
            attn: DevBuf::new(sizes.attn)?,
            delta: DevBuf::new(sizes.delta)?,
            gate_up: DevBuf::new(sizes.gate_up)?,
            act: DevBuf::new(sizes.act)?,
            logits: DevBuf::new(sizes.logits)?,
            final_h: DevBuf::new(sizes.final_h)?,
            attn_part: DevBuf::new(sizes.attn_part)?,
            norm_ss: DevBuf::new(sizes.norm_ss)?,
            // The largest layer projection; the output head goes through it in slices.
            wdq: match fp8 {
                true => {
                    let elems = c.layer_gemm_shapes().iter().map(|&(_, n, k)| n * k).max();
                    Some(DevBuf::new(elems.unwrap_or(0).max(h) * 2)?)
                }
                false => None,
            },
        };
        let blas = Blas::new(stream, dtype)?;
        let embed_scale = c.embed_scale(match dtype {
            Dtype::Bf16 => WeightDtype::Bf16,
            Dtype::F32 => WeightDtype::F32,
        });
        Ok(GpuModel {
            config: c,
            dtype,
            weight_bytes: total.get(),
            decode_bytes: step_weight_bytes(total.get(), embed_bytes, lm_head.is_some()),
            embed,
            lm_head,
            fp8,
            final_norm,
            layers,
            inv_freq,
            inv_freq_local,
            embed_scale,
            scratch,
            kv: None,
            kv_layers: Vec::new(),
            block_size: caps.block_size,
            blas,
            fp8_gemm: None,
            fused_max_rows: 0,
            rope_paired,
            rope_epilogue: harrier_kernels::switch_on("HARRIER_ROPE_EPILOGUE"),
            skip: SkipStages::from_env()?,
            fp8_fused: match std::env::var("HARRIER_FP8_FUSED_WIDE_ROWS") {
                Ok(v) => Some(v.parse().context("HARRIER_FP8_FUSED_WIDE_ROWS")?),
                Err(_) => Some(FP8_FUSED_MAX_ROWS_WIDE),
            }
            .filter(|_| harrier_kernels::switch_on("HARRIER_FP8_FUSED")),
            norm_max_rows: match std::env::var("HARRIER_NORM_MAX_ROWS") {
                Ok(v) => Some(v.parse().context("HARRIER_NORM_MAX_ROWS")?),
                Err(_) => None,
            },
            fused_wide_rows: match std::env::var("HARRIER_FUSED_WIDE_MAX_ROWS") {
                Ok(v) => Some(v.parse().context("HARRIER_FUSED_WIDE_MAX_ROWS")?),
                Err(_) => None,
            },
            deferred_norm: harrier_kernels::switch_on("HARRIER_DEFERRED_NORM"),
            embed_norm: harrier_kernels::switch_on("HARRIER_EMBED_NORM"),
            ring: None,
        })
    }

    /// FP8 models: steps past the skinny kernels run FP8 tensor-core GEMMs (cuBLASLt, per-token
    /// activation scales; see [`super::fp8_gemm`]) instead of dequantizing each projection to
    /// bf16, on `arch` sm_89 or newer with libcublasLt present, for steps of up to
    /// `max_tokens` rows. Returns why not when it cannot (the model keeps the bf16 route).
    pub(crate) fn enable_fp8_gemm(&mut self, arch: &str, max_tokens: usize) -> anyhow::Result<()> {
        if !self.fp8 {
            bail!("not an FP8 model");
        }
        let c = &self.config;
        let shapes = c.layer_gemm_shapes();
        let widest = shapes.iter().map(|&(_, _, k)| k).max().unwrap_or(0);
        let g = Fp8Gemm::new(arch, max_tokens, widest)?;
        // The smallest and largest steps that take the route, on every shape: a refusal here
        // keeps the model on the bf16 route instead of failing a step later.
        let mut plans: Vec<_> = shapes
            .iter()
            .map(|&(_, n, k)| (n, k, Fp8Out::Bf16))
            .collect();
        if fp8_gemm_vocab(c.vocab_size) {
            let ld = c.vocab_size;
            plans.push((c.vocab_size, c.hidden_size, Fp8Out::F32 { ld }));
        }
        for rows in [FP8_SKINNY_MAX_ROWS_WITH_GEMM + 1, max_tokens.max(1)] {
            for &(n, k, out) in &plans {
                g.prepare(rows, (n, k), out)
                    .with_context(|| format!("planning an FP8 GEMM of {rows} x {n} x {k}"))?;
            }
        }
        self.fp8_gemm = Some(g);
        // Every step past the skinny kernels now takes the FP8 GEMMs: the bf16 dequantization
        // scratch (the largest layer projection in bf16) goes back to the KV cache, unless
        // the output head still needs it (see `head_takes_fp8_gemm`).
        if self.head_takes_fp8_gemm() {
            self.scratch.wdq = None;
        }
        Ok(())
    }

    /// Whether the output head's large steps take the FP8 GEMMs (see [`fp8_gemm_vocab`]).
    fn head_takes_fp8_gemm(&self) -> bool {
        self.fp8_gemm.is_some() && fp8_gemm_vocab(self.config.vocab_size)
    }

    /// Whether FP8 tensor-core GEMMs are on (see [`GpuModel::enable_fp8_gemm`]).
    pub(crate) fn fp8_gemm_on(&self) -> bool {
        self.fp8_gemm.is_some()
    }

    /// FP8 weights: the most GEMM rows the skinny kernels take (see [`FP8_SKINNY_MAX_ROWS`]).
    fn fp8_skinny_max_rows(&self) -> usize {
        if self.fp8_gemm.is_some() {
            FP8_SKINNY_MAX_ROWS_WITH_GEMM
        } else {
            FP8_SKINNY_MAX_ROWS
        }
    }

    /// Allocates the KV cache: `num_blocks` blocks for every layer, or with
    /// `num_local_blocks` a hybrid cache whose sliding layers get that many instead.
    pub(crate) fn alloc_kv(
        &mut self,
        num_blocks: usize,
        num_local_blocks: Option<usize>,
        block_size: usize,
    ) -> anyhow::Result<()> {
        let c = &self.config;
        let slot = block_size * c.num_kv_heads * c.head_dim * self.dtype.size();
        let mut at = 0;
        self.kv_layers = (0..c.num_layers)
            .map(|l| {
                let local =
                    num_local_blocks.is_some() && c.layer_attention(l) == LayerAttention::Sliding;
                let per = slot
                    * if local {
                        num_local_blocks.unwrap_or(0)
                    } else {
                        num_blocks
                    };
                at += 2 * per;
                (at - 2 * per, at - per, local)
            })
            .collect();
        self.block_size = block_size;
        self.kv = Some(DevBuf::new(at).context("allocating the KV cache")?);
        self.build_ring_stages()
    }

    /// How a step of `rows` GEMM rows runs its projections (see [`ProjPlan`]).
    fn proj_plan(&self, k: &Kernels, rows: usize) -> ProjPlan {
        ProjPlan::new(
            &self.config,
            (self.dtype, self.fp8.then(|| self.fp8_skinny_max_rows())),
            (self.fp8_fused, self.norm_max_rows, self.deferred_norm),
            (self.fused_max_rows, self.fused_wide_rows),
            rows,
            |at, m, kk| match at {
                NormAt::Prologue => k.skinny_norm_supports(m, kk),
                NormAt::Deferred => k.skinny_deferred_norm_supports(m, kk, self.fp8),
                NormAt::Launch => true,
            },
        )
    }

    pub(crate) fn logits_ptr(&self) -> u64 {
        self.scratch.logits.ptr
    }

    /// Enqueues the forward pass of one step on `stream`: logits of the sampled sequences land
    /// in the logits buffer, rows `0..n_samples`.
    ///
    /// # Safety
    /// `m`'s addresses must hold the step's metadata; the KV cache must be allocated.
    pub(crate) unsafe fn forward(
        &mut self,
        k: &Kernels,
        stream: sys::CUstream,
        m: &StepMeta,
    ) -> anyhow::Result<()> {
        let c = &self.config;
        let kv = self
            .kv
            .as_ref()
            .ok_or_else(|| anyhow!("KV cache not allocated"))?;
        let (hid, hd, nh, nkv, inter) = (
            c.hidden_size,
            c.head_dim,
            c.num_heads,
            c.num_kv_heads,
            c.intermediate_size,
        );
        let qkv_dim = c.qkv_dim();
        let t = m.n_tokens;
        let s = &self.scratch;
        let eps = (c.rms_norm_eps, c.architecture.norm_weight_offset());
        let scale = c.attention_scale();
        let gelu = c.hidden_act == Activation::GeluTanh;
        let gemm_rows = m.gemm_rows.unwrap_or(t).max(t);
        let gemm_samples = m.gemm_rows.unwrap_or(m.n_samples).max(m.n_samples);
        if gemm_rows * hid * self.dtype.size() > s.x.bytes
            || gemm_samples * c.vocab_size * 4 > s.logits.bytes
        {
            bail!(
                "step of {t} tokens / {} samples exceeds the buffers",
                m.n_samples
            );
        }
        // The fused small-batch path (see ProjPlan), or cuBLAS (or gemv_bf16) with separate
        // norm, residual and activation kernels.
        let plan = self.proj_plan(k, gemm_rows);
        let skinny = plan.skinny;
        let gated = if gelu { Epi::GeluTanhMul } else { Epi::SiluMul };
        let blas = &self.blas;
        let wdq = s.wdq.as_ref().map(|b| b.ptr);
        let fp8_gemm = self.fp8_gemm.as_ref();
        let skip = self.skip;
        // y = x · wᵀ over gemm_rows rows: the skinny kernels (bf16 or FP8), cuBLAS, or (FP8
        // past the skinny kernels) FP8 tensor-core GEMMs with per-token activation scales, or
        // without them cuBLAS over a bf16 copy of the weights.
        let proj = |(x, w, y): (u64, &Proj, u64), n: usize, kk: usize| -> anyhow::Result<()> {
            // SAFETY: as the launches below (the scratch buffers hold gemm_rows rows; wdq holds
            // the largest layer projection; the FP8 GEMMs' buffers max_tokens rows).
            unsafe {
                match (skinny, w.scale.as_ref(), fp8_gemm, wdq) {
                    (true, ..) => {
                        k.skinny_gemm(stream, &w.skinny((x, y), gemm_rows, n, kk, Epi::Store))
                    }
                    (false, None, ..) => {
                        blas.gemm(k, stream, (x, w.w.ptr, y), gemm_rows, n, kk, false)
                    }
                    (false, Some(sc), Some(g), _) => g.project(
                        k,
                        stream,
                        (x, w.w.ptr, sc.ptr, y),
                        gemm_rows,
                        (n, kk),
                        Fp8Out::Bf16,
                    ),
                    (false, Some(sc), None, Some(wdq)) => {
                        k.dequant_fp8_rows(stream, (w.w.ptr, sc.ptr, wdq), n, kk)?;
                        blas.gemm(k, stream, (x, wdq, y), gemm_rows, n, kk, false)
                    }
                    (false, Some(_), None, None) => {
                        bail!("FP8 weights without a dequantization buffer")
                    }
                }
            }
        };
        let ring_step = self.ring_takes(m, gemm_rows);
        // Layer 0's input norm where it would be launched (`layer0_norm_launched`): in the
        // embedding launch instead (not for the ring, which norms in its own launch).
        let embed_norm = match self.layers.first() {
            Some(l0)
                if layer0_norm_launched(plan.norm)
                    && self.embed_norm
                    && skip.runs(Stage::Norm)
                    && !ring_step =>
            {
                Some(EmbedNorm {
                    out: s.h.ptr,
                    w: l0.input_norm.ptr,
                    eps: eps.0,
                    w_off: eps.1,
                })
            }
            _ => None,
        };
        // SAFETY: (all launches below) buffers are sized for max_tokens rows (checked above) and
        // the metadata addresses come from the slot (caller's contract).
        unsafe {
            k.embed_tokens(
                stream,
                s.x.ptr,
                self.embed.ptr,
                m.tok_src,
                m.pending,
                t as u32,
                hid as i32,
                c.vocab_size as i32,
                self.embed_scale,
                embed_norm,
            )?;
            // Batch-1 decode: everything after the embedding in one persistent launch.
            if ring_step {
                return self.launch_ring(k, stream, m);
            }
            // The pending residual delta (the previous layer's MLP output) and, for Gemma, the
            // norm it takes before its add.
            let mut pending: (u64, u64) = (0, 0);
            // Deferred norms: the o and down launches write h = x * norm weights and the
            // partials at norm_ss for the gate|up and next q|k|v launches (NormAt::Deferred).
            let deferred = plan.norm == NormAt::Deferred;
            // The q|k|v or gate|up launch `p` (of its input) with its input norm by `norm_w`
            // fused as `at` says; `None`: the norm is launched first, into h.
            let fused_norm = |p: &dyn Fn(u64) -> SkinnyInputs, norm_w: u64, at: NormAt| match at {
                NormAt::Prologue => Some(p(s.x.ptr).normed(norm_w, eps)),
                NormAt::Deferred => Some(p(s.h.ptr).norm_in(s.norm_ss.ptr, eps.0)),
                NormAt::Launch => None,
            };
            for (li, w) in self.layers.iter().enumerate() {
                let (k_off, v_off, local) = self.kv_layers[li];
                let (kc, vc) = (kv.at(k_off), kv.at(v_off));
                let (slots, tables) = match local {
                    true => (m.slot_mapping_local, m.row_block_tables_local),
                    false => (m.slot_mapping, m.row_block_tables),
                };
                let inv_freq = match (&self.inv_freq_local, w.local_rope) {
                    (Some(f), true) => f.ptr,
                    _ => self.inv_freq.ptr,
                };
                let rope_epi = rope_in_epilogue(
                    plan,
                    w.qk_norm.is_some(),
                    (self.rope_paired, self.rope_epilogue),
                );
                let qkv_launch = |x: u64| {
                    let p = w
                        .qkv
                        .skinny((x, s.qkv.ptr), gemm_rows, qkv_dim, hid, Epi::Store);
                    match rope_epi {
                        true => p.roped(SkinnyRope {
                            positions: m.positions,
                            inv_freq,
                            slot_mapping: slots,
                            k_cache: kc,
                            v_cache: vc,
                            nh: nh as i32,
                            nkv: nkv as i32,
                            hd: hd as i32,
                            rows: t as i32,
                        }),
                        false => p,
                    }
                };
                // Llama-style blocks on the fused path keep the residual in x and never have a
                // pending delta: the input norm runs inside the q|k|v GEMM, was deferred into
                // the down launch before it (layer 0's: the embedding has no such epilogue), or
                // runs on x alone (layer 0's in the embedding launch: `embed_norm`).
                let qkv_norm = qkv_norm_at(plan.norm, li);
                if let Some(p) = fused_norm(&qkv_launch, w.input_norm.ptr, qkv_norm) {
                    if skip.runs(Stage::Qkv) {
                        k.skinny_gemm(stream, &p)?;
                    }
                } else {
                    if skip.runs(Stage::Norm) && !(li == 0 && embed_norm.is_some()) {
                        k.add_rmsnorm(
                            stream,
                            s.x.ptr,
                            pending,
                            w.input_norm.ptr,
                            s.h.ptr,
                            0,
                            t as u32,
                            hid as i32,
                            eps,
                        )?;
                    }
                    if skip.runs(Stage::Qkv) {
                        match rope_epi {
                            true => k.skinny_gemm(stream, &qkv_launch(s.h.ptr))?,
                            false => proj((s.h.ptr, &w.qkv, s.qkv.ptr), qkv_dim, hid)?,
                        }
                    }
                }
                if !rope_epi && skip.runs(Stage::Norm) {
                    let (qn, kn) = w
                        .qk_norm
                        .as_ref()
                        .map(|(a, b)| (a.ptr, b.ptr))
                        .unwrap_or((0, 0));
                    k.rope_kv_write(
                        stream,
                        s.qkv.ptr,
                        qkv_dim as i32,
                        nh as i32,
                        nkv as i32,
                        hd as i32,
                        m.positions,
                        inv_freq,
                        qn,
                        kn,
                        eps,
                        slots,
                        kc,
                        vc,
                        self.rope_paired,
                        t as u32,
                    )?;
                }
                let att = AttentionInputs {
                    out: s.attn.ptr,
                    q: s.qkv.ptr,
                    q_stride: qkv_dim as i32,
                    k_cache: kc,
                    v_cache: vc,
                    tok_row: m.tok_row,
                    positions: m.positions,
                    block_tables: tables,
                    bt_stride: m.bt_stride as i32,
                    nh: nh as i32,
                    nkv: nkv as i32,
                    hd: hd as i32,
                    block_size: self.block_size as i32,
                    scale,
                    window: w.window,
                };
                // Prefill tiles (if any), then every other token through one per-token kernel.
                let (list, n_att) = if m.n_pf_tiles > 0 {
                    k.prefill_attention(stream, &att, m.pf_tiles, m.n_pf_tiles as u32)?;
                    (m.att_list, m.n_att_listed as u32)
                } else {
                    (0, t as u32)
                };
                match (m.decode_splits, m.grp_attention) {
                    _ if !skip.runs(Stage::Attn) => {}
                    (None, _) if m.grouped_attention => {
                        k.paged_attention_gqa(stream, &att, list, n_att)?
                    }
                    // (A token list comes with one split: only decode-only steps split.)
                    (splits, Some(warps)) => k.paged_attention_grouped(
                        stream,
                        &att,
                        s.attn_part.ptr,
                        (splits.unwrap_or(1) as u32, !m.short_context),
                        n_att,
                        GrpLaunch {
                            tok_list: list,
                            clusters: true,
                            warps,
                        },
                    )?,
                    (splits, None) => k.paged_attention(
                        stream,
                        &att,
                        s.attn_part.ptr,
                        (splits.unwrap_or(1) as u32, !m.short_context),
                        list,
                        n_att,
                    )?,
                }
                if plan.residual {
                    // x += input · wᵀ (the o and down projections).
                    let into_x = |p: &Proj, input, k_dim| {
                        p.skinny((input, s.x.ptr), gemm_rows, hid, k_dim, Epi::Residual)
                    };
                    // A deferred norm's writer: h = x * norm_w, and x's partial sums of squares.
                    let norm_out = |p: SkinnyInputs, norm_w: u64| match deferred {
                        true => p.norm_out((s.h.ptr, norm_w, s.norm_ss.ptr), eps.1),
                        false => p,
                    };
                    // x += o(attn); act = act(gate) * up of norm(x).
                    if skip.runs(Stage::O) {
                        let o = into_x(&w.o, s.attn.ptr, nh * hd);
                        k.skinny_gemm(stream, &norm_out(o, w.post_norm.ptr))?;
                    }
                    let gate_up = |x| {
                        w.gate_up
                            .skinny((x, s.act.ptr), gemm_rows, inter, hid, gated)
                    };
                    if let Some(p) = fused_norm(&gate_up, w.post_norm.ptr, plan.norm) {
                        if skip.runs(Stage::GateUp) {
                            k.skinny_gemm(stream, &p)?;
                        }
                    } else {
                        if skip.runs(Stage::Norm) {
                            k.add_rmsnorm(
                                stream,
                                s.x.ptr,
                                (0, 0),
                                w.post_norm.ptr,
                                s.h.ptr,
                                0,
                                t as u32,
                                hid as i32,
                                eps,
                            )?;
                        }
                        if skip.runs(Stage::GateUp) {
                            k.skinny_gemm(stream, &gate_up(s.h.ptr))?;
                        }
                    }
                    // x += down(act) (and the next layer's deferred input norm).
                    if skip.runs(Stage::Down) {
                        let down = into_x(&w.down, s.act.ptr, inter);
                        let down = match self.layers.get(li + 1) {
                            Some(next) => norm_out(down, next.input_norm.ptr),
                            None => down,
                        };
                        k.skinny_gemm(stream, &down)?;
                    }
                    continue;
                }
                if skip.runs(Stage::O) {
                    proj((s.attn.ptr, &w.o, s.delta.ptr), hid, nh * hd)?;
                }
                // Llama: x += delta, h = norm(x) * post_norm. Gemma: x += norm(delta) *
                // post_norm, h = norm(x) * pre_ff.
                let (attn_delta, mlp_norm) = match &w.ff_norms {
                    None => ((s.delta.ptr, 0), w.post_norm.ptr),
                    Some((pre_ff, _)) => ((s.delta.ptr, w.post_norm.ptr), pre_ff.ptr),
                };
                if skip.runs(Stage::Norm) {
                    k.add_rmsnorm(
                        stream, s.x.ptr, attn_delta, mlp_norm, s.h.ptr, 0, t as u32, hid as i32,
                        eps,
                    )?;
                }
                if skip.runs(Stage::GateUp) {
                    if skinny {
                        k.skinny_gemm(
                            stream,
                            &w.gate_up
                                .skinny((s.h.ptr, s.act.ptr), gemm_rows, inter, hid, gated),
                        )?;
                    } else {
                        proj((s.h.ptr, &w.gate_up, s.gate_up.ptr), 2 * inter, hid)?;
                        k.gated_act(
                            stream,
                            (s.act.ptr, s.gate_up.ptr),
                            inter as i32,
                            t as u32,
                            gelu,
                        )?;
                    }
                }
                if skip.runs(Stage::Down) {
                    proj((s.act.ptr, &w.down, s.delta.ptr), hid, inter)?;
                }
                pending = (
                    s.delta.ptr,
                    w.ff_norms.as_ref().map_or(0, |(_, post)| post.ptr),
                );
            }
            if m.n_samples > 0 && skip.runs(Stage::Head) {
                k.add_rmsnorm(
                    stream,
                    s.x.ptr,
                    pending,
                    self.final_norm.ptr,
                    s.final_h.ptr,
                    m.logit_rows,
                    m.n_samples as u32,
                    hid as i32,
                    eps,
                )?;
                let (head, head_scale) = match &self.lm_head {
                    Some(p) => (p.w.ptr, p.scale.as_ref()),
                    None => (self.embed.ptr, None),
                };
                let yw = (s.final_h.ptr, head, s.logits.ptr);
                // FP8 heads take the skinny kernel whenever the sampled rows fit it (a prefill
                // step samples few rows however many tokens it has).
                let skinny_head = match head_scale {
                    Some(_) => gemm_samples <= self.fp8_skinny_max_rows(),
                    None => skinny,
                };
                match (skinny_head, head_scale, &s.wdq) {
                    (false, Some(sc), _) if self.head_takes_fp8_gemm() => {
                        let v = c.vocab_size;
                        fp8_gemm
                            .context("FP8 GEMMs without their handle")?
                            .project(
                                k,
                                stream,
                                (s.final_h.ptr, head, sc.ptr, s.logits.ptr),
                                gemm_samples,
                                (v, hid),
                                Fp8Out::F32 { ld: v },
                            )?;
                    }
                    (true, _, _) => k.skinny_gemm(
                        stream,
                        &SkinnyInputs::new(yw, gemm_samples, c.vocab_size, hid, Epi::StoreF32)
                            .scaled(head_scale.map_or(0, |b| b.ptr)),
                    )?,
                    (false, None, _) => {
                        self.blas
                            .gemm(k, stream, yw, gemm_samples, c.vocab_size, hid, true)?
                    }
                    // Slices of vocabulary rows through the bf16 copy, each into its columns
                    // of the logits.
                    (false, Some(sc), Some(wdq)) => {
                        let rows = (wdq.bytes / 2 / hid).max(1);
                        let mut v0 = 0;
                        while v0 < c.vocab_size {
                            let n = rows.min(c.vocab_size - v0);
                            k.dequant_fp8_rows(
                                stream,
                                (head + (v0 * hid) as u64, sc.ptr + (v0 * 4) as u64, wdq.ptr),
                                n,
                                hid,
                            )?;
                            self.blas.cublas_ld(
                                (s.final_h.ptr, wdq.ptr, s.logits.ptr + (v0 * 4) as u64),
                                gemm_samples,
                                (n, hid),
                                true,
                                c.vocab_size,
                            )?;
                            v0 += n;
                        }
                    }
                    (false, Some(_), None) => bail!("FP8 weights without a dequantization buffer"),
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gen_model::Preset;

    /// A decode step reads the head once and one embedding row a token: the floor's bytes leave
    /// the embedding out where the head is its own matrix, and keep it where it is the head.
    #[test]
    fn a_step_reads_the_head_not_an_untied_embedding() {
        let wide = Preset::from_name("llama-3.1-8b").unwrap().config();
        let small = Preset::from_name("llama-3.2-1b").unwrap().config();
        assert!(!wide.tie_word_embeddings && small.tie_word_embeddings);
        let embed = |c: &ModelConfig| c.vocab_size * c.hidden_size * 2;
        // The 8B in bf16: 16.06 GB loaded, 15.01 GB read a step.
        let loaded = super::super::layout::weight_bytes(&wide, 2);
        let step = step_weight_bytes(loaded, embed(&wide), true);
        assert_eq!(step, loaded - embed(&wide));
        assert!((15.0e9..15.02e9).contains(&(step as f64)), "{step}");
        // The 1B in bf16: its embedding is its head.
        let loaded = super::super::layout::weight_bytes(&small, 2);
        assert_eq!(step_weight_bytes(loaded, embed(&small), false), loaded);
        // The 1B with FP8 layers and an FP8 copy of its tied head: the bf16 embedding is not
        // read (0.97 GB of layers, 0.26 GB of head, scales aside).
        let fp8 = super::super::layout::weight_bytes(&small, 1) + embed(&small);
        let step = step_weight_bytes(fp8, embed(&small), true);
        assert!((1.2e9..1.25e9).contains(&(step as f64)), "{step}");
    }

    /// `HARRIER_SKIP_STAGES` names stages; an unknown name is an error.
    #[test]
    fn skipped_stages_parse_by_name() {
        let s = SkipStages::parse("qkv, gate_up,head").expect("parses");
        assert!(!s.runs(Stage::Qkv) && !s.runs(Stage::GateUp) && !s.runs(Stage::Head));
        assert!(
            s.runs(Stage::Attn) && s.runs(Stage::O) && s.runs(Stage::Down) && s.runs(Stage::Norm)
        );
        assert_eq!(SkipStages::parse("").expect("empty"), SkipStages::default());
        assert!(SkipStages::parse("").expect("empty").runs(Stage::Attn));
        let all = SkipStages::parse("qkv,attn,o,gate_up,down,norm,head").expect("all");
        assert_eq!(all.0, 127);
        assert!(SkipStages::parse("qkv,mlp").is_err());
    }

    /// Which kernels a step's projections take, by step size, storage and model.
    #[test]
    fn projection_plans_follow_the_row_limits() {
        use NormAt::{Deferred as D, Launch as L, Prologue as P};
        let llama = Preset::from_name("llama-3.2-1b").unwrap().config();
        let gemma = Preset::from_name("gemma-3-1b").unwrap().config();
        let fits = |_: NormAt, _: usize, _: usize| true;
        let plan = |c: &ModelConfig, st: (Dtype, Option<usize>), max: usize, rows: usize| {
            let p = ProjPlan::new(c, st, (None, None, true), (max, None), rows, fits);
            (p.skinny, p.residual, p.norm)
        };
        let bf16 = (Dtype::Bf16, None);
        let fp8 = (Dtype::Bf16, Some(FP8_SKINNY_MAX_ROWS));
        let fp8_gemm = (Dtype::Bf16, Some(FP8_SKINNY_MAX_ROWS_WITH_GEMM));
        // bf16, fused path on up to 8 rows: residual adds and deferred norms.
        for rows in 1..=8 {
            assert_eq!(plan(&llama, bf16, 8, rows), (true, true, D), "{rows}");
        }
        assert_eq!(plan(&llama, bf16, 8, 9), (false, false, L));
        // Off, and never for f32.
        assert_eq!(plan(&llama, bf16, 0, 1), (false, false, L));
        assert_eq!(plan(&llama, (Dtype::F32, None), 8, 1), (false, false, L));
        // Gemma's sandwich norms: skinny kernels without the residual fusions.
        assert_eq!(plan(&gemma, bf16, 8, 1), (true, false, L));
        assert_eq!(plan(&gemma, bf16, 8, 8), (true, false, L));
        let norm = |c: &ModelConfig, opts, rows, fits: &dyn Fn(NormAt, usize, usize) -> bool| {
            ProjPlan::new(c, bf16, opts, (8, None), rows, fits).norm
        };
        // Deferred norms that do not fit shared memory fall back to the prologues (up to 4
        // rows at 2,048 wide), then to launches.
        let no_deferred = |at, _, _| at != D;
        assert_eq!(norm(&llama, (None, None, true), 4, &no_deferred), P);
        assert_eq!(norm(&llama, (None, None, true), 5, &no_deferred), L);
        assert_eq!(norm(&llama, (None, None, true), 1, &|_, _, _| false), L);
        // HARRIER_DEFERRED_NORM=0: the prologues up to 4 rows (2,048 wide; 2 rows wider),
        // launches past them; HARRIER_NORM_MAX_ROWS moves the prologues' limit.
        let off = (None, None, false);
        assert_eq!(norm(&llama, off, 4, &fits), P);
        assert_eq!(norm(&llama, off, 5, &fits), L);
        assert_eq!(norm(&llama, (None, Some(2), false), 3, &fits), L);
        assert_eq!(norm(&llama, (None, Some(8), false), 8, &fits), P);
        assert_eq!(norm(&llama, (None, Some(0), false), 1, &fits), L);
        let mid = Preset::from_name("llama-3.2-3b").unwrap().config();
        assert_eq!(norm(&mid, off, 2, &fits), P);
        assert_eq!(norm(&mid, off, 3, &fits), L);
        // The default limit: up to 16 rows on models up to 2,048 wide, 12 up to 3,072, models
        // wider at 1 row only.
        let default = crate::config::FUSED_DECODE_MAX_ROWS;
        assert_eq!(default, 16);
        assert_eq!(plan(&llama, bf16, default, 1), (true, true, D));
        assert_eq!(plan(&llama, bf16, default, 8), (true, true, D));
        assert_eq!(plan(&llama, bf16, default, 9), (true, true, D));
        assert_eq!(plan(&llama, bf16, default, 16), (true, true, D));
        assert_eq!(plan(&llama, bf16, default, 17), (false, false, L));
        let wide = Preset::from_name("llama-3.1-8b").unwrap().config();
        assert_eq!(plan(&wide, bf16, default, 1), (true, true, D));
        assert_eq!(plan(&wide, bf16, default, 2), (false, false, L));
        assert_eq!(plan(&mid, bf16, default, 3), (true, true, D));
        assert_eq!(plan(&mid, bf16, default, 8), (true, true, D));
        assert_eq!(plan(&mid, bf16, default, 9), (true, true, D));
        assert_eq!(plan(&mid, bf16, default, 12), (true, true, D));
        assert_eq!(plan(&mid, bf16, default, 13), (false, false, L));
        assert_eq!(plan(&mid, bf16, 10, 12), (false, false, L));
        // HARRIER_FUSED_WIDE_MAX_ROWS replaces the 2,049-3,072 band's limit only.
        let wide_plan = |c: &ModelConfig, band, rows| {
            let p = ProjPlan::new(c, bf16, (None, None, true), (default, band), rows, fits);
            (p.skinny, p.residual, p.norm)
        };
        assert_eq!(wide_plan(&mid, Some(16), 16), (true, true, D));
        assert_eq!(wide_plan(&mid, Some(8), 9), (false, false, L));
        assert_eq!(wide_plan(&llama, Some(8), 16), (true, true, D));
        assert_eq!(wide_plan(&wide, Some(16), 2), (false, false, L));
        let qwen = Preset::from_name("qwen3-0.6b").unwrap().config();
        assert_eq!(plan(&qwen, bf16, default, 16), (true, true, D));
        // FP8 without its fusions (HARRIER_FP8_FUSED=0): skinny up to 16 rows whatever the
        // fused limit.
        assert_eq!(plan(&llama, fp8, 0, 1), (true, false, L));
        assert_eq!(plan(&llama, fp8, 0, FP8_SKINNY_MAX_ROWS), (true, false, L));
        assert_eq!(
            plan(&llama, fp8, 0, FP8_SKINNY_MAX_ROWS + 1),
            (false, false, L)
        );
        assert_eq!(plan(&llama, fp8, 8, 1), (true, false, L));
        // With FP8 tensor-core GEMMs the skinny kernels stop earlier.
        assert_eq!(plan(&llama, fp8_gemm, 0, 8), (true, false, L));
        assert_eq!(plan(&llama, fp8_gemm, 0, 9), (false, false, L));
        assert_eq!(plan(&llama, fp8, 8, 16), (true, false, L));
        // The FP8 fusions (on unless HARRIER_FP8_FUSED=0): within both limits (the norms
        // deferred, or with HARRIER_DEFERRED_NORM=0 in the prologues), the plain FP8 skinny
        // path past the fused one; models wider than 2,048 up to 4 rows.
        let on = Some(FP8_FUSED_MAX_ROWS_WIDE);
        let fused_fp8 = |max, rows, deferred| {
            let p = ProjPlan::new(&llama, fp8, (on, None, deferred), (max, None), rows, fits);
            (p.skinny, p.residual, p.norm)
        };
        assert_eq!(fused_fp8(8, 1, true), (true, true, D));
        assert_eq!(fused_fp8(8, 8, true), (true, true, D));
        assert_eq!(fused_fp8(8, 1, false), (true, true, P));
        assert_eq!(fused_fp8(8, 4, false), (true, true, P));
        assert_eq!(fused_fp8(8, 8, false), (true, true, L));
        assert_eq!(fused_fp8(8, 12, true), (true, false, L));
        // FP8 takes the fusions up to 8 rows whatever the fused limit (no 16-row FP8 twins).
        assert_eq!(fused_fp8(16, 8, true), (true, true, D));
        assert_eq!(fused_fp8(16, 12, true), (true, false, L));
        assert_eq!(
            fused_fp8(8, FP8_SKINNY_MAX_ROWS + 1, true),
            (false, false, L)
        );
        let mid_fp8 = |wide, rows| {
            let p = ProjPlan::new(&mid, fp8, (Some(wide), None, true), (8, None), rows, fits);
            (p.skinny, p.residual, p.norm)
        };
        assert_eq!(mid_fp8(FP8_FUSED_MAX_ROWS_WIDE, 4), (true, true, D));
        assert_eq!(mid_fp8(FP8_FUSED_MAX_ROWS_WIDE, 5), (true, false, L));
        assert_eq!(mid_fp8(FP8_FUSED_MAX_ROWS_WIDE, 8), (true, false, L));
        // HARRIER_FP8_FUSED_WIDE_ROWS moves that limit (to measure).
        assert_eq!(mid_fp8(8, 8), (true, true, D));
        assert_eq!(mid_fp8(2, 3), (true, false, L));
        let qwen = Preset::from_name("qwen3-0.6b").unwrap().config();
        let p = ProjPlan::new(&qwen, fp8, (on, None, true), (8, None), 8, fits);
        assert_eq!((p.skinny, p.residual, p.norm), (true, true, D));
    }

    /// Layer 0's input norm moves into the embedding launch exactly where the step would
    /// launch it: not where the q|k|v GEMM norms in its prologue.
    #[test]
    fn layer0_norm_goes_into_the_embedding_where_it_is_launched() {
        assert!(layer0_norm_launched(NormAt::Launch));
        assert!(layer0_norm_launched(NormAt::Deferred));
        assert!(!layer0_norm_launched(NormAt::Prologue));
    }

    /// RoPE runs in the q|k|v epilogue on skinny steps of layers without q/k norms only.
    #[test]
    fn rope_runs_in_the_epilogue_of_skinny_steps_without_qk_norms() {
        let llama = Preset::from_name("llama-3.2-1b").unwrap().config();
        let fits = |_: NormAt, _: usize, _: usize| true;
        let bf16 = (Dtype::Bf16, None);
        let fp8 = (Dtype::Bf16, Some(FP8_SKINNY_MAX_ROWS_WITH_GEMM));
        let on = (true, true);
        let p = |st, rows| ProjPlan::new(&llama, st, (None, None, true), (1, None), rows, fits);
        assert!(rope_in_epilogue(p(bf16, 1), false, on));
        assert!(!rope_in_epilogue(p(bf16, 2), false, on), "cuBLAS step");
        assert!(rope_in_epilogue(p(fp8, 8), false, on), "FP8 skinny step");
        assert!(!rope_in_epilogue(p(fp8, 9), false, on), "FP8 GEMM step");
        assert!(!rope_in_epilogue(p(bf16, 1), true, on), "q/k norms");
        assert!(
            !rope_in_epilogue(p(bf16, 1), false, (false, true)),
            "unpaired"
        );
        assert!(
            !rope_in_epilogue(p(bf16, 1), false, (true, false)),
            "switched off"
        );
    }

    /// The paired RoPE order puts each dim and its rotation partner 8 rows apart in a 16-row
    /// tile, moves whole rows, leaves rows past the paired heads alone, and is a permutation.
    #[test]
    fn rope_pairs_sit_eight_rows_apart_in_each_tile() {
        for hd in [16usize, 64, 128, 256] {
            let (heads, row_len, extra) = (3usize, 2usize, 5usize);
            // Row r of head h holds (h * hd + r) in every column.
            let rows = heads * hd + extra;
            let mut w: Vec<u32> = (0..rows)
                .flat_map(|r| std::iter::repeat_n(r as u32, row_len))
                .collect();
            pair_rope_rows(&mut w, row_len, heads, hd);
            let row = |r: usize| {
                assert!(w[r * row_len..(r + 1) * row_len]
                    .iter()
                    .all(|&v| v == w[r * row_len]));
                w[r * row_len] as usize
            };
            let half = hd / 2;
            for h in 0..heads {
                for tile in 0..hd / 16 {
                    for e in 0..8 {
                        let s = h * hd + tile * 16 + e;
                        let dim = row(s) - h * hd;
                        assert_eq!(dim, 8 * tile + e, "hd {hd}");
                        assert_eq!(row(s + 8) - h * hd, dim + half, "hd {hd}");
                    }
                }
            }
            for r in heads * hd..rows {
                assert_eq!(row(r), r);
            }
            let mut seen: Vec<usize> = (0..rows).map(row).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..rows).collect::<Vec<_>>());
        }
        assert!(rope_pairs(64) && rope_pairs(256) && !rope_pairs(40) && !rope_pairs(0));
    }

    #[test]
    fn fp8_needs_bf16_and_reduction_widths_of_64() {
        for name in [
            "llama-3.2-1b",
            "llama-3.1-8b",
            "qwen3-0.6b",
            "gemma-3-1b",
            "micro",
        ] {
            let c = Preset::from_name(name).unwrap().config();
            check_fp8_model(&c, Dtype::Bf16).unwrap();
        }
        let c = Preset::from_name("llama-3.2-1b").unwrap().config();
        let e = check_fp8_model(&c, Dtype::F32).unwrap_err().to_string();
        assert!(e.contains("bf16"), "{e}");
        let mut odd = c.clone();
        odd.intermediate_size = 8200;
        let e = check_fp8_model(&odd, Dtype::Bf16).unwrap_err().to_string();
        assert!(
            e.contains("intermediate_size (8200)") && e.contains("64"),
            "{e}"
        );
    }
}
