//! The CUDA backend: our NVRTC-compiled kernels (`harrier-kernels`), cuBLAS GEMMs, and the
//! executor seam over two ping-pong slots. The model runs in bf16 (serving) or f32
//! (`--dtype float32`: exact fp32, for parity checks).
//!
//! ```text
//!  engine thread                       compute stream (I1: every step's work)       copy stream
//!  launch_forward(batch, slot)  ──►  wait(slot.meta_ready) ◄─ H2D slot metadata (upload stream)
//!                                    row inits, block-table updates,
//!                                    forward → logits (graph replay or eager)
//!  finalize_sampling(handle)    ──►  sample_tokens → slot.out_d, rows' pending     ─► wait(slot.step_done) (I3)
//!                                    record slot.step_done                           D2H slot.out_d → slot.out_h
//!                                                                                    record slot.copy_done
//!  wait(step)                   ◄──  cuEventSynchronize(slot.copy_done): only the oldest step's copy
//! ```
//!
//! - A decode's input token is the row's `pending` entry, written by the previous step's
//!   sampling kernel on the device: the host is never between two decode steps.
//! - Each slot owns its pinned host metadata, its device metadata (fixed addresses, refilled
//!   each step), its device and pinned output buffers and its events (I6: the engine reuses a
//!   slot only after committing its step, so the pinned buffers are never overwritten early,
//!   and its device metadata is no longer read when the next step's copy of it starts).
//! - Activations, logits and the KV cache are shared: all work on them is on one compute
//!   stream, so step t+1's forward runs after step t's sampling. Only the step's metadata
//!   copy runs on its own stream, ahead, while the step before computes.
//! - Sampling runs on the device (`sample_tokens`) with the CPU sampler's order and Philox
//!   stream, so seeded output matches the CPU backend up to numeric ties. logit_bias and the
//!   repetition, frequency and presence penalties are applied there from per-row device state
//!   (bias entries, prompt bits and output counts, reset by `init_row_state` from the row init
//!   and counts bumped by the sampler itself, so the host stays off the path between steps).
//!   Rows with logprobs, a min_tokens mask longer than `MASK_CAP` or more state than one step's
//!   staging holds run on the host (`RowSampler`, the CPU backend's sampler) in
//!   `finalize_sampling`, which then synchronises the stream for that step (`meta::RowPlan`).
//! - Decode-only steps of up to the largest bucket replay a captured graph (`graphs`), padded
//!   to the bucket with rows that read nothing and write their KV into a reserved scratch
//!   block; everything else (prefill chunks, larger batches, `--enforce-eager`) runs eagerly.
//!   Both paths enqueue the same kernels over the same buffers.
//! - Every CUDA call is checked; an error after dispatch is `ExecError::Fatal`, and every later
//!   call fails too.

pub mod blas;
pub mod fp8_gemm;
pub mod graph_check;
mod graphs;
pub mod layout;
mod meta;
mod model;
mod scenario;
mod spec;
pub mod spec_check;

use std::ffi::c_void;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context};
use harrier_kernels::cudarc::driver::{result as dr, sys, CudaContext};
use harrier_kernels::{Dtype, Kernels, RowParams, SamplerState, MASK_CAP};
use harrier_shared::protocol::{TokenId, TokenLogprobs};

use super::{ExecCounters, ExecError, Executor, InFlightStep, LaunchHandle};
use crate::batch::{ExecBatch, StepOutput};
use crate::model::{ModelConfig, ModelDir};
use crate::pipeline::{SlotId, NUM_SLOTS};
use crate::sampling::{RowSampler, SamplerScratch};
use graphs::{DecodeGraph, GraphAddrs};
use layout::{Capacities, GraphBuckets, MetaLayout};
use meta::HostRow;
pub use model::GpuModel;
pub use spec::{CudaProposer, CudaSpecConfig};

/// Whether the CUDA driver library can be loaded and reports at least one device.
pub fn cuda_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    if !unsafe { sys::is_culib_present() } {
        return false;
    }
    dr::init().is_ok() && dr::device::get_count().map(|n| n > 0).unwrap_or(false)
}

/// Why `--device cuda` cannot run here, in one line; `None` when it can.
pub fn cuda_unavailable_reason() -> Option<String> {
    // SAFETY: only tries to dlopen the libraries.
    if !unsafe { sys::is_culib_present() } {
        return Some("libcuda could not be loaded (no NVIDIA driver on this machine)".into());
    }
    if let Err(e) = dr::init() {
        return Some(format!("cuInit failed: {e:?}"));
    }
    match dr::device::get_count() {
        Ok(0) | Err(_) => return Some("no CUDA device found".into()),
        _ => {}
    }
    if !harrier_kernels::nvrtc_present() {
        return Some("libnvrtc could not be loaded (needed to compile the kernels)".into());
    }
    // SAFETY: only tries to dlopen the library.
    if !unsafe { harrier_kernels::cudarc::cublas::sys::is_culib_present() } {
        return Some("libcublas could not be loaded".into());
    }
    None
}

pub(crate) fn ck<T>(r: Result<T, dr::DriverError>, what: &str) -> anyhow::Result<T> {
    r.map_err(|e| anyhow!("CUDA error in {what}: {e:?}"))
}

/// A device allocation at a fixed address, freed on drop (the context must be current).
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
}

impl DevBuf {
    pub fn new(bytes: usize) -> anyhow::Result<DevBuf> {
        // SAFETY: a plain allocation, rounded up to 16 bytes (a 16-byte vector or bulk copy of
        // a buffer's tail stays inside it: the decode ring copies FP8 row scales so).
        let ptr = ck(
            unsafe { dr::malloc_sync(bytes.max(1).next_multiple_of(16)) },
            "cuMemAlloc",
        )?;
        Ok(DevBuf { ptr, bytes })
    }
    pub fn at(&self, byte_offset: usize) -> u64 {
        self.ptr + byte_offset as u64
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by `new`, freed once.
        unsafe {
            let _ = dr::free_sync(self.ptr);
        }
    }
}

/// Page-locked host memory (not write-combined: the host reads outputs back), freed on drop.
pub struct HostBuf<T: Copy + Default> {
    ptr: *mut T,
    len: usize,
}

