//! The scoring head on CUDA: the rows that predict a target through the final norm, then
//! the output head one vocabulary chunk at a time, each chunk's logits folded into a
//! running log-sum-exp and the target's logit (`head_reduce`), and finished into
//! log-probabilities (`head_finish`). Full logits for a pass never exist at once. CPU twin:
//! `backend/cpu/model/head.rs`.

use super::buffers::Buffers;
use super::layer::{Ints, Pass};
use super::CudaModel;
use crate::backend::cuda::device::DevBuf;
use crate::backend::cuda::gemm::Mat;
use crate::backend::cuda::launch::{self, Ptr};
use crate::backend::cuda::plan;
use anyhow::Result;

impl CudaModel {
    /// The log-probability of every scored row's target, in the pass's order: the rows are
    /// read from `x` at `rows` (the scored rows of the residual stream, or of `x_last`).
    pub(super) fn head(&self, b: &Buffers, p: &Pass, x: &DevBuf, rows: Ints) -> Result<Vec<f32>> {
        let c = &self.config;
        let (d, e) = (c.hidden_size, self.precision.elem_bytes());
        let (g, w) = (&self.gpu, &self.weights);
        let r_total = p.plan.scored.len();
        self.norm(x, p.ints(rows, 0), &w.final_norm, &b.h, r_total)?;
        let head = w.head();
        let (hr, vc_max) = (b.plan.head_rows, b.plan.vocab_chunk);
        for r0 in (0..r_total).step_by(hr) {
            let rb = hr.min(r_total - r0);
            for v0 in (0..c.vocab_size).step_by(vc_max) {
                let vc = vc_max.min(c.vocab_size - v0);
                self.blas.gemm(
                    g,
                    rb,
                    vc,
                    d,
                    Mat::of(&b.h, r0 * d * e, d),
                    Mat::of(head, v0 * d * e, d),
                    Mat::of(&b.logits, 0, vc),
                    false,
                )?;
                g.launch(
                    "head_reduce",
                    (rb as u32, 1, 1),
                    256,
                    0,
                    &launch::HeadReduce {
                        logits: Ptr::new(b.logits.ptr),
                        vc: vc as i32,
                        v0: v0 as i32,
                        targets: p.ints(Ints::Targets, r0),
                        run_max: Ptr::new(b.run_max.at(4 * r0)),
                        run_sum: Ptr::new(b.run_sum.at(8 * r0)),
                        run_target: Ptr::new(b.run_target.at(4 * r0)),
                    },
                )?;
            }
        }
        g.launch(
            "head_finish",
            (plan::blocks_for(r_total, 256), 1, 1),
            256,
            0,
            &launch::HeadFinish {
                run_max: Ptr::new(b.run_max.ptr),
                run_sum: Ptr::new(b.run_sum.ptr),
                run_target: Ptr::new(b.run_target.ptr),
                out: Ptr::new(b.out.ptr),
                rows: r_total as i32,
            },
        )?;
        g.read(&b.out, 0, r_total)
    }
}
