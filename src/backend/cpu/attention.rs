//! Causal grouped-query attention over one window.
//!
//! Shapes: `q[T, Hq, D]`, `k[T, Hkv, D]`, `v[T, Hkv, D]` (keys and values already passed
//! through the Main KV representation), output `o[T, Hq, D]`. Query head `h` reads KV head
//! `h / (Hq / Hkv)`.
//!
//! Work is cut into tasks of (KV head, block of `Q_BLOCK` query positions). A task gathers
//! the queries of every query head sharing that KV head into one matrix `Qg[(t, g), D]`, so
//! each key and value block is packed once for the whole group, and walks the keys in
//! blocks of `K_BLOCK` with an online softmax (the flash-attention recurrence): per key
//! block, `S = Qg Kᵀ / sqrt(D)` (one GEMM), a running row maximum and sum of exponentials,
//! and `O = O·e^(m_old - m_new) + P V` (one GEMM). Only a `(Q_BLOCK·group) × K_BLOCK` score
//! tile exists per task, small enough to stay in L2 at any context length, and key blocks
//! entirely in a block's future are never touched.
//!
//! Both block sizes are fixed constants and every task's arithmetic is sequential, so the
//! bits depend on neither the thread count nor the scheduling. Block sizes were chosen with
//! `cargo bench --bench ops -- --only attention --context 4096` on a 2-core AVX2 machine
//! (Q_BLOCK 128 / K_BLOCK 512 was best among 32-256 / 256-1024).

use super::exp;
use rayon::prelude::*;

