//! One decoder layer on CUDA, over every packed row of a pass: RMSNorm, the token mixer
//! (softmax attention in [`super::attention`], or a Gated DeltaNet in
//! [`super::delta_net`]), RMSNorm, the MLP (dense SwiGLU here, or a mixture of experts in
//! [`super::moe`]). CPU twin: `backend/cpu/model/layer.rs`.
//!
//! After the last layer only the rows that predict a target are read, so there, as on the
//! CPU, the MLP runs only for the rows from each window's first scored row to its end
//! (`PassPlan::last_layer`): they are gathered into `x_last` first, and the head reads them
//! there. Every row still gives its key and value, or its State update.

use super::buffers::{Buffers, Rope};
use super::moe;
use super::weights::Leaf;
use super::CudaModel;
use crate::backend::cuda::device::{DevBuf, Gpu};
use crate::backend::cuda::gemm::Mat;
use crate::backend::cuda::launch::{self, Any, Ptr};
use crate::backend::cuda::plan::{self, AttnKernel, Precision};
use crate::kv::KvDtype;
use crate::model::layout::{Ffn, Layer, Mixer, SwiGlu};
use crate::model::pass::PassPlan;
use anyhow::Result;

/// The index arrays of a pass on the device (i32 each), in this order in one buffer.
#[derive(Clone, Copy, Debug)]
pub(super) enum Ints {
    /// `[rows]`: each row's token, position in its window, window.
    Tokens,
    Positions,
    Windows,
    /// `[scored]`: the rows that predict a target, and the targets.
    Scored,
    Targets,
    /// `[last-layer rows]`: the rows the last layer's MLP produces.
    LastLayer,
    /// `[scored]`: where each scored row is among the last layer's rows.
    ScoredInLastLayer,
}

/// One forward pass as every layer sees it: the host's plan and its device copy.
pub(super) struct Pass<'a> {
    pub(super) plan: PassPlan,
    pub(super) kv: KvDtype,
    pub(super) rope: &'a Rope,
    ints: DevBuf,
    /// Byte offset of each of [`Ints`] in `ints`.
    at: [usize; 7],
    /// Attention's query tiles (`plan::attention_tiles`).
    pub(super) tiles: DevBuf,
    pub(super) n_tiles: usize,
    /// The State kernels' windows, `(first row, rows)` each (hybrid models).
    pub(super) spans: Option<DevBuf>,
}

impl<'a> Pass<'a> {
    /// Uploads `plan`'s index arrays, attention tiles and State spans.
    pub(super) fn upload(
        m: &CudaModel,
        plan: PassPlan,
        kv: KvDtype,
        rope: &'a Rope,
    ) -> Result<Pass<'a>> {
        let g = &m.gpu;
        let arrays: [&[u32]; 7] = [
            &plan.tokens,
            &plan.positions,
            &plan.window_of,
            &plan.scored,
            &plan.targets,
            &plan.last_layer,
            &plan.scored_in_last_layer,
        ];
        let mut at = [0usize; 7];
        let mut all: Vec<i32> = Vec::with_capacity(arrays.iter().map(|a| a.len()).sum());
        for (o, a) in at.iter_mut().zip(arrays) {
            *o = 4 * all.len();
            all.extend(a.iter().map(|&v| v as i32));
        }
        let ints = g.upload(&all)?;
        let spans: Vec<(usize, usize)> = plan.windows.iter().map(|w| (w.row0, w.len)).collect();
        let tiles: Vec<[i32; 4]> =
            plan::attention_tiles(&spans, m.attention_kernel().rows_per_tile())
                .into_iter()
                .map(|t| t.to_int4())
                .collect();
        let spans = match m.config.hybrid {
            Some(_) => {
                let sp: Vec<[i32; 2]> = spans.iter().map(|&(r, n)| [r as i32, n as i32]).collect();
                Some(g.upload(&sp)?)
            }
            None => None,
        };
        Ok(Pass {
            tiles: g.upload(&tiles)?,
            n_tiles: tiles.len(),
            plan,
            kv,
            rope,
            ints,
            at,
            spans,
        })
    }

    /// Packed rows.
    pub(super) fn rows(&self) -> usize {
        self.plan.rows()
    }

    /// Index array `which` from its element `from` on.
    pub(super) fn ints(&self, which: Ints, from: usize) -> Ptr<i32> {
        Ptr::new(self.ints.at(self.at[which as usize] + 4 * from))
    }
}

impl CudaModel {
    /// `out[r] = rmsnorm(x[rows ? rows[r] : r]) · w` for `n` rows, in the precision.
    pub(super) fn norm(
        &self,
        x: &DevBuf,
        rows: Ptr<i32>,
        w: &DevBuf,
        out: &DevBuf,
        n: usize,
    ) -> Result<()> {
        let c = &self.config;
        self.gpu.launch(
            "rms_norm",
            (n as u32, 1, 1),
            256,
            0,
            &launch::RmsNorm {
                x: Ptr::new(x.ptr),
                rows,
                w: Ptr::new(w.ptr),
                out: Ptr::<Any>::new(out.ptr),
                out_bf16: self.bf16_out(),
                d: c.hidden_size as i32,
                eps: c.rms_norm_eps,
            },
        )
    }

