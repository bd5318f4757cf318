//! Softmax attention on CUDA, for one layer over every packed row: the qkv GEMM,
//! `qkv_prep` (bias, q/k norms, RoPE, the Hadamard rotation of the representation, K/V
//! stored through the Main KV representation), causal attention reading the stored K/V per
//! window tile, the output rotated back where values were rotated, the output gate, and the
//! output projection accumulating into the residual stream. CPU twin:
//! `backend/cpu/model/attention.rs`.

use super::buffers::Buffers;
use super::layer::{Ints, Pass};
use super::weights::Leaf;
use super::CudaModel;
use crate::backend::cuda::launch::{self, Ptr};
use crate::backend::cuda::plan::{self, AttnKernel};
use crate::model::layout::Attention;
use anyhow::Result;

impl CudaModel {
    /// The attention block of layer `li` from the normed rows in `h`: adds
    /// `o-proj(attention)` (gated: `· sigmoid(gate)`) to `x`, every row's key and value
    /// stored.
    pub(super) fn attention(
        &self,
        li: usize,
        at: &Attention<Leaf>,
        b: &Buffers,
        p: &Pass,
    ) -> Result<()> {
        let c = &self.config;
        let (d, qd, kvd, hd, hq, hkv) = (
            c.hidden_size,
            c.q_dim(),
            c.kv_dim(),
            c.head_dim,
            c.num_heads,
            c.num_kv_heads,
        );
        let (m, eps, g) = (p.rows(), c.rms_norm_eps, &self.gpu);
        // Attention block: [q | k | v (| gate)] rows, the gate left in scratch.
        let gate_w = if at.gated { qd } else { 0 };
        let qkv_w = qd + 2 * kvd + gate_w;
        self.matmul_wt(&b.h, m, d, &at.qkv, qkv_w, &b.scratch, false)?;
        g.launch(
            &plan::qkv_entry(p.kv, hd)?,
            (plan::blocks_for(m * (hq + 2 * hkv), plan::QKV_WARPS), 1, 1),
            (plan::QKV_WARPS * 32) as u32,
            0,
            &launch::QkvPrep {
                qkv: Ptr::new(b.scratch.ptr),
                bias: at.qkv_bias.as_ref().map_or(Ptr::NULL, |x| Ptr::new(x.ptr)),
                q_norm: at.q_norm.as_ref().map_or(Ptr::NULL, |x| Ptr::new(x.ptr)),
                k_norm: at.k_norm.as_ref().map_or(Ptr::NULL, |x| Ptr::new(x.ptr)),
                rope_cos: Ptr::new(p.rope.cos.ptr),
                rope_sin: Ptr::new(p.rope.sin.ptr),
                pos: p.ints(Ints::Positions, 0),
                win: p.ints(Ints::Windows, 0),
                q_out: Ptr::new(b.q.ptr),
                q_bf16: matches!(self.attention_kernel(), AttnKernel::Mma { .. }) as i32,
                kt: b.k.arg(p.kv.layer_scales(li).0),
                vt: b.v.arg(p.kv.layer_scales(li).1),
                err: Ptr::new(b.err.ptr),
                layer: li as i32,
                rows: m as i64,
                hq: hq as i32,
                hkv: hkv as i32,
                D: hd as i32,
                row_stride: qkv_w as i32,
                rot: c.rotary_dim() as i32,
                eps,
            },
        )?;
        self.launch_attention(li, b, p)?;
        if p.kv.rotation(hd).values {
            // Values were stored rotated: the attention output goes back, head by head.
            g.launch(
                "hadamard_rows",
                (plan::blocks_for(m * hq, 8), 1, 1),
                256,
                0,
                &launch::HadamardRows {
                    x: Ptr::new(b.attn.ptr),
                    x_bf16: self.bf16_out(),
                    n: (m * hq) as i64,
                    D: hd as i32,
                },
            )?;
        }
        if at.gated {
            g.launch(
                "attn_output_gate",
                (plan::blocks_for(m * qd, 256), 1, 1),
                256,
                0,
                &launch::AttnOutputGate {
                    attn: Ptr::new(b.attn.ptr),
                    attn_bf16: self.bf16_out(),
                    qkv: Ptr::new(b.scratch.ptr),
                    row_stride: qkv_w as i32,
                    gate_off: (qd + 2 * kvd) as i32,
                    rows: m as i64,
                    qd: qd as i32,
                },
            )?;
        }
        self.matmul_wt(&b.attn, m, qd, &at.o_proj, d, &b.x, true)?;
        Ok(())
    }

    /// Causal attention of every tile's query rows over their window's stored keys and
    /// values, into `attn`.
    fn launch_attention(&self, li: usize, b: &Buffers, p: &Pass) -> Result<()> {
        let (kv, tiles, n_tiles) = (p.kv, &p.tiles, p.n_tiles);
        let (ks, vs) = kv.layer_scales(li);
        let c = &self.config;
        let k = self.attention_kernel();
        let entry = k.entry(kv);
        let scale = 1.0f32 / (c.head_dim as f32).sqrt();
        let grid = (n_tiles as u32, c.num_heads as u32, 1);
        match k {
            AttnKernel::Mma { .. } => self.gpu.launch(
                &entry,
                grid,
                128,
                0,
                &launch::AttnMma {
                    q: Ptr::new(b.q.ptr),
                    kt: b.k.arg(ks),
                    vt: b.v.arg(vs),
                    tiles: Ptr::new(tiles.ptr),
                    out: Ptr::new(b.attn.ptr),
                    hq: c.num_heads as i32,
                    hkv: c.num_kv_heads as i32,
                    sl2: scale * std::f32::consts::LOG2_E,
                },
            ),
            AttnKernel::F32 => {
                let smem = k.dynamic_smem(c.head_dim);
                self.gpu.launch(
                    &entry,
                    grid,
                    128,
                    smem,
                    &launch::AttnF32 {
                        q: Ptr::new(b.q.ptr),
                        kt: b.k.arg(ks),
                        vt: b.v.arg(vs),
                        tiles: Ptr::new(tiles.ptr),
                        out: Ptr::new(b.attn.ptr),
                        out_bf16: self.bf16_out(),
                        hq: c.num_heads as i32,
                        hkv: c.num_kv_heads as i32,
                        D: c.head_dim as i32,
                        scale,
                    },
                )
            }
        }
    }
}