pub struct AttnShape {
    pub tokens: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Query positions per task.
const Q_BLOCK: usize = 128;
/// Keys per online-softmax step. Part of the numerical definition (it fixes where the
/// running maximum is updated); a multiple of `Q_BLOCK`, so every row of a task sees at
/// least one key in every key block the task visits.
const K_BLOCK: usize = 512;
const _: () = assert!(K_BLOCK % Q_BLOCK == 0);

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: tasks write disjoint (query block, KV head group) tiles of the output.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// Per-task scratch, reused across the tasks a worker runs.
struct Scratch {
    /// Qg[rows, D]
    qg: Vec<f32>,
    /// S / P[rows, K_BLOCK]
    scores: Vec<f32>,
    /// O[rows, D], unnormalized
    og: Vec<f32>,
    /// running row maximum and sum of exponentials, [rows]
    m: Vec<f32>,
    l: Vec<f32>,
}

/// Attention outputs for query positions `from..T` (and for the rest of the query block
/// that holds `from`); rows of `o` before that block are left untouched. `from = 0` computes
/// every row. A row's bits do not depend on `from`.
pub fn causal_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: &AttnShape,
    from: usize,
    o: &mut [f32],
) {
    let (t_len, hq, hkv, d) = (s.tokens, s.q_heads, s.kv_heads, s.head_dim);
    assert_eq!(q.len(), t_len * hq * d);
    assert_eq!(k.len(), t_len * hkv * d);
    assert_eq!(v.len(), t_len * hkv * d);
    assert_eq!(o.len(), t_len * hq * d);
    let group = hq / hkv;
    let scale = 1.0 / (d as f32).sqrt();
    let blocks = t_len.div_ceil(Q_BLOCK);
    let first_block = from.min(t_len) / Q_BLOCK;
    let max_rows = Q_BLOCK * group;
    let out = SendPtr(o.as_mut_ptr());
    let tasks = hkv * (blocks - first_block);
    (0..tasks).into_par_iter().for_each_init(
        || Scratch {
            qg: vec![0.0; max_rows * d],
            scores: vec![0.0; max_rows * K_BLOCK],
            og: vec![0.0; max_rows * d],
            m: vec![0.0; max_rows],
            l: vec![0.0; max_rows],
        },
        |sc, task| {
            let out = out;
            // Later query blocks first: they have the most keys, and starting with them
            // balances the load (the order does not affect any task's result).
            let task = tasks - 1 - task;
            let (kh, b) = (task % hkv, first_block + task / hkv);
            let q0 = b * Q_BLOCK;
            let q1 = (q0 + Q_BLOCK).min(t_len);
            let rows = (q1 - q0) * group;
            // Qg[(t, g)] = q[q0 + t, kh·group + g]: for each position the group's heads are
            // already adjacent in `q`, so this is one contiguous copy per position.
            for t in q0..q1 {
                let src = &q[(t * hq + kh * group) * d..(t * hq + (kh + 1) * group) * d];
                sc.qg[(t - q0) * group * d..(t - q0 + 1) * group * d].copy_from_slice(src);
            }
            let og = &mut sc.og[..rows * d];
            og.fill(0.0);
            let (m, l) = (&mut sc.m[..rows], &mut sc.l[..rows]);
            m.fill(f32::NEG_INFINITY);
            l.fill(0.0);
            for kb0 in (0..q1).step_by(K_BLOCK) {
                let nk = K_BLOCK.min(q1 - kb0);
                let p = &mut sc.scores[..rows * nk];
                // SAFETY: `qg` is dense [rows, d]; K rows kb0..kb0+nk of KV head kh are read
                // as a [d, nk] transpose view with column stride hkv·d; `p` is dense
                // [rows, nk]. All in bounds: kb0 + nk <= q1 <= T.
                unsafe {
                    matrixmultiply::sgemm(
                        rows,
                        d,
                        nk,
                        scale,
                        sc.qg.as_ptr(),
                        d as isize,
                        1,
                        k.as_ptr().add((kb0 * hkv + kh) * d),
                        1,
                        (hkv * d) as isize,
                        0.0,
                        p.as_mut_ptr(),
                        nk as isize,
                        1,
                    );
                }
                for (r, row) in p.chunks_mut(nk).enumerate() {
                    // Position q0 + r/group sees keys 0..=q0 + r/group.
                    let visible = (q0 + r / group + 1 - kb0).min(nk);
                    let (live, masked) = row.split_at_mut(visible);
                    let m_new = m[r].max(exp::max(live));
                    let sum = exp::exp_sub_sum(live, m_new);
                    masked.fill(0.0);
                    if m[r] == f32::NEG_INFINITY {
                        l[r] = sum;
                    } else {
                        let alpha = exp::exp(m[r] - m_new);
                        l[r] = l[r] * alpha + sum;
                        og[r * d..(r + 1) * d].iter_mut().for_each(|x| *x *= alpha);
                    }
                    m[r] = m_new;
                }
                // `og = 1·og + 1·(P V)`. The `gemm` crate runs this thin product (64 output
                // columns, up to K_BLOCK deep) about 10% faster than `matrixmultiply`
                // (`cargo bench --bench ops -- --only attention --context 4096`); its
                // blocking depends only on the shape, which is fixed per task.
                // SAFETY: `p` is dense [rows, nk] (column stride 1, row stride nk); V rows
                // kb0..kb0+nk of KV head kh are [nk, d] with column stride 1 and row stride
                // hkv·d; `og` is dense [rows, d]. All in bounds: kb0 + nk <= T.
                unsafe {
                    gemm::gemm(
                        rows,
                        d,
                        nk,
                        og.as_mut_ptr(),
                        1,
                        d as isize,
                        true,
                        p.as_ptr(),
                        1,
                        nk as isize,
                        v.as_ptr().add((kb0 * hkv + kh) * d),
                        1,
                        (hkv * d) as isize,
                        1.0f32,
                        1.0f32,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
            }
            for (r, row) in og.chunks_mut(d).enumerate() {
                let inv = 1.0 / l[r];
                row.iter_mut().for_each(|x| *x *= inv);
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
        for t in [1, 9, 64, 65, 128, 300, 513, 1100] {
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
            causal_attention(&q, &k, &v, &s, 0, &mut o);
            let want = naive(&q, &k, &v, &s);
            for (a, b) in o.iter().zip(&want) {
                assert!((*a as f64 - b).abs() < 1e-5, "T={t}: {a} vs {b}");
            }
            // Skipping early queries leaves the later rows' bits unchanged.
            let from = t * 2 / 3;
            let mut part = vec![f32::NAN; q.len()];
            causal_attention(&q, &k, &v, &s, from, &mut part);
            let row = 6 * 12;
            assert!(
                o[from * row..]
                    .iter()
                    .zip(&part[from * row..])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "T={t}, from {from}"
            );
        }
    }
}