impl<T: Copy + Default> HostBuf<T> {
    pub fn new(len: usize) -> anyhow::Result<Self> {
        // SAFETY: flags 0 = plain pinned memory.
        let p = ck(
            unsafe { dr::malloc_host((len.max(1)) * std::mem::size_of::<T>(), 0) },
            "cuMemHostAlloc",
        )?;
        let ptr = p as *mut T;
        for i in 0..len {
            // SAFETY: within the allocation.
            unsafe { ptr.add(i).write(T::default()) };
        }
        Ok(Self { ptr, len })
    }
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: `len` initialised elements; the device writes only between our events.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as above, exclusive borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: Copy + Default> Drop for HostBuf<T> {
    fn drop(&mut self) {
        // SAFETY: allocated by `new`, freed once.
        unsafe {
            let _ = dr::free_host(self.ptr as *mut c_void);
        }
    }
}

fn new_event(timing: bool) -> anyhow::Result<sys::CUevent> {
    let flags = if timing {
        sys::CUevent_flags::CU_EVENT_DEFAULT
    } else {
        sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
    };
    ck(dr::event::create(flags), "cuEventCreate")
}

/// Refuses head layouts the attention kernels do not take.
fn check_head_layout(mc: &ModelConfig) -> anyhow::Result<()> {
    if !mc.head_dim.is_multiple_of(64) || mc.head_dim > harrier_kernels::MAX_HEAD_DIM {
        bail!(
            "head_dim {} is not supported by the CUDA kernels (a multiple of 64 up to 256)",
            mc.head_dim
        );
    }
    if !mc.num_heads.is_multiple_of(mc.num_kv_heads) {
        bail!(
            "num_heads {} is not a multiple of num_kv_heads {}",
            mc.num_heads,
            mc.num_kv_heads
        );
    }
    Ok(())
}

/// Options of the CUDA executor.
#[derive(Debug, Clone)]
pub struct CudaExecutorConfig {
    pub max_num_seqs: u32,
    pub max_num_batched_tokens: u32,
    pub max_model_len: u32,
    pub block_size: u32,
    /// KV blocks; `None`: from free memory times `gpu_memory_utilization`.
    pub num_kv_blocks: Option<u32>,
    pub gpu_memory_utilization: f64,
    pub device: usize,
    /// Batch sizes to capture decode graphs for (see [`GraphBuckets`]); empty: always eager.
    pub graph_sizes: Vec<usize>,
    /// Storage type of weights, activations and the KV cache.
    pub dtype: Dtype,
    /// A hybrid cache: the sliding-window layers' own pool of (at most) this many blocks, the
    /// engine's [`crate::scheduler::LocalKvConfig`] demand; sized before the full pool, and
    /// given at most half the memory budget.
    pub local_kv_blocks: Option<u32>,
    /// Decode steps of up to this many GEMM rows take the fused small-batch path (skinny
    /// tensor-core GEMMs with norms, residual adds and the gated activation fused; bf16
    /// only, see [`GpuModel::forward`]); 0 turns it off.
    pub fused_max_rows: usize,
    /// Batch-1 decode steps of models it takes run as one persistent launch (the decode
    /// ring, [`model`]'s `ring`): `Some(on)`, or `None` where its copies fit in
    /// 1/[`RING_AUTO_MEMORY_DIVISOR`] of the device's memory (`model::ring_auto`).
    pub decode_ring: Option<bool>,
    /// Store the projections and the output head in FP8 (`--quantization fp8`; bf16 only).
    /// FP8 checkpoints are FP8 without it.
    pub fp8: bool,
    /// Speculative decoding (`--speculative-model`, `--speculative-method ngram`): the
    /// proposer and the proposals per round (see [`spec`]).
    pub speculative: Option<CudaSpecConfig>,
}

/// Words of row state (penalty rows' prompt and output tokens, logit_bias pairs) one step can
/// stage for `init_row_state` (1 MiB of pinned memory per slot); a row init that does not fit
/// samples on the host.
const ROW_STATE_WORDS_PER_STEP: usize = 1 << 18;

/// Device memory set aside per captured graph when sizing the KV cache (the graphs are
/// captured after the KV cache exists, since they embed its address). Start-up measures the
/// real cost and warns if it is larger.
const GRAPH_RESERVE_BYTES: usize = 2 << 20;

/// One ping-pong slot's buffers and the host state of its step in flight.
struct Slot {
    meta_h: HostBuf<i32>,
    meta_d: DevBuf,
    inits_h: HostBuf<RowParams>,
    inits_d: DevBuf,
    out_d: DevBuf,
    out_h: HostBuf<i32>,
    /// Host-sampled tokens (row, token) uploaded to the rows' pending slots.
    host_tok_h: HostBuf<i32>,
    host_tok_d: DevBuf,
    /// Row-state inits (`meta::stage_row_state`): `[rows | offsets (3 max_rows + 1) | data]`.
    state_h: HostBuf<i32>,
    state_d: DevBuf,
    /// N-gram speculation: row inits' history tokens (`meta::stage_ngram_inits`).
    ngram: Option<(HostBuf<i32>, DevBuf)>,
    step_start: sys::CUevent,
    step_done: sys::CUevent,
    copy_done: sys::CUevent,
    /// Recorded on the upload stream after the slot's metadata copy (`HARRIER_UPLOAD_STREAM`).
    meta_ready: sys::CUevent,
    /// Recorded after an eager speculative step's proposer work when timing (`record_gaps`).
    draft_done: sys::CUevent,
    drafted: bool,
    // The step in flight.
    n_samples: usize,
    /// Logits rows of the step (`n_samples` unless it has speculative rounds).
    n_logits: usize,
    /// (index among samples, row) of host-sampled sequences.
    host_samples: Vec<(usize, u32)>,
    host_results: Vec<(usize, TokenId, Option<TokenLogprobs>)>,
    /// Structured outputs: `[logits rows | mask words]` of the step's constrained rows,
    /// allocated on first use (most servers never constrain).
    masks: Option<(HostBuf<u32>, DevBuf)>,
}

/// GPU time between consecutive steps (end of step t's sampling to start of step t+1's inputs).
#[derive(Debug, Clone, Default)]
pub struct GapStats {
    pub gaps_ms: Vec<f32>,
    pub step_ms: Vec<f32>,
    /// Eager speculative steps with proposer work: the proposer's share of `step_ms` (from the
    /// step's start to the end of its drafting; graph replays cannot be split).
    pub draft_ms: Vec<f32>,
}

impl GapStats {
    /// The median of `v` (NaN when empty).
    pub fn median(v: &[f32]) -> f32 {
        let mut v = v.to_vec();
        v.sort_by(f32::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f32::NAN)
    }
}

pub struct CudaExecutor {
    compute: sys::CUstream,
    copy: sys::CUstream,
    /// The stream that copies a step's metadata (`upload_head`'s part) while the step before
    /// computes; the compute stream only waits on its event. Between two graph replays the copy
    /// on the compute stream cost ~10 us a step (H100, session 15: 1B 1.190 -> 1.180 ms at
    /// batch 1, 1.361 -> 1.348 at 8). The slot's device metadata is free when its next step is
    /// launched (I6: the slot's previous step was committed). `HARRIER_UPLOAD_STREAM=0`: the
    /// copy on the compute stream, to compare.
    upload: Option<sys::CUstream>,
    kernels: Kernels,
    model: GpuModel,
    /// Speculative decoding (a draft model), if on.
    spec: Option<spec::SpecDecoder>,
    caps: Capacities,
    layout: MetaLayout,
    /// Usable KV blocks (the engine's); block `num_kv_blocks` is the padding rows' scratch.
    num_kv_blocks: u32,
    /// The same for the sliding layers' pool of a hybrid cache.
    num_local_kv_blocks: Option<u32>,
    rows_d: DevBuf,
    pending_d: DevBuf,
    /// Per-row block tables, `[max_rows + 1, max_blocks_per_seq]` (the last row: padding).
    row_bt_d: DevBuf,
    /// Per-row sampling state (`SamplerState`): u16 output counts `[max_rows, vocab]`, prompt
    /// bits `[max_rows, words]`, logit_bias ids and values `[max_rows, LOGIT_BIAS_CAP]`.
    pen_counts_d: DevBuf,
    pen_seen_d: DevBuf,
    /// Partial maxima of the logits rows for greedy sampling (`row_argmax_parts`), shared by
    /// the target's and the draft's logits (stream order).
    argmax_parts_d: DevBuf,
    bias_ids_d: DevBuf,
    bias_vals_d: DevBuf,
    slots: Vec<Slot>,
    /// Per-row scratch of `meta::validate` (all zero between calls).
    row_marks: Vec<u8>,
    buckets: GraphBuckets,
    /// Per slot, one graph per bucket (same order as `buckets.sizes()`); empty when eager.
    graphs: Vec<Vec<DecodeGraph>>,
    /// Speculation: buckets of steps of rounds and their graphs per slot (see [`spec`]).
    round_buckets: GraphBuckets,
    round_graphs: Vec<Vec<DecodeGraph>>,
    /// Per slot, beside `graphs` (same index): the bucket's short-context graph, captured
    /// without `attention_combine` launches, for buckets whose attention splits (small
    /// batches) in engines without speculation. A decode step replays it when every token's
    /// context fits one split ([`CudaExecutor::short_context`]): the combine launches are then
    /// no-ops, and each costs more than a launch, since it sits between attention and the o
    /// projection and keeps o from loading its weights while attention runs (H100, 1B, 256
    /// keys: 1.174 ms per step without them at batch 1, 1.204 with; docs/benchmarks.md).
    short_graphs: Vec<Vec<Option<DecodeGraph>>>,
    /// Short-context steps leave `attention_combine` out: engines without speculation, unless
    /// `HARRIER_SHORT_GRAPHS=0` (to compare).
    short_steps: bool,
    counters: ExecCounters,
    rows: Vec<Option<HostRow>>,
    scratch: SamplerScratch,
    /// One row of logits on the host, for host-sampled rows (reused: no per-step allocation).
    host_logits: Vec<f32>,
    next_step: u64,
    failed: Option<String>,
    /// Gap measurement: every step's events are read against `gap_ref` (recorded before the
    /// first timed step), since a slot's events are re-recorded by a later step that may be
    /// launched before the step in between is waited for. The last completed step's end, in
    /// ms after the reference.
    gap_ref: Option<sys::CUevent>,
    last_done_ms: Option<f32>,
    pub record_gaps: bool,
    pub gaps: GapStats,
    /// Replay captured graphs for decode steps (on when graphs were captured). Tools turn it
    /// off to compare eager and graph runs on one executor.
    pub use_graphs: bool,
    /// Small decode batches split attention over the context (graphs are captured so); tools
    /// turn it off to compare steps without splits (graphs: [`CudaExecutor::set_attention_modes`]).
    pub split_decode_attention: bool,
    /// Prefill runs of 8+ tokens use the tiled `prefill_attention` kernel (bf16 models with
    /// head dim 64 or 128); tools turn it off to compare with the per-token kernel.
    pub tiled_prefill: bool,
    /// Whether single-split steps use `paged_attention_gqa`: `None` follows
    /// [`per_token_kernels`] (grp where it has an instance, else
    /// [`layout::use_grouped_attention`]); tools force it on or off to compare.
    pub grouped_attention: Option<bool>,
    ctx: Arc<CudaContext>,
}

// SAFETY: the raw CUDA handles are used only through `&mut self`, with the context bound to the
// calling thread at the start of every call.
unsafe impl Send for CudaExecutor {}

/// `--decode-ring auto` takes the ring where its transposed copies of o and down
/// (`model::ring_copy_bytes`, a quarter of a Llama's weight bytes, taken from the KV cache)
/// fit in at most this fraction of the device's memory (1/16: 5 GB of an 80 GB H100, the 8B's
/// 4.8 GB; a 70B's 48 GB never). The ring wins at every size it takes (session 23 on an H200,
/// batch 1, context 512, against the launches in one process: the 1B 0.927 vs 0.951 ms a step,
/// 2.5%; the 3B 2.175 vs 2.324, 6.4%; the 8B's ring 4.22 in session 22, its launches 4.76 in
/// session 20), and the copies cost the 1B 0.7 GB of KV cache (~1% of an H100's), the 3B
/// 1.9 GB, the 8B 4.8 GB.
/// (Until session 23: hidden sizes of at least 4,096, when the 3B's ring won by 2.6%.)
pub const RING_AUTO_MEMORY_DIVISOR: usize = 16;

/// Facts reported at start-up.
#[derive(Debug, Clone)]
pub struct CudaStartInfo {
    pub device_name: String,
    pub arch: &'static str,
    pub dtype: Dtype,
    pub weight_bytes: usize,
    /// The weight bytes a decode step reads (`model::step_weight_bytes`).
    pub decode_bytes: usize,
    pub activation_bytes: usize,
    pub kv_blocks: u32,
    pub kv_tokens: u64,
    pub kv_bytes: usize,
    /// Blocks of the sliding layers' pool (hybrid caches) and their bytes.
    pub local_kv_blocks: Option<u32>,
    pub local_kv_bytes: usize,
    pub kernels_from_cache: bool,
    /// Kernels launch with programmatic dependent launch (sm_90+, `HARRIER_PDL`).
    pub pdl: bool,
    /// FP8 models: steps past the skinny kernels run FP8 tensor-core GEMMs (sm_89+,
    /// `HARRIER_FP8_GEMM`) rather than dequantizing to bf16.
    pub fp8_gemm: bool,
    /// Batch sizes with captured decode graphs (empty: eager only).
    pub graph_sizes: Vec<usize>,
    pub graph_count: usize,
    pub graph_capture_ms: f64,
    /// Device memory the captured graphs took (free memory before minus after).
    pub graph_bytes: usize,
    /// Batch-1 decode steps run as the decode ring (`--decode-ring`, and the model takes it).
    pub decode_ring: bool,
}

impl CudaExecutor {
    /// Loads the model onto device `cfg.device`, compiles the kernels and sizes the KV cache.
    pub fn new(
        dir: &ModelDir,
        cfg: &CudaExecutorConfig,
    ) -> anyhow::Result<(CudaExecutor, CudaStartInfo)> {
        if let Some(why) = cuda_unavailable_reason() {
            bail!("{why}");
        }
        let ctx = ck(CudaContext::new(cfg.device), "creating the CUDA context")?;
        // SAFETY: we order our streams with our own events and never use cudarc's tracked slices.
        unsafe { ctx.disable_event_tracking() };
        ck(ctx.bind_to_thread(), "binding the context")?;
        let (major, minor) = ck(ctx.compute_capability(), "compute capability")?;
        let arch = harrier_kernels::arch_name(major, minor)?;
        let device_name = ctx.name().unwrap_or_else(|_| "?".into());
        // NVRTC compiles the kernels on a device's first start (tens of seconds; cached on
        // disk afterwards): a spinner on a terminal, log lines otherwise.
        let compiling = crate::progress::StartupProgress::new(
            format!("compiling or loading the CUDA kernels for {arch}"),
            0,
            crate::progress::Unit::Items,
        );
        let kernels = Kernels::load(arch, cfg.dtype).context("compiling/loading the kernels")?;
        compiling.finish();
        let compute = ck(
            dr::stream::create(dr::stream::StreamKind::NonBlocking),
            "cuStreamCreate",
        )?;
        let copy = ck(
            dr::stream::create(dr::stream::StreamKind::NonBlocking),
            "cuStreamCreate",
        )?;
        let upload = if harrier_kernels::switch_on("HARRIER_UPLOAD_STREAM") {
            Some(ck(
                dr::stream::create(dr::stream::StreamKind::NonBlocking),
                "cuStreamCreate",
            )?)
        } else {
            None
        };
        let mc = dir.config.clone();
        check_head_layout(&mc).with_context(|| format!("model {}", dir.path.display()))?;
        let mut caps = Capacities::new(
            cfg.max_num_batched_tokens as usize,
            cfg.max_num_seqs as usize,
            cfg.max_model_len as usize,
            cfg.block_size as usize,
        );
        caps.hybrid = cfg.local_kv_blocks.is_some();
        if let Some(sc) = &cfg.speculative {
            if caps.hybrid {
                bail!("speculative decoding does not combine with window-sized KV yet");
            }
            caps = caps.with_spec(sc.k, cfg.max_model_len as usize);
        }
        let elem = cfg.dtype.size();
        let scratch_sizes = layout::ScratchSizes::new(&mc, &caps, elem);
        let mut model = GpuModel::load(dir, compute, &caps, &scratch_sizes, cfg.dtype, cfg.fp8)?;
        model.fused_max_rows = cfg.fused_max_rows;
        let ring = match cfg.decode_ring {
            Some(on) => on,
            None => {
                let total = ck(dr::mem_get_info(), "cuMemGetInfo")?.1;
                let auto = model::ring_auto(&mc, model.fp8, total);
                if !auto {
                    tracing::info!(
                        copies_mib = model::ring_copy_bytes(&mc, model.fp8) >> 20,
                        device_mib = total >> 20,
                        "decode ring off (auto): its transposed copies would take more than 1/{RING_AUTO_MEMORY_DIVISOR} of the device's memory (--decode-ring on takes it)"
                    );
                }
                auto
            }
        };
        if ring {
            let attr = |a| ck(ctx.attribute(a), "device attribute").map(|v| v as usize);
            let sms = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
            let optin = attr(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )?;
            match (major >= 9).then(|| model.setup_ring(sms, optin, &kernels)) {
                Some(Ok(pairs)) => {
                    let (slots, slot_bytes) = model
                        .with_ring_launch(|l| (l.slots, l.slot_bytes))
                        .unwrap_or_default();
                    tracing::info!(
                        sms,
                        pairs,
                        slots,
                        slot_bytes,
                        "batch-1 decode steps run as one persistent launch (the decode ring)"
                    )
                }
                Some(Err(why)) => tracing::info!("decode ring off: {why:#}"),
                None => tracing::info!("decode ring off: it needs sm_90"),
            }
        }
        if model.fp8 && harrier_kernels::switch_on("HARRIER_FP8_GEMM") {
            match model.enable_fp8_gemm(arch, caps.max_tokens.max(caps.max_seqs)) {
                Ok(()) => tracing::info!("FP8 steps past the skinny kernels run FP8 tensor-core GEMMs (cuBLASLt, per-token activation scales)"),
                Err(e) => tracing::warn!("FP8 steps past the skinny kernels dequantize to bf16: {e:#}"),
            }
        }
        let mut spec = match &cfg.speculative {
            None => None,
            Some(sc) => Some(spec::SpecDecoder::load(sc, dir, compute, &caps, cfg.dtype)?),
        };
        let layout = MetaLayout::new(&caps);
        let max_rows = caps.max_seqs;
        // Output words per slot: one token per sampled sequence, or with speculation the
        // counts and then `1 + k` tokens per sequence.
        let out_words = match caps.spec_k {
            0 => max_rows,
            k => max_rows * (k + 2),
        };
        // One more row: the graph padding row (zeroed: greedy, no state), which round graphs
        // draft for.
        let rows_d = DevBuf::new((max_rows + 1) * std::mem::size_of::<RowParams>())?;
        let pending_d = DevBuf::new(max_rows * 4)?;
        anyhow::ensure!(
            (max_rows + 1) * caps.max_blocks_per_seq < i32::MAX as usize,
            "max_num_seqs x max_model_len / block_size is too large for 32-bit block-table indices"
        );
        // Full tables, then (hybrid) the sliding layers' tables.
        let row_bt_d = DevBuf::new(caps.bt_words() * if caps.hybrid { 2 } else { 1 } * 4)?;
        let pen_counts_d = DevBuf::new(scratch_sizes.penalty_counts)?;
        let pen_seen_d = DevBuf::new(scratch_sizes.penalty_seen)?;
        let argmax_parts_d = DevBuf::new(caps.max_logits() * harrier_kernels::ARGMAX_PARTS * 8)?;
        let bias_ids_d = DevBuf::new(scratch_sizes.logit_bias / 2)?;
        let bias_vals_d = DevBuf::new(scratch_sizes.logit_bias / 2)?;
        // SAFETY: fresh allocations of those sizes; zeroed on the compute stream.
        unsafe {
            ck(
                dr::memset_d8_async(rows_d.ptr, 0, rows_d.bytes, compute),
                "memset",
            )?;
            ck(
                dr::memset_d8_async(pending_d.ptr, 0, pending_d.bytes, compute),
                "memset",
            )?;
            ck(
                dr::memset_d8_async(row_bt_d.ptr, 0, row_bt_d.bytes, compute),
                "memset",
            )?;
        }
        let mut slots = Vec::with_capacity(NUM_SLOTS);
        for _ in 0..NUM_SLOTS {
            slots.push(Slot {
                meta_h: HostBuf::new(layout.len)?,
                meta_d: DevBuf::new(layout.bytes())?,
                inits_h: HostBuf::new(max_rows)?,
                inits_d: DevBuf::new(max_rows * std::mem::size_of::<RowParams>())?,
                out_d: DevBuf::new(out_words * 4)?,
                out_h: HostBuf::new(out_words)?,
                host_tok_h: HostBuf::new(2 * max_rows)?,
                host_tok_d: DevBuf::new(2 * max_rows * 4)?,
                state_h: HostBuf::new(4 * max_rows + 1 + ROW_STATE_WORDS_PER_STEP)?,
                state_d: DevBuf::new((4 * max_rows + 1 + ROW_STATE_WORDS_PER_STEP) * 4)?,
                ngram: match spec.as_ref().and_then(|s| s.ngram_hist()) {
                    Some(_) => {
                        let words = meta::ngram_stage_words(max_rows);
                        Some((HostBuf::new(words)?, DevBuf::new(words * 4)?))
                    }
                    None => None,
                },
                step_start: new_event(true)?,
                step_done: new_event(true)?,
                copy_done: new_event(false)?,
                meta_ready: new_event(false)?,
                draft_done: new_event(true)?,
                drafted: false,
                n_samples: 0,
                n_logits: 0,
                host_samples: Vec::new(),
                host_results: Vec::new(),
                masks: None,
            });
        }
        // SAFETY: stream created above.
        ck(
            // SAFETY: `compute` is a live stream owned by this executor.
            unsafe { dr::stream::synchronize(compute) },
            "synchronising after the upload",
        )?;
        let bpb = layout::kv_bytes_per_block(&mc, caps.block_size, elem);
        // With speculation: graphs of steps of rounds and of placed decode steps (see
        // [`spec`]); `HARRIER_SPEC_GRAPHS` picks them for debugging.
        let spec_graphs = spec::SpecGraphs::from_env()?;
        let graph_sizes: &[usize] = match (&spec, spec_graphs.decode) {
            (Some(_), false) => &[],
            _ => &cfg.graph_sizes,
        };
        let buckets = GraphBuckets::new(graph_sizes, caps.max_seqs.min(caps.max_tokens));
        // Steps of rounds: (1 + k) tokens per sequence within the token budget.
        let round_buckets = match &spec {
            Some(sp) if spec_graphs.rounds => GraphBuckets::new(
                &cfg.graph_sizes,
                (caps.max_tokens / (1 + sp.k))
                    .min(caps.max_seqs)
                    .min(spec::ROUND_GRAPH_MAX_SEQS),
            ),
            _ => GraphBuckets::new(&[], 0),
        };
        // Short-context twins of the decode buckets whose attention splits (see `short_graphs`).
        let short_steps = spec.is_none() && harrier_kernels::switch_on("HARRIER_SHORT_GRAPHS");
        let short_buckets = match short_steps {
            true => buckets
                .sizes()
                .iter()
                .filter(|&&b| decode_split_count(&kernels, &mc, b) > 1)
                .count(),
            false => 0,
        };
        let num_graphs =
            (buckets.sizes().len() + round_buckets.sizes().len() + short_buckets) * NUM_SLOTS;
        let dropped: Vec<usize> = graph_sizes
            .iter()
            .copied()
            .filter(|s| !buckets.sizes().contains(s))
            .collect();
        if !dropped.is_empty() {
            tracing::warn!(
                ?dropped,
                max = caps.max_seqs.min(caps.max_tokens),
                "CUDA graph sizes above min(max_num_seqs, max_num_batched_tokens) (or 0) ignored"
            );
        }
        // A hybrid cache: the sliding layers' pool first (its demand, at most half the
        // budget), then the full layers' blocks cost only those layers' bytes.
        let local_bpb = layout::local_kv_bytes_per_block(&mc, caps.block_size, elem);
        let bpb = if caps.hybrid { bpb - local_bpb } else { bpb };
        // The draft's KV shares the target's block ids: one block costs both.
        let draft_bpb = spec.as_ref().and_then(|s| s.draft()).map_or(0, |d| {
            layout::kv_bytes_per_block(&d.config, caps.block_size, elem)
        });
        let bpb = bpb + draft_bpb;
        let (free, total) = ck(dr::mem_get_info(), "cuMemGetInfo")?;
        let budget = (total as f64 * cfg.gpu_memory_utilization) as usize;
        // One more block than the engine gets in each pool: the graph padding rows' scratch.
        let num_local = cfg.local_kv_blocks.map(|want| {
            let fit = (budget.saturating_sub(total - free) / 2) / local_bpb.max(1);
            match cfg.num_kv_blocks {
                Some(_) => want as usize + 1,
                None => (want as usize).min(fit) + 1,
            }
        });
        let local_bytes = num_local.map_or(0, |n| n * local_bpb);
        let num_kv_blocks = match cfg.num_kv_blocks {
            Some(n) => n as usize + 1,
            None => {
                // Everything but the KV cache and the graphs is allocated now (weights,
                // activations at their largest, slots, cuBLAS workspace): the KV cache gets the
                // rest of the budget.
                let used = total - free + num_graphs * GRAPH_RESERVE_BYTES + local_bytes;
                layout::kv_blocks_for(total, used, cfg.gpu_memory_utilization, bpb)
            }
        };
        if num_kv_blocks < 3 {
            bail!(
                "no room for the KV cache ({num_kv_blocks} blocks of {bpb} bytes) with --gpu-memory-utilization {}",
                cfg.gpu_memory_utilization
            );
        }
        let num_kv_blocks = num_kv_blocks.min(i32::MAX as usize / caps.block_size) as u32;
        let num_local = num_local.map(|n| n.min(i32::MAX as usize / caps.block_size) as u32);
        if let Some(n) = num_local {
            anyhow::ensure!(
                n >= 3,
                "no room for the sliding-window KV pool ({n} blocks)"
            );
        }
        model.alloc_kv(
            num_kv_blocks as usize,
            num_local.map(|n| n as usize),
            caps.block_size,
        )?;
        if let Some(s) = &mut spec {
            let (state_mib, k) = (s.state_bytes() >> 20, s.k);
            match s.draft_mut() {
                Some(d) => {
                    d.fused_max_rows = cfg.fused_max_rows;
                    d.alloc_kv(num_kv_blocks as usize, None, caps.block_size)?;
                    let target_bpb = bpb - draft_bpb;
                    tracing::info!(
                        k,
                        draft_weights_mib = d.weight_bytes >> 20,
                        target_kv_mib = (num_kv_blocks as usize * target_bpb) >> 20,
                        draft_kv_mib = (num_kv_blocks as usize * draft_bpb) >> 20,
                        draft_state_mib = state_mib,
                        graphs = ?spec_graphs,
                        "speculative decoding with a draft model on the GPU (the KV budget split by bytes per block; draft prefill beside the target's)"
                    );
                }
                None => tracing::info!(
                    k = s.k,
                    history_mib = state_mib,
                    graphs = ?spec_graphs,
                    "speculative decoding with n-gram lookup on the GPU (per-row token histories on the device)"
                ),
            }
        }
        let usable = num_kv_blocks - 1;
        let mut info = CudaStartInfo {
            device_name,
            arch,
            dtype: cfg.dtype,
            weight_bytes: model.weight_bytes,
            decode_bytes: model.decode_bytes,
            activation_bytes: scratch_sizes.total(),
            kv_blocks: usable,
            kv_tokens: usable as u64 * caps.block_size as u64,
            kv_bytes: num_kv_blocks as usize * bpb,
            local_kv_blocks: num_local.map(|n| n - 1),
            local_kv_bytes: num_local.map_or(0, |n| n as usize * local_bpb),
            kernels_from_cache: kernels.from_cache,
            pdl: kernels.pdl(),
            fp8_gemm: model.fp8_gemm_on(),
            graph_sizes: buckets.sizes().to_vec(),
            graph_count: num_graphs,
            graph_capture_ms: 0.0,
            graph_bytes: 0,
            decode_ring: model.ring_on(),
        };
        let mut exec = CudaExecutor {
            compute,
            copy,
            upload,
            kernels,
            model,
            spec,
            caps,
            layout,
            num_kv_blocks: usable,
            num_local_kv_blocks: num_local.map(|n| n - 1),
            rows_d,
            pending_d,
            row_bt_d,
            pen_counts_d,
            pen_seen_d,
            argmax_parts_d,
            bias_ids_d,
            bias_vals_d,
            slots,
            row_marks: vec![0; max_rows],
            buckets,
            graphs: (0..NUM_SLOTS).map(|_| Vec::new()).collect(),
            round_buckets,
            round_graphs: (0..NUM_SLOTS).map(|_| Vec::new()).collect(),
            short_graphs: (0..NUM_SLOTS).map(|_| Vec::new()).collect(),
            short_steps,
            counters: ExecCounters::default(),
            rows: (0..max_rows).map(|_| None).collect(),
            scratch: SamplerScratch::default(),
            host_logits: Vec::new(),
            next_step: 0,
            failed: None,
            gap_ref: None,
            last_done_ms: None,
            record_gaps: false,
            gaps: GapStats::default(),
            use_graphs: true,
            split_decode_attention: true,
            tiled_prefill: cfg.dtype == Dtype::Bf16
                && harrier_kernels::prefill_attention_supports(mc.head_dim),
            grouped_attention: None,
            ctx,
        };
        if !exec.buckets.is_empty() || !exec.round_buckets.is_empty() {
            let (free_before, _) = ck(dr::mem_get_info(), "cuMemGetInfo")?;
            let t0 = std::time::Instant::now();
            exec.capture_graphs()
                .context("capturing the decode graphs")?;
            info.graph_capture_ms = t0.elapsed().as_secs_f64() * 1e3;
            let (free_after, _) = ck(dr::mem_get_info(), "cuMemGetInfo")?;
            info.graph_bytes = free_before.saturating_sub(free_after);
            if info.graph_bytes > num_graphs * GRAPH_RESERVE_BYTES && cfg.num_kv_blocks.is_none() {
                tracing::warn!(
                    graph_mib = info.graph_bytes >> 20,
                    reserved_mib = (num_graphs * GRAPH_RESERVE_BYTES) >> 20,
                    "the decode graphs took more memory than the KV sizing set aside"
                );
            }
        }
        Ok((exec, info))
    }

