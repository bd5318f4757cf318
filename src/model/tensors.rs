//! The artifact's tensor names and shapes, and how the backends fuse them.
//!
//! This is the one place that knows that layer `i`'s query projection is called
//! `model.layers.{i}.self_attn.q_proj.weight`, that it is `[Hq·D, d]`, and that the backends
//! stack q/k/v into one `[Hq·D + 2·Hkv·D, d]` matrix and gate/up into one `[2F, d]` matrix
//! (one large GEMM instead of several small ones). The artifact reader validates against
//! [`ModelTensors::expected`], the CPU weights and the CUDA loader both build their fused
//! matrices from [`Fused`] groups, so a new tensor or a new fusion is written once.
//!
//! A layer is a token mixer (softmax attention, or a Gated DeltaNet with a recurrent State)
//! plus an MLP, so that other MLPs (mixtures of experts) can be added as variants beside them.

use crate::model::config::{LayerKind, ModelConfig};

/// Several row-major tensors stacked along their first dimension into one matrix (or, for
/// 1-D tensors, one vector), in this order.
#[derive(Clone, Debug, PartialEq)]
pub struct Fused {
    /// The artifact tensors, in stacking order.
    pub parts: Vec<String>,
    /// Rows of the stacked matrix (the sum of the parts' first dimensions).
    pub rows: usize,
    /// Columns of every part (1 for vectors).
    pub cols: usize,
}

impl Fused {
    pub fn one(name: String, rows: usize, cols: usize) -> Fused {
        Fused {
            parts: vec![name],
            rows,
            cols,
        }
    }
}

/// A self-attention block's tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionTensors {
    /// q, k, v projections stacked: `[Hq·D + 2·Hkv·D, d]`. With `gated`, the query
    /// projection holds `2·Hq·D` rows, each head's D query rows followed by its D gate rows;
    /// the backends stack them as `[q | k | v | gate]` ([`split_query_gate`]).
    pub qkv: Fused,
    /// The attention output is multiplied by `sigmoid(gate)` (qwen3_5).
    pub gated: bool,
    /// Their biases stacked, `[Hq·D + 2·Hkv·D]` (qwen2).
    pub qkv_bias: Option<Fused>,
    /// Per-head RMSNorm weights of q and k, `[D]` each (qwen3).
    pub q_norm: Option<String>,
    pub k_norm: Option<String>,
    /// Output projection, `[d, Hq·D]`.
    pub o_proj: Fused,
}

/// A Gated DeltaNet block's tensors (`linear_attn.*`).
#[derive(Clone, Debug, PartialEq)]
pub struct DeltaNetTensors {
    /// q|k|v, z, b and a projections stacked: `[conv_dim + Hv·Dv + 2·Hv, d]`.
    pub in_proj: Fused,
    /// Depthwise causal convolution over q|k|v, `[conv_dim, 1, K]`.
    pub conv: String,
    /// `[Hv]` each.
    pub dt_bias: String,
    pub a_log: String,
    /// Plain (not zero-centred) RMSNorm weight of the gated output norm, `[Dv]`.
    pub norm: String,
    /// Output projection, `[d, Hv·Dv]`.
    pub out_proj: Fused,
}

/// What a layer mixes its tokens with.
#[derive(Clone, Debug, PartialEq)]
pub enum MixerTensors {
    Attention(AttentionTensors),
    DeltaNet(DeltaNetTensors),
}

/// A SwiGLU MLP block's tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct MlpTensors {
    /// RMSNorm weight before the block, `[d]`.
    pub norm: String,
    /// gate and up projections stacked: `[2F, d]` (gate rows first).
    pub gate_up: Fused,
    /// Down projection, `[d, F]`.
    pub down: Fused,
}

/// One expert of a sparse MoE block: a SwiGLU MLP of width `I = moe_intermediate_size`.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertTensors {
    /// gate and up stacked: `[2I, d]`.
    pub gate_up: Fused,
    /// `[d, I]`.
    pub down: Fused,
}

/// A sparse mixture-of-experts block's tensors (`mlp.gate`, `mlp.experts.E.*`, and the
/// shared expert where the family has one).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeTensors {
    /// RMSNorm weight before the block, `[d]`.
    pub norm: String,
    /// The router, `[E, d]`.
    pub router: String,
    pub experts: Vec<ExpertTensors>,
    /// The shared expert (width `shared_expert_intermediate_size`) and its gate, `[1, d]`.
    pub shared: Option<(ExpertTensors, String)>,
}

