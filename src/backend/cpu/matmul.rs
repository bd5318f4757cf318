//! `y = x · Wᵀ` with `W` stored row-major as `[n, k]` (the Hugging Face layout).
//!
//! The output columns are split into contiguous blocks, one per rayon task, and each block
//! is one single-threaded packed sgemm, so every weight is packed once per call. The GEMM
//! never splits the reduction dimension and every output element is accumulated by the
//! same kernel in the same k order wherever the block boundaries fall, so the result does
//! not depend on the thread count (checked by a test).
//!
//! The bits are defined by the crate's own GEMM, [`super::sgemm16`]: the depth cut into
//! blocks of 768, one fused multiply-add chain per block, the blocks added in order. They do
//! not depend on how the crate is built. `matrixmultiply` (an `8 × 8` permute tile) computes
//! the same bits when it is built with its depth block `KC = 768` (the repository's
//! `.cargo/config.toml` sets `MATMUL_SGEMM_KC=768` through its `constconf` feature) and the
//! CPU has FMA. A build that loses that setting (`cargo install`, use as a dependency) gets
//! another `KC` and other bits, so a one-time probe ([`matrixmultiply_agrees`]) compares the
//! two on a product deeper than two blocks, and `matrixmultiply` runs only where it agrees:
//! otherwise every product takes `sgemm16`, with the same bits.
//!
//! Where both may run, which one is faster depends on the host's load at the moment
//! (docs/performance.md), so by default [`Gemm::Auto`] times both per shape as it goes and
//! mostly runs the faster one. The choice can change run to run; the results cannot.

use super::isa::Isa;
use super::operand::{Operand, WeightRows};
use super::sgemm16;
use super::SendPtr;
use rayon::prelude::*;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// Column blocks are multiples of this (the microkernel's widest panel).
const COL_ALIGN: usize = 16;
/// Don't split below this many columns per task.
const MIN_COLS: usize = 64;

/// Which GEMM computes the column blocks. Every choice gives the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gemm {
    /// `matrixmultiply::sgemm`.
    Matrixmultiply,
    /// [`sgemm16::sgemm_wt`] with the fastest tile this CPU runs.
    Tile16,
    /// Per call and shape, whichever of the two has been faster lately (see [`Picker`]).
    Auto,
}

impl Gemm {
    /// Parses `matrixmultiply`, `tile16` or `auto`.
    pub fn parse(s: &str) -> Option<Gemm> {
        match s {
            "matrixmultiply" => Some(Gemm::Matrixmultiply),
            "tile16" => Some(Gemm::Tile16),
            "auto" => Some(Gemm::Auto),
            _ => None,
        }
    }

    /// `NINFER_CPU_GEMM` (a developer switch for A/B timing; every choice gives the same
    /// bits): `Ok(None)` when unset, an error naming the value when it is not one of the names,
    /// or when it asks for `matrixmultiply` in a build whose `matrixmultiply` does not give the
    /// engine's bits. The CPU backend checks it when it starts (`CpuScorer::new`), so a typo
    /// fails the run instead of timing the wrong GEMM.
    pub fn from_env() -> Result<Option<Gemm>, String> {
        let g = match std::env::var("NINFER_CPU_GEMM") {
            Err(std::env::VarError::NotPresent) => return Ok(None),
            Err(std::env::VarError::NotUnicode(v)) => {
                return Err(format!(
                "NINFER_CPU_GEMM={v:?}: not valid UTF-8; expected matrixmultiply, tile16 or auto"
            ))
            }
            Ok(v) => Gemm::parse(v.trim()).ok_or_else(|| {
                format!("NINFER_CPU_GEMM={v:?}: expected matrixmultiply, tile16 or auto")
            })?,
        };
        if g == Gemm::Matrixmultiply && !matrixmultiply_agrees() {
            return Err(
                "NINFER_CPU_GEMM=matrixmultiply: this build's matrixmultiply does not give the engine's bits \
                 (built without MATMUL_SGEMM_KC=768, see .cargo/config.toml, or no FMA); use tile16 or auto"
                    .into(),
            );
        }
        Ok(Some(g))
    }

