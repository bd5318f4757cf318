//! RMSNorm and the SwiGLU activation.
//!
//! Both are compiled for baseline x86-64 and for AVX2+FMA and dispatched at run time; the
//! arithmetic is spelled out in a fixed order, so both versions give the same bits.

use super::exp;
use multiversion::multiversion;
use rayon::prelude::*;

/// `out[r] = x[r] / sqrt(mean(x[r]²) + eps) * weight`, per row of width `weight.len()`.
/// The mean of squares is accumulated in f64 (in order), the scaling in f32.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f64, out: &mut [f32]) {
    let d = weight.len();
    out.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .for_each(|(o, xr)| rms_norm_row(xr, weight, eps, o));
}

/// Sum of squares in f64, four interleaved lanes combined in a fixed order (a single running
/// sum would be bound by the latency of each add).
#[multiversion(targets("x86_64+avx2+fma"))]
fn sum_squares(x: &[f32]) -> f64 {
    let mut acc = [0.0f64; 4];
    let chunks = x.chunks_exact(4);
    let rem = chunks.remainder();
    for c in chunks {
        for i in 0..4 {
            acc[i] += (c[i] as f64) * (c[i] as f64);
        }
    }
    let mut s = (acc[0] + acc[2]) + (acc[1] + acc[3]);
    for &v in rem {
        s += (v as f64) * (v as f64);
    }
    s
}

#[multiversion(targets("x86_64+avx2+fma"))]
pub fn rms_norm_row(x: &[f32], weight: &[f32], eps: f64, out: &mut [f32]) {
    let ss = sum_squares(x);
    let inv = (1.0 / (ss / x.len() as f64 + eps).sqrt()) as f32;
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (v * inv);
    }
}

/// In-place RMSNorm of every `weight.len()`-wide vector in `x` (qwen3's per-head q/k norm).
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f64) {
    let d = weight.len();
    x.par_chunks_mut(d).for_each(|v| {
        let ss = sum_squares(v);
        let inv = (1.0 / (ss / d as f64 + eps).sqrt()) as f32;
        for (a, &w) in v.iter_mut().zip(weight) {
            *a = w * (*a * inv);
        }
    });
}

/// `act[t, j] = silu(gu[t, j]) * gu[t, f + j]` for a fused gate/up output `gu[T, 2f]`.
pub fn swiglu(gu: &[f32], f: usize, act: &mut [f32]) {
    act.par_chunks_mut(f)
        .zip(gu.par_chunks(2 * f))
        .for_each(|(a, g)| swiglu_row(g, a));
}

/// One row: `silu(x) = x / (1 + e^-x)` with the vectorizable [`exp::exp`]. For x below
/// -88 that `exp` saturates at e^88, so silu gives about x·e^-88 instead of x·e^x: both
/// are far below anything that reaches a logit.
#[multiversion(targets("x86_64+avx2+fma"))]
fn swiglu_row(g: &[f32], a: &mut [f32]) {
    let (gate, up) = g.split_at(a.len());
    for ((o, &x), &u) in a.iter_mut().zip(gate).zip(up) {
        *o = x / (1.0 + exp::exp(-x)) * u;
    }
}
