//! The emulated device's GEMM: cuBLAS `gemmEx` semantics, column-major, on host memory.
//!
//! `C[m, n] = alpha · op(A) · op(B) + beta · C`, every matrix column-major with a leading
//! dimension: element (i, j) of a matrix with leading dimension `ld` is at `i + j * ld`.
//! `op(A)` is `[m, k]`: A itself (`[m, k]`, `lda >= m`) or, transposed, Aᵀ of a stored
//! `[k, m]` (`lda >= k`); likewise `op(B)` is `[k, n]`. As in cuBLAS, C is not read when
//! beta is 0 (it may hold garbage). Inputs are bf16 or f32, widened exactly to f32; sums
//! are f32.
//!
//! The "TN" form the model uses runs on the CPU backend's GEMM (a row-major reading of the
//! same call); every other form runs the defining triple loop.
//!
//! A GPU's cuBLAS picks its algorithm by shape, so the same row can round differently in a
//! call with another number of rows; this GEMM computes each row alone, the same bits in any
//! call. `NINFER_EMU_GEMM_ORDER=by-rows` imitates the GPU: the TN form sums the inner
//! dimension in two parts split at a point that depends on the call's row count
//! ([`split_for`]), so the checks that compare packed and one-window passes can be shown to
//! hold their GPU bound when bits differ.

use crate::backend::cuda::device::{ColGemm, GemmInput};
use anyhow::{bail, Result};

/// Elements an operand spans: `cols - 1` full leading dimensions plus `rows`.
pub fn extent(rows: usize, cols: usize, ld: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (cols - 1) * ld + rows
    }
}

/// (stored rows, stored cols) of A, B and C.
pub fn shapes(g: &ColGemm) -> [(usize, usize); 3] {
    let a = if g.trans_a { (g.k, g.m) } else { (g.m, g.k) };
    let b = if g.trans_b { (g.n, g.k) } else { (g.k, g.n) };
    [a, b, (g.m, g.n)]
}

/// Checks the leading dimensions; returns the element extents of A, B and C.
pub fn check(g: &ColGemm) -> Result<[usize; 3]> {
    let [a, b, c] = shapes(g);
    for (name, (rows, _), ld) in [("lda", a, g.lda), ("ldb", b, g.ldb), ("ldc", c, g.ldc)] {
        if ld < rows.max(1) {
            bail!("GEMM {name} {ld} is below the {rows} rows of its matrix (cuBLAS rejects it)");
        }
    }
    Ok([
        extent(a.0, a.1, g.lda),
        extent(b.0, b.1, g.ldb),
        extent(c.0, c.1, g.ldc),
    ])
}

fn widen(input: GemmInput, bytes: &[u8]) -> Vec<f32> {
    match input {
        GemmInput::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        GemmInput::Bf16 => bytes
            .chunks_exact(2)
            .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
            .collect(),
    }
}

/// Whether `NINFER_EMU_GEMM_ORDER=by-rows` is set (read once).
fn order_by_rows() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("NINFER_EMU_GEMM_ORDER").is_ok_and(|v| v == "by-rows"))
}

/// Where a TN product of `rows` rows splits its inner dimension `k` in `by-rows` order: a
/// quarter, a half or three quarters of the way, by `rows % 3`.
pub fn split_for(rows: usize, k: usize) -> usize {
    k * (1 + rows % 3) / 4
}

