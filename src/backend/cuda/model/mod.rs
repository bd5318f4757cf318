//! The CUDA forward pass over a batch of windows, fused with the scoring head. CPU twin:
//! `backend/cpu/model/mod.rs`: the same steps in the same order, with several independent
//! windows packed row after row into one pass (`model::pass::PassPlan`).
//!
//! Per layer ([`layer`]): RMSNorm → the mixer ([`attention`]: qkv GEMM, `qkv_prep`, causal
//! attention reading the stored K/V, o-proj GEMM accumulating into the residual; or
//! [`delta_net`]) → RMSNorm → the MLP (gate/up GEMM, SwiGLU, down GEMM; or [`moe`]). Then
//! only the rows that predict a target go through the final norm and the head ([`head`]),
//! one vocabulary chunk at a time. The files of this folder and of `backend/cpu/model/` are
//! twins, file for file; CUDA's own are the per-pass device buffers ([`buffers`]) and the
//! decoding of the kernels' non-finite records ([`nonfinite`]).

pub mod attention;
pub mod buffers;
pub mod delta_net;
pub mod head;
pub mod layer;
pub mod moe;
pub mod nonfinite;
pub mod schedule;
pub mod weights;

use super::device::{Gpu, Target};
use super::gemm::Blas;
use super::launch::{self, Ptr};
use super::plan::{self, Precision};
use crate::artifact::Artifact;
use crate::backend::cpu::rope::inv_freq;
use crate::backend::{HeadRows, MemoryReport, ScoreError};
use crate::kv::KvDtype;
use crate::model::config::ModelConfig;
use crate::model::pass::PassPlan;
use anyhow::{bail, Result};
use buffers::{Buffers, State};
use layer::{Ints, Pass};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use weights::{DevWeights, Source};

pub use nonfinite::{decode_nonfinite, decode_state_nonfinite, StatePart};

/// What a pass's head hands over per window.
#[derive(Clone, Copy)]
pub(super) enum PassHead<'a> {
    /// The targets' log-probabilities.
    Logprobs,
    /// With the final-normed rows the head read (`--save-reference`).
    Hidden,
    /// Compared with a saved reference's rows of the pass (`[scored rows, d]` f32, in the
    /// pass's order; `--kld-base`).
    Paired(&'a [f32]),
}

pub struct CudaModel {
    pub config: ModelConfig,
    pub precision: Precision,
    inv_freq: Vec<f64>,
    state: Mutex<State>,
    weights: DevWeights,
    weights_bytes: usize,
    peak_used: AtomicUsize,
    /// Most windows per forward pass (tests lower it to check batching changes nothing).
    max_windows: AtomicUsize,
    /// Whether the last layer's MLP runs on the rows the head reads only (tests turn it off
    /// to check that the trimming changes no bits).
    trim_last_layer: AtomicBool,
    /// Routed rows per expert since the last `take_routing` (MoE models).
    routing: Option<Mutex<Vec<u64>>>,
    blas: Blas,
    gpu: Gpu,
}

