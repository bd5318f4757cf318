//! The gated delta rule of a Gated DeltaNet layer, over one window.
//!
//! Shapes: `q[T, Hk, Dk]` and `k[T, Hk, Dk]` (already L2-normalized, `q` also scaled by
//! `Dk^-1/2`), `v[T, Hv, Dv]`, `beta[T, Hv]` (in (0, 1)), `g[T, Hv]` (log decay, ≤ 0), output
//! `o[T, Hv, Dv]`. Value head `j` reads key head `j / (Hv / Hk)`. Every value head has a
//! State `S[Dk, Dv]` (f32) that is zero at the start of the window.
//!
//! [`recurrent`] is the specification, one token at a time: `S = exp(g)·S`,
//! `delta = beta·(v − Sᵀk)`, `S = S + k·deltaᵀ`, `o = Sᵀq`. [`chunked`] computes the same
//! function a chunk of [`CHUNK`] tokens at a time (the WY form fast implementations use for
//! prefill): within a chunk the rule is a lower-triangular system solved by forward
//! substitution, and the State is carried from chunk to chunk. It is the production path;
//! the two agree to float32 rounding (tested), not bit for bit.
//!
//! Value heads are independent and each is computed by one task in a fixed order, so the
//! result does not depend on the thread count.

use super::SendPtr;
use rayon::prelude::*;

/// Tokens per chunk of [`chunked`] (a window split between threads would have to cut at a
/// multiple of it).
pub const CHUNK: usize = 64;

/// The sizes of one call.
#[derive(Clone, Copy, Debug)]
pub struct DeltaShape {
    pub tokens: usize,
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
}

impl DeltaShape {
    fn check(&self, q: &[f32], k: &[f32], v: &[f32], beta: &[f32], g: &[f32], o: &[f32]) {
        let (t, hk, hv, dk, dv) = (
            self.tokens,
            self.key_heads,
            self.value_heads,
            self.key_dim,
            self.value_dim,
        );
        assert!(
            hk > 0 && hv % hk == 0,
            "value heads are a multiple of key heads"
        );
        assert_eq!(q.len(), t * hk * dk, "q shape");
        assert_eq!(k.len(), t * hk * dk, "k shape");
        assert_eq!(v.len(), t * hv * dv, "v shape");
        assert_eq!(beta.len(), t * hv, "beta shape");
        assert_eq!(g.len(), t * hv, "g shape");
        assert_eq!(o.len(), t * hv * dv, "o shape");
    }
}

/// One value head's inputs, gathered contiguous: `q, k [T, Dk]`, `v [T, Dv]`, `beta, g [T]`.
struct Head {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    beta: Vec<f32>,
    g: Vec<f32>,
}

fn gather(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    beta: &[f32],
    g: &[f32],
    s: &DeltaShape,
    j: usize,
) -> Head {
    let (t, hk, hv, dk, dv) = (s.tokens, s.key_heads, s.value_heads, s.key_dim, s.value_dim);
    let kh = j / (hv / hk);
    let mut h = Head {
        q: Vec::with_capacity(t * dk),
        k: Vec::with_capacity(t * dk),
        v: Vec::with_capacity(t * dv),
        beta: Vec::with_capacity(t),
        g: Vec::with_capacity(t),
    };
    for i in 0..t {
        h.q.extend_from_slice(&q[(i * hk + kh) * dk..(i * hk + kh + 1) * dk]);
        h.k.extend_from_slice(&k[(i * hk + kh) * dk..(i * hk + kh + 1) * dk]);
        h.v.extend_from_slice(&v[(i * hv + j) * dv..(i * hv + j + 1) * dv]);
        h.beta.push(beta[i * hv + j]);
        h.g.push(g[i * hv + j]);
    }
    h
}

/// Runs `head` (value head `j` → its `[T, Dv]` output) for every value head in parallel and
/// scatters the outputs into `o[T, Hv, Dv]`.
fn per_head(o: &mut [f32], s: &DeltaShape, head: impl Fn(usize) -> Vec<f32> + Sync) {
    let (hv, dv) = (s.value_heads, s.value_dim);
    let out = SendPtr(o.as_mut_ptr());
    (0..hv).into_par_iter().for_each(|j| {
        let oj = head(j);
        for (i, row) in oj.chunks(dv).enumerate() {
            // SAFETY: head j writes o[i, j, ..] only, which no other task touches; the
            // shapes were checked by the caller.
            unsafe {
                std::ptr::copy_nonoverlapping(row.as_ptr(), out.get().add((i * hv + j) * dv), dv)
            };
        }
    });
}

