//! Causal grouped-query attention over one window, as one fused kernel.
//!
//! Shapes: `q[T, Hq, D]`, `k[T, Hkv, D]`, `v[T, Hkv, D]` (keys and values already passed
//! through the Main KV representation), output `o[T, Hq, D]`. Query head `h` reads KV head
//! `h / (Hq / Hkv)`.
//!
//! Why not two library GEMMs per key block: Q·Kᵀ has a reduction depth of only `D` (64 on
//! the models we run), the score tile of a 128-query task spilled out of L2, and every call
//! repacked the same keys. Here the keys of each KV head are packed once per call into
//! panels of `NR` keys (`Kᵀ[D, NR]`), values into panels of `NR` columns (`V[T, NR]`), and
//! a task walks its queries `MB` rows at a time against one key block that
//! stays in L2: scores for `MB × K_BLOCK` land in an L1-sized tile, get their online
//! softmax step (the flash-attention recurrence: running row maximum and sum of
//! exponentials, output rescaled when the maximum moves), and are multiplied into the
//! `MB × D` output rows at once.
//!
//! Tasks are (KV head, block of `Q_BLOCK` positions); a task gathers the queries of every
//! head sharing that KV head into `Qg[(t, g), D]`, so keys are read once for the group. Key
//! blocks wholly in a row block's future are skipped, and a micro block stops at the last
//! key its latest row can see (rounded up to a panel).
//!
//! Numerics: each score is `(Σ_d q·k, in order of d, one fused multiply-add per term)·scale`
//! with `scale = log2(e)/√D`, so scores are in log2 units and the softmax uses
//! [`exp::exp2`], which needs no change of base (the probabilities are the same, about a
//! quarter of the `exp` work is saved). Each output element accumulates `p·v` over keys in
//! order, again by fused multiply-add. The portable kernels (`mul_add`) are the
//! specification; the AVX2+FMA ones do the same operations eight lanes at a time and a test
//! holds them to the same bits. The block sizes are constants, so no thread count or
//! schedule changes a result (tested). A row that meets a non-finite score gets a NaN output,
//! so the caller's finiteness check reports it (never a finite, wrong row).

use super::exp;
use super::isa::Isa;
use super::SendPtr;
use rayon::prelude::*;

