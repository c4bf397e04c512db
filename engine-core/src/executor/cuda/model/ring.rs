//! The batch-1 decode step as one persistent launch (`gemv_ring`, kernels/cuda/harrier.cu):
//! every layer's q|k|v projection, attention (RoPE and the KV write inside), o projection and
//! MLP, then the output head, with the weights streamed through a shared-memory ring that
//! never waits for an activation. Only the embedding runs before it (a launch of its own,
//! which also takes the token the last step sampled on the device); the sampler reads the
//! logits it leaves in row 0. docs/cuda.md ("The decode ring") says why and what it measured.
//! Models whose layers are FP8 (e4m3, a scale an output channel: `--quantization fp8` or an
//! FP8 checkpoint) run the kernel's FP8 instance, `gemv_ring_f8`, which streams the bytes as
//! stored and multiplies them on the tensor cores (the head may be bf16 or FP8).
//!
//! It needs, beside the model's own weights, each layer's down and o projections transposed
//! (`[intermediate, hidden]`: a block streams a chunk's gate, up and down^T rows as three
//! contiguous copies; `[q, hidden]`: a block takes the o rows of a few attention dims, so it
//! merges only those from the attention's splits), about a quarter of a Llama's weight bytes,
//! allocated before the KV cache is sized; and a scratch of stage sums and counters that every
//! launch leaves zeroed for the next (no memset in a step), residuals, and the q|k|v outputs
//! and attention partials as tagged LL words (never zeroed: the tags tell launches apart).

use anyhow::Context;
use harrier_kernels::cudarc::driver::{result as dr, sys};
use harrier_kernels::{
    ring_attn_part_words, ring_attn_smem, ring_attn_supports, ring_chunk_rows, ring_depths,
    ring_mlp_supports, ring_slot_bytes, ring_slot_side, Dtype, Kernels, RingDepths, RingInput,
    RingKind, RingLaunch, RingStage, RingStep, RING_MAX_SLOTS, RING_OUT_ROWS, RING_SLOT,
    RING_SLOT_S24, RING_TRACE_WORDS,
};

use super::super::RING_AUTO_MEMORY_DIVISOR;
use super::{DevBuf, GpuModel, Proj, StepMeta};
use crate::model::{Activation, ModelConfig};

/// Shared memory the kernel declares statically (the MLP's partial sums, the norm's, the
/// slots' tags, the stage descriptors, the attention's metadata, the LL tags' base: 1,024
/// bytes in ptxas's count, 1,280 in the FP8 instance), left beside the dynamic part. (The
/// 8B's FP8 ring keeps six slots up to 1,440.)
const STATIC_SMEM: usize = 1296;

/// The ring's state for one model: the transposed o and down projections, the stage list
/// (built once the KV cache exists) and the launch shape.
pub(super) struct RingDecode {
    /// Per layer the down and o projections transposed (`[inter, hidden]`, `[q, hidden]`; FP8:
    /// e4m3, rows rotated as [`transposed`] says).
    down_t: Vec<DevBuf>,
    o_t: Vec<DevBuf>,
    /// Stage sums and residuals, the attention partials, the head's sums, then u32 counters:
    /// zero at allocation, the sums and counters left zero by every launch.
    scratch: DevBuf,
    layout: ScratchLayout,
    stages: Option<DevBuf>,
    n_stages: usize,
    /// The head stores the logits itself ([`ring_head_rows`]): no conversion stage.
    head_rows: bool,
    blocks: u32,
    slots: i32,
    /// Copies in flight ([`ring_depths`], read once here: not an environment lookup a step).
    depth: RingDepths,
    /// Bytes a slot ([`ring_slot_choice`]).
    slot_bytes: usize,
    input_bytes: usize,
    /// 2 where the blocks run in pairs (clusters) that add their split-K sums once
    /// ([`GpuModel::pair_ring`]), else 1.
    cluster: u32,
    /// FP8 layers: launches take the kernel's FP8 instance.
    fp8: bool,
    /// Steps take the ring (the executor's switch; off: the launches, to compare).
    pub on: bool,
    /// Measurement only (`HARRIER_RING_TRACE=1`): every launch writes its per-stage times
    /// here ([`RING_TRACE_WORDS`] u64 a stage and block, see the source), read by
    /// [`GpuModel::ring_trace`].
    trace: Option<DevBuf>,
}

impl RingDecode {
    /// The launch for a step's token (its stage list once built).
    fn launch(&self, step: RingStep) -> RingLaunch {
        RingLaunch {
            stages: self.stages.as_ref().map_or(0, |d| d.ptr),
            n: self.n_stages as i32,
            done: self.scratch.at(self.layout.done),
            blocks: self.blocks,
            slots: self.slots,
            depth: self.depth,
            input_bytes: self.input_bytes,
            slot_bytes: self.slot_bytes,
            trace: self.trace.as_ref().map_or(0, |t| t.ptr),
            cluster: self.cluster,
            step,
            fp8: self.fp8,
        }
    }
}

