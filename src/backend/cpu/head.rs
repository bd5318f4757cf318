//! The output head fused with log-softmax and the target gather.
//!
//! For each scored row `h[r]` (already final-normed) and its target id, returns
//! `log p(target) = logit[target] - logsumexp(logits)`. The vocabulary is processed in
//! chunks with an online max/sum, so a window never materializes its full `[rows, vocab]`
//! logits; row blocks run in parallel and each row's reduction has a fixed order.

use rayon::prelude::*;

/// Vocabulary entries per chunk.
const VOCAB_CHUNK: usize = 4096;
/// Rows per parallel task.
const ROW_BLOCK: usize = 16;

/// `h[rows, d]`, `w[vocab, d]`, `targets[rows]` -> `out[rows]` log-probabilities.
pub fn logprobs(h: &[f32], d: usize, w: &[f32], vocab: usize, targets: &[u32], out: &mut [f32]) {
    let rows = targets.len();
    assert_eq!(h.len(), rows * d);
    assert_eq!(w.len(), vocab * d);
    assert_eq!(out.len(), rows);
    out.par_chunks_mut(ROW_BLOCK)
        .zip(h.par_chunks(ROW_BLOCK * d))
        .zip(targets.par_chunks(ROW_BLOCK))
        .for_each_init(
            || vec![0.0f32; ROW_BLOCK * VOCAB_CHUNK],
            |buf, ((o, hb), tb)| {
                let r = tb.len();
                let mut max = vec![f32::NEG_INFINITY; r];
                let mut sum = vec![0.0f64; r];
                let mut tlogit = vec![f32::NAN; r];
                let mut v0 = 0;
                while v0 < vocab {
                    let vc = VOCAB_CHUNK.min(vocab - v0);
                    let logits = &mut buf[..r * vc];
                    // SAFETY: `hb` is [r, d], the rows v0..v0+vc of `w` are [vc, d], read as
                    // their transpose, and `logits` is [r, vc]; all in bounds.
                    unsafe {
                        matrixmultiply::sgemm(
                            r,
                            d,
                            vc,
                            1.0,
                            hb.as_ptr(),
                            d as isize,
                            1,
                            w.as_ptr().add(v0 * d),
                            1,
                            d as isize,
                            0.0,
                            logits.as_mut_ptr(),
                            vc as isize,
                            1,
                        );
                    }
                    for i in 0..r {
                        let row = &logits[i * vc..(i + 1) * vc];
                        let t = tb[i] as usize;
                        if (v0..v0 + vc).contains(&t) {
                            tlogit[i] = row[t - v0];
                        }
                        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                        let new_max = max[i].max(m);
                        let mut s = 0.0f32;
                        for &x in row {
                            s += (x - new_max).exp();
                        }
                        sum[i] = sum[i] * ((max[i] - new_max) as f64).exp() + s as f64;
                        max[i] = new_max;
                    }
                    v0 += vc;
                }
                for i in 0..r {
                    o[i] = ((tlogit[i] - max[i]) as f64 - sum[i].ln()) as f32;
                }
            },
        );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_full_log_softmax() {
        let (rows, d, vocab) = (21, 7, 9000);
        let h: Vec<f32> = (0..rows * d).map(|i| ((i * 31) % 17) as f32 / 4.0 - 2.0).collect();
        let w: Vec<f32> = (0..vocab * d).map(|i| ((i * 7919) % 23) as f32 / 6.0 - 2.0).collect();
        let targets: Vec<u32> = (0..rows).map(|i| ((i * 4513) % vocab) as u32).collect();
        let mut out = vec![0.0; rows];
        logprobs(&h, d, &w, vocab, &targets, &mut out);
        for i in 0..rows {
            let logits: Vec<f64> = (0..vocab)
                .map(|v| (0..d).map(|x| h[i * d + x] as f64 * w[v * d + x] as f64).sum())
                .collect();
            let m = logits.iter().cloned().fold(f64::MIN, f64::max);
            let lse = m + logits.iter().map(|l| (l - m).exp()).sum::<f64>().ln();
            let want = logits[targets[i] as usize] - lse;
            assert!((out[i] as f64 - want).abs() < 1e-4, "{} vs {want}", out[i]);
        }
    }
}
