//! FP8 tensor-core GEMMs through cuBLASLt for the steps of FP8 models that the skinny kernels
//! do not take (more than `FP8_SKINNY_MAX_ROWS` rows: prefill and large decode batches):
//! `y[rows, n] = x[rows, k] · w[n, k]ᵀ` with e4m3 weights (one scale per output channel) and
//! e4m3 activations quantized per token (`quantize_fp8_rows`, the weights' rounding rule).
//! cuBLASLt multiplies with unit scales into bf16 (or f32 logits) and `fp8_rescale` applies
//! `xs[m] * ws[n]` in place: cuBLASLt's own scales are per tensor, which would make one outlier
//! token coarsen every other token's activations.
//!
//! Why activations are quantized here but stay bf16 in the skinny kernels: at a few rows a
//! decode step is bound by reading the weights, and converting them to bf16 in registers is
//! free; at many rows the GEMM is bound by tensor-core throughput, where e4m3 x e4m3 runs at
//! twice bf16's rate, and the bf16 alternative (dequantizing the weights to a bf16 copy first)
//! reads 2.5 bytes more per weight than bf16 itself. Per-token dynamic scales are what vLLM
//! uses for FP8 checkpoints without static activation scales.
//!
//! cuBLASLt needs sm_89 or newer for FP8 and "TN" operands (both k-major: our weights and
//! activations are); the plan of each shape (layouts and the heuristic's algorithm) is made on
//! first use (or at start-up, [`Fp8Gemm::prepare`]) and kept, so a step's host cost is a hash
//! lookup per GEMM (and graph replays have none). [`Fp8Gemm::project`] is the whole route; the
//! e4m3 activations live in buffers of its own, sized at creation.

use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::c_void;

use anyhow::{anyhow, bail, Context};
use harrier_kernels::cudarc::cublas::sys::cublasOperation_t;
use harrier_kernels::cudarc::cublaslt::sys as lt;
use harrier_kernels::cudarc::driver::sys;
use harrier_kernels::Kernels;

use super::DevBuf;

const WORKSPACE_BYTES: usize = 32 << 20;

fn lt_ck(s: lt::cublasStatus_t, what: &str) -> anyhow::Result<()> {
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(anyhow!("cuBLASLt error in {what}: {s:?}"))
    }
}

/// The output of an FP8 GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Out {
    /// bf16 rows of `n` (projections).
    Bf16,
    /// f32 rows `ld` apart (logits: a slice of the vocabulary into its columns).
    F32 { ld: usize },
}

/// One shape's layouts and algorithm (the layouts are owned by [`Fp8Gemm::plans`]; copies
/// are handles for one call).
#[derive(Clone, Copy)]
struct Plan {
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    d: lt::cublasLtMatrixLayout_t,
    algo: lt::cublasLtMatmulAlgo_t,
}

/// A cuBLASLt handle for FP8 GEMMs on one stream, with its own workspace (fixed: graph capture
/// needs it) and the plans of the shapes seen so far.
pub struct Fp8Gemm {
    handle: lt::cublasLtHandle_t,
    desc: lt::cublasLtMatmulDesc_t,
    pref: lt::cublasLtMatmulPreference_t,
    workspace: DevBuf,
    /// The activations in e4m3, `[max_rows, max_k]` bytes, and their per-token scales.
    xq: DevBuf,
    xs: DevBuf,
    max_rows: usize,
    max_k: usize,
    /// Keyed by (n, rows, k, out).
    plans: RefCell<HashMap<(usize, usize, usize, Fp8Out), Plan>>,
}

// SAFETY: the handles are plain cuBLASLt handles used from whichever single thread owns the
// executor (with its context current); nothing is shared.
unsafe impl Send for Fp8Gemm {}

