//! RMSNorm and the SwiGLU activation.

use rayon::prelude::*;

/// `out[r] = x[r] / sqrt(mean(x[r]²) + eps) * weight`, per row of width `weight.len()`.
/// The mean of squares is accumulated in f64 (in order), the scaling in f32.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f64, out: &mut [f32]) {
    let d = weight.len();
    out.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .for_each(|(o, xr)| rms_norm_row(xr, weight, eps, o));
}

pub fn rms_norm_row(x: &[f32], weight: &[f32], eps: f64, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let inv = (1.0 / (ss / x.len() as f64 + eps).sqrt()) as f32;
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (v * inv);
    }
}

/// In-place RMSNorm of every `weight.len()`-wide vector in `x` (qwen3's per-head q/k norm).
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f64) {
    let d = weight.len();
    x.par_chunks_mut(d).for_each(|v| {
        let ss: f64 = v.iter().map(|&a| (a as f64) * (a as f64)).sum();
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
        .for_each(|(a, g)| {
            let (gate, up) = g.split_at(f);
            for ((o, &x), &u) in a.iter_mut().zip(gate).zip(up) {
                *o = x / (1.0 + (-x).exp()) * u;
            }
        });
}
