//! The crate's own single-threaded sgemm, `C (+)= X · Wᵀ`: its numerics define the CPU
//! path's bits, whatever the build.
//!
//! Numerics (checked bit for bit by the tests against the definition written out): the depth
//! is cut into blocks of [`KC`] starting at zero; per block every output gets one in-order
//! chain of fused multiply-adds starting from zero; the first block's chain is stored (or
//! added to the old output when accumulating) and every later block's chain is added to the
//! output. These are also `matrixmultiply`'s bits when that crate is built with `KC = 768`,
//! so [`super::matmul`] may run either one where a probe shows they agree.
//!
//! Why a second GEMM beside `matrixmultiply`: on a shared virtual machine the faster one
//! changes with the host's load. In quiet phases this `6 × 16` broadcast tile (two vector
//! loads and six broadcasts per twelve FMAs, the shape MKL and OpenBLAS use on AVX2) beats
//! `matrixmultiply`'s `8 × 8` permute tile by about 10%; in busy phases it loses by as much
//! (docs/performance.md). Both give the same bits, so the caller picks per call by measured
//! speed without touching results.
//!
//! Layout: `x` is `[m, k]` row-major at row stride `k`; `w` is `[n, k]` row-major (one output
//! column per row, the Hugging Face layout), f32 in memory or stored rows widened while they
//! are packed ([`super::operand`]); `c` is `[m, n]` at row stride `ldc`. The weights are
//! packed per call, one column block at a time, into panels of [`NR`] columns (one 64-byte
//! line per depth step); the activations are read in place.

use super::isa::Isa;
use super::operand::WeightRows;
use std::cell::RefCell;

/// Output columns per panel (two AVX2 vectors).
pub const NR: usize = 16;
/// Rows per register tile (the AVX2 and portable tiles; the AVX-512 one has twice as many).
const MR: usize = 6;
/// The widest tile: rows × columns.
const MAX_TILE: usize = 12 * 2 * NR;
/// Rows per cache block: a block's activations for one depth slice stay in L2 while every
/// weight panel passes over them (a sweep of 24-288 found 48 best).
const MC: usize = 48;
/// Depth block: part of the definition of the CPU bits (`matrixmultiply` agrees only when
/// built with the same `KC`, see `.cargo/config.toml`).
pub const KC: usize = 768;
/// Columns per column block: the cache blocks of rows walk the packed weights of one column
/// block (1.7 MiB at depth 576) before the next, instead of all of them. Measured on the Zen 3
/// host (docs/performance.md): without it the widest shapes (gate/up, 3072 columns,
/// 7 MiB packed; a 2048-column head chunk) ran at 0.88-0.95 of `matrixmultiply`, with it at
/// 1.04 like the narrow ones. The order of the loops over outputs changes no bit.
const NC: usize = 768;
const _: () = assert!(NC.is_multiple_of(2 * NR));

/// One depth step of a panel: `NR` floats, one 64-byte cache line, aligned to it so that the
/// tile's two vector loads per step never straddle lines.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; NR]);
const _: () = assert!(std::mem::size_of::<Line>() == NR * std::mem::size_of::<f32>());

thread_local! {
    /// Per-thread packing buffer, grown on demand and reused (no allocation per call).
    static PACKED: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// Rows and panels per register tile on each instruction set: `6 × 16` (one panel) on AVX2
/// and portable code, `12 × 32` (two panels) on AVX-512.
fn tile_shape(isa: Isa) -> (usize, usize) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => (12, 2),
        _ => (MR, 1),
    }
}

/// `c[m, n] = (accumulate ? c : 0) + x[m, k] · w[n, k]ᵀ` (numerics: the module comment).
///
/// # Safety
/// `x` is readable for `m` rows of `k` floats at stride `k`; `w` holds `n` rows of `k`; `c` is
/// writable for `m` rows of `n` floats at stride `ldc ≥ n`, and nothing else accesses those
/// floats during the call. `tile` is a level this CPU runs (one of [`Isa::all`];
/// [`Isa::detect`] is the fastest).
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm_wt(
    tile: Isa,
    m: usize,
    k: usize,
    n: usize,
    x: *const f32,
    w: WeightRows,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    assert!(
        w.n() == n && w.k() == k,
        "weights [{}, {}] for [{n}, {k}]",
        w.n(),
        w.k()
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                std::ptr::write_bytes(c.add(i * ldc), 0, n);
            }
        }
        return;
    }
    PACKED.with(|buf| {
        let mut buf = buf.borrow_mut();
        blocks(tile, m, k, n, x, w, &mut buf, c, ldc, accumulate);
    });
}