    /// The addresses a graph of `slot` runs over.
    fn graph_addrs(&self, slot: usize) -> GraphAddrs {
        GraphAddrs {
            meta: self.slots[slot].meta_d.ptr,
            row_block_tables: self.row_bt_d.ptr,
            pending: self.pending_d.ptr,
            logits: self.model.logits_ptr(),
        }
    }

    /// The forward pass's view of `slot`'s metadata for `n_tokens` tokens and `n_samples`
    /// sampled rows; the attention plan (splits, tiles, grouped kernel) is the caller's.
    fn step_meta(
        &self,
        slot: usize,
        n_tokens: usize,
        n_samples: usize,
        (decode_splits, grouped_attention, grp_attention): (Option<usize>, bool, Option<u32>),
        (n_pf_tiles, n_att_listed): (usize, usize),
    ) -> model::StepMeta {
        let (d, l) = (&self.slots[slot].meta_d, &self.layout);
        model::StepMeta {
            n_tokens,
            n_samples,
            tok_src: d.at(l.tok_src * 4),
            positions: d.at(l.positions * 4),
            slot_mapping: d.at(l.slot_mapping * 4),
            slot_mapping_local: d.at(l.slot_mapping_local * 4),
            row_block_tables_local: self.row_bt_d.at(self.caps.bt_words() * 4),
            tok_row: d.at(l.tok_row * 4),
            logit_rows: d.at(l.logit_rows * 4),
            row_block_tables: self.row_bt_d.ptr,
            bt_stride: self.caps.max_blocks_per_seq,
            pending: self.pending_d.ptr,
            grouped_attention,
            grp_attention,
            gemm_rows: None,
            decode_splits,
            short_context: false,
            pf_tiles: d.at(l.pf_tiles * 4),
            n_pf_tiles,
            att_list: d.at(l.att_list * 4),
            n_att_listed,
        }
    }

