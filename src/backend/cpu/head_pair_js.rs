//! A paired head's second sweep: the Jensen–Shannon divergence and the top-5 / top-10
//! overlap of the run's and the reference's distributions at every row.
//!
//! KL divergence folds into running sums chunk by chunk ([`super::head_pair`]); the
//! Jensen–Shannon divergence does not, because its mixture `m = (p + q) / 2` needs both
//! distributions normalized, and the normalizers are known only after the whole vocabulary.
//! So a paired head sweeps the vocabulary twice: the first sweep gives each row's
//! log-sum-exp on both sides, this one multiplies the same chunks again (the logits are not
//! kept: that would be `rows × vocab` floats) and sums, per entry, with `d = ln(q/p)`,
//!
//! ```text
//!   p·ln(p/m) + q·ln(q/m) = max(p, q) · H(−|d|),   H(x) = −g(x) + eˣ·(x − g(x)),
//!   g(x) = ln((1 + eˣ) / 2)
//! ```
//!
//! (`JS = ½ Σ`). `H ≥ 0` and `H ≤ ln 2`, so the sum has no cancellation; near `x = 0`, where
//! the closed form would cancel to `x²/4`, `H` is its Taylor series (through `x⁸`, below
//! 2e-8 relative truncation for `|x| < ½`). `d` is taken as `(l_ref − l_run) − (lse_ref −
//! lse_run)`, the normalizers' difference in f64, so identical rows give exactly 0 and close
//! ones keep their digits. The same sweep keeps each side's ten largest logits (ties to the
//! lower id) and counts how many of the run's top 5 and top 10 are among the reference's.
//! CUDA twin: `head_pair_js` in `kernels/head.cu`.

use super::exp;
use super::head::{logits_block, NonFiniteLogit, ROWS, VOCAB_CHUNK};
use super::head_pair::Side;
use super::operand::WeightRows;
use rayon::prelude::*;

/// The longest top list compared (top-5 uses its first five).
pub const TOP_K: usize = 10;

/// Below this `|x|`, `H` is its series.
const SERIES_BELOW: f32 = 0.5;

/// `H(x)` for `x ≤ 0` (see the module documentation), branch-free so the loop vectorizes.
#[inline(always)]
pub fn js_weight(x: f32) -> f32 {
    // x²·(1/4 + x/8 + x²/32 + x³/192 + x⁴/1152 + x⁵/5760 + x⁶/46080)
    let series = x
        * x
        * (0.25
            + x * (0.125
                + x * (1.0 / 32.0
                    + x * (1.0 / 192.0
                        + x * (1.0 / 1152.0 + x * (1.0 / 5760.0 + x * (1.0 / 46080.0)))))));
    // ln(1 + e) = 2·atanh(s), s = e / (2 + e) ≤ 0.233 for x ≤ −½: seven odd terms.
    let e = exp::exp(x);
    let s = e / (2.0 + e);
    let s2 = s * s;
    let atanh = s
        * (1.0
            + s2 * (1.0 / 3.0
                + s2 * (1.0 / 5.0
                    + s2 * (1.0 / 7.0
                        + s2 * (1.0 / 9.0 + s2 * (1.0 / 11.0 + s2 * (1.0 / 13.0)))))));
    let g = 2.0 * atanh - std::f32::consts::LN_2;
    let closed = -g + e * (x - g);
    if x > -SERIES_BELOW {
        series
    } else {
        closed
    }
}

/// One entry's `max(p, q)·H(−|d|)`.
#[inline(always)]
fn js_term(x: f32, y: f32, lse_a: f32, lse_b: f32, c: f32) -> f32 {
    let d = (y - x) - c;
    let base = exp::exp((x - lse_a).max(y - lse_b));
    base * js_weight(-d.abs())
}

/// `½ Σ_j max(p_j, q_j)·H(−|d_j|)` over one chunk: `a` the run's logits, `b` the
/// reference's (or its log-probabilities, with `lse_b = 0`), `lse_a`, `lse_b` each side's
/// log-sum-exp over the whole vocabulary and `c = lse_b − lse_a` (rounded once from f64).
#[multiversion::multiversion(targets("x86_64+avx512f+avx2+fma", "x86_64+avx2+fma"))]
pub fn js_chunk(a: &[f32], b: &[f32], lse_a: f32, lse_b: f32, c: f32) -> f64 {
    assert_eq!(a.len(), b.len());
    // Terms first, in a plain loop the compiler vectorizes, then their sum in f64 lanes
    // (measured: 0.9 ns an entry, against 6 ns with the terms summed as they come).
    let mut t = [0.0f32; 256];
    let mut acc = [0.0f64; 8];
    let mut s = 0.0f64;
    for (x, y) in a.chunks(256).zip(b.chunks(256)) {
        let t = &mut t[..x.len()];
        for ((t, &x), &y) in t.iter_mut().zip(x).zip(y) {
            *t = js_term(x, y, lse_a, lse_b, c);
        }
        let tc = t.chunks_exact(8);
        for &v in tc.remainder() {
            s += v as f64;
        }
        for v in tc {
            for i in 0..8 {
                acc[i] += v[i] as f64;
            }
        }
    }
    let lanes = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    0.5 * (lanes + s)
}

