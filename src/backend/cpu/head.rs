//! The output head fused with log-softmax and the target gather.
//!
//! For each scored row `h[r]` (already final-normed) and its target id, returns
//! `log p(target) = logit[target] - logsumexp(logits)`. The vocabulary is cut into fixed
//! chunks processed in parallel; each chunk yields, per row, its max, its sum of
//! `exp(logit - max)` and the target logit if it holds the target, and the chunks are then
//! combined in vocabulary order. Chunk boundaries are fixed constants, so the result does
//! not depend on the thread count, and no more than `ROWS × VOCAB_CHUNK` logits exist at
//! once per task.
//!
//! [`score_rows`] also returns what the same logits say about the model's confidence, at the
//! cost of one more pass over each chunk's logits: the entropy of the predictive distribution
//! (from `Σ exp(l − max)·(l − max)` per chunk, combined like the sums) and the top-1 token with
//! its log-probability (the lowest id among equal maxima).

use super::exp;
use super::matmul::{sgemm_block, Gemm};
use super::operand::{Operand, WeightRows};
use crate::kv::find_non_finite;
use rayon::prelude::*;

/// Vocabulary entries per chunk (fixed: it defines the reduction order).
pub(super) const VOCAB_CHUNK: usize = 2048;
/// Rows per GEMM, bounding the per-task logits buffer (`ROWS × VOCAB_CHUNK` floats, 8 MiB):
/// taller blocks pack each vocabulary chunk of the head fewer times (measured: about 5% less
/// head time than 256 at context 4096).
pub(super) const ROWS: usize = 1024;

#[derive(Clone, Copy)]
pub(super) struct Partial {
    pub(super) max: f32,
    pub(super) sum: f32,
    pub(super) target: f32,
    /// `Σ exp(l − max)·(l − max)` over the chunk (with calibration only).
    pub(super) wsum: f32,
    /// The chunk's first entry equal to `max` (with calibration only).
    pub(super) argmax: u32,
}

pub use crate::backend::RowScore;

/// `Σ e[i]·(l[i] − max)` in eight lanes (element `i` into lane `i % 8`, lanes added as in
/// [`exp::exp_sub_sum`], the tail in order): written so that it vectorizes with the same bits
/// on every instruction set.
#[multiversion::multiversion(targets("x86_64+avx512f+avx2+fma", "x86_64+avx2+fma"))]
fn weighted_sum(e: &[f32], l: &[f32], max: f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ec, lc) = (e.chunks_exact(8), l.chunks_exact(8));
    let (er, lr) = (ec.remainder(), lc.remainder());
    for (a, b) in ec.zip(lc) {
        for i in 0..8 {
            acc[i] += a[i] * (b[i] - max);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (a, b) in er.iter().zip(lr) {
        s += a * (b - max);
    }
    s
}

/// A NaN or infinite logit: the first one by row, then vocabulary entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct NonFiniteLogit {
    pub row: usize,
    pub token: usize,
}

/// `h[rows, d]`, `w[vocab, d]`, `targets[rows]` -> `out[rows]` log-probabilities, or the first
/// non-finite logit (the max would drop a NaN and the fast `exp` clamp it, so every logit is
/// checked: a vectorized scan, about 1/(2d) of the head's work).
///
/// One task per vocabulary chunk walks all rows in blocks of `ROWS`, so each chunk of the
/// head matrix (4.5 MiB for SmolLM2) comes from memory once per call and from cache for the
/// later row blocks, instead of the whole 113 MiB head streaming once per row block.
pub fn logprobs<W: Operand + ?Sized>(
    h: &[f32],
    d: usize,
    w: &W,
    vocab: usize,
    targets: &[u32],
    out: &mut [f32],
) -> Result<(), NonFiniteLogit> {
    let parts = partials::<false>(h, d, w.rows(d), vocab, targets)?;
    for (i, o) in out.iter_mut().enumerate() {
        *o = combine(&parts, i).0;
    }
    Ok(())
}

/// [`logprobs`] with the entropy and the top-1 token of every row (`out[rows]`); the
/// log-probabilities have the same bits as [`logprobs`]'s.
pub fn score_rows<W: Operand + ?Sized>(
    h: &[f32],
    d: usize,
    w: &W,
    vocab: usize,
    targets: &[u32],
    out: &mut [RowScore],
) -> Result<(), NonFiniteLogit> {
    assert_eq!(out.len(), targets.len());
    let parts = partials::<true>(h, d, w.rows(d), vocab, targets)?;
    for (i, o) in out.iter_mut().enumerate() {
        let (logprob, sum, wsum, top1) = combine(&parts, i);
        // H = ln S − T/S, with S = Σ exp(l − M) and T = Σ exp(l − M)(l − M); the top-1
        // token's log-probability is (M − M) − ln S.
        let ln_s = sum.ln();
        *o = RowScore {
            logprob,
            entropy: (ln_s - wsum / sum) as f32,
            top1,
            top1_logprob: (-ln_s) as f32,
        };
    }
    Ok(())
}

