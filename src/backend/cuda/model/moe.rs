//! The sparse mixture-of-experts MLP on CUDA. CPU twin: `backend/cpu/model/moe.rs`
//! (`moe_block`).
//!
//! The router is a GEMM and `moe_route` (softmax, top-k with ties to the lower expert,
//! renormalisation). The grouping of the tokens by expert, in token order within an expert
//! (the grouping the CPU builds; [`Grouping::build`] is its host twin), is a stable counting
//! sort on the device (`moe_count`, `moe_offsets`, `moe_place`), which also lists the expert
//! GEMMs' tiles and adds the routing counts the report shows to a device array read once per
//! pass: no routing decision comes back to the host and nothing is allocated per layer. The
//! normed rows are gathered expert by expert (`rms_norm` with a row list, the same bits as
//! the block's input), one grouped GEMM launch runs every expert's gate/up product over its
//! rows, one SwiGLU covers every routed row, one grouped launch the down products, and
//! `moe_combine` adds each token's weighted expert outputs in expert-index order, then the
//! sigmoid-gated shared expert, to the residual stream.
//!
//! The grouped GEMMs are this crate's kernels, not cuBLAS: the tile list lives on the device,
//! where cuBLAS's grouped calls want per-group sizes from the host. bf16 runs on tensor
//! cores; f32 computes the CPU GEMM's bits. Every buffer is the pass's, alive until the pass
//! ends, so no kernel reads freed memory.

use super::layer::swiglu;
use super::weights::Moe;
use super::CudaModel;
use crate::backend::cuda::device::{DevBuf, Gpu};
use crate::backend::cuda::gemm::Mat;
use crate::backend::cuda::launch::{self, Any, Ptr};
use crate::backend::cuda::plan::{self, Precision};
use anyhow::{bail, Result};

/// Tokens grouped by expert, from the router's choices `idx[rows, k]`.
#[derive(Debug, PartialEq, Eq)]
pub struct Grouping {
    /// Expert e's routed rows are `offsets[e]..offsets[e + 1]` (`E + 1` entries).
    pub offsets: Vec<usize>,
    /// The token of each routed row (`rows · k`, grouped by expert, token order within).
    pub src: Vec<i32>,
    /// Per token, its experts in index order: the routed row of each (`slot`) and which of
    /// the token's choices it was (`pick`), `[rows, k]` each.
    pub slot: Vec<i32>,
    pub pick: Vec<i32>,
}

impl Grouping {
    /// Groups `idx[rows, k]` (expert indices in choice order). Fails on an index out of
    /// range or an expert chosen twice for one token (neither comes from `moe_route`).
    pub fn build(idx: &[i32], rows: usize, k: usize, experts: usize) -> Result<Grouping> {
        if idx.len() != rows * k {
            bail!(
                "MoE routing: {} choices for {rows} tokens of {k}",
                idx.len()
            );
        }
        let mut counts = vec![0usize; experts];
        for (n, &e) in idx.iter().enumerate() {
            if e < 0 || e as usize >= experts {
                bail!("MoE routing: token {} chose expert {e} of {experts}", n / k);
            }
            counts[e as usize] += 1;
        }
        let mut offsets = Vec::with_capacity(experts + 1);
        offsets.push(0);
        for c in &counts {
            offsets.push(offsets.last().unwrap() + c);
        }
        let mut next = offsets[..experts].to_vec();
        let mut src = vec![0i32; rows * k];
        let mut slot = vec![0i32; rows * k];
        let mut pick = vec![0i32; rows * k];
        let mut order: Vec<usize> = Vec::with_capacity(k);
        for r in 0..rows {
            let choices = &idx[r * k..(r + 1) * k];
            order.clear();
            order.extend(0..k);
            order.sort_by_key(|&i| choices[i]);
            for (j, &i) in order.iter().enumerate() {
                let e = choices[i] as usize;
                if j > 0 && choices[order[j - 1]] as usize == e {
                    bail!("MoE routing: token {r} chose expert {e} twice");
                }
                let row = next[e];
                next[e] += 1;
                src[row] = r as i32;
                slot[r * k + j] = row as i32;
                pick[r * k + j] = i as i32;
            }
        }
        Ok(Grouping {
            offsets,
            src,
            slot,
            pick,
        })
    }