    /// Fills sequences `range` of a step of rounds with graph padding
    /// ([`meta::fill_round_padding`]).
    fn fill_round_padding(&mut self, slot: usize, range: std::ops::Range<usize>, k: usize) {
        meta::fill_round_padding(
            self.slots[slot].meta_h.as_mut_slice(),
            &self.layout,
            range,
            k,
            (self.num_kv_blocks as usize, self.caps.block_size),
            self.caps.max_seqs,
        );
    }

    /// Fills token rows `range` with graph padding; placement entries from `placed` on
    /// become no-ops ([`meta::fill_padding`]).
    fn fill_padding(&mut self, slot: usize, range: std::ops::Range<usize>, placed: usize) {
        meta::fill_padding(
            self.slots[slot].meta_h.as_mut_slice(),
            &self.layout,
            (range, placed),
            (
                self.num_kv_blocks as usize,
                self.num_local_kv_blocks.map(|n| n as usize),
            ),
            self.caps.block_size,
            self.caps.max_seqs,
        );
    }

    /// Uploads the slot's token and sequence sections (one copy: they are adjacent) on `st`.
    ///
    /// # Safety
    /// The slot's pinned buffer must not be rewritten before the copy runs (I6), and no work
    /// may still read the slot's device metadata.
    unsafe fn upload_head(&self, slot: usize, st: sys::CUstream) -> anyhow::Result<()> {
        let s = &self.slots[slot];
        let n = self.layout.bt_index;
        // SAFETY: `meta_h` and `meta_d` hold `layout.len >= n` words.
        ck(
            unsafe { dr::memcpy_htod_async(s.meta_d.ptr, &s.meta_h.as_slice()[..n], st) },
            "metadata H2D",
        )
    }

