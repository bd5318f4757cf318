//! The scoring head on CUDA: the rows that predict a target through the final norm, then
//! the output head one vocabulary chunk at a time, each chunk's logits folded into a
//! running log-sum-exp and the target's logit (`head_reduce`), and finished into
//! log-probabilities (`head_finish`). Full logits for a pass never exist at once. CPU twin:
//! `backend/cpu/model/head.rs`.
//!
//! A paired head (`--kld-base`) also multiplies a saved reference's rows by the same chunk
//! and folds both chunks into one running record per row (`head_pair_reduce`, CPU twin
//! `backend/cpu/head_pair.rs`); once a row block has seen every chunk, a second sweep
//! multiplies the chunks again for what needs both normalizers, the Jensen–Shannon
//! divergence and the top-10 lists (`head_pair_js`, CPU twin `backend/cpu/head_pair_js.rs`).
//! The run's log-probabilities keep the bits of a plain pass.

use super::buffers::Buffers;
use super::layer::{Ints, Pass};
use super::CudaModel;
use crate::backend::cuda::device::DevBuf;
use crate::backend::cuda::gemm::Mat;
use crate::backend::cuda::launch::{self, Ptr};
use crate::backend::cuda::plan::{self, Precision};
use crate::backend::{PairScore, RowScore};
use anyhow::{bail, Result};

impl CudaModel {
    /// The log-probability of every scored row's target, in the pass's order: the rows are
    /// read from `x` at `rows` (the scored rows of the residual stream, or of `x_last`).
    /// With `paired`, each chunk of the reference's rows (uploaded by
    /// [`CudaModel::upload_reference_rows`]) is folded in beside the run's
    /// ([`CudaModel::read_pairs`] then gives the comparison).
    pub(super) fn head(
        &self,
        b: &Buffers,
        p: &Pass,
        x: &DevBuf,
        rows: Ints,
        paired: bool,
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let (d, e) = (c.hidden_size, self.precision.elem_bytes());
        let (g, w) = (&self.gpu, &self.weights);
        let r_total = p.plan.scored.len();
        self.norm(x, p.ints(rows, 0), &w.final_norm, &b.h, r_total)?;
        let head = w.head();
        let (hr, vc_max) = (b.plan.head_rows, b.plan.vocab_chunk);
        let pair = match (paired, &b.pair) {
            (false, _) => None,
            (true, Some(pair)) => Some(pair),
            (true, None) => bail!("a paired head without its buffers (planned plain)"),
        };
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
                if let Some(pair) = pair {
                    self.blas.gemm(
                        g,
                        rb,
                        vc,
                        d,
                        Mat::of(&pair.h_ref, r0 * d * e, d),
                        Mat::of(head, v0 * d * e, d),
                        Mat::of(&pair.logits_ref, 0, vc),
                        false,
                    )?;
                    g.launch(
                        "head_pair_reduce",
                        (rb as u32, 1, 1),
                        256,
                        0,
                        &launch::HeadPairReduce {
                            logits: Ptr::new(b.logits.ptr),
                            logits_ref: Ptr::new(pair.logits_ref.ptr),
                            vc: vc as i32,
                            v0: v0 as i32,
                            targets: p.ints(Ints::Targets, r0),
                            state: Ptr::new(pair.state.at(plan::PAIR_ROW_BYTES * r0)),
                        },
                    )?;
                }
            }
            // The second sweep, with this row block's normalizers known.
            if let Some(pair) = pair {
                for v0 in (0..c.vocab_size).step_by(vc_max) {
                    let vc = vc_max.min(c.vocab_size - v0);
                    for (rows_of, logits) in [(&b.h, &b.logits), (&pair.h_ref, &pair.logits_ref)] {
                        self.blas.gemm(
                            g,
                            rb,
                            vc,
                            d,
                            Mat::of(rows_of, r0 * d * e, d),
                            Mat::of(head, v0 * d * e, d),
                            Mat::of(logits, 0, vc),
                            false,
                        )?;
                    }
                    g.launch(
                        "head_pair_js",
                        (rb as u32, 1, 1),
                        256,
                        0,
                        &launch::HeadPairJs {
                            logits: Ptr::new(b.logits.ptr),
                            logits_ref: Ptr::new(pair.logits_ref.ptr),
                            vc: vc as i32,
                            v0: v0 as i32,
                            state: Ptr::new(pair.state.at(plan::PAIR_ROW_BYTES * r0)),
                        },
                    )?;
                }
            }
        }
        if let Some(pair) = pair {
            g.launch(
                "head_pair_finish",
                (plan::blocks_for(r_total, 256), 1, 1),
                256,
                0,
                &launch::HeadPairFinish {
                    state: Ptr::new(pair.state.ptr),
                    out: Ptr::new(pair.out.ptr),
                    rows: r_total as i32,
                },
            )?;
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

impl CudaModel {
    /// Puts a saved reference's final-normed rows (`[rows, d]` f32, the pass's scored rows
    /// in order) where a paired head reads them, in the GEMM's element type.
    pub(super) fn upload_reference_rows(&self, b: &Buffers, rows: &[f32]) -> Result<()> {
        let Some(pair) = &b.pair else {
            bail!("a paired head without its buffers (planned plain)");
        };
        match self.precision {
            Precision::F32 => self.gpu.write(&pair.h_ref, 0, rows),
            Precision::Bf16 => {
                let v: Vec<u16> = rows
                    .iter()
                    .map(|&x| half::bf16::from_f32(x).to_bits())
                    .collect();
                self.gpu.write(&pair.h_ref, 0, &v)
            }
        }
    }

    /// The finished comparison of a paired head's `n` rows: the run's entropy and top-1
    /// beside `logprobs` (its own, from [`CudaModel::head`]), and the reference's side.
    pub(super) fn read_pairs(
        &self,
        b: &Buffers,
        logprobs: &[f32],
    ) -> Result<(Vec<RowScore>, Vec<PairScore>)> {
        let Some(pair) = &b.pair else {
            bail!("a paired head without its buffers (planned plain)");
        };
        let n = logprobs.len();
        let raw: Vec<u32> = self.gpu.read(&pair.out, 0, 12 * n)?;
        let f = f32::from_bits;
        Ok(raw
            .chunks_exact(12)
            .zip(logprobs)
            .map(|(o, &logprob)| {
                (
                    RowScore {
                        logprob,
                        entropy: f(o[0]),
                        top1: o[1],
                        top1_logprob: f(o[2]),
                    },
                    PairScore {
                        ref_logprob: f(o[3]),
                        kld: f(o[4]),
                        kld_reverse: f(o[5]),
                        ref_top1: o[6],
                        ref_top1_logprob: f(o[7]),
                        js: f(o[8]),
                        top5: o[9] as u8,
                        top10: o[10] as u8,
                    },
                )
            })
            .unzip())
    }
}
