//! What a model is made of: one tree of its parts, generic over what a part is.
//!
//! [`Model::of`] names every part of a configuration: a [`Tensor`] says which artifact
//! tensors make it (`model.layers.{i}.self_attn.q_proj.weight`, ...), their shapes, and how a
//! backend lays them out ([`Kind`]: q/k/v stacked into one `[Hq·D + 2·Hkv·D, d]` matrix,
//! gate/up into one `[2F, d]`, every expert of a MoE block into one `[E·2I, d]`, so a block
//! runs a few large GEMMs instead of many small ones). Each backend turns that tree into its
//! own with one walk, [`Model::try_map`], and a loader for one leaf: the CPU's leaves are f32
//! matrices (`backend/cpu/model/weights.rs`), CUDA's device buffers
//! (`backend/cuda/model/weights.rs`). The artifact reader validates against
//! [`Model::expected`], the same tree flattened. So a new tensor, a new fusion or a new layer
//! kind is written here once, and both backends see it as a compile error until they handle
//! it.
//!
//! A layer is a token mixer (softmax attention, or a Gated DeltaNet with a recurrent State)
//! plus an MLP (dense SwiGLU, or a sparse mixture of experts).

use crate::model::config::{LayerKind, ModelConfig};

/// One artifact tensor of a [`Tensor`], with its stored shape (row-major).
#[derive(Clone, Debug, PartialEq)]
pub struct Part {
    pub name: String,
    pub shape: Vec<usize>,
}

/// How a backend lays out a [`Tensor`]'s parts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    /// A weight matrix `[rows, cols]`: the parts' rows one after another, in the compute
    /// precision (the GEMM operands and the embedding).
    Matrix,
    /// Gated attention's `[q | k | v | gate]` matrix. Part 0 (`q_proj`, `[2·heads·head_dim,
    /// cols]`) holds each head's `head_dim` query rows followed by its `head_dim` gate rows:
    /// its query rows come first, then k and v, then its gate rows ([`split_query_gate`]),
    /// so one GEMM gives all four.
    GatedQkv { heads: usize, head_dim: usize },
    /// An f32 vector: the parts one after another (biases, decay parameters, the plain norm
    /// weight of a Gated DeltaNet's output).
    Vector,
    /// An RMSNorm's scale in f32: the weight, or `1 + w` where the family stores norm
    /// weights zero-centred (qwen3_5), computed once at load exactly as the reference
    /// computes it per call, so the forward passes have one RMSNorm.
    Norm { zero_centred: bool },
    /// A depthwise causal convolution stored `[channels, 1, taps]`, laid out tap-major
    /// `[taps, channels]` in f32: tap `taps - 1` multiplies the current token.
    ConvTaps { channels: usize, taps: usize },
}

/// One part of a model as the artifact stores it: several tensors stacked along their first
/// dimension, `[rows, cols]` once stacked (vectors: `cols` 1).
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// The artifact tensors, in stacking order.
    pub parts: Vec<Part>,
    pub rows: usize,
    pub cols: usize,
    pub kind: Kind,
}

impl Tensor {
    /// A matrix of one or more stacked `[rows_i, cols]` tensors.
    fn matrix(parts: Vec<(String, usize)>, cols: usize) -> Tensor {
        let rows = parts.iter().map(|p| p.1).sum();
        Tensor {
            parts: parts
                .into_iter()
                .map(|(name, r)| Part {
                    name,
                    shape: vec![r, cols],
                })
                .collect(),
            rows,
            cols,
            kind: Kind::Matrix,
        }
    }

    /// An f32 vector of one or more stacked 1-D tensors.
    fn vector(parts: Vec<(String, usize)>) -> Tensor {
        Tensor {
            rows: parts.iter().map(|p| p.1).sum(),
            parts: parts
                .into_iter()
                .map(|(name, n)| Part {
                    name,
                    shape: vec![n],
                })
                .collect(),
            cols: 1,
            kind: Kind::Vector,
        }
    }

    fn norm(name: String, n: usize, zero_centred: bool) -> Tensor {
        Tensor {
            kind: Kind::Norm { zero_centred },
            ..Tensor::vector(vec![(name, n)])
        }
    }

    /// Elements once laid out.
    pub fn elements(&self) -> usize {
        self.rows * self.cols
    }

    /// The artifact tensors' names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().map(|p| p.name.as_str())
    }
}