    /// The process-wide default: [`Gemm::from_env`] when it names one, else `Auto` (library
    /// users that skip the backend's check get `Auto` for a bad value). `Auto` is `Tile16` where
    /// `matrixmultiply` does not agree with it.
    pub fn configured() -> Gemm {
        static CONFIGURED: OnceLock<Gemm> = OnceLock::new();
        *CONFIGURED.get_or_init(|| {
            let g = Gemm::from_env().ok().flatten().unwrap_or(Gemm::Auto);
            if g == Gemm::Auto && !matrixmultiply_agrees() {
                Gemm::Tile16
            } else {
                g
            }
        })
    }
}

/// Whether this build's `matrixmultiply` gives exactly [`super::sgemm16`]'s bits on this CPU
/// (probed once per process: a product three depth blocks deep, with and without
/// accumulation). False when `matrixmultiply` was built with another depth block than 768,
/// or runs without FMA here.
pub fn matrixmultiply_agrees() -> bool {
    static AGREES: OnceLock<bool> = OnceLock::new();
    *AGREES.get_or_init(|| {
        let (m, n, k) = (24, 40, 2 * sgemm16::KC + 45);
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919) % 1013) as f32 / 500.0 - 1.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 104729) % 997) as f32 / 400.0 - 1.0)
            .collect();
        [false, true].into_iter().all(|accumulate| {
            let run = |g: Gemm| {
                let mut c: Vec<f32> = (0..m * n).map(|i| i as f32 * 0.25 - 3.0).collect();
                // SAFETY: dense [m, k], [n, k] and [m, n] buffers, owned here.
                unsafe {
                    run_block(
                        g,
                        m,
                        k,
                        n,
                        x.as_ptr(),
                        WeightRows::f32(&w, k),
                        c.as_mut_ptr(),
                        n,
                        accumulate,
                    )
                };
                c
            };
            let (a, b) = (run(Gemm::Matrixmultiply), run(Gemm::Tile16));
            a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits())
        })
    })
}

/// `out[m, n] = (accumulate ? out : 0) + x[m, k] · w[n, k]ᵀ`.
pub fn matmul_wt<W: Operand + ?Sized>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &W,
    n: usize,
    out: &mut [f32],
    accumulate: bool,
) {
    matmul_wt_with(Gemm::configured(), x, m, k, w.rows(k), n, out, accumulate)
}

/// [`matmul_wt`] on a given GEMM.
#[allow(clippy::too_many_arguments)]
pub fn matmul_wt_with(
    gemm: Gemm,
    x: &[f32],
    m: usize,
    k: usize,
    w: WeightRows,
    n: usize,
    out: &mut [f32],
    accumulate: bool,
) {
    assert_eq!(x.len(), m * k, "x shape");
    assert_eq!((w.n(), w.k()), (n, k), "w shape");
    assert_eq!(out.len(), m * n, "out shape");
    if m == 0 || n == 0 {
        return;
    }
    let threads = rayon::current_num_threads().max(1);
    let per = (n.div_ceil(threads)).div_ceil(COL_ALIGN) * COL_ALIGN;
    let per = per.max(MIN_COLS).min(n);
    let blocks: Vec<(usize, usize)> = (0..n)
        .step_by(per)
        .map(|j0| (j0, (j0 + per).min(n)))
        .collect();
    let o = SendPtr(out.as_mut_ptr());
    blocks.par_iter().for_each(|&(j0, j1)| {
        // SAFETY: `x` is dense [m, k]; rows j0..j1 of `w` are [j1-j0, k]; the output
        // view starts at column j0 with row stride n and covers columns j0..j1 only, which no
        // other task touches. All indices are in bounds by the asserts.
        unsafe {
            sgemm_block(
                gemm,
                m,
                k,
                j1 - j0,
                x.as_ptr(),
                w.slice(j0, j1 - j0),
                o.get().add(j0),
                n,
                accumulate,
            )
        };
    });
}