/// Packs panels `p0..p1` of `w` into `packed` (`(p1 - p0) · k` lines): line `(p - p0) · k + t`
/// holds `w[(p·NR + j) · k + t]` at `j`, zero past the last row. Stored rows are widened one
/// row at a time into `row`.
fn pack(w: &WeightRows, k: usize, p0: usize, p1: usize, packed: &mut [Line], row: &mut Vec<f32>) {
    let n = w.n();
    let f32_rows = w.as_f32();
    for p in p0..p1 {
        let panel = &mut packed[(p - p0) * k..(p - p0 + 1) * k];
        let cols = NR.min(n - p * NR);
        for j in 0..cols {
            let r = p * NR + j;
            let src: &[f32] = match f32_rows {
                Some(all) => &all[r * k..(r + 1) * k],
                None => {
                    row.resize(k, 0.0);
                    w.decode_row(r, row);
                    row
                }
            };
            for (line, &v) in panel.iter_mut().zip(src) {
                line.0[j] = v;
            }
        }
        for line in panel.iter_mut() {
            line.0[cols..].fill(0.0);
        }
    }
}

/// The cache blocking, packing one column block of weights at a time (at most `NC` columns ×
/// `k` floats: the packing buffer never holds a whole matrix).
///
/// # Safety
/// As for [`sgemm_wt`].
#[allow(clippy::too_many_arguments)]
unsafe fn blocks(
    tile: Isa,
    m: usize,
    k: usize,
    n: usize,
    x: *const f32,
    w: WeightRows,
    buf: &mut Vec<Line>,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    let panels = n.div_ceil(NR);
    let (mr, pw) = tile_shape(tile);
    let mut edge = [0.0f32; MAX_TILE];
    let block_panels = (NC / NR).min(panels);
    if buf.len() < block_panels * k {
        buf.resize(block_panels * k, Line([0.0; NR]));
    }
    let mut row = Vec::new();
    for p0 in (0..panels).step_by(NC / NR) {
        let p1 = (p0 + NC / NR).min(panels);
        let packed = &mut buf[..(p1 - p0) * k];
        pack(&w, k, p0, p1, packed, &mut row);
        for i0 in (0..m).step_by(MC) {
            let i1 = (i0 + MC).min(m);
            for t0 in (0..k).step_by(KC) {
                let len = KC.min(k - t0);
                let store = t0 == 0 && !accumulate;
                for p in (p0..p1).step_by(pw) {
                    let np = pw.min(p1 - p);
                    let b = packed[(p - p0) * k + t0..].as_ptr().cast::<f32>();
                    let cols = (np * NR).min(n - p * NR);
                    for i in (i0..i1).step_by(mr) {
                        let rows = mr.min(i1 - i);
                        let a = x.add(i * k + t0);
                        let cp = c.add(i * ldc + p * NR);
                        if cols == np * NR {
                            run_tile(tile, rows, np, a, k, b, k * NR, len, cp, ldc, store);
                            continue;
                        }
                        // A narrow last panel: the full tile goes to a scratch tile (its
                        // padding columns met zero weights) and only the real columns are
                        // combined.
                        let w = np * NR;
                        let e = edge.as_mut_ptr();
                        run_tile(tile, rows, np, a, k, b, k * NR, len, e, w, true);
                        for r in 0..rows {
                            for j in 0..cols {
                                let o = cp.add(r * ldc + j);
                                let v = edge[r * w + j];
                                *o = if store { v } else { *o + v };
                            }
                        }
                    }
                }
            }
        }
    }
}