    /// Captures a graph per (slot, bucket). Each bucket first runs once eagerly over padding
    /// rows (cuBLAS settles its choices outside the capture), then is captured. With
    /// speculation, decode graphs also place their entries, and steps of rounds get graphs of
    /// their own ([`spec`]).
    fn capture_graphs(&mut self) -> anyhow::Result<()> {
        let st = self.compute;
        let (bt, state) = (self.block_tables(), self.sampler_state());
        let rows_d = self.rows_d.ptr;
        for slot in 0..NUM_SLOTS {
            for rounds in [false, true] {
                let (sizes, k) = match (rounds, &self.spec) {
                    (false, sp) => (
                        self.buckets.sizes().to_vec(),
                        sp.as_ref().map_or(0, |s| s.k),
                    ),
                    (true, Some(sp)) => (self.round_buckets.sizes().to_vec(), sp.k),
                    (true, None) => continue,
                };
                let Some(&largest) = sizes.last() else {
                    continue;
                };
                if rounds {
                    self.fill_round_padding(slot, 0..largest, k);
                } else {
                    self.fill_padding(slot, 0..largest, 0);
                }
                // SAFETY: the upload is synchronised before the pinned buffer changes again.
                unsafe {
                    self.upload_head(slot, st)?;
                    ck(dr::stream::synchronize(st), "sync")?;
                }
                for &size in &sizes {
                    let t = if rounds { (1 + k) * size } else { size };
                    let plan = self.attention_plan(t, !rounds);
                    let m = self.step_meta(slot, t, t, plan, (0, 0));
                    let draft = match rounds {
                        true => meta::DraftCounts::rounds(size),
                        false => meta::DraftCounts::NONE,
                    };
                    let addrs = self.graph_addrs(slot);
                    let (model, kernels) = (&mut self.model, &self.kernels);
                    let meta_d = &self.slots[slot].meta_d;
                    let l = &self.layout;
                    let mut spec = self.spec.as_mut();
                    let mut body = || -> anyhow::Result<()> {
                        // SAFETY: the metadata holds `size` padding rows (or rounds); only
                        // kernel launches and cuBLAS calls are enqueued under capture.
                        unsafe {
                            match spec.as_deref_mut() {
                                None => model.forward(kernels, st, &m),
                                Some(sp) => sp.enqueue_step(
                                    kernels,
                                    st,
                                    model,
                                    (meta_d, l),
                                    (draft, size),
                                    &m,
                                    (rows_d, state),
                                    (bt, None),
                                ),
                            }
                        }
                    };
                    // SAFETY: as above; the warm-up is synchronised before the capture.
                    let g = unsafe {
                        body()?;
                        ck(dr::stream::synchronize(st), "warm-up forward")?;
                        DecodeGraph::capture(st, size, addrs, body)?
                    };
                    if rounds {
                        self.round_graphs[slot].push(g);
                        continue;
                    }
                    self.graphs[slot].push(g);
                    let short = match self.short_twin(plan.0) {
                        true => {
                            let m = model::StepMeta {
                                short_context: true,
                                ..m
                            };
                            let (model, kernels) = (&mut self.model, &self.kernels);
                            // SAFETY: as above (no speculation: the plain forward pass).
                            Some(unsafe {
                                DecodeGraph::capture(st, size, addrs, || {
                                    model.forward(kernels, st, &m)
                                })?
                            })
                        }
                        false => None,
                    };
                    self.short_graphs[slot].push(short);
                }
            }
        }
        // SAFETY: our stream.
        ck(unsafe { dr::stream::synchronize(st) }, "sync after capture")
    }

    /// Clusters of `size` blocks of the decode ring's launch that can be resident at once
    /// (`None` without a ring): `harrier-cuda-tool ring-clusters`, for designs that would
    /// take a KV head's stages into a cluster (docs/cuda.md, "The decode ring").
    pub fn ring_max_clusters(&self, size: u32) -> anyhow::Result<Option<u32>> {
        self.model
            .with_ring_launch(|l| self.kernels.ring_max_clusters(l, size))
            .transpose()
    }

    /// Whether batch-1 decode steps run as the decode ring now.
    pub fn decode_ring(&self) -> bool {
        self.model.ring_on()
    }

    /// Turns the decode ring on or off for batch-1 decode steps (where the model has it);
    /// graphs are recaptured when that changes them. Returns whether the model has the ring.
    pub fn set_decode_ring(&mut self, on: bool) -> anyhow::Result<bool> {
        match self.model.set_ring(on) {
            None => Ok(false),
            Some(false) => Ok(true),
            Some(true) => self.recapture_graphs().map(|()| true),
        }
    }

    /// The decode ring's last traced launch (`HARRIER_RING_TRACE=1`): per-stage times, layers
    /// and blocks; `None` without a ring or trace. Call with nothing in flight.
    pub fn ring_trace(&self) -> anyhow::Result<Option<(Vec<u64>, usize, usize)>> {
        self.model.ring_trace()
    }

    /// Steps of up to `max_rows` GEMM rows take the fused small-batch path (0: never; f32
    /// models never do). Captured graphs are recaptured so that replays follow; call between
    /// steps (nothing in flight).
    pub fn set_fused_max_rows(&mut self, max_rows: usize) -> anyhow::Result<()> {
        self.model.fused_max_rows = max_rows;
        if let Some(d) = self.spec.as_mut().and_then(|s| s.draft_mut()) {
            d.fused_max_rows = max_rows;
        }
        self.recapture_graphs()
    }

    /// How decode steps run per-token attention: split over the context for small batches
    /// (`split`; the default) and which unsplit kernel (`grouped`, see
    /// [`CudaExecutor::grouped_attention`]). Captured graphs are recaptured when this changes
    /// them, so tools can compare graph steps with and without splits; call between steps.
    pub fn set_attention_modes(
        &mut self,
        split: bool,
        grouped: Option<bool>,
    ) -> anyhow::Result<()> {
        if (split, grouped) == (self.split_decode_attention, self.grouped_attention) {
            return Ok(());
        }
        self.split_decode_attention = split;
        self.grouped_attention = grouped;
        self.recapture_graphs()
    }

    /// Captures the graphs again if any are captured (after a change to what they hold).
    fn recapture_graphs(&mut self) -> anyhow::Result<()> {
        if self
            .graphs
            .iter()
            .chain(&self.round_graphs)
            .any(|g| !g.is_empty())
        {
            for g in self.graphs.iter_mut().chain(&mut self.round_graphs) {
                g.clear();
            }
            for g in &mut self.short_graphs {
                g.clear();
            }
            self.capture_graphs()?;
        }
        Ok(())
    }

    /// Whether the model's projections and output head hold FP8 weights.
    pub fn fp8(&self) -> bool {
        self.model.fp8
    }

    /// See [`CudaExecutor::set_fused_max_rows`].
    pub fn fused_max_rows(&self) -> usize {
        self.model.fused_max_rows
    }

    /// Small-batch GEMMs through our `gemv_bf16` (default) or cuBLAS. Affects eager steps
    /// only: captured graphs keep what they were captured with.
    pub fn set_custom_gemv(&mut self, on: bool) {
        self.model.blas.use_gemv = on;
    }

    /// The per-row block tables as the kernels take them.
    fn block_tables(&self) -> harrier_kernels::BlockTables {
        harrier_kernels::BlockTables {
            ptr: self.row_bt_d.ptr,
            stride: self.caps.max_blocks_per_seq as i32,
            block_size: self.caps.block_size as i32,
        }
    }

    /// The device addresses of the per-row sampling state.
    fn sampler_state(&self) -> SamplerState {
        SamplerState {
            counts: self.pen_counts_d.ptr,
            seen: self.pen_seen_d.ptr,
            bias_ids: self.bias_ids_d.ptr,
            bias_vals: self.bias_vals_d.ptr,
            argmax_parts: self.argmax_parts_d.ptr,
        }
    }

    /// The per-token attention plan for `rows` rows (a decode step's padded batch, or the
    /// tokens a step's prefill tiles leave): context splits for small decode batches, then
    /// [`per_token_kernels`]. Graph capture and eager steps both ask here, so a bucket's replay
    /// and its eager run cut attention the same way and run the same kernels.
    fn attention_plan(&self, rows: usize, decode: bool) -> (Option<usize>, bool, Option<u32>) {
        let splits = if decode {
            self.decode_splits(rows)
        } else {
            None
        };
        let (gqa, grp) = per_token_kernels(
            &self.kernels,
            &self.model.config,
            rows,
            splits.is_some(),
            self.grouped_attention,
        );
        (splits, gqa, grp)
    }

