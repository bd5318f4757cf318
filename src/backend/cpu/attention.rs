//! Causal grouped-query attention over one window.
//!
//! Shapes: `q[T, Hq, D]`, `k[T, Hkv, D]`, `v[T, Hkv, D]` (keys and values already passed
//! through the Main KV representation), output `o[T, Hq, D]`. Query head `h` reads KV head
//! `h / (Hq / Hkv)`. Scores and the weighted sum go through the packed GEMM, the softmax
//! subtracts the row maximum, and each output tile is computed by one task with shapes
//! that do not depend on the thread count, so neither do the bits.

use rayon::prelude::*;

pub struct AttnShape {
    pub tokens: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Query rows per task. Fixed: it defines each GEMM's shape, so it is part of the
/// numerical definition (the thread count is not).
const Q_BLOCK: usize = 64;

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: tasks write disjoint (query block, head) tiles of the output through this pointer.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// Causal GQA attention, one task per (query head, block of `Q_BLOCK` queries): scores
/// `S = Q Kᵀ / sqrt(D)` for the block against every key up to its last query (one GEMM),
/// a masked row softmax, then `O = P V` (one GEMM). Only a `Q_BLOCK × T` score tile exists
/// per task, never the full `T × T` matrix.
pub fn causal_attention(q: &[f32], k: &[f32], v: &[f32], s: &AttnShape, o: &mut [f32]) {
    let (t_len, hq, hkv, d) = (s.tokens, s.q_heads, s.kv_heads, s.head_dim);
    assert_eq!(q.len(), t_len * hq * d);
    assert_eq!(k.len(), t_len * hkv * d);
    assert_eq!(v.len(), t_len * hkv * d);
    assert_eq!(o.len(), t_len * hq * d);
    let group = hq / hkv;
    let scale = 1.0 / (d as f32).sqrt();
    let blocks = t_len.div_ceil(Q_BLOCK);
    let out = SendPtr(o.as_mut_ptr());
    (0..hq * blocks).into_par_iter().for_each_init(
        || vec![0.0f32; Q_BLOCK * t_len],
        |scores, task| {
            let out = out;
            let (h, b) = (task / blocks, task % blocks);
            let kh = h / group;
            let q0 = b * Q_BLOCK;
            let q1 = (q0 + Q_BLOCK).min(t_len);
            let (rows, keys) = (q1 - q0, q1);
            let sc = &mut scores[..rows * keys];
            // SAFETY: Q rows q0..q1 of head h are read with row stride hq·d; K rows 0..keys of
            // KV head kh as a [d, keys] transpose view with column stride hkv·d; `sc` is dense
            // [rows, keys]. All within the asserted buffer sizes.
            unsafe {
                matrixmultiply::sgemm(
                    rows,
                    d,
                    keys,
                    scale,
                    q.as_ptr().add((q0 * hq + h) * d),
                    (hq * d) as isize,
                    1,
                    k.as_ptr().add(kh * d),
                    1,
                    (hkv * d) as isize,
                    0.0,
                    sc.as_mut_ptr(),
                    keys as isize,
                    1,
                );
            }
            for (r, row) in sc.chunks_mut(keys).enumerate() {
                let visible = q0 + r + 1; // keys 0..=i
                let (live, masked) = row.split_at_mut(visible);
                let max = live.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0f32;
                for x in live.iter_mut() {
                    *x = (*x - max).exp();
                    sum += *x;
                }
                let inv = 1.0 / sum;
                for x in live.iter_mut() {
                    *x *= inv;
                }
                masked.fill(0.0);
            }
            // SAFETY: `sc` is [rows, keys]; V rows 0..keys of KV head kh have row stride
            // hkv·d; the output tile (rows q0..q1, head h) has row stride hq·d and belongs
            // to this task alone.
            unsafe {
                matrixmultiply::sgemm(
                    rows,
                    keys,
                    d,
                    1.0,
                    sc.as_ptr(),
                    keys as isize,
                    1,
                    v.as_ptr().add(kh * d),
                    (hkv * d) as isize,
                    1,
                    0.0,
                    out.0.add((q0 * hq + h) * d),
                    (hq * d) as isize,
                    1,
                );
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
        for t in [1, 9, 64, 150] {
            let s = AttnShape { tokens: t, q_heads: 6, kv_heads: 2, head_dim: 12 };
            let gen = |n: usize, seed: usize| -> Vec<f32> {
                (0..n).map(|i| (((i + seed) * 2654435761usize) % 1000) as f32 / 500.0 - 1.0).collect()
            };
            let q = gen(t * 6 * 12, 1);
            let k = gen(t * 2 * 12, 2);
            let v = gen(t * 2 * 12, 3);
            let mut o = vec![0.0; q.len()];
            causal_attention(&q, &k, &v, &s, &mut o);
            let want = naive(&q, &k, &v, &s);
            for (a, b) in o.iter().zip(&want) {
                assert!((*a as f64 - b).abs() < 1e-5, "T={t}: {a} vs {b}");
            }
        }
    }
}