pub struct AttnShape {
    pub tokens: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Query positions per task (a window split between threads is cut at a multiple of it).
pub const Q_BLOCK: usize = 64;
/// Keys per online-softmax step. Part of the numerical definition (it fixes where the
/// running maximum is updated); a multiple of `Q_BLOCK`, so every row of a task sees at
/// least one key in every key block the task visits.
const K_BLOCK: usize = 512;
/// Query rows per micro block: one score tile `MB × ≤K_BLOCK`, one online-softmax step, one
/// P·V pass. The AVX-512 tiles take all twelve rows at once (each key panel read from L2 once
/// per twelve rows); the AVX2 and portable ones take them as two tiles of [`MR`].
const MB: usize = 12;
/// Query rows per AVX2 / portable register tile (registers: MR × NR/8 accumulators).
const MR: usize = 6;
const _: () = assert!(MB.is_multiple_of(MR));
/// Keys per packed panel, and output columns per P·V tile.
const NR: usize = 16;
const _: () = assert!(K_BLOCK.is_multiple_of(Q_BLOCK) && K_BLOCK.is_multiple_of(NR));

/// Keys and values of one call, laid out for the micro-kernels.
struct Packed {
    /// Kᵀ panels `[Hkv][T/NR][D][NR]` (keys past T are zero).
    kt: Vec<f32>,
    /// V in column panels `[Hkv][Dp/NR][T rounded up to NR][NR]` (columns past D and rows
    /// past T are zero), so a P·V pass over one panel streams contiguous memory.
    vp: Vec<f32>,
    /// Keys per head after rounding up to a whole panel.
    t_pad: usize,
    /// D rounded up to a multiple of NR.
    dp: usize,
}

impl Packed {
    fn new(k: &[f32], v: &[f32], s: &AttnShape) -> Packed {
        let (t_len, hkv, d) = (s.tokens, s.kv_heads, s.head_dim);
        let t_pad = t_len.div_ceil(NR) * NR;
        let dp = d.div_ceil(NR) * NR;
        let mut kt = vec![0.0f32; hkv * t_pad * d];
        let mut vp = vec![0.0f32; hkv * t_pad * dp];
        // One key panel (NR keys of one head) per chunk: independent writes.
        kt.par_chunks_mut(NR * d).enumerate().for_each(|(i, kp)| {
            let (kh, panel) = (i / (t_pad / NR), i % (t_pad / NR));
            for j in 0..NR.min(t_len.saturating_sub(panel * NR)) {
                let src = ((panel * NR + j) * hkv + kh) * d;
                for x in 0..d {
                    kp[x * NR + j] = k[src + x];
                }
            }
        });
        // One value column panel (NR columns of one head, every key) per chunk.
        vp.par_chunks_mut(t_pad * NR)
            .enumerate()
            .for_each(|(i, vpn)| {
                let (kh, c0) = (i / (dp / NR), (i % (dp / NR)) * NR);
                let width = NR.min(d - c0);
                for t in 0..t_len {
                    let src = (t * hkv + kh) * d + c0;
                    vpn[t * NR..t * NR + width].copy_from_slice(&v[src..src + width]);
                }
            });
        Packed { kt, vp, t_pad, dp }
    }
}

/// Per-task scratch, reused across the tasks a worker runs.
struct Scratch {
    /// Qg[rows rounded up to MB, D]; padding rows are zero.
    qg: Vec<f32>,
    /// S / P[MB, K_BLOCK]
    scores: Vec<f32>,
    /// O[rows rounded up to MB, Dp], unnormalized
    og: Vec<f32>,
    /// running row maximum and sum of exponentials, [rows]
    m: Vec<f32>,
    l: Vec<f32>,
    /// rows that met a non-finite score, [rows]
    bad: Vec<bool>,
}

/// `s[r, p·NR + c] = scale · Σ_x q[r, x]·kt[p][x][c]` for the `MB` query rows of a micro
/// block (`q[MB, d]`) and `panels` key panels; `s` has row stride `K_BLOCK`. Returns each
/// row's maximum over the first `max_panels` panels (the ones every row may see;
/// `NEG_INFINITY` when none), taken while the tile is still in registers, which saves the
/// softmax a pass.
#[allow(clippy::too_many_arguments)]
fn scores_block(
    isa: Isa,
    q: &[f32],
    kt: &[f32],
    d: usize,
    panels: usize,
    max_panels: usize,
    scale: f32,
    s: &mut [f32],
) -> [f32; MB] {
    assert!(q.len() >= MB * d && kt.len() >= panels * d * NR);
    assert!(panels * NR <= K_BLOCK && s.len() >= MB * K_BLOCK && max_panels <= panels);
    let mut out = [f32::NEG_INFINITY; MB];
    for h in 0..MB / MR {
        let (qh, sh) = (&q[h * MR * d..], &mut s[h * MR * K_BLOCK..]);
        let mx = match isa {
            Isa::Portable => portable::scores_tile(qh, kt, d, panels, max_panels, scale, sh),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has AVX2 and FMA (`Isa::detect`, or a test that checked); the
            // asserts above bound every access of this half.
            Isa::Avx2 => unsafe {
                avx2::scores_tile(
                    qh.as_ptr(),
                    kt.as_ptr(),
                    d,
                    panels,
                    max_panels,
                    scale,
                    sh.as_mut_ptr(),
                )
            },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                // SAFETY: the CPU has AVX-512F (as above); the asserts bound every access.
                return unsafe {
                    avx512::scores_tile(
                        q.as_ptr(),
                        kt.as_ptr(),
                        d,
                        panels,
                        max_panels,
                        scale,
                        s.as_mut_ptr(),
                    )
                };
            }
        };
        out[h * MR..(h + 1) * MR].copy_from_slice(&mx);
    }
    out
}