/// One single-threaded block `c[m, n] (+)= x[m, k] · w[n, k]ᵀ` on `gemm`, `c` at row
/// stride `ldc` (the head calls it per vocabulary chunk).
///
/// `matrixmultiply` reads f32 weights only: stored ones (bf16, fp8, nvfp4) always take
/// `sgemm16`, which widens them while it packs (the same bits either way).
///
/// # Safety
/// `x` is readable for `m · k` floats, `w` holds `n` rows of `k`; `c` is writable for `m` rows
/// of `n` at stride `ldc ≥ n` and nothing else accesses them during the call.
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm_block(
    gemm: Gemm,
    m: usize,
    k: usize,
    n: usize,
    x: *const f32,
    w: WeightRows,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    match gemm {
        _ if w.as_f32().is_none() => run_block(Gemm::Tile16, m, k, n, x, w, c, ldc, accumulate),
        Gemm::Auto if !matrixmultiply_agrees() => {
            run_block(Gemm::Tile16, m, k, n, x, w, c, ldc, accumulate)
        }
        Gemm::Auto => {
            let key = (k, n, m.min(PICK_ROWS));
            let g = picker().pick(key);
            let start = Instant::now();
            run_block(g, m, k, n, x, w, c, ldc, accumulate);
            if m * n * k > 0 {
                picker().record(key, g, start.elapsed().as_secs_f64() / (m * n * k) as f64);
            }
        }
        g => run_block(g, m, k, n, x, w, c, ldc, accumulate),
    }
}

/// One block on the GEMM named (`Auto` is not a GEMM here).
///
/// # Safety
/// As for [`sgemm_block`].
#[allow(clippy::too_many_arguments)]
unsafe fn run_block(
    gemm: Gemm,
    m: usize,
    k: usize,
    n: usize,
    x: *const f32,
    w: WeightRows,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    match (gemm, w.as_f32()) {
        (Gemm::Matrixmultiply, Some(wf)) => matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            x,
            k as isize,
            1,
            wf.as_ptr(),
            1,
            k as isize,
            if accumulate { 1.0 } else { 0.0 },
            c,
            ldc as isize,
            1,
        ),
        _ => sgemm16::sgemm_wt(Isa::detect(), m, k, n, x, w, c, ldc, accumulate),
    }
}

/// Row counts at or above this share one timing record per `(k, n)`; smaller blocks (the
/// last layer's few rows, short streams) are timed apart.
const PICK_ROWS: usize = 256;

fn picker() -> &'static Picker {
    static PICKER: OnceLock<Picker> = OnceLock::new();
    PICKER.get_or_init(Picker::default)
}

/// Chooses between the two GEMMs per shape from their recent speed.
///
/// Each shape keeps a moving average of seconds per multiply-add for both GEMMs. A shape's
/// first calls alternate between them; after that it runs the faster one and, every
/// `EXPLORE_EVERY`-th (8th) call, the other, so a change in the host's behaviour is noticed
/// within a few dozen calls. Which GEMM ran never changes a bit of the result, so the choice
/// may depend on timing, thread interleaving and history.
#[derive(Default)]
pub struct Picker {
    shapes: Mutex<Vec<Record>>,
}

/// One shape's timings: `[matrixmultiply, tile16]`.
struct Record {
    key: (usize, usize, usize),
    secs_per_fma: [f64; 2],
    samples: [u32; 2],
    calls: u64,
}

/// Every this-many calls of a shape go to the GEMM currently judged slower.
const EXPLORE_EVERY: u64 = 8;
/// Weight of a new timing in the moving average.
const AVERAGE_WEIGHT: f64 = 0.25;

impl Picker {
    fn pick(&self, key: (usize, usize, usize)) -> Gemm {
        let mut shapes = self.shapes.lock().unwrap_or_else(|e| e.into_inner());
        let i = match shapes.iter().position(|r| r.key == key) {
            Some(i) => i,
            None => {
                shapes.push(Record {
                    key,
                    secs_per_fma: [0.0; 2],
                    samples: [0; 2],
                    calls: 0,
                });
                shapes.len() - 1
            }
        };
        let r = &mut shapes[i];
        r.calls += 1;
        let slot = if r.samples.iter().any(|&s| s < 2) {
            (r.calls % 2) as usize
        } else {
            let best = (r.secs_per_fma[1] < r.secs_per_fma[0]) as usize;
            if r.calls.is_multiple_of(EXPLORE_EVERY) {
                1 - best
            } else {
                best
            }
        };
        [Gemm::Matrixmultiply, Gemm::Tile16][slot]
    }