    /// Whether decode steps with `splits` have a short-context variant (see `short_graphs`):
    /// split steps of engines that make them. (Only decode-only steps split.)
    fn short_twin(&self, splits: Option<usize>) -> bool {
        self.short_steps && splits.is_some()
    }

    /// Whether every one of the `t` tokens staged in `slot` attends to at most
    /// [`harrier_kernels::Kernels::attn_one_split_keys`] keys (its position + 1), so that split
    /// attention needs no `attention_combine` (see `short_graphs`). Reads the staged positions
    /// (a few rows: only steps whose bucket splits ask).
    fn short_context(&self, slot: usize, t: usize) -> bool {
        let l = &self.layout;
        layout::fits_one_split(
            &self.slots[slot].meta_h.as_slice()[l.positions..l.positions + t],
            self.kernels.attn_one_split_keys(),
        )
    }

    /// Split decode attention for a decode step of `batch` (padded) rows, if it splits.
    fn decode_splits(&self, batch: usize) -> Option<usize> {
        let n = decode_split_count(&self.kernels, &self.model.config, batch);
        (n > 1 && self.split_decode_attention).then_some(n)
    }

    /// Starts (`on`) or stops timing steps into [`CudaExecutor::gaps`], cleared; call between
    /// steps. The first gap is measured from the next step on.
    pub fn time_steps(&mut self, on: bool) -> anyhow::Result<()> {
        self.record_gaps = on;
        self.gaps = GapStats::default();
        self.last_done_ms = None;
        if let Some(ev) = self.gap_ref.take() {
            // SAFETY: nothing in flight waits on the reference (steps are read once waited).
            ck(unsafe { dr::event::synchronize(ev) }, "event sync")?;
            // SAFETY: created by `new_event`, no longer referenced.
            unsafe {
                let _ = dr::event::destroy(ev);
            }
        }
        Ok(())
    }

    /// Kernel launches in the decode graph that a step of `n` sequences replays (`None`:
    /// no such graph captured).
    pub fn graph_kernels(&self, n: usize) -> Option<usize> {
        let (_, size) = self.buckets.bucket_for(n)?;
        self.graphs[0]
            .iter()
            .find(|g| g.size == size)
            .map(|g| g.nodes)
    }

    /// How steps ran so far (graph replays, eager fallbacks).
    pub fn exec_counters(&self) -> ExecCounters {
        self.counters
    }

    pub fn num_kv_blocks(&self) -> u32 {
        self.num_kv_blocks
    }

    pub fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    /// Debug/parity support: the f32 logits of the last step's `k`-th sampled sequence (as the
    /// sampler left them: unmodified for greedy rows). Synchronises the compute stream.
    pub fn logits_row(&mut self, k: usize) -> anyhow::Result<Vec<f32>> {
        ck(self.ctx.bind_to_thread(), "bind")?;
        let v = self.model.config.vocab_size;
        let mut out = vec![0f32; v];
        // SAFETY: the logits buffer holds max_seqs rows of `v` floats; k is checked.
        unsafe {
            ck(dr::stream::synchronize(self.compute), "sync")?;
            anyhow::ensure!(k < self.caps.max_seqs, "row {k} out of range");
            ck(
                dr::memcpy_dtoh_sync(&mut out, self.model.logits_ptr() + (k * v * 4) as u64),
                "logits D2H",
            )?;
        }
        Ok(out)
    }

    /// Empties the kernel trace buffer of a `-DHARRIER_TRACE` build (measurement only; an
    /// error for other builds).
    pub fn trace_reset(&mut self) -> anyhow::Result<()> {
        self.synchronize()?;
        self.kernels.trace_reset()
    }

    /// The blocks traced since [`CudaExecutor::trace_reset`], after the enqueued work completes.
    pub fn trace_read(&mut self) -> anyhow::Result<Vec<harrier_kernels::TraceRecord>> {
        self.synchronize()?;
        self.kernels.trace_read()
    }

    /// Waits for all enqueued work.
    pub fn synchronize(&mut self) -> anyhow::Result<()> {
        ck(self.ctx.bind_to_thread(), "bind")?;
        // SAFETY: our streams.
        unsafe {
            ck(dr::stream::synchronize(self.compute), "sync")?;
            ck(dr::stream::synchronize(self.copy), "sync")
        }
    }

    fn fatal(&mut self, e: anyhow::Error) -> ExecError {
        let msg = format!("{e:#}");
        tracing::error!("CUDA backend failure: {msg}");
        self.failed.get_or_insert(msg);
        ExecError::Fatal(e)
    }

    fn check_alive(&self) -> Result<(), ExecError> {
        match &self.failed {
            Some(e) => Err(ExecError::Fatal(anyhow!(
                "the CUDA backend failed earlier: {e}"
            ))),
            None => Ok(()),
        }
    }

    /// Everything that can refuse a batch, before any state changes (`meta::validate`).
    fn validate(&mut self, batch: &ExecBatch) -> Result<(), String> {
        let lim = meta::Limits {
            caps: self.caps,
            vocab: self.model.config.vocab_size as u32,
            kv_blocks: self.num_kv_blocks,
            local_kv_blocks: self.num_local_kv_blocks.unwrap_or(0),
        };
        meta::validate(batch, &lim, &self.rows, &mut self.row_marks)
    }