/// The `TOP_K` largest values seen, largest first, ties to the lower id; empty slots are
/// `(−∞, u32::MAX)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TopK {
    pub value: [f32; TOP_K],
    pub id: [u32; TOP_K],
}

impl Default for TopK {
    fn default() -> Self {
        TopK {
            value: [f32::NEG_INFINITY; TOP_K],
            id: [u32::MAX; TOP_K],
        }
    }
}

/// `(v, i)` ranks before `(w, j)`: larger value, then lower id.
fn before(v: f32, i: u32, w: f32, j: u32) -> bool {
    v > w || (v == w && i < j)
}

impl TopK {
    /// Adds `row[j]` as id `v0 + j`, for every `j` (finite values). Eight entries at a
    /// time are first tested against the list's last value in one branch-free pass: most
    /// blocks hold nothing that enters.
    pub fn scan(&mut self, row: &[f32], v0: usize) {
        for (b, block) in row.chunks(8).enumerate() {
            let last = self.value[TOP_K - 1];
            if !block.iter().fold(false, |any, &v| any | (v >= last)) {
                continue;
            }
            for (j, &v) in block.iter().enumerate() {
                self.insert(v, (v0 + 8 * b + j) as u32);
            }
        }
    }

    fn insert(&mut self, v: f32, id: u32) {
        if !before(v, id, self.value[TOP_K - 1], self.id[TOP_K - 1]) {
            return;
        }
        let mut k = TOP_K - 1;
        while k > 0 && before(v, id, self.value[k - 1], self.id[k - 1]) {
            self.value[k] = self.value[k - 1];
            self.id[k] = self.id[k - 1];
            k -= 1;
        }
        self.value[k] = v;
        self.id[k] = id;
    }

    /// The `TOP_K` best of both lists.
    pub fn merge(&self, o: &TopK) -> TopK {
        let mut out = TopK::default();
        let (mut i, mut j) = (0, 0);
        for k in 0..TOP_K {
            if before(o.value[j], o.id[j], self.value[i], self.id[i]) {
                (out.value[k], out.id[k]) = (o.value[j], o.id[j]);
                j += 1;
            } else {
                (out.value[k], out.id[k]) = (self.value[i], self.id[i]);
                i += 1;
            }
        }
        out
    }
}

/// How many of the run's first `k` ids are among the reference's first `k`.
pub fn overlap(run: &TopK, reference: &TopK, k: usize) -> u8 {
    let r = &reference.id[..k];
    run.id[..k]
        .iter()
        .filter(|&&i| i != u32::MAX && r.contains(&i))
        .count() as u8
}

/// What the second sweep gives for one row.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Spread {
    /// Jensen–Shannon divergence, nats (at most ln 2).
    pub js: f64,
    pub top: TopK,
    pub top_ref: TopK,
}

/// The reference side of the second sweep.
#[derive(Clone, Copy)]
pub enum RefSide<'a> {
    /// Its rows `[rows, d_ref]` through its head `[vocab, d_ref]`.
    Rows(&'a [f32], usize, WeightRows<'a>),
    /// Another engine's log-probabilities `[rows, vocab]` (normalizer 0).
    Logprobs(&'a [f32]),
}

