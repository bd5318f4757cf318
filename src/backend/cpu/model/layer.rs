//! One decoder layer on the CPU: RMSNorm, the token mixer (softmax attention in
//! [`super::attention`], or a Gated DeltaNet in [`super::delta_net`]), RMSNorm, the MLP
//! (dense SwiGLU here, or a mixture of experts in [`super::moe`]). CUDA twin:
//! `backend/cuda/model/layer.rs`.

use super::delta_net;
use super::moe;
use super::profile::{Laps, Phase};
use super::split::{Link, Stop};
use super::CpuModel;
use crate::backend::cpu::matmul::matmul_wt;
use crate::backend::cpu::norm::{rms_norm, swiglu};
use crate::backend::cpu::rope::RopeTable;
use crate::kv::KvDtype;
use crate::model::config::ModelConfig;
use crate::model::layout::{Ffn, Mixer};

impl CpuModel {
    /// One decoder layer for rows `rows` of a window (`x` holds exactly those rows of the
    /// residual stream). After the last layer only the rows that predict a target are read,
    /// so there the mixer's output projection and the MLP run for rows `first_target - 1..`
    /// only (every row still contributes its key and value, or its State update); the same
    /// bits as for all rows.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn layer(
        &self,
        li: usize,
        rows: std::ops::Range<usize>,
        x: &mut [f32],
        b: &mut Bufs,
        pass: &Pass,
        link: &Link,
        laps: &mut Laps,
    ) -> Result<(), Stop> {
        let c = &self.config;
        let l = &self.weights.layers[li];
        let (d, f) = (c.hidden_size, c.intermediate_size);
        let eps = c.rms_norm_eps;
        let (lo, hi) = (rows.start, rows.end);
        let m = hi - lo;
        let r0 = if li + 1 == self.weights.layers.len() {
            (pass.first_target - 1).max(lo)
        } else {
            lo
        };

        laps.lap(Phase::QkvPrep);
        rms_norm(x, &l.norm, eps, &mut b.h[..m * d]);
        laps.lap(Phase::Norms);
        match &l.mixer {
            Mixer::Attention(a) => {
                self.attention(li, a, rows, r0, x, b, pass, link, laps)?;
            }
            Mixer::DeltaNet(g) => {
                // Windows of hybrid models are never split: the whole window is here.
                debug_assert!(lo == 0 && matches!(link, Link::Alone));
                let hc = c.hybrid.as_ref().expect("a Gated DeltaNet layer is hybrid");
                let xr = &mut x[(r0 - lo) * d..];
                let mix = delta_net::Mix {
                    hc,
                    w: g,
                    d,
                    layer: li,
                    eps,
                    faults: self.faults,
                };
                mix.run(&b.h[..m * d], r0 - lo, xr, &mut b.delta_net)?;
                laps.lap(Phase::Attention);
            }
        }
        if r0 >= hi {
            crate::ui::layer_rows_done(m);
            return Ok(());
        }
        let n = hi - r0;
        let x = &mut x[(r0 - lo) * d..];

        // MLP block.
        match &l.ffn {
            Ffn::Dense(mlp) => {
                let (h, gu, act) = (
                    &mut b.h[..n * d],
                    &mut b.gu[..n * 2 * f],
                    &mut b.act[..n * f],
                );
                rms_norm(x, &l.ffn_norm, eps, h);
                laps.lap(Phase::Norms);
                matmul_wt(h, n, d, &mlp.gate_up, 2 * f, gu, false);
                laps.lap(Phase::GateUp);
                swiglu(gu, f, act);
                laps.lap(Phase::Swiglu);
                matmul_wt(act, n, f, &mlp.down, d, x, true);
                laps.lap(Phase::Down);
            }
            Ffn::Moe(moe) => {
                let h = &mut b.h[..n * d];
                rms_norm(x, &l.ffn_norm, eps, h);
                laps.lap(Phase::Norms);
                moe::moe_block(
                    moe,
                    h,
                    n,
                    d,
                    &mut x[..n * d],
                    self.faults,
                    self.routing.as_ref(),
                );
                laps.lap(Phase::Down);
            }
        }
        crate::ui::layer_rows_done(m);
        Ok(())
    }
}

/// What one layer needs besides its rows.
pub(crate) struct Pass<'a> {
    pub(crate) first_target: usize,
    pub(crate) kv: KvDtype,
    pub(crate) rope: &'a RopeTable,
    /// The test-only `rope-shift` fault's table for layer 0's keys.
    pub(crate) shifted_rope: Option<&'a RopeTable>,
}

/// Work buffers for rows `lo..hi` of a window.
pub(crate) struct Bufs {
    /// h[hi-lo, d]: normed rows.
    pub(super) h: Vec<f32>,
    /// qkv[hi-lo, Hq·D + 2·Hkv·D (+ Hq·D of output gate)]
    pub(super) qkv: Vec<f32>,
    /// q[hi, Hq, D]: rows lo.. are this part's (the rest are never read).
    pub(super) q: Vec<f32>,
    /// k[hi, Hkv, D], v[hi, Hkv, D]: rows ..lo come from the first part of a split window.
    pub(super) k: Vec<f32>,
    pub(super) v: Vec<f32>,
    /// attn[hi, Hq, D]: attention output, rows lo.. written.
    pub(super) attn: Vec<f32>,
    /// gu[hi-lo, 2F], act[hi-lo, F]
    pub(super) gu: Vec<f32>,
    pub(super) act: Vec<f32>,
    /// The Gated DeltaNet layers' buffers (allocated at the first such layer).
    pub(super) delta_net: delta_net::Scratch,
}

impl Bufs {
    pub(crate) fn new(c: &ModelConfig, lo: usize, hi: usize) -> Bufs {
        let (d, qd, kvd, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let gate = if c.attention_output_gate() { qd } else { 0 };
        let m = hi - lo;
        Bufs {
            h: vec![0.0; m * d],
            qkv: vec![0.0; m * (qd + 2 * kvd + gate)],
            q: vec![0.0; hi * qd],
            k: vec![0.0; hi * kvd],
            v: vec![0.0; hi * kvd],
            attn: vec![0.0; hi * qd],
            gu: vec![0.0; m * 2 * f],
            act: vec![0.0; m * f],
            delta_net: Default::default(),
        }
    }
}
