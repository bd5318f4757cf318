//! The output head fused with log-softmax and the target gather.
//!
//! For each scored row `h[r]` (already final-normed) and its target id, returns
//! `log p(target) = logit[target] - logsumexp(logits)`. The vocabulary is cut into fixed
//! chunks processed in parallel; each chunk yields, per row, its max, its sum of
//! `exp(logit - max)` and the target logit if it holds the target, and the chunks are then
//! combined in vocabulary order. Chunk boundaries are fixed constants, so the result does
//! not depend on the thread count, and no more than `ROWS × VOCAB_CHUNK` logits exist at
//! once per task.

use super::exp;
use super::matmul::{sgemm_block, Gemm};
use crate::kv::find_non_finite;
use rayon::prelude::*;

/// Vocabulary entries per chunk (fixed: it defines the reduction order).
const VOCAB_CHUNK: usize = 2048;
/// Rows per GEMM, bounding the per-task logits buffer (`ROWS × VOCAB_CHUNK` floats, 8 MiB):
/// taller blocks pack each vocabulary chunk of the head fewer times (measured: about 5% less
/// head time than 256 at context 4096).
const ROWS: usize = 1024;

#[derive(Clone, Copy)]
struct Partial {
    max: f32,
    sum: f32,
    target: f32,
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
pub fn logprobs(
    h: &[f32],
    d: usize,
    w: &[f32],
    vocab: usize,
    targets: &[u32],
    out: &mut [f32],
) -> Result<(), NonFiniteLogit> {
    let rows = targets.len();
    assert_eq!(h.len(), rows * d);
    assert_eq!(w.len(), vocab * d);
    assert_eq!(out.len(), rows);
    let chunks: Vec<usize> = (0..vocab).step_by(VOCAB_CHUNK).collect();
    // partials[chunk][row], or the chunk's first non-finite logit.
    let partials: Vec<Result<Vec<Partial>, NonFiniteLogit>> = chunks
        .par_iter()
        .map(|&v0| {
            let vc = VOCAB_CHUNK.min(vocab - v0);
            let mut logits = vec![0.0f32; ROWS.min(rows) * vc];
            let mut part = Vec::with_capacity(rows);
            for r0 in (0..rows).step_by(ROWS) {
                let r = ROWS.min(rows - r0);
                let hb = &h[r0 * d..(r0 + r) * d];
                let lg = &mut logits[..r * vc];
                // SAFETY: `hb` is dense [r, d]; rows v0..v0+vc of `w` are dense [vc, d]; `lg`
                // is dense [r, vc] and owned by this task. All in bounds.
                unsafe {
                    sgemm_block(
                        Gemm::configured(),
                        r,
                        d,
                        vc,
                        hb.as_ptr(),
                        w.as_ptr().add(v0 * d),
                        lg.as_mut_ptr(),
                        vc,
                        false,
                    );
                }
                if let Some(i) = find_non_finite(lg) {
                    return Err(NonFiniteLogit {
                        row: r0 + i / vc,
                        token: v0 + i % vc,
                    });
                }
                for (i, row) in lg.chunks_mut(vc).enumerate() {
                    let t = targets[r0 + i] as usize;
                    let target = if (v0..v0 + vc).contains(&t) {
                        row[t - v0]
                    } else {
                        f32::NAN
                    };
                    let max = exp::max(row);
                    let sum = exp::exp_sub_sum(row, max);
                    part.push(Partial { max, sum, target });
                }
            }
            Ok(part)
        })
        .collect();
    // The first bad logit by row, then token, whichever chunk found it.
    if let Some(e) = partials.iter().filter_map(|p| p.as_ref().err()).min() {
        return Err(*e);
    }
    let partials: Vec<Vec<Partial>> = partials
        .into_iter()
        .map(|p| p.unwrap_or_default())
        .collect();
    // Combine each row's chunks in vocabulary order (fixed, whatever the threads did).
    for (i, o) in out.iter_mut().enumerate() {
        let max = partials
            .iter()
            .map(|p| p[i].max)
            .fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f64;
        let mut target = f32::NAN;
        for p in &partials {
            sum += p[i].sum as f64 * ((p[i].max - max) as f64).exp();
            if !p[i].target.is_nan() {
                target = p[i].target;
            }
        }
        *o = ((target - max) as f64 - sum.ln()) as f32;
    }
    Ok(())
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
