//! The CUDA backend: our NVRTC-compiled kernels (`harrier-kernels`), cuBLAS bf16 GEMMs, and the
//! executor seam over two ping-pong slots.
//!
//! ```text
//!  engine thread                       compute stream (I1: every step's work)       copy stream
//!  launch_forward(batch, slot)  ──►  H2D slot metadata, row inits, forward → logits
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
//!   slot only after committing its step, so the pinned buffers are never overwritten early).
//! - Activations, logits and the KV cache are shared: all work is on one compute stream, so
//!   step t+1's forward runs after step t's sampling.
//! - Sampling with penalties, logprobs or a long min_tokens mask runs on the host
//!   (`RowSampler`, the CPU backend's sampler) in `finalize_sampling`, which then synchronises
//!   the stream for that step; everything else samples on the device with the same Philox
//!   stream, so seeded output matches the CPU backend up to numeric ties.
//! - Every CUDA call is checked; an error after dispatch is `ExecError::Fatal`, and every later
//!   call fails too.

pub mod layout;
mod model;

use std::ffi::c_void;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context};
use harrier_kernels::cudarc::driver::{result as dr, sys, CudaContext};
use harrier_kernels::{Kernels, RowParams, MASK_CAP};
use harrier_shared::protocol::{TokenId, TokenLogprobs};

use super::{ExecError, Executor, InFlightStep, LaunchHandle};
use crate::batch::{ExecBatch, StepOutput};
use crate::model::{ModelConfig, ModelDir};
use crate::pipeline::{SlotId, NUM_SLOTS};
use crate::sampling::{RowSampler, SamplerScratch};
use layout::{Capacities, MetaLayout};
pub use model::GpuModel;

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
        // SAFETY: a plain allocation; zero-size requests allocate one word.
        let ptr = ck(unsafe { dr::malloc_sync(bytes.max(4)) }, "cuMemAlloc")?;
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
}

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
    step_start: sys::CUevent,
    step_done: sys::CUevent,
    copy_done: sys::CUevent,
    // The step in flight.
    n_tokens: usize,
    n_seqs: usize,
    n_samples: usize,
    n_inits: usize,
    bt_stride: usize,
    /// (index among samples, row) of host-sampled sequences.
    host_samples: Vec<(usize, u32)>,
    host_results: Vec<(usize, TokenId, Option<TokenLogprobs>)>,
}

/// Host mirror of a row.
struct HostRow {
    block_table: Vec<u32>,
    /// A sample was launched for this row: its pending token exists on the device.
    has_pending: bool,
    /// `Some` when this row samples on the host.
    host_sampler: Option<RowSampler>,
}

/// GPU time between consecutive steps (end of step t's sampling to start of step t+1's inputs).
#[derive(Debug, Clone, Default)]
pub struct GapStats {
    pub gaps_ms: Vec<f32>,
    pub step_ms: Vec<f32>,
}

pub struct CudaExecutor {
    compute: sys::CUstream,
    copy: sys::CUstream,
    kernels: Kernels,
    model: GpuModel,
    caps: Capacities,
    layout: MetaLayout,
    num_kv_blocks: u32,
    rows_d: DevBuf,
    pending_d: DevBuf,
    slots: Vec<Slot>,
    rows: Vec<Option<HostRow>>,
    scratch: SamplerScratch,
    next_step: u64,
    failed: Option<String>,
    /// Step-timing events of the last completed step, for gap measurement.
    last_done: Option<sys::CUevent>,
    pub record_gaps: bool,
    pub gaps: GapStats,
    ctx: Arc<CudaContext>,
}

// SAFETY: the raw CUDA handles are used only through `&mut self`, with the context bound to the
// calling thread at the start of every call.
unsafe impl Send for CudaExecutor {}

