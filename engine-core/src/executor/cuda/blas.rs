//! The GEMM `y[rows, n] = x[rows, k] · w[n, k]ᵀ` (bf16 or f32 operands, fp32 accumulation)
//! and how it is run: cuBLAS, except single-row bf16 products of small matrices, which go to
//! our `gemv_bf16`. The handle disallows reduced-precision split-K reductions (cuBLAS may
//! otherwise reduce bf16 split-K partials in bf16); f32 GEMMs never use TF32 (the default
//! math mode), so the f32 model is exact fp32.
//!
//! Measured on the H200 (`harrier-cuda-tool check-gemv`, docs/benchmarks.md, 1B shapes):
//! at one row our GEMV takes 6.4 / 6.0 us for q|k|v (3072 x 2048) and o (2048 x 2048) where
//! cuBLAS takes 8.8 / 9.1 us (both latency-bound, far from the 3 / 2 us of streaming the
//! weights), but cuBLAS streams the large matrices faster (gate|up 19.0 vs 23.5 us, down 12.6
//! vs 16.9, lm_head 122 vs 150), and from two rows on cuBLAS wins everywhere (our GEMV re-reads
//! x per row). Hence the rule: one row and at most `GEMV_MAX_ELEMS` weights. Both accumulate
//! in fp32 and round once; they differ only in summation order.

use std::ffi::c_void;

use anyhow::anyhow;
use harrier_kernels::cudarc::cublas::sys as cb;
use harrier_kernels::cudarc::driver::sys;
use harrier_kernels::{Dtype, Kernels};

use super::DevBuf;

const WORKSPACE_BYTES: usize = 32 << 20;

/// Largest weight matrix (elements) a single-row product sends to `gemv_bf16` (see above).
const GEMV_MAX_ELEMS: usize = 8 << 20;

/// A cuBLAS handle bound to one stream with a fixed workspace (needed for graph capture).
pub struct Blas {
    handle: cb::cublasHandle_t,
    _workspace: DevBuf,
    /// Use `gemv_bf16` where the rule above says so (tools turn it off to compare; always
    /// off for f32).
    pub use_gemv: bool,
    /// Operand type of every GEMM (x, w, and y unless f32 out).
    dtype: Dtype,
}

fn blas_ck(s: cb::cublasStatus_t, what: &str) -> anyhow::Result<()> {
    if s == cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(anyhow!("cuBLAS error in {what}: {s:?}"))
    }
}

impl Blas {
    /// A handle enqueuing on `stream` (the context must be current), for `dtype` operands.
    pub fn new(stream: sys::CUstream, dtype: Dtype) -> anyhow::Result<Blas> {
        let workspace = DevBuf::new(WORKSPACE_BYTES)?;
        let mut handle: cb::cublasHandle_t = std::ptr::null_mut();
        // SAFETY: plain cuBLAS set-up calls on a fresh handle with our stream and workspace.
        unsafe {
            blas_ck(cb::cublasCreate_v2(&mut handle), "cublasCreate")?;
            let b = Blas {
                handle,
                _workspace: workspace,
                use_gemv: dtype == Dtype::Bf16,
                dtype,
            };
            blas_ck(
                cb::cublasSetStream_v2(handle, stream as cb::cudaStream_t),
                "cublasSetStream",
            )?;
            blas_ck(
                cb::cublasSetWorkspace_v2(handle, b._workspace.ptr as *mut c_void, WORKSPACE_BYTES),
                "cublasSetWorkspace",
            )?;
            blas_ck(
                cb::cublasSetMathMode(
                    handle,
                    cb::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION,
                ),
                "cublasSetMathMode",
            )?;
            Ok(b)
        }
    }

    /// `y[rows, n] = x[rows, k] · w[n, k]ᵀ` on `stream` (the handle's): the operand type or
    /// f32 out.
    ///
    /// # Safety
    /// x, w, y must hold rows*k, n*k and rows*n elements, rows 16-byte aligned.
    #[allow(clippy::too_many_arguments)] // a GEMM's shape and operands
    pub unsafe fn gemm(
        &self,
        kernels: &Kernels,
        stream: sys::CUstream,
        (x, w, y): (u64, u64, u64),
        rows: usize,
        n: usize,
        k: usize,
        f32_out: bool,
    ) -> anyhow::Result<()> {
        if rows == 0 {
            return Ok(());
        }
        if self.use_gemv
            && self.dtype == Dtype::Bf16
            && rows == 1
            && n * k <= GEMV_MAX_ELEMS
            && k.is_multiple_of(8)
        {
            // SAFETY: forwarded.
            return unsafe { kernels.gemv_bf16(stream, x, w, y, rows, n, k, f32_out) };
        }
        // SAFETY: forwarded.
        unsafe { self.cublas(x, w, y, rows, n, k, f32_out) }
    }

    /// The cuBLAS path alone (column-major view: yᵀ[n, rows] = w[k, n]ᵀ · xᵀ[k, rows]).
    ///
    /// # Safety
    /// As [`Blas::gemm`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn cublas(
        &self,
        x: u64,
        w: u64,
        y: u64,
        rows: usize,
        n: usize,
        k: usize,
        f32_out: bool,
    ) -> anyhow::Result<()> {
        // SAFETY: the caller's contract, with y's rows n apart.
        unsafe { self.cublas_ld((x, w, y), rows, (n, k), f32_out, n) }
    }

    /// As [`Blas::cublas`] with y's rows `ldc` elements apart (`ldc >= n`): a slice of the
    /// output features written into its columns of a wider output.
    ///
    /// # Safety
    /// `x` holds `rows x k`, `w` `n x k` and `y` `rows x ldc` elements (f32 for `f32_out`).
    pub unsafe fn cublas_ld(
        &self,
        (x, w, y): (u64, u64, u64),
        rows: usize,
        (n, k): (usize, usize),
        f32_out: bool,
        ldc: usize,
    ) -> anyhow::Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let otype = match self.dtype {
            Dtype::Bf16 => cb::cudaDataType::CUDA_R_16BF,
            Dtype::F32 => cb::cudaDataType::CUDA_R_32F,
        };
        let ctype = if f32_out {
            cb::cudaDataType::CUDA_R_32F
        } else {
            otype
        };
        // SAFETY: caller's contract on the operands; scalars live across the call.
        unsafe {
            blas_ck(
                cb::cublasGemmEx(
                    self.handle,
                    cb::cublasOperation_t::CUBLAS_OP_T,
                    cb::cublasOperation_t::CUBLAS_OP_N,
                    n as i32,
                    rows as i32,
                    k as i32,
                    &alpha as *const f32 as *const c_void,
                    w as *const c_void,
                    otype,
                    k as i32,
                    x as *const c_void,
                    otype,
                    k as i32,
                    &beta as *const f32 as *const c_void,
                    y as *mut c_void,
                    ctype,
                    ldc as i32,
                    cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cb::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
                ),
                "cublasGemmEx",
            )
        }
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        unsafe {
            let _ = cb::cublasDestroy_v2(self.handle);
        }
    }
}