/// `o[r, c] += Σ_j p[r, j]·v[j, c]` for the `MB` rows of a micro block, `keys` keys and the
/// value panels `c < tiles` (`p` with row stride `K_BLOCK`; panel `c` is `v[c·vstride +
/// j·NR ..]` for key `j`, its output columns start at `o[c·NR]`, `o` with row stride
/// `ostride`), accumulated in key order. The AVX-512 kernel takes two panels per pass
/// (24 accumulators); each output element is the same chain on every kernel.
#[allow(clippy::too_many_arguments)]
fn pv_block(
    isa: Isa,
    p: &[f32],
    v: &[f32],
    vstride: usize,
    tiles: usize,
    keys: usize,
    o: &mut [f32],
    ostride: usize,
) {
    if tiles == 0 {
        return;
    }
    assert!(keys <= K_BLOCK && p.len() >= MB * K_BLOCK);
    assert!(v.len() >= (tiles - 1) * vstride + keys * NR);
    assert!(o.len() >= (MB - 1) * ostride + tiles * NR);
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        let mut c = 0;
        while c < tiles {
            let (vc, oc) = (v[c * vstride..].as_ptr(), o[c * NR..].as_mut_ptr());
            // SAFETY: the CPU has AVX-512F; panels c (and c + 1) and their output columns
            // are in bounds by the asserts above.
            unsafe {
                if c + 2 <= tiles {
                    avx512::pv_tile::<2>(p.as_ptr(), vc, vstride, keys, oc, ostride);
                } else {
                    avx512::pv_tile::<1>(p.as_ptr(), vc, vstride, keys, oc, ostride);
                }
            }
            c += 2;
        }
        return;
    }
    for h in 0..MB / MR {
        let ph = &p[h * MR * K_BLOCK..];
        for c in 0..tiles {
            let (vc, oc) = (&v[c * vstride..], &mut o[h * MR * ostride + c * NR..]);
            match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the CPU has AVX2 and FMA; the asserts above bound every access.
                Isa::Avx2 => unsafe {
                    avx2::pv_tile(ph.as_ptr(), vc.as_ptr(), keys, oc.as_mut_ptr(), ostride)
                },
                _ => portable::pv_tile(ph, vc, keys, oc, ostride),
            }
        }
    }
}

/// The specification of both micro-kernels: one fused multiply-add per term, in order.
mod portable {
    use super::{K_BLOCK, MR, NR};

    pub fn scores_tile(
        q: &[f32],
        kt: &[f32],
        d: usize,
        panels: usize,
        max_panels: usize,
        scale: f32,
        s: &mut [f32],
    ) -> [f32; MR] {
        let mut mx = [f32::NEG_INFINITY; MR];
        for p in 0..panels {
            let mut acc = [[0.0f32; NR]; MR];
            for x in 0..d {
                let kx = &kt[(p * d + x) * NR..(p * d + x + 1) * NR];
                for (r, a) in acc.iter_mut().enumerate() {
                    let qv = q[r * d + x];
                    for c in 0..NR {
                        a[c] = qv.mul_add(kx[c], a[c]);
                    }
                }
            }
            for (r, a) in acc.iter().enumerate() {
                for c in 0..NR {
                    let v = a[c] * scale;
                    s[r * K_BLOCK + p * NR + c] = v;
                    if p < max_panels {
                        mx[r] = mx[r].max(v);
                    }
                }
            }
        }
        mx
    }

    pub fn pv_tile(p: &[f32], v: &[f32], keys: usize, o: &mut [f32], ostride: usize) {
        for r in 0..MR {
            for c in 0..NR {
                let mut a = o[r * ostride + c];
                for j in 0..keys {
                    a = p[r * K_BLOCK + j].mul_add(v[j * NR + c], a);
                }
                o[r * ostride + c] = a;
            }
        }
    }
}