/// A whole model.
#[derive(Clone, Debug, PartialEq)]
pub struct Model<T> {
    /// Token embeddings, `[vocab, d]`.
    pub embed: T,
    pub layers: Vec<Layer<T>>,
    /// The final RMSNorm, `[d]`.
    pub final_norm: T,
    /// The untied output head, `[vocab, d]`; `None` when the head is the embedding.
    pub lm_head: Option<T>,
}

/// One decoder layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Layer<T> {
    /// RMSNorm before the mixer, `[d]`.
    pub norm: T,
    pub mixer: Mixer<T>,
    /// RMSNorm before the MLP, `[d]`.
    pub ffn_norm: T,
    pub ffn: Ffn<T>,
}

/// What a layer mixes its tokens with.
#[derive(Clone, Debug, PartialEq)]
pub enum Mixer<T> {
    Attention(Attention<T>),
    DeltaNet(DeltaNet<T>),
}

/// Softmax attention.
#[derive(Clone, Debug, PartialEq)]
pub struct Attention<T> {
    /// `[Hq·D + 2·Hkv·D, d]`, or with `gated` `[Hq·D + 2·Hkv·D + Hq·D, d]` (the output
    /// gate's rows last).
    pub qkv: T,
    /// q, k, v biases stacked, `[Hq·D + 2·Hkv·D]` (qwen2).
    pub qkv_bias: Option<T>,
    /// Per-head RMSNorms of q and k, `[D]` each (qwen3).
    pub q_norm: Option<T>,
    pub k_norm: Option<T>,
    /// Output projection, `[d, Hq·D]`.
    pub o_proj: T,
    /// The output is multiplied by `sigmoid(gate)` (qwen3_5).
    pub gated: bool,
}

/// A Gated DeltaNet (`linear_attn.*`).
#[derive(Clone, Debug, PartialEq)]
pub struct DeltaNet<T> {
    /// q|k|v, z, b and a projections stacked: `[conv_dim + Hv·Dv + 2·Hv, d]`.
    pub in_proj: T,
    /// The causal convolution over q|k|v, `[K, conv_dim]` once laid out.
    pub conv: T,
    /// `[Hv]` each.
    pub dt_bias: T,
    pub a_log: T,
    /// The plain (not zero-centred) RMSNorm of the gated output, `[Dv]`.
    pub norm: T,
    /// Output projection, `[d, Hv·Dv]`.
    pub out_proj: T,
}

/// A layer's MLP.
#[derive(Clone, Debug, PartialEq)]
pub enum Ffn<T> {
    Dense(SwiGlu<T>),
    Moe(Moe<T>),
}

/// A SwiGLU MLP of width `width`.
#[derive(Clone, Debug, PartialEq)]
pub struct SwiGlu<T> {
    /// gate and up stacked, `[2·width, d]` (gate rows first).
    pub gate_up: T,
    /// `[d, width]`.
    pub down: T,
    pub width: usize,
}

/// A sparse mixture of experts.
#[derive(Clone, Debug, PartialEq)]
pub struct Moe<T> {
    /// The router, `[E, d]`.
    pub router: T,
    pub experts: Experts<T>,
    /// The shared expert and its gate (`[1, d]`), where the family has one.
    pub shared: Option<Shared<T>>,
    /// Experts per token.
    pub top_k: usize,
    /// Whether the chosen experts' probabilities are renormalised to sum to 1.
    pub norm_topk_prob: bool,
}

/// Every expert of a MoE block, each a SwiGLU of width `width`, stacked: expert `e`'s rows
/// follow expert `e - 1`'s, so expert `e` is a slice (an offset) of each matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Experts<T> {
    /// `[E·2·width, d]`: per expert its gate rows, then its up rows.
    pub gate_up: T,
    /// `[E·d, width]`.
    pub down: T,
    pub count: usize,
    pub width: usize,
}

/// A MoE block's shared expert, weighted by `sigmoid(h · gate)`.
#[derive(Clone, Debug, PartialEq)]
pub struct Shared<T> {
    pub mlp: SwiGlu<T>,
    /// `[1, d]`.
    pub gate: T,
}

/// The embedding's name (also what a tied head reads).
pub const EMBED: &str = "model.embed_tokens.weight";
/// The untied output head's name.
pub const LM_HEAD: &str = "lm_head.weight";
/// The final norm's name.
pub const FINAL_NORM: &str = "model.norm.weight";