    /// Routed rows per expert.
    pub fn counts(&self) -> impl Iterator<Item = usize> + '_ {
        self.offsets.windows(2).map(|w| w[1] - w[0])
    }
}

/// A MoE block's activation buffers (sized by `plan::buffer_sizes`).
pub(super) struct MoeBufs {
    /// `[rows, E + 1 + 2k]` f32 / i32: router logits (then probabilities), the shared
    /// expert's gate logit, the choices, their weights.
    pub(super) router: DevBuf,
    /// `[rows · k, d]` in the precision: the block's input rows grouped by expert.
    pub(super) input: DevBuf,
    /// `[rows · (k + 1), d]` f32: the experts' outputs per routed row, then the shared
    /// expert's per token.
    pub(super) out: DevBuf,
    /// The grouping by expert and the pass's routing counts (`plan::MoeGroupLayout`).
    pub(super) group: DevBuf,
}

/// The buffers a block reads and overwrites besides its own.
pub(super) struct Io<'a> {
    /// The residual rows `[rows, d]` f32 (the block adds to them).
    pub x: &'a DevBuf,
    /// The block's normed input `[rows, d]` in the precision.
    pub h: &'a DevBuf,
    /// The block's RMSNorm weight (re-applied to gather the rows by expert).
    pub norm: &'a DevBuf,
    /// f32 GEMM outputs, `[rows, max(k · 2I, 2Is)]`.
    pub scratch: &'a DevBuf,
    /// SwiGLU outputs in the precision, `[rows, max(k · I, Is)]`.
    pub act: &'a DevBuf,
}

/// One grouped expert product `y[routed, n] = x[routed, k] · w_eᵀ` per expert, over the
/// tiles `moe_offsets` listed.
struct Grouped<'a> {
    x: &'a DevBuf,
    w: &'a DevBuf,
    n: usize,
    k: usize,
    y: &'a DevBuf,
}

/// Groups `lay.rows` tokens by expert from their choices `idx[rows, k]` (a device address)
/// into `grp` laid out as `lay`: the three grouping kernels, as the block runs them (the
/// kernel tests call this too).
pub fn group_by_expert(
    g: &Gpu,
    idx: u64,
    grp: &DevBuf,
    lay: &plan::MoeGroupLayout,
    k: usize,
    ne: usize,
) -> Result<()> {
    g.launch(
        "moe_count",
        (lay.chunks as u32, 1, 1),
        256,
        launch::moe_group_smem(k) as usize,
        &launch::MoeCount {
            idx: Ptr::new(idx),
            rows: lay.rows as i64,
            k: k as i32,
            experts: ne as i32,
            counts: Ptr::new(grp.at(lay.base)),
        },
    )?;
    g.launch(
        "moe_offsets",
        (1, 1, 1),
        256,
        4 * (2 * ne + 1),
        &launch::MoeOffsets {
            counts: Ptr::new(grp.at(lay.base)),
            chunks: lay.chunks as i32,
            experts: ne as i32,
            offsets: Ptr::new(grp.at(lay.offsets)),
            tiles: Ptr::new(grp.at(lay.tiles)),
            max_tiles: lay.max_tiles as i32,
            routed: Ptr::new(grp.at(lay.routed)),
        },
    )?;
    g.launch(
        "moe_place",
        (lay.chunks as u32, 1, 1),
        256,
        launch::moe_group_smem(k) as usize,
        &launch::MoePlace {
            idx: Ptr::new(idx),
            rows: lay.rows as i64,
            k: k as i32,
            experts: ne as i32,
            base: Ptr::new(grp.at(lay.base)),
            src: Ptr::new(grp.at(lay.src)),
            slot: Ptr::new(grp.at(lay.slot)),
            pick: Ptr::new(grp.at(lay.pick)),
        },
    )
}