/// The same loops as [`portable`], eight lanes at a time with AVX2 fused multiply-adds
/// (`MR × NR/8 = 12` accumulators in registers).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{K_BLOCK, MR, NR};
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX2 and FMA present; `q[MR·d]`, `kt[panels·d·NR]` readable, `s[MR·K_BLOCK]`
    /// writable, `max_panels <= panels`, `panels·NR <= K_BLOCK`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scores_tile(
        q: *const f32,
        kt: *const f32,
        d: usize,
        panels: usize,
        max_panels: usize,
        scale: f32,
        s: *mut f32,
    ) -> [f32; MR] {
        let sc = _mm256_set1_ps(scale);
        let mut mx = [_mm256_set1_ps(f32::NEG_INFINITY); MR];
        for p in 0..panels {
            let kp = kt.add(p * d * NR);
            let mut acc = [[_mm256_setzero_ps(); 2]; MR];
            for x in 0..d {
                let b0 = _mm256_loadu_ps(kp.add(x * NR));
                let b1 = _mm256_loadu_ps(kp.add(x * NR + 8));
                for (r, a) in acc.iter_mut().enumerate() {
                    let qv = _mm256_broadcast_ss(&*q.add(r * d + x));
                    a[0] = _mm256_fmadd_ps(qv, b0, a[0]);
                    a[1] = _mm256_fmadd_ps(qv, b1, a[1]);
                }
            }
            for (r, a) in acc.iter().enumerate() {
                let dst = s.add(r * K_BLOCK + p * NR);
                let (v0, v1) = (_mm256_mul_ps(a[0], sc), _mm256_mul_ps(a[1], sc));
                _mm256_storeu_ps(dst, v0);
                _mm256_storeu_ps(dst.add(8), v1);
                if p < max_panels {
                    mx[r] = _mm256_max_ps(mx[r], _mm256_max_ps(v0, v1));
                }
            }
        }
        let mut out = [f32::NEG_INFINITY; MR];
        for (o, m) in out.iter_mut().zip(&mx) {
            let mut l = [0.0f32; 8];
            _mm256_storeu_ps(l.as_mut_ptr(), *m);
            *o = l.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        }
        out
    }

    /// # Safety
    /// AVX2 and FMA present; `p[MR·K_BLOCK]`, `v[keys·NR]` readable, `o` writable for
    /// `MR` rows of `NR` at stride `ostride`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn pv_tile(p: *const f32, v: *const f32, keys: usize, o: *mut f32, ostride: usize) {
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        for (r, a) in acc.iter_mut().enumerate() {
            a[0] = _mm256_loadu_ps(o.add(r * ostride));
            a[1] = _mm256_loadu_ps(o.add(r * ostride + 8));
        }
        for j in 0..keys {
            let b0 = _mm256_loadu_ps(v.add(j * NR));
            let b1 = _mm256_loadu_ps(v.add(j * NR + 8));
            for (r, a) in acc.iter_mut().enumerate() {
                let pv = _mm256_broadcast_ss(&*p.add(r * K_BLOCK + j));
                a[0] = _mm256_fmadd_ps(pv, b0, a[0]);
                a[1] = _mm256_fmadd_ps(pv, b1, a[1]);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.add(r * ostride), a[0]);
            _mm256_storeu_ps(o.add(r * ostride + 8), a[1]);
        }
    }
}