/// `chain[r, j]` = in-order FMA chain from zero over `t < len` of `a[r·lda + t] · b[t, j]`;
/// then `c[r, j] = chain` when `store`, else `c[r, j] + chain`; `rows` rows (at most the
/// tile's), `np · NR` columns from `np` panels (at most the tile's), panel `q`'s depth step
/// `t` at `b + q·bstride + t·NR`.
///
/// # Safety
/// `a` holds `rows` rows of `len` at stride `lda`; `b` holds `np` panels of `len · NR` floats
/// at stride `bstride`, 64-byte aligned; `c` is writable (and, unless `store`, readable) for
/// `rows` rows of `np · NR` at stride `ldc`.
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn run_tile(
    tile: Isa,
    rows: usize,
    np: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    bstride: usize,
    len: usize,
    c: *mut f32,
    ldc: usize,
    store: bool,
) {
    macro_rules! dispatch {
        ($m:ident, $p:literal, $($r:literal)+) => {
            match rows {
                $($r => $m::tile::<$r, $p>(a, lda, b, bstride, len, c, ldc, store),)+
                _ => unreachable!("{rows} rows for a {tile:?} tile"),
            }
        };
    }
    match (tile, np) {
        (Isa::Portable, _) => dispatch!(portable, 1, 1 2 3 4 5 6),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, _) => dispatch!(avx2, 1, 1 2 3 4 5 6),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, 2) => dispatch!(avx512, 2, 1 2 3 4 5 6 7 8 9 10 11 12),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, _) => dispatch!(avx512, 1, 1 2 3 4 5 6 7 8 9 10 11 12),
    }
}

/// The specification of the register tile.
mod portable {
    use super::NR;

    /// # Safety
    /// As for [`super::run_tile`], with `R` rows and `P` panels.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tile<const R: usize, const P: usize>(
        a: *const f32,
        lda: usize,
        b: *const f32,
        bstride: usize,
        len: usize,
        c: *mut f32,
        ldc: usize,
        store: bool,
    ) {
        for r in 0..R {
            for j in 0..P * NR {
                let bj = b.add((j / NR) * bstride + j % NR);
                let mut acc = 0.0f32;
                for t in 0..len {
                    acc = (*a.add(r * lda + t)).mul_add(*bj.add(t * NR), acc);
                }
                let o = c.add(r * ldc + j);
                *o = if store { acc } else { *o + acc };
            }
        }
    }
}

/// [`portable::tile`] eight lanes at a time (`R × 2` accumulators; twelve of the sixteen
/// vector registers at `R = 6`).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::NR;
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX2 and FMA present; otherwise as for [`super::run_tile`], with `R` rows and `P`
    /// panels.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tile<const R: usize, const P: usize>(
        a: *const f32,
        lda: usize,
        b: *const f32,
        bstride: usize,
        len: usize,
        c: *mut f32,
        ldc: usize,
        store: bool,
    ) {
        let mut acc = [[[_mm256_setzero_ps(); 2]; P]; R];
        for t in 0..len {
            let mut bv = [[_mm256_setzero_ps(); 2]; P];
            for (q, v) in bv.iter_mut().enumerate() {
                let bp = b.add(q * bstride + t * NR);
                *v = [_mm256_load_ps(bp), _mm256_load_ps(bp.add(8))];
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm256_broadcast_ss(&*a.add(r * lda + t));
                for (v, bq) in row.iter_mut().zip(&bv) {
                    v[0] = _mm256_fmadd_ps(av, bq[0], v[0]);
                    v[1] = _mm256_fmadd_ps(av, bq[1], v[1]);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (q, v) in row.iter().enumerate() {
                let o = c.add(r * ldc + q * NR);
                if store {
                    _mm256_storeu_ps(o, v[0]);
                    _mm256_storeu_ps(o.add(8), v[1]);
                } else {
                    _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), v[0]));
                    _mm256_storeu_ps(o.add(8), _mm256_add_ps(_mm256_loadu_ps(o.add(8)), v[1]));
                }
            }
        }
    }
}