/// Row `i`'s chunks combined in vocabulary order: (log-probability, Σ exp(l − max),
/// Σ exp(l − max)(l − max), top-1 id); the last two only mean something with calibration.
pub(super) fn combine(partials: &[Vec<Partial>], i: usize) -> (f32, f64, f64, u32) {
    let max = partials
        .iter()
        .map(|p| p[i].max)
        .fold(f32::NEG_INFINITY, f32::max);
    let (mut sum, mut wsum) = (0.0f64, 0.0f64);
    let mut target = f32::NAN;
    let mut top1 = None;
    for p in partials {
        let p = p[i];
        let shift = (p.max - max) as f64;
        let scale = shift.exp();
        sum += p.sum as f64 * scale;
        wsum += (p.wsum as f64 + shift * p.sum as f64) * scale;
        if !p.target.is_nan() {
            target = p.target;
        }
        if top1.is_none() && p.max == max {
            top1 = Some(p.argmax);
        }
    }
    let lp = ((target - max) as f64 - sum.ln()) as f32;
    (lp, sum, wsum, top1.unwrap_or(0))
}

/// `lg[r, vc]` = logits of rows `r0..r0 + r` of `h[rows, d]` against vocabulary entries
/// `v0..v0 + vc` of `w[vocab, d]`, or the first non-finite one.
#[allow(clippy::too_many_arguments)]
pub(super) fn logits_block(
    h: &[f32],
    d: usize,
    w: WeightRows,
    v0: usize,
    vc: usize,
    r0: usize,
    r: usize,
    lg: &mut [f32],
) -> Result<(), NonFiniteLogit> {
    let hb = &h[r0 * d..(r0 + r) * d];
    assert_eq!(lg.len(), r * vc);
    assert!(w.n() >= v0 + vc && w.k() == d);
    // SAFETY: `hb` is dense [r, d]; rows v0..v0+vc of `w` are [vc, d] (checked above);
    // `lg` is dense [r, vc] and owned by the caller. All in bounds.
    unsafe {
        sgemm_block(
            Gemm::configured(),
            r,
            d,
            vc,
            hb.as_ptr(),
            w.slice(v0, vc),
            lg.as_mut_ptr(),
            vc,
            false,
        );
    }
    match find_non_finite(lg) {
        Some(i) => Err(NonFiniteLogit {
            row: r0 + i / vc,
            token: v0 + i % vc,
        }),
        None => Ok(()),
    }
}

/// One row's partial over a chunk starting at `v0`; `row` is left holding `exp(l − max)`
/// and, with calibration, `kept` the logits themselves.
pub(super) fn row_partial<const CALIB: bool>(
    row: &mut [f32],
    kept: &mut [f32],
    v0: usize,
    target: u32,
) -> Partial {
    let t = target as usize;
    let vc = row.len();
    let target = if (v0..v0 + vc).contains(&t) {
        row[t - v0]
    } else {
        f32::NAN
    };
    let max = exp::max(row);
    let mut argmax = 0;
    if CALIB {
        argmax = v0 as u32 + row.iter().position(|&v| v == max).unwrap_or(0) as u32;
        kept.copy_from_slice(row);
    }
    let sum = exp::exp_sub_sum(row, max);
    let wsum = if CALIB {
        weighted_sum(row, kept, max)
    } else {
        0.0
    };
    Partial {
        max,
        sum,
        target,
        wsum,
        argmax,
    }
}

