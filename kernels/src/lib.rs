//! Harrier's CUDA kernels: the CUDA C source (`cuda/harrier.cu`), its NVRTC compilation for the
//! device's architecture with an on-disk PTX cache keyed by source hash, and typed launchers.
//!
//! The launchers take raw device addresses (`CUdeviceptr`) and a raw stream: the executor owns
//! its buffers at fixed addresses (so CUDA graphs can capture the decode step over them) and
//! orders its streams with its own events; nothing here allocates or synchronises.
//!
//! No CUDA headers are needed: bf16 values are handled as raw 16-bit words in the source.
//! The source compiles for one storage type ([`Dtype`]): bf16 (serving) or fp32 (the exact
//! model, `-DHARRIER_F32`, for parity checks against an fp32 reference).

pub use cudarc;

use std::ffi::c_void;
use std::path::PathBuf;

use anyhow::{anyhow, bail, Context};
use cudarc::driver::result as dr;
use cudarc::driver::sys;

/// The CUDA C source of every kernel.
pub const SOURCE: &str = include_str!("../cuda/harrier.cu");

/// The `extern "C"` kernels in [`SOURCE`] but the skinny GEMM and `gemv_ring` instances, which
/// [`SKINNY_INSTANCES`], [`SKINNY_B2`] and [`RING_INSTANCES`] name; [`kernel_names`] lists them
/// all.
const KERNELS: &[&str] = &[
    "embed_tokens",
    "add_rmsnorm",
    "rope_kv_write",
    "silu_mul",
    "gelu_tanh_mul",
    "paged_attention",
    "paged_attention_hd64",
    "paged_attention_hd128",
    "paged_attention_hd256",
    "apply_row_inits",
    "sample_tokens",
    "spec_place",
    "draft_sample",
    "spec_verify",
    "row_argmax_parts",
    "ngram_init",
    "ngram_record",
    "ngram_propose",
    "copy_f32",
    "scatter_i32",
    "apply_token_mask",
    "gemv_bf16",
    "attention_combine",
    "init_row_state",
    "prefill_attention",
    "paged_attention_gqa",
    "paged_attention_grp64",
    "paged_attention_grp128",
    "paged_attention_grpc64",
    "paged_attention_grpc128",
    "dequant_fp8_rows",
    "quantize_fp8_rows",
    "fp8_rescale",
];

/// Kernels that only exist in the bf16 build: these, and every tensor-core skinny GEMM and FP8
/// kernel (names starting with [`BF16_ONLY_PREFIXES`]).
const BF16_ONLY: &[&str] = &[
    "gemv_bf16",
    "paged_attention_grp64",
    "paged_attention_grp128",
    "paged_attention_grpc64",
    "paged_attention_grpc128",
    "prefill_attention",
    "dequant_fp8_rows",
    "quantize_fp8_rows",
    "fp8_rescale",
];
const BF16_ONLY_PREFIXES: &[&str] = &["skinny_gemm_", "gemv_ring"];

/// Query tokens per `prefill_attention` tile (`PF_QT` in the source).
pub const PREFILL_TILE: usize = 64;

/// Threads of a `prefill_attention` block (`PF_WARPS` warps).
const PREFILL_THREADS: u32 = 4 * 32;

/// Threads of a `paged_attention_gqa` block: `GQA_WARPS` (8) warps for small grids, 4 from
/// [`GQA_SMALL_BLOCKS_FROM`] blocks on (more, smaller blocks per SM; measured in harrier.cu).
const GQA_THREADS: u32 = 8 * 32;
const GQA_SMALL_BLOCKS_FROM: u32 = 512;

/// Whether `paged_attention_gqa` has an instance for this head layout (G = nh / nkv query
/// heads per KV head in 1, 2, 3, 4, 6, 8 with head dim 64 or 128; G in 1, 2, 4 with head dim
/// 256).
pub fn gqa_attention_supports(nh: usize, nkv: usize, hd: usize) -> bool {
    if nkv == 0 || !nh.is_multiple_of(nkv) {
        return false;
    }
    match hd {
        64 | 128 => matches!(nh / nkv, 1 | 2 | 3 | 4 | 6 | 8),
        256 => matches!(nh / nkv, 1 | 2 | 4),
        _ => false,
    }
}

/// Per-token attention over at least this many rows (and no token list) takes
/// `paged_attention_grp*`, a KV head's query heads in one block ([`Kernels::grp_serves`]):
/// every row count since session 37's kernel (scores on the tensor cores, 16-key warp tiles).
/// Measured on an H200 (session 37, graphs, context 512, ms a step, from 4 rows vs from 1):
/// 1B batch 2 0.930-0.931 vs 0.888-0.891, batch 3 0.963-0.965 vs 0.906-0.908; 3B batch 2
/// 2.217-2.230 vs 2.153-2.159, 3 2.338-2.346 vs 2.197-2.202; Qwen3-0.6B (no decode ring) batch
/// 1 0.840-0.844 vs 0.750-0.751, 2 0.892-0.894 vs 0.785, 3 0.951-0.952 vs 0.812-0.820. (Session
/// 35's kernel lost at 1-2 rows: 3B batch 2 2.285 vs 2.36.) The 1B's and 3B's batch 1 run in
/// the decode ring either way. `HARRIER_ATTN_GRP_MIN_TOKENS` overrides it, to measure.
pub const ATTN_GRP_MIN_TOKENS: usize = 1;

/// Threads of a `paged_attention_grp*` block (`GRP_WARPS` warps): the cluster instances' and
/// the widest plain block ([`grp_warps`]).
const GRP_THREADS: u32 = 16 * 32;

/// Block widths of the plain `paged_attention_grp*` launches, widest first: a block's 16-key
/// tiles go round-robin over its warps, so fewer warps a block take more tiles each, and more
/// blocks fit an SM (128 registers a thread: one 16-warp block, two of 8, four of 4).
const GRP_WIDTHS: [u32; 3] = [16, 8, 4];

/// Warps a block of a plain `paged_attention_grp*` launch of `blocks` blocks: the widest of
/// [`GRP_WIDTHS`] whose blocks all fit at once (`resident[i]`: blocks of width
/// `GRP_WIDTHS[i]` resident on the device), else the narrowest. Measured on an H200 (session
/// 38, graphs, context 512, ms a step, unsplit launches as `paged_attention_gqa` ran them;
/// gqa / 16 / 8 / 4 warps): 1B batch 32 (256 blocks) 1.503-1.513 / 1.424 / **1.367** / 1.444,
/// 64 (512) 1.799-1.804 / 1.765 / 1.637 / **1.580**, 128 2.515-2.517 / 2.455 / 2.225 /
/// **2.106**, 256 3.969-3.970 / 3.913 / 3.423 / **3.219**.
pub fn grp_warps(blocks: u32, resident: [u32; 3]) -> u32 {
    GRP_WIDTHS
        .iter()
        .zip(resident)
        .find(|&(_, r)| blocks <= r)
        .map_or(GRP_WIDTHS[GRP_WIDTHS.len() - 1], |(&w, _)| w)
}

/// How a [`Kernels::paged_attention_grouped`] launch is shaped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GrpLaunch {
    /// The tokens, `tok_list[i]` for block row i (0: token i; one split only).
    pub tok_list: u64,
    /// 2-4 splits whose clusters are all resident merge there (`paged_attention_grpc*`, the
    /// engine's choice) instead of in `attention_combine`, with the same bits.
    pub clusters: bool,
    /// Warps a block of the plain instance (one of [`GRP_WIDTHS`]; 0: the launch's own
    /// [`Kernels::grp_launch_warps`]; the engine passes its plan's, from the padded rows).
    pub warps: u32,
}

/// The `paged_attention_grp*` instance for this head layout, if it has one: G = nh / nkv query
/// heads per KV head up to 4 (`GRP_MAX_G`), head dim 64 or 128.
fn grp_attention_kernel(nh: i32, nkv: i32, hd: i32) -> Option<&'static str> {
    if nkv <= 0 || nh % nkv != 0 || !(1..=4).contains(&(nh / nkv)) {
        return None;
    }
    match hd {
        64 => Some("paged_attention_grp64"),
        128 => Some("paged_attention_grp128"),
        _ => None,
    }
}

/// The most splits a `paged_attention_grpc*` launch merges in its clusters (`GRP_CL_MAX`).
/// Measured on an H200 (session 36, graphs, context 512, ms a step, `attention_combine` vs
/// clusters): Qwen3-0.6B batch 4 0.945 vs 0.895-0.898, batch 8 1.027-1.029 vs 0.974-0.981; the
/// Llama 1B and 3B tie at batches 4 and 8.
pub const GRP_CLUSTER_MAX_SPLITS: u32 = 4;

/// [`Kernels::grp_cluster_splits`] where a launch of `s` splits holds `tokens_at(s)` tokens.
fn cluster_splits(tokens: u32, splits: u32, tokens_at: impl Fn(u32) -> u32) -> u32 {
    (2..=splits.min(GRP_CLUSTER_MAX_SPLITS))
        .rev()
        .find(|&s| tokens <= tokens_at(s))
        .unwrap_or(splits)
}

/// The cluster twins of the `paged_attention_grp*` instances: a token's splits of a KV head in
/// one cluster, merged there (no `attention_combine`).
const GRP_CLUSTER_KERNELS: [(&str, &str); 2] = [
    ("paged_attention_grp64", "paged_attention_grpc64"),
    ("paged_attention_grp128", "paged_attention_grpc128"),
];

/// The index of plain grp instance `grp` in [`GRP_CLUSTER_KERNELS`] (and so in the per-instance
/// tables [`Kernels`] keeps: resident blocks, resident clusters).
fn grp_kernel_index(grp: &str) -> Option<usize> {
    GRP_CLUSTER_KERNELS.iter().position(|(g, _)| *g == grp)
}

/// Whether `paged_attention_grp*` has an instance for this head layout.
pub fn grp_attention_supports(nh: usize, nkv: usize, hd: usize) -> bool {
    grp_attention_kernel(nh as i32, nkv as i32, hd as i32).is_some()
}

/// Whether `prefill_attention` handles head dimension `hd` (256 with 32-key tiles).
pub fn prefill_attention_supports(hd: usize) -> bool {
    matches!(hd, 64 | 128 | 256)
}

/// The storage type of weights, activations and the KV cache (arithmetic is fp32 either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dtype {
    /// bfloat16, with Hugging Face's bf16 rounding points (the serving type).
    #[default]
    Bf16,
    /// float32 throughout (twice the memory and bandwidth; for exact parity checks).
    F32,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bf16 => 2,
            Dtype::F32 => 4,
        }
    }

    /// The name `--dtype` takes (as vLLM and transformers spell it).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bfloat16",
            Dtype::F32 => "float32",
        }
    }

    /// Whether `kernel` exists in this build of the source.
    pub fn has_kernel(self, kernel: &str) -> bool {
        self == Dtype::Bf16
            || !(BF16_ONLY.contains(&kernel)
                || BF16_ONLY_PREFIXES.iter().any(|p| kernel.starts_with(p)))
    }
}

impl std::str::FromStr for Dtype {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Dtype> {
        match s {
            "bfloat16" | "bf16" | "auto" => Ok(Dtype::Bf16),
            "float32" | "fp32" | "float" => Ok(Dtype::F32),
            _ => bail!("unknown dtype {s:?} (expected bfloat16 or float32)"),
        }
    }
}

/// Largest batch `gemv_bf16` takes (`GEMV_MAX_M` in the source); larger ones go to cuBLAS.
pub const GEMV_MAX_M: usize = 8;

/// `gemv_bf16` blocks: `GEMV_WARPS` warps, each computing `GEMV_ROWS` outputs (as in the source).
const GEMV_WARPS: u32 = 8;
const GEMV_ROWS: u32 = 2;

/// Largest step `skinny_gemm_*` takes (8 input rows per mma n-tile, at most 8 tiles).
pub const SKINNY_MAX_M: usize = 64;

/// `skinny_gemm_*` blocks: `SK_WARPS` warps (the source's default; [`Kernels::load_with`] may
/// override it) over tiles of `SK_ROWS` weight rows.
const SKINNY_WARPS: u32 = 16;
const SKINNY_ROWS: u32 = 16;

/// Products with at least this many row tiles (of 16) use the 4-tile instances (fewer blocks
/// re-read and re-normalise x): gate|up and lm_head of the Llama shapes. Re-measured on the
/// H200 (session 13, ms per step): one-tile gate|up blocks lost on the 3B (2.58 vs 2.51) and
/// the 8B (4.97 vs 4.88) and tied on the 1B.
const SKINNY_R4_FROM_TILES: usize = 1024;

/// What a `skinny_gemm_*` launch does with its sums (`SK_*` in the source).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkinnyEpilogue {
    /// `y = bf16(acc)`.
    Store = 0,
    /// `y = acc` in f32 (logits).
    StoreF32 = 1,
    /// `y = bf16(y + bf16(acc))`: the residual add, in place. The kernel reads y before it
    /// waits on the launch before it (programmatic dependent launch), so that launch must not
    /// write y; launches two or more back have completed by then (three or more after
    /// `attention_combine`, which lets the next launch start before its own wait: the o
    /// projection's y is written by the down projection further back).
    Residual = 2,
    /// w is `[gate; up]` over `2 n` rows: `y = bf16(bf16(silu(gate)) * up)`.
    SiluMul = 3,
    /// As `SiluMul` with GELU (tanh approximation).
    GeluTanhMul = 4,
    /// The q|k|v projection with RoPE and the KV write (see [`SkinnyRope`]): q rotated into
    /// `y`, k rotated and v into the cache; `y`'s k and v columns are not written.
    Rope = 5,
}

/// The RoPE epilogue of a q|k|v skinny GEMM (mirrors `struct SkinnyRope`): what
/// [`Kernels::rope_kv_write`] does for a model without q/k norms, for the first `rows` rows,
/// with the q and k weight rows in the paired order (`rope_row` in the source; needs
/// `head_dim % 16 == 0`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct SkinnyRope {
    pub positions: u64,
    pub inv_freq: u64,
    pub slot_mapping: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub nh: i32,
    pub nkv: i32,
    pub hd: i32,
    pub rows: i32,
}

/// The RMSNorm a `skinny_gemm_*` launch takes part in (norm weights scaled by `w_off + w`
/// when `w_off` is not 0, as [`Kernels::add_rmsnorm`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SkinnyNorm {
    None,
    /// x is RMSNorm(x) by `w`, computed in the prologue ([`SkinnyInputs::normed`]).
    Prologue {
        w: u64,
        eps: f32,
        w_off: f32,
    },
    /// A deferred norm's writer ([`SkinnyInputs::norm_out`]).
    Out {
        u: u64,
        w: u64,
        ss: u64,
        w_off: f32,
    },
    /// A deferred norm's reader ([`SkinnyInputs::norm_in`]).
    In {
        ss: u64,
        eps: f32,
    },
}

/// One `skinny_gemm_*` launch (passed to the kernel as [`SkinnyAbi`], `struct SkinnyIn`):
/// `y[m, n] = epilogue(x'[m, :] · w[n, :])` for `m < m_rows`, where x' is x, or its RMSNorm
/// by `norm`.
#[derive(Debug, Clone, Copy)]
pub struct SkinnyInputs {
    pub x: u64,
    pub w: u64,
    pub y: u64,
    /// FP8 weights: one f32 scale per weight row (then `w` holds e4m3 bytes); 0 for bf16.
    pub scale: u64,
    pub m_rows: i32,
    pub n: i32,
    pub k: i32,
    pub epi: i32,
    /// Read with [`SkinnyEpilogue::Rope`] only.
    pub rope: SkinnyRope,
    pub norm: SkinnyNorm,
}

impl SkinnyInputs {
    /// A plain product `y[m, n] = x[m, :] · w[n, :]` with `epi`'s epilogue.
    pub fn new(
        (x, w, y): (u64, u64, u64),
        m_rows: usize,
        n: usize,
        k: usize,
        epi: SkinnyEpilogue,
    ) -> SkinnyInputs {
        SkinnyInputs {
            x,
            w,
            y,
            scale: 0,
            m_rows: m_rows as i32,
            n: n as i32,
            k: k as i32,
            epi: epi as i32,
            rope: SkinnyRope::default(),
            norm: SkinnyNorm::None,
        }
    }

    /// The q|k|v epilogue with RoPE and the KV write ([`SkinnyEpilogue::Rope`]).
    pub fn roped(self, rope: SkinnyRope) -> SkinnyInputs {
        SkinnyInputs {
            epi: SkinnyEpilogue::Rope as i32,
            rope,
            ..self
        }
    }

    /// FP8 weights (`w` is e4m3 bytes) with one f32 scale per weight row at `scale`; 0 keeps
    /// bf16 weights (so a projection's optional scale buffer passes straight through).
    pub fn scaled(self, scale: u64) -> SkinnyInputs {
        SkinnyInputs { scale, ..self }
    }

    /// The writer half of a deferred RMSNorm (a [`SkinnyEpilogue::Residual`] launch): besides
    /// the new residual `y' = bf16(y + bf16(acc))` it writes `u = bf16(norm_w * y')` (`[m_rows,
    /// n]` at `u`; `w_off + norm_w` scaling as [`Kernels::add_rmsnorm`] when `w_off` is not 0)
    /// and the sums of squares of `y'` over each 16 columns, `ss[m * ceil(n / 16) + n / 16]`
    /// (f32, in a fixed order). The next launch reads `u` with [`SkinnyInputs::norm_in`].
    pub fn norm_out(self, (u, w, ss): (u64, u64, u64), w_off: f32) -> SkinnyInputs {
        SkinnyInputs {
            norm: SkinnyNorm::Out { u, w, ss, w_off },
            ..self
        }
    }

    /// The reader half of a deferred RMSNorm: `x` is the `u` a [`SkinnyInputs::norm_out`] launch
    /// wrote over `k` columns and `ss` its partial sums; each row's sums are multiplied by its
    /// `rsqrt(mean(y'^2) + eps)` before the epilogue. That is RMSNorm with the scale applied
    /// after the product instead of before it: the same value but for rounding (`u` rounds
    /// `norm_w * y'` where the launched norm rounds `y' * inv` and then `norm_w * that`), no
    /// prologue and no norm launch (docs/cuda.md, "Deferred norms").
    pub fn norm_in(self, ss: u64, eps: f32) -> SkinnyInputs {
        SkinnyInputs {
            norm: SkinnyNorm::In { ss, eps },
            ..self
        }
    }

    /// The input RMSNormed first (weights `w`, `(eps, w_off)` as [`Kernels::add_rmsnorm`]).
    pub fn normed(self, w: u64, (eps, w_off): (f32, f32)) -> SkinnyInputs {
        SkinnyInputs {
            norm: SkinnyNorm::Prologue { w, eps, w_off },
            ..self
        }
    }

    /// Whether the launch takes part in a deferred norm (the `_dn` instances).
    fn deferred(&self) -> bool {
        matches!(self.norm, SkinnyNorm::In { .. } | SkinnyNorm::Out { .. })
    }
}

/// The deferred norm's writer operands in `struct SkinnyIn`'s union (`dout`).
#[repr(C)]
#[derive(Clone, Copy)]
struct SkinnyNormOut {
    u: u64,
    ss: u64,
}

/// `struct SkinnyIn`'s union: RoPE's operands or the deferred norm's writer's.
#[repr(C)]
#[derive(Clone, Copy)]
union SkinnyEpilogueArgs {
    rope: SkinnyRope,
    dout: SkinnyNormOut,
}

/// `struct SkinnyIn` as the kernel reads it: 120 bytes, fields reused by the deferred norm's
/// flags (`SK_NORM_IN`: `norm_w` holds the partials; `SK_NORM_OUT`: `norm_w` the next norm's
/// weights and the union `u` and the partials). Keep it at most 128 bytes: NVRTC passed a
/// 152-byte one by address, and `skinny_gemm_8` read every field through generic loads (89 ->
/// 60 registers, the 1B 2-5% slower; session 29).
#[repr(C)]
#[derive(Clone, Copy)]
struct SkinnyAbi {
    x: u64,
    w: u64,
    y: u64,
    norm_w: u64,
    scale: u64,
    eps: f32,
    w_off: f32,
    m_rows: i32,
    n: i32,
    k: i32,
    epi: i32,
    args: SkinnyEpilogueArgs,
}

/// `SK_NORM_IN` and `SK_NORM_OUT` in the source: flags beside the epilogue in `epi`.
const SK_NORM_IN: i32 = 16;
const SK_NORM_OUT: i32 = 32;

impl SkinnyInputs {
    /// The kernel's argument (see [`SkinnyAbi`]).
    fn abi(&self) -> SkinnyAbi {
        let rope = SkinnyEpilogueArgs { rope: self.rope };
        // (norm_w, eps, w_off, flags, union)
        let (norm_w, eps, w_off, flags, args) = match self.norm {
            SkinnyNorm::None => (0, 0.0, 0.0, 0, rope),
            SkinnyNorm::Prologue { w, eps, w_off } => (w, eps, w_off, 0, rope),
            SkinnyNorm::In { ss, eps } => (ss, eps, 0.0, SK_NORM_IN, rope),
            SkinnyNorm::Out { u, w, ss, w_off } => (
                w,
                0.0,
                w_off,
                SK_NORM_OUT,
                SkinnyEpilogueArgs {
                    dout: SkinnyNormOut { u, ss },
                },
            ),
        };
        SkinnyAbi {
            x: self.x,
            w: self.w,
            y: self.y,
            norm_w,
            scale: self.scale,
            eps,
            w_off,
            m_rows: self.m_rows,
            n: self.n,
            k: self.k,
            epi: self.epi | flags,
            args,
        }
    }
}

/// Dynamic shared memory the skinny kernels ask for (the normed input and the norm weights):
/// a 4,096-wide model at 8 rows. GPUs whose opt-in limit is lower (99 KiB per block on
/// sm_86/89, with up to 32 KiB of static reduction buffers) get [`SKINNY_SMEM_FALLBACK`].
const SKINNY_SMEM_MAX: usize = 80 << 10;
const SKINNY_SMEM_FALLBACK: usize = 16 << 10;

/// Layer 0's input RMSNorm done by `embed_tokens` ([`Kernels::embed_tokens`]).
#[derive(Debug, Clone, Copy)]
pub struct EmbedNorm {
    /// The normed rows (`hidden` a row).
    pub out: u64,
    /// The norm's weights (`hidden`).
    pub w: u64,
    pub eps: f32,
    /// The norm weights' offset (Gemma's 1; Llama's 0), as [`Kernels::add_rmsnorm`]'s.
    pub w_off: f32,
}

/// The f32 partial sums of squares a deferred norm keeps for `m` rows of `k` columns (one a 16
/// columns and row; [`SkinnyInputs::norm_out`]).
pub fn deferred_norm_partials(m: usize, k: usize) -> usize {
    m * k.div_ceil(16)
}

fn deferred_norm_smem(m: usize, k: usize) -> usize {
    deferred_norm_partials(m, k) * 4
}

/// Whether `skinny_gemm_*` takes an `m`-row product over `k`.
pub fn skinny_supports(m: usize, k: usize) -> bool {
    (1..=SKINNY_MAX_M).contains(&m) && k.is_multiple_of(32) && k > 0
}