impl Fp8Gemm {
    /// A handle for steps of up to `max_rows` rows over reductions up to `max_k` wide, or why
    /// FP8 GEMMs are unavailable here (no libcublasLt, or a device before sm_89): the caller
    /// then dequantizes to bf16 instead.
    pub fn new(arch: &str, max_rows: usize, max_k: usize) -> anyhow::Result<Fp8Gemm> {
        let sm = harrier_kernels::sm_version(arch)
            .with_context(|| format!("unknown architecture {arch}"))?;
        if sm < 89 {
            bail!("FP8 tensor cores need sm_89 or newer ({arch})");
        }
        // SAFETY: only tries to dlopen the library.
        if !unsafe { lt::is_culib_present() } {
            bail!("libcublasLt not found");
        }
        let (max_rows, max_k) = (max_rows.max(1), max_k.max(1));
        let mut g = Fp8Gemm {
            handle: std::ptr::null_mut(),
            desc: std::ptr::null_mut(),
            pref: std::ptr::null_mut(),
            workspace: DevBuf::new(WORKSPACE_BYTES)?,
            xq: DevBuf::new(max_rows * max_k)?,
            xs: DevBuf::new(max_rows * 4)?,
            max_rows,
            max_k,
            plans: RefCell::new(HashMap::new()),
        };
        // SAFETY: plain cuBLASLt set-up calls on fresh handles (what fails before the end is
        // released by Drop); attribute buffers are live values of the documented types
        // (cublasOperation_t is an int32, the workspace size a uint64).
        unsafe {
            lt_ck(lt::cublasLtCreate(&mut g.handle), "cublasLtCreate")?;
            lt_ck(
                lt::cublasLtMatmulDescCreate(
                    &mut g.desc,
                    lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    lt::cudaDataType_t::CUDA_R_32F,
                ),
                "cublasLtMatmulDescCreate",
            )?;
            for (attr, op) in [
                (
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                    cublasOperation_t::CUBLAS_OP_T as i32,
                ),
                (
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                    cublasOperation_t::CUBLAS_OP_N as i32,
                ),
            ] {
                lt_ck(
                    lt::cublasLtMatmulDescSetAttribute(
                        g.desc,
                        attr,
                        &op as *const i32 as *const c_void,
                        4,
                    ),
                    "cublasLtMatmulDescSetAttribute",
                )?;
            }
            lt_ck(
                lt::cublasLtMatmulPreferenceCreate(&mut g.pref),
                "cublasLtMatmulPreferenceCreate",
            )?;
            let ws = WORKSPACE_BYTES as u64;
            lt_ck(
                lt::cublasLtMatmulPreferenceSetAttribute(
                    g.pref,
                    lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &ws as *const u64 as *const c_void,
                    8,
                ),
                "cublasLtMatmulPreferenceSetAttribute",
            )?;
            Ok(g)
        }
    }

    /// Plans a shape ahead of use (start-up checks that cuBLASLt has an algorithm for the
    /// model's shapes, so a step never finds out; the plan is kept).
    pub fn prepare(&self, rows: usize, (n, k): (usize, usize), out: Fp8Out) -> anyhow::Result<()> {
        self.plan_for(rows, (n, k), out).map(drop)
    }

    /// The plan of a shape, made on first use.
    fn plan_for(&self, rows: usize, (n, k): (usize, usize), out: Fp8Out) -> anyhow::Result<Plan> {
        Ok(match self.plans.borrow_mut().entry((n, rows, k, out)) {
            Entry::Occupied(e) => *e.get(),
            Entry::Vacant(e) => *e.insert(self.plan(n, rows, k, out)?),
        })
    }

    /// The e4m3 activations and their scales as the last [`Fp8Gemm::project`] left them
    /// (device addresses; tools compare them with the host's quantizer).
    pub fn activations(&self) -> (u64, u64) {
        (self.xq.ptr, self.xs.ptr)
    }