    fn launch_inner(&mut self, batch: &ExecBatch, slot: usize) -> anyhow::Result<()> {
        ck(self.ctx.bind_to_thread(), "bind")?;
        let caps = self.caps;
        let l = self.layout;
        // Row (re)initialisations: host mirror, device parameters, device row state.
        let mut n_inits = 0;
        let (mut n_state, mut state_words) = (0usize, 0usize);
        let max_rows = caps.max_seqs;
        let state_base = 4 * max_rows + 1;
        for init in &batch.row_inits {
            let p = &init.sampling;
            let plan = meta::RowPlan::new(init, ROW_STATE_WORDS_PER_STEP - state_words);
            let host = plan.host;
            let mut rp = RowParams {
                temperature: if p.is_greedy() { 0.0 } else { p.temperature },
                top_p: p.top_p,
                min_p: p.min_p,
                top_k: p.top_k.map(|k| k.min(i32::MAX as u32) as i32).unwrap_or(0),
                seed_lo: init.seed as u32,
                seed_hi: (init.seed >> 32) as u32,
                generated: init.output.len() as u32,
                min_tokens: p.min_tokens,
                host_sampled: host as i32,
                penalties: plan.penalties as i32,
                n_bias: plan.bias as i32,
                repetition_penalty: p.repetition_penalty,
                frequency_penalty: p.frequency_penalty,
                presence_penalty: p.presence_penalty,
                mask_len: init.min_tokens_mask.len().min(MASK_CAP) as i32,
                mask: [-1; MASK_CAP],
            };
            for (m, &t) in rp.mask.iter_mut().zip(&init.min_tokens_mask) {
                *m = t as i32;
            }
            let s = &mut self.slots[slot];
            s.inits_h.as_mut_slice()[n_inits] = rp;
            s.meta_h.as_mut_slice()[l.init_rows + n_inits] = init.row.0 as i32;
            n_inits += 1;
            if plan.penalties || plan.bias > 0 {
                meta::stage_row_state(
                    s.state_h.as_mut_slice(),
                    max_rows,
                    n_state,
                    state_words,
                    init,
                    &plan,
                );
                n_state += 1;
                state_words += plan.words;
            }
            self.rows[init.row.0 as usize] =
                Some(HostRow::new(host.then(|| RowSampler::new(init))));
        }
        // Per-token and per-sequence metadata; new block-table entries.
        let decode_only = meta::is_decode_only(batch);
        let k = self.spec.as_ref().map_or(0, |sp| sp.k);
        let round_only = meta::is_round_only(batch, k);
        let n_seqs = batch.seqs.len();
        let s = &mut self.slots[slot];
        s.host_results.clear();
        s.drafted = false;
        let counts = meta::fill_step(
            s.meta_h.as_mut_slice(),
            &l,
            &caps,
            batch,
            &mut self.rows,
            &mut s.host_samples,
            self.tiled_prefill,
        );
        let (t, n_samples, n_bt) = (counts.tokens, counts.samples, counts.bt_updates);
        s.n_samples = n_samples;
        s.n_logits = counts.logits;
        let draft_counts = match self.spec {
            Some(_) => meta::fill_draft_step(s.meta_h.as_mut_slice(), &l, batch),
            None => meta::DraftCounts::NONE,
        };
        // A decode step's bucket (or a step of rounds'): its graph, and the padded size that
        // fixes its attention splits whether it replays or not. A speculative engine's decode
        // graphs have no proposer work: a decode step with some (a one-token prefill the
        // draft or the n-gram histories must take in) runs eagerly.
        let decode_only = decode_only && !draft_counts.any();
        let (bucket, graphs) = match (decode_only, round_only) {
            (true, _) => (self.buckets.bucket_for(n_seqs), &self.graphs[slot]),
            (_, true) => (
                self.round_buckets.bucket_for(n_seqs),
                &self.round_graphs[slot],
            ),
            _ => (None, &self.graphs[slot]),
        };
        let graph = bucket.filter(|_| self.use_graphs && !graphs.is_empty());
        // Token rows per sequence of a bucketed step.
        let per_seq = if round_only { 1 + k } else { 1 };
        let n_ngram = match &mut self.slots[slot].ngram {
            Some((h, _)) => meta::stage_ngram_inits(h.as_mut_slice(), max_rows, batch),
            None => 0,
        };
        match graph {
            Some((_, size)) if round_only => self.fill_round_padding(slot, n_seqs..size, k),
            Some((_, size)) => self.fill_padding(slot, t..size, counts.placed),
            None => {}
        }
        let st = self.compute;
        let s = &self.slots[slot];
        // SAFETY: all device addresses are our allocations with the layout's capacities; the
        // pinned source buffers belong to this slot and are not rewritten before the step is
        // committed (I6).
        unsafe {
            if self.record_gaps {
                if self.gap_ref.is_none() {
                    let ev = new_event(true)?;
                    ck(dr::event::record(ev, st), "event record")?;
                    self.gap_ref = Some(ev);
                }
                ck(dr::event::record(s.step_start, st), "event record")?;
            }
            match self.upload {
                Some(up) => {
                    self.upload_head(slot, up)?;
                    ck(dr::event::record(s.meta_ready, up), "event record")?;
                    ck(
                        dr::stream::wait_event(
                            st,
                            s.meta_ready,
                            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                        ),
                        "stream wait",
                    )?;
                }
                None => self.upload_head(slot, st)?,
            }
            if n_bt > 0 {
                let meta = s.meta_h.as_slice();
                // bt_index and bt_value are adjacent: one copy of both up to the last entry.
                let (a, b) = (l.bt_index, l.bt_value + n_bt);
                ck(
                    dr::memcpy_htod_async(s.meta_d.at(a * 4), &meta[a..b], st),
                    "block-table H2D",
                )?;
                self.kernels.scatter_i32(
                    st,
                    self.row_bt_d.ptr,
                    s.meta_d.at(l.bt_index * 4),
                    s.meta_d.at(l.bt_value * 4),
                    n_bt as i32,
                )?;
            }
            if n_inits > 0 {
                ck(
                    dr::memcpy_htod_async(s.inits_d.ptr, &s.inits_h.as_slice()[..n_inits], st),
                    "row init H2D",
                )?;
                self.kernels.apply_row_inits(
                    st,
                    self.rows_d.ptr,
                    s.inits_d.ptr,
                    s.meta_d.at(l.init_rows * 4),
                    n_inits as i32,
                )?;
            }
            if let (Some((h, d)), Some(hist)) = (
                s.ngram.as_ref().filter(|_| n_ngram > 0),
                self.spec.as_ref().and_then(|sp| sp.ngram_hist()),
            ) {
                let words = meta::ngram_staged_words(h.as_slice(), max_rows, n_ngram);
                ck(
                    dr::memcpy_htod_async(d.ptr, &h.as_slice()[..words], st),
                    "n-gram history H2D",
                )?;
                let at = |w: usize| d.at(w * 4);
                let (rows, starts, offsets, tokens) = meta::ngram_stage_sections(max_rows);
                self.kernels.ngram_init(
                    st,
                    hist,
                    (at(rows), at(offsets), at(starts), at(tokens)),
                    n_ngram as u32,
                )?;
            }
            if counts.pf_tiles > 0 {
                // Tiles and the listed tokens: one copy from the tiles up to the list's end.
                let meta = s.meta_h.as_slice();
                let (a, b) = (l.pf_tiles, l.att_list + counts.att_listed);
                ck(
                    dr::memcpy_htod_async(s.meta_d.at(a * 4), &meta[a..b], st),
                    "prefill tiles H2D",
                )?;
            }
            if n_state > 0 {
                ck(
                    dr::memcpy_htod_async(
                        s.state_d.ptr,
                        &s.state_h.as_slice()[..state_base + state_words],
                        st,
                    ),
                    "row state H2D",
                )?;
                self.kernels.init_row_state(
                    st,
                    self.sampler_state(),
                    self.model.config.vocab_size as i32,
                    s.state_d.ptr,
                    s.state_d.at(max_rows * 4),
                    s.state_d.at(state_base * 4),
                    n_state as u32,
                )?;
            }
            if let Some((i, size)) = graph {
                let g = match round_only {
                    true => &self.round_graphs[slot][i],
                    false => match self.short_graphs[slot].get(i) {
                        Some(Some(g)) if self.short_context(slot, t) => g,
                        _ => &self.graphs[slot][i],
                    },
                };
                g.replay(st, size, self.graph_addrs(slot))?;
                self.counters.graph_replays += 1;
            } else if t > 0 {
                // The attention plan follows the padded batch of a bucketed step (as its
                // graph would), else the tokens left to the per-token kernels.
                let plan_n = if decode_only || round_only {
                    bucket.map_or(t, |(_, b)| b * per_seq)
                } else if counts.pf_tiles > 0 {
                    counts.att_listed
                } else {
                    t
                };
                let mut m = self.step_meta(
                    slot,
                    t,
                    counts.logits,
                    self.attention_plan(plan_n, decode_only),
                    (counts.pf_tiles, counts.att_listed),
                );
                // GEMMs over the bucket's rows, as its graph computes them.
                m.gemm_rows = bucket.map(|(_, b)| b * per_seq);
                m.short_context = self.short_twin(m.decode_splits) && self.short_context(slot, t);
                let (bt, state) = (self.block_tables(), self.sampler_state());
                let mark =
                    (self.record_gaps && draft_counts.any()).then_some(self.slots[slot].draft_done);
                match &mut self.spec {
                    None => self.model.forward(&self.kernels, st, &m)?,
                    Some(sp) => sp.enqueue_step(
                        &self.kernels,
                        st,
                        &mut self.model,
                        (&self.slots[slot].meta_d, &l),
                        (draft_counts, counts.placed),
                        &m,
                        (self.rows_d.ptr, state),
                        (bt, mark),
                    )?,
                }
                self.slots[slot].drafted = mark.is_some();
                if decode_only {
                    self.counters.eager_decode_steps += 1;
                } else {
                    self.counters.eager_other_steps += 1;
                }
            }
        }
        Ok(())
    }

    fn finalize_inner(&mut self, slot: usize) -> anyhow::Result<()> {
        ck(self.ctx.bind_to_thread(), "bind")?;
        let l = self.layout;
        let st = self.compute;
        let vocab = self.model.config.vocab_size;
        let state = self.sampler_state();
        let speculating = self.spec.is_some();
        let s = &mut self.slots[slot];
        // Output words: tokens, or with speculation counts then `1 + k` tokens per sequence.
        let out_words = match &self.spec {
            None => s.n_samples,
            Some(sp) => self.caps.max_seqs + s.n_samples * (sp.k + 1),
        };
        // SAFETY: device addresses are our allocations; sizes within capacities.
        unsafe {
            // Every step, whether or not a row is greedy (the host does not track it): one
            // extra read of the logits (about 10 us at 64 rows of 128k), against a 52 us
            // single-block scan per greedy row.
            self.kernels.row_argmax_parts(
                st,
                self.model.logits_ptr(),
                vocab as i32,
                state.argmax_parts,
                s.n_logits as u32,
            )?;
            match &self.spec {
                None => self.kernels.sample_tokens(
                    st,
                    self.model.logits_ptr(),
                    vocab as i32,
                    s.meta_d.at(l.sample_rows * 4),
                    self.rows_d.ptr,
                    s.out_d.ptr,
                    self.pending_d.ptr,
                    state,
                    s.n_samples as u32,
                )?,
                Some(sp) => self.kernels.spec_verify(
                    st,
                    self.model.logits_ptr(),
                    vocab as i32,
                    harrier_kernels::VerifySeqs {
                        sample_rows: s.meta_d.at(l.sample_rows * 4),
                        samp_first: s.meta_d.at(l.samp_first * 4),
                        samp_draft: s.meta_d.at(l.samp_draft * 4),
                        logit_rows: s.meta_d.at(l.logit_rows * 4),
                        tok_src: s.meta_d.at(l.tok_src * 4),
                        positions: s.meta_d.at(l.positions * 4),
                    },
                    self.rows_d.ptr,
                    (s.out_d.at(self.caps.max_seqs * 4), s.out_d.ptr),
                    sp.rows(self.pending_d.ptr),
                    state,
                    s.n_samples as u32,
                )?,
            }
            if !s.host_samples.is_empty() {
                // Host sampling: the CPU backend's sampler on this step's raw logits.
                ck(dr::stream::synchronize(st), "sync for host sampling")?;
                let logits = &mut self.host_logits;
                logits.resize(vocab, 0.0);
                let n = s.host_samples.len();
                for (i, &(k, row)) in s.host_samples.iter().enumerate() {
                    // The sequence's logits row: its round's first with speculation.
                    let lr = match speculating {
                        false => k,
                        true => s.meta_h.as_slice()[l.samp_first + k] as usize,
                    };
                    ck(
                        dr::memcpy_dtoh_sync(
                            logits.as_mut_slice(),
                            self.model.logits_ptr() + (lr * vocab * 4) as u64,
                        ),
                        "logits D2H",
                    )?;
                    let sampler = self.rows[row as usize]
                        .as_mut()
                        .and_then(|r| r.host_sampler.as_mut())
                        .expect("host row");
                    let (tok, lp) = sampler.sample(logits.as_mut_slice(), &mut self.scratch);
                    s.host_results.push((k, tok, lp));
                    let h = s.host_tok_h.as_mut_slice();
                    h[i] = row as i32;
                    h[n + i] = tok as i32;
                }
                ck(
                    dr::memcpy_htod_async(s.host_tok_d.ptr, &s.host_tok_h.as_slice()[..2 * n], st),
                    "host tokens H2D",
                )?;
                self.kernels.scatter_i32(
                    st,
                    self.pending_d.ptr,
                    s.host_tok_d.ptr,
                    s.host_tok_d.at(n * 4),
                    n as i32,
                )?;
            }
            ck(dr::event::record(s.step_done, st), "event record")?;
            // I3: the copy waits on this step's event only.
            ck(
                dr::stream::wait_event(
                    self.copy,
                    s.step_done,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                ),
                "stream wait",
            )?;
            if s.n_samples > 0 {
                let out = std::slice::from_raw_parts_mut(s.out_h.ptr, out_words);
                ck(
                    dr::memcpy_dtoh_async(out, s.out_d.ptr, self.copy),
                    "tokens D2H",
                )?;
            }
            ck(dr::event::record(s.copy_done, self.copy), "event record")?;
        }
        Ok(())
    }