/// The skinny GEMM instances, bf16 weights then FP8, by shape: 8, 16, 32 and 64 input rows;
/// 8 and 16 rows over 4 row tiles a block; 8 rows in 8-warp blocks over 1 and 4 row tiles.
const SKINNY_INSTANCES: [[&str; 8]; 2] = [
    [
        "skinny_gemm_8",
        "skinny_gemm_16",
        "skinny_gemm_32",
        "skinny_gemm_64",
        "skinny_gemm_8_r4",
        "skinny_gemm_16_r4",
        "skinny_gemm_8_w8",
        "skinny_gemm_8_r4_w8",
    ],
    [
        "skinny_gemm_f8_8",
        "skinny_gemm_f8_16",
        "skinny_gemm_f8_32",
        "skinny_gemm_f8_64",
        "skinny_gemm_f8_8_r4",
        "skinny_gemm_f8_16_r4",
        "skinny_gemm_f8_8_w8",
        "skinny_gemm_f8_8_r4_w8",
    ],
];

/// Every `extern "C"` kernel in [`SOURCE`], in the order [`Kernels`] keeps their functions.
pub fn kernel_names() -> impl Iterator<Item = &'static str> {
    KERNELS
        .iter()
        .chain(SKINNY_INSTANCES.iter().flatten())
        .chain(SKINNY_16_W8.iter())
        .chain([SKINNY_B2, SKINNY_K2, SKINNY_K2_W8].iter().flatten())
        .chain(SKINNY_DN.iter().map(|(_, dn)| dn))
        .chain(RING_INSTANCES.iter().map(|(_, _, name)| name))
        .copied()
}

/// Each 8-row and bf16 16-row instance and its deferred-norm twin (`skinny_gemm<.., DN = true>`,
/// the only ones that read `SK_NORM_IN` / `SK_NORM_OUT`: the extra epilogue code in every
/// instance cost the 1B's other fused steps ~2%, session 29); the FP8 ones serve FP8 steps on
/// the fused path (the default since session 33; `HARRIER_FP8_FUSED=0` leaves them out).
const SKINNY_DN: [(&str, &str); 18] = [
    ("skinny_gemm_8", "skinny_gemm_8_dn"),
    ("skinny_gemm_8_r4", "skinny_gemm_8_r4_dn"),
    ("skinny_gemm_8_w8", "skinny_gemm_8_w8_dn"),
    ("skinny_gemm_8_r4_w8", "skinny_gemm_8_r4_w8_dn"),
    (SKINNY_B2[0], "skinny_gemm_8_b2_dn"),
    (SKINNY_K2[0], "skinny_gemm_8_b2_dn_k2"),
    (SKINNY_K2_W8[0], "skinny_gemm_8_w8_dn_k2"),
    ("skinny_gemm_16", "skinny_gemm_16_dn"),
    ("skinny_gemm_16_r4", "skinny_gemm_16_r4_dn"),
    (SKINNY_16_W8[0], "skinny_gemm_16_w8_dn"),
    (SKINNY_16_W8[1], "skinny_gemm_16_r4_w8_dn"),
    (SKINNY_B2[1], "skinny_gemm_16_b2_dn"),
    (SKINNY_K2[1], "skinny_gemm_16_b2_dn_k2"),
    (SKINNY_K2_W8[1], "skinny_gemm_16_w8_dn_k2"),
    ("skinny_gemm_f8_8", "skinny_gemm_f8_8_dn"),
    ("skinny_gemm_f8_8_r4", "skinny_gemm_f8_8_r4_dn"),
    ("skinny_gemm_f8_8_w8", "skinny_gemm_f8_8_w8_dn"),
    ("skinny_gemm_f8_8_r4_w8", "skinny_gemm_f8_8_r4_w8_dn"),
];

/// The deferred-norm twin of instance `name`, if it has one (8-row instances; bf16 16-row ones).
fn skinny_dn_instance(name: &str) -> Option<&'static str> {
    SKINNY_DN
        .iter()
        .find(|(k, _)| *k == name)
        .map(|(_, dn)| *dn)
}

/// The bf16 16-row 8-warp instances over 1 and 4 row tiles (FP8 has no 16-row `_w8` ones:
/// [`W8Rule::fits`]).
const SKINNY_16_W8: [&str; 2] = ["skinny_gemm_16_w8", "skinny_gemm_16_r4_w8"];

/// The most rows of the skinny instances with 8-warp, two-block, cluster split-K and
/// deferred-norm twins: 16 with bf16 weights (the `_16_` ones, session 39), 8 with FP8 (`f8`).
/// The engine's fused path stops there.
pub fn skinny_twins_max_m(f8: bool) -> usize {
    if f8 {
        8
    } else {
        16
    }
}

/// The instance of an `m`-row launch (`r4`: 4 row tiles a block, m <= 16; `w8`: 8-warp blocks,
/// m <= [`skinny_twins_max_m`]; `f8`: FP8 weights).
fn skinny_instance(m: usize, r4: bool, f8: bool, w8: bool) -> &'static str {
    if w8 && m > 8 {
        return SKINNY_16_W8[usize::from(r4)];
    }
    let shape = match (m.div_ceil(8), r4, w8) {
        (_, false, true) => 6,
        (_, true, true) => 7,
        (1, true, _) => 4,
        (2, true, _) => 5,
        (1, ..) => 0,
        (2, ..) => 1,
        (3 | 4, ..) => 2,
        _ => 3,
    };
    SKINNY_INSTANCES[usize::from(f8)][shape]
}

/// The instance of one-tile bf16 launches of up to 8 rows (9-16: the second, two n-tile twin)
/// with at least [`SKINNY_W8_MIN_BLOCKS`] blocks that either run one wave at two blocks an SM (at most
/// [`SKINNY_B2_MAX_BLOCKS`]: the 1B q|k|v, the 3B o, the 8B o) or have reductions past
/// [`SKINNY_W8_MAX_K`] (the 3B and 8B down projections): 16 warps bound to two blocks an SM.
/// Measured on the H200 (session 13, ms per step, side by side): the long reductions 3B
/// 2.615 -> 2.489 at batch 1, 3.26 -> 3.12 at 8, 8B 4.965 -> 4.914; the one-wave launches on
/// top 1B 1.049 -> 1.034 (batch 1), 1.208 -> 1.198 (8), 3B 2.492 -> 2.463, 3.125 -> 3.105, 8B
/// the same; up to 400 blocks (two waves) lost (3B 2.535, 8B 5.008). `HARRIER_SKINNY_B2=0`:
/// the 8-warp and `skinny_gemm_8` instances instead, to compare. (These split-K and
/// two-block names come in pairs, `[up to 8 rows, 9-16 rows]`: bf16 steps of 9-16 rows take
/// the 16-row twins by the same rules; session 39.)
const SKINNY_B2: [&str; 2] = ["skinny_gemm_8_b2", "skinny_gemm_16_b2"];
/// [`SKINNY_B2`] with each block's reduction cut in two, the halves a cluster of two blocks
/// (rank 1 pushes its sums into rank 0's shared memory, which adds them and runs the
/// epilogue; sm_90 on): one-tile bf16 launches of up to 16 rows that neither it nor the 8-warp
/// instances take, at most [`SKINNY_B2_MAX_BLOCKS`] / 2 tiles over reductions of at least
/// [`SKINNY_K2_MIN_K`], without a staged (norm prologue) input, and their clusters all
/// resident (the 1B's down, 128 tiles, and Qwen3-0.6B's, 64: otherwise one block an SM on as
/// many SMs as tiles). `HARRIER_SKINNY_K2=0` turns it off, to compare. Measured on an H200 (session 36, graphs, context 512, ms a step,
/// off vs on): 1B batch 2 0.957-0.958 vs 0.934, 4 0.985-0.986 vs 0.956-0.957, 8 1.022-1.026 vs
/// 0.986-0.994; Qwen3-0.6B batch 1 0.852-0.855 vs 0.841-0.842, 4 0.911 vs 0.888-0.889, 8
/// 1.000-1.003 vs 0.967-0.969; check-gemv, 8 rows: the 1B's down 10.0 -> 8.1 us, Qwen3-0.6B's
/// 3.9 -> 3.1, but the 1B's o (k 2,048) 3.4 either way, so reductions from 3,072.
const SKINNY_K2: [&str; 2] = ["skinny_gemm_8_b2_k2", "skinny_gemm_16_b2_k2"];
/// [`SKINNY_K2`]'s 8-warp twin, three blocks an SM, for launches [`SKINNY_B2`] takes over
/// reductions of at least [`SKINNY_K2_MIN_K`] whose halves fit one wave (at most 198 tiles:
/// the 3B's o and down, 192 tiles over 3,072 and 8,192), so that they stream from every SM
/// rather than two blocks an SM on 96. Measured on an H200 (session 36, graphs, context 512, ms
/// a step, b2 vs this): 3B batch 2 2.284-2.288 vs 2.226-2.232, 4 2.421-2.425 vs 2.360-2.363, 8
/// 2.535-2.536 vs 2.477-2.483; on the 1B's q|k|v (192 tiles over 2,048) a tie or 1% slower,
/// hence the same shortest reduction as [`SKINNY_K2`]. `HARRIER_SKINNY_K2_W8=0` turns it off,
/// to compare.
const SKINNY_K2_W8: [&str; 2] = ["skinny_gemm_8_w8_k2", "skinny_gemm_16_w8_k2"];
/// The shortest reduction [`SKINNY_K2`] takes (`HARRIER_SKINNY_K2_MIN_K` overrides it, to
/// measure).
const SKINNY_K2_MIN_K: usize = 3072;

/// Whether an `m`-row one-tile bf16 launch of `blocks` tiles over `k` that neither [`SKINNY_B2`]
/// nor the 8-warp instances take runs [`SKINNY_K2`]: up to 16 rows, reductions of at least
/// `min_k`, twice the blocks within `max_blocks` (one wave at two an SM) and `clusters` resident
/// pairs for its tiles.
fn skinny_k2_fits(
    (m, blocks, k): (usize, u32, usize),
    (min_k, max_blocks): (usize, u32),
    clusters: u32,
) -> bool {
    m <= skinny_twins_max_m(false) && k >= min_k && 2 * blocks <= max_blocks && blocks <= clusters
}

/// Whether a launch of `blocks` tiles over `k` that [`SKINNY_B2`] takes runs [`SKINNY_K2_W8`]
/// instead: reductions of at least `min_k`, twice the blocks within one wave at three an SM
/// (`max_blocks` counts two an SM), and `clusters` resident pairs for its tiles.
fn skinny_k2_w8_fits(
    (blocks, k): (u32, usize),
    (min_k, max_blocks): (usize, u32),
    clusters: u32,
) -> bool {
    k >= min_k && 4 * blocks <= 3 * max_blocks && blocks <= clusters
}

/// Two blocks on each of an H100's or H200's 132 SMs (`HARRIER_SKINNY_B2_MAX_BLOCKS`
/// overrides it, to measure).
const SKINNY_B2_MAX_BLOCKS: u32 = 264;

/// Launches of at least this many blocks, with bf16 weights over reductions of at most
/// `SKINNY_W8_MAX_K`, take the 8-warp skinny instances (see [`skinny_w8_fits`]).
const SKINNY_W8_MIN_BLOCKS: u32 = 160;
const SKINNY_W8_MAX_K: usize = 4096;

/// Whether an `m`-row skinny launch of `blocks` blocks over `k` (`f8`: FP8 weights) takes an 8-warp
/// instance (`skinny_gemm_*_w8`) rather than `SK_WARPS` warps: up to [`skinny_twins_max_m`] rows,
/// more blocks than an H100 has SMs, and for bf16 weights reductions of at most 4,096. Measured on
/// the H100 (1 row, us, 16 vs 8 warps; `check-gemv` / `check-fp8 --variants`, 2026-11-25): 1B q|k|v
/// (192 blocks, k 2,048) 6.4 vs 5.0 bf16, 6.7 vs 5.4 FP8; gate|up (256) 27.3 vs 26.0 bf16, 17.3 vs
/// 17.5 FP8; lm_head (2,004) 183.4 vs 180.8 bf16, 137.8 vs 106.7 FP8; 8B q|k|v (384, k 4,096) 22.6
/// vs 20.3 bf16, 19.0 vs 14.5 FP8; gate|up (448) 87.3 vs 84.3 bf16, 60.4 vs 52.1 FP8; lm_head 362
/// vs 366 bf16 (the one loss kept: the layers win more), 222 vs 199 FP8; FP8 down (256 blocks, k
/// 14,336) 33.2 vs 31.6 and o (256) 13.2 vs 12.2; but 128-block launches keep 16 (1B o 3.8 vs 4.4,
/// down 10.1 vs 13.2 bf16 and 8.7 vs 13.9 FP8), and so do long bf16 reductions (8B down 46.3 vs
/// 52.0). (Those 16-warp timings were of the unbound instance, one block an SM; one-tile bf16
/// launches of up to 264 blocks now take `skinny_gemm_8_b2` first, which beat the 8-warp blocks on
/// the H200 in session 13.)
pub fn skinny_w8_fits(m: usize, blocks: u32, k: usize, f8: bool) -> bool {
    W8Rule::default().fits(m, blocks, k, f8)
}

/// The skinny instance rule's thresholds: [`skinny_w8_fits`]'s fewest blocks and longest bf16
/// reduction, and the most blocks that take [`SKINNY_B2`] whatever their reduction
/// (`HARRIER_SKINNY_W8_MIN_BLOCKS` / `HARRIER_SKINNY_W8_MAX_K` /
/// `HARRIER_SKINNY_B2_MAX_BLOCKS` override them, to measure).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct W8Rule {
    min_blocks: u32,
    max_k: usize,
    /// Launches of at most this many blocks take [`SKINNY_B2`] whatever their reduction
    /// length ([`SKINNY_B2_MAX_BLOCKS`]; 0: only long reductions do).
    b2_max_blocks: u32,
    /// ... and of at least this many (`min_blocks` by default;
    /// `HARRIER_SKINNY_B2_MIN_BLOCKS` lowers it, to measure: 128 takes the 1B's o and down).
    b2_min_blocks: u32,
    /// Launches with reductions past `max_k` take [`SKINNY_B2`] from this many blocks
    /// (`min_blocks` by default; `HARRIER_SKINNY_B2_LONG_MIN_BLOCKS` lowers it, to measure:
    /// 128 takes the 1B's down only).
    b2_long_min_blocks: u32,
}

impl Default for W8Rule {
    fn default() -> W8Rule {
        W8Rule {
            min_blocks: SKINNY_W8_MIN_BLOCKS,
            max_k: SKINNY_W8_MAX_K,
            b2_max_blocks: SKINNY_B2_MAX_BLOCKS,
            b2_min_blocks: SKINNY_W8_MIN_BLOCKS,
            b2_long_min_blocks: SKINNY_W8_MIN_BLOCKS,
        }
    }
}

impl W8Rule {
    fn from_env() -> W8Rule {
        let d = W8Rule::default();
        W8Rule {
            min_blocks: env_number("HARRIER_SKINNY_W8_MIN_BLOCKS").unwrap_or(d.min_blocks),
            max_k: env_number("HARRIER_SKINNY_W8_MAX_K").unwrap_or(d.max_k),
            b2_max_blocks: env_number("HARRIER_SKINNY_B2_MAX_BLOCKS").unwrap_or(d.b2_max_blocks),
            b2_min_blocks: env_number("HARRIER_SKINNY_B2_MIN_BLOCKS").unwrap_or(d.b2_min_blocks),
            b2_long_min_blocks: env_number("HARRIER_SKINNY_B2_LONG_MIN_BLOCKS")
                .unwrap_or(d.b2_long_min_blocks),
        }
    }

    fn fits(self, m: usize, blocks: u32, k: usize, f8: bool) -> bool {
        m <= skinny_twins_max_m(f8) && blocks >= self.min_blocks && (f8 || k <= self.max_k)
    }

    /// Whether a launch takes [`SKINNY_B2`] (before the 8-warp instances, which then do not
    /// run it): one-tile bf16 launches of many blocks that fit one wave at two an SM or that
    /// the 8-warp rule turns away for their reduction length.
    fn two_blocks(self, m: usize, blocks: u32, k: usize, f8: bool, r4: bool) -> bool {
        !f8 && !r4
            && m <= skinny_twins_max_m(f8)
            && ((blocks >= self.b2_long_min_blocks && k > self.max_k)
                || (blocks >= self.b2_min_blocks && blocks <= self.b2_max_blocks))
    }
}

/// The reduction widths the FP8 instances (`skinny_gemm_f8_*`, 64-wide chunks) and
/// `dequant_fp8_rows` take.
pub fn fp8_supports_k(k: usize) -> bool {
    k.is_multiple_of(64) && k > 0
}

/// Warps of a `rope_kv_write` block (one warp per head; heads spread over gridDim.y).
const ROPE_WARPS: u32 = 4;

/// Capacity of a row's min_tokens mask on the device (longer masks sample on the host).
pub const MASK_CAP: usize = 16;

/// logit_bias entries a row keeps on the device (`BIAS_CAP` in the source; the API allows at
/// most this many).
pub const LOGIT_BIAS_CAP: usize = 1024;

/// Largest head dimension `paged_attention` supports.
pub const MAX_HEAD_DIM: usize = 256;

/// `paged_attention` instances compiled for one head dim (loops over it unrolled, registers
/// allocated for it); other head dims take the generic `paged_attention`.
const ATTN_HD_KERNELS: [(i32, &str); 3] = [
    (64, "paged_attention_hd64"),
    (128, "paged_attention_hd128"),
    (256, "paged_attention_hd256"),
];

/// The `paged_attention` instance for head dim `hd`.
fn attn_kernel(hd: i32) -> &'static str {
    ATTN_HD_KERNELS
        .iter()
        .find(|&&(d, _)| d == hd)
        .map_or("paged_attention", |&(_, k)| k)
}

/// Most splits a `paged_attention` launch takes (`COMBINE_MAX_SPLITS`: `attention_combine`
/// reads a split's sums a lane).
pub const ATTN_MAX_SPLITS: u32 = 32;

/// Split decode attention keeps a context of at most this many 32-key tiles in one block per
/// head (its 16 warps take a tile each) and skips the combine; longer ones split as before
/// (at most `n_splits`, at least 4 tiles each). Measured on the H100 (1B, batch 1, graphs,
/// ms per step, side by side): 512 keys 1.324 one split vs 1.407 four; at 2,048 keys four
/// splits of 16 tiles lost to eight of 8 (1.491 vs 1.469), so only short contexts stay whole.
pub const ATTN_ONE_SPLIT_TILES: i32 = 16;

/// Most warps of a `paged_attention` block (`ATT_WARPS_MAX` in harrier.cu); the kernel takes
/// its warp count from the launch (4, 8 or 16, see [`AttnWarps`]).
const ATT_WARPS_MAX: u32 = 16;

/// Warps of `paged_attention` blocks: `split` for launches cut into context splits (small decode
/// batches), `whole` for the others. Both 16 by default; `HARRIER_ATTN_WARPS_SPLIT` /
/// `HARRIER_ATTN_WARPS` override them (4, 8 or 16), to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct AttnWarps {
    split: u32,
    whole: u32,
}

impl AttnWarps {
    fn from_env() -> AttnWarps {
        let pick = |name| {
            env_number(name)
                .filter(|w: &u32| [4, 8, 16].contains(w))
                .unwrap_or(ATT_WARPS_MAX)
        };
        AttnWarps {
            split: pick("HARRIER_ATTN_WARPS_SPLIT"),
            whole: pick("HARRIER_ATTN_WARPS"),
        }
    }

    /// Threads of a launch with `n_splits` splits.
    fn threads(self, n_splits: u32) -> u32 {
        32 * if n_splits > 1 { self.split } else { self.whole }
    }
}

/// The trace buffer of a `-DHARRIER_TRACE` build, its record counter, and its capacity in
/// records (`TRACE_CAP`).
const TRACE_SYMBOL: &str = "harrier_trace";
const TRACE_COUNT_SYMBOL: &str = "harrier_trace_n";
const TRACE_CAP: usize = 262144;

/// One block's record in a `-DHARRIER_TRACE` build (thread 0's view; measurement only): its
/// launch (`%gridid`), the global timer before and after its PDL wait and at its exit, the
/// launch's block count and block size, its SM, and its cycles from before the wait to the exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceRecord {
    pub grid: u64,
    pub before_wait_ns: u64,
    pub after_wait_ns: u64,
    pub exit_ns: u64,
    pub blocks: u32,
    pub threads: u32,
    pub sm: u32,
    pub cycles: u64,
}

impl TraceRecord {
    /// A record as `TraceScope` (harrier.cu) writes it: grid id, the times before and after the
    /// wait and at the exit, the clock at the wait and at the exit, then blocks << 32 | block
    /// size << 16 | SM.
    fn from_raw(r: &[u64]) -> TraceRecord {
        TraceRecord {
            grid: r[0],
            before_wait_ns: r[1],
            after_wait_ns: r[2],
            exit_ns: r[3],
            blocks: (r[6] >> 32) as u32,
            threads: ((r[6] >> 16) & 0xffff) as u32,
            sm: (r[6] & 0xffff) as u32,
            cycles: r[5].wrapping_sub(r[4]),
        }
    }
}

/// Threads of an `add_rmsnorm` block (one block per row). 1,024 rather than 256: at batch 1
/// the kernel is one block whose dependent loads are the whole cost (8.8 us per call on the
/// H200 profile with 256).
const NORM_THREADS: u32 = 1024;

/// Device addresses of the per-row sampling state beyond [`RowParams`]: u16 output-token counts
/// `[rows, vocab]`, prompt-token bits `[rows, ceil(vocab / 32)]`, logit_bias ids and values
/// `[rows, LOGIT_BIAS_CAP]` (see `init_row_state` in the source).
#[derive(Debug, Clone, Copy)]
pub struct SamplerState {
    pub counts: u64,
    pub seen: u64,
    pub bias_ids: u64,
    pub bias_vals: u64,
    /// Partial maxima of the logits rows ([`Kernels::row_argmax_parts`], `[rows,
    /// ARGMAX_PARTS]` of (f32, i32)); 0: greedy rows scan their logits in one block.
    pub argmax_parts: u64,
}

impl SamplerState {
    /// The addresses in the order the sampling kernels take them (counts, seen, bias ids,
    /// bias values, partial maxima).
    pub fn ptrs(&self) -> [u64; 5] {
        [
            self.counts,
            self.seen,
            self.bias_ids,
            self.bias_vals,
            self.argmax_parts,
        ]
    }
}

/// Partial maxima per logits row (`ARGMAX_PARTS` in the source).
pub const ARGMAX_PARTS: usize = 32;

/// Threads of a `row_argmax_parts` block for `n_rows` logits rows when `resident` 1,024-thread
/// blocks of it fit the device at once: 1,024 while the launch's `ARGMAX_PARTS n_rows` blocks
/// are one wave (an H200's 132 SMs at two an SM: up to 8 rows; a 128k vocabulary's slice is
/// then 4 loads a thread, all in flight together; 256 threads, 16 loads in two rounds, took 4.2
/// us after a batch-1 step, 1.9 with 1,024, H200, session 42), else 256 (at 64 rows 1,024-thread
/// blocks, eight waves, made the step 0.9% slower). The outputs do not depend on it.
pub fn argmax_threads(n_rows: u32, resident: u32) -> u32 {
    if (ARGMAX_PARTS as u32).saturating_mul(n_rows) <= resident {
        1024
    } else {
        256
    }
}

/// The per-row device state of speculative decoding (see `spec_place` in the source):
/// `kv_len`, `prev_tok` and `pending` (`[rows]` i32), `proposals` (`[rows, k]` i32) and the
/// draft's distributions `q` (`[rows, k, vocab]` f32; 0: proposals are point masses).
#[derive(Debug, Clone, Copy)]
pub struct SpecRows {
    pub kv_len: u64,
    pub prev_tok: u64,
    pub pending: u64,
    pub proposals: u64,
    pub q: u64,
    pub k: i32,
    /// N-gram proposals: how many each row has (`[rows]` i32; 0: the host's counts) and the
    /// token histories `spec_verify` extends.
    pub prop_count: u64,
    pub hist: NgramHist,
}

