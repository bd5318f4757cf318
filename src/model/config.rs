//! Text-model configuration stored in every artifact.
//!
//! This is the engine's own, normalized description of a decoder-only transformer;
//! packers translate GGUF metadata or a Hugging Face `config.json` into it, and the
//! artifact reader validates every tensor against it.

use crate::model::layout::Model;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// Largest vocabulary accepted (2^22; released models stay below 2^18).
pub const MAX_VOCAB: usize = 1 << 22;
/// Largest hidden size, and largest `num_heads × head_dim`.
pub const MAX_WIDTH: usize = 1 << 16;
/// Largest MLP width.
pub const MAX_INTERMEDIATE: usize = 1 << 20;
/// Largest number of layers.
pub const MAX_LAYERS: usize = 1024;
/// Largest number of attention heads (query or KV).
pub const MAX_HEADS: usize = 1024;
/// Largest head dimension.
pub const MAX_HEAD_DIM: usize = 1024;
/// Largest trained context.
pub const MAX_POSITIONS: usize = 1 << 26;

/// Architecture family. qwen2 adds a bias to the q/k/v projections, qwen3 applies a
/// per-head RMSNorm to q and k before RoPE, and qwen3_5 is the hybrid text model: Gated
/// DeltaNet layers with a recurrent State between gated full-attention layers, zero-centred
/// norms (`1 + w`) and partial RoPE (see [`HybridConfig`] and `docs/hybrid.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Llama,
    Qwen2,
    Qwen3,
    #[serde(rename = "qwen3_5")]
    Qwen3_5,
    /// Qwen3 attention with sparse mixture-of-experts MLPs (Qwen3-30B-A3B, 235B-A22B).
    #[serde(rename = "qwen3_moe")]
    Qwen3Moe,
    /// The Qwen3.5 hybrid with sparse MoE MLPs and a gated shared expert (Qwen3.5-35B-A3B).
    #[serde(rename = "qwen3_5_moe")]
    Qwen3_5Moe,
    /// Qwen3-Next (80B-A3B): the same layers as qwen3_5_moe, dense layers where the config
    /// says so; its checkpoints group the Gated DeltaNet projections per key head, which the
    /// packer un-groups.
    #[serde(rename = "qwen3_next")]
    Qwen3Next,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Qwen3_5 => "qwen3_5",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Qwen3_5Moe => "qwen3_5_moe",
            Family::Qwen3Next => "qwen3_next",
        }
    }

    /// The Qwen3.5 text model's layers (hybrid, zero-centred norms, gated attention).
    pub fn is_qwen3_5(self) -> bool {
        matches!(
            self,
            Family::Qwen3_5 | Family::Qwen3_5Moe | Family::Qwen3Next
        )
    }

    /// Families whose MLPs are mixtures of experts.
    pub fn is_moe(self) -> bool {
        matches!(
            self,
            Family::Qwen3Moe | Family::Qwen3_5Moe | Family::Qwen3Next
        )
    }
}

/// The sparse mixture-of-experts MLPs of a qwen3_moe / qwen3_5_moe model.
///
/// A sparse layer routes each token to `num_experts_per_tok` of `num_experts` SwiGLU experts
/// (of width `moe_intermediate_size`) by the softmax of a linear router, in f32; the chosen
/// probabilities are renormalised to sum to 1 when `norm_topk_prob`, and weight the experts'
/// outputs. A shared expert (width `shared_expert_intermediate_size`, 0 for none) sees every
/// token and is scaled by `sigmoid(shared_expert_gate · x)`. Dense layers keep the ordinary
/// MLP of `intermediate_size`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub norm_topk_prob: bool,
    pub shared_expert_intermediate_size: usize,
    /// One per layer: `true` for a sparse MoE layer, `false` for a dense MLP.
    pub sparse_layers: Vec<bool>,
}

/// Most experts per layer this engine takes (512 in the largest released models).
pub const MAX_EXPERTS: usize = 4096;

/// What a layer mixes its tokens with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    /// Causal softmax attention over the Main KV.
    FullAttention,
    /// Gated DeltaNet: linear attention with a recurrent State.
    LinearAttention,
}