    fn wait_inner(&mut self, slot: usize, out: &mut StepOutput) -> anyhow::Result<()> {
        ck(self.ctx.bind_to_thread(), "bind")?;
        let s = &mut self.slots[slot];
        // SAFETY: event recorded by finalize_sampling.
        ck(
            // SAFETY: `copy_done` is a live event owned by this slot, recorded on the copy stream.
            unsafe { dr::event::synchronize(s.copy_done) },
            "waiting for the step",
        )?;
        out.clear();
        match &self.spec {
            None => {
                let toks = &s.out_h.as_slice()[..s.n_samples];
                out.tokens.extend(toks.iter().map(|&t| t as TokenId));
                out.logprobs.resize(s.n_samples, None);
                out.counts.resize(s.n_samples, 1);
                out.proposed.resize(s.n_samples, 0);
                for (k, tok, lp) in s.host_results.drain(..) {
                    out.tokens[k] = tok;
                    out.logprobs[k] = lp;
                }
            }
            Some(sp) => {
                let (l, n) = (&self.layout, s.n_samples);
                let drafts = &s.meta_h.as_slice()[l.samp_draft..l.samp_draft + n];
                meta::read_spec_output(
                    s.out_h.as_slice(),
                    (self.caps.max_seqs, sp.k),
                    drafts,
                    &mut s.host_results,
                    out,
                )?;
            }
        }
        if let (true, Some(r)) = (self.record_gaps, self.gap_ref) {
            // SAFETY: the reference and this step's events were recorded on the compute
            // stream before this step's copy, which has completed; this slot's events are not
            // re-recorded before the step is waited for.
            unsafe {
                if let (Ok(a), Ok(b)) = (
                    dr::event::elapsed(r, s.step_start),
                    dr::event::elapsed(r, s.step_done),
                ) {
                    if let Some(prev) = self.last_done_ms {
                        self.gaps.gaps_ms.push(a - prev);
                    }
                    self.gaps.step_ms.push(b - a);
                    self.last_done_ms = Some(b);
                }
                if s.drafted {
                    if let Ok(d) = dr::event::elapsed(s.step_start, s.draft_done) {
                        self.gaps.draft_ms.push(d);
                    }
                }
            }
        }
        Ok(())
    }
}

impl Executor for CudaExecutor {
    fn launch_forward(
        &mut self,
        batch: &ExecBatch,
        slot: SlotId,
    ) -> Result<LaunchHandle, ExecError> {
        self.check_alive()?;
        self.validate(batch).map_err(ExecError::Rejected)?;
        let si = slot.0 as usize;
        if let Err(e) = self.launch_inner(batch, si) {
            return Err(self.fatal(e));
        }
        let step = self.next_step;
        self.next_step += 1;
        Ok(LaunchHandle { slot, step })
    }

    fn finalize_sampling(&mut self, handle: LaunchHandle) -> Result<InFlightStep, ExecError> {
        self.check_alive()?;
        let LaunchHandle { slot, step } = handle;
        if let Err(e) = self.finalize_inner(slot.0 as usize) {
            return Err(self.fatal(e));
        }
        Ok(InFlightStep { slot, step })
    }

    fn wait(&mut self, step: InFlightStep, out: &mut StepOutput) -> Result<(), ExecError> {
        self.check_alive()?;
        if let Err(e) = self.wait_inner(step.slot.0 as usize, out) {
            return Err(self.fatal(e));
        }
        Ok(())
    }

    fn counters(&self) -> ExecCounters {
        self.counters
    }

    fn supports_token_masks(&self) -> bool {
        true
    }

    fn set_token_masks(
        &mut self,
        slot: SlotId,
        masks: &crate::batch::TokenMasks,
    ) -> Result<(), ExecError> {
        self.check_alive()?;
        if let Err(e) = self.masks_inner(slot.0 as usize, masks) {
            return Err(self.fatal(e));
        }
        Ok(())
    }
}

impl CudaExecutor {
    /// Uploads the step's token masks on the compute stream, after its forward and before its
    /// sampling, and masks the logits there. The slot's pinned buffer is not reused before
    /// the step is committed (I6), so the asynchronous copy reads stable memory.
    fn masks_inner(&mut self, slot: usize, masks: &crate::batch::TokenMasks) -> anyhow::Result<()> {
        let n = masks.samples.len();
        if n == 0 {
            return Ok(());
        }
        let vocab = self.model.config.vocab_size;
        let wpm = masks.words_per_mask;
        anyhow::ensure!(
            wpm >= vocab.div_ceil(32),
            "token masks of {wpm} words cannot cover {vocab} tokens"
        );
        let max_rows = self.caps.max_seqs;
        let spec_first = self.spec.as_ref().map(|_| self.layout.samp_first);
        let s = &mut self.slots[slot];
        let need = max_rows + max_rows * wpm;
        if s.masks
            .as_ref()
            .is_none_or(|(h, _)| h.as_slice().len() < need)
        {
            s.masks = Some((HostBuf::new(need)?, DevBuf::new(need * 4)?));
        }
        let (h, d) = s.masks.as_mut().expect("allocated above");
        let hs = h.as_mut_slice();
        for (i, &k) in masks.samples.iter().enumerate() {
            // The sequence's logits row: its round's first with speculation (constrained
            // rows do not speculate: their round is that one row).
            hs[i] = match spec_first {
                None => k,
                Some(f) => s.meta_h.as_slice()[f + k as usize] as u32,
            };
        }
        hs[n..n + n * wpm].copy_from_slice(&masks.words[..n * wpm]);
        ck(self.ctx.bind_to_thread(), "bind")?;
        let st = self.compute;
        // SAFETY: pinned source and device destination of `n + n * wpm` words; the kernel
        // reads rows `< n_samples` of this step's logits.
        unsafe {
            ck(
                dr::memcpy_htod_async(d.ptr, &h.as_slice()[..n + n * wpm], st),
                "token masks H2D",
            )?;
            self.kernels.apply_token_mask(
                st,
                self.model.logits_ptr(),
                vocab as i32,
                d.ptr,
                d.at(n * 4),
                wpm as i32,
                n as u32,
            )?;
        }
        Ok(())
    }
}

impl Drop for CudaExecutor {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: our streams and events; nothing is enqueued after this.
            unsafe {
                let _ = dr::stream::synchronize(self.compute);
                let _ = dr::stream::synchronize(self.copy);
                // (The compute stream waits on every metadata copy it reads, but one enqueued
                // before an error left the step must not outlive the pinned buffer either.)
                if let Some(up) = self.upload {
                    let _ = dr::stream::synchronize(up);
                }
                self.graphs.clear();
                for s in &self.slots {
                    let _ = dr::event::destroy(s.step_start);
                    let _ = dr::event::destroy(s.step_done);
                    let _ = dr::event::destroy(s.draft_done);
                    let _ = dr::event::destroy(s.copy_done);
                    let _ = dr::event::destroy(s.meta_ready);
                }
                if let Some(ev) = self.gap_ref.take() {
                    let _ = dr::event::destroy(ev);
                }
            }
        }
        // Buffers free in field order (the context, last, outlives them); streams stay until
        // the context goes.
    }
}

/// Which kernel takes `rows` per-token attention rows (`split`: cut into context splits), as
/// (`paged_attention_gqa`, `paged_attention_grp*` in blocks of that many warps,
/// [`Kernels::grp_launch_warps`]), at most one of them; neither: the per-head kernel. grp
/// wherever [`Kernels::grp_serves`] says (any count, split or with a token list); gqa
/// (single-split rows only, bf16: the f32 model is for exactness checks) for heads grp has no
/// instance for where [`layout::use_grouped_attention`] says, or as `gqa_override` says
/// (`bench`'s attention modes: `graph-async-grouped-attn` times gqa where grp would run). The
/// executor's steps and the draft model's ask here.
pub(super) fn per_token_kernels(
    k: &Kernels,
    c: &ModelConfig,
    rows: usize,
    split: bool,
    gqa_override: Option<bool>,
) -> (bool, Option<u32>) {
    let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
    let grp = k.grp_serves(nh, nkv, hd, rows);
    let gqa = !split
        && k.dtype == Dtype::Bf16
        && harrier_kernels::gqa_attention_supports(nh, nkv, hd)
        && gqa_override.unwrap_or_else(|| !grp && layout::use_grouped_attention(rows, nkv));
    let warps = (!gqa && grp).then(|| k.grp_launch_warps(nh, nkv, hd, rows, split));
    (gqa, warps)
}

/// Context splits a token of a decode step of `batch` (padded) rows: where its attention
/// launch takes `paged_attention_grp*` ([`Kernels::grp_serves`]), enough for a wave of
/// [`layout::GRP_TARGET_BLOCKS`] (token, KV head, split) blocks lowered to the most that merge
/// in resident clusters ([`Kernels::grp_cluster_splits`]), else the per-head kernel's
/// [`layout::decode_attention_splits`]. Capture, eager steps, the short-context bucket count
/// and the draft model's decode rows all ask here.
pub(super) fn decode_split_count(k: &Kernels, c: &ModelConfig, batch: usize) -> usize {
    let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
    match k.grp_serves(nh, nkv, hd, batch) {
        true => {
            let splits = layout::grp_decode_splits(batch, nh, nkv) as u32;
            // As many as merge in resident clusters, if any do (the launch's rows are at most
            // the batch rounded up to a power of two, as grp_decode_splits rounds it).
            let rows = batch.max(1).next_power_of_two().min(u32::MAX as usize) as u32;
            k.grp_cluster_splits(nh, nkv, hd, rows, splits) as usize
        }
        false => layout::decode_attention_splits(batch, nh),
    }
}