/// Byte offsets in [`RingDecode::scratch`].
#[derive(Debug, Clone, Copy)]
struct ScratchLayout {
    /// Per layer: q|k|v LL words (`hidden / 1024` a row, see [`RingStage::ll`]), o sums, MLP
    /// sums (two f32 halves each, see [`RingInput::Sums`]).
    layer: usize,
    qkv: usize,
    o: usize,
    mlp: usize,
    /// Per layer the residual after attention and after the MLP (f32).
    res: usize,
    /// The attention splits' partials (LL words), shared by the layers (o merges them before
    /// the next layer's attention writes; the tags tell the layers apart).
    part: usize,
    /// The output head's sums (the last stage converts them into the logits; none where the
    /// head stores the logits itself).
    head: usize,
    /// A counter a stage (blocks done), then a claim counter a stage (the next item), then
    /// the LL tags' epoch (u32, one up a launch).
    done: usize,
    total: usize,
}

impl ScratchLayout {
    fn new(m: &GpuModel, blocks: usize, n_stages: usize, head_rows: bool) -> ScratchLayout {
        let c = &m.config;
        let (hid, nh, nkv, hd) = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim);
        // (A sum's two f32 halves, an LL word: 8 bytes.)
        let sum = 8;
        let qkv_words = c.qkv_dim() * (hid / 1024);
        let (qkv, o, mlp) = (0, qkv_words * sum, (qkv_words + hid) * sum);
        let layer = (qkv_words + 2 * hid) * sum;
        let res = layer * c.num_layers;
        let part = res + 2 * hid * 4 * c.num_layers;
        let head = part + ring_attn_part_words(blocks, nh, nkv, hd) * sum;
        let done = head + if head_rows { 0 } else { c.vocab_size * sum };
        let total = done + (2 * n_stages + 1) * 4;
        ScratchLayout {
            layer,
            qkv,
            o,
            mlp,
            res,
            part,
            head,
            done,
            total,
        }
    }
}

/// The stage whose sums stage `s` of a ring of `layers` layers zeroes once it has waited, if
/// any (`head_rows`: the head stores the logits, no conversion stage). Only a stage after a
/// grid-wide wait knows that a buffer's readers have all finished: a q|k|v stage zeroes the o
/// sums of the layer before (read by that layer's MLP stage), an MLP stage the MLP sums of the
/// layer before (read by this layer's q|k|v stage, whose every block has since counted this
/// layer's o stage), the head the last o sums, the conversion the last MLP sums, and the first
/// q|k|v stage the head's of the launch before, or with no conversion the last MLP sums of the
/// launch before (the head's readers). The attention and o stages wait for no grid (their
/// inputs are LL words, never zeroed) and zero nothing.
fn zeroed_by(s: usize, layers: usize, head_rows: bool) -> Option<usize> {
    let head = 4 * layers;
    match s % 4 {
        _ if s == 0 && head_rows => Some(head - 1),
        _ if s == 0 => Some(head),
        _ if s >= head => Some(s - 2),
        0 => Some(s - 2),
        3 if s >= 7 => Some(s - 4),
        _ => None,
    }
}

/// Stages of a model of `layers` layers: q|k|v, attention, o and MLP a layer, then the head
/// and (unless `head_rows`) the logits' conversion.
fn stage_count(layers: usize, head_rows: bool) -> usize {
    4 * layers + if head_rows { 1 } else { 2 }
}

/// Whether the ring's head stores each logit itself, computed whole by one warp
/// ([`RING_OUT_ROWS`]: models 2,048 wide, two 1,024-weight pieces a row), instead of adding
/// exactly split sums that a conversion stage turns into the logits after one more grid-wide
/// wait. `HARRIER_RING_HEAD_ROWS=0` keeps the conversion, to measure. (Wider rows, P pieces
/// taken by a P-th of a slot's warps: docs/cuda.md, session 50; not measured, not built here.)
fn ring_head_rows(hidden: usize) -> bool {
    hidden == 2048 && harrier_kernels::switch_on("HARRIER_RING_HEAD_ROWS")
}

/// Whether the ring's layers are FP8: `Some(true)` where every layer projection is (the head
/// either way), `Some(false)` where none is and the head neither, `None` for a mix the kernel
/// does not take.
fn ring_fp8(m: &GpuModel) -> Option<bool> {
    let fp8 = |p: &Proj| p.scale.is_some();
    let mut projs = m
        .layers
        .iter()
        .flat_map(|l| [&l.qkv, &l.o, &l.gate_up, &l.down]);
    let first = fp8(projs.next()?);
    let uniform = projs.all(|p| fp8(p) == first);
    let head_fp8 = m.lm_head.as_ref().is_some_and(fp8);
    (uniform && (first || !head_fp8)).then_some(first)
}

/// Bytes a ring weight takes: 1 for FP8 layers, 2 for bf16.
fn weight_bytes(fp8: bool) -> usize {
    if fp8 {
        1
    } else {
        2
    }
}