impl CudaModel {
    /// Zeroes the pass's routing counts (before its first layer).
    pub(super) fn moe_begin(&self, b: &MoeBufs) -> Result<()> {
        let e = self.config.moe.as_ref().map_or(0, |m| m.num_experts);
        self.gpu.memset(&b.group, 0, 8 * e, 0)
    }

    /// The pass's routed rows per expert (after its last layer).
    pub(super) fn moe_routed(&self, b: &MoeBufs) -> Result<Vec<u64>> {
        let e = self.config.moe.as_ref().map_or(0, |m| m.num_experts);
        self.gpu.read(&b.group, 0, e)
    }

    fn grouped_gemm(&self, p: &Grouped, group: &DevBuf, lay: &plan::MoeGroupLayout) -> Result<()> {
        let grid = (
            p.n.div_ceil(launch::MOE_TILE_COLS) as u32,
            lay.max_tiles as u32,
            1,
        );
        let tiles = Ptr::new(group.at(lay.tiles));
        let (n, k) = (p.n as i32, p.k as i32);
        match self.precision {
            Precision::Bf16 => self.gpu.launch(
                "moe_gemm_bf16",
                grid,
                128,
                0,
                &launch::MoeGemmBf16 {
                    x: Ptr::new(p.x.ptr),
                    w: Ptr::new(p.w.ptr),
                    tiles,
                    N: n,
                    K: k,
                    y: Ptr::new(p.y.ptr),
                    ldy: n,
                },
            ),
            Precision::F32 => self.gpu.launch(
                "moe_gemm_f32",
                grid,
                256,
                0,
                &launch::MoeGemmF32 {
                    x: Ptr::new(p.x.ptr),
                    w: Ptr::new(p.w.ptr),
                    tiles,
                    N: n,
                    K: k,
                    y: Ptr::new(p.y.ptr),
                    ldy: n,
                },
            ),
        }
    }