/// The per-row token histories of n-gram proposals (see `ngram_propose` in the source):
/// `hist` (`[rows, stride]` i32; 0: none) and `start` (`[rows]` i32: the first known
/// position).
#[derive(Debug, Clone, Copy, Default)]
pub struct NgramHist {
    pub hist: u64,
    pub stride: i32,
    pub start: u64,
}

/// A step's per-token metadata sections that `spec_place` writes (and the rows it reads).
#[derive(Debug, Clone, Copy)]
pub struct TokenMeta {
    pub tok_src: u64,
    pub positions: u64,
    pub slots: u64,
    pub tok_row: u64,
}

/// The decode entries `spec_place` places: entry `e` owns tokens `first[e] ..` (`first` 0:
/// token `e`), `ntok[e]` of them (`ntok` 0: `n_const`), at offsets `off0 ..` from its row's
/// `kv_len`.
#[derive(Debug, Clone, Copy)]
pub struct PlaceEntries {
    pub first: u64,
    pub ntok: u64,
    pub n_const: i32,
    pub n: u32,
    pub off0: i32,
}

/// Per-row block tables: `[rows + 1, stride]` block ids.
#[derive(Debug, Clone, Copy)]
pub struct BlockTables {
    pub ptr: u64,
    pub stride: i32,
    pub block_size: i32,
}

/// The sampled sequences `spec_verify` takes: per sequence its row, first logits row and
/// proposal count; per logits row its token (whose position and id start the round).
#[derive(Debug, Clone, Copy)]
pub struct VerifySeqs {
    pub sample_rows: u64,
    pub samp_first: u64,
    pub samp_draft: u64,
    pub logit_rows: u64,
    pub tok_src: u64,
    pub positions: u64,
}

/// What every attention kernel reads and writes, whatever its plan; passed to the kernels by
/// value (mirrors `struct AttnIn` in the source): the output and query rows (q inside the fused
/// qkv rows, `q_stride` apart), one layer's paged K/V cache (`[slots, nkv, hd]` each), each
/// token's backend row and position, the per-row block tables, and the head geometry.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AttentionInputs {
    pub out: u64,
    pub q: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub tok_row: u64,
    pub positions: u64,
    pub block_tables: u64,
    pub q_stride: i32,
    pub bt_stride: i32,
    /// Query heads, KV heads, head dim, tokens per KV block.
    pub nh: i32,
    pub nkv: i32,
    pub hd: i32,
    pub block_size: i32,
    pub scale: f32,
    /// Sliding window in keys; 0: none.
    pub window: i32,
}

/// Per-row sampling state on the device; mirrors `struct RowParams` in the source.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RowParams {
    pub temperature: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub top_k: i32,
    pub seed_lo: u32,
    pub seed_hi: u32,
    pub generated: u32,
    pub min_tokens: u32,
    pub host_sampled: i32,
    pub penalties: i32,
    pub n_bias: i32,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub mask_len: i32,
    pub mask: [i32; MASK_CAP],
}

/// The `sm_XY` / `compute_XY` name NVRTC wants for a compute capability.
pub fn arch_name(major: i32, minor: i32) -> anyhow::Result<&'static str> {
    Ok(match (major, minor) {
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 7) => "sm_87",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        _ => bail!("compute capability {major}.{minor} is not supported (sm_80 or newer needed)"),
    })
}

/// Whether libnvrtc can be loaded (checked without panicking).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles [`SOURCE`] to PTX for `arch` (for example `"sm_90"`) and storage type `dtype`.
pub fn compile_ptx(arch: &'static str, dtype: Dtype) -> anyhow::Result<String> {
    compile_ptx_with(arch, dtype, &[])
}

/// As [`compile_ptx`] with extra NVRTC options (`-DNAME=VALUE` overrides of the source's
/// tunable defines).
pub fn compile_ptx_with(
    arch: &'static str,
    dtype: Dtype,
    extra: &[String],
) -> anyhow::Result<String> {
    if !nvrtc_present() {
        bail!("libnvrtc could not be loaded (put its folder on LD_LIBRARY_PATH)");
    }
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        fmad: Some(true),
        name: Some("harrier.cu".into()),
        options: match dtype {
            Dtype::Bf16 => vec!["--std=c++17".into()],
            Dtype::F32 => vec!["--std=c++17".into(), "-DHARRIER_F32".into()],
        }
        .into_iter()
        .chain(extra.iter().cloned())
        .collect(),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts)
        .map_err(|e| anyhow!("NVRTC failed for {arch} ({}): {e:?}", dtype.name()))?;
    Ok(ptx.to_src())
}

/// Where compiled PTX is cached: `$HARRIER_KERNEL_CACHE`, else `$HARRIER_HOME/kernel-cache`,
/// else `~/.cache/harrier/kernel-cache`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("HARRIER_KERNEL_CACHE") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HARRIER_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into()))
                .join(".cache")
                .join("harrier")
        });
    home.join("kernel-cache")
}

/// The cache file name for `arch` and `dtype`: a hash of the source, the architecture, the
/// storage type and the NVRTC version.
pub fn cache_key(arch: &str, dtype: Dtype) -> String {
    let (mut maj, mut min) = (0i32, 0i32);
    if nvrtc_present() {
        // SAFETY: the library is present; the out-pointers are valid.
        unsafe {
            let _ = cudarc::nvrtc::sys::nvrtcVersion(&mut maj, &mut min);
        }
    }
    let h = xxhash_rust::xxh64::xxh64(
        format!(
            "{SOURCE}\u{0}{arch}\u{0}{}\u{0}{maj}.{min}\u{0}v1",
            dtype.name()
        )
        .as_bytes(),
        0,
    );
    format!("harrier-{arch}-{h:016x}.ptx")
}

/// PTX for `arch`, from the disk cache or compiled (and then cached; a cache write failure is
/// only logged by the caller through the returned flag).
///
/// Measurement only: `HARRIER_KERNEL_DEFINES` (space-separated NVRTC options, e.g.
/// `-DSOME_EXPERIMENT`) compiles the source afresh with them, bypassing the cache, so that an
/// `#ifdef`-guarded variant of a kernel can be timed against the default in one device call.
pub fn ptx_for(arch: &'static str, dtype: Dtype) -> anyhow::Result<(String, bool)> {
    if let Some(defs) = std::env::var("HARRIER_KERNEL_DEFINES")
        .ok()
        .filter(|d| !d.trim().is_empty())
    {
        let extra: Vec<String> = defs.split_whitespace().map(str::to_string).collect();
        return Ok((compile_ptx_with(arch, dtype, &extra)?, false));
    }
    let path = cache_dir().join(cache_key(arch, dtype));
    if let Ok(s) = std::fs::read_to_string(&path) {
        if s.contains(".entry") {
            return Ok((s, true));
        }
    }
    let ptx = compile_ptx(arch, dtype)?;
    let _ = std::fs::create_dir_all(path.parent().unwrap_or(&path));
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, &ptx).is_ok() {
        let _ = std::fs::rename(&tmp, &path);
    }
    Ok((ptx, false))
}

/// Which build a module image (PTX text or cubin) is: the bf16 one names `gemv_bf16`, a kernel
/// the f32 build lacks ([`BF16_ONLY`]), in either form.
fn image_dtype(image: &[u8]) -> Dtype {
    let name = b"gemv_bf16";
    match image.windows(name.len()).any(|w| w == name) {
        true => Dtype::Bf16,
        false => Dtype::F32,
    }
}

/// A module image as `cuModuleLoadData` takes it: an ELF cubin as it is, PTX text with a NUL
/// appended (refused if it holds one: the driver would read a truncated module).
fn module_image(mut image: Vec<u8>) -> anyhow::Result<Vec<u8>> {
    if !image.starts_with(b"\x7fELF") {
        if image.contains(&0) {
            bail!("PTX contains a NUL byte");
        }
        image.push(0);
    }
    Ok(image)
}

/// A CUDA failure with the call that made it.
/// The launch attribute for clusters of `n` blocks along x.
fn cluster_attr(n: u32) -> sys::CUlaunchAttribute {
    // SAFETY: a zeroed attribute is a valid POD value; the union field set is the one the
    // attribute id names.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim.x = n;
    attr.value.clusterDim.y = 1;
    attr.value.clusterDim.z = 1;
    attr
}

fn ck<T>(r: Result<T, dr::DriverError>, what: &str) -> anyhow::Result<T> {
    r.map_err(|e| anyhow!("{what}: {e:?}"))
}

/// The loaded module and its functions. Must be used with its context current.
pub struct Kernels {
    module: sys::CUmodule,
    /// Every kernel by name ([`kernel_names`]); null for kernels this dtype's build lacks.
    /// A map, not a list searched by name: every eager launch looks its kernel up.
    f: std::collections::HashMap<&'static str, sys::CUfunction>,
    pub dtype: Dtype,
    /// Whether the PTX came from the disk cache.
    pub from_cache: bool,
    /// Warps of a `skinny_gemm_*` block (`SK_WARPS` as compiled; `_w8` instances: 8).
    skinny_warps: u32,
    /// `paged_attention` pulls its K/V rows into L2 before waiting on the previous kernel
    /// (`HARRIER_ATTN_PREFETCH=0`: off, to compare).
    attn_prefetch: bool,
    /// Per-token attention over at least this many rows takes `paged_attention_grp*`
    /// ([`Kernels::grp_serves`]; [`ATTN_GRP_MIN_TOKENS`], `HARRIER_ATTN_GRP_MIN_TOKENS`
    /// overrides it, to measure; `usize::MAX` in the f32 build, which has no such kernel).
    attn_grp_min_tokens: usize,
    /// Resident clusters of `paged_attention_grpc*` ([`GRP_CLUSTER_KERNELS`] order) a cluster
    /// size from 2 to [`GRP_CLUSTER_MAX_SPLITS`] (`cuOccupancyMaxActiveClusters`): a grp launch
    /// of 2-4 splits takes the cluster instance where its clusters all fit at once. Zeros in
    /// the f32 build and with `HARRIER_ATTN_GRP_CLUSTER=0` (to measure the split launch and
    /// its combine instead).
    grp_clusters: [[u32; GRP_CLUSTER_MAX_SPLITS as usize - 1]; 2],
    /// Blocks of the plain `paged_attention_grp*` instances ([`GRP_CLUSTER_KERNELS`] order) of
    /// each of [`GRP_WIDTHS`] resident on the device at once (occupancy an SM times the SMs;
    /// zeros in the f32 build): [`grp_warps`] picks a launch's width from them.
    grp_resident: [[u32; 3]; 2],
    /// 1,024-thread `row_argmax_parts` blocks resident on the device at once (occupancy an SM
    /// times the SMs): [`argmax_threads`]'s bound.
    argmax_resident: u32,
    /// `paged_attention` reads V a row per lane group (16-byte loads, a tile's loads
    /// independent) rather than a 4-byte slice a lane per key (`HARRIER_ATTN_VROWS=0`).
    attn_vrows: bool,
    /// Contexts of up to this many tiles run unsplit in split launches
    /// ([`ATTN_ONE_SPLIT_TILES`]; `HARRIER_ATTN_ONE_SPLIT_TILES` overrides it, 0: never).
    attn_one_split: i32,
    attn_warps: AttnWarps,
    /// Launches that [`skinny_w8_fits`] take the 8-warp instances (off in `load_with`'s
    /// builds, whose launch shape is under test, and with `HARRIER_SKINNY_W8=0`).
    skinny_w8: bool,
    /// The 8-warp choice's thresholds (from the environment at load).
    w8_rule: W8Rule,
    /// [`SKINNY_R4_FROM_TILES`] (`HARRIER_SKINNY_R4_FROM_TILES` overrides it, to measure).
    r4_from: usize,
    /// Launches that [`W8Rule::two_blocks`] picks take [`SKINNY_B2`] (off in `load_with`'s
    /// builds, with `HARRIER_SKINNY_B2=0` and with the 8-warp choice off).
    skinny_b2: bool,
    /// Resident clusters of two [`SKINNY_K2`] blocks (`cuOccupancyMaxActiveClusters` at load;
    /// 0: it never runs: before sm_90, off with the 8-warp or b2 choices, `HARRIER_SKINNY_K2=0`).
    skinny_k2_clusters: u32,
    /// [`SKINNY_K2_MIN_K`], or `HARRIER_SKINNY_K2_MIN_K`.
    skinny_k2_min_k: usize,
    /// Resident clusters of two [`SKINNY_K2_W8`] blocks (0: off, as `skinny_k2_clusters`, or
    /// with `HARRIER_SKINNY_K2_W8=0`).
    skinny_k2_w8_clusters: u32,
    /// Dynamic shared memory the skinny kernels were allowed at load.
    skinny_smem: usize,
    /// Launches carry the programmatic-stream-serialization attribute (programmatic dependent
    /// launch: see [`pdl_default`]).
    pdl: bool,
}

/// Whether kernels launch with programmatic dependent launch on `arch`: sm_90 and newer, unless
/// `HARRIER_PDL=0`. Each kernel then waits for the previous one in its stream itself
/// (`PDL_ENTER` in the source) and may be scheduled while that one finishes, which hides most
/// of the launch gap between the ~100 small kernels of a decode step; in a CUDA graph the
/// captured edges become programmatic. `HARRIER_PDL=0` is for side-by-side measurement.
pub fn pdl_default(arch: &str) -> bool {
    sm_version(arch).is_some_and(|v| v >= 90) && switch_on("HARRIER_PDL")
}

/// Whether `arch` runs thread-block clusters (sm_90 and newer): the `paged_attention_grpc*`
/// instances (the decode ring asks the device itself).
pub fn clusters_supported(arch: &str) -> bool {
    sm_version(arch).is_some_and(|v| v >= 90)
}

/// A comparison switch: on unless the environment sets `name` to `0` (the kernels' and the
/// model's `HARRIER_*` switches, which restore earlier code paths for side-by-side runs).
pub fn switch_on(name: &str) -> bool {
    std::env::var(name).map_or(true, |v| v != "0")
}

/// A number the environment sets to override a tuned default (`None`: unset or unparsable).
fn env_number<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok()?.parse().ok()
}

/// The compute capability `arch` (an [`arch_name`]) names as one number: `"sm_89"` -> 89.
pub fn sm_version(arch: &str) -> Option<u32> {
    arch.strip_prefix("sm_")?.parse().ok()
}

/// Blocks of 256 threads for a grid-stride loop over `items`: one item a thread up to the
/// grid's x limit (no items: no blocks, and the launch is skipped).
fn grid_stride_blocks(items: usize) -> u32 {
    items.div_ceil(256).min(65_535) as u32
}

// SAFETY: CUDA module and function handles are plain handles usable from any thread that has
// the owning context current; `Kernels` has no interior mutability.
unsafe impl Send for Kernels {}

impl Drop for Kernels {
    fn drop(&mut self) {
        // SAFETY: the module was loaded by `load` and is unloaded once.
        unsafe {
            let _ = dr::module::unload(self.module);
        }
    }
}

/// One launch's parameter list: pointers to each argument value, kept alive by the caller.
macro_rules! params {
    ($($a:expr),* $(,)?) => { [$( (&$a) as *const _ as *mut c_void ),*] };
}

impl Kernels {
    /// Compiles (or reads from the cache) and loads every kernel for `arch` and `dtype` into
    /// the current context.
    ///
    /// Measurement only: `HARRIER_KERNEL_IMAGE` names a PTX or cubin file of [`SOURCE`] built
    /// beforehand (for `arch`, any `-D` variant: NVRTC and `ptxas` run on a machine without a
    /// GPU), loaded instead of compiling, so that a device call spends no minute of NVRTC a
    /// variant. It holds one dtype's build; the other dtype's kernels (check-fused's f32
    /// reference beside a bf16 image) compile as without it.
    pub fn load(arch: &'static str, dtype: Dtype) -> anyhow::Result<Kernels> {
        let image = match std::env::var_os("HARRIER_KERNEL_IMAGE") {
            Some(path) => {
                let path = path.to_string_lossy();
                let bytes = std::fs::read(&*path)
                    .with_context(|| format!("HARRIER_KERNEL_IMAGE {path}"))?;
                let built = image_dtype(&bytes);
                if built == dtype {
                    Some(bytes)
                } else {
                    tracing::info!(
                        image = %path,
                        "HARRIER_KERNEL_IMAGE holds the {} build; compiling the {} kernels",
                        built.name(),
                        dtype.name()
                    );
                    None
                }
            }
            None => None,
        };
        let (image, from_cache) = match image {
            Some(bytes) => (bytes, false),
            None => {
                let (ptx, from_cache) = ptx_for(arch, dtype)?;
                (ptx.into_bytes(), from_cache)
            }
        };
        let w8 = switch_on("HARRIER_SKINNY_W8");
        Self::load_image(
            image,
            dtype,
            from_cache,
            SKINNY_WARPS,
            w8,
            pdl_default(arch),
            clusters_supported(arch),
        )
    }

    /// A build with the skinny GEMM's launch shape overridden (`SK_WARPS` warps per block,
    /// `SK_LOADS` weight loads in flight per warp, the `_f8` instances' alike; tools compare
    /// them), compiled afresh, without the `_w8` choice (every launch takes that shape).
    pub fn load_with(
        arch: &'static str,
        dtype: Dtype,
        skinny_warps: u32,
        skinny_loads: u32,
    ) -> anyhow::Result<Kernels> {
        if !(1..=16).contains(&skinny_warps) || !skinny_warps.is_power_of_two() {
            bail!("SK_WARPS must be a power of two up to 16, not {skinny_warps}");
        }
        let ptx = compile_ptx_with(
            arch,
            dtype,
            &[
                format!("-DSK_WARPS={skinny_warps}"),
                format!("-DSK_LOADS={skinny_loads}"),
            ],
        )?;
        Self::load_image(
            ptx.into_bytes(),
            dtype,
            false,
            skinny_warps,
            false,
            pdl_default(arch),
            clusters_supported(arch),
        )
    }

    /// Loads a module image: PTX text (NUL-terminated here) or an ELF cubin.
    fn load_image(
        image: Vec<u8>,
        dtype: Dtype,
        from_cache: bool,
        skinny_warps: u32,
        skinny_w8: bool,
        pdl: bool,
        clusters: bool,
    ) -> anyhow::Result<Kernels> {
        let image = module_image(image)?;
        // SAFETY: `image` is a NUL-terminated PTX text or a cubin; a context is current (the
        // caller's contract).
        let module = ck(
            unsafe { dr::module::load_data(image.as_ptr() as *const c_void) },
            "cuModuleLoadData",
        )?;
        let mut k = Kernels {
            module,
            f: Default::default(),
            dtype,
            from_cache,
            skinny_warps,
            skinny_w8,
            attn_prefetch: switch_on("HARRIER_ATTN_PREFETCH"),
            attn_vrows: switch_on("HARRIER_ATTN_VROWS"),
            attn_grp_min_tokens: match dtype {
                Dtype::Bf16 => {
                    env_number("HARRIER_ATTN_GRP_MIN_TOKENS").unwrap_or(ATTN_GRP_MIN_TOKENS)
                }
                Dtype::F32 => usize::MAX,
            },
            grp_clusters: Default::default(),
            grp_resident: Default::default(),
            argmax_resident: 0,
            attn_one_split: env_number("HARRIER_ATTN_ONE_SPLIT_TILES")
                .filter(|n| (0..=1024).contains(n))
                .unwrap_or(ATTN_ONE_SPLIT_TILES),
            attn_warps: AttnWarps::from_env(),
            skinny_smem: SKINNY_SMEM_MAX,
            w8_rule: W8Rule::from_env(),
            skinny_b2: skinny_w8 && switch_on("HARRIER_SKINNY_B2"),
            skinny_k2_clusters: 0,
            skinny_k2_w8_clusters: 0,
            skinny_k2_min_k: env_number("HARRIER_SKINNY_K2_MIN_K").unwrap_or(SKINNY_K2_MIN_K),
            r4_from: env_number("HARRIER_SKINNY_R4_FROM_TILES").unwrap_or(SKINNY_R4_FROM_TILES),
            pdl,
        };
        for name in kernel_names() {
            if !dtype.has_kernel(name) {
                k.f.insert(name, std::ptr::null_mut());
                continue;
            }
            let n = std::ffi::CString::new(name).expect("kernel names have no NUL");
            // SAFETY: `module` is loaded; `n` is NUL-terminated.
            let f = ck(unsafe { dr::module::get_function(module, n) }, name)?;
            if name.starts_with("skinny_gemm") && k.skinny_smem > SKINNY_SMEM_FALLBACK {
                // SAFETY: `f` is a loaded function; the attribute only raises its own limit.
                let raised = unsafe {
                    dr::function::set_function_attribute(
                        f,
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        SKINNY_SMEM_MAX as i32,
                    )
                };
                if raised.is_err() {
                    k.skinny_smem = SKINNY_SMEM_FALLBACK;
                }
            }
            k.f.insert(name, f);
        }
        if clusters && dtype == Dtype::Bf16 && k.skinny_b2 && switch_on("HARRIER_SKINNY_K2") {
            k.skinny_k2_clusters = k.skinny_pairs(SKINNY_K2, k.skinny_warps)?;
            if switch_on("HARRIER_SKINNY_K2_W8") {
                k.skinny_k2_w8_clusters = k.skinny_pairs(SKINNY_K2_W8, 8)?;
            }
        }
        if dtype == Dtype::Bf16 {
            k.grp_resident = k.grp_resident_blocks()?;
        }
        k.argmax_resident = k.resident_blocks("row_argmax_parts", 1024)?;
        if clusters && dtype == Dtype::Bf16 && switch_on("HARRIER_ATTN_GRP_CLUSTER") {
            for (i, (_, name)) in GRP_CLUSTER_KERNELS.iter().enumerate() {
                for size in 2..=GRP_CLUSTER_MAX_SPLITS {
                    k.grp_clusters[i][size as usize - 2] =
                        k.max_active_clusters(name, GRP_THREADS, size)?;
                }
            }
        }
        Ok(k)
    }

    /// Clusters of `size` blocks (along x, `threads` each, static shared memory only) of
    /// kernel `name` that can be resident at once (`cuOccupancyMaxActiveClusters`).
    fn max_active_clusters(&self, name: &str, threads: u32, size: u32) -> anyhow::Result<u32> {
        let mut attr = cluster_attr(size);
        let cfg = sys::CUlaunchConfig {
            gridDimX: size,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: std::ptr::null_mut(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let mut n = 0i32;
        // SAFETY: `cfg` and `attr` outlive the call; a loaded function.
        let got =
            unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, self.func(name), &cfg).result() };
        ck(got, name)?;
        Ok(n.max(0) as u32)
    }

    /// Resident clusters of two blocks (`warps` each) of a split-K skinny instance pair (8 and
    /// 16 rows), counted for both and their deferred-norm twins alike (the fewest).
    fn skinny_pairs(&self, names: [&str; 2], warps: u32) -> anyhow::Result<u32> {
        let mut n = u32::MAX;
        for name in names {
            let dn =
                skinny_dn_instance(name).expect("the split-K instances have deferred-norm twins");
            n = n.min(self.max_active_clusters(name, warps * 32, 2)?);
            n = n.min(self.max_active_clusters(dn, warps * 32, 2)?);
        }
        Ok(n)
    }