/// Runs the call. `a` and `b` hold exactly their extents in the input type, `c` its
/// extent in f32.
pub fn run(g: &ColGemm, a: &[u8], b: &[u8], c: &mut [f32]) -> Result<()> {
    let [ea, eb, ec] = check(g)?;
    let esz = match g.input {
        GemmInput::Bf16 => 2,
        GemmInput::F32 => 4,
    };
    if a.len() != ea * esz || b.len() != eb * esz || c.len() != ec {
        bail!("GEMM operands do not match their extents");
    }
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    let (a, b) = (widen(g.input, a), widen(g.input, b));
    let mut prod = vec![0f32; g.m * g.n]; // column-major, ld = m
    if g.trans_a && !g.trans_b {
        // C[i, j] = Σ_l A[l + i·lda] · B[l + j·ldb]: row-major, rows j of B times rows i
        // of A, i.e. out[n, m] = Bᵀrows[n, k] · Arows[m, k]ᵀ.
        // Contiguous rows are used in place; padded ones are gathered.
        let rows = |v: Vec<f32>, n: usize, ld: usize| -> Vec<f32> {
            if ld == g.k {
                return v;
            }
            let mut out = Vec::with_capacity(n * g.k);
            for r in 0..n {
                out.extend_from_slice(&v[r * ld..r * ld + g.k]);
            }
            out
        };
        let (x, w) = (rows(b, g.n, g.ldb), rows(a, g.m, g.lda));
        let split = if order_by_rows() {
            split_for(g.n, g.k)
        } else {
            0
        };
        if split > 0 {
            // Two partial products over [0, split) and [split, k), added.
            let part = |v: &[f32], n: usize, r: std::ops::Range<usize>| -> Vec<f32> {
                (0..n)
                    .flat_map(|i| v[i * g.k + r.start..i * g.k + r.end].to_vec())
                    .collect()
            };
            let (lo, hi) = (0..split, split..g.k);
            let mut second = vec![0f32; g.m * g.n];
            let (x0, w0) = (part(&x, g.n, lo.clone()), part(&w, g.m, lo));
            let (x1, w1) = (part(&x, g.n, hi.clone()), part(&w, g.m, hi));
            crate::backend::cpu::matmul::matmul_wt(&x0, g.n, split, &w0, g.m, &mut prod, false);
            crate::backend::cpu::matmul::matmul_wt(
                &x1,
                g.n,
                g.k - split,
                &w1,
                g.m,
                &mut second,
                false,
            );
            for (p, s) in prod.iter_mut().zip(&second) {
                *p += s;
            }
        } else if g.k > 0 {
            crate::backend::cpu::matmul::matmul_wt(&x, g.n, g.k, &w, g.m, &mut prod, false);
        }
    } else {
        let at = |i: usize, l: usize| {
            if g.trans_a {
                a[l + i * g.lda]
            } else {
                a[i + l * g.lda]
            }
        };
        let bt = |l: usize, j: usize| {
            if g.trans_b {
                b[j + l * g.ldb]
            } else {
                b[l + j * g.ldb]
            }
        };
        for j in 0..g.n {
            for i in 0..g.m {
                let mut s = 0f32;
                for l in 0..g.k {
                    s += at(i, l) * bt(l, j);
                }
                prod[i + j * g.m] = s;
            }
        }
    }
    for j in 0..g.n {
        for i in 0..g.m {
            let p = g.alpha * prod[i + j * g.m];
            let out = &mut c[i + j * g.ldc];
            *out = if g.beta == 0.0 { p } else { p + g.beta * *out };
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(clippy::too_many_arguments)] // one cuBLAS call's parameters
    fn call(
        trans_a: bool,
        trans_b: bool,
        m: usize,
        n: usize,
        k: usize,
        lda: usize,
        ldb: usize,
        ldc: usize,
    ) -> ColGemm {
        ColGemm {
            trans_a,
            trans_b,
            m,
            n,
            k,
            alpha: 1.0,
            a: 0,
            lda,
            b: 0,
            ldb,
            beta: 0.0,
            c: 0,
            ldc,
            input: GemmInput::F32,
        }
    }

    fn bytes(v: &[f32]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    /// Hand-checked: A = [[1, 2, 3], [4, 5, 6]] (2 x 3), B = [[1, 0], [0, 1], [1, 1]] (3 x 2),
    /// A·B = [[4, 5], [10, 11]], in each storage the four forms use.
    #[test]
    fn the_four_forms_follow_column_major_semantics() {
        let want = [4.0, 10.0, 5.0, 11.0]; // column-major [2, 2]
                                           // A stored as [2, 3] column-major (lda 2), or Aᵀ stored [3, 2] (lda 3).
        let a_n = [1.0, 4.0, 2.0, 5.0, 3.0, 6.0];
        let a_t = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        // B stored [3, 2] (ldb 3), or Bᵀ stored [2, 3] (ldb 2).
        let b_n = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0];
        let b_t = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let (a, lda): (&[f32], usize) = if ta { (&a_t, 3) } else { (&a_n, 2) };
            let (b, ldb): (&[f32], usize) = if tb { (&b_t, 2) } else { (&b_n, 3) };
            let g = call(ta, tb, 2, 2, 3, lda, ldb, 2);
            let mut c = vec![f32::NAN; 4]; // beta 0: never read
            run(&g, &bytes(a), &bytes(b), &mut c).unwrap();
            assert_eq!(c, want, "trans_a {ta} trans_b {tb}");
        }
    }

    /// Leading dimensions larger than the rows skip the padding; beta 1 accumulates; alpha
    /// scales; bf16 inputs are widened exactly.
    #[test]
    fn leading_dimensions_beta_alpha_and_bf16() {
        // A = Aᵀ stored [k=2, m=2] with lda 3 (row 2 is padding, NaN), B [k=2, n=1] ldb 4.
        let a = [1.0, 2.0, f32::NAN, 3.0, 4.0, f32::NAN];
        let b = [10.0, 100.0, f32::NAN, f32::NAN];
        let mut g = call(true, false, 2, 1, 2, 3, 4, 3);
        g.beta = 1.0;
        g.alpha = 2.0;
        let mut c = vec![1.0, 2.0, -7.0]; // ldc 3: the third is padding, untouched
        run(&g, &bytes(&a[..5]), &bytes(&b[..2]), &mut c[..2]).unwrap();
        // C = 2 · [1·10 + 2·100, 3·10 + 4·100] + [1, 2]
        assert_eq!(c, [421.0, 862.0, -7.0]);
        let mut g = call(false, false, 1, 1, 2, 1, 2, 1);
        g.input = GemmInput::Bf16;
        let h = |v: f32| half::bf16::from_f32(v).to_bits();
        let a: Vec<u8> = bytemuck::cast_slice(&[h(1.5), h(-2.0)]).to_vec();
        let b: Vec<u8> = bytemuck::cast_slice(&[h(4.0), h(0.25)]).to_vec();
        let mut c = [0.0f32];
        run(&g, &a, &b, &mut c).unwrap();
        assert_eq!(c, [5.5]);
    }

    #[test]
    fn a_leading_dimension_below_the_rows_is_refused() {
        let g = call(false, false, 3, 1, 1, 2, 1, 3);
        let e = check(&g).unwrap_err().to_string();
        assert!(e.contains("lda 2 is below the 3 rows"), "{e}");
        assert_eq!(extent(3, 2, 5), 8);
        assert_eq!(extent(0, 2, 5), 0);
    }

    /// The fast "TN" path equals the defining loop (integers: exact in any order).
    #[test]
    fn the_tn_fast_path_equals_the_loop() {
        let (m, n, k) = (5, 3, 7);
        let (lda, ldb, ldc) = (k + 2, k + 1, m + 3);
        let a: Vec<f32> = (0..extent(k, m, lda))
            .map(|i| ((i * 7) % 11) as f32 - 5.0)
            .collect();
        let b: Vec<f32> = (0..extent(k, n, ldb))
            .map(|i| ((i * 5) % 13) as f32 - 6.0)
            .collect();
        let g = call(true, false, m, n, k, lda, ldb, ldc);
        let mut fast = vec![0f32; extent(m, n, ldc)];
        run(&g, &bytes(&a), &bytes(&b), &mut fast).unwrap();
        for j in 0..n {
            for i in 0..m {
                let s: f32 = (0..k).map(|l| a[l + i * lda] * b[l + j * ldb]).sum();
                assert_eq!(fast[i + j * ldc], s, "({i}, {j})");
            }
        }
    }
}
