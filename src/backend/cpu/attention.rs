//! Causal grouped-query attention over one window.
//!
//! Shapes: `q[T, Hq, D]`, `k[T, Hkv, D]`, `v[T, Hkv, D]` (keys and values already passed
//! through the Main KV representation), output `o[T, Hq, D]`. Query head `h` reads KV head
//! `h / (Hq / Hkv)`. Scores are formed in f32 with a fixed order; the softmax subtracts
//! the row maximum; each query row is computed by one task, so the thread count does not
//! change any bit.

use rayon::prelude::*;

pub struct AttnShape {
    pub tokens: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent partial sums (vectorizes well), combined in a fixed order.
    let mut acc = [0.0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

pub fn causal_attention(q: &[f32], k: &[f32], v: &[f32], s: &AttnShape, o: &mut [f32]) {
    let (t_len, hq, hkv, d) = (s.tokens, s.q_heads, s.kv_heads, s.head_dim);
    assert_eq!(q.len(), t_len * hq * d);
    assert_eq!(k.len(), t_len * hkv * d);
    assert_eq!(v.len(), t_len * hkv * d);
    assert_eq!(o.len(), t_len * hq * d);
    let group = hq / hkv;
    let scale = 1.0 / (d as f32).sqrt();
    o.par_chunks_mut(hq * d).enumerate().for_each_init(
        || vec![0.0f32; t_len],
        |scores, (i, orow)| {
            for h in 0..hq {
                let kh = h / group;
                let qv = &q[(i * hq + h) * d..(i * hq + h + 1) * d];
                let sc = &mut scores[..=i];
                let mut max = f32::NEG_INFINITY;
                for (j, sj) in sc.iter_mut().enumerate() {
                    let kv = &k[(j * hkv + kh) * d..(j * hkv + kh + 1) * d];
                    *sj = dot(qv, kv) * scale;
                    max = max.max(*sj);
                }
                let mut sum = 0.0f32;
                for sj in sc.iter_mut() {
                    *sj = (*sj - max).exp();
                    sum += *sj;
                }
                let inv = 1.0 / sum;
                let out = &mut orow[h * d..(h + 1) * d];
                out.fill(0.0);
                for (j, &p) in sc.iter().enumerate() {
                    let vv = &v[(j * hkv + kh) * d..(j * hkv + kh + 1) * d];
                    let w = p * inv;
                    for (a, &b) in out.iter_mut().zip(vv) {
                        *a += w * b;
                    }
                }
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Straightforward f64 attention, the test's own reference.
    fn naive(q: &[f32], k: &[f32], v: &[f32], s: &AttnShape) -> Vec<f64> {
        let (t, hq, hkv, d) = (s.tokens, s.q_heads, s.kv_heads, s.head_dim);
        let mut o = vec![0.0; t * hq * d];
        for i in 0..t {
            for h in 0..hq {
                let kh = h * hkv / hq;
                let sc: Vec<f64> = (0..=i)
                    .map(|j| (0..d).map(|x| q[(i * hq + h) * d + x] as f64 * k[(j * hkv + kh) * d + x] as f64).sum::<f64>() / (d as f64).sqrt())
                    .collect();
                let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for j in 0..=i {
                    for x in 0..d {
                        o[(i * hq + h) * d + x] += e[j] / z * v[(j * hkv + kh) * d + x] as f64;
                    }
                }
            }
        }
        o
    }

    #[test]
    fn matches_naive_gqa() {
        let s = AttnShape { tokens: 9, q_heads: 6, kv_heads: 2, head_dim: 12 };
        let gen = |n: usize, seed: usize| -> Vec<f32> { (0..n).map(|i| (((i + seed) * 2654435761usize) % 1000) as f32 / 500.0 - 1.0).collect() };
        let q = gen(9 * 6 * 12, 1);
        let k = gen(9 * 2 * 12, 2);
        let v = gen(9 * 2 * 12, 3);
        let mut o = vec![0.0; q.len()];
        causal_attention(&q, &k, &v, &s, &mut o);
        let want = naive(&q, &k, &v, &s);
        for (a, b) in o.iter().zip(&want) {
            assert!((*a as f64 - b).abs() < 1e-5, "{a} vs {b}");
        }
    }
}
