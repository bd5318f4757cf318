//! The sparse mixture-of-experts MLP on CUDA. CPU twin: `backend/cpu/model/moe.rs`
//! (`moe_block`).
//!
//! The router is a GEMM and `moe_route` (softmax, top-k with ties to the lower expert,
//! renormalisation). The choices come back to the host, which groups the tokens by expert
//! in token order — the same grouping the CPU builds, and the routing counts the report
//! shows — and uploads where each token's rows go. The normed rows are gathered expert by
//! expert (`rms_norm` with a row list, the same bits as the block's input), each expert
//! with tokens runs its gate/up GEMM over its rows, one SwiGLU covers every routed row,
//! each expert its down GEMM, and `moe_combine` adds each token's weighted expert outputs
//! in expert-index order, then the sigmoid-gated shared expert, to the residual stream.
//!
//! The expert GEMMs are one cuBLAS call per expert that has tokens (a grouped GEMM as a
//! loop): their rows are contiguous, so the loop is the only thing a fused grouped kernel
//! would change, not the numbers.

use super::layer::swiglu;
use super::weights::Moe;
use super::CudaModel;
use crate::backend::cuda::device::DevBuf;
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

impl CudaModel {
    /// Adds the MoE block's output for the `m` rows of `io.h` to `io.x`; adds each expert's
    /// routed rows to `counts`.
    pub(super) fn moe(
        &self,
        w: &Moe,
        b: &MoeBufs,
        io: &Io,
        m: usize,
        counts: &mut [u64],
    ) -> Result<()> {
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
        let e = precision.elem_bytes();
        let bf16_out = (precision == Precision::Bf16) as i32;
        let routed = m * k;
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
        let idx: Vec<i32> = g.read(&b.router, o_idx, routed)?;
        let grouping = Grouping::build(&idx, m, k, ne)?;
        for (c, n) in counts.iter_mut().zip(grouping.counts()) {
            *c += n as u64;
        }
        let ints = g.upload(&[&grouping.src[..], &grouping.slot, &grouping.pick].concat())?;
        let (o_src, o_slot, o_pick) = (0, 4 * routed, 8 * routed);
        // The input rows grouped by expert: the block's norm again, over a row list.
        g.launch(
            "rms_norm",
            (routed as u32, 1, 1),
            256,
            0,
            &launch::RmsNorm {
                x: Ptr::new(io.x.ptr),
                rows: Ptr::new(ints.at(o_src)),
                w: Ptr::new(io.norm.ptr),
                out: Ptr::<Any>::new(b.input.ptr),
                out_bf16: bf16_out,
                d: d as i32,
                eps,
            },
        )?;
        let experts_with_rows = || {
            grouping
                .offsets
                .windows(2)
                .enumerate()
                .filter(|(_, r)| r[1] > r[0])
                .map(|(x, r)| (x, r[0], r[1] - r[0]))
        };
        for (x, r0, n) in experts_with_rows() {
            blas.gemm(
                g,
                n,
                2 * fi,
                d,
                Mat::of(&b.input, r0 * d * e, d),
                Mat::of(&w.experts.gate_up, x * 2 * fi * d * e, d),
                Mat::of(io.scratch, r0 * 2 * fi * 4, 2 * fi),
                false,
            )?;
        }
        swiglu(g, io.scratch, io.act, bf16_out, routed, fi)?;
        for (x, r0, n) in experts_with_rows() {
            blas.gemm(
                g,
                n,
                d,
                fi,
                Mat::of(io.act, r0 * fi * e, fi),
                Mat::of(&w.experts.down, x * d * fi * e, fi),
                Mat::of(&b.out, r0 * d * 4, d),
                false,
            )?;
        }
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
                slot: Ptr::new(ints.at(o_slot)),
                pick: Ptr::new(ints.at(o_pick)),
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