/// Facts reported at start-up.
#[derive(Debug, Clone)]
pub struct CudaStartInfo {
    pub device_name: String,
    pub arch: &'static str,
    pub weight_bytes: usize,
    pub activation_bytes: usize,
    pub kv_blocks: u32,
    pub kv_tokens: u64,
    pub kv_bytes: usize,
    pub kernels_from_cache: bool,
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
        let kernels = Kernels::load(arch).context("compiling/loading the kernels")?;
        let compute = ck(
            dr::stream::create(dr::stream::StreamKind::NonBlocking),
            "cuStreamCreate",
        )?;
        let copy = ck(
            dr::stream::create(dr::stream::StreamKind::NonBlocking),
            "cuStreamCreate",
        )?;
        let mc = dir.config.clone();
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
        let caps = Capacities::new(
            cfg.max_num_batched_tokens as usize,
            cfg.max_num_seqs as usize,
            cfg.max_model_len as usize,
            cfg.block_size as usize,
        );
        let scratch_sizes = layout::ScratchSizes::new(&mc, &caps);
        let mut model = GpuModel::load(dir, compute, &caps, &scratch_sizes)?;
        let layout = MetaLayout::new(&caps);
        let max_rows = caps.max_seqs;
        let rows_d = DevBuf::new(max_rows * std::mem::size_of::<RowParams>())?;
        let pending_d = DevBuf::new(max_rows * 4)?;
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
        }
        let mut slots = Vec::with_capacity(NUM_SLOTS);
        for _ in 0..NUM_SLOTS {
            slots.push(Slot {
                meta_h: HostBuf::new(layout.len)?,
                meta_d: DevBuf::new(layout.bytes())?,
                inits_h: HostBuf::new(max_rows)?,
                inits_d: DevBuf::new(max_rows * std::mem::size_of::<RowParams>())?,
                out_d: DevBuf::new(max_rows * 4)?,
                out_h: HostBuf::new(max_rows)?,
                host_tok_h: HostBuf::new(2 * max_rows)?,
                host_tok_d: DevBuf::new(2 * max_rows * 4)?,
                step_start: new_event(true)?,
                step_done: new_event(true)?,
                copy_done: new_event(false)?,
                n_tokens: 0,
                n_seqs: 0,
                n_samples: 0,
                n_inits: 0,
                bt_stride: 1,
                host_samples: Vec::new(),
                host_results: Vec::new(),
            });
        }
        // SAFETY: stream created above.
        ck(
            // SAFETY: `compute` is a live stream owned by this executor.
            unsafe { dr::stream::synchronize(compute) },
            "synchronising after the upload",
        )?;
        let bpb = layout::kv_bytes_per_block(&mc, caps.block_size);
        let num_kv_blocks = match cfg.num_kv_blocks {
            Some(n) => n as usize,
            None => {
                // Everything but the KV cache is allocated now (weights, activations at their
                // largest, slots, cuBLAS workspace): the KV cache gets the rest of the budget.
                let (free, total) = ck(dr::mem_get_info(), "cuMemGetInfo")?;
                layout::kv_blocks_for(total, total - free, cfg.gpu_memory_utilization, bpb)
            }
        };
        if num_kv_blocks < 2 {
            bail!(
                "no room for the KV cache ({num_kv_blocks} blocks of {bpb} bytes) with --gpu-memory-utilization {}",
                cfg.gpu_memory_utilization
            );
        }
        let num_kv_blocks = num_kv_blocks.min(u32::MAX as usize / caps.block_size) as u32;
        model.alloc_kv(num_kv_blocks as usize, caps.block_size)?;
        let info = CudaStartInfo {
            device_name,
            arch,
            weight_bytes: model.weight_bytes,
            activation_bytes: scratch_sizes.total(),
            kv_blocks: num_kv_blocks,
            kv_tokens: num_kv_blocks as u64 * caps.block_size as u64,
            kv_bytes: num_kv_blocks as usize * bpb,
            kernels_from_cache: kernels.from_cache,
        };
        let exec = CudaExecutor {
            compute,
            copy,
            kernels,
            model,
            caps,
            layout,
            num_kv_blocks,
            rows_d,
            pending_d,
            slots,
            rows: (0..max_rows).map(|_| None).collect(),
            scratch: SamplerScratch::default(),
            next_step: 0,
            failed: None,
            last_done: None,
            record_gaps: false,
            gaps: GapStats::default(),
            ctx,
        };
        Ok((exec, info))
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

    /// Everything that can refuse a batch, before any state changes.
    fn validate(&self, batch: &ExecBatch) -> Result<(), String> {
        batch.check()?;
        let c = &self.caps;
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
        let vocab = self.model.config.vocab_size as u32;
        if let Some(&tok) = batch.host_tokens.iter().find(|&&x| x >= vocab) {
            return Err(format!("token id {tok} outside the vocabulary ({vocab})"));
        }
        if let Some(&b) = batch.new_blocks.iter().find(|&&b| b >= self.num_kv_blocks) {
            return Err(format!(
                "block {b} outside the cache ({} blocks)",
                self.num_kv_blocks
            ));
        }
        for init in &batch.row_inits {
            if init.row.0 as usize >= self.rows.len() {
                return Err(format!("row {} out of range", init.row.0));
            }
        }
        let mut seen = std::collections::HashSet::new();
        for s in &batch.seqs {
            let r = s.row.0 as usize;
            if r >= self.rows.len() {
                return Err(format!("row {r} out of range"));
            }
            if !seen.insert(r) {
                return Err(format!("row {r} appears twice in one step"));
            }
            let reinit = batch.row_inits.iter().any(|i| i.row.0 as usize == r);
            let (have, pending) = match (&self.rows[r], reinit) {
                (_, true) => (0, false),
                (Some(row), false) => (row.block_table.len(), row.has_pending),
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
        }
        Ok(())
    }

    fn launch_inner(&mut self, batch: &ExecBatch, slot: usize) -> anyhow::Result<()> {
        ck(self.ctx.bind_to_thread(), "bind")?;
        let caps = self.caps;
        let l = self.layout;
        // Row (re)initialisations: host mirror and device parameters.
        let mut n_inits = 0;
        for init in &batch.row_inits {
            let p = &init.sampling;
            let host = p.repetition_penalty != 1.0
                || p.frequency_penalty != 0.0
                || p.presence_penalty != 0.0
                || p.logprobs.is_some()
                || init.min_tokens_mask.len() > MASK_CAP;
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
            self.rows[init.row.0 as usize] = Some(HostRow {
                block_table: Vec::new(),
                has_pending: false,
                host_sampler: host.then(|| RowSampler::new(init)),
            });
        }
        // Per-token and per-sequence metadata.
        let bt_stride = batch
            .seqs
            .iter()
            .map(|s| {
                let r = self.rows[s.row.0 as usize]
                    .as_ref()
                    .map(|r| r.block_table.len())
                    .unwrap_or(0);
                r + s.blocks_len as usize
            })
            .max()
            .unwrap_or(1)
            .max(1);
        let bs = caps.block_size;
        let s = &mut self.slots[slot];
        let meta = s.meta_h.as_mut_slice();
        let mut t = 0usize;
        let mut n_samples = 0usize;
        s.host_samples.clear();
        s.host_results.clear();
        for (si, seq) in batch.seqs.iter().enumerate() {
            let row = self.rows[seq.row.0 as usize].as_mut().expect("validated");
            row.block_table.extend_from_slice(
                &batch.new_blocks
                    [seq.blocks_start as usize..(seq.blocks_start + seq.blocks_len) as usize],
            );
            for j in 0..seq.num_tokens as usize {
                let pos = seq.position as usize + j;
                meta[l.tok_src + t] = if j < seq.host_len as usize {
                    batch.host_tokens[seq.host_start as usize + j] as i32
                } else {
                    -1 - seq.row.0 as i32
                };
                meta[l.positions + t] = pos as i32;
                meta[l.slot_mapping + t] =
                    (row.block_table[pos / bs] as usize * bs + pos % bs) as i32;
                meta[l.tok_seq + t] = si as i32;
                t += 1;
            }
            let bt =
                &mut meta[l.block_tables + si * bt_stride..l.block_tables + (si + 1) * bt_stride];
            bt[..row.block_table.len()].copy_from_slice(bytemuck_u32(&row.block_table));
            bt[row.block_table.len()..].fill(0);
            if seq.sample {
                meta[l.logit_rows + n_samples] = (t - 1) as i32;
                meta[l.sample_rows + n_samples] = seq.row.0 as i32;
                if row.host_sampler.is_some() {
                    s.host_samples.push((n_samples, seq.row.0));
                }
                row.has_pending = true;
                n_samples += 1;
            }
        }
        let n_seqs = batch.seqs.len();
        s.n_tokens = t;
        s.n_seqs = n_seqs;
        s.n_samples = n_samples;
        s.n_inits = n_inits;
        s.bt_stride = bt_stride;
        let st = self.compute;
        // SAFETY: all device addresses are our allocations with the layout's capacities; the
        // pinned source buffers belong to this slot and are not rewritten before the step is
        // committed (I6).
        unsafe {
            if self.record_gaps {
                ck(dr::event::record(s.step_start, st), "event record")?;
            }
            let meta = s.meta_h.as_slice();
            let up = |off: usize, n: usize| -> anyhow::Result<()> {
                if n > 0 {
                    ck(
                        dr::memcpy_htod_async(s.meta_d.at(off * 4), &meta[off..off + n], st),
                        "metadata H2D",
                    )?;
                }
                Ok(())
            };
            up(l.tok_src, t)?;
            up(l.positions, t)?;
            up(l.slot_mapping, t)?;
            up(l.tok_seq, t)?;
            up(l.logit_rows, n_samples)?;
            up(l.sample_rows, n_samples)?;
            up(l.init_rows, n_inits)?;
            up(l.block_tables, n_seqs * bt_stride)?;
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
            if t > 0 {
                let m = model::StepMeta {
                    n_tokens: t,
                    n_samples,
                    tok_src: s.meta_d.at(l.tok_src * 4),
                    positions: s.meta_d.at(l.positions * 4),
                    slot_mapping: s.meta_d.at(l.slot_mapping * 4),
                    tok_seq: s.meta_d.at(l.tok_seq * 4),
                    logit_rows: s.meta_d.at(l.logit_rows * 4),
                    block_tables: s.meta_d.at(l.block_tables * 4),
                    bt_stride,
                    pending: self.pending_d.ptr,
                };
                self.model.forward(&self.kernels, st, &m)?;
            }
        }
        Ok(())
    }

    fn finalize_inner(&mut self, slot: usize) -> anyhow::Result<()> {
        ck(self.ctx.bind_to_thread(), "bind")?;
        let l = self.layout;
        let st = self.compute;
        let vocab = self.model.config.vocab_size;
        let s = &mut self.slots[slot];
        // SAFETY: device addresses are our allocations; sizes within capacities.
        unsafe {
            self.kernels.sample_tokens(
                st,
                self.model.logits_ptr(),
                vocab as i32,
                s.meta_d.at(l.sample_rows * 4),
                self.rows_d.ptr,
                s.out_d.ptr,
                self.pending_d.ptr,
                s.n_samples as u32,
            )?;
            if !s.host_samples.is_empty() {
                // Host sampling: the CPU backend's sampler on this step's raw logits.
                ck(dr::stream::synchronize(st), "sync for host sampling")?;
                let mut logits = vec![0f32; vocab];
                let n = s.host_samples.len();
                for (i, &(k, row)) in s.host_samples.iter().enumerate() {
                    ck(
                        dr::memcpy_dtoh_sync(
                            &mut logits,
                            self.model.logits_ptr() + (k * vocab * 4) as u64,
                        ),
                        "logits D2H",
                    )?;
                    let sampler = self.rows[row as usize]
                        .as_mut()
                        .and_then(|r| r.host_sampler.as_mut())
                        .expect("host row");
                    let (tok, lp) = sampler.sample(&mut logits, &mut self.scratch);
                    s.host_results.push((k, tok, lp));
                    let h = s.host_tok_h.as_mut_slice();
                    h[i] = row as i32;
                    h[n + i] = tok as i32;
                }
                ck(
                    dr::memcpy_htod_async(s.host_tok_d.ptr, &s.host_tok_h.as_slice()[..2 * n], st),
                    "host tokens H2D",
                )?;
                self.kernels.scatter_pending(
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
                let out = std::slice::from_raw_parts_mut(s.out_h.ptr, s.n_samples);
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
        let toks = &s.out_h.as_slice()[..s.n_samples];
        out.tokens.extend(toks.iter().map(|&t| t as TokenId));
        out.logprobs.resize(s.n_samples, None);
        for (k, tok, lp) in s.host_results.drain(..) {
            out.tokens[k] = tok;
            out.logprobs[k] = lp;
        }
        if self.record_gaps {
            // SAFETY: both events were recorded on the compute stream and have completed.
            unsafe {
                if let Some(prev) = self.last_done {
                    if let Ok(g) = dr::event::elapsed(prev, s.step_start) {
                        self.gaps.gaps_ms.push(g);
                    }
                }
                if let Ok(d) = dr::event::elapsed(s.step_start, s.step_done) {
                    self.gaps.step_ms.push(d);
                }
            }
            self.last_done = Some(s.step_done);
        }
        Ok(())
    }
}

fn bytemuck_u32(v: &[u32]) -> &[i32] {
    // SAFETY: u32 and i32 have the same size and alignment; block ids are < 2^31 (checked
    // against the cache size).
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const i32, v.len()) }
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
}

impl Drop for CudaExecutor {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: our streams and events; nothing is enqueued after this.
            unsafe {
                let _ = dr::stream::synchronize(self.compute);
                let _ = dr::stream::synchronize(self.copy);
                for s in &self.slots {
                    let _ = dr::event::destroy(s.step_start);
                    let _ = dr::event::destroy(s.step_done);
                    let _ = dr::event::destroy(s.copy_done);
                }
            }
        }
        // Buffers free in field order (the context, last, outlives them); streams stay until
        // the context goes.
    }
}