    /// [`Kernels::grp_resident`]: for each plain grp instance and width, its resident blocks.
    fn grp_resident_blocks(&self) -> anyhow::Result<[[u32; 3]; 2]> {
        let mut out = [[0u32; 3]; 2];
        for (i, (name, _)) in GRP_CLUSTER_KERNELS.iter().enumerate() {
            for (j, &w) in GRP_WIDTHS.iter().enumerate() {
                out[i][j] = self.resident_blocks(name, w * 32)?;
            }
        }
        Ok(out)
    }

    /// Blocks of `threads` threads (no dynamic shared memory) of kernel `name` resident on the
    /// current device at once: the blocks an SM holds
    /// (`cuOccupancyMaxActiveBlocksPerMultiprocessor`) times its SMs.
    fn resident_blocks(&self, name: &str, threads: u32) -> anyhow::Result<u32> {
        let mut dev: sys::CUdevice = 0;
        let (mut sms, mut per_sm) = (0i32, 0i32);
        // SAFETY: out-pointers to locals; the kernels were loaded in the current context, and
        // `func` gives a loaded function.
        unsafe {
            ck(sys::cuCtxGetDevice(&mut dev).result(), "cuCtxGetDevice")?;
            let a = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
            ck(
                sys::cuDeviceGetAttribute(&mut sms, a, dev).result(),
                "SM count",
            )?;
            let got = sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut per_sm,
                self.func(name),
                threads as i32,
                0,
            );
            ck(got.result(), name)?;
        }
        Ok((per_sm.max(0) as u32).saturating_mul(sms.max(0) as u32))
    }

    /// The `paged_attention_grpc*` twin of grp instance `grp` and how many of its clusters of
    /// `n_splits` blocks are resident at once; none outside 2 to [`GRP_CLUSTER_MAX_SPLITS`].
    fn grp_cluster_twin(&self, grp: &str, n_splits: u32) -> Option<(&'static str, u32)> {
        if !(2..=GRP_CLUSTER_MAX_SPLITS).contains(&n_splits) {
            return None;
        }
        let i = grp_kernel_index(grp)?;
        Some((
            GRP_CLUSTER_KERNELS[i].1,
            self.grp_clusters[i][n_splits as usize - 2],
        ))
    }

    fn func(&self, name: &str) -> sys::CUfunction {
        *self.f.get(name).expect("known kernel")
    }

    /// # Safety
    /// Every pointer in `params` must point to a live argument of the kernel's parameter type,
    /// and device addresses among them must be valid for the accesses the kernel makes.
    unsafe fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        stream: sys::CUstream,
        params: &mut [*mut c_void],
    ) -> anyhow::Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.launch_smem(name, grid, block, 0, stream, params, 1) }
    }

    /// Whether launches use programmatic dependent launch ([`pdl_default`]).
    pub fn pdl(&self) -> bool {
        self.pdl
    }

    /// Launches kernel `name` with `smem` bytes of dynamic shared memory (an empty grid
    /// launches nothing), in clusters of `cluster` blocks along x (1: none), with programmatic
    /// dependent launch when [`Kernels::pdl`].
    ///
    /// # Safety
    /// As [`Kernels::launch`]; `smem` within what the kernel was allowed; `grid.0` a multiple
    /// of `cluster`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_smem(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        stream: sys::CUstream,
        params: &mut [*mut c_void],
        cluster: u32,
    ) -> anyhow::Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        if !self.dtype.has_kernel(name) {
            bail!("{name} does not exist in the {} build", self.dtype.name());
        }
        let f = self.func(name);
        if !self.pdl && cluster == 1 {
            // SAFETY: forwarded from the caller.
            return ck(
                unsafe { dr::launch_kernel(f, grid, (block, 1, 1), smem, stream, params) },
                name,
            );
        }
        // SAFETY: a zeroed attribute is a valid POD value; the union field set is the one the
        // attribute id names.
        let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n_attrs = 0;
        if self.pdl {
            attrs[n_attrs].id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n_attrs].value.programmaticStreamSerializationAllowed = 1;
            n_attrs += 1;
        }
        if cluster > 1 {
            attrs[n_attrs] = cluster_attr(cluster);
            n_attrs += 1;
        }
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: stream,
            attrs: attrs.as_mut_ptr(),
            numAttrs: n_attrs as u32,
        };
        // SAFETY: `cfg` and `attrs` outlive the call; the parameters are forwarded from the
        // caller.
        ck(
            unsafe {
                sys::cuLaunchKernelEx(&cfg, f, params.as_mut_ptr(), std::ptr::null_mut()).result()
            },
            name,
        )
    }

    /// `out[t] = table[token(t)] * scale`, `t < n` (scale 1: a copy). With `norm`, also
    /// layer 0's input RMSNorm of the rows, the same bits as an [`Kernels::add_rmsnorm`]
    /// launch without a delta after it (one launch a step fewer).
    ///
    /// # Safety
    /// Device addresses must be valid for `n` tokens of `hidden` bf16 values.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn embed_tokens(
        &self,
        s: sys::CUstream,
        out: u64,
        table: u64,
        tok_src: u64,
        pending: u64,
        n: u32,
        hidden: i32,
        vocab: i32,
        scale: f32,
        norm: Option<EmbedNorm>,
    ) -> anyhow::Result<()> {
        let (h, norm_w, eps, w_off) = match norm {
            Some(EmbedNorm { out, w, eps, w_off }) => {
                if w == 0 {
                    bail!("embed_tokens: a norm without weights");
                }
                (out, w, eps, w_off)
            }
            None => (0, 0, 0.0, 0.0),
        };
        let mut p =
            params![out, table, tok_src, pending, hidden, vocab, scale, h, norm_w, eps, w_off];
        // add_rmsnorm's block size, with a norm or without: its loop and block sum, so its bits
        // (a plain copy's bits do not depend on it), and a row of up to 2,048 one round of loads
        // a thread (`EMBED_ROUND` in the source).
        // SAFETY: argument types match the kernel's.
        unsafe { self.launch("embed_tokens", (n, 1, 1), NORM_THREADS, s, &mut p) }
    }

    /// Residual add (when `delta != 0`; the delta RMSNormed by `delta_w` first when that is
    /// not 0) and RMSNorm of `n` rows (selected by `rows` when not 0). Norm weights scale by
    /// `w_off + w` in fp32 when `w_off` is not 0 (Gemma: 1), else as Llama's.
    ///
    /// # Safety
    /// Device addresses must be valid for the rows touched.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn add_rmsnorm(
        &self,
        s: sys::CUstream,
        resid: u64,
        (delta, delta_w): (u64, u64),
        w: u64,
        out: u64,
        rows: u64,
        n: u32,
        hidden: i32,
        (eps, w_off): (f32, f32),
    ) -> anyhow::Result<()> {
        let mut p = params![resid, delta, delta_w, w, out, rows, hidden, eps, w_off];
        // SAFETY: argument types match the kernel's.
        unsafe { self.launch("add_rmsnorm", (n, 1, 1), NORM_THREADS, s, &mut p) }
    }

    /// Q/K norm (when the norm weights are not 0), RoPE and the KV cache write for `n` tokens;
    /// `paired`: the q and k rows are in the paired order (see [`SkinnyRope`]).
    ///
    /// # Safety
    /// Device addresses must be valid; slot_mapping entries must lie inside the cache.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rope_kv_write(
        &self,
        s: sys::CUstream,
        qkv: u64,
        qkv_stride: i32,
        nh: i32,
        nkv: i32,
        hd: i32,
        positions: u64,
        inv_freq: u64,
        q_norm: u64,
        k_norm: u64,
        (eps, w_off): (f32, f32),
        slot_mapping: u64,
        k_cache: u64,
        v_cache: u64,
        paired: bool,
        n: u32,
    ) -> anyhow::Result<()> {
        let paired = paired as i32;
        let mut p = params![
            qkv,
            qkv_stride,
            nh,
            nkv,
            hd,
            positions,
            inv_freq,
            q_norm,
            k_norm,
            eps,
            w_off,
            slot_mapping,
            k_cache,
            v_cache,
            paired
        ];
        // SAFETY: argument types match the kernel's.
        let heads = (nh + 2 * nkv).max(1) as u32;
        // SAFETY: argument types match the kernel's.
        unsafe {
            self.launch(
                "rope_kv_write",
                (n, heads.div_ceil(ROPE_WARPS), 1),
                ROPE_WARPS * 32,
                s,
                &mut p,
            )
        }
    }

    /// `out = act(gate) * up` over `rows` rows of `[gate | up]`: SiLU, or with `gelu` the tanh
    /// approximation of GELU (`gelu_tanh_mul`).
    ///
    /// # Safety
    /// Device addresses must be valid for `rows * inter` outputs.
    pub unsafe fn gated_act(
        &self,
        s: sys::CUstream,
        (out, gu): (u64, u64),
        inter: i32,
        rows: u32,
        gelu: bool,
    ) -> anyhow::Result<()> {
        let total = rows as i64 * inter as i64;
        let blocks = grid_stride_blocks(total.max(0) as usize);
        let mut p = params![out, gu, inter, total];
        // SAFETY: argument types match the kernel's.
        unsafe {
            self.launch(
                if gelu { "gelu_tanh_mul" } else { "silu_mul" },
                (if total == 0 { 0 } else { blocks }, 1, 1),
                256,
                s,
                &mut p,
            )
        }
    }

    /// Paged causal attention for `n` tokens (`tok_list[i]`, or token i when `tok_list` is 0),
    /// each token's context cut into up to `n_splits` splits (of at least 4 tiles of 32 keys),
    /// merged by `attention_combine` when `n_splits > 1` (partials in `part`:
    /// `n * nh * n_splits * (hd + 2)` floats; unused with one split; a token list needs one
    /// split). `combine: false` leaves that launch out: the caller knows that every token's
    /// context fits one split ([`Kernels::attn_one_split_keys`]), so each writes its output
    /// directly and the combine would be a no-op (see `DecodeGraph` short-context graphs).
    /// The per-head kernel; [`Kernels::paged_attention_grouped`] computes the same with a KV
    /// head's query heads in one block ([`Kernels::grp_serves`] says where the engine takes it).
    ///
    /// # Safety
    /// Device addresses must be valid; block tables must name blocks inside the cache.
    pub unsafe fn paged_attention(
        &self,
        s: sys::CUstream,
        a: &AttentionInputs,
        part: u64,
        splits: (u32, bool),
        tok_list: u64,
        n: u32,
    ) -> anyhow::Result<()> {
        // SAFETY: the caller's guarantees.
        unsafe { self.attention_launch(s, a, part, splits, tok_list, n, None) }
    }

    /// Whether per-token attention over `n` rows (a step's padded count, as its graph has it,
    /// or the tokens a step's prefill tiles leave) should take
    /// [`Kernels::paged_attention_grouped`] for these heads: from [`ATTN_GRP_MIN_TOKENS`] rows,
    /// in the bf16 build.
    pub fn grp_serves(&self, nh: usize, nkv: usize, hd: usize, n: usize) -> bool {
        grp_attention_supports(nh, nkv, hd) && n >= self.attn_grp_min_tokens
    }

    /// Warps a block of a [`Kernels::paged_attention_grouped`] launch of `rows` tokens for
    /// these heads: 16 where it `split`s the context (its splits aim at one wave of 16-warp
    /// blocks, the cluster instances' width), else [`grp_warps`] over its (token, KV head)
    /// blocks. The engine asks with a step's padded rows, as its graph has them, so that an
    /// eager step and its graph's replay add the warps' sums in the same order.
    pub fn grp_launch_warps(
        &self,
        nh: usize,
        nkv: usize,
        hd: usize,
        rows: usize,
        split: bool,
    ) -> u32 {
        let i = grp_attention_kernel(nh as i32, nkv as i32, hd as i32).and_then(grp_kernel_index);
        match (split, i) {
            (false, Some(i)) => {
                let blocks = rows.saturating_mul(nkv).min(u32::MAX as usize) as u32;
                grp_warps(blocks, self.grp_resident[i])
            }
            _ => GRP_WIDTHS[0],
        }
    }

    /// [`Kernels::paged_attention`] through `paged_attention_grp*`: the same outputs and split
    /// partials, each KV head's K/V rows read once for its query heads; an error where it has
    /// no instance for the heads or in the f32 build. `how` (see [`GrpLaunch`]): a token list
    /// (one split), the cluster instances ([`Kernels::grp_cluster_tokens`]; without, always
    /// the combine: check-attention compares the two) and the plain blocks' width.
    ///
    /// # Safety
    /// As [`Kernels::paged_attention`].
    pub unsafe fn paged_attention_grouped(
        &self,
        s: sys::CUstream,
        a: &AttentionInputs,
        part: u64,
        splits: (u32, bool),
        n: u32,
        how: GrpLaunch,
    ) -> anyhow::Result<()> {
        let kernel = grp_attention_kernel(a.nh, a.nkv, a.hd)
            .filter(|_| self.dtype == Dtype::Bf16)
            .with_context(|| {
                format!(
                    "paged_attention_grp: no {} instance for {} heads over {} KV heads, head dim {}",
                    self.dtype.name(),
                    a.nh,
                    a.nkv,
                    a.hd
                )
            })?;
        if how.warps != 0 && !GRP_WIDTHS.contains(&how.warps) {
            bail!(
                "paged_attention_grp: {} warps a block (one of {GRP_WIDTHS:?})",
                how.warps
            );
        }
        // SAFETY: the caller's guarantees.
        unsafe { self.attention_launch(s, a, part, splits, how.tok_list, n, Some((kernel, how))) }
    }

    /// Tokens a [`Kernels::paged_attention_grouped`] launch of `n_splits` splits can take with
    /// its splits merged in clusters (`paged_attention_grpc*`, every cluster resident at
    /// once); 0 where it has no cluster instance for the heads or the split count.
    pub fn grp_cluster_tokens(&self, nh: usize, nkv: usize, hd: usize, n_splits: u32) -> u32 {
        grp_attention_kernel(nh as i32, nkv as i32, hd as i32)
            .and_then(|grp| self.grp_cluster_twin(grp, n_splits))
            .map_or(0, |(_, clusters)| {
                (clusters / nkv as u32).min(u16::MAX as u32)
            })
    }

    /// Splits for a grp launch of `tokens` rows that aims at `splits`: the most from 2 to
    /// `splits` whose clusters all fit at once ([`Kernels::grp_cluster_tokens`]), so that the
    /// launch merges them in its clusters instead of an `attention_combine` launch; `splits`
    /// where none fits (or it is below 2, or past [`GRP_CLUSTER_MAX_SPLITS`] with none of
    /// 2-4 fitting). On an H200 a launch holds 8 tokens in pairs, 4 in threes, 3 in fours at 8
    /// KV heads, so batch 4's four splits become three.
    pub fn grp_cluster_splits(
        &self,
        nh: usize,
        nkv: usize,
        hd: usize,
        tokens: u32,
        splits: u32,
    ) -> u32 {
        cluster_splits(tokens, splits, |s| self.grp_cluster_tokens(nh, nkv, hd, s))
    }

    /// The per-token attention launch and its combine (see [`Kernels::paged_attention`]): the
    /// per-head kernel, or `grp`, a `paged_attention_grp*` instance and its launch's shape.
    #[allow(clippy::too_many_arguments)]
    unsafe fn attention_launch(
        &self,
        s: sys::CUstream,
        a: &AttentionInputs,
        part: u64,
        (n_splits, combine): (u32, bool),
        tok_list: u64,
        n: u32,
        grp: Option<(&'static str, GrpLaunch)>,
    ) -> anyhow::Result<()> {
        let (nh, nkv, hd) = (a.nh, a.nkv, a.hd);
        if nkv <= 0
            || nh % nkv != 0
            || !(8..=MAX_HEAD_DIM as i32).contains(&hd)
            || hd % 8 != 0
            || n_splits == 0
            || n_splits > ATTN_MAX_SPLITS
            || (tok_list != 0 && n_splits > 1)
        {
            bail!(
                "paged_attention: {nh} heads over {nkv} KV heads, head dim {hd} (a multiple of 8 \
                 up to 256), {n_splits} splits, list {tok_list:#x}"
            );
        }
        let ns = n_splits as i32;
        let prefetch = self.attn_prefetch as i32;
        let one_split = self.attn_one_split;
        let vrows = self.attn_vrows as i32;
        // SAFETY: argument types match the kernels'.
        unsafe {
            match grp {
                Some((kernel, how)) => {
                    let mut p = params![*a, part, ns, one_split, tok_list];
                    // Every cluster resident at once (and the tokens within the grid's y).
                    let cl = self.grp_cluster_twin(kernel, n_splits).filter(|&(_, c)| {
                        how.clusters && n <= u16::MAX as u32 && n as u64 * nkv as u64 <= c as u64
                    });
                    if let Some((cl, _)) = cl {
                        // The splits merged in their cluster: no partials, no combine.
                        let grid = (n_splits, n, nkv as u32);
                        return self.launch_smem(cl, grid, GRP_THREADS, 0, s, &mut p, n_splits);
                    }
                    let warps = match how.warps {
                        0 => self.grp_launch_warps(
                            nh as usize,
                            nkv as usize,
                            hd as usize,
                            n as usize,
                            n_splits > 1,
                        ),
                        w => w,
                    };
                    let grid = (n, nkv as u32, n_splits);
                    self.launch(kernel, grid, warps * 32, s, &mut p)?;
                }
                None => {
                    let mut p = params![*a, part, ns, tok_list, prefetch, one_split, vrows];
                    self.launch(
                        attn_kernel(hd),
                        (n, nh as u32, n_splits),
                        self.attn_warps.threads(n_splits),
                        s,
                        &mut p,
                    )?;
                }
            }
            if n_splits > 1 && combine {
                let mut p = params![a.out, part, ns, nh, hd];
                self.launch(
                    "attention_combine",
                    (n, nh as u32, 1),
                    // A thread a dim, warp 0 whole (it reads the splits' sums).
                    (hd as u32).next_multiple_of(32),
                    s,
                    &mut p,
                )?;
            }
        }
        Ok(())
    }

    /// Decode attention with each KV head's query heads together (K/V read once per group),
    /// for `n` tokens (`tok_list[i]`, or token i when `tok_list` is 0); same cache and output
    /// layout as [`Kernels::paged_attention`], one split.
    ///
    /// # Safety
    /// Device addresses must be valid; block tables must name blocks inside the cache.
    pub unsafe fn paged_attention_gqa(
        &self,
        s: sys::CUstream,
        a: &AttentionInputs,
        tok_list: u64,
        n: u32,
    ) -> anyhow::Result<()> {
        let (nh, nkv, hd) = (a.nh, a.nkv, a.hd);
        if !gqa_attention_supports(nh as usize, nkv as usize, hd as usize) {
            bail!("paged_attention_gqa: {nh} heads over {nkv} KV heads, head dim {hd}");
        }
        let mut p = params![*a, tok_list];
        let threads = if n * nkv as u32 >= GQA_SMALL_BLOCKS_FROM {
            GQA_THREADS / 2
        } else {
            GQA_THREADS
        };
        // SAFETY: argument types match the kernel's.
        unsafe {
            self.launch(
                "paged_attention_gqa",
                (n, nkv as u32, 1),
                threads,
                s,
                &mut p,
            )
        }
    }

    /// Tiled causal attention for `n_tiles` prefill tiles (`tiles`: `[n_tiles][2]` first token,
    /// count; a tile's tokens are consecutive tokens of one sequence at consecutive positions,
    /// at most [`PREFILL_TILE`]), same cache and output layout as [`Kernels::paged_attention`].
    /// bf16 only; head dims 64 and 128.
    ///
    /// # Safety
    /// Device addresses must be valid; block tables must name blocks inside the cache.
    pub unsafe fn prefill_attention(
        &self,
        s: sys::CUstream,
        a: &AttentionInputs,
        tiles: u64,
        n_tiles: u32,
    ) -> anyhow::Result<()> {
        let (nh, nkv, hd) = (a.nh, a.nkv, a.hd);
        if nkv <= 0 || nh % nkv != 0 || !prefill_attention_supports(hd as usize) {
            bail!("prefill_attention: {nh} heads over {nkv} KV heads, head dim {hd}");
        }
        let mut p = params![*a, tiles];
        // SAFETY: argument types match the kernel's.
        unsafe {
            self.launch(
                "prefill_attention",
                (n_tiles, nh as u32, 1),
                PREFILL_THREADS,
                s,
                &mut p,
            )
        }
    }

    /// `rows[init_rows[i]] = inits[i]`, `i < n`.
    ///
    /// # Safety
    /// Device addresses must be valid.
    pub unsafe fn apply_row_inits(
        &self,
        s: sys::CUstream,
        rows: u64,
        inits: u64,
        init_rows: u64,
        n: i32,
    ) -> anyhow::Result<()> {
        let mut p = params![rows, inits, init_rows, n];
        // SAFETY: argument types match the kernel's.
        unsafe {
            self.launch(
                "apply_row_inits",
                ((n as u32).div_ceil(128), 1, 1),
                128,
                s,
                &mut p,
            )
        }
    }

    /// Samples `n` tokens from `logits` (modified), into `out_tokens` and the rows' pending
    /// slots; rows with logit_bias or penalties read `state` (and bump their counts).
    ///
    /// # Safety
    /// Device addresses must be valid.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn sample_tokens(
        &self,
        s: sys::CUstream,
        logits: u64,
        vocab: i32,
        sample_rows: u64,
        rows: u64,
        out_tokens: u64,
        pending: u64,
        state: SamplerState,
        n: u32,
    ) -> anyhow::Result<()> {
        let st = state.ptrs();
        let mut p = params![
            logits,
            vocab,
            sample_rows,
            rows,
            out_tokens,
            pending,
            st[0],
            st[1],
            st[2],
            st[3],
            st[4]
        ];
        // SAFETY: argument types match the kernel's.
        unsafe { self.launch("sample_tokens", (n, 1, 1), 1024, s, &mut p) }
    }

    /// The partial maxima of `n_rows` logits rows into `parts` (`[n_rows, ARGMAX_PARTS]`):
    /// the sampling kernels' greedy rows combine them instead of scanning a row in one block.
    ///
    /// # Safety
    /// Device addresses must be valid; `parts` holds `n_rows * ARGMAX_PARTS` entries.
    pub unsafe fn row_argmax_parts(
        &self,
        s: sys::CUstream,
        logits: u64,
        vocab: i32,
        parts: u64,
        n_rows: u32,
    ) -> anyhow::Result<()> {
        let mut p = params![logits, vocab, parts];
        // SAFETY: argument types match the kernel's.
        unsafe {
            self.launch(
                "row_argmax_parts",
                (n_rows, ARGMAX_PARTS as u32, 1),
                argmax_threads(n_rows, self.argmax_resident),
                s,
                &mut p,
            )
        }
    }

    /// Places `at.n` decode entries at their rows' true lengths (speculative decoding; see
    /// `spec_place` in the source): positions, KV slots and token ids of their tokens in
    /// `meta`, from the rows' `kv_len`, `prev_tok`, `pending` and proposals.
    ///
    /// # Safety
    /// Device addresses must be valid; every entry's tokens inside `meta`'s sections.
    pub unsafe fn spec_place(
        &self,
        s: sys::CUstream,
        meta: TokenMeta,
        at: PlaceEntries,
        spec: SpecRows,
        bt: BlockTables,
    ) -> anyhow::Result<()> {
        let TokenMeta {
            tok_src,
            positions,
            slots,
            tok_row,
        } = meta;
        let PlaceEntries {
            first,
            ntok,
            n_const,
            n,
            off0,
        } = at;
        let SpecRows {
            kv_len,
            prev_tok,
            pending,
            proposals,
            k,
            ..
        } = spec;
        let BlockTables {
            ptr,
            stride,
            block_size,
        } = bt;
        let n_entries = n as i32;
        let mut p = params![
            tok_src, positions, slots, tok_row, first, ntok, n_const, n_entries, off0, kv_len,
            prev_tok, pending, proposals, k, ptr, stride, block_size
        ];
        // SAFETY: argument types match the kernel's.
        unsafe { self.launch("spec_place", (n.div_ceil(128), 1, 1), 128, s, &mut p) }
    }

    /// Draws proposal `i` of `n` speculating rows `spec_rows[b]` from the draft's logits rows
    /// `b` (modified): the rows' processing, greedy or a draw whose distribution goes to
    /// `spec.q`.
    ///
    /// # Safety
    /// Device addresses must be valid; `i < spec.k`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn draft_sample(
        &self,
        s: sys::CUstream,
        logits: u64,
        vocab: i32,
        spec_rows: u64,
        i: i32,
        rows: u64,
        spec: SpecRows,
        state: SamplerState,
        n: u32,
    ) -> anyhow::Result<()> {
        let st = state.ptrs();
        let (proposals, q, k) = (spec.proposals, spec.q, spec.k);
        let mut p = params![
            logits, vocab, spec_rows, i, rows, proposals, q, k, st[0], st[1], st[2], st[3], st[4]
        ];
        // SAFETY: argument types match the kernel's.
        unsafe { self.launch("draft_sample", (n, 1, 1), 1024, s, &mut p) }
    }

    /// Verifies `n` sampled sequences (speculative rounds and plain samples; see `spec_verify`
    /// in the source): emitted tokens to `out_tokens` (`[n, k + 1]`) and their counts to
    /// `out_counts`; the rows' pending token, `kv_len` and `prev_tok` move on.
    ///
    /// # Safety
    /// Device addresses must be valid; the sequences' logits rows inside `logits`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn spec_verify(
        &self,
        s: sys::CUstream,
        logits: u64,
        vocab: i32,
        seqs: VerifySeqs,
        rows: u64,
        (out_tokens, out_counts): (u64, u64),
        spec: SpecRows,
        state: SamplerState,
        n: u32,
    ) -> anyhow::Result<()> {
        let VerifySeqs {
            sample_rows,
            samp_first,
            samp_draft,
            logit_rows,
            tok_src,
            positions,
        } = seqs;
        let SpecRows {
            kv_len,
            prev_tok,
            pending,
            proposals,
            q,
            k,
            prop_count,
            hist,
        } = spec;
        let (hist, hist_stride) = (hist.hist, hist.stride);
        let st = state.ptrs();
        let mut p = params![
            logits,
            vocab,
            sample_rows,
            samp_first,
            samp_draft,
            logit_rows,
            tok_src,
            positions,
            rows,
            out_tokens,
            out_counts,
            pending,
            kv_len,
            prev_tok,
            proposals,
            q,
            k,
            prop_count,
            hist,
            hist_stride,
            st[0],
            st[1],
            st[2],
            st[3],
            st[4]
        ];
        // SAFETY: argument types match the kernel's.
        unsafe { self.launch("spec_verify", (n, 1, 1), 1024, s, &mut p) }
    }

    /// Sets the n-gram histories of `n` re-initialised rows `rows[i]`: the staged tokens
    /// `tokens[offsets[i] .. offsets[i + 1]]` from position 0, and the first known position
    /// `starts[i]`.
    ///
    /// # Safety
    /// Device addresses must be valid; `offsets` holds `n + 1` entries.
    pub unsafe fn ngram_init(
        &self,
        s: sys::CUstream,
        h: NgramHist,
        (rows, offsets, starts, tokens): (u64, u64, u64, u64),
        n: u32,
    ) -> anyhow::Result<()> {
        let (hist, stride, start) = (h.hist, h.stride, h.start);
        let mut p = params![hist, stride, start, rows, offsets, starts, tokens];
        // SAFETY: argument types match the kernel's.
        unsafe { self.launch("ngram_init", (n, 1, 1), 256, s, &mut p) }
    }

    /// Records the host tokens among `n` metadata tokens in their rows' n-gram histories.
    ///
    /// # Safety
    /// Device addresses must be valid; rows inside the histories.
    pub unsafe fn ngram_record(
        &self,
        s: sys::CUstream,
        h: NgramHist,
        meta: TokenMeta,
        n: u32,
    ) -> anyhow::Result<()> {
        let (hist, stride) = (h.hist, h.stride);
        let (tok_src, positions, tok_row) = (meta.tok_src, meta.positions, meta.tok_row);
        let n_tokens = n as i32;
        let mut p = params![hist, stride, tok_src, positions, tok_row, n_tokens];
        // SAFETY: argument types match the kernel's.
        unsafe { self.launch("ngram_record", (n.div_ceil(256), 1, 1), 256, s, &mut p) }
    }

    /// N-gram proposals for `n` rows `spec_rows[b]` (suffixes of `min_n ..= max_n` tokens)
    /// into `spec.proposals`, their counts into `spec.prop_count`.
    ///
    /// # Safety
    /// Device addresses must be valid; `spec.prop_count` and `spec.hist` set.
    pub unsafe fn ngram_propose(
        &self,
        s: sys::CUstream,
        spec: SpecRows,
        spec_rows: u64,
        (min_n, max_n): (i32, i32),
        n: u32,
    ) -> anyhow::Result<()> {
        let SpecRows {
            kv_len,
            pending,
            proposals,
            k,
            prop_count,
            hist: h,
            ..
        } = spec;
        let (hist, stride, start) = (h.hist, h.stride, h.start);
        let mut p = params![
            hist, stride, start, kv_len, pending, spec_rows, min_n, max_n, proposals, prop_count, k
        ];
        // SAFETY: argument types match the kernel's.
        unsafe { self.launch("ngram_propose", (n, 1, 1), 128, s, &mut p) }
    }

    /// Resets the sampling state of `n` rows `rows[i]` (penalty counts and prompt bits, logit
    /// bias entries) from their staged inits (`offs`: `3n + 1` offsets into `data`, see
    /// `init_row_state`).
    ///
    /// # Safety
    /// Device addresses must be valid; rows inside the state arrays.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn init_row_state(
        &self,
        s: sys::CUstream,
        state: SamplerState,
        vocab: i32,
        rows: u64,
        offs: u64,
        data: u64,
        n: u32,
    ) -> anyhow::Result<()> {
        let SamplerState {
            counts,
            seen,
            bias_ids,
            bias_vals,
            ..
        } = state;
        let mut p = params![counts, seen, bias_ids, bias_vals, vocab, rows, offs, data];
        // SAFETY: argument types match the kernel's.
        unsafe { self.launch("init_row_state", (n, 1, 1), 256, s, &mut p) }
    }

    /// `out[i] = in[i]` for `n` floats.
    ///
    /// # Safety
    /// Device addresses must be valid for `n` floats.
    pub unsafe fn copy_f32(
        &self,
        s: sys::CUstream,
        out: u64,
        input: u64,
        n: i64,
    ) -> anyhow::Result<()> {
        let blocks = grid_stride_blocks(n.max(0) as usize);
        let mut p = params![out, input, n];
        // SAFETY: argument types match the kernel's.
        unsafe { self.launch("copy_f32", (blocks, 1, 1), 256, s, &mut p) }
    }

    /// `dst[index[i]] = values[i]`, `i < n` (host-sampled tokens into `pending`, new entries
    /// into the per-row block tables).
    ///
    /// # Safety
    /// Device addresses must be valid; every `index[i]` inside `dst`.
    pub unsafe fn scatter_i32(
        &self,
        s: sys::CUstream,
        dst: u64,
        index: u64,
        values: u64,
        n: i32,
    ) -> anyhow::Result<()> {
        let mut p = params![dst, index, values, n];
        // SAFETY: argument types match the kernel's.
        unsafe {
            self.launch(
                "scatter_i32",
                ((n.max(0) as u32).div_ceil(128), 1, 1),
                128,
                s,
                &mut p,
            )
        }
    }

    /// Sets every logit of row `rows[m]` that mask `m` does not allow to -inf, for
    /// `m < n_masks` (structured outputs; bit `t % 32` of word `t / 32` allows token `t`).
    ///
    /// # Safety
    /// `logits` holds the f32 rows named by `rows` (`n_masks` ints); `words` holds
    /// `n_masks * words_per_mask` words, `words_per_mask >= vocab.div_ceil(32)`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn apply_token_mask(
        &self,
        s: sys::CUstream,
        logits: u64,
        vocab: i32,
        rows: u64,
        words: u64,
        words_per_mask: i32,
        n_masks: u32,
    ) -> anyhow::Result<()> {
        let mut p = params![logits, vocab, rows, words, words_per_mask];
        // SAFETY: argument types match the kernel's.
        unsafe {
            self.launch(
                "apply_token_mask",
                ((vocab.max(0) as u32).div_ceil(256), n_masks, 1),
                256,
                s,
                &mut p,
            )
        }
    }

    /// `y[m, n] = x[m, :] · w[n, :]` for `m < rows <= GEMV_MAX_M` (bf16, fp32 accumulation; f32
    /// or bf16 out). `k` must be a multiple of 8.
    ///
    /// # Safety
    /// Device addresses must be valid for `rows * k`, `n * k` and `rows * n` elements, 16-byte
    /// aligned.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemv_bf16(
        &self,
        s: sys::CUstream,
        x: u64,
        w: u64,
        y: u64,
        rows: usize,
        n: usize,
        k: usize,
        f32_out: bool,
    ) -> anyhow::Result<()> {
        if rows > GEMV_MAX_M || !k.is_multiple_of(8) {
            bail!("gemv_bf16: {rows} rows (max {GEMV_MAX_M}), k {k} (a multiple of 8)");
        }
        let (m, nn, kk, f) = (rows as i32, n as i32, k as i32, f32_out as i32);
        let mut p = params![x, w, y, m, nn, kk, f];
        let blocks = (n as u32).div_ceil(GEMV_WARPS * GEMV_ROWS);
        // SAFETY: argument types match the kernel's.
        unsafe {
            self.launch(
                "gemv_bf16",
                (if rows == 0 { 0 } else { blocks }, 1, 1),
                GEMV_WARPS * 32,
                s,
                &mut p,
            )
        }
    }
}