impl CudaModel {
    /// Uploads the artifact's weights to device `target`, one tensor at a time (host memory
    /// holds at most one widened tensor). `progress` sees (tensors done, tensors total).
    pub fn load(
        a: &Artifact,
        target: Target,
        precision: Precision,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<CudaModel> {
        Self::load_from(&Source::Artifact(a), target, precision, progress)
    }

    /// A model of `config` with the random weights `write_random_artifact` would store for
    /// `seed`, generated in memory one tensor at a time (for benchmarks of large shapes).
    pub fn load_random(
        config: &ModelConfig,
        seed: u64,
        target: Target,
        precision: Precision,
    ) -> Result<CudaModel> {
        use anyhow::Context;
        config.validate().context("random model")?;
        Self::load_from(
            &Source::random(config, seed),
            target,
            precision,
            &mut |_, _| {},
        )
    }

    fn load_from(
        a: &Source,
        target: Target,
        precision: Precision,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<CudaModel> {
        let c = a.config().clone();
        let gpu = Gpu::open_target(target)?;
        if let Some(h) = &c.hybrid {
            plan::check_delta_net(h, gpu.info.max_dynamic_smem)?;
        }
        if c.head_dim > plan::MAX_HEAD_DIM {
            bail!(
                "head_dim {} is larger than the CUDA kernels take ({})",
                c.head_dim,
                plan::MAX_HEAD_DIM
            );
        }
        let need = plan::weight_bytes(&c, precision);
        let (free, _) = gpu.mem_info()?;
        if need + plan::RESERVE_BYTES.min(free / 8) > free {
            bail!(
                "{}: the weights need {} MiB in {} on the device, {} MiB are free",
                gpu.info.name,
                need >> 20,
                precision.name(),
                free >> 20
            );
        }
        let weights = weights::upload(a, &gpu, precision, progress)?;
        let weights_bytes = gpu.stats.current.load(Ordering::Relaxed);
        let blas = Blas::new(&gpu, precision)?;
        let inv_freq = inv_freq(c.rotary_dim(), c.rope_theta, c.rope_scaling.as_ref());
        let routing = c.moe.as_ref().map(|m| Mutex::new(vec![0; m.num_experts]));
        Ok(CudaModel {
            config: c,
            precision,
            inv_freq,
            state: Mutex::new(State::default()),
            weights,
            weights_bytes,
            peak_used: AtomicUsize::new(0),
            max_windows: AtomicUsize::new(plan::MAX_WINDOWS),
            trim_last_layer: AtomicBool::new(true),
            routing,
            blas,
            gpu,
        })
    }

    /// Token-to-expert assignments per expert since the last call (summed over the sparse
    /// layers), zeroing them; `None` for a dense model. The same counts as the CPU's.
    pub fn take_routing(&self) -> Option<Vec<u64>> {
        self.routing
            .as_ref()
            .map(|r| r.lock().unwrap().iter_mut().map(std::mem::take).collect())
    }

    /// Limits the windows packed into one forward pass (at least 1).
    pub fn set_max_windows_per_pass(&self, n: usize) {
        self.max_windows.store(n.max(1), Ordering::Relaxed);
    }

    /// Runs the last layer's MLP on every row (`false`) or on the rows the head reads only
    /// (`true`, the default): the same bits either way, a check of the trimming.
    pub fn set_trim_last_layer(&self, on: bool) {
        self.trim_last_layer.store(on, Ordering::Relaxed);
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn memory_report(&self) -> MemoryReport {
        MemoryReport {
            peak_allocated_bytes: self.gpu.stats.peak.load(Ordering::Relaxed) as u64,
            peak_used_bytes: self.peak_used.load(Ordering::Relaxed) as u64,
            weights_bytes: self.weights_bytes as u64,
            total_bytes: self.gpu.info.memory_bytes,
        }
    }

    /// One forward pass over packed windows `(tokens, first_target)`; returns each window's
    /// rows as `head` asks: its target log-probabilities, with its final-normed rows, or
    /// compared with a saved reference's rows.
    fn forward_batch(
        &self,
        st: &State,
        wins: &[(&[u32], usize)],
        kv: KvDtype,
        head: PassHead,
    ) -> Result<Vec<HeadRows>, ScoreError> {
        let c = &self.config;
        let plan = PassPlan::new(wins, c.vocab_size)
            .map_err(|(index, error)| ScoreError::Window { index, error })?;
        let b = st.bufs.as_ref().expect("allocated");
        let paired = if let PassHead::Paired(rows) = head {
            let want = plan.scored.len() * c.hidden_size;
            if rows.len() != want {
                return Err(ScoreError::Device(anyhow::anyhow!(
                    "the saved reference gave {} values for this pass's {} scored rows of {} (a damaged or mismatched file)",
                    rows.len(),
                    plan.scored.len(),
                    c.hidden_size
                )));
            }
            self.upload_reference_rows(b, rows)?;
            true
        } else {
            false
        };
        let rope = st.rope.as_ref().expect("allocated");
        let p = Pass::upload(self, plan, kv, rope)?;
        let (g, w) = (&self.gpu, &self.weights);
        g.memset(&b.err, 0, 16, 0xFF)?;
        self.embed(b, &p)?;
        if let Some(mb) = &b.moe {
            self.moe_begin(mb)?;
        }
        for (li, l) in w.layers.iter().enumerate() {
            self.layer(li, l, b, &p)?;
        }
        // The head reads the scored rows where the last layer left them.
        let lps = if self.trims(w.layers.len() - 1, &p) {
            self.head(b, &p, &b.x_last, Ints::ScoredInLastLayer, paired)?
        } else {
            self.head(b, &p, &b.x, Ints::Scored, paired)?
        };
        let err: Vec<u64> = g.read(&b.err, 0, 2)?;
        if let Ok((free, total)) = g.mem_info() {
            self.peak_used.fetch_max(total - free, Ordering::Relaxed);
        }
        // The record of the earlier (window, layer) is what the CPU meets first; the two
        // slots never share a layer (a layer has a Main KV or a State, not both).
        if err[0] != u64::MAX || err[1] != u64::MAX {
            let (index, error) = if (err[0] >> 40) <= (err[1] >> 40) {
                nonfinite::decode_nonfinite(err[0], c.num_kv_heads, c.head_dim)
            } else {
                nonfinite::decode_state_nonfinite(err[1], c)
            };
            return Err(ScoreError::Window { index, error });
        }
        // Routed rows per expert in this pass, added to the model's counts as it succeeded.
        if let (Some(r), Some(mb)) = (&self.routing, &b.moe) {
            let routed = self.moe_routed(mb)?;
            for (t, n) in r.lock().unwrap().iter_mut().zip(&routed) {
                *t += n;
            }
        }
        // Each window's share of the pass's scored rows, in order.
        let spans: Vec<std::ops::Range<usize>> = {
            let mut at = 0;
            p.plan
                .windows
                .iter()
                .map(|w| {
                    at += w.len - w.first_target;
                    at - (w.len - w.first_target)..at
                })
                .collect()
        };
        let d = c.hidden_size;
        Ok(match head {
            PassHead::Logprobs => spans
                .into_iter()
                .map(|s| HeadRows::Logprobs(lps[s].to_vec()))
                .collect(),
            PassHead::Hidden => {
                // The head left the scored rows final-normed in `h`, in the pass's order.
                let n = lps.len() * d;
                let rows: Vec<f32> = match self.precision {
                    Precision::F32 => g.read::<f32>(&b.h, 0, n)?,
                    Precision::Bf16 => g
                        .read::<u16>(&b.h, 0, n)?
                        .into_iter()
                        .map(|x| half::bf16::from_bits(x).to_f32())
                        .collect(),
                };
                spans
                    .into_iter()
                    .map(|s| {
                        HeadRows::LogprobsHidden(
                            lps[s.clone()].to_vec(),
                            rows[s.start * d..s.end * d].to_vec(),
                        )
                    })
                    .collect()
            }
            PassHead::Paired(_) => {
                let (rs, ps) = self.read_pairs(b, &lps)?;
                spans
                    .into_iter()
                    .map(|s| HeadRows::Paired(rs[s.clone()].to_vec(), ps[s].to_vec()))
                    .collect()
            }
        })
    }

    /// The embedding rows of the pass's tokens into the residual stream `x`.
    fn embed(&self, b: &Buffers, p: &Pass) -> Result<()> {
        self.gpu.launch(
            "embed_gather",
            (p.rows() as u32, 1, 1),
            256,
            0,
            &launch::EmbedGather {
                tokens: p.ints(Ints::Tokens, 0),
                embed: Ptr::new(self.weights.embed.ptr),
                embed_bf16: self.bf16_out(),
                x: Ptr::new(b.x.ptr),
                d: self.config.hidden_size as i32,
            },
        )
    }
}
