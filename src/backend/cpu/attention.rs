//! Causal grouped-query attention over one window.
//!
//! Shapes: `q[T, Hq, D]`, `k[T, Hkv, D]`, `v[T, Hkv, D]` (keys and values already passed
//! through the Main KV representation), output `o[T, Hq, D]`. Query head `h` reads KV head
//! `h / (Hq / Hkv)`. Scores and the weighted sum go through the packed GEMM, the softmax
//! subtracts the row maximum, and each output tile is computed by one task with shapes
//! that do not depend on the thread count, so neither do the bits.

use super::exp;
use rayon::prelude::*;

pub struct AttnShape {
    pub tokens: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Query positions per task. Fixed: it defines each GEMM's shape, so it is part of the
/// numerical definition (the thread count is not).
const Q_BLOCK: usize = 128;

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: tasks write disjoint (query block, KV head group) tiles of the output.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// Causal GQA attention, one task per (KV head, block of `Q_BLOCK` query positions). The
/// task gathers the block's queries of every query head sharing that KV head into one
/// matrix `Qg[(t, g), D]`, so keys and values are packed once for the whole group:
/// `S = Qg Kᵀ / sqrt(D)` against every key up to the block's last position (one GEMM), a
/// masked row softmax, then `O = P V` (one GEMM), scattered back to `o`. Only a
/// `(Q_BLOCK·group) × T` score tile exists per task, never the full `T × T` matrix.
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
    (0..hkv * blocks).into_par_iter().for_each_init(
        || {
            (
                vec![0.0f32; Q_BLOCK * group * d],
                vec![0.0f32; Q_BLOCK * group * t_len],
                vec![0.0f32; Q_BLOCK * group * d],
            )
        },
        |(qg, scores, og), task| {
            let out = out;
            let (kh, b) = (task / blocks, task % blocks);
            let q0 = b * Q_BLOCK;
            let q1 = (q0 + Q_BLOCK).min(t_len);
            let rows = (q1 - q0) * group;
            let keys = q1;
            // Qg[(t, g)] = q[q0 + t, kh·group + g]: for each position the group's heads are
            // already adjacent in `q`, so this is one contiguous copy per position.
            for t in q0..q1 {
                let src = &q[(t * hq + kh * group) * d..(t * hq + (kh + 1) * group) * d];
                qg[(t - q0) * group * d..(t - q0 + 1) * group * d].copy_from_slice(src);
            }
            let sc = &mut scores[..rows * keys];
            // SAFETY: `qg` is dense [rows, d]; K rows 0..keys of KV head kh are read as a
            // [d, keys] transpose view with column stride hkv·d; `sc` is dense [rows, keys].
            unsafe {
                matrixmultiply::sgemm(
                    rows,
                    d,
                    keys,
                    scale,
                    qg.as_ptr(),
                    d as isize,
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
                let visible = q0 + r / group + 1; // position t sees keys 0..=t
                let (live, masked) = row.split_at_mut(visible);
                let max = exp::max(live);
                let inv = 1.0 / exp::exp_sub_sum(live, max);
                for x in live.iter_mut() {
                    *x *= inv;
                }
                masked.fill(0.0);
            }
            // SAFETY: `sc` is [rows, keys]; V rows 0..keys of KV head kh have row stride
            // hkv·d; `og` is dense [rows, d].
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
                    og.as_mut_ptr(),
                    d as isize,
                    1,
                );
            }
            for t in q0..q1 {
                let src = &og[(t - q0) * group * d..(t - q0 + 1) * group * d];
                // SAFETY: positions q0..q1 × heads of KV group kh are written by this task
                // only; the range lies inside `o` ([T, Hq, D]).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.as_ptr(),
                        out.0.add((t * hq + kh * group) * d),
                        group * d,
                    );
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
                    .map(|j| {
                        (0..d)
                            .map(|x| {
                                q[(i * hq + h) * d + x] as f64 * k[(j * hkv + kh) * d + x] as f64
                            })
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
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
        for t in [1, 9, 128, 300] {
            let s = AttnShape {
                tokens: t,
                q_heads: 6,
                kv_heads: 2,
                head_dim: 12,
            };
            let gen = |n: usize, seed: usize| -> Vec<f32> {
                (0..n)
                    .map(|i| (((i + seed) * 2654435761usize) % 1000) as f32 / 500.0 - 1.0)
                    .collect()
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