impl Kernels {
    /// The longest context (keys, including the token's own) that `paged_attention` keeps in
    /// one split whatever `n_splits` is ([`ATTN_ONE_SPLIT_TILES`] tiles of 32 keys, or the
    /// `HARRIER_ATTN_ONE_SPLIT_TILES` override): a step whose tokens all fit needs no
    /// `attention_combine`.
    pub fn attn_one_split_keys(&self) -> usize {
        self.attn_one_split.max(0) as usize * 32
    }

    /// The trace buffer of a `-DHARRIER_TRACE` build (`HARRIER_KERNEL_DEFINES`): its address
    /// and the counter's; an error for other builds.
    fn trace_symbols(&self) -> anyhow::Result<(u64, u64)> {
        let get = |name: &str| -> anyhow::Result<u64> {
            let c = std::ffi::CString::new(name).expect("no NUL");
            let (mut at, mut bytes) = (0u64, 0usize);
            // SAFETY: the module is loaded; out-pointers are valid locals.
            unsafe { sys::cuModuleGetGlobal_v2(&mut at, &mut bytes, self.module, c.as_ptr()) }
                .result()
                .map_err(|e| {
                    anyhow!("{name}: {e:?} (trace needs HARRIER_KERNEL_DEFINES=-DHARRIER_TRACE)")
                })?;
            Ok(at)
        };
        Ok((get(TRACE_SYMBOL)?, get(TRACE_COUNT_SYMBOL)?))
    }

    /// Empties the trace buffer (synchronous; measurement only, see [`TraceRecord`]).
    pub fn trace_reset(&self) -> anyhow::Result<()> {
        let (_, n) = self.trace_symbols()?;
        // SAFETY: `n` is the module's 4-byte counter.
        ck(unsafe { dr::memset_d8_sync(n, 0, 4) }, "trace reset")
    }

    /// The blocks recorded since [`Kernels::trace_reset`] (synchronous; the stream's work must
    /// have completed).
    pub fn trace_read(&self) -> anyhow::Result<Vec<TraceRecord>> {
        let (buf, n) = self.trace_symbols()?;
        let mut count = [0u32];
        // SAFETY: the counter and buffer are the module's; the host buffers match the sizes.
        unsafe {
            ck(dr::memcpy_dtoh_sync(&mut count, n), "trace count")?;
            let n = (count[0] as usize).min(TRACE_CAP);
            let mut raw = vec![0u64; n * 8];
            if n > 0 {
                ck(dr::memcpy_dtoh_sync(&mut raw, buf), "trace read")?;
            }
            if count[0] as usize > TRACE_CAP {
                eprintln!(
                    "trace: {} blocks recorded, the first {TRACE_CAP} kept",
                    count[0]
                );
            }
            Ok(raw.chunks_exact(8).map(TraceRecord::from_raw).collect())
        }
    }

    /// Whether `skinny_gemm_*` can norm an `m`-row input over `k` (`(m + 1) * k` bf16 in shared
    /// memory, m <= 8).
    pub fn skinny_norm_supports(&self, m: usize, k: usize) -> bool {
        skinny_supports(m, k) && m <= 8 && (m + 1) * k * 2 <= self.skinny_smem
    }

    /// Whether a skinny launch of `m` rows can read a deferred norm's partials over `k`
    /// ([`SkinnyInputs::norm_in`]; they are staged in dynamic shared memory): up to 16 rows
    /// with bf16 weights, 8 with FP8 (`f8`).
    pub fn skinny_deferred_norm_supports(&self, m: usize, k: usize, f8: bool) -> bool {
        skinny_supports(m, k)
            && m <= skinny_twins_max_m(f8)
            && deferred_norm_smem(m, k) <= self.skinny_smem
    }

    /// The tensor-core skinny GEMM (see [`SkinnyInputs`]); the instance with the fewest 8-row
    /// tiles that covers `p.m_rows`.
    ///
    /// # Safety
    /// Device addresses must be valid for `m_rows * k` inputs, `n * k` weights (`2 n * k` for
    /// the gated epilogues), `m_rows * n` outputs and `k` norm weights, 16-byte aligned.
    pub unsafe fn skinny_gemm(&self, s: sys::CUstream, p: &SkinnyInputs) -> anyhow::Result<()> {
        let (m, k) = (p.m_rows as usize, p.k as usize);
        let f8 = p.scale != 0;
        // The residual epilogue copies y in 4-byte pairs: even n.
        let odd_resid = p.epi == SkinnyEpilogue::Residual as i32 && p.n % 2 != 0;
        if !skinny_supports(m, k) || p.n <= 0 || (f8 && !fp8_supports_k(k)) || odd_resid {
            bail!(
                "skinny_gemm: {m} rows (1 to {SKINNY_MAX_M}), k {k} (a multiple of 32; of 64 \
                 with FP8 weights), n {} (even with a residual epilogue)",
                p.n
            );
        }
        let gated = [SkinnyEpilogue::SiluMul, SkinnyEpilogue::GeluTanhMul]
            .iter()
            .any(|&e| p.epi == e as i32);
        if p.epi == SkinnyEpilogue::Rope as i32 {
            let r = &p.rope;
            if !(16..=256).contains(&r.hd)
                || r.hd % 16 != 0
                || p.n != (r.nh + 2 * r.nkv) * r.hd
                || r.rows > p.m_rows
            {
                bail!(
                    "skinny_gemm: a RoPE epilogue needs n = (heads + 2 kv heads) x head_dim with \
                     head_dim % 16 == 0, at most 256, and at most m rows: n {}, {r:?}",
                    p.n
                );
            }
        }
        let tiles = (p.n as usize * if gated { 2 } else { 1 }).div_ceil(SKINNY_ROWS as usize);
        let r4 = tiles >= self.r4_from && m <= 16;
        let rows = (if gated { SKINNY_ROWS / 2 } else { SKINNY_ROWS }) * if r4 { 4 } else { 1 };
        let blocks = (p.n as u32).div_ceil(rows);
        // (skinny_w8_fits holds up to skinny_twins_max_m rows: the 8-warp instances' sizes.)
        // (b2 first: a launch both rules take runs 16 warps, as SKINNY_B2 is compiled for.)
        let b2 = self.skinny_b2 && self.w8_rule.two_blocks(m, blocks, k, f8, r4);
        let w8 = !b2 && self.skinny_w8 && self.w8_rule.fits(m, blocks, k, f8);
        // The cluster split-K instances, for launches without a staged input (their clusters'
        // residency is counted without dynamic shared memory): few tiles that neither rule above
        // takes (SKINNY_K2), or the b2 rule's (SKINNY_K2_W8).
        let unstaged = matches!(p.norm, SkinnyNorm::None | SkinnyNorm::Out { .. });
        let limits = (self.skinny_k2_min_k, self.w8_rule.b2_max_blocks);
        let k2 = unstaged
            && !(b2 || w8 || f8 || r4)
            && skinny_k2_fits((m, blocks, k), limits, self.skinny_k2_clusters);
        let k2_w8 =
            unstaged && b2 && skinny_k2_w8_fits((blocks, k), limits, self.skinny_k2_w8_clusters);
        let nt16 = usize::from(m > 8);
        let name = match (b2, k2, k2_w8) {
            (_, _, true) => SKINNY_K2_W8[nt16],
            (true, ..) => SKINNY_B2[nt16],
            (_, true, _) => SKINNY_K2[nt16],
            _ => skinny_instance(m, r4, f8, w8),
        };
        let name = match p.deferred() {
            true => skinny_dn_instance(name).with_context(|| {
                format!("skinny_gemm: no deferred-norm instance for {name} (bf16 up to 16 rows, FP8 up to 8)")
            })?,
            false => name,
        };
        // Dynamic shared memory: the normed input, or a deferred norm's partials.
        let smem = match p.norm {
            SkinnyNorm::None => 0,
            SkinnyNorm::Out { .. } if p.epi == SkinnyEpilogue::Residual as i32 => 0,
            SkinnyNorm::Out { .. } => {
                bail!("skinny_gemm: a deferred norm's writer needs the residual epilogue")
            }
            SkinnyNorm::Prologue { .. } if self.skinny_norm_supports(m, k) => (m + 1) * k * 2,
            SkinnyNorm::In { .. } if self.skinny_deferred_norm_supports(m, k, f8) => {
                deferred_norm_smem(m, k)
            }
            _ => bail!("skinny_gemm: a normed input of {m} rows x {k} exceeds the shared memory"),
        } as u32;
        let abi = p.abi();
        let mut a = params![abi];
        let cluster = if k2 || k2_w8 { 2 } else { 1 };
        let grid = (blocks * cluster, 1, 1);
        let warps = if w8 || k2_w8 { 8 } else { self.skinny_warps };
        // SAFETY: argument types match the kernel's; the caller vouches for the addresses; the
        // dynamic shared memory is within what `load_image` allowed.
        unsafe { self.launch_smem(name, grid, warps * 32, smem, s, &mut a, cluster) }
    }
}

/// What a [`RingStage`] computes (the source's `RING_GEMV`, `RING_MLP`, `RING_ATTN`,
/// `RING_GEMVT`, `RING_CVT`).
#[repr(i32)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RingKind {
    /// `y[N] += W[N, K] x[K]`.
    #[default]
    Gemv = 0,
    /// `y[K] += down(silu(gate x) * (up x))`, `w = [gate; up]` (`[2N, K]`), `w2 = down^T`
    /// (`[N, K]`).
    Mlp = 1,
    /// One token's attention over its KV head's cache (no weights): `x` the layer's q|k|v
    /// LL words (from a GEMV stage with `ll`; `K` that stage's, `K / 1024` words a row; q and k
    /// rows in the paired RoPE order); the splits' partials go to `part` as LL words, the new
    /// key and value to the cache at the step's slot (see the source).
    Attn = 2,
    /// `y[N] += W x[K]` from `w = W^T` (`[K, N]`), split over the input rows (a block stages
    /// only its own; [`RingInput::AttnParts`] merges them from an attention stage).
    GemvT = 3,
    /// `y[N] = x` as f32 from the stage before's sums (the last stage: the logits).
    Convert = 4,
}

/// How a [`RingStage`] reads its input `x` (the source's `RING_X_*`).
#[repr(i32)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RingInput {
    /// Sums of the stage before, as every stage's `y` but a [`RingKind::Convert`]'s: `2 len`
    /// f32, each sum `y[i] + y[len + i]` (every added value split into a part rounded to 2^-8
    /// and the rest rounded to 2^-25, so both halves add exactly and in any order to the same
    /// bits: a step does not depend on the blocks' timing; see the source).
    #[default]
    Sums = 0,
    /// `K` bf16 (the embedding).
    Bf16 = 1,
    /// An attention stage's split partials (its `part`, LL words polled until they carry the
    /// attention stage's tag: no grid-wide wait), merged while staged ([`RingKind::GemvT`]
    /// stages only); the stage carries the attention's `nh`, `nkv` and `hd`, and `K = nh hd`.
    AttnParts = 2,
}

/// One stage of [`Kernels::gemv_ring`] (bf16 weights, exactly added sums in and out), as the source's
/// `RingStage` (see [`RingKind`]). The input is `x` (read as `x_form` says), or with `res` the
/// residual add `bf16(res + bf16(x))` (block 0 writes it to `res_out`), RMSNormed by `norm_w`
/// (`eps`) when that is not 0. Attention stages also take the layer's caches, RoPE
/// frequencies and a split-partials buffer (`part`, [`ring_attn_part_words`]), which the next
/// stage reads as [`RingInput::AttnParts`].
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RingStage {
    pub w: u64,
    pub w2: u64,
    pub x: u64,
    pub y: u64,
    pub res: u64,
    pub res_out: u64,
    pub norm_w: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub inv_freq: u64,
    pub part: u64,
    /// `zero_len` u64 words this stage zeroes once it has waited (the sums of the stage two
    /// before, whose readers have finished: the next launch finds them zero).
    pub zero: u64,
    pub kind: RingKind,
    pub n: i32,
    pub k: i32,
    pub eps: f32,
    pub x_form: RingInput,
    pub nh: i32,
    pub nkv: i32,
    pub hd: i32,
    pub scale: f32,
    pub zero_len: i32,
    /// The length of the sums `x` holds (where their second half starts; see
    /// [`RingInput::Sums`]).
    pub x_len: i32,
    /// GEMV stages (a layer's q|k|v, read by the attention stage after it): 1 to write `y` as
    /// LL words, each warp's sum of a 1,024-weight piece with the launch's tag for the stage in
    /// one 8-byte store (`K / 1024` words a row), which the attention stage polls instead of a
    /// grid-wide wait; the stage counts nothing. Attention stages always write their partials
    /// so, and an [`RingInput::AttnParts`] input is read so (see the source's header).
    /// [`RING_OUT_ROWS`] instead: `y` as f32 outputs, each row's stored once by the warp that
    /// computed it whole (`K` = 2,048 only: the head of a 2,048-wide model, which then writes
    /// the logits, the launch's last stage, with no [`RingKind::Convert`] after it).
    pub ll: i32,
    /// FP8 weights where not 0 (`gemv_ring_f8`): `w` (and an MLP's `w2`) hold e4m3 bytes and
    /// these their f32 scales, one an output channel (`w`'s rows for GEMV and an MLP's
    /// gate|up; the output columns, `w`'s for GEMVT and `w2`'s for the MLP's down^T).
    pub ws: u64,
    pub ws2: u64,
}