/// A layer's MLP: dense, or a sparse mixture of experts.
#[derive(Clone, Debug, PartialEq)]
pub enum FfnTensors {
    Dense(MlpTensors),
    Moe(MoeTensors),
}

impl FfnTensors {
    /// The RMSNorm weight before the block.
    pub fn norm(&self) -> &str {
        match self {
            FfnTensors::Dense(m) => &m.norm,
            FfnTensors::Moe(m) => &m.norm,
        }
    }
}

/// One decoder layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerTensors {
    /// RMSNorm weight before the mixer, `[d]`.
    pub norm: String,
    pub mixer: MixerTensors,
    pub mlp: FfnTensors,
}

/// Every tensor of a model, grouped the way the backends use them.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelTensors {
    /// Token embeddings, `[vocab, d]`.
    pub embed: Fused,
    pub layers: Vec<LayerTensors>,
    /// Final RMSNorm weight, `[d]`.
    pub final_norm: String,
    /// The untied output head, `[vocab, d]`; `None` when the head is the embedding.
    pub lm_head: Option<Fused>,
}

/// The embedding's name (also what a tied head reads).
pub const EMBED: &str = "model.embed_tokens.weight";
/// The untied output head's name.
pub const LM_HEAD: &str = "lm_head.weight";
/// The final norm's name.
pub const FINAL_NORM: &str = "model.norm.weight";

impl ModelTensors {
    /// The tensors a model of this configuration holds. Sizes are not checked here (the
    /// config's validation bounds them).
    pub fn of(c: &ModelConfig) -> ModelTensors {
        let (d, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let (q, kv) = (c.q_dim(), c.kv_dim());
        let gated = c.attention_output_gate();
        let layer = |i: usize| {
            let p = format!("model.layers.{i}");
            let mixer = match c.layer_kind(i) {
                LayerKind::FullAttention => {
                    let proj = |n: &str| format!("{p}.self_attn.{n}_proj.weight");
                    let bias = |n: &str| format!("{p}.self_attn.{n}_proj.bias");
                    let q_rows = if gated { 2 * q } else { q };
                    MixerTensors::Attention(AttentionTensors {
                        qkv: Fused {
                            parts: vec![proj("q"), proj("k"), proj("v")],
                            rows: q_rows + 2 * kv,
                            cols: d,
                        },
                        gated,
                        qkv_bias: c.attention_bias.then(|| Fused {
                            parts: vec![bias("q"), bias("k"), bias("v")],
                            rows: q + 2 * kv,
                            cols: 1,
                        }),
                        q_norm: c.qk_norm.then(|| format!("{p}.self_attn.q_norm.weight")),
                        k_norm: c.qk_norm.then(|| format!("{p}.self_attn.k_norm.weight")),
                        o_proj: Fused::one(proj("o"), d, q),
                    })
                }
                LayerKind::LinearAttention => {
                    let h = c
                        .hybrid
                        .as_ref()
                        .expect("a linear-attention layer is hybrid");
                    let la = |n: &str| format!("{p}.linear_attn.{n}");
                    let hv = h.linear_num_value_heads;
                    MixerTensors::DeltaNet(DeltaNetTensors {
                        in_proj: Fused {
                            parts: ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]
                                .map(|n| la(&format!("{n}.weight")))
                                .to_vec(),
                            rows: h.conv_dim() + h.value_dim() + 2 * hv,
                            cols: d,
                        },
                        conv: la("conv1d.weight"),
                        dt_bias: la("dt_bias"),
                        a_log: la("A_log"),
                        norm: la("norm.weight"),
                        out_proj: Fused::one(la("out_proj.weight"), d, h.value_dim()),
                    })
                }
            };
            let norm = format!("{p}.post_attention_layernorm.weight");
            let swiglu = |q: &str, width: usize| ExpertTensors {
                gate_up: Fused {
                    parts: vec![
                        format!("{q}.gate_proj.weight"),
                        format!("{q}.up_proj.weight"),
                    ],
                    rows: 2 * width,
                    cols: d,
                },
                down: Fused::one(format!("{q}.down_proj.weight"), d, width),
            };
            let mlp = match &c.moe {
                Some(m) if m.sparse_layers[i] => FfnTensors::Moe(MoeTensors {
                    norm,
                    router: format!("{p}.mlp.gate.weight"),
                    experts: (0..m.num_experts)
                        .map(|e| swiglu(&format!("{p}.mlp.experts.{e}"), m.moe_intermediate_size))
                        .collect(),
                    shared: (m.shared_expert_intermediate_size > 0).then(|| {
                        (
                            swiglu(
                                &format!("{p}.mlp.shared_expert"),
                                m.shared_expert_intermediate_size,
                            ),
                            format!("{p}.mlp.shared_expert_gate.weight"),
                        )
                    }),
                }),
                _ => {
                    let e = swiglu(&format!("{p}.mlp"), f);
                    FfnTensors::Dense(MlpTensors {
                        norm,
                        gate_up: e.gate_up,
                        down: e.down,
                    })
                }
            };
            LayerTensors {
                norm: format!("{p}.input_layernorm.weight"),
                mixer,
                mlp,
            }
        };
        ModelTensors {
            embed: Fused::one(EMBED.into(), v, d),
            layers: (0..c.num_layers).map(layer).collect(),
            final_norm: FINAL_NORM.into(),
            lm_head: (!c.tie_word_embeddings).then(|| Fused::one(LM_HEAD.into(), v, d)),
        }
    }