/// The activation of the Gated DeltaNet output gate (`silu(z)` by default).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutputGate {
    Silu,
    Sigmoid,
}

/// The hybrid part of a qwen3_5 text model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HybridConfig {
    /// One entry per layer.
    pub layer_types: Vec<LayerKind>,
    /// Leading dims of each full-attention head that RoPE rotates (the rest pass through).
    pub rotary_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    /// Width of the causal depthwise convolution over q|k|v.
    pub linear_conv_kernel_dim: usize,
    pub output_gate: OutputGate,
}

impl HybridConfig {
    /// Channels the convolution runs over: q and k of every key head, v of every value head.
    pub fn conv_dim(&self) -> usize {
        2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// `Hv · Dv`: the width of the value heads (and of the z gate, and of out_proj's input).
    pub fn value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// f32 values of one Gated DeltaNet layer's State for a window: the `[Dk, Dv]` matrix
    /// of every value head, and the last `K - 1` convolution inputs.
    pub fn state_floats_per_layer(&self) -> usize {
        self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
            + (self.linear_conv_kernel_dim - 1) * self.conv_dim()
    }
}

/// Llama-3 style RoPE frequency scaling (the only scaling scheme supported).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (qwen2).
    pub attention_bias: bool,
    /// per-head RMSNorm on q and k before RoPE (qwen3).
    pub qk_norm: bool,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<u32>,
    /// The recurrent layers of a hybrid (qwen3_5) model; absent for the others.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hybrid: Option<HybridConfig>,
    /// The mixture-of-experts MLPs (qwen3_moe, qwen3_5_moe); absent for dense models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeConfig>,
}

impl ModelConfig {
    /// Checks the fields against each other and against sane maxima, so that a corrupted or
    /// hostile config (one edited digit in `num_layers`) is refused with its name before
    /// anything is sized from it. The maxima are far above any released model.
    pub fn validate(&self) -> Result<()> {
        let bounded = [
            ("vocab_size", self.vocab_size, MAX_VOCAB),
            ("hidden_size", self.hidden_size, MAX_WIDTH),
            (
                "intermediate_size",
                self.intermediate_size,
                MAX_INTERMEDIATE,
            ),
            ("num_layers", self.num_layers, MAX_LAYERS),
            ("num_heads", self.num_heads, MAX_HEADS),
            ("num_kv_heads", self.num_kv_heads, MAX_HEADS),
            ("head_dim", self.head_dim, MAX_HEAD_DIM),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                MAX_POSITIONS,
            ),
        ];
        for (name, v, max) in bounded {
            if v == 0 {
                bail!("config field `{name}` must be positive");
            }
            if v > max {
                bail!("config field `{name}` is {v}, above the largest this engine takes ({max})");
            }
        }
        if self.q_dim() > MAX_WIDTH {
            bail!(
                "config: num_heads × head_dim is {}, above the largest this engine takes ({MAX_WIDTH})",
                self.q_dim()
            );
        }
        if let Some(r) = &self.rope_scaling {
            let ok = [r.factor, r.low_freq_factor, r.high_freq_factor]
                .iter()
                .all(|x| x.is_finite() && *x > 0.0)
                && r.original_max_position_embeddings > 0;
            if !ok {
                bail!("config: rope_scaling needs positive finite factors and original_max_position_embeddings");
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            bail!(
                "config: num_heads ({}) is not a multiple of num_kv_heads ({})",
                self.num_heads,
                self.num_kv_heads
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!("config: head_dim ({}) must be even for RoPE", self.head_dim);
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            bail!("config: rms_norm_eps must be a positive finite number");
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            bail!("config: rope_theta must be a positive finite number");
        }
        match self.family {
            Family::Llama => {}
            Family::Qwen2 if !self.attention_bias => bail!("config: qwen2 requires attention_bias"),
            Family::Qwen3 if !self.qk_norm => bail!("config: qwen3 requires qk_norm"),
            _ => {}
        }
        match (&self.hybrid, self.family) {
            (None, f) if f.is_qwen3_5() => {
                bail!("config: {} needs its `hybrid` part", f.name())
            }
            (Some(_), f) if !f.is_qwen3_5() => {
                bail!(
                    "config: `hybrid` is only for qwen3_5 and qwen3_5_moe, not {}",
                    f.name()
                )
            }
            (Some(h), _) => self.validate_hybrid(h)?,
            (None, _) => {}
        }
        if self.family == Family::Qwen3Moe && (!self.qk_norm || self.attention_bias) {
            bail!("config: qwen3_moe has q/k norm and no attention bias");
        }
        match (&self.moe, self.family) {
            (None, f) if f.is_moe() => bail!("config: {} needs its `moe` part", f.name()),
            (Some(_), f) if !f.is_moe() => {
                bail!(
                    "config: `moe` is only for qwen3_moe and qwen3_5_moe, not {}",
                    f.name()
                )
            }
            (Some(m), _) => self.validate_moe(m)?,
            (None, _) => {}
        }
        Ok(())
    }

    fn validate_moe(&self, m: &MoeConfig) -> Result<()> {
        if m.num_experts == 0 || m.num_experts > MAX_EXPERTS {
            bail!(
                "config: num_experts is {}, outside 1..={MAX_EXPERTS}",
                m.num_experts
            );
        }
        if m.num_experts_per_tok == 0 || m.num_experts_per_tok > m.num_experts {
            bail!(
                "config: num_experts_per_tok is {}, outside 1..=num_experts ({})",
                m.num_experts_per_tok,
                m.num_experts
            );
        }
        if m.moe_intermediate_size == 0 || m.moe_intermediate_size > MAX_INTERMEDIATE {
            bail!(
                "config: moe_intermediate_size is {}, outside 1..={MAX_INTERMEDIATE}",
                m.moe_intermediate_size
            );
        }
        if m.shared_expert_intermediate_size > MAX_INTERMEDIATE {
            bail!(
                "config: shared_expert_intermediate_size is {}, above {MAX_INTERMEDIATE}",
                m.shared_expert_intermediate_size
            );
        }
        if m.sparse_layers.len() != self.num_layers {
            bail!(
                "config: `sparse_layers` has {} entries for {} layers",
                m.sparse_layers.len(),
                self.num_layers
            );
        }
        Ok(())
    }

    /// Whether layer `i`'s MLP is a sparse mixture of experts.
    pub fn is_sparse_layer(&self, i: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.sparse_layers[i])
    }