/// The second sweep over `h[rows, d]` through `w[vocab, d]` and the reference, given each
/// row's `(lse_run, lse_ref)` from the first: one [`Spread`] per row. Chunks and row
/// blocks as the first sweep's, combined in vocabulary order.
pub fn spread(
    (h, d, w): (&[f32], usize, WeightRows),
    reference: RefSide,
    vocab: usize,
    lse: &[(f64, f64)],
) -> Result<Vec<Spread>, (Side, NonFiniteLogit)> {
    let rows = lse.len();
    let chunks: Vec<usize> = (0..vocab).step_by(VOCAB_CHUNK).collect();
    let parts: Vec<Result<Vec<Spread>, (Side, NonFiniteLogit)>> = chunks
        .par_iter()
        .map(|&v0| {
            let vc = VOCAB_CHUNK.min(vocab - v0);
            let mut lg = vec![0.0f32; ROWS.min(rows) * vc];
            let mut lg_ref = match reference {
                RefSide::Rows(..) => vec![0.0f32; ROWS.min(rows) * vc],
                RefSide::Logprobs(_) => Vec::new(),
            };
            let mut part = Vec::with_capacity(rows);
            for r0 in (0..rows).step_by(ROWS) {
                let r = ROWS.min(rows - r0);
                let a = &mut lg[..r * vc];
                logits_block(h, d, w, v0, vc, r0, r, a).map_err(|e| (Side::Run, e))?;
                if let RefSide::Rows(h_ref, d_ref, w_ref) = reference {
                    logits_block(h_ref, d_ref, w_ref, v0, vc, r0, r, &mut lg_ref[..r * vc])
                        .map_err(|e| (Side::Reference, e))?;
                }
                for (i, x) in a.chunks(vc).enumerate() {
                    let row = r0 + i;
                    let (y, lse_b) = match reference {
                        RefSide::Rows(..) => (&lg_ref[i * vc..(i + 1) * vc], lse[row].1),
                        RefSide::Logprobs(lp) => {
                            (&lp[row * vocab + v0..row * vocab + v0 + vc], 0.0)
                        }
                    };
                    let lse_a = lse[row].0;
                    let c = (lse_b - lse_a) as f32;
                    let mut s = Spread {
                        js: js_chunk(x, y, lse_a as f32, lse_b as f32, c),
                        ..Spread::default()
                    };
                    s.top.scan(x, v0);
                    s.top_ref.scan(y, v0);
                    part.push(s);
                }
            }
            Ok(part)
        })
        .collect();
    if let Some(e) = parts.iter().filter_map(|p| p.as_ref().err()).min() {
        return Err(*e);
    }
    let parts: Vec<Vec<Spread>> = parts.into_iter().map(|p| p.unwrap_or_default()).collect();
    Ok((0..rows)
        .map(|i| {
            parts.iter().fold(Spread::default(), |acc, c| Spread {
                js: acc.js + c[i].js,
                top: acc.top.merge(&c[i].top),
                top_ref: acc.top_ref.merge(&c[i].top_ref),
            })
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `H` against float64's closed form, on both sides of the switch to the series and far
    /// out; the series' own accuracy near 0 against float64's series.
    #[test]
    fn the_weight_matches_float64() {
        let exact = |x: f64| {
            let g = ((1.0 + x.exp()) / 2.0).ln();
            -g + x.exp() * (x - g)
        };
        for i in 0..4000 {
            let x = -(i as f64) * 0.01;
            let (got, want) = (js_weight(x as f32) as f64, exact(x));
            // f64's closed form itself cancels near 0: compare there with the series.
            let want = if x > -0.05 {
                x * x / 4.0 + x * x * x / 8.0 + x.powi(4) / 32.0
            } else {
                want
            };
            assert!(
                (got - want).abs() <= 2e-6 * want.abs() + 1e-30,
                "H({x}) = {got} vs {want}"
            );
        }
        assert_eq!(js_weight(0.0), 0.0);
        assert_eq!(js_weight(-200.0), std::f32::consts::LN_2);
    }

    #[test]
    fn top_lists_keep_the_largest_and_the_lower_id_on_ties() {
        let row: Vec<f32> = (0..40).map(|i| ((i * 7) % 13) as f32).collect();
        let mut a = TopK::default();
        a.scan(&row[..20], 0);
        let mut b = TopK::default();
        b.scan(&row[20..], 20);
        let mut all = TopK::default();
        all.scan(&row, 0);
        assert_eq!(a.merge(&b), all);
        let mut want: Vec<(f32, u32)> = row
            .iter()
            .enumerate()
            .map(|(i, &v)| (v, i as u32))
            .collect();
        want.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
        assert_eq!(
            all.id.to_vec(),
            want[..TOP_K].iter().map(|x| x.1).collect::<Vec<_>>()
        );
        let mut short = TopK::default();
        short.scan(&[1.0, 2.0], 5);
        assert_eq!((short.id[0], short.id[1], short.id[2]), (6, 5, u32::MAX));
        assert_eq!(overlap(&short, &short, 10), 2);
        assert_eq!(overlap(&all, &all, 5), 5);
    }
}
