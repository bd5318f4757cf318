//! Text-model configuration stored in every artifact.
//!
//! This is the engine's own, normalized description of a decoder-only transformer;
//! packers translate GGUF metadata or a Hugging Face `config.json` into it, and the
//! artifact reader validates every tensor against it.

use crate::model::tensors::ModelTensors;
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

    /// Every tensor the artifact must hold, with its shape (row-major, Hugging Face naming):
    /// [`ModelTensors::expected`].
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        ModelTensors::expected(self)
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
            qk_norm: family == Family::Qwen3,
            bos_token_id: None,
            eos_token_id: None,
        }
    }
}