/// Whether the ring's layers are FP8 where it can run this model's decode steps, or why it
/// cannot: Llama-shaped blocks of bf16 activations (no q/k norms, sandwich norms, sliding windows, embedding
/// scale) whose projections are all bf16 or all FP8, SiLU, the paired RoPE order, and shapes
/// the kernel takes (reductions of whole 1,024-weight warps, the fused MLP's chunks (FP8: 4 to
/// 16 rows, a tensor-core tile's k), the attention stage's heads, a KV block size it can shift
/// by), with `slot` bytes a slot.
fn ring_layers(m: &GpuModel, blocks: usize, slot: usize) -> Result<bool, String> {
    let c = &m.config;
    let (hid, q) = (c.hidden_size, c.num_heads * c.head_dim);
    let Some(fp8) = ring_fp8(m) else {
        return Err("layers mixing bf16 and FP8 projections, or an FP8 head on bf16 layers".into());
    };
    let wb = weight_bytes(fp8);
    let checks: [(bool, &str); 11] = [
        (m.dtype == Dtype::Bf16, "bf16 activations only"),
        (
            m.layers
                .iter()
                .all(|l| l.qk_norm.is_none() && l.ff_norms.is_none()),
            "q/k or sandwich norms",
        ),
        (
            m.layers.iter().all(|l| l.window == 0 && !l.local_rope),
            "sliding-window layers",
        ),
        (
            c.hidden_act == Activation::Silu,
            "an activation other than SiLU",
        ),
        (
            m.embed_scale == 1.0 && c.architecture.norm_weight_offset() == 0.0,
            "a scaled embedding or offset norm weights",
        ),
        (m.rope_paired, "q/k rows not in the paired RoPE order"),
        (
            hid % 1024 == 0 && q % 1024 == 0,
            "hidden size and q width must be multiples of 1,024",
        ),
        (
            ring_mlp_supports(c.intermediate_size, hid, slot, wb)
                && q.is_multiple_of(ring_chunk_rows(hid, slot, wb)),
            "the MLP's or o's shape (chunks of intermediate or head rows)",
        ),
        (
            ring_attn_supports(c.num_heads, c.num_kv_heads, c.head_dim, slot)
                && blocks >= c.num_kv_heads,
            "the attention heads",
        ),
        (
            m.block_size.is_power_of_two(),
            "a KV block size that is not a power of two",
        ),
        (
            [c.qkv_dim() * hid, hid * q, c.vocab_size * hid]
                .iter()
                .all(|&e| e < 1 << 31),
            "a projection of 2^31 weights or more",
        ),
    ];
    match checks.iter().find(|(ok, _)| !ok) {
        Some((_, why)) => Err(why.to_string()),
        None => Ok(fp8),
    }
}

/// The ring's layers (FP8 or not) and its slot size where it can run this model's decode
/// steps, or why not: [`ring_slot_bytes`]'s choice (24 KB for bf16 hidden sizes whose chunks
/// would fill only that of 32 KB), or [`RING_SLOT`] where the model's shapes fit only that.
/// `HARRIER_RING_SLOT` (32768 or 24576; read at load) overrides the choice, to measure.
fn ring_slot_choice(m: &GpuModel, blocks: usize) -> anyhow::Result<(bool, usize)> {
    let wb = weight_bytes(ring_fp8(m).unwrap_or(false));
    let forced = match std::env::var("HARRIER_RING_SLOT") {
        Ok(v) => Some(
            v.parse::<usize>()
                .ok()
                .filter(|&b| b == RING_SLOT || b == RING_SLOT_S24)
                .with_context(|| format!("HARRIER_RING_SLOT={v}: 32768 or 24576"))?,
        ),
        Err(_) => None,
    };
    let slot = forced.unwrap_or_else(|| ring_slot_bytes(m.config.hidden_size, wb));
    match ring_layers(m, blocks, slot) {
        Ok(fp8) => Ok((fp8, slot)),
        Err(_) if forced.is_none() && slot != RING_SLOT => ring_layers(m, blocks, RING_SLOT)
            .map(|fp8| (fp8, RING_SLOT))
            .map_err(|why| anyhow::anyhow!("{why}")),
        Err(why) => Err(anyhow::anyhow!("{why}")),
    }
}

/// `p`'s weights (`rows x cols` on the device) transposed into a new buffer: bf16, or (FP8,
/// chunks of `cr` transposed rows, [`ring_chunk_rows`]) e4m3 with transposed row `j`'s
/// elements rotated by `32 ((j % cr) / 4)` places (element `i` at `(i + that) % rows`), the
/// layout `ring_f8_rows` reads without bank conflicts. An FP8 projection's scales stay as
/// they are: one an output channel, now a column.
fn transposed(p: &Proj, rows: usize, cols: usize, cr: usize) -> anyhow::Result<DevBuf> {
    match p.scale {
        Some(_) => transposed_as::<u8>(&p.w, rows, cols, Some(cr)),
        None => transposed_as::<u16>(&p.w, rows, cols, None),
    }
}