    /// The whole route: `y[m, j] = (Σ_k e4m3(x[m, k] / xs[m]) · w[j, k]) · xs[m] · ws[j]` for
    /// `m < rows`, with `w` e4m3 weights of one scale `ws[j]` per row: `quantize_fp8_rows`,
    /// the cuBLASLt GEMM with unit scales, then `fp8_rescale` in place (bf16 rows of `n`, or
    /// f32 rows `ld` apart).
    ///
    /// # Safety
    /// `x` must hold `rows x k` bf16, `w` `n x k` bytes, `ws` `n` f32 and `y` the output rows,
    /// 16-byte aligned; `stream` the stream the handle's work is ordered on.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn project(
        &self,
        kernels: &Kernels,
        stream: sys::CUstream,
        (x, w, ws, y): (u64, u64, u64, u64),
        rows: usize,
        (n, k): (usize, usize),
        out: Fp8Out,
    ) -> anyhow::Result<()> {
        if rows > self.max_rows || k > self.max_k {
            bail!(
                "FP8 GEMM of {rows} x {k} exceeds its activation buffers ({} x {})",
                self.max_rows,
                self.max_k
            );
        }
        let (ld, f32_out) = match out {
            Fp8Out::Bf16 => (n, false),
            Fp8Out::F32 { ld } => (ld, true),
        };
        // SAFETY: the caller's contract for x, w, ws and y; xq/xs hold rows x k (checked).
        unsafe {
            kernels.quantize_fp8_rows(stream, (x, self.xq.ptr, self.xs.ptr), rows, k)?;
            self.gemm(stream, (self.xq.ptr, w, y), rows, (n, k), out)?;
            kernels.fp8_rescale(stream, (y, self.xs.ptr, ws), rows, n, ld, f32_out)
        }
    }

    /// `d[m, j] = Σ_k xq[m, k] · wq[j, k]` over `rows` rows of e4m3 (unit scales), into bf16
    /// rows of `n` or f32 rows `ld` apart. Plans the shape on first use.
    ///
    /// # Safety
    /// `wq` must hold `n * k` bytes, `xq` `rows * k` bytes, `d` the output rows; 16-byte
    /// aligned; `stream` the stream the handle's work is ordered on.
    unsafe fn gemm(
        &self,
        stream: sys::CUstream,
        (xq, wq, d): (u64, u64, u64),
        rows: usize,
        (n, k): (usize, usize),
        out: Fp8Out,
    ) -> anyhow::Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let p = self.plan_for(rows, (n, k), out)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the plan's layouts describe these operands (caller's contract for the
        // addresses); alpha/beta are host f32 (the default pointer mode); C aliases D with
        // beta 0.
        unsafe {
            lt_ck(
                lt::cublasLtMatmul(
                    self.handle,
                    self.desc,
                    &alpha as *const f32 as *const c_void,
                    wq as *const c_void,
                    p.a,
                    xq as *const c_void,
                    p.b,
                    &beta as *const f32 as *const c_void,
                    d as *const c_void,
                    p.d,
                    d as *mut c_void,
                    p.d,
                    &p.algo,
                    self.workspace.ptr as *mut c_void,
                    WORKSPACE_BYTES,
                    stream as _,
                ),
                "cublasLtMatmul (FP8)",
            )
        }
    }

    /// Layouts (column-major, as cuBLASLt sees them): A = the weights, k x n with ld k, taken
    /// transposed; B = the activations, k x rows with ld k; D = n x rows with ld n (bf16) or
    /// ld (f32).
    fn plan(&self, n: usize, rows: usize, k: usize, out: Fp8Out) -> anyhow::Result<Plan> {
        let layout = |ty: lt::cudaDataType_t, r: usize, c: usize, ld: usize| {
            let mut l: lt::cublasLtMatrixLayout_t = std::ptr::null_mut();
            // SAFETY: creates a layout descriptor; freed by Plan's owner (Drop).
            lt_ck(
                unsafe {
                    lt::cublasLtMatrixLayoutCreate(&mut l, ty, r as u64, c as u64, ld as i64)
                },
                "cublasLtMatrixLayoutCreate",
            )
            .map(|_| l)
        };
        let e4m3 = lt::cudaDataType_t::CUDA_R_8F_E4M3;
        let a = layout(e4m3, k, n, k)?;
        let b = layout(e4m3, k, rows, k)?;
        let d = match out {
            Fp8Out::Bf16 => layout(lt::cudaDataType_t::CUDA_R_16BF, n, rows, n)?,
            Fp8Out::F32 { ld } => layout(lt::cudaDataType_t::CUDA_R_32F, n, rows, ld)?,
        };
        // SAFETY: a zeroed heuristic result is a valid POD value the call overwrites.
        let mut res: lt::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        let mut count = 0;
        // SAFETY: every descriptor is live; one result requested into `res`.
        unsafe {
            lt_ck(
                lt::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    self.desc,
                    a,
                    b,
                    d,
                    d,
                    self.pref,
                    1,
                    &mut res,
                    &mut count,
                ),
                "cublasLtMatmulAlgoGetHeuristic",
            )?;
        }
        let plan = Plan {
            a,
            b,
            d,
            algo: res.algo,
        };
        if count < 1 {
            destroy(&plan);
            bail!("cuBLASLt has no FP8 algorithm for {n} x {rows} x {k} ({out:?})");
        }
        Ok(plan)
    }
}

fn destroy(p: &Plan) {
    // SAFETY: each layout was created by `plan` and is destroyed once (its plan goes with it).
    unsafe {
        for l in [p.a, p.b, p.d] {
            lt::cublasLtMatrixLayoutDestroy(l);
        }
    }
}

impl Drop for Fp8Gemm {
    fn drop(&mut self) {
        for p in self.plans.get_mut().values() {
            destroy(p);
        }
        // SAFETY: created in `new` (null when creation failed before them) and destroyed once.
        unsafe {
            if !self.pref.is_null() {
                lt::cublasLtMatmulPreferenceDestroy(self.pref);
            }
            if !self.desc.is_null() {
                lt::cublasLtMatmulDescDestroy(self.desc);
            }
            if !self.handle.is_null() {
                lt::cublasLtDestroy(self.handle);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_devices_without_fp8_tensor_cores() {
        for arch in ["sm_80", "sm_86", "bogus"] {
            let e = Fp8Gemm::new(arch, 1, 64)
                .err()
                .expect("refused")
                .to_string();
            assert!(
                e.contains("sm_89") || e.contains("unknown architecture"),
                "{arch}: {e}"
            );
        }
    }
}