impl RingStage {
    /// Sums its `y` holds ([`RingInput::Sums`]: two f32 halves each): `K` for an MLP stage,
    /// `N` for GEMV and GEMVT stages, none for attention (partials), the conversion (f32) and
    /// LL GEMV stages (tagged words, never zeroed).
    pub fn sums_len(&self) -> i32 {
        match self.kind {
            RingKind::Attn | RingKind::Convert => 0,
            RingKind::Gemv if self.ll != 0 => 0,
            RingKind::Mlp => self.k,
            RingKind::Gemv | RingKind::GemvT => self.n,
        }
    }
}

/// [`RingStage::ll`] for LL words (the source's `RING_OUT_LL`).
pub const RING_OUT_LL: i32 = 1;
/// [`RingStage::ll`] for whole rows stored as f32 (the source's `RING_OUT_ROWS`).
pub const RING_OUT_ROWS: i32 = 2;

/// The decode step's token for [`RingKind::Attn`] stages (the source's `RingStep`): device
/// addresses of the step's positions, slot mapping, block tables and token rows (the
/// executor's step metadata; row 0 is the token's).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RingStep {
    pub positions: u64,
    pub slot_mapping: u64,
    pub block_tables: u64,
    pub tok_row: u64,
    pub bt_stride: i32,
    pub block_size: i32,
}

/// Bytes of one `gemv_ring` weight slot (`RING_SLOT`): a consumer warp reduces 2048 bytes of
/// it, so the block has `RING_SLOT / 2048` consumer warps (`RING_CW`) and the producer's.
pub const RING_SLOT: usize = 32768;

/// The smaller slot of `gemv_ring_s24` and `gemv_ring_f8_s24` (12 consumer warps): for models
/// whose MLP and o chunks would fill only 24 KB of a [`RING_SLOT`] (hidden sizes of 3 x 2^k, as
/// the 3B's 3,072), so that the ring holds a third more of them.
pub const RING_SLOT_S24: usize = 24576;

/// Every `gemv_ring` instance: (FP8 layers, slot bytes, name). An instance's block has a
/// consumer warp a 2,048-byte share of its slot, and the producer's.
const RING_INSTANCES: [(bool, usize, &str); 4] = [
    (false, RING_SLOT, "gemv_ring"),
    (true, RING_SLOT, "gemv_ring_f8"),
    (false, RING_SLOT_S24, "gemv_ring_s24"),
    (true, RING_SLOT_S24, "gemv_ring_f8_s24"),
];

/// The most slots a `gemv_ring` launch may have (`RING_MAX_SLOTS`: their tags' array; the
/// kernel traps past it).
pub const RING_MAX_SLOTS: usize = 16;

/// u64 a stage and block of a `gemv_ring` trace (`RING_TRACE_WORDS`): the wait's start, the
/// input staged, the stage counted, then (attention stages) five points inside the stage.
pub const RING_TRACE_WORDS: usize = 8;

/// Keys of a `gemv_ring` attention tile (`RING_KT`).
const RING_KT: usize = 48;

/// Shared-memory bytes an attention stage takes for `g` query heads a KV head of `hd` dims
/// (the source's `ring_attn_smem`).
pub fn ring_attn_smem(g: usize, hd: usize) -> usize {
    4 * (RING_KT * hd + hd + g * hd + RING_KT * g + 3 * g) + 16 * RING_KT
}

/// LL words (8 bytes: an f32 and its tag) of an attention stage's `part` buffer on `blocks`
/// blocks: `hd` output sums, then (max, sum), for each query head and split (`blocks / nkv`
/// splits a KV head).
pub fn ring_attn_part_words(blocks: usize, nh: usize, nkv: usize, hd: usize) -> usize {
    (blocks / nkv).max(1) * nh * (hd + 2)
}

/// Rows of `k` weights of `wb` bytes (2: bf16, 1: FP8) in a `gemv_ring` chunk with `slot`
/// bytes a slot (the source's `ring_chunk_rows<SLOT>`; [`ring_slot_bytes`] picks the slot): the
/// largest power of two of rows that fill at most a slot (an MLP chunk's intermediate rows, a
/// GEMVT chunk's input rows).
pub fn ring_chunk_rows(k: usize, slot: usize, wb: usize) -> usize {
    let mut cr = 1;
    while 2 * wb * cr * k <= slot {
        cr *= 2;
    }
    cr
}

/// Whether `gemv_ring`'s fused MLP stage takes `n` intermediate rows of hidden size `k` with
/// `slot` bytes a slot and weights of `wb` bytes: whole warps of a row (`k % 1024`), a row in
/// a slot, at most 16 down sums a consumer thread, whole chunks, a warp a gate (or up) part
/// (bf16), or (FP8) chunks of 4 to 16 rows, which the tensor cores take as one tile's k, two
/// 1,024-weight gate (or up) units a warp, and the split-K's columns in whole 32-column pairs a
/// warp (`k % (32 cw) == 0`: o's too, whose columns are the same hidden size).
pub fn ring_mlp_supports(n: usize, k: usize, slot: usize, wb: usize) -> bool {
    let (cw, cr) = (slot / 2048, ring_chunk_rows(k, slot, wb));
    k > 0
        && k.is_multiple_of(1024)
        && wb * k <= slot
        && k <= 32 * cw * 16
        && n.is_multiple_of(cr)
        && match wb {
            2 => cr * k / 1024 <= cw,
            1 => (4..=16).contains(&cr) && cr * k / 1024 <= 2 * cw && k.is_multiple_of(32 * cw),
            _ => false,
        }
}

/// The slot size for a ring of `wb`-byte layer weights on hidden size `hidden`:
/// [`RING_SLOT_S24`] where the fused MLP's and o's chunks (the largest power of two of
/// `hidden`-wide rows in a [`RING_SLOT`]) would fill at most 24 KB of it, else [`RING_SLOT`].
/// (The 3B's 4 rows of 3,072: a 32 KB slot streams 75% full, and 24 KB slots hold a third more
/// chunks in the same shared memory: 2.020 -> 1.988 ms a step on an H200, session 30.)
pub fn ring_slot_bytes(hidden: usize, wb: usize) -> usize {
    match ring_chunk_rows(hidden, RING_SLOT, wb) * hidden * wb <= RING_SLOT_S24 {
        true => RING_SLOT_S24,
        false => RING_SLOT,
    }
}

/// Whether `gemv_ring`'s attention stage takes these heads with `slot` bytes a slot (`slot /
/// 2048` consumer warps): `g * hd` at most two a consumer thread, `hd` a power of two from 16
/// (the paired RoPE order; shifts for its rows) to 256.
pub fn ring_attn_supports(nh: usize, nkv: usize, hd: usize, slot: usize) -> bool {
    nkv > 0
        && nh.is_multiple_of(nkv)
        && (nh / nkv) * hd <= 2 * (slot / 2048) * 32
        && hd.is_power_of_two()
        && (16..=256).contains(&hd)
}

/// One [`Kernels::gemv_ring`] launch.
#[derive(Debug, Clone, Copy)]
pub struct RingLaunch {
    /// Device address of `n` [`RingStage`]s.
    pub stages: u64,
    pub n: i32,
    /// `2 n` zeroed u32 counters, a stage's blocks done then its next claimed item (zeroed
    /// again by the launch's last block).
    pub done: u64,
    /// Blocks, one an SM.
    pub blocks: u32,
    /// Slots of `slot_bytes` in shared memory.
    pub slots: i32,
    /// Weight copies the producer keeps in flight ([`ring_depths`]).
    pub depth: RingDepths,
    /// Shared-memory bytes beside the ring: the largest stage input (bf16, `2 K`) or an
    /// attention stage's state ([`ring_attn_smem`]), whichever is larger.
    pub input_bytes: usize,
    /// Bytes a slot: [`RING_SLOT`], or [`RING_SLOT_S24`] (the `_s24` instances), or
    /// what a measurement build's `-DRING_SLOT=B -DRING_CW=B/2048` made the default instances
    /// take (a consumer warp reduces 2048 bytes of a slot, so the block has `slot_bytes / 2048`
    /// consumer warps and the producer's; the kernel traps on any other block size).
    pub slot_bytes: usize,
    /// 0, or `RING_TRACE_WORDS n blocks` u64 for the per-stage times (see the source).
    pub trace: u64,
    /// 1, or 2: pairs of blocks in clusters add their split-K sums once (where
    /// [`Kernels::ring_pairs_fit`] says they all fit; `input_bytes` at least `4 hidden`).
    pub cluster: u32,
    /// The token of the attention stages (zeros without them).
    pub step: RingStep,
    /// FP8 layers ([`RingStage::ws`]): the `gemv_ring_f8` instance, else `gemv_ring` (which
    /// has no FP8 code).
    pub fp8: bool,
}

/// Shared-memory bytes beside each `gemv_ring` slot: its two mbarriers, and (`gemv_ring_f8`)
/// `RING_SLOT_SCALES` f32, an FP8 slot's row scales copied with it.
pub fn ring_slot_side(fp8: bool) -> usize {
    16 + if fp8 { 4 * RING_SLOT_SCALES } else { 0 }
}

/// Bytes of weight copies a `gemv_ring` block keeps in flight outside MLP stages (see
/// [`ring_depths`] for theirs): enough to stream at the full copy rate, few enough that the
/// queue they make in front of the block's other global accesses (the consumers' dependent
/// round trips) stays short. Measured on an H200 (sessions 46-47, docs/cuda.md): the 1B's 32
/// KB slots best at 2 (one and three slower); the 3B's 24 KB at 3 with every stage alike
/// (-1.7%; two -1.0%, one +8%), and at 2 once its MLP stages keep every slot in flight
/// (1.902-1.908 ms against 1.936-1.937 at 3, main 1.941-1.953); every free slot in flight
/// everywhere (the 3B: 8 x 24 KB) made an attention stage's dependent loads wait up to 8 us.
pub const RING_FLIGHT_BYTES: usize = 64 * 1024;

/// The most weight copies a `gemv_ring` block keeps in flight (the kernel's `depth`,
/// `depth_mlp` and `depth_attn`): each 0, or `slots` or more, for as many as there are free
/// slots.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RingDepths {
    /// The stages' not named below (the head's).
    pub other: i32,
    /// An MLP stage's.
    pub mlp: i32,
    /// A q|k|v or o stage's: the copies put while the consumers run the chain around
    /// attention.
    pub attn: i32,
}

/// The depths for a ring of `slots` slots of `slot_bytes` (`fp8`: the `gemv_ring_f8`
/// instances'), worked out once at ring setup:
/// - `other`: [`RING_FLIGHT_BYTES`] worth, at least one and fewer than `slots`;
/// - `mlp`: every free slot where the slots are smaller than [`RING_SLOT`] (the 3B's 24 KB:
///   8 x 24 KB; with the others at 2, 3B 1.902-1.908 ms against main's 1.941-1.953 and FP8 3B
///   1.437-1.439 against 1.441-1.443 on an H200, session 47), `other`'s rule otherwise (the
///   1B's 32 KB slots all in flight cost it 0.3%). Keyed on the consumers' stage instead (every
///   slot while they run an MLP stage, which also deepens the next layer's first copies,
///   issued at its end) the 3B lost 1.5%;
/// - `attn`: one for bf16: each copy lands before the next is issued. On an H200 (session 48,
///   against session 47's rule in the same call): 1B 0.791-0.798 ms against 0.804-0.811, 3B
///   1.883-1.889 against 1.903-1.908, 8B 3.891-3.896 against 3.956-3.963; o's alone gave
///   about half of it on the 1B, most of it on the 3B. `other` for FP8, where one lost (FP8
///   1B +0.5%, FP8 3B +1.1%): the `gemv_ring_f8` instances take `depth` for them and ignore
///   `depth_attn` (the select in them cost the FP8 1B 0.5%).
///
/// `HARRIER_RING_DEPTH` overrides all three, `HARRIER_RING_DEPTH_MLP` the MLP's and
/// `HARRIER_RING_DEPTH_ATTN` q|k|v's and o's, bf16 only (measurement; 0: every free slot).
pub fn ring_depths(slot_bytes: usize, slots: i32, fp8: bool) -> RingDepths {
    let all = env_number("HARRIER_RING_DEPTH");
    let own = |name| env_number(name).or(all);
    let other = all.unwrap_or_else(|| ring_depth_for(slot_bytes, slots));
    RingDepths {
        other,
        mlp: own("HARRIER_RING_DEPTH_MLP").unwrap_or_else(|| ring_depth_mlp_for(slot_bytes, slots)),
        attn: match fp8 {
            true => other, // (what the FP8 instances take)
            false => own("HARRIER_RING_DEPTH_ATTN").unwrap_or_else(|| ring_depth_attn_for(slots)),
        },
    }
}

/// [`ring_depths`]'s rule for bf16 q|k|v and o stages, without the overrides: one copy.
fn ring_depth_attn_for(slots: i32) -> i32 {
    ring_depth_of(1, slots)
}

/// [`ring_depths`]'s rule for MLP stages, without the overrides.
fn ring_depth_mlp_for(slot_bytes: usize, slots: i32) -> i32 {
    match slot_bytes < RING_SLOT {
        true => 0,
        false => ring_depth_for(slot_bytes, slots),
    }
}

/// [`ring_depths`]'s rule for the other stages, without the override: [`RING_FLIGHT_BYTES`]
/// worth, at least one.
fn ring_depth_for(slot_bytes: usize, slots: i32) -> i32 {
    ring_depth_of((RING_FLIGHT_BYTES / slot_bytes.max(1)).max(1), slots)
}

/// `copies` in flight as the kernel takes them: 0 where that is every slot (the kernel's "no
/// limit", which also skips its wait).
fn ring_depth_of(copies: usize, slots: i32) -> i32 {
    if copies >= slots.max(0) as usize {
        0
    } else {
        copies as i32
    }
}

/// f32 row scales beside a `gemv_ring_f8` slot (`RING_SLOT_SCALES`).
const RING_SLOT_SCALES: usize = 64;

impl RingLaunch {
    /// Dynamic shared memory of the launch.
    pub fn smem(&self) -> usize {
        self.slots as usize * (self.slot_bytes + ring_slot_side(self.fp8)) + self.input_bytes
    }

    /// The kernel instance the launch runs: [`RING_INSTANCES`]' for its layers and slot size,
    /// or (a measurement build's other `-DRING_SLOT`) the default size's.
    fn kernel(&self) -> &'static str {
        let of = |slot| {
            RING_INSTANCES
                .iter()
                .find(|&&(f8, s, _)| f8 == self.fp8 && s == slot)
                .map(|&(_, _, name)| name)
        };
        of(self.slot_bytes)
            .or_else(|| of(RING_SLOT))
            .unwrap_or("gemv_ring")
    }

    /// Threads a block: a consumer warp a 2048-byte share of a slot, and the producer's.
    fn threads(&self) -> u32 {
        (self.slot_bytes as u32 / 2048 + 1) * 32
    }
}

impl Kernels {
    /// Lets `gemv_ring` launches (every instance) take `bytes` of dynamic shared memory (once,
    /// where the ring is set up: not a driver call every eager step).
    pub fn allow_ring_smem(&self, bytes: usize) -> anyhow::Result<()> {
        for (_, _, name) in RING_INSTANCES {
            // SAFETY: a loaded function; the attribute only raises its own limit.
            let raised = unsafe {
                dr::function::set_function_attribute(
                    self.func(name),
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
            };
            ck(raised, &format!("{name} shared memory"))?;
        }
        Ok(())
    }

    /// Whether `r`'s blocks can all run at once in clusters of two (an even count, and that
    /// many pairs resident at `r`'s shared memory; after [`Kernels::allow_ring_smem`]).
    pub fn ring_pairs_fit(&self, r: &RingLaunch) -> anyhow::Result<bool> {
        Ok(r.blocks.is_multiple_of(2) && 2 * self.ring_max_clusters(r, 2)? >= r.blocks)
    }

    /// Clusters of `size` blocks of launch `r` (its grid rounded down to whole clusters) that
    /// can be resident at once (`cuOccupancyMaxActiveClusters`). Sizes past 8, the portable
    /// limit, are allowed for `gemv_ring` here first (which only asks: the kernel itself runs
    /// in clusters of at most two).
    pub fn ring_max_clusters(&self, r: &RingLaunch, size: u32) -> anyhow::Result<u32> {
        anyhow::ensure!(size > 0, "a cluster of no blocks");
        let f = self.func(r.kernel());
        if size > 8 {
            // SAFETY: a loaded function; a documented attribute.
            let set = unsafe {
                sys::cuFuncSetAttribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                    1,
                )
                .result()
            };
            ck(set, "gemv_ring non-portable cluster sizes")?;
        }
        let mut attr = cluster_attr(size);
        let cfg = sys::CUlaunchConfig {
            gridDimX: r.blocks / size * size,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: r.threads(),
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: r.smem() as u32,
            hStream: std::ptr::null_mut(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let mut n = 0i32;
        // SAFETY: `cfg` and `attr` outlive the call; a loaded function.
        let got = unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f, &cfg).result() };
        ck(got, "gemv_ring clusters")?;
        Ok(n.max(0) as u32)
    }

    /// A chain of one-row stages in one persistent launch of one block an SM (all resident:
    /// stage `s` waits until `done[s - 1]` counts every block), the weights streamed through a
    /// ring of shared-memory slots: the executor's batch-1 decode step (`harrier-cuda-tool
    /// bench-ring` measures chains of projections).
    ///
    /// # Safety
    /// `r.stages` must hold `n` [`RingStage`]s whose addresses are valid for their shapes
    /// (`K % 1024 == 0`, `N * K < 2^31`, 16-byte aligned, each stage's `x` the `K` values the
    /// stage before writes or the host wrote; a fused MLP stage and an attention stage as the
    /// source says; `r.step` valid for attention stages); every stage's sums and the counters
    /// zeroed (as every launch leaves them); `blocks` at most the SM count; `trace` null or as
    /// [`RingLaunch::trace`] says. The launch's shared memory must be within what
    /// [`Kernels::allow_ring_smem`] allowed (a launch past it fails).
    pub unsafe fn gemv_ring(&self, s: sys::CUstream, r: &RingLaunch) -> anyhow::Result<()> {
        let smem = r.smem();
        let mut p = params![
            r.stages,
            r.n,
            r.done,
            r.slots,
            r.trace,
            r.step,
            r.depth.other,
            r.depth.mlp,
            r.depth.attn
        ];
        // SAFETY: argument types match the kernel's; the caller vouches for the rest.
        unsafe {
            self.launch_smem(
                r.kernel(),
                (r.blocks, 1, 1),
                r.threads(),
                smem as u32,
                s,
                &mut p,
                r.cluster,
            )
        }
    }
}

impl Kernels {
    /// FP8 weights to bf16: `w[r, c] = bf16(e4m3(q[r, c]) * scale[r])` for `rows x k` weights.
    ///
    /// # Safety
    /// `q` must hold `rows * k` bytes, `scale` `rows` f32 and `w` `rows * k` bf16, 16-byte
    /// aligned.
    pub unsafe fn dequant_fp8_rows(
        &self,
        s: sys::CUstream,
        (q, scale, w): (u64, u64, u64),
        rows: usize,
        k: usize,
    ) -> anyhow::Result<()> {
        if !fp8_supports_k(k) || rows == 0 {
            bail!("dequant_fp8_rows: {rows} rows of k {k} (a multiple of 64)");
        }
        let groups = (rows * k / 8) as i64;
        let k32 = k as i32;
        let mut a = params![q, scale, w, k32, groups];
        let blocks = grid_stride_blocks(groups as usize);
        // SAFETY: argument types match the kernel's; the caller vouches for the addresses.
        unsafe { self.launch("dequant_fp8_rows", (blocks, 1, 1), 256, s, &mut a) }
    }

    /// Per-token FP8 activations (sm_89+ only: the conversion instruction does not exist
    /// before): row `m < rows` of `x` (`[rows, k]` bf16) to e4m3 bytes `xq[m]` and its scale
    /// `xs[m]`, by `model::fp8`'s rule for weights.
    ///
    /// # Safety
    /// `x` must hold `rows * k` bf16, `xq` `rows * k` bytes and `xs` `rows` f32, 16-byte
    /// aligned rows.
    pub unsafe fn quantize_fp8_rows(
        &self,
        s: sys::CUstream,
        (x, xq, xs): (u64, u64, u64),
        rows: usize,
        k: usize,
    ) -> anyhow::Result<()> {
        if !fp8_supports_k(k) {
            bail!("quantize_fp8_rows: k {k} (a multiple of 64)");
        }
        let k32 = k as i32;
        let mut a = params![x, xq, xs, k32];
        // SAFETY: argument types match the kernel's; the caller vouches for the addresses.
        unsafe { self.launch("quantize_fp8_rows", (rows as u32, 1, 1), 256, s, &mut a) }
    }

    /// `y[m, n] *= xs[m] * ws[n]` for `m < rows`, `n < n` (rows `ld` apart; bf16 `y`, or f32
    /// with `f32_out`): the scales of an FP8 GEMM run with unit scales.
    ///
    /// # Safety
    /// `y` must hold `rows` rows of `ld` elements, `xs` `rows` f32 and `ws` `n` f32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn fp8_rescale(
        &self,
        s: sys::CUstream,
        (y, xs, ws): (u64, u64, u64),
        rows: usize,
        n: usize,
        ld: usize,
        f32_out: bool,
    ) -> anyhow::Result<()> {
        if !n.is_multiple_of(2) || !ld.is_multiple_of(2) || ld < n {
            bail!("fp8_rescale: n {n} and ld {ld} must be even, ld >= n");
        }
        let (m32, n32, ld32, f) = (rows as i32, n as i32, ld as i32, f32_out as i32);
        let mut a = params![y, xs, ws, m32, n32, ld32, f];
        let blocks = grid_stride_blocks(rows * n / 2);
        // SAFETY: argument types match the kernel's; the caller vouches for the addresses.
        unsafe { self.launch("fp8_rescale", (blocks, 1, 1), 256, s, &mut a) }
    }
}