/// Where element `i` of transposed row `j` goes: rotated within chunks of `cr` rows (an FP8
/// copy, see [`transposed`]), or in place.
fn rotated(i: usize, j: usize, rows: usize, cr: Option<usize>) -> usize {
    match cr {
        None => i,
        Some(cr) => (i + 32 * ((j % cr) / 4)) % rows,
    }
}

/// `w` (`rows x cols` elements of `T` on the device) transposed into a new buffer, each
/// transposed row rotated as [`rotated`] says.
fn transposed_as<T: Copy + Default>(
    w: &DevBuf,
    rows: usize,
    cols: usize,
    cr: Option<usize>,
) -> anyhow::Result<DevBuf> {
    let mut host = vec![T::default(); rows * cols];
    // SAFETY: `w` holds rows * cols elements of T; the host vector as many.
    unsafe { dr::memcpy_dtoh_sync(&mut host, w.ptr) }.context("reading a projection")?;
    let t = transpose_rotated(&host, rows, cols, cr);
    let out = DevBuf::new(rows * cols * std::mem::size_of::<T>())?;
    // SAFETY: `out` holds rows * cols elements of T.
    unsafe { dr::memcpy_htod_sync(out.ptr, &t) }.context("writing a transposed projection")?;
    Ok(out)
}

/// `host` (`rows x cols`) transposed, transposed row `c` rotated as [`rotated`] says.
fn transpose_rotated<T: Copy + Default>(
    host: &[T],
    rows: usize,
    cols: usize,
    cr: Option<usize>,
) -> Vec<T> {
    let mut t = vec![T::default(); rows * cols];
    // Blocks of 64 x 64 keep both sides in cache.
    const B: usize = 64;
    for r0 in (0..rows).step_by(B) {
        for c0 in (0..cols).step_by(B) {
            for r in r0..(r0 + B).min(rows) {
                for c in c0..(c0 + B).min(cols) {
                    t[c * rows + rotated(r, c, rows, cr)] = host[r * cols + c];
                }
            }
        }
    }
    t
}

impl GpuModel {
    /// Sets the decode ring up for `kernels`' launches on a device of `sms` SMs with
    /// `smem_optin` bytes of shared memory a block (before the KV cache is sized: the
    /// transposed o and down projections take memory): prepared, its shared memory allowed,
    /// its blocks paired where they fit. Returns whether they are paired, or why there is no
    /// ring (the launches then run every step): on any failure the model keeps none, so a ring
    /// it has is one that launches.
    pub(crate) fn setup_ring(
        &mut self,
        sms: usize,
        smem_optin: usize,
        kernels: &Kernels,
    ) -> anyhow::Result<bool> {
        let set = (|| {
            self.prepare_ring(sms, smem_optin)?;
            kernels.allow_ring_smem(self.ring_smem())?;
            self.pair_ring(|l| kernels.ring_pairs_fit(l))
        })();
        if set.is_err() {
            self.ring = None;
        }
        set
    }

    /// Prepares the decode ring (see [`GpuModel::setup_ring`]); returns why not when the model
    /// does not fit it.
    fn prepare_ring(&mut self, sms: usize, smem_optin: usize) -> anyhow::Result<()> {
        let (fp8, slot) = ring_slot_choice(self, sms)?;
        let c = &self.config;
        let (hid, inter) = (c.hidden_size, c.intermediate_size);
        let q = c.num_heads * c.head_dim;
        let cr = ring_chunk_rows(hid, slot, weight_bytes(fp8));
        let input_bytes = ring_input_bytes(c, fp8, sms, slot)?;
        let slots = (smem_optin.saturating_sub(input_bytes + STATIC_SMEM)
            / (slot + ring_slot_side(fp8)))
        .min(RING_MAX_SLOTS);
        if slots < 2 {
            anyhow::bail!("{smem_optin} bytes of shared memory a block hold {slots} ring slots");
        }
        let head_rows = ring_head_rows(hid);
        let n_stages = stage_count(c.num_layers, head_rows);
        let layout = ScratchLayout::new(self, sms, n_stages, head_rows);
        let down_t = self
            .layers
            .iter()
            .map(|l| transposed(&l.down, hid, inter, cr))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let o_t = self
            .layers
            .iter()
            .map(|l| transposed(&l.o, hid, q, cr))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let scratch = DevBuf::new(layout.total)?;
        // SAFETY: the buffer holds `total` bytes.
        unsafe { dr::memset_d8_sync(scratch.ptr, 0, layout.total) }.context("zeroing")?;
        self.weight_bytes += down_t.iter().chain(&o_t).map(|b| b.bytes).sum::<usize>();
        self.ring = Some(RingDecode {
            down_t,
            o_t,
            scratch,
            layout,
            stages: None,
            n_stages,
            head_rows,
            blocks: sms as u32,
            slots: slots as i32,
            depth: ring_depths(slot, slots as i32, fp8),
            slot_bytes: slot,
            input_bytes,
            on: true,
            cluster: 1,
            fp8,
            // (Off unless set: every traced launch writes its times.)
            trace: match std::env::var("HARRIER_RING_TRACE").is_ok_and(|v| v == "1") {
                true => {
                    let t = DevBuf::new(RING_TRACE_WORDS * n_stages * sms * 8)?;
                    // SAFETY: the buffer holds that many bytes. (Zero: blocks that stamp
                    // nothing in a stage read as such.)
                    unsafe { dr::memset_d8_sync(t.ptr, 0, t.bytes) }.context("zeroing")?;
                    Some(t)
                }
                false => None,
            },
        });
        Ok(())
    }

