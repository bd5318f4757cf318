//! Named real-size model shapes (`ninfer-pack random --preset NAME`, the benchmarks, the
//! memory-plan and throughput checks): published configurations, no weights.

use crate::model::config::{Family, ModelConfig};
use anyhow::{bail, Result};

/// Named shapes. `qwen3-8b` is Qwen3-8B's config.json; `smollm2-135m` SmolLM2-135M's;
/// `qwen3_5-27b` the text model of the Qwen3.5 27B hybrid (docs/hybrid.md): 48 Gated
/// DeltaNet and 16 gated full-attention layers; `qwen3_5-35b-a3b` the text model of the
/// Qwen3.5 35B-A3B mixture of experts (transformers' `Qwen3_5MoeTextConfig` defaults): the
/// same hybrid layout over 40 layers of width 2048, every MLP 256 experts of width 512 with
/// 8 chosen per token and a gated shared expert of width 512.
pub const PRESETS: [&str; 5] = [
    "qwen3-8b",
    "llama3-8b",
    "smollm2-135m",
    "qwen3_5-27b",
    "qwen3_5-35b-a3b",
];

pub fn preset(name: &str) -> Result<ModelConfig> {
    let base = ModelConfig {
        family: Family::Qwen3,
        vocab_size: 151_936,
        hidden_size: 4096,
        intermediate_size: 12288,
        num_layers: 36,
        num_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        rope_scaling: None,
        max_position_embeddings: 40960,
        tie_word_embeddings: false,
        attention_bias: false,
        qk_norm: true,
        bos_token_id: None,
        eos_token_id: None,
        hybrid: None,
        moe: None,
    };
    Ok(match name {
        "qwen3-8b" => base,
        "llama3-8b" => ModelConfig {
            family: Family::Llama,
            vocab_size: 128_256,
            intermediate_size: 14336,
            num_layers: 32,
            rms_norm_eps: 1e-5,
            rope_theta: 500_000.0,
            max_position_embeddings: 8192,
            qk_norm: false,
            ..base
        },
        "smollm2-135m" => ModelConfig {
            family: Family::Llama,
            vocab_size: 49_152,
            hidden_size: 576,
            intermediate_size: 1536,
            num_layers: 30,
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            rms_norm_eps: 1e-5,
            rope_theta: 100_000.0,
            max_position_embeddings: 8192,
            tie_word_embeddings: true,
            qk_norm: false,
            ..base
        },
        "qwen3_5-27b" => {
            use crate::model::config::{HybridConfig, OutputGate};
            ModelConfig {
                family: Family::Qwen3_5,
                vocab_size: 248_320,
                hidden_size: 5120,
                intermediate_size: 17408,
                num_layers: 64,
                num_heads: 24,
                num_kv_heads: 4,
                head_dim: 256,
                rope_theta: 10_000_000.0,
                max_position_embeddings: 262_144,
                hybrid: Some(HybridConfig {
                    layer_types: every_fourth_full(64),
                    rotary_dim: 64,
                    linear_num_key_heads: 16,
                    linear_num_value_heads: 48,
                    linear_key_head_dim: 128,
                    linear_value_head_dim: 128,
                    linear_conv_kernel_dim: 4,
                    output_gate: OutputGate::Silu,
                }),
                ..base
            }
        }
        "qwen3_5-35b-a3b" => {
            use crate::model::config::{HybridConfig, MoeConfig, OutputGate};
            ModelConfig {
                family: Family::Qwen3_5Moe,
                vocab_size: 248_320,
                hidden_size: 2048,
                // Unused: every layer is sparse.
                intermediate_size: 512,
                num_layers: 40,
                num_heads: 16,
                num_kv_heads: 2,
                head_dim: 256,
                rope_theta: 10_000_000.0,
                max_position_embeddings: 262_144,
                hybrid: Some(HybridConfig {
                    layer_types: every_fourth_full(40),
                    rotary_dim: 64,
                    linear_num_key_heads: 16,
                    linear_num_value_heads: 32,
                    linear_key_head_dim: 128,
                    linear_value_head_dim: 128,
                    linear_conv_kernel_dim: 4,
                    output_gate: OutputGate::Silu,
                }),
                moe: Some(MoeConfig {
                    num_experts: 256,
                    num_experts_per_tok: 8,
                    moe_intermediate_size: 512,
                    norm_topk_prob: true,
                    shared_expert_intermediate_size: 512,
                    sparse_layers: vec![true; 40],
                }),
                ..base
            }
        }
        other => bail!("unknown preset `{other}` (valid: {})", PRESETS.join(", ")),
    })
}

/// Qwen3.5's layer layout: three Gated DeltaNet layers, then a full-attention one.
fn every_fourth_full(layers: usize) -> Vec<crate::model::config::LayerKind> {
    use crate::model::config::LayerKind;
    (0..layers)
        .map(|i| {
            if (i + 1) % 4 == 0 {
                LayerKind::FullAttention
            } else {
                LayerKind::LinearAttention
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_have_the_published_sizes() {
        let q = preset("qwen3-8b").unwrap();
        q.validate().unwrap();
        assert!(
            (8.1e9..8.3e9).contains(&(q.num_params() as f64)),
            "{}",
            q.num_params()
        );
        let s = preset("smollm2-135m").unwrap();
        s.validate().unwrap();
        assert!(
            (134e6..135e6).contains(&(s.num_params() as f64)),
            "{}",
            s.num_params()
        );
        preset("llama3-8b").unwrap().validate().unwrap();
        // The Qwen3.5 27B text model: about 27B parameters with its 2 × 1.27B embedding
        // and head, 48 + 16 layers, the State of docs/hybrid.md.
        let h = preset("qwen3_5-27b").unwrap();
        h.validate().unwrap();
        assert!(
            (26.0e9..27.5e9).contains(&(h.num_params() as f64)),
            "{}",
            h.num_params()
        );
        assert_eq!((h.state_layers(), h.kv_layers()), (48, 16));
        // S: 48 × 48 heads × 128 × 128 f32 = 144 MiB; the conv inputs add 5.6 MiB.
        assert_eq!(h.state_bytes_per_window() >> 20, 149);
        // Qwen3.5-35B-A3B's text model: about 35B parameters, about 3B active per token.
        let m = preset("qwen3_5-35b-a3b").unwrap();
        m.validate().unwrap();
        eprintln!(
            "35b-a3b: {} params, {} active",
            m.num_params(),
            m.active_params()
        );
        assert!(
            (34.0e9..36.0e9).contains(&(m.num_params() as f64)),
            "{}",
            m.num_params()
        );
        assert!(
            (2.5e9..3.5e9).contains(&(m.active_params() as f64)),
            "{}",
            m.active_params()
        );
        assert_eq!((m.state_layers(), m.kv_layers()), (30, 10));
        assert!(preset("gpt5").unwrap_err().to_string().contains("qwen3-8b"));
    }
}