impl<T> Model<T> {
    /// The output head: the untied one, or the embedding when tied.
    pub fn head(&self) -> &T {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// The same tree with every leaf mapped by `f`, visited in a fixed order (embedding,
    /// layers in order, final norm, head); the first error stops the walk.
    pub fn try_map<U, E>(&self, f: &mut impl FnMut(&T) -> Result<U, E>) -> Result<Model<U>, E> {
        Ok(Model {
            embed: f(&self.embed)?,
            layers: self
                .layers
                .iter()
                .map(|l| l.try_map(f))
                .collect::<Result<_, _>>()?,
            final_norm: f(&self.final_norm)?,
            lm_head: self.lm_head.as_ref().map(&mut *f).transpose()?,
        })
    }
}

impl<T> Layer<T> {
    fn try_map<U, E>(&self, f: &mut impl FnMut(&T) -> Result<U, E>) -> Result<Layer<U>, E> {
        Ok(Layer {
            norm: f(&self.norm)?,
            mixer: match &self.mixer {
                Mixer::Attention(a) => Mixer::Attention(Attention {
                    qkv: f(&a.qkv)?,
                    qkv_bias: a.qkv_bias.as_ref().map(&mut *f).transpose()?,
                    q_norm: a.q_norm.as_ref().map(&mut *f).transpose()?,
                    k_norm: a.k_norm.as_ref().map(&mut *f).transpose()?,
                    o_proj: f(&a.o_proj)?,
                    gated: a.gated,
                }),
                Mixer::DeltaNet(g) => Mixer::DeltaNet(DeltaNet {
                    in_proj: f(&g.in_proj)?,
                    conv: f(&g.conv)?,
                    dt_bias: f(&g.dt_bias)?,
                    a_log: f(&g.a_log)?,
                    norm: f(&g.norm)?,
                    out_proj: f(&g.out_proj)?,
                }),
            },
            ffn_norm: f(&self.ffn_norm)?,
            ffn: match &self.ffn {
                Ffn::Dense(m) => Ffn::Dense(m.try_map(f)?),
                Ffn::Moe(m) => Ffn::Moe(Moe {
                    router: f(&m.router)?,
                    experts: Experts {
                        gate_up: f(&m.experts.gate_up)?,
                        down: f(&m.experts.down)?,
                        count: m.experts.count,
                        width: m.experts.width,
                    },
                    shared: match &m.shared {
                        Some(s) => Some(Shared {
                            mlp: s.mlp.try_map(f)?,
                            gate: f(&s.gate)?,
                        }),
                        None => None,
                    },
                    top_k: m.top_k,
                    norm_topk_prob: m.norm_topk_prob,
                }),
            },
        })
    }
}

impl<T> SwiGlu<T> {
    fn try_map<U, E>(&self, f: &mut impl FnMut(&T) -> Result<U, E>) -> Result<SwiGlu<U>, E> {
        Ok(SwiGlu {
            gate_up: f(&self.gate_up)?,
            down: f(&self.down)?,
            width: self.width,
        })
    }
}

impl Model<Tensor> {
    /// The parts of a model of this configuration and the artifact tensors each is made of.
    /// Sizes are not checked here (the config's validation bounds them).
    pub fn of(c: &ModelConfig) -> Model<Tensor> {
        let (d, v) = (c.hidden_size, c.vocab_size);
        let (q, kv, hd) = (c.q_dim(), c.kv_dim(), c.head_dim);
        let zero_centred = c.zero_centred_norms();
        let swiglu = |p: &str, width: usize| SwiGlu {
            gate_up: Tensor::matrix(
                vec![
                    (format!("{p}.gate_proj.weight"), width),
                    (format!("{p}.up_proj.weight"), width),
                ],
                d,
            ),
            down: Tensor::matrix(vec![(format!("{p}.down_proj.weight"), d)], width),
            width,
        };
        let layer = |i: usize| {
            let p = format!("model.layers.{i}");
            let mixer = match c.layer_kind(i) {
                LayerKind::FullAttention => {
                    let gated = c.attention_output_gate();
                    let proj = |n: &str| format!("{p}.self_attn.{n}_proj.weight");
                    let bias = |n: &str| format!("{p}.self_attn.{n}_proj.bias");
                    let mut qkv = Tensor::matrix(
                        vec![
                            (proj("q"), if gated { 2 * q } else { q }),
                            (proj("k"), kv),
                            (proj("v"), kv),
                        ],
                        d,
                    );
                    if gated {
                        qkv.kind = Kind::GatedQkv {
                            heads: c.num_heads,
                            head_dim: hd,
                        };
                    }
                    Mixer::Attention(Attention {
                        qkv,
                        qkv_bias: c.attention_bias.then(|| {
                            Tensor::vector(vec![(bias("q"), q), (bias("k"), kv), (bias("v"), kv)])
                        }),
                        q_norm: c.qk_norm.then(|| {
                            Tensor::norm(format!("{p}.self_attn.q_norm.weight"), hd, zero_centred)
                        }),
                        k_norm: c.qk_norm.then(|| {
                            Tensor::norm(format!("{p}.self_attn.k_norm.weight"), hd, zero_centred)
                        }),
                        o_proj: Tensor::matrix(vec![(proj("o"), d)], q),
                        gated,
                    })
                }
                LayerKind::LinearAttention => {
                    let h = c
                        .hybrid
                        .as_ref()
                        .expect("a linear-attention layer is hybrid");
                    let la = |n: &str| format!("{p}.linear_attn.{n}");
                    let hv = h.linear_num_value_heads;
                    let (channels, taps) = (h.conv_dim(), h.linear_conv_kernel_dim);
                    Mixer::DeltaNet(DeltaNet {
                        in_proj: Tensor::matrix(
                            vec![
                                (la("in_proj_qkv.weight"), channels),
                                (la("in_proj_z.weight"), h.value_dim()),
                                (la("in_proj_b.weight"), hv),
                                (la("in_proj_a.weight"), hv),
                            ],
                            d,
                        ),
                        conv: Tensor {
                            parts: vec![Part {
                                name: la("conv1d.weight"),
                                shape: vec![channels, 1, taps],
                            }],
                            rows: taps,
                            cols: channels,
                            kind: Kind::ConvTaps { channels, taps },
                        },
                        dt_bias: Tensor::vector(vec![(la("dt_bias"), hv)]),
                        a_log: Tensor::vector(vec![(la("A_log"), hv)]),
                        norm: Tensor::vector(vec![(la("norm.weight"), h.linear_value_head_dim)]),
                        out_proj: Tensor::matrix(vec![(la("out_proj.weight"), d)], h.value_dim()),
                    })
                }
            };
            let ffn = match &c.moe {
                Some(m) if m.sparse_layers[i] => {
                    let (e, w) = (m.num_experts, m.moe_intermediate_size);
                    let expert = |x: usize| format!("{p}.mlp.experts.{x}");
                    Ffn::Moe(Moe {
                        router: Tensor::matrix(vec![(format!("{p}.mlp.gate.weight"), e)], d),
                        experts: Experts {
                            gate_up: Tensor::matrix(
                                (0..e)
                                    .flat_map(|x| {
                                        [
                                            (format!("{}.gate_proj.weight", expert(x)), w),
                                            (format!("{}.up_proj.weight", expert(x)), w),
                                        ]
                                    })
                                    .collect(),
                                d,
                            ),
                            down: Tensor::matrix(
                                (0..e)
                                    .map(|x| (format!("{}.down_proj.weight", expert(x)), d))
                                    .collect(),
                                w,
                            ),
                            count: e,
                            width: w,
                        },
                        shared: (m.shared_expert_intermediate_size > 0).then(|| Shared {
                            mlp: swiglu(
                                &format!("{p}.mlp.shared_expert"),
                                m.shared_expert_intermediate_size,
                            ),
                            gate: Tensor::matrix(
                                vec![(format!("{p}.mlp.shared_expert_gate.weight"), 1)],
                                d,
                            ),
                        }),
                        top_k: m.num_experts_per_tok,
                        norm_topk_prob: m.norm_topk_prob,
                    })
                }
                _ => Ffn::Dense(swiglu(&format!("{p}.mlp"), c.intermediate_size)),
            };
            Layer {
                norm: Tensor::norm(format!("{p}.input_layernorm.weight"), d, zero_centred),
                mixer,
                ffn_norm: Tensor::norm(
                    format!("{p}.post_attention_layernorm.weight"),
                    d,
                    zero_centred,
                ),
                ffn,
            }
        };
        Model {
            embed: Tensor::matrix(vec![(EMBED.into(), v)], d),
            layers: (0..c.num_layers).map(layer).collect(),
            final_norm: Tensor::norm(FINAL_NORM.into(), d, zero_centred),
            lm_head: (!c.tie_word_embeddings).then(|| Tensor::matrix(vec![(LM_HEAD.into(), v)], d)),
        }
    }