/// The token recurrence (the specification).
pub fn recurrent(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    beta: &[f32],
    g: &[f32],
    s: &DeltaShape,
    o: &mut [f32],
) {
    s.check(q, k, v, beta, g, o);
    let (t, dk, dv) = (s.tokens, s.key_dim, s.value_dim);
    per_head(o, s, |j| {
        let h = gather(q, k, v, beta, g, s, j);
        let mut st = vec![0.0f32; dk * dv]; // S[Dk, Dv]
        let mut out = vec![0.0f32; t * dv];
        let mut delta = vec![0.0f32; dv];
        for i in 0..t {
            let (qi, ki) = (&h.q[i * dk..(i + 1) * dk], &h.k[i * dk..(i + 1) * dk]);
            let vi = &h.v[i * dv..(i + 1) * dv];
            let alpha = h.g[i].exp();
            st.iter_mut().for_each(|x| *x *= alpha);
            // delta = beta·(v − Sᵀk), from the decayed State.
            delta.copy_from_slice(vi);
            for (a, row) in ki.iter().zip(st.chunks(dv)) {
                for (d, &sv) in delta.iter_mut().zip(row) {
                    *d -= a * sv;
                }
            }
            delta.iter_mut().for_each(|d| *d *= h.beta[i]);
            // S += k·deltaᵀ; o = Sᵀq from the updated State.
            let oi = &mut out[i * dv..(i + 1) * dv];
            for ((&a, &b), row) in ki.iter().zip(qi).zip(st.chunks_mut(dv)) {
                for ((sv, &d), o) in row.iter_mut().zip(&delta).zip(oi.iter_mut()) {
                    *sv += a * d;
                    *o += b * *sv;
                }
            }
        }
        out
    });
}

/// The chunked form (the production path; see the module docs).
pub fn chunked(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    beta: &[f32],
    g: &[f32],
    s: &DeltaShape,
    o: &mut [f32],
) {
    s.check(q, k, v, beta, g, o);
    let (t, dk, dv) = (s.tokens, s.key_dim, s.value_dim);
    per_head(o, s, |j| {
        let h = gather(q, k, v, beta, g, s, j);
        let mut st = vec![0.0f32; dk * dv]; // S[Dk, Dv], carried between chunks
        let mut out = vec![0.0f32; t * dv];
        let mut c = ChunkScratch::new(dk, dv);
        for c0 in (0..t).step_by(CHUNK) {
            let c1 = (c0 + CHUNK).min(t);
            chunk(
                &h,
                c0,
                c1,
                dk,
                dv,
                &mut st,
                &mut out[c0 * dv..c1 * dv],
                &mut c,
            );
        }
        out
    });
}

/// Work buffers of one chunk.
struct ChunkScratch {
    /// Cumulative log decay within the chunk, `[n]`.
    gc: Vec<f32>,
    /// The triangular system, `[n, n]`.
    a: Vec<f32>,
    /// `A·(beta·v)` `[n, Dv]` and `A·(beta·k·exp(gc))` `[n, Dk]`.
    u: Vec<f32>,
    w: Vec<f32>,
    /// `u − w·S`, `[n, Dv]`.
    v_new: Vec<f32>,
}

