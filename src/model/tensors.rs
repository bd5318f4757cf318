//! The artifact's tensor names and shapes, and how the backends fuse them.
//!
//! This is the one place that knows that layer `i`'s query projection is called
//! `model.layers.{i}.self_attn.q_proj.weight`, that it is `[Hq·D, d]`, and that the backends
//! stack q/k/v into one `[Hq·D + 2·Hkv·D, d]` matrix and gate/up into one `[2F, d]` matrix
//! (one large GEMM instead of several small ones). The artifact reader validates against
//! [`ModelTensors::expected`], the CPU weights and the CUDA loader both build their fused
//! matrices from [`Fused`] groups, so a new tensor or a new fusion is written once.
//!
//! Layers are described as an attention mixer plus an MLP so that other mixers (a recurrent
//! State layer) and other MLPs (mixtures of experts) can be added as variants beside them.

use crate::model::config::ModelConfig;

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
    fn one(name: String, rows: usize, cols: usize) -> Fused {
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
    /// RMSNorm weight before the block, `[d]`.
    pub norm: String,
    /// q, k, v projections stacked: `[Hq·D + 2·Hkv·D, d]`.
    pub qkv: Fused,
    /// Their biases stacked, `[Hq·D + 2·Hkv·D]` (qwen2).
    pub qkv_bias: Option<Fused>,
    /// Per-head RMSNorm weights of q and k, `[D]` each (qwen3).
    pub q_norm: Option<String>,
    pub k_norm: Option<String>,
    /// Output projection, `[d, Hq·D]`.
    pub o_proj: Fused,
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

/// One decoder layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerTensors {
    pub attention: AttentionTensors,
    pub mlp: MlpTensors,
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
        let layer = |i: usize| {
            let p = format!("model.layers.{i}");
            let proj = |n: &str| format!("{p}.self_attn.{n}_proj.weight");
            let bias = |n: &str| format!("{p}.self_attn.{n}_proj.bias");
            LayerTensors {
                attention: AttentionTensors {
                    norm: format!("{p}.input_layernorm.weight"),
                    qkv: Fused {
                        parts: vec![proj("q"), proj("k"), proj("v")],
                        rows: q + 2 * kv,
                        cols: d,
                    },
                    qkv_bias: c.attention_bias.then(|| Fused {
                        parts: vec![bias("q"), bias("k"), bias("v")],
                        rows: q + 2 * kv,
                        cols: 1,
                    }),
                    q_norm: c.qk_norm.then(|| format!("{p}.self_attn.q_norm.weight")),
                    k_norm: c.qk_norm.then(|| format!("{p}.self_attn.k_norm.weight")),
                    o_proj: Fused::one(proj("o"), d, q),
                },
                mlp: MlpTensors {
                    norm: format!("{p}.post_attention_layernorm.weight"),
                    gate_up: Fused {
                        parts: vec![
                            format!("{p}.mlp.gate_proj.weight"),
                            format!("{p}.mlp.up_proj.weight"),
                        ],
                        rows: 2 * f,
                        cols: d,
                    },
                    down: Fused::one(format!("{p}.mlp.down_proj.weight"), d, f),
                },
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
            let a = l.attention;
            t.push((a.norm, vec![d]));
            for (name, rows) in a.qkv.parts.into_iter().zip([q, kv, kv]) {
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
            t.push((l.mlp.norm, vec![d]));
            for n in l.mlp.gate_up.parts {
                t.push((n, vec![f, d]));
            }
            t.extend(l.mlp.down.parts.into_iter().map(|n| (n, vec![d, f])));
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
        let per_layer = 9 + 3 * usize::from(c.attention_bias) + 2 * usize::from(c.qk_norm);
        let head = usize::from(!c.tie_word_embeddings);
        c.num_layers
            .saturating_mul(per_layer)
            .saturating_add(2 + head)
    }
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
                    fused.extend([&l.attention.qkv, &l.attention.o_proj]);
                    fused.extend(&l.attention.qkv_bias);
                    fused.extend([&l.mlp.gate_up, &l.mlp.down]);
                    seen.push(l.attention.norm.clone());
                    seen.push(l.mlp.norm.clone());
                    seen.extend(l.attention.q_norm.iter().cloned());
                    seen.extend(l.attention.k_norm.iter().cloned());
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
