//! Two output heads over the same positions, compared over the full vocabulary in one pass.
//!
//! For `--reference-kv` / `--reference-artifact` runs: each scored position has the run's
//! final hidden state and the reference's, and this computes, chunk by chunk of the
//! vocabulary exactly as [`super::head`] does (so the run's own scores keep their bits), both
//! distributions' partials and `Σ exp(l_ref − max_ref)·(l_ref − l_run)`, from which
//! `KL(ref ‖ run) = U/S_ref − lse_ref + lse_run` follows (and the mirror sum for
//! `KL(run ‖ ref)`). No logits outlive their chunk, so
//! memory stays `O(rows × chunk)` whatever the vocabulary. Identical inputs give a KL of
//! exactly 0. A second sweep over the same chunks, with both normalizers known, gives the
//! Jensen–Shannon divergence and the top-5 / top-10 overlap ([`super::head_pair_js`]).

use super::head::{combine, logits_block, row_partial, NonFiniteLogit, Partial, RowScore};
use super::head::{ROWS, VOCAB_CHUNK};
use super::head_pair_js::{self, overlap, RefSide, Spread, TOP_K};
use super::operand::WeightRows;
use rayon::prelude::*;

pub use crate::backend::PairScore;

/// Which head produced a non-finite logit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Side {
    Run,
    Reference,
}