    /// Every tensor the artifact must hold, with its shape (row-major), in the artifact's
    /// order: the embedding; per layer its input norm, the mixer's tensors, the MLP's norm
    /// and the MLP's tensors (a MoE block: each expert's gate, up and down, the shared
    /// expert's, the router, the shared expert's gate); the final norm; the untied head.
    pub fn expected(c: &ModelConfig) -> Vec<(String, Vec<usize>)> {
        let m = Model::of(c);
        let mut out = Vec::with_capacity(Model::count(c));
        fn add(out: &mut Vec<(String, Vec<usize>)>, parts: &[&Part]) {
            out.extend(parts.iter().map(|p| (p.name.clone(), p.shape.clone())));
        }
        let push = |out: &mut Vec<_>, t: &Tensor| add(out, &t.parts.iter().collect::<Vec<_>>());
        push(&mut out, &m.embed);
        for l in &m.layers {
            push(&mut out, &l.norm);
            match &l.mixer {
                Mixer::Attention(a) => {
                    push(&mut out, &a.qkv);
                    for t in [&a.qkv_bias, &a.q_norm, &a.k_norm].into_iter().flatten() {
                        push(&mut out, t);
                    }
                    push(&mut out, &a.o_proj);
                }
                Mixer::DeltaNet(g) => {
                    for t in [
                        &g.in_proj,
                        &g.conv,
                        &g.dt_bias,
                        &g.a_log,
                        &g.norm,
                        &g.out_proj,
                    ] {
                        push(&mut out, t);
                    }
                }
            }
            push(&mut out, &l.ffn_norm);
            match &l.ffn {
                Ffn::Dense(s) => {
                    push(&mut out, &s.gate_up);
                    push(&mut out, &s.down);
                }
                Ffn::Moe(moe) => {
                    let (gu, down) = (&moe.experts.gate_up.parts, &moe.experts.down.parts);
                    for e in 0..moe.experts.count {
                        add(&mut out, &[&gu[2 * e], &gu[2 * e + 1], &down[e]]);
                    }
                    if let Some(s) = &moe.shared {
                        push(&mut out, &s.mlp.gate_up);
                        push(&mut out, &s.mlp.down);
                    }
                    push(&mut out, &moe.router);
                    if let Some(s) = &moe.shared {
                        push(&mut out, &s.gate);
                    }
                }
            }
        }
        push(&mut out, &m.final_norm);
        if let Some(h) = &m.lm_head {
            push(&mut out, h);
        }
        out
    }

