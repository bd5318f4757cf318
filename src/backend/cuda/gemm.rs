//! Matrix products through cuBLAS: `Y[m, n] (+)= X[m, k] · W[n, k]ᵀ` with row-major
//! operands, W in the Hugging Face `[out, in]` layout. CPU twin: src/backend/cpu/matmul.rs.
//!
//! Row-major Y is column-major Yᵀ, so each product is the column-major
//! `Yᵀ[n, m] = op(W)[n, k] · Xᵀ[k, m]` with W transposed (the "TN" form cuBLAS runs
//! fastest). bf16 precision: bf16 W and X, f32 Y and f32 accumulation
//! (CUBLAS_COMPUTE_32F). f32 precision: all f32, CUBLAS_COMPUTE_32F with the default math
//! mode, which never uses TF32.

use super::device::{DevBuf, Gpu, STREAM};
use super::plan::Precision;
use anyhow::{anyhow, bail, Result};
use cudarc::cublas::{result, sys};
use std::ffi::c_void;

pub struct Blas {
    handle: sys::cublasHandle_t,
    precision: Precision,
}

// SAFETY: the handle is used from one thread at a time (the model serializes its calls).
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}

/// One operand: a device address and its row stride (elements).
#[derive(Clone, Copy, Debug)]
pub struct Mat {
    pub ptr: u64,
    pub ld: usize,
}

impl Mat {
    pub fn of(b: &DevBuf, offset_bytes: usize, ld: usize) -> Mat {
        Mat {
            ptr: b.at(offset_bytes),
            ld,
        }
    }
}

impl Blas {
    pub fn new(gpu: &Gpu, precision: Precision) -> Result<Blas> {
        gpu.bind()?;
        let handle = result::create_handle().map_err(|e| anyhow!("cuBLAS handle: {e}"))?;
        // SAFETY: a fresh handle; the null stream is the legacy default stream.
        unsafe {
            result::set_stream(handle, STREAM as _).map_err(|e| anyhow!("cuBLAS stream: {e}"))?;
            sys::cublasSetMathMode(handle, sys::cublasMath_t::CUBLAS_DEFAULT_MATH)
                .result()
                .map_err(|e| anyhow!("cuBLAS math mode: {e}"))?;
        }
        Ok(Blas { handle, precision })
    }

    /// `y[m, n] = x[m, k] · w[n, k]ᵀ (+ y when accumulate)`. `x` and `w` hold GEMM input
    /// elements of the precision; `y` is f32.
    #[allow(clippy::too_many_arguments)] // the BLAS-shaped call: shape, three operands, mode
    pub fn gemm(
        &self,
        m: usize,
        n: usize,
        k: usize,
        x: Mat,
        w: Mat,
        y: Mat,
        accumulate: bool,
    ) -> Result<()> {
        if m == 0 || n == 0 {
            return Ok(());
        }
        if x.ld < k || w.ld < k || y.ld < n {
            bail!(
                "GEMM strides too small: m {m} n {n} k {k}, ld x {} w {} y {}",
                x.ld,
                w.ld,
                y.ld
            );
        }
        let int = |v: usize, what: &str| -> Result<i32> {
            i32::try_from(v).map_err(|_| anyhow!("GEMM {what} {v} exceeds cuBLAS's 32-bit sizes"))
        };
        let (mi, ni, ki) = (int(n, "n")?, int(m, "m")?, int(k, "k")?);
        let (lda, ldb, ldc) = (int(w.ld, "ld")?, int(x.ld, "ld")?, int(y.ld, "ld")?);
        let alpha = 1.0f32;
        let beta = if accumulate { 1.0f32 } else { 0.0f32 };
        let in_type = match self.precision {
            Precision::Bf16 => sys::cudaDataType::CUDA_R_16BF,
            Precision::F32 => sys::cudaDataType::CUDA_R_32F,
        };
        // SAFETY: device pointers and strides describe allocations of the model's buffers
        // (checked by the callers' size arithmetic); alpha/beta are host scalars.
        unsafe {
            result::gemm_ex(
                self.handle,
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                mi,
                ni,
                ki,
                &alpha as *const f32 as *const c_void,
                w.ptr as *const c_void,
                in_type,
                lda,
                x.ptr as *const c_void,
                in_type,
                ldb,
                &beta as *const f32 as *const c_void,
                y.ptr as *mut c_void,
                sys::cudaDataType::CUDA_R_32F,
                ldc,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| anyhow!("cuBLAS GEMM m {m} n {n} k {k}: {e}"))
    }
}