    /// Every tensor the artifact must hold, with its shape (row-major), in a fixed order:
    /// the embedding, each layer's tensors, the final norm, the untied head.
    pub fn expected(c: &ModelConfig) -> Vec<(String, Vec<usize>)> {
        let (d, f, q, kv, hd) = (
            c.hidden_size,
            c.intermediate_size,
            c.q_dim(),
            c.kv_dim(),
            c.head_dim,
        );
        let mut t = vec![(EMBED.to_string(), vec![c.vocab_size, d])];
        for l in ModelTensors::of(c).layers {
            t.push((l.norm, vec![d]));
            match l.mixer {
                MixerTensors::Attention(a) => {
                    let q_rows = if a.gated { 2 * q } else { q };
                    for (name, rows) in a.qkv.parts.into_iter().zip([q_rows, kv, kv]) {
                        t.push((name, vec![rows, d]));
                    }
                    if let Some(b) = a.qkv_bias {
                        for (name, rows) in b.parts.into_iter().zip([q, kv, kv]) {
                            t.push((name, vec![rows]));
                        }
                    }
                    for n in [a.q_norm, a.k_norm].into_iter().flatten() {
                        t.push((n, vec![hd]));
                    }
                    t.extend(a.o_proj.parts.into_iter().map(|n| (n, vec![d, q])));
                }
                MixerTensors::DeltaNet(g) => {
                    let h = c.hybrid.as_ref().expect("hybrid");
                    let hv = h.linear_num_value_heads;
                    let rows = [h.conv_dim(), h.value_dim(), hv, hv];
                    for (name, r) in g.in_proj.parts.into_iter().zip(rows) {
                        t.push((name, vec![r, d]));
                    }
                    t.push((g.conv, vec![h.conv_dim(), 1, h.linear_conv_kernel_dim]));
                    t.push((g.dt_bias, vec![hv]));
                    t.push((g.a_log, vec![hv]));
                    t.push((g.norm, vec![h.linear_value_head_dim]));
                    t.extend(
                        g.out_proj
                            .parts
                            .into_iter()
                            .map(|n| (n, vec![d, h.value_dim()])),
                    );
                }
            }
            t.push((l.mlp.norm().to_string(), vec![d]));
            let mut swiglu = |e: ExpertTensors, width: usize| {
                for n in e.gate_up.parts {
                    t.push((n, vec![width, d]));
                }
                t.extend(e.down.parts.into_iter().map(|n| (n, vec![d, width])));
            };
            match l.mlp {
                FfnTensors::Dense(m) => swiglu(
                    ExpertTensors {
                        gate_up: m.gate_up,
                        down: m.down,
                    },
                    f,
                ),
                FfnTensors::Moe(m) => {
                    let mc = c.moe.as_ref().expect("moe");
                    let router = m.router;
                    for e in m.experts {
                        swiglu(e, mc.moe_intermediate_size);
                    }
                    let shared_gate = m.shared.map(|(e, gate)| {
                        swiglu(e, mc.shared_expert_intermediate_size);
                        gate
                    });
                    t.push((router, vec![mc.num_experts, d]));
                    if let Some(g) = shared_gate {
                        t.push((g, vec![1, d]));
                    }
                }
            }
        }
        t.push((FINAL_NORM.to_string(), vec![d]));
        if !c.tie_word_embeddings {
            t.push((LM_HEAD.to_string(), vec![c.vocab_size, d]));
        }
        t
    }

