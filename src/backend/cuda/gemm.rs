//! The model's matrix products, `Y[m, n] (+)= X[m, k] · W[n, k]ᵀ` with row-major operands
//! and W in the Hugging Face `[out, in]` layout, expressed as cuBLAS calls. CPU twin:
//! src/backend/cpu/matmul.rs.
//!
//! Row-major Y is column-major Yᵀ, so each product is the column-major
//! `Yᵀ[n, m] = op(W)[n, k] · Xᵀ[k, m]` with W transposed (the "TN" form cuBLAS runs
//! fastest). bf16 precision: bf16 W and X, f32 Y and f32 accumulation
//! (CUBLAS_COMPUTE_32F). f32 precision: all f32, CUBLAS_COMPUTE_32F with the default math
//! mode, which never uses TF32. The device runs the call: cuBLAS on a GPU, the reference
//! GEMM on the emulated device.

use super::device::{ColGemm, DevBuf, GemmInput, Gpu};
use super::plan::Precision;
use anyhow::{bail, Result};

/// The products of one precision on one device.
pub struct Blas {
    precision: Precision,
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

/// The column-major call for `y[m, n] = x[m, k] · w[n, k]ᵀ (+ y when accumulate)`.
#[allow(clippy::too_many_arguments)] // the BLAS-shaped call: shape, three operands, mode, type
pub fn row_major_wt(
    m: usize,
    n: usize,
    k: usize,
    x: Mat,
    w: Mat,
    y: Mat,
    accumulate: bool,
    input: GemmInput,
) -> ColGemm {
    ColGemm {
        trans_a: true,
        trans_b: false,
        m: n,
        n: m,
        k,
        alpha: 1.0,
        a: w.ptr,
        lda: w.ld,
        b: x.ptr,
        ldb: x.ld,
        beta: if accumulate { 1.0 } else { 0.0 },
        c: y.ptr,
        ldc: y.ld,
        input,
    }
}

impl Blas {
    pub fn new(_gpu: &Gpu, precision: Precision) -> Result<Blas> {
        Ok(Blas { precision })
    }

    /// `y[m, n] = x[m, k] · w[n, k]ᵀ (+ y when accumulate)`. `x` and `w` hold GEMM input
    /// elements of the precision; `y` is f32.
    #[allow(clippy::too_many_arguments)] // the BLAS-shaped call: device, shape, three operands, mode
    pub fn gemm(
        &self,
        gpu: &Gpu,
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
        let input = match self.precision {
            Precision::Bf16 => GemmInput::Bf16,
            Precision::F32 => GemmInput::F32,
        };
        gpu.gemm(&row_major_wt(m, n, k, x, w, y, accumulate, input))
    }
}
