//! `y = x · Wᵀ` with `W` stored row-major as `[n, k]` (the Hugging Face layout).
//!
//! Rows of `x` are split across rayon threads; each chunk is one single-threaded sgemm.
//! The packed GEMM never splits the reduction dimension and every output element is
//! accumulated by the same kernel in the same k order whatever the chunk boundaries, so the
//! result does not depend on the thread count.

use rayon::prelude::*;

/// Rows per parallel task; small enough to balance 2-16 threads, large enough for packing
/// to pay off.
const ROW_CHUNK: usize = 32;

/// `out[m, n] = beta * out + x[m, k] · w[n, k]ᵀ`.
pub fn matmul_wt(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, out: &mut [f32], accumulate: bool) {
    assert_eq!(x.len(), m * k, "x shape");
    assert_eq!(w.len(), n * k, "w shape");
    assert_eq!(out.len(), m * n, "out shape");
    if m == 0 || n == 0 {
        return;
    }
    let beta = if accumulate { 1.0 } else { 0.0 };
    out.par_chunks_mut(ROW_CHUNK * n)
        .zip(x.par_chunks(ROW_CHUNK * k))
        .for_each(|(o, xa)| {
            let rows = xa.len() / k;
            // SAFETY: the slices hold exactly rows*k, n*k and rows*n elements (asserted
            // above and by the chunking), and the strides describe dense row-major `xa`,
            // the transpose view of row-major `w`, and dense row-major `o`.
            unsafe {
                matrixmultiply::sgemm(
                    rows,
                    k,
                    n,
                    1.0,
                    xa.as_ptr(),
                    k as isize,
                    1,
                    w.as_ptr(),
                    1,
                    k as isize,
                    beta,
                    o.as_mut_ptr(),
                    n as isize,
                    1,
                );
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_naive_product() {
        let (m, k, n) = (70, 19, 13);
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 101) as f32 / 50.0 - 1.0).collect();
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 104729) % 89) as f32 / 40.0 - 1.0).collect();
        let mut out = vec![0.5f32; m * n];
        matmul_wt(&x, m, k, &w, n, &mut out, true);
        for i in 0..m {
            for j in 0..n {
                let want: f64 = 0.5 + (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum::<f64>();
                assert!((out[i * n + j] as f64 - want).abs() < 1e-4);
            }
        }
    }
}