    /// `out[m, n] (+)= x[m, k] · w[n, k]ᵀ`, row-major, each operand at its buffer's start
    /// (the CPU twin: `backend::cpu::matmul::matmul_wt`, with the same arguments); inputs in
    /// the precision, `out` f32, accumulated into when `accumulate`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_wt(
        &self,
        x: &DevBuf,
        m: usize,
        k: usize,
        w: &DevBuf,
        n: usize,
        out: &DevBuf,
        accumulate: bool,
    ) -> Result<()> {
        self.blas.gemm(
            &self.gpu,
            m,
            n,
            k,
            Mat::of(x, 0, k),
            Mat::of(w, 0, k),
            Mat::of(out, 0, n),
            accumulate,
        )
    }

    /// 1 when activations are stored in bf16 (the precision), else 0.
    pub(super) fn bf16_out(&self) -> i32 {
        (self.precision == Precision::Bf16) as i32
    }

    /// Layer `li` over the pass's rows (the last layer's MLP over `x_last`'s, see the module
    /// doc); a MoE layer adds the routing of its rows to the pass's device counts.
    pub(super) fn layer(&self, li: usize, l: &Layer<Leaf>, b: &Buffers, p: &Pass) -> Result<()> {
        let m = p.rows();
        self.norm(&b.x, Ptr::NULL, &l.norm, &b.h, m)?;
        match &l.mixer {
            Mixer::Attention(at) => self.attention(li, at, b, p)?,
            Mixer::DeltaNet(dn) => self.delta_net(li, dn, b, p)?,
        }
        let (x, n) = if self.trims(li, p) {
            let t = p.plan.last_layer.len();
            self.gather_rows(&b.x, p.ints(Ints::LastLayer, 0), &b.x_last, t)?;
            (&b.x_last, t)
        } else {
            (&b.x, m)
        };
        self.norm(x, Ptr::NULL, &l.ffn_norm, &b.h, n)?;
        match &l.ffn {
            Ffn::Dense(mlp) => self.mlp(mlp, b, x, n),
            Ffn::Moe(mw) => {
                let io = moe::Io {
                    x,
                    h: &b.h,
                    norm: &l.ffn_norm,
                    scratch: &b.scratch,
                    act: &b.act,
                };
                let bufs = b.moe.as_ref().expect("allocated for MoE models");
                self.moe(mw, bufs, &io, n)
            }
        }
    }

    /// Whether layer `li` runs its MLP on the last layer's rows only.
    pub(super) fn trims(&self, li: usize, p: &Pass) -> bool {
        li + 1 == self.weights.layers.len()
            && p.plan.trims_last_layer()
            && self
                .trim_last_layer
                .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `out[r] = x[rows[r]]` for `n` f32 rows of the model width (`embed_gather` on f32
    /// rows: a copy).
    fn gather_rows(&self, x: &DevBuf, rows: Ptr<i32>, out: &DevBuf, n: usize) -> Result<()> {
        self.gpu.launch(
            "embed_gather",
            (n as u32, 1, 1),
            256,
            0,
            &launch::EmbedGather {
                tokens: rows,
                embed: Ptr::new(x.ptr),
                embed_bf16: 0,
                x: Ptr::new(out.ptr),
                d: self.config.hidden_size as i32,
            },
        )
    }

    /// The dense SwiGLU MLP of `n` rows: from the normed rows in `h`, adds
    /// `down(silu(gate) · up)` to `x`.
    fn mlp(&self, mlp: &SwiGlu<Leaf>, b: &Buffers, x: &DevBuf, n: usize) -> Result<()> {
        let (d, f) = (self.config.hidden_size, mlp.width);
        let g = &self.gpu;
        self.matmul_wt(&b.h, n, d, &mlp.gate_up, 2 * f, &b.scratch, false)?;
        swiglu(g, &b.scratch, &b.act, self.bf16_out(), n, f)?;
        self.matmul_wt(&b.act, n, f, &mlp.down, d, x, true)
    }

    /// The attention kernel this model runs.
    pub fn attention_kernel(&self) -> AttnKernel {
        AttnKernel::choose(self.precision, self.config.head_dim)
    }
}

/// `act[r] = silu(gu[r, ..f]) · gu[r, f..]` for `rows` rows (`gu` f32, `act` in the
/// precision): the dense MLP's and every expert's.
pub(super) fn swiglu(
    g: &Gpu,
    gu: &DevBuf,
    act: &DevBuf,
    bf16_out: i32,
    rows: usize,
    f: usize,
) -> Result<()> {
    g.launch(
        "swiglu",
        (plan::blocks_for(rows * f, 256), 1, 1),
        256,
        0,
        &launch::Swiglu {
            gu: Ptr::new(gu.ptr),
            act: Ptr::new(act.ptr),
            out_bf16: bf16_out,
            rows: rows as i64,
            f: f as i32,
        },
    )
}