/// Every chunk's partials for every row (`partials[chunk][row]`), or the first bad logit.
fn partials<const CALIB: bool>(
    h: &[f32],
    d: usize,
    w: WeightRows,
    vocab: usize,
    targets: &[u32],
) -> Result<Vec<Vec<Partial>>, NonFiniteLogit> {
    let rows = targets.len();
    assert_eq!(h.len(), rows * d);
    assert_eq!((w.n(), w.k()), (vocab, d));
    let chunks: Vec<usize> = (0..vocab).step_by(VOCAB_CHUNK).collect();
    // partials[chunk][row], or the chunk's first non-finite logit.
    let partials: Vec<Result<Vec<Partial>, NonFiniteLogit>> = chunks
        .par_iter()
        .map(|&v0| {
            let vc = VOCAB_CHUNK.min(vocab - v0);
            let mut logits = vec![0.0f32; ROWS.min(rows) * vc];
            // A row's logits before `exp_sub_sum` overwrites them (calibration only).
            let mut kept = vec![0.0f32; if CALIB { vc } else { 0 }];
            let mut part = Vec::with_capacity(rows);
            for r0 in (0..rows).step_by(ROWS) {
                let r = ROWS.min(rows - r0);
                let lg = &mut logits[..r * vc];
                logits_block(h, d, w, v0, vc, r0, r, lg)?;
                for (i, row) in lg.chunks_mut(vc).enumerate() {
                    part.push(row_partial::<CALIB>(row, &mut kept, v0, targets[r0 + i]));
                }
            }
            Ok(part)
        })
        .collect();
    // The first bad logit by row, then token, whichever chunk found it.
    if let Some(e) = partials.iter().filter_map(|p| p.as_ref().err()).min() {
        return Err(*e);
    }
    Ok(partials
        .into_iter()
        .map(|p| p.unwrap_or_default())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_gets_the_same_bits_whatever_else_is_in_the_call() {
        // Row blocks and vocabulary chunks are fixed, and a row's logits do not depend on
        // the other rows of its GEMM: scoring rows in two calls equals scoring them in one.
        let (rows, d, vocab) = (600, 24, 5000);
        let h: Vec<f32> = (0..rows * d)
            .map(|i| ((i * 7919) % 1013) as f32 / 300.0 - 1.7)
            .collect();
        let w: Vec<f32> = (0..vocab * d)
            .map(|i| ((i * 104729) % 997) as f32 / 400.0 - 1.2)
            .collect();
        let targets: Vec<u32> = (0..rows).map(|i| ((i * 4513) % vocab) as u32).collect();
        let mut all = vec![0.0; rows];
        logprobs(&h, d, &w, vocab, &targets, &mut all).unwrap();
        let split = 301;
        let mut a = vec![0.0; split];
        let mut b = vec![0.0; rows - split];
        logprobs(&h[..split * d], d, &w, vocab, &targets[..split], &mut a).unwrap();
        logprobs(&h[split * d..], d, &w, vocab, &targets[split..], &mut b).unwrap();
        a.extend(b);
        assert!(all.iter().zip(&a).all(|(x, y)| x.to_bits() == y.to_bits()));
    }

    #[test]
    fn entropy_and_top1_match_a_direct_computation() {
        // Several vocabulary chunks, the last one partial, and a planted tie for the top-1.
        let (rows, d, vocab) = (13, 5, 2 * VOCAB_CHUNK + 777);
        let h: Vec<f32> = (0..rows * d)
            .map(|i| ((i * 31) % 17) as f32 / 4.0 - 2.0)
            .collect();
        let mut w: Vec<f32> = (0..vocab * d)
            .map(|i| ((i * 7919) % 23) as f32 / 6.0 - 2.0)
            .collect();
        // Entry vocab-1 (last chunk) and entry 5 (first chunk) are the same vector, the
        // largest of all: every row's top-1 is a tie, to be won by the lower id.
        for x in 0..d {
            w[5 * d + x] = 3.0 * (x as f32 - 2.0);
            w[(vocab - 1) * d + x] = 3.0 * (x as f32 - 2.0);
        }
        let targets: Vec<u32> = (0..rows).map(|i| ((i * 4513) % vocab) as u32).collect();
        let mut rs = vec![RowScore::default(); rows];
        score_rows(&h, d, &w, vocab, &targets, &mut rs).unwrap();
        let mut lp = vec![0.0; rows];
        logprobs(&h, d, &w, vocab, &targets, &mut lp).unwrap();
        for i in 0..rows {
            assert_eq!(
                rs[i].logprob.to_bits(),
                lp[i].to_bits(),
                "same log-probability bits"
            );
            let logits: Vec<f64> = (0..vocab)
                .map(|v| (0..d).map(|x| (h[i * d + x] * w[v * d + x]) as f64).sum())
                .collect();
            let m = logits.iter().cloned().fold(f64::MIN, f64::max);
            let lse = m + logits.iter().map(|l| (l - m).exp()).sum::<f64>().ln();
            let entropy: f64 = logits.iter().map(|l| -(l - lse).exp() * (l - lse)).sum();
            let top = logits.iter().position(|&l| l == m).unwrap();
            assert!(
                (rs[i].entropy as f64 - entropy).abs() < 1e-4,
                "{} vs {entropy}",
                rs[i].entropy
            );
            assert_eq!(rs[i].top1 as usize, top, "row {i}");
            assert!((rs[i].top1_logprob as f64 - (m - lse)).abs() < 1e-4);
        }
        assert!(
            rs.iter().any(|r| r.top1 == 5),
            "the planted tie is exercised"
        );
    }

    #[test]
    fn matches_full_log_softmax() {
        let (rows, d, vocab) = (21, 7, 9000);
        let h: Vec<f32> = (0..rows * d)
            .map(|i| ((i * 31) % 17) as f32 / 4.0 - 2.0)
            .collect();
        let w: Vec<f32> = (0..vocab * d)
            .map(|i| ((i * 7919) % 23) as f32 / 6.0 - 2.0)
            .collect();
        let targets: Vec<u32> = (0..rows).map(|i| ((i * 4513) % vocab) as u32).collect();
        let mut out = vec![0.0; rows];
        logprobs(&h, d, &w, vocab, &targets, &mut out).unwrap();
        for i in 0..rows {
            let logits: Vec<f64> = (0..vocab)
                .map(|v| {
                    (0..d)
                        .map(|x| h[i * d + x] as f64 * w[v * d + x] as f64)
                        .sum()
                })
                .collect();
            let m = logits.iter().cloned().fold(f64::MIN, f64::max);
            let lse = m + logits.iter().map(|l| (l - m).exp()).sum::<f64>().ln();
            let want = logits[targets[i] as usize] - lse;
            assert!((out[i] as f64 - want).abs() < 1e-4, "{} vs {want}", out[i]);
        }
    }
}