    fn record(&self, key: (usize, usize, usize), gemm: Gemm, secs_per_fma: f64) {
        let slot = (gemm == Gemm::Tile16) as usize;
        let mut shapes = self.shapes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = shapes.iter_mut().find(|r| r.key == key) {
            r.secs_per_fma[slot] = if r.samples[slot] == 0 {
                secs_per_fma
            } else {
                r.secs_per_fma[slot] + AVERAGE_WEIGHT * (secs_per_fma - r.secs_per_fma[slot])
            };
            r.samples[slot] = r.samples[slot].saturating_add(1);
        }
    }

    /// One line for profiles: per shape (depth × columns, rows capped at `PICK_ROWS`, 256), how
    /// many calls each GEMM has timed so far and its recent GFLOP/s on one thread.
    pub fn summary() -> String {
        let shapes = picker().shapes.lock().unwrap_or_else(|e| e.into_inner());
        let rate = |s: f64| if s > 0.0 { 2e-9 / s } else { 0.0 };
        let parts: Vec<String> = shapes
            .iter()
            .map(|r| {
                format!(
                    "{}x{} ({} rows): matrixmultiply {} at {:.0}, tile16 {} at {:.0}",
                    r.key.0,
                    r.key.1,
                    r.key.2,
                    r.samples[0],
                    rate(r.secs_per_fma[0]),
                    r.samples[1],
                    rate(r.secs_per_fma[1])
                )
            })
            .collect();
        if parts.is_empty() {
            "none timed (NINFER_CPU_GEMM is not auto)".into()
        } else {
            parts.join("; ")
        }
    }
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

    /// The engine's depth block (`sgemm16::KC`).
    const KC: usize = 768;

    #[test]
    fn the_bits_are_one_fma_chain_per_depth_block_of_768() {
        // With beta = 0 every output is, per depth block of KC, one in-order FMA chain
        // from zero, and the blocks' chains are added in order: whichever GEMM runs.
        let (m, n, k) = (16, 24, 2 * KC);
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919) % 1013) as f32 / 500.0 - 1.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 104729) % 997) as f32 / 400.0 - 1.0)
            .collect();
        let chain = |i: usize, j: usize, ks: std::ops::Range<usize>| {
            ks.fold(0.0f32, |acc, t| x[i * k + t].mul_add(w[j * k + t], acc))
        };
        let mut gemms = vec![Gemm::Tile16, Gemm::Auto, Gemm::configured()];
        if matrixmultiply_agrees() {
            gemms.push(Gemm::Matrixmultiply);
        }
        for g in gemms {
            let mut out = vec![0.0f32; m * n];
            matmul_wt_with(g, &x, m, k, WeightRows::f32(&w, k), n, &mut out, false);
            let mut differ = 0;
            for i in 0..m {
                for j in 0..n {
                    let want = chain(i, j, 0..KC) + chain(i, j, KC..k);
                    differ += (out[i * n + j].to_bits() != want.to_bits()) as usize;
                }
            }
            assert_eq!(differ, 0, "{g:?}");
        }
    }

    #[test]
    fn matrixmultiply_runs_only_where_it_gives_the_same_bits() {
        // Built with the repository's MATMUL_SGEMM_KC=768 on an FMA machine, matrixmultiply
        // agrees and the picker may use it; built any other way it must not be used.
        let pinned = option_env!("MATMUL_SGEMM_KC") == Some("768");
        if !pinned {
            assert!(
                !matrixmultiply_agrees(),
                "KC is not 768, yet the probe agreed"
            );
            assert_eq!(Gemm::configured(), Gemm::Tile16);
        } else if Isa::detect() != Isa::Portable {
            assert!(
                matrixmultiply_agrees(),
                "matrixmultiply built with KC=768 disagrees with sgemm16: the picker lost a GEMM"
            );
        }
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
