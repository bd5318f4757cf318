//! Weights widened to f32 and laid out for the CPU kernels.
//!
//! The stacked matrices (q/k/v into one `[q + 2·kv, d]`, gate/up into one `[2·f, d]`, a Gated
//! DeltaNet's four input projections into one) are the groups [`super::tensors`] defines, so
//! each block does a few large GEMMs instead of many small ones. Zero-centred norm weights
//! (qwen3_5 stores `w` for the scale `1 + w`) are turned into their scale here, once, in f32,
//! exactly the value the reference computes per call, so the forward pass has one RMSNorm.

use crate::artifact::Artifact;
use crate::model::tensors::{
    split_query_gate, ExpertTensors, FfnTensors, Fused, MixerTensors, ModelTensors,
};
use anyhow::Result;

/// Softmax attention's weights.
pub struct AttentionWeights {
    /// `[q + 2kv, d]`, or `[q + 2kv + q, d]` with the output gate's rows last.
    pub wqkv: Vec<f32>,
    pub bqkv: Option<Vec<f32>>,   // [q + 2kv]
    pub q_norm: Option<Vec<f32>>, // [head_dim]
    pub k_norm: Option<Vec<f32>>, // [head_dim]
    pub wo: Vec<f32>,             // [d, q]
    /// Attention's output is multiplied by `sigmoid(gate)`.
    pub gated: bool,
}

/// A Gated DeltaNet's weights.
pub struct DeltaNetWeights {
    /// `[conv_dim + Hv·Dv + 2·Hv, d]`: q|k|v, z, b, a.
    pub w_in: Vec<f32>,
    /// `[K, conv_dim]` (tap-major, transposed from the checkpoint's `[conv_dim, 1, K]`): tap
    /// `K - 1` multiplies the current token.
    pub conv: Vec<f32>,
    pub dt_bias: Vec<f32>, // [Hv]
    pub a_log: Vec<f32>,   // [Hv]
    pub norm: Vec<f32>,    // [Dv], plain
    pub w_out: Vec<f32>,   // [d, Hv·Dv]
}

pub enum MixerWeights {
    Attention(AttentionWeights),
    DeltaNet(DeltaNetWeights),
}

/// A SwiGLU MLP (dense, or one expert).
pub struct SwiGlu {
    pub wgu: Vec<f32>,   // [2f, d]: gate rows, then up rows
    pub wdown: Vec<f32>, // [d, f]
    /// `f`
    pub width: usize,
}

/// A sparse mixture-of-experts block.
pub struct MoeWeights {
    pub router: Vec<f32>, // [E, d]
    pub experts: Vec<SwiGlu>,
    /// The shared expert and its gate (`[d]`: one row).
    pub shared: Option<(SwiGlu, Vec<f32>)>,
    pub top_k: usize,
    pub norm_topk_prob: bool,
}

pub enum FfnWeights {
    Dense(SwiGlu),
    Moe(MoeWeights),
}

pub struct LayerWeights {
    pub attn_norm: Vec<f32>, // [d]
    pub mixer: MixerWeights,
    pub mlp_norm: Vec<f32>, // [d]
    pub ffn: FfnWeights,
}

pub struct Weights {
    pub embed: Vec<f32>, // [vocab, d]
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,      // [d]
    pub lm_head: Option<Vec<f32>>, // [vocab, d] when untied
}

impl Weights {
    /// The output projection: the untied head, or the embedding when tied.
    pub fn head(&self) -> &[f32] {
        self.lm_head.as_deref().unwrap_or(&self.embed)
    }

