//! The model's matrix products, `Y[m, n] (+)= X[m, k] · W[n, k]ᵀ` with row-major operands
//! and W in the Hugging Face `[out, in]` layout, expressed as cuBLAS calls. CPU twin:
//! src/backend/cpu/matmul.rs.
//!
//! Row-major Y is column-major Yᵀ, so each product is the column-major
//! `Yᵀ[n, m] = op(W)[n, k] · Xᵀ[k, m]` with W transposed (the "TN" form cuBLAS runs
//! fastest). bf16 precision: bf16 W and X, f32 Y and f32 accumulation
//! (CUBLAS_COMPUTE_32F). f32 precision: all f32, CUBLAS_COMPUTE_32F_PEDANTIC, which rules
//! out TF32 and emulated f32 explicitly (`real::compute_type`). The device runs the call:
//! cuBLAS on a GPU, the reference GEMM on the emulated device.
//!
//! cuBLAS indexes with 32-bit integers, and some of its algorithms fail once one operand
//! spans more than 2^31 elements: the 27B hybrid's gate/up output at 16 windows of 4096 rows
//! is 65,536 × 34,816 = 2.28e9. So a product whose rows of `x` or `y` would span more than
//! [`MAX_OPERAND_ELEMS`] is run as several calls over blocks of rows ([`row_blocks`]); each
//! row's result is the same product.

use super::device::{ColGemm, DevBuf, GemmInput, Gpu};
use super::plan::Precision;
use anyhow::{bail, Result};
use std::ops::Range;

/// The most elements one operand of one cuBLAS call spans (2^31 − 1).
pub const MAX_OPERAND_ELEMS: usize = i32::MAX as usize;

/// Blocks of the `m` rows of a product whose rows of `x` (stride `ld_x`) and `y` (stride
/// `ld_y`) each span at most `limit` elements per block: one block when the whole product
/// fits, else as few equal blocks as fit (the last shorter).
pub fn row_blocks(
    m: usize,
    ld_x: usize,
    ld_y: usize,
    limit: usize,
) -> Result<impl Iterator<Item = Range<usize>>> {
    let widest = ld_x.max(ld_y).max(1);
    let rows = limit / widest;
    if rows == 0 {
        bail!("GEMM rows of {widest} elements exceed one call's {limit}");
    }
    Ok((0..m).step_by(rows).map(move |r| r..(r + rows).min(m)))
}

/// The products of one precision on one device.
pub struct Blas {
    precision: Precision,
    /// The most elements one call's x or y may span ([`MAX_OPERAND_ELEMS`]; smaller in tests).
    /// The weight is never split: one past [`MAX_OPERAND_ELEMS`] is refused.
    operand_limit: usize,
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
        Ok(Blas {
            precision,
            operand_limit: MAX_OPERAND_ELEMS,
        })
    }

    /// The same products with calls split at `limit` elements per operand (tests show with
    /// a small limit that splitting changes no row).
    pub fn with_operand_limit(mut self, limit: usize) -> Blas {
        self.operand_limit = limit.min(MAX_OPERAND_ELEMS);
        self
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
        if n.saturating_mul(w.ld) > MAX_OPERAND_ELEMS {
            bail!(
                "GEMM weight of {n} x {} elements exceeds one call's {MAX_OPERAND_ELEMS}",
                w.ld
            );
        }
        let input = match self.precision {
            Precision::Bf16 => GemmInput::Bf16,
            Precision::F32 => GemmInput::F32,
        };
        let x_elem = self.precision.elem_bytes() as u64;
        for rows in row_blocks(m, x.ld, y.ld, self.operand_limit)? {
            let r0 = rows.start as u64;
            let xb = Mat {
                ptr: x.ptr + r0 * (x.ld as u64) * x_elem,
                ld: x.ld,
            };
            let yb = Mat {
                ptr: y.ptr + r0 * (y.ld as u64) * 4,
                ld: y.ld,
            };
            gpu.gemm(&row_major_wt(
                rows.len(),
                n,
                k,
                xb,
                w,
                yb,
                accumulate,
                input,
            ))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::presets::preset;

    /// Blocks cover every row once, in order, and each spans at most the limit.
    fn check(m: usize, ld_x: usize, ld_y: usize, limit: usize) -> usize {
        let b: Vec<_> = row_blocks(m, ld_x, ld_y, limit).unwrap().collect();
        assert_eq!(b.first().unwrap().start, 0);
        assert_eq!(b.last().unwrap().end, m);
        for w in b.windows(2) {
            assert_eq!(w[0].end, w[1].start);
        }
        for r in &b {
            assert!(r.len() * ld_x.max(ld_y) <= limit, "{r:?}");
        }
        b.len()
    }

    /// The 27B hybrid's widest products at the production packing (16 windows of 4096 rows)
    /// and at the long-context profile (one window of 65,536): the gate/up output, 2.28e9
    /// elements, is split in two; the narrower products stay one call.
    #[test]
    fn the_27b_products_stay_under_2_pow_31_elements() {
        let c = preset("qwen3_5-27b").unwrap();
        let rows = 16 * 4096;
        assert_eq!(rows, 65_536, "the long-context profile has as many rows");
        let gate_up = 2 * c.intermediate_size;
        assert!(rows * gate_up > MAX_OPERAND_ELEMS);
        assert_eq!(check(rows, c.hidden_size, gate_up, MAX_OPERAND_ELEMS), 2);
        // down: x is the SwiGLU output (intermediate), y the residual stream.
        assert_eq!(
            check(rows, c.intermediate_size, c.hidden_size, MAX_OPERAND_ELEMS),
            1
        );
        assert_eq!(check(10, 7, 3, 20), 5);
        assert!(row_blocks(4, 30, 3, 20).is_err());
    }
}