    /// The last traced launch's per-stage times (`HARRIER_RING_TRACE=1`) with the layer count
    /// and blocks, or `None` without a trace. Call with nothing in flight.
    pub(crate) fn ring_trace(&self) -> anyhow::Result<Option<(Vec<u64>, usize, usize)>> {
        let Some((r, t)) = self
            .ring
            .as_ref()
            .and_then(|r| Some(r).zip(r.trace.as_ref()))
        else {
            return Ok(None);
        };
        let mut v = vec![0u64; t.bytes / 8];
        // SAFETY: the buffer holds that many u64; the caller has nothing in flight.
        unsafe { dr::memcpy_dtoh_sync(&mut v, t.ptr) }.context("reading the ring trace")?;
        Ok(Some((v, self.config.num_layers, r.blocks as usize)))
    }

    /// The ring's stage list over the KV cache (after [`GpuModel::alloc_kv`]).
    pub(super) fn build_ring_stages(&mut self) -> anyhow::Result<()> {
        let Some(r) = self.ring.as_ref() else {
            return Ok(());
        };
        let kv = self.kv.as_ref().context("KV cache not allocated")?;
        let c = &self.config;
        let (hid, nh, nkv, hd) = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim);
        let (l, base) = (r.layout, r.scratch.ptr);
        let at = |off: usize| base + off as u64;
        let layer = |i: usize, off: usize| at(i * l.layer + off);
        let res = |i: usize, which: usize| at(l.res + (2 * i + which) * hid * 4);
        let eps = c.rms_norm_eps;
        let mut stages = Vec::with_capacity(r.n_stages);
        for (i, w) in self.layers.iter().enumerate() {
            let (k_off, v_off, _) = self.kv_layers[i];
            // The input: the embedding (bf16, the residual itself) or the last MLP's sums
            // added to the residual; normed.
            let (x, x_form, res_in) = match i {
                0 => (self.scratch.x.ptr, RingInput::Bf16, 0),
                _ => (layer(i - 1, l.mlp), RingInput::Sums, res(i - 1, 1)),
            };
            let hid_len = hid as i32;
            stages.push(RingStage {
                kind: RingKind::Gemv,
                w: w.qkv.w.ptr,
                ws: w.qkv.scale_ptr(),
                x,
                x_form,
                x_len: hid_len,
                res: res_in,
                res_out: res(i, 0),
                norm_w: w.input_norm.ptr,
                y: layer(i, l.qkv),
                n: c.qkv_dim() as i32,
                k: hid as i32,
                eps,
                ll: 1,
                ..Default::default()
            });
            stages.push(RingStage {
                kind: RingKind::Attn,
                x: layer(i, l.qkv),
                // (The q|k|v stage's K: its LL words a row are K / 1024.)
                k: hid as i32,
                k_cache: kv.at(k_off),
                v_cache: kv.at(v_off),
                inv_freq: self.inv_freq.ptr,
                part: at(l.part),
                nh: nh as i32,
                nkv: nkv as i32,
                hd: hd as i32,
                scale: c.attention_scale(),
                ..Default::default()
            });
            // (Right after its attention stage: a paired block's o pushes wait for the
            // partner's attention stage to end, the kernel's `partner_free`.)
            stages.push(RingStage {
                kind: RingKind::GemvT,
                w: r.o_t[i].ptr,
                ws: w.o.scale_ptr(),
                x: at(l.part),
                x_form: RingInput::AttnParts,
                nh: nh as i32,
                nkv: nkv as i32,
                hd: hd as i32,
                y: layer(i, l.o),
                n: hid as i32,
                k: (nh * hd) as i32,
                ..Default::default()
            });
            stages.push(RingStage {
                kind: RingKind::Mlp,
                w: w.gate_up.w.ptr,
                w2: r.down_t[i].ptr,
                ws: w.gate_up.scale_ptr(),
                ws2: w.down.scale_ptr(),
                x: layer(i, l.o),
                x_len: hid_len,
                res: res(i, 0),
                res_out: res(i, 1),
                norm_w: w.post_norm.ptr,
                y: layer(i, l.mlp),
                n: c.intermediate_size as i32,
                k: hid as i32,
                eps,
                ..Default::default()
            });
        }
        let last = c.num_layers - 1;
        let (head, head_ws) = self
            .lm_head
            .as_ref()
            .map_or((self.embed.ptr, 0), |p| (p.w.ptr, p.scale_ptr()));
        stages.push(RingStage {
            kind: RingKind::Gemv,
            w: head,
            ws: head_ws,
            x: layer(last, l.mlp),
            x_len: hid as i32,
            res: res(last, 1),
            norm_w: self.final_norm.ptr,
            y: if r.head_rows {
                self.scratch.logits.ptr
            } else {
                at(l.head)
            },
            ll: if r.head_rows { RING_OUT_ROWS } else { 0 },
            n: c.vocab_size as i32,
            k: hid as i32,
            eps,
            ..Default::default()
        });
        if !r.head_rows {
            stages.push(RingStage {
                kind: RingKind::Convert,
                x: at(l.head),
                x_len: c.vocab_size as i32,
                y: self.scratch.logits.ptr,
                n: c.vocab_size as i32,
                ..Default::default()
            });
        }
        let n = stages.len();
        for s in 0..n {
            // (Two f32 halves a sum: a u64 word each.)
            (stages[s].zero, stages[s].zero_len) = match zeroed_by(s, c.num_layers, r.head_rows) {
                Some(z) => (stages[z].y, stages[z].sums_len()),
                None => (0, 0),
            };
        }
        debug_assert_eq!(n, r.n_stages);
        let d = DevBuf::new(stages.len() * std::mem::size_of::<RingStage>())?;
        // SAFETY: `d` holds the stages.
        unsafe { dr::memcpy_htod_sync(d.ptr, &stages) }.context("uploading the ring stages")?;
        if let Some(r) = self.ring.as_mut() {
            r.stages = Some(d);
        }
        Ok(())
    }

    /// Whether batch-1 decode steps take the ring (prepared and on).
    pub(crate) fn ring_on(&self) -> bool {
        self.ring.as_ref().is_some_and(|r| r.on)
    }

    /// Turns the ring on or off: `None` without a ring, else whether that changed it.
    pub(crate) fn set_ring(&mut self, on: bool) -> Option<bool> {
        self.ring
            .as_mut()
            .map(|r| std::mem::replace(&mut r.on, on) != on)
    }

    /// Runs the ring's blocks in clusters of two where they all fit (`fits`:
    /// [`harrier_kernels::Kernels::ring_pairs_fit`] of the launch) unless `HARRIER_RING_PAIRS=0`:
    /// each pair adds the o and MLP stages' split-K sums once, half the atomics. Returns
    /// whether it does.
    fn pair_ring(
        &mut self,
        fits: impl FnOnce(&RingLaunch) -> anyhow::Result<bool>,
    ) -> anyhow::Result<bool> {
        let Some(r) = self.ring.as_mut() else {
            return Ok(false);
        };
        let paired = harrier_kernels::switch_on("HARRIER_RING_PAIRS")
            && fits(&r.launch(RingStep::default()))?;
        r.cluster = if paired { 2 } else { 1 };
        Ok(paired)
    }

    /// What `f` says of the ring's launch (`None` without a ring).
    pub(crate) fn with_ring_launch<T>(&self, f: impl FnOnce(&RingLaunch) -> T) -> Option<T> {
        self.ring
            .as_ref()
            .map(|r| f(&r.launch(RingStep::default())))
    }

    /// Dynamic shared memory of the ring's launches (0 without a ring).
    pub(crate) fn ring_smem(&self) -> usize {
        self.with_ring_launch(RingLaunch::smem).unwrap_or(0)
    }

    /// Whether step `m` of `gemm_rows` rows runs as the ring: one token, sampled, no prefill
    /// tiles, none of the launches left out.
    pub(super) fn ring_takes(&self, m: &StepMeta, gemm_rows: usize) -> bool {
        self.ring
            .as_ref()
            .is_some_and(|r| r.on && r.stages.is_some())
            && m.n_tokens == 1
            && m.n_samples == 1
            && gemm_rows == 1
            && m.n_pf_tiles == 0
            && self.skip.is_none()
    }

    /// Enqueues the ring for step `m` (after the embedding).
    ///
    /// # Safety
    /// `m`'s addresses must hold the step's metadata (one token, row 0).
    pub(super) unsafe fn launch_ring(
        &self,
        k: &Kernels,
        stream: sys::CUstream,
        m: &StepMeta,
    ) -> anyhow::Result<()> {
        let r = self.ring.as_ref().context("no decode ring")?;
        anyhow::ensure!(r.stages.is_some(), "decode ring without its stages");
        let launch = r.launch(RingStep {
            positions: m.positions,
            slot_mapping: m.slot_mapping,
            block_tables: m.row_block_tables,
            tok_row: m.tok_row,
            bt_stride: m.bt_stride as i32,
            block_size: self.block_size as i32,
        });
        // SAFETY: the stages were built over this model's buffers and KV cache; the sums and
        // counters are zero between launches (each launch leaves them so); the executor raised
        // the shared-memory limit to `ring_smem`; the caller vouches for m.
        unsafe { k.gemv_ring(stream, &launch) }
    }
}