/// The AVX-512 twins of [`avx2`]: sixteen lanes per register, all `MB` rows of a micro block
/// and two key (or value) panels per pass (24 accumulators), so each panel is loaded once per
/// twelve rows. Same operations per
/// element, so the same bits (tested against the portable kernels).
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{K_BLOCK, MB, NR};
    use std::arch::x86_64::*;

    /// # Safety
    /// As for [`super::avx2::scores_tile`] with `MB` rows instead of `MR`, with AVX-512F present.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn scores_tile(
        q: *const f32,
        kt: *const f32,
        d: usize,
        panels: usize,
        max_panels: usize,
        scale: f32,
        s: *mut f32,
    ) -> [f32; MB] {
        let mut mx = [_mm512_set1_ps(f32::NEG_INFINITY); MB];
        let mut p = 0;
        while p < panels {
            if p + 2 <= panels {
                pair::<2>(q, kt, d, p, max_panels, scale, s, &mut mx);
                p += 2;
            } else {
                pair::<1>(q, kt, d, p, max_panels, scale, s, &mut mx);
                p += 1;
            }
        }
        let mut out = [f32::NEG_INFINITY; MB];
        for (o, m) in out.iter_mut().zip(&mx) {
            *o = _mm512_reduce_max_ps(*m);
        }
        out
    }

    /// Panels `p0..p0 + P` of [`scores_tile`].
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pair<const P: usize>(
        q: *const f32,
        kt: *const f32,
        d: usize,
        p0: usize,
        max_panels: usize,
        scale: f32,
        s: *mut f32,
        mx: &mut [__m512; MB],
    ) {
        let sc = _mm512_set1_ps(scale);
        let mut acc = [[_mm512_setzero_ps(); P]; MB];
        for x in 0..d {
            let mut b = [_mm512_setzero_ps(); P];
            for (i, bv) in b.iter_mut().enumerate() {
                *bv = _mm512_loadu_ps(kt.add(((p0 + i) * d + x) * NR));
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let qv = _mm512_set1_ps(*q.add(r * d + x));
                for (av, &bv) in a.iter_mut().zip(&b) {
                    *av = _mm512_fmadd_ps(qv, bv, *av);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (i, &av) in a.iter().enumerate() {
                let v = _mm512_mul_ps(av, sc);
                _mm512_storeu_ps(s.add(r * K_BLOCK + (p0 + i) * NR), v);
                if p0 + i < max_panels {
                    mx[r] = _mm512_max_ps(mx[r], v);
                }
            }
        }
    }

    /// `P` value panels at once: panel `i` at `v + i·vstride`, its output columns at
    /// `o + i·NR`; otherwise as for [`super::avx2::pv_tile`].
    ///
    /// # Safety
    /// AVX-512F present; `p[MB·K_BLOCK]` and each panel's `keys·NR` floats readable, `o`
    /// writable for `MB` rows of `P·NR` at stride `ostride`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn pv_tile<const P: usize>(
        p: *const f32,
        v: *const f32,
        vstride: usize,
        keys: usize,
        o: *mut f32,
        ostride: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); P]; MB];
        for (r, a) in acc.iter_mut().enumerate() {
            for (i, av) in a.iter_mut().enumerate() {
                *av = _mm512_loadu_ps(o.add(r * ostride + i * NR));
            }
        }
        for j in 0..keys {
            let mut b = [_mm512_setzero_ps(); P];
            for (i, bv) in b.iter_mut().enumerate() {
                *bv = _mm512_loadu_ps(v.add(i * vstride + j * NR));
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let pv = _mm512_set1_ps(*p.add(r * K_BLOCK + j));
                for (av, &bv) in a.iter_mut().zip(&b) {
                    *av = _mm512_fmadd_ps(pv, bv, *av);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (i, &av) in a.iter().enumerate() {
                _mm512_storeu_ps(o.add(r * ostride + i * NR), av);
            }
        }
    }
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
    if t_len == 0 {
        return;
    }
    let group = hq / hkv;
    // Scores in log2 units: 2^(s·log2 e) = e^s.
    let scale = std::f32::consts::LOG2_E / (d as f32).sqrt();
    let blocks = t_len.div_ceil(Q_BLOCK);
    let first_block = from.min(t_len) / Q_BLOCK;
    let isa = Isa::detect();
    let max_rows = (Q_BLOCK * group).div_ceil(MB) * MB;
    let packed = Packed::new(k, v, s);
    let (t_pad, dp) = (packed.t_pad, packed.dp);
    let out = SendPtr(o.as_mut_ptr());
    let tasks = hkv * (blocks - first_block);
    (0..tasks).into_par_iter().for_each_init(
        || Scratch {
            qg: vec![0.0; max_rows * d],
            scores: vec![0.0; MB * K_BLOCK],
            og: vec![0.0; max_rows * dp],
            m: vec![0.0; max_rows],
            l: vec![0.0; max_rows],
            bad: vec![false; max_rows],
        },
        |sc, task| {
            // Later query blocks first: they have the most keys, and starting with them
            // balances the load (the order does not affect any task's result).
            let task = tasks - 1 - task;
            let (kh, b) = (task % hkv, first_block + task / hkv);
            let q0 = b * Q_BLOCK;
            let q1 = (q0 + Q_BLOCK).min(t_len);
            let rows = (q1 - q0) * group;
            let rows_pad = rows.div_ceil(MB) * MB;
            // Qg[(t, g)] = q[q0 + t, kh·group + g]: for each position the group's heads are
            // already adjacent in `q`, so this is one contiguous copy per position.
            for t in q0..q1 {
                let src = &q[(t * hq + kh * group) * d..(t * hq + (kh + 1) * group) * d];
                sc.qg[(t - q0) * group * d..(t - q0 + 1) * group * d].copy_from_slice(src);
            }
            sc.qg[rows * d..rows_pad * d].fill(0.0);
            let og = &mut sc.og[..rows_pad * dp];
            og.fill(0.0);
            let (m, l) = (&mut sc.m[..rows], &mut sc.l[..rows]);
            m.fill(f32::NEG_INFINITY);
            l.fill(0.0);
            let bad = &mut sc.bad[..rows];
            bad.fill(false);
            let kt_head = &packed.kt[kh * t_pad * d..(kh + 1) * t_pad * d];
            let v_head = &packed.vp[kh * t_pad * dp..(kh + 1) * t_pad * dp];
            let v_tiles = dp / NR;
            for kb0 in (0..q1).step_by(K_BLOCK) {
                let kb1 = (kb0 + K_BLOCK).min(q1);
                for r0 in (0..rows).step_by(MB) {
                    // Keys visible to this micro block's latest row, whole panels.
                    let last_pos = q0 + ((r0 + MB).min(rows) - 1) / group;
                    let end = kb1.min(last_pos + 1);
                    let panels = (end - kb0).div_ceil(NR);
                    let cols = panels * NR;
                    // Panels the micro block's earliest row sees whole (so every row does).
                    let shared = ((q0 + r0 / group + 1 - kb0) / NR).min(panels);
                    let p = &mut sc.scores[..];
                    let tile_max = scores_block(
                        isa,
                        &sc.qg[r0 * d..(r0 + MB) * d],
                        &kt_head[kb0 * d..(kb0 + cols) * d],
                        d,
                        panels,
                        shared,
                        scale,
                        p,
                    );
                    let og_mb = &mut og[r0 * dp..(r0 + MB) * dp];
                    for i in 0..MB {
                        let row = &mut p[i * K_BLOCK..i * K_BLOCK + cols];
                        let r = r0 + i;
                        if r >= rows {
                            row.fill(0.0);
                            continue;
                        }
                        // Position q0 + r/group sees keys 0..=q0 + r/group.
                        let visible = (q0 + r / group + 1 - kb0).min(cols);
                        let (live, masked) = row.split_at_mut(visible);
                        masked.fill(0.0);
                        // The maximum drops a NaN and exp2 clamps an infinity, so a score
                        // that overflowed would give a finite, wrong row: mark the row.
                        bad[r] |= crate::kv::find_non_finite(live).is_some();
                        // The maximum is exact, so splitting it changes no bit.
                        let live_max = tile_max[i].max(exp::max(&live[shared * NR..]));
                        let m_new = m[r].max(live_max);
                        let sum = exp::exp2_sub_sum(live, m_new);
                        if m[r] == f32::NEG_INFINITY {
                            l[r] = sum;
                        } else {
                            let alpha = exp::exp2(m[r] - m_new);
                            l[r] = l[r] * alpha + sum;
                            // Multiplying by exactly 1 would change nothing.
                            if alpha != 1.0 {
                                og_mb[i * dp..(i + 1) * dp]
                                    .iter_mut()
                                    .for_each(|x| *x *= alpha);
                            }
                        }
                        m[r] = m_new;
                    }
                    let v = &v_head[kb0 * NR..(v_tiles - 1) * t_pad * NR + (kb0 + cols) * NR];
                    pv_block(isa, p, v, t_pad * NR, v_tiles, cols, og_mb, dp);
                }
            }
            for (r, row) in og[..rows * dp].chunks_mut(dp).enumerate() {
                if bad[r] {
                    // The caller checks the output and reports where it is not finite.
                    row[..d].fill(f32::NAN);
                    continue;
                }
                let inv = 1.0 / l[r];
                row[..d].iter_mut().for_each(|x| *x *= inv);
            }
            for t in q0..q1 {
                for g in 0..group {
                    let r = (t - q0) * group + g;
                    // SAFETY: positions q0..q1 × heads of KV group kh are written by this
                    // task only; the range lies inside `o` ([T, Hq, D]).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            og[r * dp..].as_ptr(),
                            out.get().add((t * hq + kh * group + g) * d),
                            d,
                        );
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

    fn gen(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i + seed) * 2654435761usize) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    #[test]
    fn matches_naive_gqa() {
        // (query heads, KV heads, head_dim): odd groups, a head_dim that is not a multiple
        // of the panel width, SmolLM2's 9/3/64 and a Qwen-like 4/2/128.
        let shapes = [(6, 2, 12), (9, 3, 64), (4, 2, 128), (3, 3, 20)];
        for (hq, hkv, d) in shapes {
            for t in [1, 9, 64, 65, 128, 300, 513, 1100] {
                if d >= 64 && t > 600 {
                    continue; // the f64 reference is cubic; smaller shapes cover long T
                }
                let s = AttnShape {
                    tokens: t,
                    q_heads: hq,
                    kv_heads: hkv,
                    head_dim: d,
                };
                let q = gen(t * hq * d, 1);
                let k = gen(t * hkv * d, 2);
                let v = gen(t * hkv * d, 3);
                let mut o = vec![0.0; q.len()];
                causal_attention(&q, &k, &v, &s, 0, &mut o);
                let want = naive(&q, &k, &v, &s);
                for (a, b) in o.iter().zip(&want) {
                    assert!(
                        (*a as f64 - b).abs() < 1e-5,
                        "{hq}/{hkv}/{d} T={t}: {a} vs {b}"
                    );
                }
                // Skipping early queries leaves the later rows' bits unchanged.
                let from = t * 2 / 3;
                let mut part = vec![f32::NAN; q.len()];
                causal_attention(&q, &k, &v, &s, from, &mut part);
                let row = hq * d;
                assert!(
                    o[from * row..]
                        .iter()
                        .zip(&part[from * row..])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{hq}/{hkv}/{d} T={t}, from {from}"
                );
            }
        }
    }

    #[test]
    fn same_bits_for_any_thread_count() {
        let s = AttnShape {
            tokens: 777,
            q_heads: 9,
            kv_heads: 3,
            head_dim: 64,
        };
        let q = gen(777 * 9 * 64, 4);
        let k = gen(777 * 3 * 64, 5);
        let v = gen(777 * 3 * 64, 6);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut o = vec![0.0; q.len()];
            pool.install(|| causal_attention(&q, &k, &v, &s, 0, &mut o));
            o.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
        };
        let one = run(1);
        assert_eq!(one, run(3));
        assert_eq!(one, run(1));
    }

    /// The AVX2 micro-kernels compute exactly the portable kernels' bits.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_kernels_match_the_portable_bits() {
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        let isas: Vec<Isa> = Isa::all()
            .into_iter()
            .filter(|&i| i != Isa::Portable)
            .collect();
        if isas.is_empty() {
            eprintln!("no AVX2+FMA or AVX-512 here: nothing to compare");
            return;
        }
        for (d, panels) in [(64, 32), (12, 3), (128, 1), (64, 5)] {
            let q = gen(MB * d, 7);
            let kt = gen(panels * d * NR, 8);
            let shared = panels / 2 + 1;
            let mut b = vec![0.0; MB * K_BLOCK];
            let mb = scores_block(Isa::Portable, &q, &kt, d, panels, shared, 0.125, &mut b);
            // P·V over three value panels (a pair and a single one on AVX-512), with the
            // output columns offset inside a wider row.
            let keys = panels * NR;
            let (tiles, vstride, ostride) = (3, keys * NR + 5, 4 * NR);
            let v = gen((tiles - 1) * vstride + keys * NR, 9);
            let mut ob = gen(MB * ostride, 10);
            pv_block(
                Isa::Portable,
                &b,
                &v,
                vstride,
                tiles,
                keys,
                &mut ob[NR / 2..],
                ostride,
            );
            for &isa in &isas {
                let mut a = vec![0.0; MB * K_BLOCK];
                let ma = scores_block(isa, &q, &kt, d, panels, shared, 0.125, &mut a);
                assert_eq!(bits(&a), bits(&b), "{isa:?} scores, d {d}");
                assert_eq!(bits(&ma), bits(&mb), "{isa:?} row maxima, d {d}");
                for r in 0..MB {
                    let want = exp::max(&a[r * K_BLOCK..r * K_BLOCK + shared * NR]);
                    assert_eq!(ma[r], want, "{isa:?} row {r} maximum, d {d}");
                }
                let mut oa = gen(MB * ostride, 10);
                pv_block(
                    isa,
                    &b,
                    &v,
                    vstride,
                    tiles,
                    keys,
                    &mut oa[NR / 2..],
                    ostride,
                );
                assert_eq!(bits(&oa), bits(&ob), "{isa:?} P·V, {keys} keys");
            }
        }
    }
}