    /// How many tensors [`Model::expected`] lists, computed without building the list (for
    /// bounds checks before anything is sized from a config, and progress totals).
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

    /// The names every part of `m` reads, in `try_map`'s order.
    fn leaf_names(m: &Model<Tensor>) -> Vec<String> {
        let mut names = Vec::new();
        m.try_map(&mut |t: &Tensor| {
            names.extend(t.names().map(String::from));
            Ok::<(), ()>(())
        })
        .unwrap();
        names
    }

    #[test]
    fn the_tree_reads_exactly_the_expected_tensors_with_their_shapes() {
        let hybrid = crate::backend::cpu::model::synthetic::synthetic_hybrid_model().config;
        let mut configs = vec![hybrid];
        for fam in [Family::Llama, Family::Qwen2, Family::Qwen3] {
            for tied in [false, true] {
                configs.push(ModelConfig {
                    tie_word_embeddings: tied,
                    ..ModelConfig::for_test(fam, 3, 16, 4, 2, 4, 24, 50)
                });
            }
        }
        for c in &configs {
            let expected = Model::expected(c);
            assert_eq!(expected.len(), Model::count(c), "{:?}", c.family);
            let m = Model::of(c);
            let mut got = leaf_names(&m);
            let mut want: Vec<String> = expected.iter().map(|e| e.0.clone()).collect();
            got.sort();
            want.sort();
            assert_eq!(got, want, "{:?}", c.family);
            want.dedup();
            assert_eq!(want.len(), expected.len(), "names are unique");
            // Every part's rows (its shape's first dimension) add up to the stacked rows.
            m.try_map(&mut |t: &Tensor| {
                let rows: usize = t.parts.iter().map(|p| p.shape[0]).sum();
                match t.kind {
                    Kind::ConvTaps { channels, taps } => {
                        assert_eq!((rows, t.rows, t.cols), (channels, taps, channels))
                    }
                    _ => assert_eq!(rows, t.rows, "{:?}", t.parts),
                }
                Ok::<(), ()>(())
            })
            .unwrap();
        }
    }
}