/// Shared memory beside a ring block's slots for its stage's input: an attention stage's
/// state, or (bf16) the stage's bf16 input, or the o stage's rows (f32: a block's run of
/// chunks of input rows), in 2 hidden-size bytes, then the half of the hidden-wide f32 split-K
/// sums a cluster's partner pushes to the block in the next 2 (`add_out`); FP8 that region
/// first, then the input as f16 or o's rows, then the o and down column scales (f32) in 4
/// hidden-size bytes. An error where o's rows would reach past their 2 hidden-size bytes.
pub(crate) fn ring_input_bytes(
    c: &ModelConfig,
    fp8: bool,
    sms: usize,
    slot: usize,
) -> anyhow::Result<usize> {
    let hid = c.hidden_size;
    let q = c.num_heads * c.head_dim;
    let cr = ring_chunk_rows(hid, slot, weight_bytes(fp8));
    let o_rows = q.div_ceil(cr).div_ceil(sms) * cr;
    if 4 * o_rows > 2 * hid {
        anyhow::bail!(
            "the o stage's {o_rows} input rows a block do not fit beside the pair's sums"
        );
    }
    Ok((if fp8 { 8 * hid } else { 4 * hid })
        .max(ring_attn_smem(c.num_heads / c.num_kv_heads, c.head_dim)))
}

