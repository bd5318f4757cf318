//! A Gated DeltaNet layer's token mixer (qwen3_5 `linear_attn`), over one whole window.
//!
//! ```text
//! [q|k|v, z, b, a] = h · W_inᵀ                       (one GEMM over the stacked projections)
//! c = silu(causal depthwise conv over q|k|v)        (width K, zero left padding, tap K-1 = now)
//! q, k = L2-normalised per key head; q ·= Dk^-1/2
//! beta = sigmoid(b);  g = −exp(A_log) · softplus(a + dt_bias)
//! o = gated delta rule(q, k, v, beta, g)            (State zero at the window's start)
//! y = rmsnorm(o per value head; plain weight) · act(z)    (act: silu, or sigmoid)
//! out = y · W_outᵀ
//! ```
//!
//! The State never leaves f32 and is not a Main KV representation. A non-finite value in the
//! mixer's output (the State's read-out) fails the window like a non-finite key does.

use crate::backend::cpu::delta_rule::{chunked, DeltaShape};
use crate::backend::cpu::exp;
use crate::backend::cpu::matmul::matmul_wt;
use crate::backend::cpu::model::fault::{Faults, Pitfall};
use crate::backend::cpu::model::weights::DeltaNet;
use crate::backend::cpu::norm::rms_norm_row;
use crate::model::config::{HybridConfig, OutputGate};
use crate::model::error::{check_finite, ForwardError, Part};
use multiversion::multiversion;
use rayon::prelude::*;

/// Work buffers of the Gated DeltaNet layers of one window, kept across its layers (a
/// window's buffers are hundreds of MB at long contexts; allocating them per layer costs a
/// page fault per 4 KiB).
#[derive(Default)]
pub(crate) struct Scratch {
    proj: Vec<f32>,
    c: Vec<f32>,
    beta: Vec<f32>,
    g: Vec<f32>,
    o: Vec<f32>,
    y: Vec<f32>,
}

/// `v[..n]`, grown to `n` first (contents unspecified).
fn take(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// One Gated DeltaNet layer of a model.
pub(crate) struct Mix<'a> {
    pub hc: &'a HybridConfig,
    pub w: &'a DeltaNet,
    /// Hidden size.
    pub d: usize,
    pub layer: usize,
    /// The gated output norm's epsilon.
    pub eps: f64,
    /// Test-only pitfalls ([`crate::backend::cpu::model::fault`]).
    pub faults: Faults,
}