    /// Parameters one token uses: every tensor but the experts it is not routed to (the
    /// embedding row and the head counted whole, as for a dense model).
    pub fn active_params(&self) -> usize {
        let Some(m) = &self.moe else {
            return self.num_params();
        };
        let per_expert = 3 * self.hidden_size * m.moe_intermediate_size;
        let sparse = m.sparse_layers.iter().filter(|&&s| s).count();
        self.num_params() - sparse * (m.num_experts - m.num_experts_per_tok) * per_expert
    }

    fn validate_hybrid(&self, h: &HybridConfig) -> Result<()> {
        if !self.qk_norm || self.attention_bias {
            bail!(
                "config: {} has q/k norm and no attention bias",
                self.family.name()
            );
        }
        if h.layer_types.len() != self.num_layers {
            bail!(
                "config: `layer_types` has {} entries for {} layers",
                h.layer_types.len(),
                self.num_layers
            );
        }
        let bounded = [
            ("linear_num_key_heads", h.linear_num_key_heads, MAX_HEADS),
            (
                "linear_num_value_heads",
                h.linear_num_value_heads,
                MAX_HEADS,
            ),
            ("linear_key_head_dim", h.linear_key_head_dim, MAX_HEAD_DIM),
            (
                "linear_value_head_dim",
                h.linear_value_head_dim,
                MAX_HEAD_DIM,
            ),
            ("linear_conv_kernel_dim", h.linear_conv_kernel_dim, 64),
            ("rotary_dim", h.rotary_dim, self.head_dim),
        ];
        for (name, v, max) in bounded {
            if v == 0 {
                bail!("config field `{name}` must be positive");
            }
            if v > max {
                bail!("config field `{name}` is {v}, above the largest this engine takes ({max})");
            }
        }
        if !h.rotary_dim.is_multiple_of(2) {
            bail!(
                "config: rotary_dim ({}) must be even for RoPE",
                h.rotary_dim
            );
        }
        if !h
            .linear_num_value_heads
            .is_multiple_of(h.linear_num_key_heads)
        {
            bail!(
                "config: linear_num_value_heads ({}) is not a multiple of linear_num_key_heads ({})",
                h.linear_num_value_heads,
                h.linear_num_key_heads
            );
        }
        if h.conv_dim() > MAX_WIDTH * 4 || h.value_dim() > MAX_WIDTH {
            bail!("config: the Gated DeltaNet heads are wider than this engine takes");
        }
        Ok(())
    }

