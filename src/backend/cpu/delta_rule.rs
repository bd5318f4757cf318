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
//! substitution, the chunk's products run on the crate's GEMM, and the State is carried from
//! chunk to chunk. It is the production path; the two agree to float32 rounding (tested),
//! not bit for bit. Exponentials use the crate's [`exp::exp`] (relative error below 3e-7),
//! and denormals are flushed to zero (`FlushDenormals`): a State that decays fast would
//! otherwise spend most of its time in the slow denormal range.
//!
//! Value heads are independent and each is computed by one task in a fixed order, so the
//! result does not depend on the thread count.

use super::exp;
use super::matmul::{sgemm_block, Gemm};
use super::operand::WeightRows;
use super::SendPtr;
use multiversion::multiversion;
use rayon::prelude::*;

/// Tokens per chunk of [`chunked`] (a window split between threads would have to cut at a
/// multiple of it).
pub const CHUNK: usize = 64;

/// The sizes of one call, and where the rows of q, k and v lie: row `i` of `q` starts at
/// `q[i · q_stride]` (its `Hk·Dk` values contiguous), likewise `k` and `v`. Dense inputs have
/// strides `Hk·Dk`, `Hk·Dk`, `Hv·Dv` ([`DeltaShape::dense`]); the layer passes its one
/// q|k|v buffer with all three strides equal to its width, no copies.
#[derive(Clone, Copy, Debug)]
pub struct DeltaShape {
    pub tokens: usize,
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    /// Row strides of q, k and v.
    pub strides: [usize; 3],
}

impl DeltaShape {
    /// A shape whose q, k and v are dense `[T, H, D]` tensors.
    pub fn dense(
        tokens: usize,
        key_heads: usize,
        value_heads: usize,
        dk: usize,
        dv: usize,
    ) -> Self {
        DeltaShape {
            tokens,
            key_heads,
            value_heads,
            key_dim: dk,
            value_dim: dv,
            strides: [key_heads * dk, key_heads * dk, value_heads * dv],
        }
    }

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
        let rows = |len: usize, stride: usize, width: usize| {
            t == 0 || (stride >= width && len >= (t - 1) * stride + width)
        };
        assert!(rows(q.len(), self.strides[0], hk * dk), "q shape");
        assert!(rows(k.len(), self.strides[1], hk * dk), "k shape");
        assert!(rows(v.len(), self.strides[2], hv * dv), "v shape");
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
    let [qs, ks, vs] = s.strides;
    let kh = j / (hv / hk);
    let mut h = Head {
        q: Vec::with_capacity(t * dk),
        k: Vec::with_capacity(t * dk),
        v: Vec::with_capacity(t * dv),
        beta: Vec::with_capacity(t),
        g: Vec::with_capacity(t),
    };
    for i in 0..t {
        h.q.extend_from_slice(&q[i * qs + kh * dk..][..dk]);
        h.k.extend_from_slice(&k[i * ks + kh * dk..][..dk]);
        h.v.extend_from_slice(&v[i * vs + j * dv..][..dv]);
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
    let (t, hk, hv, dk, dv) = (s.tokens, s.key_heads, s.value_heads, s.key_dim, s.value_dim);
    let [qs, ks, vs] = s.strides;
    let out = SendPtr(o.as_mut_ptr());
    (0..hv).into_par_iter().for_each(|j| {
        let _ftz = FlushDenormals::new();
        let kh = j / (hv / hk);
        // One chunk of this head's inputs at a time (no copy of the whole window per head).
        let mut h = Head {
            q: Vec::with_capacity(CHUNK * dk),
            k: Vec::with_capacity(CHUNK * dk),
            v: Vec::with_capacity(CHUNK * dv),
            beta: Vec::with_capacity(CHUNK),
            g: Vec::with_capacity(CHUNK),
        };
        let mut st = vec![0.0f32; dv * dk]; // Sᵀ[Dv, Dk], carried between chunks
        let mut oc = vec![0.0f32; CHUNK * dv];
        let mut c = ChunkScratch::new(dk, dv);
        for c0 in (0..t).step_by(CHUNK) {
            let c1 = (c0 + CHUNK).min(t);
            let n = c1 - c0;
            h.q.clear();
            h.k.clear();
            h.v.clear();
            h.beta.clear();
            h.g.clear();
            for i in c0..c1 {
                h.q.extend_from_slice(&q[i * qs + kh * dk..][..dk]);
                h.k.extend_from_slice(&k[i * ks + kh * dk..][..dk]);
                h.v.extend_from_slice(&v[i * vs + j * dv..][..dv]);
                h.beta.push(beta[i * hv + j]);
                h.g.push(g[i * hv + j]);
            }
            chunk(&h, 0, n, dk, dv, &mut st, &mut oc[..n * dv], &mut c);
            for (i, row) in oc[..n * dv].chunks(dv).enumerate() {
                // SAFETY: head j writes o[c0 + i, j, ..] only, which no other task touches;
                // the shapes were checked above.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        row.as_ptr(),
                        out.get().add(((c0 + i) * hv + j) * dv),
                        dv,
                    )
                };
            }
        }
    });
}

