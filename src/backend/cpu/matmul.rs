//! `y = x · Wᵀ` with `W` stored row-major as `[n, k]` (the Hugging Face layout).
//!
//! The output columns are split into contiguous blocks, one per rayon task, and each block
//! is one single-threaded packed sgemm, so every weight is packed once per call. The GEMM
//! never splits the reduction dimension and every output element is accumulated by the
//! same kernel in the same k order wherever the block boundaries fall, so the result does
//! not depend on the thread count (checked by a test).
//!
//! The bits do depend on `matrixmultiply`'s depth blocking: each output is one fused
//! multiply-add chain per block of `KC` depth, the blocks added in order. The repository
//! pins `KC = 768` at compile time (`.cargo/config.toml`, the crate's `constconf` feature),
//! which keeps SmolLM2's depth-576 products in one pass; a test fails if a build loses it.

use super::SendPtr;
use rayon::prelude::*;

/// Column blocks are multiples of this (the microkernel's widest panel).
const COL_ALIGN: usize = 16;
/// Don't split below this many columns per task.
const MIN_COLS: usize = 64;

/// `out[m, n] = (accumulate ? out : 0) + x[m, k] · w[n, k]ᵀ`.
pub fn matmul_wt(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[f32],
    n: usize,
    out: &mut [f32],
    accumulate: bool,
) {
    assert_eq!(x.len(), m * k, "x shape");
    assert_eq!(w.len(), n * k, "w shape");
    assert_eq!(out.len(), m * n, "out shape");
    if m == 0 || n == 0 {
        return;
    }
    let beta = if accumulate { 1.0 } else { 0.0 };
    let threads = rayon::current_num_threads().max(1);
    let per = (n.div_ceil(threads)).div_ceil(COL_ALIGN) * COL_ALIGN;
    let per = per.max(MIN_COLS).min(n);
    let blocks: Vec<(usize, usize)> = (0..n)
        .step_by(per)
        .map(|j0| (j0, (j0 + per).min(n)))
        .collect();
    let o = SendPtr(out.as_mut_ptr());
    blocks.par_iter().for_each(|&(j0, j1)| {
        // SAFETY: `x` is dense [m, k]; rows j0..j1 of `w` are read as a [k, j1-j0] transpose
        // view; the output view starts at column j0 with row stride n and covers columns
        // j0..j1 only, which no other task touches. All indices are in bounds by the asserts.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                j1 - j0,
                1.0,
                x.as_ptr(),
                k as isize,
                1,
                w.as_ptr().add(j0 * k),
                1,
                k as isize,
                beta,
                o.get().add(j0),
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
        let (m, k, n) = (70, 19, 213);
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 104729) % 89) as f32 / 40.0 - 1.0)
            .collect();
        let mut out = vec![0.5f32; m * n];
        matmul_wt(&x, m, k, &w, n, &mut out, true);
        for i in 0..m {
            for j in 0..n {
                let want: f64 = 0.5
                    + (0..k)
                        .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                        .sum::<f64>();
                assert!((out[i * n + j] as f64 - want).abs() < 1e-4);
            }
        }
    }

    /// `matrixmultiply`'s depth blocking as pinned in `.cargo/config.toml`.
    const PINNED_KC: usize = 768;

    #[test]
    fn depth_blocking_is_the_pinned_one() {
        // With beta = 0 every output is, per depth block of KC, one in-order FMA chain
        // from zero, and the blocks' chains are added in order. Rebuild that by hand for a
        // depth of two blocks (shapes that are multiples of the 8 x 8 kernel, so no edge
        // path); a build with another KC cuts the sums elsewhere and changes the bits.
        let (m, n, k) = (16, 24, 2 * PINNED_KC);
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919) % 1013) as f32 / 500.0 - 1.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 104729) % 997) as f32 / 400.0 - 1.0)
            .collect();
        let mut out = vec![0.0f32; m * n];
        matmul_wt(&x, m, k, &w, n, &mut out, false);
        let chain = |i: usize, j: usize, ks: std::ops::Range<usize>| {
            ks.fold(0.0f32, |acc, t| x[i * k + t].mul_add(w[j * k + t], acc))
        };
        let mut differ = 0;
        for i in 0..m {
            for j in 0..n {
                let want = chain(i, j, 0..PINNED_KC) + chain(i, j, PINNED_KC..k);
                differ += (out[i * n + j].to_bits() != want.to_bits()) as usize;
            }
        }
        assert_eq!(
            differ,
            0,
            "matrixmultiply was not built with MATMUL_SGEMM_KC={PINNED_KC} (see .cargo/config.toml) \
             or its kernel has no FMA: the CPU path's bits would not match the baselines"
        );
    }

    #[test]
    fn thread_count_does_not_change_bits() {
        let (m, k, n) = (37, 301, 1000);
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919) % 1013) as f32 / 500.0 - 1.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 104729) % 997) as f32 / 400.0 - 1.0)
            .collect();
        let run = |t: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .unwrap();
            let mut out = vec![0.0f32; m * n];
            pool.install(|| matmul_wt(&x, m, k, &w, n, &mut out, false));
            out
        };
        let one = run(1);
        for t in [2, 3, 5, 8] {
            assert!(
                one.iter()
                    .zip(run(t))
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{t} threads"
            );
        }
    }
}