    /// The same model with `n` layers: a hybrid model's `layer_types` repeat their pattern
    /// (the first `n` of it, cycled), so fewer layers of a 3:1 model stay 3:1 (benchmarks
    /// and tests of large shapes).
    pub fn with_layers(&self, n: usize) -> ModelConfig {
        let mut c = self.clone();
        c.num_layers = n;
        if let Some(h) = &mut c.hybrid {
            let pattern = std::mem::take(&mut h.layer_types);
            h.layer_types = pattern.iter().copied().cycle().take(n).collect();
        }
        if let Some(m) = &mut c.moe {
            let pattern = std::mem::take(&mut m.sparse_layers);
            m.sparse_layers = pattern.iter().copied().cycle().take(n).collect();
        }
        c
    }

    /// What layer `i` mixes its tokens with.
    pub fn layer_kind(&self, i: usize) -> LayerKind {
        match &self.hybrid {
            Some(h) => h.layer_types[i],
            None => LayerKind::FullAttention,
        }
    }

    /// Layers with a Main KV (the full-attention ones).
    pub fn kv_layers(&self) -> usize {
        (0..self.num_layers)
            .filter(|&i| self.layer_kind(i) == LayerKind::FullAttention)
            .count()
    }

    /// Gated DeltaNet layers.
    pub fn state_layers(&self) -> usize {
        self.num_layers - self.kv_layers()
    }

    /// Dims of each attention head that RoPE rotates.
    pub fn rotary_dim(&self) -> usize {
        self.hybrid.as_ref().map_or(self.head_dim, |h| h.rotary_dim)
    }

    /// Whether the norms hold `w` with the scale `1 + w` (qwen3_5), rather than the scale.
    pub fn zero_centred_norms(&self) -> bool {
        self.family.is_qwen3_5()
    }

    /// Whether attention's output is multiplied by `sigmoid(gate)`, the gate projected with
    /// the query (qwen3_5).
    pub fn attention_output_gate(&self) -> bool {
        self.family.is_qwen3_5()
    }

    /// Bytes of Recurrent State a window holds (f32, every Gated DeltaNet layer).
    pub fn state_bytes_per_window(&self) -> usize {
        self.hybrid
            .as_ref()
            .map_or(0, |h| 4 * h.state_floats_per_layer() * self.state_layers())
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Every tensor the artifact must hold, with its shape (row-major, Hugging Face naming):
    /// [`Model::expected`].
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        Model::expected(self)
    }

    /// Number of parameters (tied head counted once).
    pub fn num_params(&self) -> usize {
        self.expected_tensors()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }

    /// A config of the given shape with the family's required features (qwen2 bias, qwen3
    /// q/k norm), an untied head and ordinary constants: for unit tests.
    #[cfg(test)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn for_test(
        family: Family,
        layers: usize,
        d: usize,
        hq: usize,
        hkv: usize,
        hd: usize,
        f: usize,
        vocab: usize,
    ) -> ModelConfig {
        ModelConfig {
            family,
            vocab_size: vocab,
            hidden_size: d,
            intermediate_size: f,
            num_layers: layers,
            num_heads: hq,
            num_kv_heads: hkv,
            head_dim: hd,
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            rope_scaling: None,
            max_position_embeddings: 40960,
            tie_word_embeddings: false,
            attention_bias: family == Family::Qwen2,
            qk_norm: matches!(family, Family::Qwen3 | Family::Qwen3Moe),
            bos_token_id: None,
            eos_token_id: None,
            hybrid: None,
            moe: None,
        }
    }
}