    /// Adds the MoE block's output for the `m` rows of `io.h` to `io.x`, and their routing
    /// to the pass's counts.
    pub(super) fn moe(&self, w: &Moe, b: &MoeBufs, io: &Io, m: usize) -> Result<()> {
        let (g, blas, precision) = (&self.gpu, &self.blas, self.precision);
        let cfg = self
            .config
            .moe
            .as_ref()
            .expect("a MoE layer has a MoE config");
        let (d, eps) = (self.config.hidden_size, self.config.rms_norm_eps);
        let (ne, k, fi) = (
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
        );
        let bf16_out = (precision == Precision::Bf16) as i32;
        let routed = m * k;
        let lay = plan::MoeGroupLayout::new(m, k, ne);
        if lay.bytes > b.group.bytes {
            bail!(
                "MoE grouping of {m} rows needs {} bytes, the pass planned {}",
                lay.bytes,
                b.group.bytes
            );
        }
        // The router buffer's regions: logits [m, E], gate [m], idx [m, k], wts [m, k].
        let (o_gate, o_idx, o_wts) = (4 * m * ne, 4 * m * (ne + 1), 4 * m * (ne + 1 + k));
        self.matmul_wt(io.h, m, d, &w.router, ne, &b.router, false)?;
        g.launch(
            "moe_route",
            (plan::blocks_for(m, 128), 1, 1),
            128,
            0,
            &launch::MoeRoute {
                logits: Ptr::new(b.router.ptr),
                rows: m as i64,
                experts: ne as i32,
                k: k as i32,
                renorm: cfg.norm_topk_prob as i32,
                idx: Ptr::new(b.router.at(o_idx)),
                wts: Ptr::new(b.router.at(o_wts)),
            },
        )?;
        group_by_expert(g, b.router.at(o_idx), &b.group, &lay, k, ne)?;
        // The input rows grouped by expert: the block's norm again, over a row list.
        g.launch(
            "rms_norm",
            (routed as u32, 1, 1),
            256,
            0,
            &launch::RmsNorm {
                x: Ptr::new(io.x.ptr),
                rows: Ptr::new(b.group.at(lay.src)),
                w: Ptr::new(io.norm.ptr),
                out: Ptr::<Any>::new(b.input.ptr),
                out_bf16: bf16_out,
                d: d as i32,
                eps,
            },
        )?;
        let gate_up = Grouped {
            x: &b.input,
            w: &w.experts.gate_up,
            n: 2 * fi,
            k: d,
            y: io.scratch,
        };
        self.grouped_gemm(&gate_up, &b.group, &lay)?;
        swiglu(g, io.scratch, io.act, bf16_out, routed, fi)?;
        let down = Grouped {
            x: io.act,
            w: &w.experts.down,
            n: d,
            k: fi,
            y: &b.out,
        };
        self.grouped_gemm(&down, &b.group, &lay)?;
        let (shared, gate) = match &w.shared {
            Some(sh) => {
                let (sw, gw) = (&sh.mlp, &sh.gate);
                let fs = cfg.shared_expert_intermediate_size;
                let s_off = routed * d * 4;
                self.matmul_wt(io.h, m, d, &sw.gate_up, 2 * fs, io.scratch, false)?;
                swiglu(g, io.scratch, io.act, bf16_out, m, fs)?;
                blas.gemm(
                    g,
                    m,
                    d,
                    fs,
                    Mat::of(io.act, 0, fs),
                    Mat::of(&sw.down, 0, fs),
                    Mat::of(&b.out, s_off, d),
                    false,
                )?;
                blas.gemm(
                    g,
                    m,
                    1,
                    d,
                    Mat::of(io.h, 0, d),
                    Mat::of(gw, 0, d),
                    Mat::of(&b.router, o_gate, 1),
                    false,
                )?;
                (Ptr::new(b.out.at(s_off)), Ptr::new(b.router.at(o_gate)))
            }
            None => (Ptr::NULL, Ptr::NULL),
        };
        g.launch(
            "moe_combine",
            (plan::blocks_for(m * d, 256), 1, 1),
            256,
            0,
            &launch::MoeCombine {
                y: Ptr::new(b.out.ptr),
                slot: Ptr::new(b.group.at(lay.slot)),
                pick: Ptr::new(b.group.at(lay.pick)),
                wts: Ptr::new(b.router.at(o_wts)),
                k: k as i32,
                shared,
                gate,
                x: Ptr::new(io.x.ptr),
                xrows: Ptr::NULL,
                rows: m as i64,
                d: d as i32,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_grouped_by_expert_in_token_order() {
        // 3 tokens, k = 2, 4 experts; choices in probability order.
        let idx = [2, 0, 0, 3, 2, 3];
        let g = Grouping::build(&idx, 3, 2, 4).unwrap();
        assert_eq!(g.offsets, vec![0, 2, 2, 4, 6]);
        assert_eq!(g.src, vec![0, 1, 0, 2, 1, 2]);
        assert_eq!(g.counts().collect::<Vec<_>>(), vec![2, 0, 2, 2]);
        // Token 0: expert 0 (its 2nd choice) at routed row 0, expert 2 (1st) at row 2.
        assert_eq!(&g.slot[0..2], &[0, 2]);
        assert_eq!(&g.pick[0..2], &[1, 0]);
        // Token 2: expert 2 (1st) at row 3, expert 3 (2nd) at row 5.
        assert_eq!(&g.slot[4..6], &[3, 5]);
        assert_eq!(&g.pick[4..6], &[0, 1]);
    }

    #[test]
    fn impossible_choices_are_refused() {
        assert!(Grouping::build(&[0, 4], 1, 2, 4).is_err());
        assert!(Grouping::build(&[-1, 0], 1, 2, 4).is_err());
        assert!(Grouping::build(&[1, 1], 1, 2, 4)
            .unwrap_err()
            .to_string()
            .contains("twice"));
        assert!(Grouping::build(&[1], 1, 2, 4).is_err());
    }
}