impl ChunkScratch {
    fn new(dk: usize, dv: usize) -> ChunkScratch {
        ChunkScratch {
            gc: vec![0.0; CHUNK],
            a: vec![0.0; CHUNK * CHUNK],
            u: vec![0.0; CHUNK * dv],
            w: vec![0.0; CHUNK * dk],
            v_new: vec![0.0; CHUNK * dv],
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Tokens `c0..c1` of one value head: writes their outputs into `out[n, Dv]` and carries the
/// State `st[Dk, Dv]` past the chunk.
#[allow(clippy::too_many_arguments)]
fn chunk(
    h: &Head,
    c0: usize,
    c1: usize,
    dk: usize,
    dv: usize,
    st: &mut [f32],
    out: &mut [f32],
    c: &mut ChunkScratch,
) {
    let n = c1 - c0;
    let key = |i: usize| &h.k[(c0 + i) * dk..(c0 + i + 1) * dk];
    let query = |i: usize| &h.q[(c0 + i) * dk..(c0 + i + 1) * dk];
    let value = |i: usize| &h.v[(c0 + i) * dv..(c0 + i + 1) * dv];
    let beta = |i: usize| h.beta[c0 + i];
    let mut acc = 0.0f32;
    for i in 0..n {
        acc += h.g[c0 + i];
        c.gc[i] = acc;
    }
    let gc = &c.gc[..n];
    // A[i, j] = −beta_i·(k_i·k_j)·exp(gc_i − gc_j) for j < i, then the forward substitution
    // that turns it into the inverse of the chunk's (I − strictly lower) system, plus I.
    let a = &mut c.a[..n * n];
    for i in 0..n {
        for j in 0..n {
            a[i * n + j] = if j < i {
                -beta(i) * dot(key(i), key(j)) * (gc[i] - gc[j]).exp()
            } else {
                0.0
            };
        }
    }
    let mut row = vec![0.0f32; n];
    for i in 1..n {
        row.copy_from_slice(&a[i * n..(i + 1) * n]);
        for j in 0..i {
            let mut add = 0.0f32;
            for m in j + 1..i {
                add += row[m] * a[m * n + j];
            }
            a[i * n + j] = row[j] + add;
        }
    }
    for i in 0..n {
        a[i * n + i] = 1.0;
    }
    // u = A·(beta·v), w = A·(beta·k·exp(gc)).
    let (u, w) = (&mut c.u[..n * dv], &mut c.w[..n * dk]);
    u.fill(0.0);
    w.fill(0.0);
    for i in 0..n {
        for j in 0..=i {
            let aij = a[i * n + j];
            if aij == 0.0 {
                continue;
            }
            let bv = aij * beta(j);
            for (x, &y) in u[i * dv..(i + 1) * dv].iter_mut().zip(value(j)) {
                *x += bv * y;
            }
            let bk = bv * gc[j].exp();
            for (x, &y) in w[i * dk..(i + 1) * dk].iter_mut().zip(key(j)) {
                *x += bk * y;
            }
        }
    }
    // v_new = u − w·S (the values less what the State carried in already predicts).
    let v_new = &mut c.v_new[..n * dv];
    v_new.copy_from_slice(u);
    for i in 0..n {
        let vi = &mut v_new[i * dv..(i + 1) * dv];
        for (&wk, srow) in w[i * dk..(i + 1) * dk].iter().zip(st.chunks(dv)) {
            for (x, &sv) in vi.iter_mut().zip(srow) {
                *x -= wk * sv;
            }
        }
    }
    // o_i = exp(gc_i)·(q_i·S) + Σ_{j≤i} (q_i·k_j)·exp(gc_i − gc_j)·v_new_j.
    for i in 0..n {
        let oi = &mut out[i * dv..(i + 1) * dv];
        oi.fill(0.0);
        let e = gc[i].exp();
        for (&qv, srow) in query(i).iter().zip(st.chunks(dv)) {
            let qe = qv * e;
            for (x, &sv) in oi.iter_mut().zip(srow) {
                *x += qe * sv;
            }
        }
        for j in 0..=i {
            let p = dot(query(i), key(j)) * (gc[i] - gc[j]).exp();
            for (x, &y) in oi.iter_mut().zip(&v_new[j * dv..(j + 1) * dv]) {
                *x += p * y;
            }
        }
    }
    // S = exp(gc_last)·S + Σ_i (k_i·exp(gc_last − gc_i)) v_new_iᵀ.
    let last = gc[n - 1];
    let decay = last.exp();
    st.iter_mut().for_each(|x| *x *= decay);
    for i in 0..n {
        let f = (last - gc[i]).exp();
        for (&kv, srow) in key(i).iter().zip(st.chunks_mut(dv)) {
            let kf = kv * f;
            for (sv, &y) in srow.iter_mut().zip(&v_new[i * dv..(i + 1) * dv]) {
                *sv += kf * y;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random inputs with the layer's ranges: unit-norm q and k (q scaled), beta in (0, 1),
    /// g ≤ 0.
    fn inputs(s: &DeltaShape, seed: u64) -> [Vec<f32>; 5] {
        let mut x = seed;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32
        };
        let unit = |n: usize, d: usize, scale: f32, rnd: &mut dyn FnMut() -> f32| {
            let mut v: Vec<f32> = (0..n * d).map(|_| rnd() - 0.5).collect();
            for r in v.chunks_mut(d) {
                let norm = r.iter().map(|a| a * a).sum::<f32>().sqrt();
                r.iter_mut().for_each(|a| *a *= scale / norm);
            }
            v
        };
        let (t, hk, hv, dk, dv) = (s.tokens, s.key_heads, s.value_heads, s.key_dim, s.value_dim);
        let q = unit(t * hk, dk, 1.0 / (dk as f32).sqrt(), &mut rnd);
        let k = unit(t * hk, dk, 1.0, &mut rnd);
        let v: Vec<f32> = (0..t * hv * dv).map(|_| 2.0 * rnd() - 1.0).collect();
        let beta: Vec<f32> = (0..t * hv).map(|_| rnd()).collect();
        let g: Vec<f32> = (0..t * hv).map(|_| -0.3 * rnd()).collect();
        [q, k, v, beta, g]
    }

    #[test]
    fn the_chunked_form_computes_the_recurrence() {
        // Partial last chunks, several chunks, value heads sharing key heads (3:1).
        for tokens in [1, 5, 64, 65, 150, 257] {
            let s = DeltaShape {
                tokens,
                key_heads: 2,
                value_heads: 6,
                key_dim: 16,
                value_dim: 8,
            };
            let [q, k, v, beta, g] = inputs(&s, tokens as u64 + 1);
            let n = tokens * 6 * 8;
            let (mut a, mut b) = (vec![0.0; n], vec![0.0; n]);
            recurrent(&q, &k, &v, &beta, &g, &s, &mut a);
            chunked(&q, &k, &v, &beta, &g, &s, &mut b);
            let scale = a.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let diff = a
                .iter()
                .zip(&b)
                .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                diff <= 2e-5 * scale.max(1.0),
                "{tokens} tokens: {diff:e} (scale {scale})"
            );
            assert!(scale > 0.01, "the test needs non-trivial outputs");
        }
    }

    #[test]
    fn a_hand_computed_state() {
        // One head, Dk = Dv = 1: S_t = e^g·S + beta·(v − e^g·S·k)·k, o = S·q.
        let s = DeltaShape {
            tokens: 2,
            key_heads: 1,
            value_heads: 1,
            key_dim: 1,
            value_dim: 1,
        };
        let (q, k, v, beta, g) = ([2.0, 3.0], [1.0, 0.5], [4.0, 1.0], [0.5, 1.0], [0.0, -1.0]);
        let mut o = [0.0; 2];
        recurrent(&q, &k, &v, &beta, &g, &s, &mut o);
        let s1 = 0.5 * 4.0; // S0 = 0: delta = 0.5·4, S1 = delta·k
        let d = 1.0 * (1.0 - (-1.0f32).exp() * s1 * 0.5);
        let s2 = (-1.0f32).exp() * s1 + 0.5 * d;
        assert_eq!(o[0], s1 * 2.0);
        assert!((o[1] - s2 * 3.0).abs() < 1e-6, "{} vs {}", o[1], s2 * 3.0);
        let mut c = [0.0; 2];
        chunked(&q, &k, &v, &beta, &g, &s, &mut c);
        assert!((c[0] - o[0]).abs() < 1e-6 && (c[1] - o[1]).abs() < 1e-6);
    }

    #[test]
    fn value_heads_read_their_key_head_by_repeat_interleave() {
        // Hv = 4, Hk = 2: value heads 0 and 1 read key head 0, 2 and 3 key head 1. Moving
        // key head 1 changes value heads 2 and 3 only.
        let s = DeltaShape {
            tokens: 10,
            key_heads: 2,
            value_heads: 4,
            key_dim: 4,
            value_dim: 3,
        };
        let [q, mut k, v, beta, g] = inputs(&s, 9);
        let mut a = vec![0.0; 10 * 4 * 3];
        chunked(&q, &k, &v, &beta, &g, &s, &mut a);
        for t in 0..10 {
            k[(t * 2 + 1) * 4] += 0.5;
        }
        let mut b = vec![0.0; 10 * 4 * 3];
        chunked(&q, &k, &v, &beta, &g, &s, &mut b);
        for t in 0..10 {
            for j in 0..4 {
                let same = (0..3).all(|c| a[(t * 4 + j) * 3 + c] == b[(t * 4 + j) * 3 + c]);
                assert_eq!(same, j < 2, "t {t}, head {j}");
            }
        }
    }
}