/// `Σ e[i]·(a[i] − b[i])` in eight lanes, the same bits on every instruction set.
#[multiversion::multiversion(targets("x86_64+avx512f+avx2+fma", "x86_64+avx2+fma"))]
fn diff_weighted_sum(e: &[f32], a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let n = e.len() / 8 * 8;
    for ((x, y), z) in e[..n]
        .chunks_exact(8)
        .zip(a[..n].chunks_exact(8))
        .zip(b[..n].chunks_exact(8))
    {
        for i in 0..8 {
            acc[i] += x[i] * (y[i] - z[i]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for i in n..e.len() {
        s += e[i] * (a[i] - b[i]);
    }
    s
}

/// The run's row `i` from its chunks' partials (as [`super::head::score_rows`] gives it) and
/// its sum of `exp(l − max)`.
fn run_row(run: &[Vec<Partial>], i: usize) -> (RowScore, f64) {
    let (lp, sum, wsum, top1) = combine(run, i);
    let ln_s = sum.ln();
    let row = RowScore {
        logprob: lp,
        entropy: (ln_s - wsum / sum) as f32,
        top1,
        top1_logprob: (-ln_s) as f32,
    };
    (row, sum)
}

#[derive(Clone, Copy)]
struct Both {
    run: Partial,
    reference: Partial,
    /// `Σ exp(l_ref − max_ref)·(l_ref − l_run)` over the chunk.
    u: f32,
    /// `Σ exp(l_run − max_run)·(l_run − l_ref)` over the chunk.
    u_rev: f32,
}

/// `h[rows, d]` with `w[vocab, d]` (the run) and `h_ref[rows, d_ref]` with
/// `w_ref[vocab, d_ref]` (the reference), `targets[rows]` -> `out[rows]` (the run's rows,
/// the same bits as [`super::head::score_rows`]) and `pairs[rows]`.
#[allow(clippy::too_many_arguments)]
pub fn score_pairs(
    (h, d, w): (&[f32], usize, WeightRows),
    (h_ref, d_ref, w_ref): (&[f32], usize, WeightRows),
    vocab: usize,
    targets: &[u32],
    out: &mut [RowScore],
    pairs: &mut [PairScore],
) -> Result<(), (Side, NonFiniteLogit)> {
    let rows = targets.len();
    assert_eq!(h.len(), rows * d);
    assert_eq!(h_ref.len(), rows * d_ref);
    assert_eq!((w.n(), w.k()), (vocab, d));
    assert_eq!((w_ref.n(), w_ref.k()), (vocab, d_ref));
    assert_eq!((out.len(), pairs.len()), (rows, rows));
    let chunks: Vec<usize> = (0..vocab).step_by(VOCAB_CHUNK).collect();
    let parts: Vec<Result<Vec<Both>, (Side, NonFiniteLogit)>> = chunks
        .par_iter()
        .map(|&v0| {
            let vc = VOCAB_CHUNK.min(vocab - v0);
            let mut lg = vec![0.0f32; ROWS.min(rows) * vc];
            let mut lg_ref = vec![0.0f32; ROWS.min(rows) * vc];
            let (mut kept, mut kept_ref) = (vec![0.0f32; vc], vec![0.0f32; vc]);
            let mut part = Vec::with_capacity(rows);
            for r0 in (0..rows).step_by(ROWS) {
                let r = ROWS.min(rows - r0);
                let (a, b) = (&mut lg[..r * vc], &mut lg_ref[..r * vc]);
                logits_block(h, d, w, v0, vc, r0, r, a).map_err(|e| (Side::Run, e))?;
                logits_block(h_ref, d_ref, w_ref, v0, vc, r0, r, b)
                    .map_err(|e| (Side::Reference, e))?;
                for (i, (x, y)) in a.chunks_mut(vc).zip(b.chunks_mut(vc)).enumerate() {
                    let t = targets[r0 + i];
                    let run = row_partial::<true>(x, &mut kept, v0, t);
                    let reference = row_partial::<true>(y, &mut kept_ref, v0, t);
                    let u = diff_weighted_sum(y, &kept_ref, &kept);
                    let u_rev = diff_weighted_sum(x, &kept, &kept_ref);
                    part.push(Both {
                        run,
                        reference,
                        u,
                        u_rev,
                    });
                }
            }
            Ok(part)
        })
        .collect();
    if let Some(e) = parts.iter().filter_map(|p| p.as_ref().err()).min() {
        return Err(*e);
    }
    let parts: Vec<Vec<Both>> = parts.into_iter().map(|p| p.unwrap_or_default()).collect();
    let run: Vec<Vec<Partial>> = parts
        .iter()
        .map(|c| c.iter().map(|b| b.run).collect())
        .collect();
    let refs: Vec<Vec<Partial>> = parts
        .iter()
        .map(|c| c.iter().map(|b| b.reference).collect())
        .collect();
    let mut lses = Vec::with_capacity(rows);
    for i in 0..rows {
        let (row, sum) = run_row(&run, i);
        out[i] = row;
        let ln_s = sum.ln();
        let (lp_ref, sum_ref, _, top1_ref) = combine(&refs, i);
        let max =
            |p: &Vec<Vec<Partial>>| p.iter().map(|c| c[i].max).fold(f32::NEG_INFINITY, f32::max);
        let (m, m_ref) = (max(&run), max(&refs));
        let u: f64 = parts
            .iter()
            .map(|c| c[i].u as f64 * ((c[i].reference.max - m_ref) as f64).exp())
            .sum();
        let u_rev: f64 = parts
            .iter()
            .map(|c| c[i].u_rev as f64 * ((c[i].run.max - m) as f64).exp())
            .sum();
        let lse = m as f64 + ln_s;
        let lse_ref = m_ref as f64 + sum_ref.ln();
        pairs[i] = PairScore {
            ref_logprob: lp_ref,
            kld: (u / sum_ref - lse_ref + lse) as f32,
            kld_reverse: (u_rev / sum - lse + lse_ref) as f32,
            ref_top1: top1_ref,
            ref_top1_logprob: (-sum_ref.ln()) as f32,
            ..PairScore::default()
        };
        lses.push((lse, lse_ref));
    }
    let spread = head_pair_js::spread((h, d, w), RefSide::Rows(h_ref, d_ref, w_ref), vocab, &lses)?;
    fill_spread(pairs, &spread);
    Ok(())
}

/// The second sweep's Jensen–Shannon divergence and top-k overlap into `pairs`.
fn fill_spread(pairs: &mut [PairScore], spread: &[Spread]) {
    for (p, s) in pairs.iter_mut().zip(spread) {
        p.js = s.js as f32;
        p.top5 = overlap(&s.top, &s.top_ref, 5);
        p.top10 = overlap(&s.top, &s.top_ref, TOP_K);
    }
}

/// Log-probabilities at or below this are left out of KL(reference ‖ run) against another
/// engine's file, as llama.cpp's own `--kl-divergence` does (its file floors them there).
pub const FOREIGN_FLOOR: f32 = -16.0;

/// Per chunk: the run's partial, and the two sums against the reference's log-probabilities.
#[derive(Clone, Copy)]
struct Foreign {
    run: Partial,
    /// `Σ p_ref·(lp_ref − l_run)` and `Σ p_ref` over entries above [`FOREIGN_FLOOR`].
    a: f64,
    p: f64,
    /// `Σ exp(l_run − max_run)·(l_run − lp_ref)` over every entry.
    u_rev: f32,
}

/// The run `h[rows, d]` through `w[vocab, d]` against another engine's log-probabilities
/// `ref_lp[rows, vocab]` (normalized, as that engine computed them; not renormalized
/// here), `targets[rows]` -> `out[rows]` (the same bits as [`super::head::score_rows`]) and
/// `pairs[rows]`. KL(reference ‖ run) takes the entries above [`FOREIGN_FLOOR`], as
/// llama.cpp's `--kl-divergence` does on its own file; KL(run ‖ reference) takes every entry
/// as the file gives it (its floor included); the reference's target log-probability and
/// top-1 are the file's values.
pub fn score_against_logprobs(
    (h, d, w): (&[f32], usize, WeightRows),
    ref_lp: &[f32],
    vocab: usize,
    targets: &[u32],
    out: &mut [RowScore],
    pairs: &mut [PairScore],
) -> Result<(), (Side, NonFiniteLogit)> {
    let rows = targets.len();
    assert_eq!(h.len(), rows * d);
    assert_eq!(ref_lp.len(), rows * vocab);
    assert_eq!((w.n(), w.k()), (vocab, d));
    assert_eq!((out.len(), pairs.len()), (rows, rows));
    if let Some(i) = ref_lp.iter().position(|x| !x.is_finite()) {
        let e = NonFiniteLogit {
            row: i / vocab,
            token: i % vocab,
        };
        return Err((Side::Reference, e));
    }
    let chunks: Vec<usize> = (0..vocab).step_by(VOCAB_CHUNK).collect();
    let parts: Vec<Result<Vec<Foreign>, (Side, NonFiniteLogit)>> = chunks
        .par_iter()
        .map(|&v0| {
            let vc = VOCAB_CHUNK.min(vocab - v0);
            let mut lg = vec![0.0f32; ROWS.min(rows) * vc];
            let mut kept = vec![0.0f32; vc];
            let mut part = Vec::with_capacity(rows);
            for r0 in (0..rows).step_by(ROWS) {
                let r = ROWS.min(rows - r0);
                let a = &mut lg[..r * vc];
                logits_block(h, d, w, v0, vc, r0, r, a).map_err(|e| (Side::Run, e))?;
                for (i, x) in a.chunks_mut(vc).enumerate() {
                    let row = r0 + i;
                    let run = row_partial::<true>(x, &mut kept, v0, targets[row]);
                    let lp = &ref_lp[row * vocab + v0..row * vocab + v0 + vc];
                    let (mut sa, mut sp) = (0.0f64, 0.0f64);
                    for (&q, &l) in lp.iter().zip(&kept) {
                        if q > FOREIGN_FLOOR {
                            let p = (q as f64).exp();
                            sa += p * (q as f64 - l as f64);
                            sp += p;
                        }
                    }
                    // `x` now holds exp(l − max) (row_partial), `kept` the logits.
                    let u_rev = diff_weighted_sum(x, &kept, lp);
                    part.push(Foreign {
                        run,
                        a: sa,
                        p: sp,
                        u_rev,
                    });
                }
            }
            Ok(part)
        })
        .collect();
    if let Some(e) = parts.iter().filter_map(|p| p.as_ref().err()).min() {
        return Err(*e);
    }
    let parts: Vec<Vec<Foreign>> = parts.into_iter().map(|p| p.unwrap_or_default()).collect();
    let run: Vec<Vec<Partial>> = parts
        .iter()
        .map(|c| c.iter().map(|b| b.run).collect())
        .collect();
    let mut lses = Vec::with_capacity(rows);
    for i in 0..rows {
        let (row, sum) = run_row(&run, i);
        out[i] = row;
        let ln_s = sum.ln();
        let m = run
            .iter()
            .map(|c| c[i].max)
            .fold(f32::NEG_INFINITY, f32::max);
        let lse = m as f64 + ln_s;
        let (a, p): (f64, f64) = parts
            .iter()
            .fold((0.0, 0.0), |(a, p), c| (a + c[i].a, p + c[i].p));
        let u_rev: f64 = parts
            .iter()
            .map(|c| c[i].u_rev as f64 * ((c[i].run.max - m) as f64).exp())
            .sum();
        let row = &ref_lp[i * vocab..(i + 1) * vocab];
        let (top, top_lp) =
            row.iter()
                .enumerate()
                .fold((0usize, f32::NEG_INFINITY), |(bi, bv), (j, &v)| {
                    if v > bv {
                        (j, v)
                    } else {
                        (bi, bv)
                    }
                });
        pairs[i] = PairScore {
            ref_logprob: row[targets[i] as usize],
            kld: (a + p * lse) as f32,
            kld_reverse: (u_rev / sum - lse) as f32,
            ref_top1: top as u32,
            ref_top1_logprob: top_lp,
            ..PairScore::default()
        };
        lses.push((lse, 0.0));
    }
    let spread = head_pair_js::spread((h, d, w), RefSide::Logprobs(ref_lp), vocab, &lses)?;
    fill_spread(pairs, &spread);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::head::score_rows;
    use super::*;

    fn data(rows: usize, d: usize, vocab: usize, salt: usize) -> (Vec<f32>, Vec<f32>) {
        let h = (0..rows * d)
            .map(|i| (((i + salt) * 31) % 17) as f32 / 4.0 - 2.0)
            .collect();
        let w = (0..vocab * d)
            .map(|i| ((i * 7919 + salt) % 23) as f32 / 6.0 - 2.0)
            .collect();
        (h, w)
    }

    #[test]
    fn kl_top1_and_the_run_rows_match_a_direct_computation() {
        let (rows, d, vocab) = (9, 6, 2 * VOCAB_CHUNK + 301);
        let (h, w) = (data(rows, d, vocab, 0).0, data(rows, d, vocab, 0).1);
        let (h_ref, w_ref) = data(rows, d + 1, vocab, 5);
        let targets: Vec<u32> = (0..rows).map(|i| ((i * 4513) % vocab) as u32).collect();
        let mut out = vec![RowScore::default(); rows];
        let mut pairs = vec![PairScore::default(); rows];
        score_pairs(
            (&h, d, WeightRows::f32(&w, d)),
            (&h_ref, d + 1, WeightRows::f32(&w_ref, d + 1)),
            vocab,
            &targets,
            &mut out,
            &mut pairs,
        )
        .unwrap();
        let mut alone = vec![RowScore::default(); rows];
        score_rows(&h, d, &w, vocab, &targets, &mut alone).unwrap();
        assert_eq!(out, alone, "the run's rows keep their bits");
        let logits = |h: &[f32], w: &[f32], d: usize, i: usize| -> Vec<f64> {
            (0..vocab)
                .map(|v| (0..d).map(|x| (h[i * d + x] * w[v * d + x]) as f64).sum())
                .collect()
        };
        let lsm = |l: Vec<f64>| {
            let m = l.iter().cloned().fold(f64::MIN, f64::max);
            let lse = m + l.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            l.iter().map(|x| x - lse).collect::<Vec<f64>>()
        };
        for i in 0..rows {
            let a = lsm(logits(&h, &w, d, i));
            let b = lsm(logits(&h_ref, &w_ref, d + 1, i));
            let kl: f64 = b.iter().zip(&a).map(|(q, p)| q.exp() * (q - p)).sum();
            assert!(
                (pairs[i].kld as f64 - kl).abs() < 1e-4 * kl.max(1.0),
                "{} vs {kl}",
                pairs[i].kld
            );
            assert!(kl > 0.01, "the two heads differ");
            let kl_rev: f64 = a.iter().zip(&b).map(|(p, q)| p.exp() * (p - q)).sum();
            assert!(
                (pairs[i].kld_reverse as f64 - kl_rev).abs() < 1e-4 * kl_rev.max(1.0),
                "{} vs {kl_rev}",
                pairs[i].kld_reverse
            );
            assert!(
                (kl - kl_rev).abs() > 1e-3,
                "the directions differ: {kl} {kl_rev}"
            );
            let t = targets[i] as usize;
            assert!((pairs[i].ref_logprob as f64 - b[t]).abs() < 1e-4);
            let top = b.iter().cloned().fold(f64::MIN, f64::max);
            assert_eq!(
                pairs[i].ref_top1 as usize,
                b.iter().position(|&x| x == top).unwrap()
            );
            assert!((pairs[i].ref_top1_logprob as f64 - top).abs() < 1e-4);
            let js = js_direct(&a, &b);
            assert!(
                (pairs[i].js as f64 - js).abs() < 1e-5 * js,
                "JS {} vs {js}",
                pairs[i].js
            );
            assert_eq!(pairs[i].top5, overlap_direct(&a, &b, 5));
            assert_eq!(pairs[i].top10, overlap_direct(&a, &b, 10));
        }
    }

    /// A reference close to the run (the same head, rows nudged): Jensen–Shannon small and
    /// accurate to float64, overlaps partial and counted as float64 counts them.
    #[test]
    fn a_close_reference_gives_small_js_and_partial_overlaps() {
        let (rows, d, vocab) = (16, 6, 2 * VOCAB_CHUNK + 301);
        // Values without ties (a multiplicative hash), so the top lists are unambiguous.
        let noise = |i: usize, salt: u64| {
            // splitmix64's finalizer of (i, salt).
            let mut x = (i as u64)
                .wrapping_add(salt << 32)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15);
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let h: Vec<f32> = (0..rows * d).map(|i| 4.0 * noise(i, 1)).collect();
        let w: Vec<f32> = (0..vocab * d).map(|i| noise(i, 2)).collect();
        let h_ref: Vec<f32> = (0..rows * d).map(|i| h[i] + 0.1 * noise(i, 3)).collect();
        let targets: Vec<u32> = (0..rows).map(|i| (i * 331 % vocab) as u32).collect();
        let mut out = vec![RowScore::default(); rows];
        let mut pairs = vec![PairScore::default(); rows];
        score_pairs(
            (&h, d, WeightRows::f32(&w, d)),
            (&h_ref, d, WeightRows::f32(&w, d)),
            vocab,
            &targets,
            &mut out,
            &mut pairs,
        )
        .unwrap();
        let lsm = |h: &[f32], i: usize| -> Vec<f64> {
            let l: Vec<f64> = (0..vocab)
                .map(|v| (0..d).map(|x| (h[i * d + x] * w[v * d + x]) as f64).sum())
                .collect();
            let m = l.iter().cloned().fold(f64::MIN, f64::max);
            let lse = m + l.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            l.iter().map(|x| x - lse).collect()
        };
        let mut tops = Vec::new();
        for (i, p) in pairs.iter().enumerate() {
            let (a, b) = (lsm(&h, i), lsm(&h_ref, i));
            let js = js_direct(&a, &b);
            assert!(js < 0.05 && js > 0.0, "close: {js}");
            assert!((p.js as f64 - js).abs() < 2e-5 * js, "JS {} vs {js}", p.js);
            assert_eq!(
                (p.top5, p.top10),
                (overlap_direct(&a, &b, 5), overlap_direct(&a, &b, 10))
            );
            tops.push((p.top5, p.top10));
        }
        assert!(
            tops.iter().any(|&(a, b)| a < 5 && b > a && b < 10),
            "some overlaps are partial: {tops:?}"
        );
    }

    /// Jensen–Shannon divergence of two log-probability vectors, in float64.
    fn js_direct(a: &[f64], b: &[f64]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(&x, &y)| {
                let (p, q) = (x.exp(), y.exp());
                let m = 0.5 * (p + q);
                0.5 * (p * (p / m).ln() + q * (q / m).ln())
            })
            .sum()
    }

    /// How many of `a`'s `k` largest ids are among `b`'s (ties to the lower id).
    fn overlap_direct(a: &[f64], b: &[f64], k: usize) -> u8 {
        let top = |v: &[f64]| {
            let mut ids: Vec<usize> = (0..v.len()).collect();
            ids.sort_by(|&i, &j| v[j].total_cmp(&v[i]).then(i.cmp(&j)));
            ids.truncate(k);
            ids
        };
        let (ta, tb) = (top(a), top(b));
        ta.iter().filter(|i| tb.contains(i)).count() as u8
    }

    #[test]
    fn a_reference_equal_to_the_run_gives_exactly_zero() {
        let (rows, d, vocab) = (7, 5, VOCAB_CHUNK + 77);
        let (h, w) = data(rows, d, vocab, 3);
        let targets: Vec<u32> = (0..rows).map(|i| (i * 97 % vocab) as u32).collect();
        let mut out = vec![RowScore::default(); rows];
        let mut pairs = vec![PairScore::default(); rows];
        score_pairs(
            (&h, d, WeightRows::f32(&w, d)),
            (&h, d, WeightRows::f32(&w, d)),
            vocab,
            &targets,
            &mut out,
            &mut pairs,
        )
        .unwrap();
        for (o, p) in out.iter().zip(&pairs) {
            assert_eq!((p.kld, p.kld_reverse, p.js), (0.0, 0.0, 0.0));
            assert_eq!((p.top5, p.top10), (5, 10));
            assert_eq!(p.ref_logprob.to_bits(), o.logprob.to_bits());
            assert_eq!(p.ref_top1, o.top1);
        }
    }

    #[test]
    fn a_bad_reference_logit_is_named() {
        let (rows, d, vocab) = (3, 4, 100);
        let (h, w) = data(rows, d, vocab, 1);
        let mut w_bad = w.clone();
        w_bad[17 * d] = f32::NAN;
        let targets = vec![1u32; rows];
        let mut out = vec![RowScore::default(); rows];
        let mut pairs = vec![PairScore::default(); rows];
        let e = score_pairs(
            (&h, d, WeightRows::f32(&w, d)),
            (&h, d, WeightRows::f32(&w_bad, d)),
            vocab,
            &targets,
            &mut out,
            &mut pairs,
        )
        .unwrap_err();
        assert_eq!(e, (Side::Reference, NonFiniteLogit { row: 0, token: 17 }));
    }

    /// Against log-probabilities as another engine writes them: KL(reference ‖ run) over
    /// the entries above the floor, unnormalized as llama.cpp takes them, and the reverse
    /// over every entry, both to a direct float64 computation; the run's rows keep their
    /// bits; a reference equal to the run (its own log-softmax) gives 0.
    #[test]
    fn another_engine_s_log_probabilities_give_llama_cpp_s_kl() {
        let (rows, d, vocab) = (6, 5, VOCAB_CHUNK + 300);
        let (h, w) = data(rows, d, vocab, 2);
        let (h2, _) = data(rows, d, vocab, 9);
        let targets: Vec<u32> = (0..rows).map(|i| (i * 1237 % vocab) as u32).collect();
        let logits = |h: &[f32], i: usize| -> Vec<f64> {
            (0..vocab)
                .map(|v| (0..d).map(|x| (h[i * d + x] * w[v * d + x]) as f64).sum())
                .collect()
        };
        let lsm = |l: Vec<f64>| {
            let m = l.iter().cloned().fold(f64::MIN, f64::max);
            let lse = m + l.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            l.iter().map(|x| x - lse).collect::<Vec<f64>>()
        };
        // The reference: another hidden state's log-softmax, as f32 log-probabilities.
        let reference: Vec<Vec<f64>> = (0..rows).map(|i| lsm(logits(&h2, i))).collect();
        let ref_lp: Vec<f32> = reference.iter().flatten().map(|&x| x as f32).collect();
        let mut out = vec![RowScore::default(); rows];
        let mut pairs = vec![PairScore::default(); rows];
        score_against_logprobs(
            (&h, d, WeightRows::f32(&w, d)),
            &ref_lp,
            vocab,
            &targets,
            &mut out,
            &mut pairs,
        )
        .unwrap();
        let mut alone = vec![RowScore::default(); rows];
        score_rows(&h, d, &w, vocab, &targets, &mut alone).unwrap();
        assert_eq!(out, alone, "the run's rows keep their bits");
        let mut below = 0;
        for i in 0..rows {
            let run = lsm(logits(&h, i));
            let q: Vec<f64> = ref_lp[i * vocab..(i + 1) * vocab]
                .iter()
                .map(|&x| x as f64)
                .collect();
            below += q.iter().filter(|&&x| x <= FOREIGN_FLOOR as f64).count();
            let kl: f64 = q
                .iter()
                .zip(&run)
                .filter(|(&p, _)| p > FOREIGN_FLOOR as f64)
                .map(|(p, r)| p.exp() * (p - r))
                .sum();
            let kl_rev: f64 = run.iter().zip(&q).map(|(r, p)| r.exp() * (r - p)).sum();
            assert!(
                (pairs[i].kld as f64 - kl).abs() < 1e-4 * kl.max(1.0),
                "{} vs {kl}",
                pairs[i].kld
            );
            assert!(kl > 0.01);
            assert!(
                (pairs[i].kld_reverse as f64 - kl_rev).abs() < 1e-4 * kl_rev.max(1.0),
                "{} vs {kl_rev}",
                pairs[i].kld_reverse
            );
            assert_eq!(
                pairs[i].ref_logprob,
                ref_lp[i * vocab + targets[i] as usize]
            );
            let js = js_direct(&run, &q);
            assert!(
                (pairs[i].js as f64 - js).abs() < 1e-4 * js,
                "JS {} vs {js}",
                pairs[i].js
            );
            assert_eq!(pairs[i].top10, overlap_direct(&run, &q, 10));
        }
        assert!(
            below > 0,
            "some entries lie below the floor, so it is exercised"
        );
        // The run against its own log-probabilities: 0 up to f32 rounding.
        let own: Vec<f32> = (0..rows)
            .flat_map(|i| lsm(logits(&h, i)))
            .map(|x| x as f32)
            .collect();
        score_against_logprobs(
            (&h, d, WeightRows::f32(&w, d)),
            &own,
            vocab,
            &targets,
            &mut out,
            &mut pairs,
        )
        .unwrap();
        for p in &pairs {
            assert!(p.kld.abs() < 1e-4 && p.kld_reverse.abs() < 1e-4, "{p:?}");
        }
    }
}
