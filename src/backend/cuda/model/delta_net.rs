//! A Gated DeltaNet layer's token mixer on CUDA, over every packed row: the input
//! projections, the causal convolution, the gates, the chunked gated delta rule with each
//! window's State in shared memory (starting at zero, never leaving the kernel), the gated
//! output norm and the output projection. CPU twin: `backend/cpu/model/delta_net.rs`.

use super::buffers::Buffers;
use super::layer::{Ints, Pass};
use super::nonfinite::StatePart;
use super::weights::Leaf;
use super::CudaModel;
use crate::backend::cuda::launch::{self, Ptr};
use crate::backend::cuda::plan;
use crate::model::config::OutputGate;
use crate::model::layout::DeltaNet;
use anyhow::Result;

impl CudaModel {
    /// A Gated DeltaNet layer over the packed rows: from the normed rows in `h`, adds
    /// `out_proj(rmsnorm(o) · act(z))` to `x` (the CPU twin: `Mix::run` in `backend/cpu/model/delta_net.rs`).
    /// Each window's State starts at zero inside the rule's kernel and never leaves it.
    pub(super) fn delta_net(
        &self,
        li: usize,
        dn: &DeltaNet<Leaf>,
        b: &Buffers,
        p: &Pass,
    ) -> Result<()> {
        let m = p.rows();
        let windows = p.plan.windows.len();
        let spans = p.spans.as_ref().expect("uploaded for hybrid models");
        let c = &self.config;
        let h = c.hybrid.as_ref().expect("a Gated DeltaNet layer is hybrid");
        let g = &self.gpu;
        let d = c.hidden_size;
        let (hk, hv, dk, dv) = (
            h.linear_num_key_heads,
            h.linear_num_value_heads,
            h.linear_key_head_dim,
            h.linear_value_head_dim,
        );
        let (conv_dim, vdim) = (h.conv_dim(), h.value_dim());
        let width = conv_dim + vdim + 2 * hv;
        let (pos, win) = (p.ints(Ints::Positions, 0), p.ints(Ints::Windows, 0));
        let scan = |x: u64, cols: usize, part: StatePart| -> Result<()> {
            g.launch(
                "nonfinite_scan",
                (plan::blocks_for(m * cols, 256), 1, 1),
                256,
                0,
                &launch::NonfiniteScan {
                    x: Ptr::new(x),
                    rows: m as i64,
                    cols: cols as i32,
                    pos,
                    win,
                    layer: li as i32,
                    part: part as i32,
                    err: Ptr::new(b.err.at(8)),
                },
            )
        };
        // proj[m, width] = [q|k|v, z, b, a]
        self.matmul_wt(&b.h, m, d, &dn.in_proj, width, &b.scratch, false)?;
        scan(b.scratch.ptr, width, StatePart::Input)?;
        // c[m, conv_dim] = silu(conv(q|k|v)), then q and k normalised in place; gates.
        g.launch(
            "delta_conv_silu",
            (plan::blocks_for(m * conv_dim, 256), 1, 1),
            256,
            0,
            &launch::DeltaConvSilu {
                proj: Ptr::new(b.scratch.ptr),
                width: width as i32,
                conv: Ptr::new(dn.conv.ptr),
                kw: h.linear_conv_kernel_dim as i32,
                pos,
                rows: m as i64,
                conv_dim: conv_dim as i32,
                c: Ptr::new(b.conv.ptr),
            },
        )?;
        let (beta, gdecay) = (b.gates.ptr, b.gates.at(4 * m * hv));
        g.launch(
            "delta_prep",
            (plan::blocks_for(m * (2 * hk + 1), 8), 1, 1),
            256,
            0,
            &launch::DeltaPrep {
                c: Ptr::new(b.conv.ptr),
                conv_dim: conv_dim as i32,
                proj: Ptr::new(b.scratch.ptr),
                width: width as i32,
                a_log: Ptr::new(dn.a_log.ptr),
                dt_bias: Ptr::new(dn.dt_bias.ptr),
                rows: m as i64,
                hk: hk as i32,
                dk: dk as i32,
                hv: hv as i32,
                dv: dv as i32,
                q_scale: 1.0 / (dk as f32).sqrt(),
                beta: Ptr::new(beta),
                g: Ptr::new(gdecay),
            },
        )?;
        scan(gdecay, hv, StatePart::Decay)?;
        scan(beta, hv, StatePart::Beta)?;
        // o[m, Hv, Dv]: the State's read-out (in `q`, free in this layer), by the chunked
        // rule with each window's State in shared memory (`plan::check_delta_net`), its
        // products on tensor cores in bf16 mode.
        g.launch(
            launch::delta_chunked_entry(self.precision),
            (windows as u32, hv as u32, 1),
            launch::DELTA_CHUNKED_THREADS,
            launch::delta_chunked_smem(dk, dv) as usize,
            &launch::DeltaRuleChunked {
                c: Ptr::new(b.conv.ptr),
                conv_dim: conv_dim as i32,
                beta: Ptr::new(beta),
                g: Ptr::new(gdecay),
                spans: Ptr::new(spans.ptr),
                hk: hk as i32,
                dk: dk as i32,
                hv: hv as i32,
                dv: dv as i32,
                state: Ptr::NULL,
                o: Ptr::new(b.q.ptr),
            },
        )?;
        scan(b.q.ptr, vdim, StatePart::State)?;
        // y[m, Hv·Dv] = rmsnorm(o) · w · act(z) (in `attn`, the out-projection's input).
        g.launch(
            "delta_gated_norm",
            (plan::blocks_for(m * hv, 8), 1, 1),
            256,
            0,
            &launch::DeltaGatedNorm {
                o: Ptr::new(b.q.ptr),
                proj: Ptr::new(b.scratch.ptr),
                width: width as i32,
                conv_dim: conv_dim as i32,
                w: Ptr::new(dn.norm.ptr),
                n: m as i64,
                hv: hv as i32,
                dv: dv as i32,
                eps: c.rms_norm_eps,
                sigmoid_gate: (h.output_gate == OutputGate::Sigmoid) as i32,
                y: Ptr::new(b.attn.ptr),
                out_bf16: self.bf16_out(),
            },
        )?;
        self.matmul_wt(&b.attn, m, vdim, &dn.out_proj, d, &b.x, true)?;
        Ok(())
    }
}