/// Flushes denormal results and inputs to zero on this thread while alive (x86-64 MXCSR
/// FTZ and DAZ), restoring the previous mode on drop. A State that decays fast drifts into
/// denormal magnitudes (below 1.2e-38), where x86 arithmetic is 10-100 times slower; such
/// values are far below anything that reaches a logit. Elsewhere a no-op.
struct FlushDenormals {
    #[cfg(target_arch = "x86_64")]
    saved: u32,
}

impl FlushDenormals {
    #[allow(deprecated)] // _mm_getcsr/_mm_setcsr: the documented way to reach MXCSR
    fn new() -> FlushDenormals {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_getcsr, _mm_setcsr};
            // SAFETY: reading and writing MXCSR's FTZ (bit 15) and DAZ (bit 6) bits only
            // changes how this thread rounds tiny floats; the previous value is restored.
            let saved = unsafe { _mm_getcsr() };
            unsafe { _mm_setcsr(saved | (1 << 15) | (1 << 6)) };
            FlushDenormals { saved }
        }
        #[cfg(not(target_arch = "x86_64"))]
        FlushDenormals {}
    }
}

impl Drop for FlushDenormals {
    #[allow(deprecated)]
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: restores the mode read in `new`.
        unsafe {
            std::arch::x86_64::_mm_setcsr(self.saved)
        };
    }
}

/// Work buffers of one chunk (`n ≤ CHUNK` tokens).
struct ChunkScratch {
    /// Cumulative log decay within the chunk, `[n]`.
    gc: Vec<f32>,
    /// `exp(gc_i − gc_j)` for `j ≤ i`, `[n, n]`.
    decay: Vec<f32>,
    /// `K·Kᵀ`, then the triangular system `A` `[n, n]`; `Q·Kᵀ` masked and decayed `[n, n]`.
    a: Vec<f32>,
    p: Vec<f32>,
    /// `(beta·v)ᵀ [Dv, n]`, `(beta·k·exp(gc))ᵀ [Dk, n]`, `(k·exp(gc_last − gc))ᵀ [Dk, n]`.
    vbt: Vec<f32>,
    kbt: Vec<f32>,
    kft: Vec<f32>,
    /// `q·exp(gc)` `[n, Dk]`.
    qe: Vec<f32>,
    /// `u = A·(beta·v)` `[n, Dv]`, `w = A·(beta·k·exp(gc))` `[n, Dk]`, `w·S` `[n, Dv]`.
    u: Vec<f32>,
    w: Vec<f32>,
    ws: Vec<f32>,
    /// `v_new = u − w·S` `[n, Dv]` and its transpose.
    v_new: Vec<f32>,
    v_new_t: Vec<f32>,
}

impl ChunkScratch {
    fn new(dk: usize, dv: usize) -> ChunkScratch {
        let z = |n: usize| vec![0.0f32; n];
        ChunkScratch {
            gc: z(CHUNK),
            decay: z(CHUNK * CHUNK),
            a: z(CHUNK * CHUNK),
            p: z(CHUNK * CHUNK),
            vbt: z(dv * CHUNK),
            kbt: z(dk * CHUNK),
            kft: z(dk * CHUNK),
            qe: z(CHUNK * dk),
            u: z(CHUNK * dv),
            w: z(CHUNK * dk),
            ws: z(CHUNK * dv),
            v_new: z(CHUNK * dv),
            v_new_t: z(dv * CHUNK),
        }
    }
}

/// `out[m, n] (+)= x[m, k] · w[n, k]ᵀ` on one thread (the chunks' small products; the tasks
/// are already one per value head).
fn mm(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, out: &mut [f32], accumulate: bool) {
    assert!(x.len() >= m * k && w.len() >= n * k && out.len() >= m * n);
    // SAFETY: the slices hold [m, k], [n, k] and [m, n] (asserted); `out` is exclusively
    // borrowed.
    unsafe {
        sgemm_block(
            Gemm::configured(),
            m,
            k,
            n,
            x.as_ptr(),
            WeightRows::f32_shape(&w[..n * k], n, k),
            out.as_mut_ptr(),
            n,
            accumulate,
        )
    }
}

/// `dst[c, r] = src[r, c]` for `src[rows, cols]`.
fn transpose(src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
    for r in 0..rows {
        for c in 0..cols {
            dst[c * rows + r] = src[r * cols + c];
        }
    }
}