/// The AVX-512 tile: `R` rows by `P` panels (`R × P` accumulators of sixteen lanes; 24 of
/// the 32 vector registers at `12 × 2`), two aligned loads and `R` broadcasts per `2R` FMAs.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::NR;
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX-512F present; otherwise as for [`super::run_tile`], with `R` rows and `P` panels.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tile<const R: usize, const P: usize>(
        a: *const f32,
        lda: usize,
        b: *const f32,
        bstride: usize,
        len: usize,
        c: *mut f32,
        ldc: usize,
        store: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        for t in 0..len {
            let mut bv = [_mm512_setzero_ps(); P];
            for (q, v) in bv.iter_mut().enumerate() {
                *v = _mm512_load_ps(b.add(q * bstride + t * NR));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*a.add(r * lda + t));
                for (v, &bq) in row.iter_mut().zip(&bv) {
                    *v = _mm512_fmadd_ps(av, bq, *v);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (q, &v) in row.iter().enumerate() {
                let o = c.add(r * ldc + q * NR);
                if store {
                    _mm512_storeu_ps(o, v);
                } else {
                    _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), v));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gen(len: usize, mul: usize, modulus: usize, div: f32) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * mul) % modulus) as f32 / div - 1.0)
            .collect()
    }

    /// The definition, written out: per depth block of `KC` one in-order FMA chain from
    /// zero; the first block's chain stored (or added to the old output), later ones added.
    fn reference(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, c: &mut [f32], acc: bool) {
        for i in 0..m {
            for j in 0..n {
                let mut out = c[i * n + j];
                for (b, k0) in (0..k).step_by(KC).enumerate() {
                    let chain = (k0..(k0 + KC).min(k))
                        .fold(0.0f32, |a, t| x[i * k + t].mul_add(w[j * k + t], a));
                    out = if b == 0 && !acc { chain } else { out + chain };
                }
                c[i * n + j] = if k == 0 && !acc { 0.0 } else { out };
            }
        }
    }

    /// The contract: the definition's bits for every tile, with and without accumulation,
    /// over shapes that cross every block edge (rows past a cache block and a
    /// partial register tile, depth over two `KC` blocks and a partial one, columns past an `NC`
    /// block, a narrow panel).
    #[test]
    fn every_tile_gives_the_definitions_bits() {
        let shapes = [
            (1, 1, 1),
            (5, 7, 3),
            (MC + MR + 1, 2 * KC + 37, 2 * NR + 5),
            (64, 576, 96),
            (13, KC, NR),
            (50, 1536, 40),
            (MC + 13, 300, 3 * NR),
            (25, 64, 4 * NR + 1),
            (MC + 5, 100, NC + 2 * NR + 3),
        ];
        for (m, k, n) in shapes {
            let x = gen(m * k, 7919, 1013, 500.0);
            let w = gen(n * k, 104729, 997, 400.0);
            let init = gen(m * n, 31, 17, 8.0);
            for accumulate in [false, true] {
                let mut want = init.clone();
                reference(&x, m, k, &w, n, &mut want, accumulate);
                for tile in Isa::all() {
                    let mut got = init.clone();
                    // SAFETY: dense buffers of the stated shapes.
                    unsafe {
                        sgemm_wt(
                            tile,
                            m,
                            k,
                            n,
                            x.as_ptr(),
                            WeightRows::f32(&w, k),
                            got.as_mut_ptr(),
                            n,
                            accumulate,
                        )
                    };
                    let differ = got
                        .iter()
                        .zip(&want)
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    assert_eq!(differ, 0, "{tile:?} {m}x{k}x{n} accumulate {accumulate}");
                }
            }
        }
    }

    /// The portable tile is the specification: one `mul_add` chain per depth block.
    #[test]
    fn portable_tile_is_one_chain_per_depth_block() {
        let (m, k, n) = (7, KC + 9, NR + 3);
        let x = gen(m * k, 7919, 1013, 500.0);
        let w = gen(n * k, 104729, 997, 400.0);
        let mut got = vec![0.0f32; m * n];
        // SAFETY: dense buffers of the stated shapes.
        unsafe {
            sgemm_wt(
                Isa::Portable,
                m,
                k,
                n,
                x.as_ptr(),
                WeightRows::f32(&w, k),
                got.as_mut_ptr(),
                n,
                false,
            )
        };
        let chain = |i: usize, j: usize, ks: std::ops::Range<usize>| {
            ks.fold(0.0f32, |acc, t| x[i * k + t].mul_add(w[j * k + t], acc))
        };
        for i in 0..m {
            for j in 0..n {
                let want = chain(i, j, 0..KC) + chain(i, j, KC..k);
                assert_eq!(got[i * n + j].to_bits(), want.to_bits(), "({i}, {j})");
            }
        }
    }

    #[test]
    fn empty_depth_gives_zero_or_keeps_the_output() {
        let mut out = vec![2.0f32; 6];
        for (accumulate, want) in [(true, 2.0), (false, 0.0)] {
            // SAFETY: `out` is 2 x 3; nothing is read from x or w at depth 0.
            unsafe {
                sgemm_wt(
                    Isa::detect(),
                    2,
                    0,
                    3,
                    [].as_ptr(),
                    WeightRows::f32_shape(&[], 3, 0),
                    out.as_mut_ptr(),
                    3,
                    accumulate,
                )
            };
            assert_eq!(out, vec![want; 6]);
        }
    }
}