/// Bytes of the ring's transposed copies of o and down (`[q, hidden]` and `[intermediate,
/// hidden]` a layer, bf16 or, for FP8 layers, e4m3), made at load beside the model's own
/// weights.
pub(crate) fn ring_copy_bytes(c: &ModelConfig, fp8: bool) -> usize {
    c.num_layers
        * c.hidden_size
        * (c.num_heads * c.head_dim + c.intermediate_size)
        * weight_bytes(fp8)
}

/// `--decode-ring auto`: the ring where its copies (of FP8 layers with `fp8`) take at most
/// 1/[`RING_AUTO_MEMORY_DIVISOR`] of the device's `total` bytes.
pub(crate) fn ring_auto(c: &ModelConfig, fp8: bool, total: usize) -> bool {
    ring_copy_bytes(c, fp8) * RING_AUTO_MEMORY_DIVISOR <= total
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gen_model::Preset;

    #[test]
    fn every_sum_buffer_is_zeroed_once_after_its_readers_and_no_ll_buffer_is() {
        // Stage kinds by index: 4 a layer (q|k|v, attention, o, MLP), then the head and (unless
        // it stores the logits itself) the conversion. A sum buffer's readers: o's the MLP of
        // its layer, the MLP's the next q|k|v (the last MLP's, the head), the head's the
        // conversion.
        for head_rows in [false, true] {
            for layers in [1, 2, 16] {
                let n = stage_count(layers, head_rows);
                let head = 4 * layers;
                assert_eq!(n, head + 2 - head_rows as usize);
                let mut zeroed = vec![0; n];
                for s in 0..n {
                    if let Some(z) = zeroed_by(s, layers, head_rows) {
                        zeroed[z] += 1;
                        // The zeroing stage waits for a grid (a q|k|v, MLP, head or conversion
                        // stage, not the attention or o stage), for every block past the
                        // buffer's reader, the stage after its writer (the first q|k|v stage
                        // zeroes the launch before's head, or its last MLP's).
                        assert!(s % 4 == 0 || s % 4 == 3 || s >= head, "stage {s}");
                        assert!(s == 0 || s > z + 1, "stage {s} zeroes {z}");
                    }
                }
                for (z, &times) in zeroed.iter().enumerate() {
                    // o (4l + 2), MLP (4l + 3) and the head's sums: once each; q|k|v (LL
                    // words), attention (partials, LL), the conversion's f32 logits and a head
                    // storing them: never.
                    let sums = (z < head && z % 4 >= 2) || (z == head && !head_rows);
                    assert_eq!(times, sums as usize, "stage {z} of {n}, {head_rows}");
                }
            }
        }
    }

    #[test]
    fn auto_takes_the_ring_where_its_copies_fit_a_sixteenth_of_the_memory() {
        let cfg = |name| Preset::from_name(name).unwrap().config();
        let (b1, b3, b8) = (
            cfg("llama-3.2-1b"),
            cfg("llama-3.2-3b"),
            cfg("llama-3.1-8b"),
        );
        // 16 x 2048 x (2048 + 8192) bf16; the 8B's 32 x 4096 x (4096 + 14336); FP8 half.
        assert_eq!(ring_copy_bytes(&b1, false), 671_088_640);
        assert_eq!(ring_copy_bytes(&b8, false), 4_831_838_208);
        assert_eq!(ring_copy_bytes(&b8, true), 2_415_919_104);
        // An 80 GB H100 reports ~79.1 GiB: every Llama to the 8B; a 70B's 48 GB, no.
        let h100 = 81_079_000_000;
        assert!([&b1, &b3, &b8].iter().all(|c| ring_auto(c, false, h100)));
        let mut l70 = b8.clone();
        (l70.num_layers, l70.hidden_size, l70.intermediate_size) = (80, 8192, 28672);
        (l70.num_heads, l70.head_dim) = (64, 128);
        assert!(!ring_auto(&l70, false, h100) && !ring_auto(&l70, true, h100));
        assert!(ring_auto(&l70, false, 16 * ring_copy_bytes(&l70, false)));
        assert!(!ring_auto(
            &l70,
            false,
            16 * ring_copy_bytes(&l70, false) - 1
        ));
        // A 24 GiB card: the 1B's 0.67 GB (x 16: 10.7 GB), not the 3B's 1.9 GB (x 16: 31 GB);
        // the 3B in FP8 (0.94 GB, x 16: 15 GB), yes.
        assert!(ring_auto(&b1, false, 24 << 30) && !ring_auto(&b3, false, 24 << 30));
        assert!(ring_auto(&b3, true, 24 << 30));
    }

    #[test]
    fn the_input_region_holds_the_pairs_sums_beside_the_input() {
        let cfg = |name| Preset::from_name(name).unwrap().config();
        let (b1, b3, b8) = (
            cfg("llama-3.2-1b"),
            cfg("llama-3.2-3b"),
            cfg("llama-3.1-8b"),
        );
        // 4 hidden-size bytes (bf16), 8 (FP8), or an attention state larger than that.
        assert_eq!(
            ring_input_bytes(&b1, false, 132, RING_SLOT).unwrap(),
            (4 * 2048).max(ring_attn_smem(4, 64))
        );
        assert_eq!(
            ring_input_bytes(&b8, true, 132, RING_SLOT).unwrap(),
            8 * 4096
        );
        // The 3B in 24 KB slots (its bf16 choice): the same 4-row chunks of o, so the same
        // region.
        assert_eq!(ring_slot_bytes(b3.hidden_size, 2), RING_SLOT_S24);
        assert_eq!(
            ring_input_bytes(&b3, false, 132, RING_SLOT_S24).unwrap(),
            ring_input_bytes(&b3, false, 132, RING_SLOT).unwrap()
        );
        // o's rows a block: the 1B's 8-row chunks over 132 blocks, 2 chunks (64 bytes); on
        // a device of one SM all 2,048 rows (8 KB), past the 4 KB before the pair's sums.
        assert!(ring_input_bytes(&b1, false, 2, RING_SLOT).is_ok());
        let e = ring_input_bytes(&b1, false, 1, RING_SLOT)
            .unwrap_err()
            .to_string();
        assert!(e.contains("2048 input rows"), "{e}");
    }

    #[test]
    fn a_layer_is_four_stages_then_the_head_and_its_conversion_unless_it_stores_the_logits() {
        assert_eq!(stage_count(16, false), 66);
        assert_eq!(stage_count(1, false), 6);
        assert_eq!(stage_count(16, true), 65);
        // The head stores the logits on 2,048-wide models only (the 1B), unless switched off.
        if std::env::var_os("HARRIER_RING_HEAD_ROWS").is_none() {
            assert!(ring_head_rows(2048));
        }
        assert!(!ring_head_rows(3072) && !ring_head_rows(4096));
    }

    /// The FP8 copies' layout as `ring_f8_rows` reads it: lane (g, t) of a warp takes
    /// transposed rows 4t..4t+3 of a chunk at logical columns 32 p + 4g.. (p a 32-column pair),
    /// 4 bytes at `(32 p + 4g + 32 t) % len`: they hold the right weights, and for each row
    /// offset i a warp's 32 loads fall in 32 different banks. (The 1B's and 3B's shapes.)
    #[test]
    fn fp8_copies_are_rotated_as_the_tensor_core_loads_read_them() {
        for (rows, cols, cr) in [(2048, 48, 16), (3072, 24, 8)] {
            assert_eq!(ring_chunk_rows(rows, RING_SLOT, 1), cr);
            let host: Vec<u32> = (0..rows * cols).map(|i| i as u32).collect();
            let t = transpose_rotated(&host, rows, cols, Some(cr));
            for chunk in 0..cols / cr {
                for p in 0..rows / 32 {
                    for i in 0..4 {
                        let mut banks = std::collections::HashSet::new();
                        for lane in 0..32 {
                            let (g, tt) = (lane / 4, lane % 4);
                            if 4 * tt >= cr {
                                continue;
                            }
                            let j = chunk * cr + 4 * tt + i;
                            let at = (32 * p + 4 * g + 32 * tt) % rows;
                            for k in 0..4 {
                                assert_eq!(
                                    t[j * rows + at + k],
                                    host[(32 * p + 4 * g + k) * cols + j]
                                );
                            }
                            assert!(banks.insert((j * rows + at) / 4 % 32), "bank conflict");
                        }
                    }
                }
            }
        }
        // bf16 copies are plain transposes.
        let host: Vec<u16> = (0..6).collect();
        assert_eq!(transpose_rotated(&host, 2, 3, None), [0, 3, 1, 4, 2, 5]);
    }
}