    /// How many tensors [`ModelTensors::expected`] lists, computed without building the list
    /// (for bounds checks and progress totals).
    pub fn count(c: &ModelConfig) -> usize {
        let attention = 9 + 3 * usize::from(c.attention_bias) + 2 * usize::from(c.qk_norm);
        let delta_net = 14; // norm, 4 projections, conv, dt_bias, A_log, norm, out_proj, MLP 4
        let layers = c
            .kv_layers()
            .saturating_mul(attention)
            .saturating_add(c.state_layers().saturating_mul(delta_net));
        let head = usize::from(!c.tie_word_embeddings);
        // A sparse layer replaces the dense MLP's 3 matrices with a router, 3 per expert and
        // a shared expert's 3 plus its gate.
        let moe = c.moe.as_ref().map_or(0, |m| {
            let sparse = m.sparse_layers.iter().filter(|&&s| s).count();
            let per =
                1 + 3 * m.num_experts + 4 * usize::from(m.shared_expert_intermediate_size > 0);
            sparse.saturating_mul(per.saturating_sub(3))
        });
        layers.saturating_add(2 + head).saturating_add(moe)
    }
}

/// Splits a gated query projection (`[2·heads·head_dim, cols]`, each head's `head_dim` query
/// rows followed by its `head_dim` gate rows) into the query rows and the gate rows, each
/// `[heads·head_dim, cols]` in head order: a reordering of rows, no arithmetic.
pub fn split_query_gate(w: &[f32], heads: usize, head_dim: usize) -> (Vec<f32>, Vec<f32>) {
    let block = w.len() / (2 * heads); // one head's query (or gate) rows, all columns
    debug_assert!(block.is_multiple_of(head_dim));
    let (mut q, mut g) = (
        Vec::with_capacity(w.len() / 2),
        Vec::with_capacity(w.len() / 2),
    );
    for h in w.chunks(2 * block) {
        q.extend_from_slice(&h[..block]);
        g.extend_from_slice(&h[block..]);
    }
    (q, g)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::Family;

    #[test]
    fn the_fused_groups_cover_exactly_the_expected_tensors() {
        for fam in [Family::Llama, Family::Qwen2, Family::Qwen3] {
            for tied in [false, true] {
                let c = ModelConfig {
                    tie_word_embeddings: tied,
                    ..ModelConfig::for_test(fam, 3, 16, 4, 2, 4, 24, 50)
                };
                let expected = ModelTensors::expected(&c);
                assert_eq!(expected.len(), ModelTensors::count(&c), "{fam:?}");
                let shape = |n: &str| expected.iter().find(|e| e.0 == n).map(|e| e.1.clone());
                let t = ModelTensors::of(&c);
                let mut fused = vec![&t.embed];
                fused.extend(&t.lm_head);
                let mut seen = vec![t.final_norm.clone()];
                for l in &t.layers {
                    let MixerTensors::Attention(a) = &l.mixer else {
                        panic!("no hybrid family here")
                    };
                    fused.extend([&a.qkv, &a.o_proj]);
                    fused.extend(&a.qkv_bias);
                    let FfnTensors::Dense(mlp) = &l.mlp else {
                        panic!("no MoE family here")
                    };
                    fused.extend([&mlp.gate_up, &mlp.down]);
                    seen.push(l.norm.clone());
                    seen.push(mlp.norm.clone());
                    seen.extend(a.q_norm.iter().cloned());
                    seen.extend(a.k_norm.iter().cloned());
                }
                for f in fused {
                    let rows: usize = f
                        .parts
                        .iter()
                        .map(|p| shape(p).unwrap_or_else(|| panic!("{p}"))[0])
                        .sum();
                    assert_eq!(rows, f.rows, "{:?}", f.parts);
                    for p in &f.parts {
                        assert_eq!(shape(p).unwrap().get(1).copied().unwrap_or(1), f.cols);
                    }
                    seen.extend(f.parts.iter().cloned());
                }
                seen.sort();
                seen.dedup();
                let mut names: Vec<String> = expected.into_iter().map(|e| e.0).collect();
                names.sort();
                assert_eq!(seen, names, "{fam:?} tied={tied}");
            }
        }
    }
}