/// Tokens `c0..c1` of one value head: writes their outputs into `out[n, Dv]` and carries the
/// State, held transposed as `st[Dv, Dk]` (`Sᵀ`), past the chunk. Compiled for AVX2+FMA as
/// well (run-time dispatch): the same operations in the same order, so the same bits, but
/// `mul_add` and the loops run natively instead of through libm's `fmaf`.
#[allow(clippy::too_many_arguments)]
#[multiversion(targets("x86_64+avx2+fma"))]
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
    let (q, k, v) = (
        &h.q[c0 * dk..c1 * dk],
        &h.k[c0 * dk..c1 * dk],
        &h.v[c0 * dv..c1 * dv],
    );
    let beta = &h.beta[c0..c1];
    let mut acc = 0.0f32;
    for i in 0..n {
        acc += h.g[c0 + i];
        c.gc[i] = acc;
    }
    let gc = &c.gc[..n];
    let last = gc[n - 1];

    // A[i, j] = −beta_i·(k_i·k_j)·exp(gc_i − gc_j) for j < i, then the forward substitution
    // that turns it into the inverse of the chunk's (I − strictly lower) system, plus I.
    // decay[i, j] = exp(gc_i − gc_j) for j ≤ i (one exponential each, shared below).
    let decay = &mut c.decay[..n * n];
    for i in 0..n {
        for j in 0..=i {
            decay[i * n + j] = exp::exp(gc[i] - gc[j]);
        }
    }
    let a = &mut c.a[..n * n];
    mm(k, n, dk, k, n, a, false);
    for i in 0..n {
        for j in 0..n {
            a[i * n + j] = if j < i {
                -beta[i] * a[i * n + j] * decay[i * n + j]
            } else {
                0.0
            };
        }
    }
    let mut row = [0.0f32; CHUNK];
    for i in 1..n {
        row[..n].copy_from_slice(&a[i * n..(i + 1) * n]);
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
    let (vbt, kbt) = (&mut c.vbt[..dv * n], &mut c.kbt[..dk * n]);
    for i in 0..n {
        let e = beta[i] * exp::exp(gc[i]);
        for d in 0..dv {
            vbt[d * n + i] = beta[i] * v[i * dv + d];
        }
        for d in 0..dk {
            kbt[d * n + i] = e * k[i * dk + d];
        }
    }
    let (u, w) = (&mut c.u[..n * dv], &mut c.w[..n * dk]);
    mm(a, n, n, vbt, dv, u, false);
    mm(a, n, n, kbt, dk, w, false);

    // v_new = u − w·S (the values less what the State carried in already predicts).
    let ws = &mut c.ws[..n * dv];
    mm(w, n, dk, st, dv, ws, false);
    let v_new = &mut c.v_new[..n * dv];
    for ((x, &uu), &y) in v_new.iter_mut().zip(u.iter()).zip(ws.iter()) {
        *x = uu - y;
    }
    let v_new_t = &mut c.v_new_t[..dv * n];
    transpose(v_new, n, dv, v_new_t);

    // o_i = exp(gc_i)·(q_i·S) + Σ_{j≤i} (q_i·k_j)·exp(gc_i − gc_j)·v_new_j.
    let qe = &mut c.qe[..n * dk];
    for i in 0..n {
        let e = exp::exp(gc[i]);
        for (x, &y) in qe[i * dk..(i + 1) * dk]
            .iter_mut()
            .zip(&q[i * dk..(i + 1) * dk])
        {
            *x = e * y;
        }
    }
    mm(qe, n, dk, st, dv, out, false);
    let p = &mut c.p[..n * n];
    mm(q, n, dk, k, n, p, false);
    for i in 0..n {
        for j in 0..n {
            p[i * n + j] = if j <= i {
                p[i * n + j] * decay[i * n + j]
            } else {
                0.0
            };
        }
    }
    mm(p, n, n, v_new_t, dv, out, true);

    // S = exp(gc_last)·S + Σ_i (k_i·exp(gc_last − gc_i)) v_new_iᵀ, as Sᵀ += v_newᵀ·(k·f).
    let carry = exp::exp(last);
    st.iter_mut().for_each(|x| *x *= carry);
    let kft = &mut c.kft[..dk * n];
    for i in 0..n {
        let f = exp::exp(last - gc[i]);
        for d in 0..dk {
            kft[d * n + i] = f * k[i * dk + d];
        }
    }
    mm(v_new_t, dv, n, kft, dk, st, true);
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
            let s = DeltaShape::dense(tokens, 2, 6, 16, 8);
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
    fn flushing_denormals_is_local_to_the_chunked_rule() {
        // The mode is restored afterwards: plain arithmetic on this thread still keeps
        // denormals.
        let s = DeltaShape::dense(70, 1, 1, 4, 4);
        let [q, k, v, beta, g] = inputs(&s, 2);
        let mut o = vec![0.0; 70 * 4];
        chunked(&q, &k, &v, &beta, &g, &s, &mut o);
        let tiny = std::hint::black_box(f32::MIN_POSITIVE);
        assert!(
            std::hint::black_box(tiny / 4.0) > 0.0,
            "denormals survive outside"
        );
    }

    #[test]
    fn a_hand_computed_state() {
        // One head, Dk = Dv = 1: S_t = e^g·S + beta·(v − e^g·S·k)·k, o = S·q.
        let s = DeltaShape::dense(2, 1, 1, 1, 1);
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
        let s = DeltaShape::dense(10, 2, 4, 4, 3);
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
