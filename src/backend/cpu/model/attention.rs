//! Softmax attention on the CPU, for one layer over a window's rows: the qkv projection,
//! bias, q/k norms and RoPE, the representation's Hadamard rotation of queries and keys (and
//! values), keys and values stored through the Main KV representation and read back, causal
//! attention, the output rotated back where values were rotated, the output gate, the output
//! projection. CUDA twin:
//! `backend/cuda/model/attention.rs`.

use super::fault::Pitfall;
use super::kv_store::{self, Stored};
use super::layer::{Bufs, Pass};
use super::profile::{Laps, Phase};
use super::split::{Link, Stop};
use super::weights::Attention;
use super::CpuModel;
use crate::backend::cpu::attention::{causal_attention, AttnShape};
use crate::backend::cpu::matmul::matmul_wt;
use crate::backend::cpu::norm::rms_norm_inplace;
use crate::kv::hadamard;
use crate::model::error::{check_finite, Part};
use rayon::prelude::*;

impl CpuModel {
    /// The attention block of rows `lo..hi` from their normed rows in `b.h`: adds
    /// `o-proj(attention)` (gated: `· sigmoid(gate)`) to rows `r0..hi` of `x`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention(
        &self,
        li: usize,
        l: &Attention,
        rows: std::ops::Range<usize>,
        r0: usize,
        x: &mut [f32],
        b: &mut Bufs,
        pass: &Pass,
        link: &Link,
        laps: &mut Laps,
    ) -> Result<(), Stop> {
        let c = &self.config;
        let (d, hd, hq, hkv) = (c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads);
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let gate_w = if l.gated { qd } else { 0 };
        let qkv_w = qd + 2 * kvd + gate_w;
        let eps = c.rms_norm_eps;
        let (lo, hi) = (rows.start, rows.end);
        let m = hi - lo;
        let qkv = &mut b.qkv[..m * qkv_w];
        matmul_wt(&b.h[..m * d], m, d, &l.qkv, qkv_w, qkv, false);
        laps.lap(Phase::Qkv);
        if let Some(bias) = &l.qkv_bias {
            qkv.par_chunks_mut(qkv_w)
                .for_each(|r| r.iter_mut().zip(bias.iter()).for_each(|(a, b)| *a += b));
        }
        // Split qkv[m, q+2kv(+q)] into rows lo..hi of q[hi, Hq, D], k[hi, Hkv, D],
        // v[hi, Hkv, D] (the gate, if any, stays in qkv).
        let (q, k, v) = (
            &mut b.q[lo * qd..hi * qd],
            &mut b.k[lo * kvd..hi * kvd],
            &mut b.v[lo * kvd..hi * kvd],
        );
        for (t, r) in qkv.chunks(qkv_w).enumerate() {
            q[t * qd..(t + 1) * qd].copy_from_slice(&r[..qd]);
            k[t * kvd..(t + 1) * kvd].copy_from_slice(&r[qd..qd + kvd]);
            v[t * kvd..(t + 1) * kvd].copy_from_slice(&r[qd + kvd..qd + 2 * kvd]);
        }
        let norm_after_rope = self.faults.pitfall(Pitfall::QkNormAfterRope);
        let qk_norm = |q: &mut [f32], k: &mut [f32]| {
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                rms_norm_inplace(q, qn, eps);
                rms_norm_inplace(k, kn, eps);
            }
        };
        if !norm_after_rope {
            qk_norm(q, k);
        }
        pass.rope.apply_from(q, hq, lo);
        match pass.shifted_rope {
            Some(shifted) if li == 0 => shifted.apply_from(k, hkv, lo),
            _ => pass.rope.apply_from(k, hkv, lo),
        }
        if norm_after_rope {
            qk_norm(q, k);
        }
        // Keys are stored rotated (kv_store), so queries turn with them; the scores are the
        // same up to rounding and quantization.
        let rotation = pass.kv.rotation(hd);
        if rotation.keys {
            q.par_chunks_mut(hd).for_each(hadamard::rotate);
        }
        check_finite(q, hq, hd, Part::Query, li, lo)?;
        kv_store::store(k, hkv, hd, pass.kv, Stored::Key, li, lo)?;
        kv_store::store(v, hkv, hd, pass.kv, Stored::Value, li, lo)?;
        match link {
            Link::Alone => {}
            Link::Give(to) => to.give(li, &b.k, &b.v),
            Link::Take(from) => from.take(li, &mut b.k[..lo * kvd], &mut b.v[..lo * kvd])?,
        }
        laps.lap(Phase::QkvPrep);
        if r0 >= hi {
            return Ok(());
        }
        let n = hi - r0;
        let shape = AttnShape {
            tokens: hi,
            q_heads: hq,
            kv_heads: hkv,
            head_dim: hd,
        };
        causal_attention(&b.q, &b.k, &b.v, &shape, r0, &mut b.attn);
        if rotation.values {
            // Values were stored rotated: each head's output goes back.
            b.attn[r0 * qd..hi * qd]
                .par_chunks_mut(hd)
                .for_each(hadamard::rotate);
        }
        check_finite(
            &b.attn[r0 * qd..hi * qd],
            hq,
            hd,
            Part::AttentionOutput,
            li,
            r0,
        )?;
        if l.gated {
            let silu = self.faults.pitfall(Pitfall::GateSilu);
            let attn = &mut b.attn[r0 * qd..hi * qd];
            attn.par_chunks_mut(qd)
                .zip(qkv[(r0 - lo) * qkv_w..].par_chunks(qkv_w))
                .for_each(|(a, r)| {
                    for (o, &gv) in a.iter_mut().zip(&r[qd + 2 * kvd..]) {
                        let sig = 1.0 / (1.0 + crate::backend::cpu::exp::exp(-gv));
                        *o *= if silu { gv * sig } else { sig };
                    }
                });
        }
        laps.lap(Phase::Attention);
        let x = &mut x[(r0 - lo) * d..];
        matmul_wt(&b.attn[r0 * qd..], n, qd, &l.o_proj, d, x, true);
        laps.lap(Phase::OProj);
        Ok(())
    }
}
