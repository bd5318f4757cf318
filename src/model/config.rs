//! Text-model configuration stored in every artifact.
//!
//! This is the engine's own, normalized description of a decoder-only transformer;
//! packers translate GGUF metadata or a Hugging Face `config.json` into it, and the
//! artifact reader validates every tensor against it.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// Architecture family. The differences the engine cares about are small: qwen2 adds a
/// bias to the q/k/v projections, qwen3 applies a per-head RMSNorm to q and k before RoPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Llama,
    Qwen2,
    Qwen3,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
        }
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
}

impl ModelConfig {
    pub fn validate(&self) -> Result<()> {
        let nz = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
        ];
        for (name, v) in nz {
            if v == 0 {
                bail!("config field `{name}` must be positive");
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
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Every tensor the artifact must hold, with its shape (row-major, Hugging Face naming).
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (d, f, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let (q, kv, hd) = (self.q_dim(), self.kv_dim(), self.head_dim);
        let mut t = vec![("model.embed_tokens.weight".to_string(), vec![v, d])];
        for i in 0..self.num_layers {
            let p = format!("model.layers.{i}");
            t.push((format!("{p}.input_layernorm.weight"), vec![d]));
            t.push((format!("{p}.self_attn.q_proj.weight"), vec![q, d]));
            t.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, d]));
            t.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, d]));
            if self.attention_bias {
                t.push((format!("{p}.self_attn.q_proj.bias"), vec![q]));
                t.push((format!("{p}.self_attn.k_proj.bias"), vec![kv]));
                t.push((format!("{p}.self_attn.v_proj.bias"), vec![kv]));
            }
            if self.qk_norm {
                t.push((format!("{p}.self_attn.q_norm.weight"), vec![hd]));
                t.push((format!("{p}.self_attn.k_norm.weight"), vec![hd]));
            }
            t.push((format!("{p}.self_attn.o_proj.weight"), vec![d, q]));
            t.push((format!("{p}.post_attention_layernorm.weight"), vec![d]));
            t.push((format!("{p}.mlp.gate_proj.weight"), vec![f, d]));
            t.push((format!("{p}.mlp.up_proj.weight"), vec![f, d]));
            t.push((format!("{p}.mlp.down_proj.weight"), vec![d, f]));
        }
        t.push(("model.norm.weight".to_string(), vec![d]));
        if !self.tie_word_embeddings {
            t.push(("lm_head.weight".to_string(), vec![v, d]));
        }
        t
    }

    /// Number of parameters (tied head counted once).
    pub fn num_params(&self) -> usize {
        self.expected_tensors()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }

    /// FLOPs of one window of `len` tokens scoring `scored` targets, counting multiply-adds
    /// as two: the projections and MLP for every token, causal attention (QK^T and PV over
    /// the keys each query sees, the query itself included) and the output head for scored
    /// rows. The work the CUDA backend does and its bench divides by; the CPU backend does
    /// a little less ([`Self::window_flops_last_layer_scored_only`]).
    pub fn window_flops(&self, len: usize, scored: usize) -> f64 {
        let (d, qd, kvd, f, v) = (
            self.hidden_size,
            self.q_dim(),
            self.kv_dim(),
            self.intermediate_size,
            self.vocab_size,
        );
        let t = len as f64;
        let per_token_linear = 2.0 * (d * (qd + 2 * kvd) + qd * d + d * 2 * f + f * d) as f64;
        let pairs = t * (t + 1.0) / 2.0; // (query, key) pairs under the causal mask
        let attn = 4.0 * pairs * qd as f64;
        let layers = self.num_layers as f64;
        layers * (t * per_token_linear + attn) + 2.0 * scored as f64 * (d * v) as f64
    }

    /// FLOPs of the model's forward pass over a window of `len` tokens, the way a model
    /// forward is usually counted: every layer for every token, causal attention, and the
    /// output head for every position (what transformers computes when asked for logits). It
    /// does not depend on how many positions are scored, so two engines that score the same
    /// windows are credited with the same work, and one that skips work (logits nobody reads)
    /// shows it as a higher rate. The CPU speed target is stated in this count; the benches
    /// also print the work actually done ([`Self::window_flops_last_layer_scored_only`]).
    pub fn forward_flops(&self, len: usize) -> f64 {
        self.window_flops(len, len)
    }

    /// [`Self::window_flops`] less what the CPU backend skips: after the last layer only
    /// rows that predict a target are read, so there attention (queries from row
    /// `len - scored - 1` on), the o-projection and the MLP run for those rows only, while
    /// the q/k/v projection still runs for every token. The CPU benches divide by this.
    pub fn window_flops_last_layer_scored_only(&self, len: usize, scored: usize) -> f64 {
        let (d, qd, f) = (self.hidden_size, self.q_dim(), self.intermediate_size);
        let full = self.window_flops(len, scored);
        if self.num_layers == 0 || scored == 0 {
            return full;
        }
        let skipped_rows = len.saturating_sub(scored + 1) as f64;
        let pairs = |n: f64| n * (n + 1.0) / 2.0;
        let per_row_tail = 2.0 * (qd * d + 3 * d * f) as f64; // o-projection, gate/up, down
        full - skipped_rows * per_row_tail - 4.0 * pairs(skipped_rows) * qd as f64
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
            qk_norm: family == Family::Qwen3,
            bos_token_id: None,
            eos_token_id: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_match_a_hand_count() {
        let c = ModelConfig::for_test(Family::Qwen3, 1, 4, 2, 1, 2, 8, 10);
        // Linear per token: 2*(4*(4+2*2) + 4*4 + 4*16 + 8*4) = 2*144 = 288.
        // Attention for 3 tokens: 6 pairs * 4 * (2*2) = 96. Head: 2 * 2 rows * 40 = 160.
        assert_eq!(c.window_flops(3, 2), 3.0 * 288.0 + 96.0 + 160.0);
        // Qwen3-8B's shape: 15-20 GFLOP per token at context 4096.
        let q = ModelConfig::for_test(Family::Qwen3, 36, 4096, 32, 8, 128, 12288, 151_936);
        let per_token = q.window_flops(4096, 2048) / 4096.0;
        assert!((15e9..20e9).contains(&per_token), "{per_token:e}");
    }

    #[test]
    fn forward_pass_counts_the_head_for_every_position() {
        let c = ModelConfig::for_test(Family::Qwen3, 1, 4, 2, 1, 2, 8, 10);
        // As in the hand count above, with the head (2 * 40 per row) on all 3 rows.
        assert_eq!(c.forward_flops(3), 3.0 * 288.0 + 96.0 + 3.0 * 80.0);
        // SmolLM2-135M at context 1024: 212.3 MFLOP of projections and MLP, 56.6 of head and
        // 35.4 of causal attention per token (the 0.30 GFLOP the CPU speed target assumes).
        let mut s = ModelConfig::for_test(Family::Llama, 30, 576, 9, 3, 64, 1536, 49_152);
        s.tie_word_embeddings = true;
        let per_token = s.forward_flops(1024) / 1024.0;
        assert!((per_token / 1e6 - 304.4).abs() < 0.1, "{per_token:e}");
    }

    #[test]
    fn last_layer_savings_match_a_hand_count() {
        let c = ModelConfig::for_test(Family::Qwen3, 2, 4, 2, 1, 2, 8, 10);
        // 5 tokens, 2 scored: rows 0 and 1 of the last layer skip o/MLP (2 * (16 + 96) each)
        // and their attention (pairs 1 + 2 = 3, each 4 * 4 FLOPs).
        let skipped = 2.0 * 2.0 * (16.0 + 96.0) + 3.0 * 4.0 * 4.0;
        assert_eq!(
            c.window_flops_last_layer_scored_only(5, 2),
            c.window_flops(5, 2) - skipped
        );
        // A window that scores every row after the first skips nothing.
        assert_eq!(
            c.window_flops_last_layer_scored_only(5, 4),
            c.window_flops(5, 4)
        );
    }
}