impl Mix<'_> {
    /// `x[r0.., d] += out` for rows `r0..T` of the window, from the normed rows `h[T, d]`.
    pub(crate) fn run(
        &self,
        h: &[f32],
        r0: usize,
        x: &mut [f32],
        sc: &mut Scratch,
    ) -> Result<(), ForwardError> {
        let Mix {
            hc,
            w,
            d,
            layer,
            eps,
            faults,
        } = *self;
        let t_len = h.len() / d;
        let (hk, hv) = (hc.linear_num_key_heads, hc.linear_num_value_heads);
        let (dk, dv) = (hc.linear_key_head_dim, hc.linear_value_head_dim);
        let (conv_dim, vdim, kw) = (hc.conv_dim(), hc.value_dim(), hc.linear_conv_kernel_dim);
        let width = conv_dim + vdim + 2 * hv;

        // proj[T, conv_dim + Hv·Dv + 2·Hv] = [q|k|v, z, b, a]
        let proj = take(&mut sc.proj, t_len * width);
        matmul_wt(h, t_len, d, &w.in_proj, width, proj, false);
        // The fast exp below clamps a NaN: non-finite values are caught before it can.
        check_finite(proj, 1, width, Part::DeltaNetInput, layer, 0)?;
        let proj = &*proj;

        // c[T, conv_dim] = silu(conv(q|k|v)); then q and k L2-normalised in place.
        let c = take(&mut sc.c, t_len * conv_dim);
        let conv: std::borrow::Cow<[f32]> = if faults.pitfall(Pitfall::ConvReversed) {
            w.conv.chunks(conv_dim).rev().flatten().copied().collect()
        } else {
            (&w.conv[..]).into()
        };
        let kd = hk * dk;
        let q_scale = if faults.pitfall(Pitfall::NoKeyScale) {
            1.0
        } else {
            1.0 / (dk as f32).sqrt()
        };
        c.par_chunks_mut(conv_dim).enumerate().for_each(|(t, row)| {
            conv_silu_row(proj, width, &conv, kw, t, row);
            let (q, k) = row[..2 * kd].split_at_mut(kd);
            q.chunks_mut(dk).for_each(|x| l2_normalize(x, q_scale));
            k.chunks_mut(dk).for_each(|x| l2_normalize(x, 1.0));
        });

        // beta[T, Hv], g[T, Hv] from b and a.
        let beta = take(&mut sc.beta, t_len * hv);
        let g = take(&mut sc.g, t_len * hv);
        for t in 0..t_len {
            let r = &proj[t * width + conv_dim + vdim..(t + 1) * width];
            let (b, a) = r.split_at(hv);
            for j in 0..hv {
                beta[t * hv + j] = sigmoid(b[j]);
                g[t * hv + j] = -w.a_log[j].exp() * softplus(a[j] + w.dt_bias[j]);
            }
        }
        check_finite(g, hv, 1, Part::DeltaNetGate, layer, 0)?;
        check_finite(beta, hv, 1, Part::DeltaNetGate, layer, 0)?;

        let c = &*c;
        let o = take(&mut sc.o, t_len * vdim);
        if faults.pitfall(Pitfall::KeysTiled) {
            // Value head j given key head j % Hk: expand the key heads to one per value head.
            let tile = |off: usize| -> Vec<f32> {
                c.chunks(conv_dim)
                    .flat_map(|row| {
                        (0..hv).flat_map(move |j| row[off + (j % hk) * dk..][..dk].to_vec())
                    })
                    .collect()
            };
            let (q, k) = (tile(0), tile(kd));
            let v: Vec<f32> = c
                .chunks(conv_dim)
                .flat_map(|r| r[2 * kd..].to_vec())
                .collect();
            let shape = DeltaShape::dense(t_len, hv, hv, dk, dv);
            chunked(&q, &k, &v, beta, g, &shape, o);
        } else {
            let shape = DeltaShape {
                strides: [conv_dim; 3],
                ..DeltaShape::dense(t_len, hk, hv, dk, dv)
            };
            chunked(c, &c[kd..], &c[2 * kd..], beta, g, &shape, o);
        }
        check_finite(o, hv, dv, Part::State, layer, 0)?;

        // y = rmsnorm(o) · act(z), per value head, for the rows that are read on.
        let n = t_len - r0;
        let y = take(&mut sc.y, n * vdim);
        let o = &*o;
        y.par_chunks_mut(vdim).enumerate().for_each(|(i, yr)| {
            let t = r0 + i;
            let z = &proj[t * width + conv_dim..t * width + conv_dim + vdim];
            for ((yh, oh), zh) in yr
                .chunks_mut(dv)
                .zip(o[t * vdim..(t + 1) * vdim].chunks(dv))
                .zip(z.chunks(dv))
            {
                rms_norm_row(oh, &w.norm, eps, yh);
                gate_row(yh, zh, hc.output_gate);
            }
        });
        matmul_wt(y, n, vdim, &w.out_proj, d, x, true);
        Ok(())
    }
}

/// Row `t` of `silu(conv)`: `row[ch] = silu(Σ_j conv[j, ch] · proj[t − (K − 1) + j, ch])`
/// (`conv` tap-major `[K, conv_dim]`), rows before the window's start being zero. Compiled
/// for AVX2+FMA too (same bits).
#[multiversion(targets("x86_64+avx2+fma"))]
pub fn conv_silu_row(
    proj: &[f32],
    width: usize,
    conv: &[f32],
    kw: usize,
    t: usize,
    row: &mut [f32],
) {
    let ch = row.len();
    row.fill(0.0);
    for j in 0..kw {
        // Tap j reads token t − (K − 1) + j.
        let Some(src) = (t + j).checked_sub(kw - 1) else {
            continue;
        };
        let x = &proj[src * width..src * width + ch];
        for ((o, &v), &tap) in row.iter_mut().zip(x).zip(&conv[j * ch..(j + 1) * ch]) {
            *o += tap * v;
        }
    }
    row.iter_mut().for_each(|o| *o = silu(*o));
}

/// `y ·= act(z)` elementwise. Compiled for AVX2+FMA too (same bits).
#[multiversion(targets("x86_64+avx2+fma"))]
pub fn gate_row(y: &mut [f32], z: &[f32], gate: OutputGate) {
    for (a, &zv) in y.iter_mut().zip(z) {
        *a *= match gate {
            OutputGate::Silu => silu(zv),
            OutputGate::Sigmoid => sigmoid(zv),
        };
    }
}

#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp::exp(-x))
}

#[inline(always)]
fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `log(1 + e^x)`, as torch's softplus: `x` itself above 20.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `x ← x · scale / sqrt(Σx² + 1e-6)`.
pub fn l2_normalize(x: &mut [f32], scale: f32) {
    let ss: f32 = x.iter().map(|a| a * a).sum();
    let f = scale / (ss + 1e-6).sqrt();
    x.iter_mut().for_each(|a| *a *= f);
}