    /// Loads every tensor; `progress` is called with (tensors done, tensors total).
    pub fn load(a: &Artifact, progress: &mut dyn FnMut(usize, usize)) -> Result<Weights> {
        let c = &a.config;
        let names = ModelTensors::of(c);
        let mut r = Reader {
            a,
            done: 0,
            total: ModelTensors::count(c),
            progress,
            zero_centred: c.zero_centred_norms(),
        };
        let embed = r.fused(&names.embed)?;
        let mut layers = Vec::with_capacity(names.layers.len());
        for l in &names.layers {
            let mixer = match &l.mixer {
                MixerTensors::Attention(at) => {
                    let wqkv = if at.gated {
                        // q_proj interleaves each head's query and gate rows: stack them as
                        // [q | k | v | gate] so one GEMM gives all four.
                        let qp = r.one(&at.qkv.parts[0])?;
                        let (q, gate) = split_query_gate(&qp, c.num_heads, c.head_dim);
                        let mut w = q;
                        w.extend(r.one(&at.qkv.parts[1])?);
                        w.extend(r.one(&at.qkv.parts[2])?);
                        w.extend(gate);
                        w
                    } else {
                        r.fused(&at.qkv)?
                    };
                    MixerWeights::Attention(AttentionWeights {
                        wqkv,
                        bqkv: at.qkv_bias.as_ref().map(|f| r.fused(f)).transpose()?,
                        q_norm: at.q_norm.as_ref().map(|n| r.norm(n)).transpose()?,
                        k_norm: at.k_norm.as_ref().map(|n| r.norm(n)).transpose()?,
                        wo: r.fused(&at.o_proj)?,
                        gated: at.gated,
                    })
                }
                MixerTensors::DeltaNet(g) => MixerWeights::DeltaNet(DeltaNetWeights {
                    w_in: r.fused(&g.in_proj)?,
                    conv: {
                        let h = c.hybrid.as_ref().expect("hybrid");
                        let (ch, kw) = (h.conv_dim(), h.linear_conv_kernel_dim);
                        let w = r.one(&g.conv)?; // [conv_dim, 1, K]
                        (0..kw)
                            .flat_map(|j| (0..ch).map(move |i| (i, j)))
                            .map(|(i, j)| w[i * kw + j])
                            .collect()
                    },
                    dt_bias: r.one(&g.dt_bias)?,
                    a_log: r.one(&g.a_log)?,
                    norm: r.one(&g.norm)?, // the gated norm is plain
                    w_out: r.fused(&g.out_proj)?,
                }),
            };
            let attn_norm = r.norm(&l.norm)?;
            let mlp_norm = r.norm(l.mlp.norm())?;
            let ffn = match &l.mlp {
                FfnTensors::Dense(m) => FfnWeights::Dense(SwiGlu {
                    wgu: r.fused(&m.gate_up)?,
                    wdown: r.fused(&m.down)?,
                    width: c.intermediate_size,
                }),
                FfnTensors::Moe(m) => {
                    let mc = c.moe.as_ref().expect("a sparse layer has a moe config");
                    let mut swiglu = |e: &ExpertTensors, width: usize| -> Result<SwiGlu> {
                        Ok(SwiGlu {
                            wgu: r.fused(&e.gate_up)?,
                            wdown: r.fused(&e.down)?,
                            width,
                        })
                    };
                    let experts = m
                        .experts
                        .iter()
                        .map(|e| swiglu(e, mc.moe_intermediate_size))
                        .collect::<Result<Vec<_>>>()?;
                    let shared = match &m.shared {
                        Some((e, _)) => Some(swiglu(e, mc.shared_expert_intermediate_size)?),
                        None => None,
                    };
                    let shared = match (shared, &m.shared) {
                        (Some(w), Some((_, gate))) => Some((w, r.one(gate)?)),
                        _ => None,
                    };
                    FfnWeights::Moe(MoeWeights {
                        router: r.one(&m.router)?,
                        experts,
                        shared,
                        top_k: mc.num_experts_per_tok,
                        norm_topk_prob: mc.norm_topk_prob,
                    })
                }
            };
            layers.push(LayerWeights {
                attn_norm,
                mixer,
                mlp_norm,
                ffn,
            });
        }
        Ok(Weights {
            embed,
            layers,
            final_norm: r.norm(&names.final_norm)?,
            lm_head: names.lm_head.as_ref().map(|f| r.fused(f)).transpose()?,
        })
    }
}

/// Reads tensors widened to f32, counting them for the progress callback.
struct Reader<'a> {
    a: &'a Artifact,
    done: usize,
    total: usize,
    progress: &'a mut dyn FnMut(usize, usize),
    zero_centred: bool,
}

impl Reader<'_> {
    fn one(&mut self, name: &str) -> Result<Vec<f32>> {
        let t = self.a.tensor_f32(name)?;
        self.done += 1;
        (self.progress)(self.done, self.total);
        Ok(t)
    }

    /// An RMSNorm's scale: the weight, or `1 + w` for zero-centred norms.
    fn norm(&mut self, name: &str) -> Result<Vec<f32>> {
        let mut w = self.one(name)?;
        if self.zero_centred {
            w.iter_mut().for_each(|x| *x += 1.0);
        }
        Ok(w)
    }

    /// A stacked matrix: its parts' rows, one after another.
    fn fused(&mut self, f: &Fused) -> Result<Vec<f32>> {
        let mut m = Vec::with_capacity(f.rows * f.cols);
        for p in &f.parts {
            m.extend(self.one(p)?);
        }
        Ok(m)
    }
}