/// Test support: makes libnvrtc from `$HARRIER_CUDA_DIR/lib` (the wheel installed by
/// scripts/setup.sh) loadable by cudarc, by opening it (and its builtins) by full path first.
/// Returns the folder used.
pub fn preload_nvrtc_from_env() -> anyhow::Result<PathBuf> {
    let dir = std::env::var_os("HARRIER_CUDA_DIR").map(PathBuf::from).context(
        "HARRIER_CUDA_DIR is not set: run scripts/setup.sh and export HARRIER_CUDA_DIR=$HARRIER_HOME/cuda (scripts/test.sh does)",
    )?;
    let lib = dir.join("lib");
    let mut names: Vec<_> = std::fs::read_dir(&lib)
        .with_context(|| format!("reading {}", lib.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("libnvrtc") && !n.contains(".alt."))
        .collect();
    // Builtins first: libnvrtc dlopens them by name.
    names.sort_by_key(|n| !n.contains("builtins"));
    if !names.iter().any(|n| n.starts_with("libnvrtc.so")) {
        bail!("no libnvrtc.so* in {}", lib.display());
    }
    for n in names {
        let p = std::ffi::CString::new(lib.join(&n).to_string_lossy().into_owned())?;
        // SAFETY: dlopen of a shared library by path; the handle is intentionally leaked.
        let h = unsafe { libc::dlopen(p.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if h.is_null() {
            bail!("dlopen {} failed", lib.join(&n).display());
        }
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of `#define NAME <number>` in harrier.cu.
    fn define(name: &str) -> u32 {
        SOURCE
            .lines()
            .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{name} defined in harrier.cu"))
    }

    #[test]
    fn argmax_blocks_fit_one_wave_then_shrink() {
        // row_argmax_parts keeps its warps' maxima in 32 shared words: at most 1,024 threads.
        for rows in [1, 2, 8, 9, 64, 256] {
            for resident in [0, 228, 264, u32::MAX] {
                let t = argmax_threads(rows, resident);
                assert!(
                    t.is_multiple_of(32) && t <= 1024,
                    "{rows} rows: {t} threads"
                );
            }
        }
        // 32 blocks a row, two 1,024-thread blocks an SM: an H200 (132 SMs) holds 8 rows' in
        // one wave, an H100 PCIe (114) 7 rows'; past that, 256-thread blocks.
        assert_eq!(
            (argmax_threads(1, 264), argmax_threads(8, 264)),
            (1024, 1024)
        );
        assert_eq!(
            (argmax_threads(9, 264), argmax_threads(64, 264)),
            (256, 256)
        );
        assert_eq!(
            (argmax_threads(7, 228), argmax_threads(8, 228)),
            (1024, 256)
        );
        assert_eq!(argmax_threads(1, 0), 256);
    }

    /// Every kernel some launch above runs in blocks of 1,024 threads (`NORM_THREADS`, the
    /// samplers' 1,024, [`argmax_threads`]): a new such launch joins the list. (The samplers and
    /// `add_rmsnorm` take `__launch_bounds__(1024, 1)`: `(1024)` alone made ptxas aim at two
    /// blocks an SM, 32 registers, and `spec_verify` spilled; with `, 1` none spills, H200
    /// checks and steps as before, session 42.)
    const LAUNCHED_AT_1024: [&str; 6] = [
        "embed_tokens",
        "add_rmsnorm",
        "row_argmax_parts",
        "sample_tokens",
        "draft_sample",
        "spec_verify",
    ];

    #[test]
    fn kernels_launched_at_1024_threads_are_bounded_for_it() {
        // A block of 1,024 threads launches only with at most 64 registers a thread; without
        // the bound nothing here sees the count (NVRTC stops at PTX), and the device refuses
        // the launch (session 42: embed_tokens at 72 registers).
        for k in LAUNCHED_AT_1024 {
            let decl = SOURCE
                .lines()
                .find(|l| l.contains("__global__ void") && l.contains(&format!(" {k}(")))
                .unwrap_or_else(|| panic!("{k} declared in harrier.cu"));
            assert!(
                decl.contains("__launch_bounds__(1024)")
                    || decl.contains("__launch_bounds__(1024, "),
                "{k} is launched with 1,024 threads: bound it ({decl})"
            );
        }
        assert_eq!(NORM_THREADS, 1024);
        assert_eq!(argmax_threads(1, 264), 1024);
    }

    #[test]
    fn attention_block_size_matches_the_source() {
        let warps = define("ATT_WARPS_MAX");
        assert_eq!(warps, ATT_WARPS_MAX, "launch blocks must fit ATT_WARPS_MAX");
        assert!(SOURCE.contains(&format!("#define COMBINE_MAX_SPLITS {ATTN_MAX_SPLITS}\n")));
        let w = AttnWarps {
            split: 8,
            whole: 16,
        };
        assert_eq!((w.threads(1), w.threads(2), w.threads(32)), (512, 256, 256));
    }

    /// grp blocks: the widest width whose blocks all fit (an H200's 132 SMs: one 16-warp block,
    /// two of 8, four of 4 an SM), the narrowest past them; every width divides the source's
    /// shared arrays (`GRP_WARPS`) and holds a warp a head for the merge (`GRP_MAX_G`).
    #[test]
    fn grp_width_is_the_widest_that_fits() {
        let h200 = [132, 264, 528];
        assert_eq!(grp_warps(1, h200), 16);
        assert_eq!(
            grp_warps(132, h200),
            16,
            "batch 16 of 8 KV heads, one split"
        );
        assert_eq!(grp_warps(133, h200), 8);
        assert_eq!(grp_warps(256, h200), 8, "batch 32");
        assert_eq!(grp_warps(512, h200), 4, "batch 64");
        assert_eq!(grp_warps(2048, h200), 4, "batch 256");
        assert_eq!(grp_warps(1, [0; 3]), 4, "no occupancy known: the narrowest");
        assert_eq!(GRP_WIDTHS[0], define("GRP_WARPS"));
        assert!(GRP_WIDTHS
            .iter()
            .all(|&w| w >= define("GRP_MAX_G") && w <= GRP_WIDTHS[0]));
    }

    /// The 8-warp instances: many blocks, up to 8 rows, bf16 reductions up to 4,096 (the
    /// 1B's q|k|v, gate|up and head take them; its o and down do not).
    #[test]
    fn skinny_w8_takes_short_reductions_over_many_blocks() {
        let fits = |m, blocks, k| skinny_w8_fits(m, blocks, k, false);
        assert!(fits(1, 192, 2048) && fits(8, 2004, 2048) && fits(1, 384, 4096));
        assert!(!fits(1, 128, 2048), "o of the 1B");
        assert!(!fits(1, 128, 8192), "down of the 1B");
        assert!(!fits(1, 256, 14336), "bf16 down of the 8B");
        assert!(skinny_w8_fits(1, 256, 14336, true), "FP8 down of the 8B");
        assert!(!skinny_w8_fits(1, 128, 8192, true), "FP8 down of the 1B");
        // The thresholds the environment may override (measurement only).
        let wide = W8Rule {
            min_blocks: 96,
            max_k: 16384,
            b2_max_blocks: 0,
            b2_min_blocks: 96,
            b2_long_min_blocks: 160,
        };
        assert!(wide.fits(1, 128, 8192, false), "1B down, 8 warps");
        assert!(
            !wide.two_blocks(1, 128, 8192, false, false),
            "no b2 with its limit 0"
        );
        assert!(!wide.fits(17, 128, 8192, false), "never past 16 rows");
        assert!(!W8Rule::default().fits(1, 128, 8192, false));
        let low = W8Rule {
            b2_min_blocks: 128,
            ..W8Rule::default()
        };
        assert!(
            low.two_blocks(1, 128, 2048, false, false),
            "1B o, b2 from 128"
        );
        assert!(!W8Rule::default().two_blocks(1, 128, 2048, false, false));
        let long = W8Rule {
            b2_long_min_blocks: 128,
            ..W8Rule::default()
        };
        assert!(long.two_blocks(1, 128, 8192, false, false), "1B down");
        assert!(!long.two_blocks(1, 128, 2048, false, false), "not the 1B o");
        assert!(fits(16, 192, 2048), "bf16: the 16-row 8-warp instances");
        assert!(!fits(17, 192, 2048), "no 8-warp instances past 16 rows");
        assert!(!skinny_w8_fits(9, 192, 2048, true), "FP8: 8 rows");
        let w8 = kernel_names().filter(|k| k.ends_with("_w8")).count();
        assert_eq!(w8, 6);
        // The instance table names every skinny kernel once, FP8 ones in the FP8 row.
        let mut table: Vec<&str> = SKINNY_INSTANCES.iter().flatten().copied().collect();
        table.extend(SKINNY_16_W8);
        table.extend([SKINNY_B2, SKINNY_K2, SKINNY_K2_W8].concat());
        table.extend(SKINNY_DN.iter().map(|(_, dn)| *dn));
        // Every deferred-norm twin is an 8-row or a bf16 16-row instance's, and every such
        // instance has one.
        for (base, dn) in SKINNY_DN {
            assert!(table.contains(&base) && !base.contains("_f8_16"));
            assert_eq!(skinny_dn_instance(base), Some(dn));
            assert_eq!(base.contains("_16"), dn.contains("_16"), "{dn}");
        }
        for (m, r4, f8, w8) in
            (0..32).map(|i| ([1, 8, 9, 16][i & 3], i & 4 != 0, i & 8 != 0, i & 16 != 0))
        {
            let k = skinny_instance(m, r4, f8, w8 && (m <= 8 || !f8));
            assert_eq!(skinny_dn_instance(k).is_some(), m <= 8 || !f8, "{k}");
        }
        assert_eq!(skinny_dn_instance("skinny_gemm_32"), None);
        assert_eq!(skinny_dn_instance("skinny_gemm_f8_16"), None);
        let listed: Vec<&str> = kernel_names()
            .filter(|k| k.starts_with("skinny_gemm_"))
            .collect();
        assert_eq!(table.len(), listed.len());
        assert!(listed.iter().all(|k| table.contains(k)));
        // (The skinny names are listed once: the plain list holds none, and none twice.)
        assert!(KERNELS.iter().all(|k| !k.starts_with("skinny_gemm_")));
        let mut all: Vec<&str> = kernel_names().collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), kernel_names().count());
        assert!(SKINNY_INSTANCES[1].iter().all(|k| k.contains("_f8_")));
        assert!(SKINNY_INSTANCES[0].iter().all(|k| !k.contains("_f8_")));
        assert!(SKINNY_INSTANCES
            .iter()
            .all(|r| r[6..].iter().all(|k| k.ends_with("_w8"))));
        // Rows, 4-tile blocks and 8-warp blocks pick the instance by name.
        for (m, r4, f8, w8, want) in [
            (1, false, false, false, "skinny_gemm_8"),
            (8, false, false, false, "skinny_gemm_8"),
            (9, false, false, false, "skinny_gemm_16"),
            (17, false, false, false, "skinny_gemm_32"),
            (32, false, false, false, "skinny_gemm_32"),
            (33, false, false, false, "skinny_gemm_64"),
            (64, false, true, false, "skinny_gemm_f8_64"),
            (8, true, false, false, "skinny_gemm_8_r4"),
            (16, true, true, false, "skinny_gemm_f8_16_r4"),
            (1, false, false, true, "skinny_gemm_8_w8"),
            (8, true, false, true, "skinny_gemm_8_r4_w8"),
            (1, false, true, true, "skinny_gemm_f8_8_w8"),
            (4, true, true, true, "skinny_gemm_f8_8_r4_w8"),
            (12, false, true, false, "skinny_gemm_f8_16"),
            (9, false, false, true, "skinny_gemm_16_w8"),
            (16, true, false, true, "skinny_gemm_16_r4_w8"),
        ] {
            assert_eq!(skinny_instance(m, r4, f8, w8), want, "{m} {r4} {f8} {w8}");
        }
    }

    /// The ring's shape rules on the Llama shapes (1B, 3B, 8B) and the cases they refuse; the
    /// chunk rule is the source's.
    #[test]
    fn ring_shape_rules() {
        assert!(SOURCE.contains("int cr = 1;\n    while (2 * wb * cr * K <= SLOT) cr *= 2;"));
        assert_eq!(
            [1024, 2048, 3072, 4096, 8192].map(|k| ring_chunk_rows(k, RING_SLOT, 2)),
            [16, 8, 4, 4, 2]
        );
        // FP8: twice the rows of a chunk.
        assert_eq!(
            [1024, 2048, 3072, 4096, 8192].map(|k| ring_chunk_rows(k, RING_SLOT, 1)),
            [32, 16, 8, 8, 4]
        );
        for wb in [1, 2] {
            for (n, k) in [(8192, 2048), (8192, 3072), (14336, 4096)] {
                assert!(ring_mlp_supports(n, k, RING_SLOT, wb), "{n} x {k}, {wb}");
            }
            // Not whole warps of a row; not whole chunks; a 16 KB row past a slot's half.
            for (n, k) in [(8192, 1000), (8196, 2048), (8192, 32768)] {
                assert!(!ring_mlp_supports(n, k, RING_SLOT, wb), "{n} x {k}, {wb}");
            }
        }
        // FP8's chunks of 16 rows (hidden 2,048) must be whole, bf16's are of 8; FP8 chunks of
        // 32 rows (hidden 1,024) are past a tile's k; 3-byte weights are no format.
        assert!(ring_mlp_supports(8200, 2048, RING_SLOT, 2));
        assert!(!ring_mlp_supports(8200, 2048, RING_SLOT, 1));
        assert!(ring_mlp_supports(4096, 1024, RING_SLOT, 2));
        assert!(!ring_mlp_supports(4096, 1024, RING_SLOT, 1));
        assert!(!ring_mlp_supports(8192, 2048, RING_SLOT, 3));
        assert!(SOURCE.contains("#define RING_SLOT_SCALES 64\n"));
        assert_eq!(ring_slot_side(true), 16 + 4 * 64);
        for (nh, nkv, hd) in [(32, 8, 64), (24, 8, 128), (32, 8, 128), (64, 8, 128)] {
            assert!(
                ring_attn_supports(nh, nkv, hd, RING_SLOT),
                "{nh}/{nkv}/{hd}"
            );
        }
        // 12 consumer warps take up to 768 values a KV head's group: the 3B's 3 x 128, not the
        // 8 x 128 of 64 heads over 8.
        assert!(ring_attn_supports(24, 8, 128, RING_SLOT_S24));
        assert!(!ring_attn_supports(64, 8, 128, RING_SLOT_S24));
        for (nh, nkv, hd) in [
            (128, 8, 128),
            (32, 8, 72),
            (32, 8, 96),
            (32, 6, 64),
            (8, 8, 512),
        ] {
            assert!(
                !ring_attn_supports(nh, nkv, hd, RING_SLOT),
                "{nh}/{nkv}/{hd}"
            );
        }
        // 24 KB slots for bf16 hidden sizes of 3 x 2^k (the 3B), where a chunk then fills its
        // slot and the fused MLP still takes the shape; FP8 and the other Llamas keep 32 KB.
        assert_eq!(
            [1024, 2048, 3072, 4096, 6144, 8192].map(|k| ring_slot_bytes(k, 2)),
            [
                RING_SLOT,
                RING_SLOT,
                RING_SLOT_S24,
                RING_SLOT,
                RING_SLOT_S24,
                RING_SLOT
            ]
        );
        // FP8 alike (8 rows of 3,072 fill 24 KB); the 1B's 16 rows of 2,048 fill 32.
        assert_eq!(ring_slot_bytes(3072, 1), RING_SLOT_S24);
        assert_eq!(ring_slot_bytes(2048, 1), RING_SLOT);
        assert_eq!(ring_slot_bytes(4096, 1), RING_SLOT);
        for (n, k) in [(8192, 3072), (16384, 6144)] {
            assert!(ring_mlp_supports(n, k, RING_SLOT_S24, 2), "{n} x {k}");
            assert_eq!(ring_chunk_rows(k, RING_SLOT_S24, 2) * k * 2, RING_SLOT_S24);
        }
        // FP8 at 24 KB: 24 units of the 3B's 8-row chunks on 12 warps, 8 column pairs a warp;
        // 2,048 columns are no whole pairs a warp of 12.
        assert!(ring_mlp_supports(8192, 3072, RING_SLOT_S24, 1));
        assert!(!ring_mlp_supports(8192, 2048, RING_SLOT_S24, 1));
        assert!(SOURCE.contains("P = cols / (32 * CW)"));
        assert!(SOURCE.contains("gemv_ring_body<true, 24576>(stages"));
        assert!(SOURCE.contains("gemv_ring_body<false, 24576>(stages"));
        assert_eq!(RING_SLOT_S24 % 2048, 0);
        // The instance a launch runs, by its layers and slot size (a measurement build's other
        // size: the default size's), and its block: 12 or 16 consumer warps and the producer.
        let launch = |fp8, slot_bytes| RingLaunch {
            stages: 0,
            n: 0,
            done: 0,
            blocks: 1,
            slots: 2,
            depth: RingDepths::default(),
            input_bytes: 0,
            slot_bytes,
            trace: 0,
            cluster: 1,
            step: RingStep::default(),
            fp8,
        };
        for (fp8, slot, name) in RING_INSTANCES {
            assert_eq!(launch(fp8, slot).kernel(), name);
            assert!(
                SOURCE.contains(&format!(" {name}(const RingStage* stages")),
                "{name}"
            );
        }
        // `gemv_ring`'s parameters in the order the launch passes them (every instance calls
        // the body with its own, in that order).
        assert_eq!(
            SOURCE
                .matches("(stages, n, done, nslots, trace, step, depth, depth_mlp, depth_attn);")
                .count(),
            RING_INSTANCES.len()
        );
        assert!(SOURCE.contains("RingStep step, int depth, int depth_mlp, int depth_attn) {"));
        // Copies in flight: 64 KB worth (two of the 1B's 32 KB slots, two of the 3B's
        // 24 KB), at least one, and none where that is every slot.
        assert_eq!(ring_depth_for(RING_SLOT, 6), 2);
        assert_eq!(ring_depth_for(RING_SLOT_S24, 8), 2);
        assert_eq!(ring_depth_for(128 * 1024, 4), 1);
        assert_eq!(ring_depth_for(RING_SLOT_S24, 3), 2);
        assert_eq!(ring_depth_for(RING_SLOT_S24, 2), 0);
        assert_eq!(ring_depth_for(RING_SLOT, 2), 0);
        // An MLP stage's: every slot of a 24 KB ring, the same rule on 32 KB slots.
        assert_eq!(ring_depth_mlp_for(RING_SLOT_S24, 8), 0);
        assert_eq!(ring_depth_mlp_for(RING_SLOT, 6), 2);
        assert_eq!(ring_depth_mlp_for(RING_SLOT, 2), 0);
        // q|k|v's and o's: one for bf16 (none where one is every slot); FP8's are the others'.
        assert_eq!(ring_depth_attn_for(6), 1);
        assert_eq!(ring_depth_attn_for(8), 1);
        assert_eq!(ring_depth_attn_for(1), 0);
        if std::env::vars().all(|(k, _)| !k.starts_with("HARRIER_RING_DEPTH")) {
            let (bf16, fp8) = (
                ring_depths(RING_SLOT, 6, false),
                ring_depths(RING_SLOT, 6, true),
            );
            assert_eq!((bf16.other, bf16.mlp, bf16.attn), (2, 2, 1));
            assert_eq!((fp8.other, fp8.mlp, fp8.attn), (2, 2, 2));
            let s24 = ring_depths(RING_SLOT_S24, 8, true);
            assert_eq!((s24.other, s24.mlp, s24.attn), (2, 0, 2));
        }
        assert_eq!(launch(true, 16384).kernel(), "gemv_ring_f8");
        assert_eq!(launch(false, 16384).kernel(), "gemv_ring");
        assert_eq!(launch(false, RING_SLOT_S24).threads(), 13 * 32);
        assert_eq!(launch(true, RING_SLOT).threads(), 17 * 32);
        assert!(kernel_names().any(|k| k == "gemv_ring_f8_s24"));
        // Every query head and split holds (max, sum, hd outputs).
        assert_eq!(ring_attn_part_words(132, 32, 8, 64), 16 * 32 * 66);
        assert_eq!(ring_attn_part_words(4, 32, 8, 64), 32 * 66);
        // The sums a stage leaves: an MLP's are hidden-wide (K), a GEMV's or GEMVT's N;
        // attention partials and the f32 logits are none.
        let stage = |kind| RingStage {
            kind,
            n: 8192,
            k: 2048,
            ..Default::default()
        };
        assert_eq!(
            [
                RingKind::Gemv,
                RingKind::Mlp,
                RingKind::Attn,
                RingKind::GemvT,
                RingKind::Convert
            ]
            .map(|k| stage(k).sums_len()),
            [8192, 2048, 0, 8192, 0]
        );
        // A q|k|v stage writing LL words holds no sums (nothing to zero).
        let ll = RingStage {
            ll: 1,
            ..stage(RingKind::Gemv)
        };
        assert_eq!(ll.sums_len(), 0);
    }

    #[test]
    fn kernel_list_matches_source() {
        let declared = |k: &str| {
            SOURCE.lines().any(|l| {
                l.starts_with("extern \"C\" __global__ void ") && l.contains(&format!(" {k}("))
            })
        };
        for k in kernel_names() {
            assert!(declared(k), "{k} missing from harrier.cu");
        }
        assert_eq!(
            SOURCE.matches("extern \"C\" __global__").count(),
            kernel_names().count()
        );
        assert!(SOURCE.contains(&format!("#define MASK_CAP {MASK_CAP}")));
        assert!(SOURCE.contains(&format!("#define GEMV_MAX_M {GEMV_MAX_M}")));
        assert_eq!(
            (define("GEMV_WARPS"), define("GEMV_ROWS")),
            (GEMV_WARPS, GEMV_ROWS)
        );
        assert_eq!(define("GRP_WARPS") * 32, GRP_THREADS);
        assert_eq!(std::mem::size_of::<RowParams>(), 60 + 4 * MASK_CAP);
        // SkinnyIn: five pointers, two floats, four ints, then SkinnyRope (five pointers, four
        // ints) at offset 64; the epilogue codes and block shape.
        assert!(SOURCE.contains("struct SkinnyIn {") && SOURCE.contains("struct SkinnyRope {"));
        // RingStage: twelve pointers, then ints and floats as the source's (`ll` last), then two pointers; RingStep; the
        // kinds, the attention tile and its shared memory; the slot and warp defaults (a
        // consumer warp a 2048-byte share of a slot).
        assert!(SOURCE.contains("struct RingStage {\n    const bf16* w;\n    const bf16* w2;\n    const float* x;\n    float* y;\n    const float* res;\n    float* res_out;\n    const bf16* norm_w;\n    bf16* k_cache;\n    bf16* v_cache;\n    const float* inv_freq;\n    float* part;\n    unsigned long long* zero;\n    int kind;\n    int N, K;\n    float eps;\n    int x_form;\n    int nh, nkv, hd;\n    float scale;\n    int zero_len;\n    int x_len;\n    int ll;            // GEMV: y as LL words, a 1,024-weight piece each (ring_ll_put), for an ATTN stage; or RING_OUT_ROWS\n    const float* ws;   // FP8 weights where not null (gemv_ring_f8): w's scales, one an output channel\n    const float* ws2;  // and w2's (MLP: down^T's columns)\n};"));
        assert_eq!(std::mem::offset_of!(RingStage, kind), 12 * 8);
        assert_eq!(std::mem::offset_of!(RingStage, ll), 12 * 8 + 11 * 4);
        assert_eq!(std::mem::offset_of!(RingStage, ws), 12 * 8 + 12 * 4);
        assert_eq!(std::mem::size_of::<RingStage>(), 14 * 8 + 12 * 4);
        assert!(SOURCE.contains("struct RingStep {\n    const int* positions;\n    const int* slot_mapping;\n    const int* block_tables;\n    const int* tok_row;\n    int bt_stride, block_size;\n};"));
        assert_eq!(std::mem::size_of::<RingStep>(), 4 * 8 + 2 * 4);
        assert!(SOURCE.contains(
            "#define RING_GEMV 0\n#define RING_MLP 1\n#define RING_ATTN 2\n#define RING_GEMVT 3\n#define RING_CVT 4\n"
        ));
        assert_eq!((RingKind::GemvT as i32, RingKind::Convert as i32), (3, 4));
        assert_eq!(
            (
                RingKind::Gemv as i32,
                RingKind::Mlp as i32,
                RingKind::Attn as i32
            ),
            (0, 1, 2)
        );
        assert!(SOURCE
            .contains("#define RING_X_SUMS 0\n#define RING_X_BF16 1\n#define RING_X_PARTS 2\n"));
        assert!(SOURCE.contains(&format!(
            "#define RING_OUT_LL {RING_OUT_LL}\n#define RING_OUT_ROWS {RING_OUT_ROWS}\n"
        )));
        assert_eq!(
            (
                RingInput::Sums as i32,
                RingInput::Bf16 as i32,
                RingInput::AttnParts as i32
            ),
            (0, 1, 2)
        );
        assert!(SOURCE.contains(&format!("#define RING_KT {RING_KT}\n")));
        assert!(SOURCE.contains(&format!("#define RING_TRACE_WORDS {RING_TRACE_WORDS}\n")));
        assert!(SOURCE.contains(
            "return 4 * (RING_KT * hd + hd + G * hd + RING_KT * G + 3 * G) + 16 * RING_KT;"
        ));
        assert!(SOURCE.contains(&format!("#define RING_SLOT {RING_SLOT}\n")));
        assert!(SOURCE.contains(&format!("#define RING_MAX_SLOTS {RING_MAX_SLOTS}\n")));
        assert!(SOURCE.contains(&format!("#define RING_CW {}\n", RING_SLOT / 2048)));
        assert_eq!(std::mem::size_of::<SkinnyRope>(), 5 * 8 + 4 * 4);
        assert_eq!(std::mem::offset_of!(SkinnyAbi, args), 5 * 8 + 6 * 4);
        // At most 128 bytes (see SkinnyAbi), the union no larger than the RoPE operands.
        assert_eq!(
            std::mem::size_of::<SkinnyAbi>(),
            5 * 8 + 6 * 4 + 5 * 8 + 4 * 4
        );
        assert!(std::mem::size_of::<SkinnyAbi>() <= 128);
        assert_eq!(
            std::mem::size_of::<SkinnyEpilogueArgs>(),
            std::mem::size_of::<SkinnyRope>()
        );
        assert_eq!(
            (define("SK_NORM_IN"), define("SK_NORM_OUT")),
            (SK_NORM_IN as u32, SK_NORM_OUT as u32)
        );
        assert_eq!(
            (define("SK_WARPS"), define("SK_ROWS")),
            (SKINNY_WARPS, SKINNY_ROWS)
        );
        // Every instance but the `_w8` ones launches with SK_WARPS warps, as the host does.
        let bounds = |k: &str| {
            SOURCE.lines().find_map(|l| {
                l.strip_prefix("extern \"C\" __global__ void __launch_bounds__(")
                    .and_then(|r| r.split_once(&format!(" {k}(")))
                    .map(|(b, _)| b.trim_end_matches(')').to_string())
            })
        };
        // (The thread count; a `_w8` instance may add a minimum of blocks per SM.)
        let threads = |k: &str| bounds(k).map(|b| b.split(',').next().unwrap_or("").to_string());
        for k in kernel_names().filter(|k| k.starts_with("skinny_gemm_")) {
            let want = if ["_w8", "_w8_dn", "_w8_k2", "_w8_dn_k2"]
                .iter()
                .any(|s| k.ends_with(s))
            {
                "8 * 32"
            } else {
                "SK_WARPS * 32"
            };
            assert_eq!(threads(k).as_deref(), Some(want), "{k}");
        }
        // Two attention blocks an SM (64 registers; docs/cuda.md: a block must fit beside the
        // q|k|v GEMM's to overlap it), three one-tile 8-warp skinny blocks.
        for k in ATTN_HD_KERNELS
            .map(|(_, k)| k)
            .iter()
            .chain(&["paged_attention"])
        {
            assert_eq!(bounds(k).as_deref(), Some("ATT_WARPS_MAX * 32, 2"), "{k}");
        }
        for (hd, k) in ATTN_HD_KERNELS {
            assert!(SOURCE.contains(&format!(" {k}(ATT_PARAMS) {{ ATT_BODY({hd}) }}")));
            assert_eq!(attn_kernel(hd), k);
        }
        assert_eq!(attn_kernel(192), "paged_attention");
        for k in ["skinny_gemm_8_w8", "skinny_gemm_f8_8_w8"] {
            assert_eq!(bounds(k).as_deref(), Some("8 * 32, 3"), "{k}");
        }
        for k in SKINNY_B2.iter().chain(&SKINNY_K2) {
            assert_eq!(bounds(k).as_deref(), Some("SK_WARPS * 32, 2"), "{k}");
        }
        for k in SKINNY_16_W8[..1].iter().chain(&SKINNY_K2_W8) {
            assert_eq!(bounds(k).as_deref(), Some("8 * 32, 3"), "{k}");
        }
        // The 64-register instances (two 16-warp blocks an SM) read x a chunk at a time (XA
        // false: a round's loads at once spill there); one n-tile ones say so, the 16-row ones
        // default to it.
        for k in kernel_names().filter(|k| k.starts_with("skinny_gemm_")) {
            if bounds(k).as_deref() != Some("SK_WARPS * 32, 2") {
                continue;
            }
            let line = SOURCE
                .lines()
                .find(|l| l.contains(&format!(" {k}(")))
                .unwrap_or("");
            let call = line.split_once("{ ").map_or("", |(_, c)| c);
            let two_tiles = call.contains("<2, ") || call.contains("(2, ");
            let xa_off = call.ends_with("false>(p); }") || call.ends_with("false) }");
            assert!(two_tiles || xa_off, "{k}: {call}");
        }
        // A deferred-norm twin launches as its base instance does.
        for (base, dn) in SKINNY_DN {
            assert!(bounds(dn).is_some(), "{dn}");
            assert_eq!(bounds(dn), bounds(base), "{dn}");
        }
        // Two blocks an SM for the one-wave launches (1B q|k|v, 3B and 8B o) and the long
        // reductions (3B and 8B down), not for the 1B's 128-block o and down, the 3B and 8B
        // q|k|v (320, 384 blocks), FP8, 4-tile blocks or more than 16 rows.
        let rule = W8Rule::default();
        for (m, blocks, k, f8, r4, want) in [
            (1, 192, 8192, false, false, true),
            (8, 256, 14336, false, false, true),
            (1, 192, 2048, false, false, true),
            (8, 256, 4096, false, false, true),
            (1, 320, 8192, false, false, true),
            (1, 128, 8192, false, false, false),
            (1, 128, 2048, false, false, false),
            (1, 320, 3072, false, false, false),
            (1, 256, 14336, true, false, false),
            (1, 512, 8192, false, true, false),
            (16, 192, 8192, false, false, true),
            (17, 192, 8192, false, false, false),
        ] {
            assert_eq!(
                rule.two_blocks(m, blocks, k, f8, r4),
                want,
                "{m} {blocks} {k}"
            );
        }
        for (e, name) in [
            (SkinnyEpilogue::Store, "SK_STORE"),
            (SkinnyEpilogue::StoreF32, "SK_STORE_F32"),
            (SkinnyEpilogue::Residual, "SK_RESID"),
            (SkinnyEpilogue::SiluMul, "SK_SILU"),
            (SkinnyEpilogue::GeluTanhMul, "SK_GELU"),
            (SkinnyEpilogue::Rope, "SK_ROPE"),
        ] {
            assert_eq!(define(name), e as u32, "{name}");
        }
        assert!(skinny_supports(1, 2048) && skinny_supports(64, 1152));
        assert!(!skinny_supports(65, 2048) && !skinny_supports(8, 1000) && !skinny_supports(0, 64));
        assert!(SOURCE.contains(&format!("#define BIAS_CAP {LOGIT_BIAS_CAP}")));
        assert!(BF16_ONLY.iter().all(|k| kernel_names().any(|n| n == *k)));
        // AttnIn: seven pointers, then eight 4-byte fields, no padding.
        assert!(SOURCE.contains("struct AttnIn {"));
        assert_eq!(std::mem::size_of::<AttentionInputs>(), 7 * 8 + 8 * 4);
        assert_eq!(define("PF_WARPS") * 32, PREFILL_THREADS);
        assert_eq!(define("GQA_WARPS") * 32, GQA_THREADS);
        assert!(gqa_attention_supports(32, 8, 64) && gqa_attention_supports(16, 8, 128));
        assert!(gqa_attention_supports(24, 8, 128));
        assert!(!gqa_attention_supports(40, 8, 128) && !gqa_attention_supports(48, 8, 256));
        // Gemma 3 1B (4 / 1) and 4B (8 / 4) at head dim 256: G * hd within GQA_MAX_ELEMS.
        assert!(gqa_attention_supports(4, 1, 256) && gqa_attention_supports(8, 4, 256));
        assert!(SOURCE.contains("#define GQA_MAX_ELEMS 1024"));
        assert_eq!(16 * define("PF_WARPS") as usize, PREFILL_TILE);
        // paged_attention_grp*: G up to GRP_MAX_G (4) at head dims 64 and 128, G * hd within
        // GRP_MAX_ELEMS; an instance a head dim.
        assert_eq!(
            grp_attention_kernel(32, 8, 64),
            Some("paged_attention_grp64")
        );
        assert_eq!(
            grp_attention_kernel(24, 8, 128),
            Some("paged_attention_grp128")
        );
        assert!(grp_attention_supports(32, 8, 128) && grp_attention_supports(8, 8, 64));
        assert!(!grp_attention_supports(40, 8, 128) && !grp_attention_supports(4, 1, 256));
        assert!(!grp_attention_supports(12, 8, 64) && !grp_attention_supports(8, 0, 64));
        assert_eq!(
            define("GRP_MAX_G") as usize * 128,
            define("GRP_MAX_ELEMS") as usize
        );
        // The cluster twins: as many splits as the source's GRP_CL_MAX, an instance a grp one.
        assert_eq!(define("GRP_CL_MAX"), GRP_CLUSTER_MAX_SPLITS);
        for (grp, cl) in GRP_CLUSTER_KERNELS {
            assert!(KERNELS.contains(&grp) && KERNELS.contains(&cl) && BF16_ONLY.contains(&cl));
        }
    }

    #[test]
    fn skinny_k2_takes_few_tiles_over_long_reductions() {
        let rule = W8Rule::default();
        let limits = (SKINNY_K2_MIN_K, rule.b2_max_blocks);
        let k2 = |m, blocks, k| {
            !rule.two_blocks(m, blocks, k, false, false)
                && !rule.fits(m, blocks, k, false)
                && skinny_k2_fits((m, blocks, k), limits, 132)
        };
        // The 1B's down (2,048 rows = 128 tiles over 8,192) and Qwen3-0.6B's (64 over 3,072).
        assert!(k2(8, 128, 8192) && k2(1, 128, 8192) && k2(8, 64, 3072));
        assert!(k2(16, 128, 8192), "bf16 16 rows: the 16-row twin");
        // Not the 1B's o (a 2,048 reduction: a tie in check-gemv), more than 16 rows, the 3B's
        // o and down (192 tiles: b2 already), nor without enough resident pairs.
        assert!(!k2(8, 128, 2048) && !k2(17, 128, 8192) && !k2(8, 192, 8192));
        assert!(!skinny_k2_fits((8, 128, 8192), limits, 100));
        assert!(!skinny_k2_fits((8, 128, 8192), limits, 0));
        // The 8-warp twin, among launches b2 takes: the 3B's o and down (192 tiles over 3,072
        // and 8,192) and Qwen3-4B's (160 over 4,096 and 9,728); not the 1B's q|k|v (over
        // 2,048) nor the 8B's o and down (256 tiles: two waves).
        let w8 = |blocks, k| {
            rule.two_blocks(8, blocks, k, false, false)
                && skinny_k2_w8_fits((blocks, k), limits, 198)
        };
        assert!(w8(192, 3072) && w8(192, 8192) && w8(160, 4096) && w8(160, 9728));
        assert!(!w8(192, 2048) && !w8(256, 4096) && !w8(256, 14336));
        assert!(!skinny_k2_w8_fits((192, 8192), limits, 100));
    }

    #[test]
    fn grp_splits_lowered_to_resident_clusters() {
        // An H200 at 8 KV heads: 8 tokens a launch in pairs, 4 in threes, 3 in fours.
        let h200 = |s: u32| [8, 4, 3][s as usize - 2];
        assert_eq!(cluster_splits(4, 4, h200), 3);
        assert_eq!(cluster_splits(3, 4, h200), 4);
        assert_eq!(cluster_splits(8, 2, h200), 2);
        assert_eq!(cluster_splits(8, 4, h200), 2);
        // Past 4 splits: the most of 2-4 that fits; none fitting leaves the count as it was.
        assert_eq!(cluster_splits(2, 8, h200), 4);
        assert_eq!(cluster_splits(16, 2, h200), 2);
        assert_eq!(cluster_splits(16, 8, h200), 8);
        assert_eq!(cluster_splits(4, 1, h200), 1);
        // No clusters (f32, before sm_90, HARRIER_ATTN_GRP_CLUSTER=0): unchanged.
        assert_eq!(cluster_splits(4, 4, |_| 0), 4);
        assert!(clusters_supported("sm_90") && !clusters_supported("sm_89"));
    }

    #[test]
    fn module_images_are_terminated_ptx_or_untouched_cubins() {
        assert_eq!(
            module_image(b".version 8.0".to_vec()).unwrap(),
            b".version 8.0\0"
        );
        let cubin = b"\x7fELF\x02\x01\0\0rest".to_vec();
        assert_eq!(module_image(cubin.clone()).unwrap(), cubin);
        assert!(module_image(b".version\0 8.0".to_vec()).is_err());
    }

    /// The deferred norm's operands land in the fields `struct SkinnyIn` reads them from.
    #[test]
    fn deferred_norms_reuse_the_kernel_argument_fields() {
        let base = SkinnyInputs::new((1, 2, 3), 8, 2048, 2048, SkinnyEpilogue::Residual);
        let plain = base.abi();
        assert_eq!(
            (plain.norm_w, plain.epi),
            (0, SkinnyEpilogue::Residual as i32)
        );
        let out = base.norm_out((10, 11, 12), 0.0).abi();
        assert_eq!(out.norm_w, 11, "the next norm's weights");
        assert_eq!(out.epi, SkinnyEpilogue::Residual as i32 | SK_NORM_OUT);
        // SAFETY: a writer's argument carries the `dout` member.
        let dout = unsafe { out.args.dout };
        assert_eq!((dout.u, dout.ss), (10, 12));
        let rope = SkinnyRope {
            positions: 7,
            rows: 5,
            ..SkinnyRope::default()
        };
        let qkv = SkinnyInputs::new((1, 2, 3), 8, 3072, 2048, SkinnyEpilogue::Store).roped(rope);
        let inp = qkv.norm_in(20, 1e-5).abi();
        assert_eq!(inp.norm_w, 20, "the partials");
        assert_eq!(inp.epi, SkinnyEpilogue::Rope as i32 | SK_NORM_IN);
        assert_eq!(inp.eps, 1e-5);
        // SAFETY: a RoPE launch's argument carries the `rope` member.
        let r = unsafe { inp.args.rope };
        assert_eq!((r.positions, r.rows), (7, 5));
        // A prologue norm passes its weights unflagged.
        let normed = qkv.normed(30, (1e-6, 1.0)).abi();
        assert_eq!(
            (normed.norm_w, normed.epi, normed.w_off),
            (30, SkinnyEpilogue::Rope as i32, 1.0)
        );
    }

    #[test]
    fn cache_key_depends_on_arch() {
        assert_ne!(
            cache_key("sm_80", Dtype::Bf16),
            cache_key("sm_90", Dtype::Bf16)
        );
        assert_ne!(
            cache_key("sm_90", Dtype::Bf16),
            cache_key("sm_90", Dtype::F32)
        );
        assert_eq!("float32".parse::<Dtype>().unwrap(), Dtype::F32);
        assert_eq!("auto".parse::<Dtype>().unwrap(), Dtype::Bf16);
        assert!("fp8".parse::<Dtype>().is_err());
        assert_eq!(arch_name(9, 0).unwrap(), "sm_90");
        assert!(arch_name(7, 5).is_err());
    }

    /// HARRIER_PTX_DUMP=DIR keeps a test's PTX as DIR/NAME.ptx (`ptxas -v` then gives register
    /// counts, `cuobjdump -sass` the code).
    fn dump_ptx(name: &str, ptx: &str) {
        if let Some(dir) = std::env::var_os("HARRIER_PTX_DUMP") {
            let path = std::path::Path::new(&dir).join(format!("{name}.ptx"));
            std::fs::write(&path, ptx).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
    }

    /// The trace buffer's capacity is the same on both sides, and a record reads back as the
    /// source packs it.
    #[test]
    fn trace_capacity_matches_the_source() {
        assert!(SOURCE.contains(&format!("#define TRACE_CAP {TRACE_CAP}\n")));
        assert!(SOURCE.contains(&format!(" {TRACE_SYMBOL}[TRACE_CAP][8];")));
        assert!(SOURCE.contains(&format!(" {TRACE_COUNT_SYMBOL};")));
        assert!(SOURCE.contains(
            "r[6] = ((unsigned long long)gridDim.x * gridDim.y * gridDim.z << 32) | ((unsigned long long)blockDim.x << 16) | smid;"
        ));
        let r = TraceRecord::from_raw(&[
            7,
            100,
            250,
            900,
            5,
            1005,
            (2004 << 32) | (256 << 16) | 131,
            0,
        ]);
        assert_eq!(
            r,
            TraceRecord {
                grid: 7,
                before_wait_ns: 100,
                after_wait_ns: 250,
                exit_ns: 900,
                blocks: 2004,
                threads: 256,
                sm: 131,
                cycles: 1000,
            }
        );
    }

    /// The source's measurement-only `#ifdef` variants ([`ptx_for`]'s
    /// `HARRIER_KERNEL_DEFINES`) still compile, so a device call can time them.
    #[test]
    fn measurement_variants_compile() {
        if preload_nvrtc_from_env().is_err() && std::env::var_os("CI").is_none() {
            eprintln!("SKIPPED: NVRTC not available");
            return;
        }
        const VARIANTS: &[&str] = &[
            "-DATT_EXIT_AFTER_WAIT -DRING_MLP_TRACE -DRING_LL_BACKOFF=100 -DRING_ATTN_TRACE -DRING_ATTN_WTRACE=3",
            "-DHARRIER_TRACE -DRING_MLP_TRACE=2 -DRING_NO_MERGE_WAIT -DRING_ATTN_TRACE -DRING_ATTN_WTRACE=2",
            // (Variants of different kernels share a compile.)
            "-DSK_NO_EARLY -DRING_NO_MATH -DRING_NO_DEP -DRING_COUNT_RELAXED -DRING_ATTN_TRACE -DRING_ATTN_WTRACE",
            "-DATT_LATE_TRIGGER -DRING_NO_RED -DRING_MLP_NO_BAR -DRING_COPY_PARTS=4 -DRING_DEPTH_HEAD=1",
            "-DCOMBINE_LATE_TRIGGER -DRING_MLP_NO_DOWN -DRING_NO_HINT -DRING_PV_UNROLL=8",
            "-DRING_SKIP_ATTN -DRING_MLP_CLAIM -DRING_BAR_CHECK",
        ];
        for defs in VARIANTS {
            let opts: Vec<String> = defs.split_whitespace().map(String::from).collect();
            let ptx = compile_ptx_with("sm_90", Dtype::Bf16, &opts)
                .unwrap_or_else(|e| panic!("{defs}: {e:#}"));
            assert!(ptx.contains(".entry paged_attention("), "{defs}");
            if defs.starts_with("-DHARRIER_TRACE") {
                assert!(
                    ptx.contains(&format!(" {TRACE_SYMBOL}[")),
                    "the trace buffer"
                );
            }
            dump_ptx(
                &format!("sm_90_bfloat16{}", defs.replace("-D", "").replace(' ', "_")),
                &ptx,
            );
        }
    }

    /// Every kernel compiles through NVRTC for sm_90 and sm_80 (CI has no GPU: NVRTC comes from
    /// the nvidia-cuda-nvrtc-cu12 wheel that scripts/setup.sh installs). Skipped with a message
    /// outside CI when the wheel is missing; a failure in CI.
    #[test]
    fn every_kernel_compiles_with_nvrtc() {
        if let Err(e) = preload_nvrtc_from_env() {
            if std::env::var_os("CI").is_some() {
                panic!("NVRTC is required in CI: {e:#}");
            }
            eprintln!("SKIPPED: NVRTC not available ({e:#})");
            return;
        }
        assert!(
            nvrtc_present(),
            "libnvrtc preloaded but cudarc cannot load it"
        );
        for (arch, dtype) in [
            ("sm_90", Dtype::Bf16),
            ("sm_80", Dtype::Bf16),
            ("sm_90", Dtype::F32),
            ("sm_80", Dtype::F32),
        ] {
            let ptx = compile_ptx(arch, dtype).unwrap_or_else(|e| panic!("{e:#}"));
            for k in kernel_names() {
                assert_eq!(
                    ptx.contains(&format!(".entry {k}(")),
                    dtype.has_kernel(k),
                    "{k} in the {arch} {dtype:?} PTX"
                );
            }
            dump_ptx(&format!("{arch}_{}", dtype.name()), &ptx);
            // A HARRIER_KERNEL_IMAGE of this build is taken for this dtype only.
            assert_eq!(image_dtype(ptx.as_bytes()), dtype, "{arch} {dtype:?}");
            let target = format!(".target {arch}");
            assert!(ptx.contains(&target), "PTX for {arch} lacks {target}");
            if dtype == Dtype::Bf16 {
                skinny_in_registers(&ptx, arch);
            }
            // Launched with programmatic dependent launch on sm_90, every kernel must wait for
            // the previous one itself (PDL_ENTER): a kernel without the wait could read what
            // its predecessor has not written yet.
            for entry in ptx.split(".entry ").skip(1) {
                let name = entry.split('(').next().unwrap_or_default();
                assert_eq!(
                    entry.contains("griddepcontrol.wait"),
                    arch == "sm_90",
                    "{name} in the {arch} {dtype:?} PTX: griddepcontrol.wait"
                );
            }
        }
    }

    /// The skinny GEMMs keep their weight loads in registers: a larger local array in
    /// their PTX would mean an index the compiler could not resolve (the stream through local
    /// memory would cost more than it hides). The one local array allowed is the 28 bytes of
    /// sincosf's range reduction for huge angles (the RoPE epilogue), under 32.
    fn skinny_in_registers(ptx: &str, what: &str) {
        let mut n = 0;
        for entry in ptx.split(".entry ").skip(1) {
            let name = entry.split('(').next().unwrap_or_default();
            if name.starts_with("skinny_gemm") {
                n += 1;
                let local: usize = entry
                    .lines()
                    .filter(|l| l.contains(".local .align"))
                    .filter_map(|l| {
                        l.split('[')
                            .nth(1)?
                            .split(']')
                            .next()?
                            .parse::<usize>()
                            .ok()
                    })
                    .sum();
                assert!(
                    local < 32,
                    "{name} ({what}) has {local} bytes of local memory"
                );
            }
        }
        assert!(n > 0, "no skinny_gemm entries ({what})");
    }

    #[test]
    fn pdl_only_from_sm_90() {
        // HARRIER_PDL is not set in the test environment.
        if std::env::var_os("HARRIER_PDL").is_none() {
            assert!(pdl_default("sm_90"));
            assert!(pdl_default("sm_120"));
        }
        assert!(!pdl_default("sm_80"));
        assert!(!pdl_default("sm_89"));
        assert!(!pdl_default("bogus"));
    }

    #[test]
    fn architectures_and_grid_stride_launches() {
        assert_eq!(sm_version("sm_89"), Some(89));
        assert_eq!(sm_version("bogus"), None);
        assert_eq!((grid_stride_blocks(0), grid_stride_blocks(257)), (0, 2));
        assert_eq!(grid_stride_blocks(usize::MAX / 2), 65_535);
    }
}
