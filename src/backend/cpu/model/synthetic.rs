//! Small models with deterministic pseudo-random weights, for unit tests of the forward pass
//! and the engine's scheduler: llama-shaped ([`synthetic_model`]) and hybrid qwen3_5-shaped
//! ([`synthetic_hybrid_model`]).

use crate::backend::cpu::model::CpuModel;
use crate::model::config::{Family, HybridConfig, LayerKind, ModelConfig, OutputGate};
use crate::model::layout::{Attention, DeltaNet, Ffn, Layer, Mixer, Model, SwiGlu};

pub(crate) fn synthetic_model() -> CpuModel {
    let (vocab, d, f, layers, hq, hkv, hd) = (300, 32, 48, 2, 4, 2, 8);
    let mut seed = 1usize;
    let mut gen = |n: usize, scale: f32| -> Vec<f32> {
        seed += 1;
        (0..n)
            .map(|i| ((((i + 7 * seed) * 2_654_435_761) % 2001) as f32 / 1000.0 - 1.0) * scale)
            .collect()
    };
    // Fields in the order their values are drawn.
    let layer = |gen: &mut dyn FnMut(usize, f32) -> Vec<f32>| Layer {
        norm: gen(d, 0.5).iter().map(|x| 1.0 + x).collect(),
        mixer: Mixer::Attention(Attention {
            qkv: gen((hq * hd + 2 * hkv * hd) * d, 0.3).into(),
            qkv_bias: None,
            q_norm: None,
            k_norm: None,
            o_proj: gen(d * hq * hd, 0.3).into(),
            gated: false,
        }),
        ffn_norm: gen(d, 0.5).iter().map(|x| 1.0 + x).collect(),
        ffn: Ffn::Dense(SwiGlu {
            gate_up: gen(2 * f * d, 0.3).into(),
            down: gen(d * f, 0.3).into(),
            width: f,
        }),
    };
    let weights = Model {
        embed: gen(vocab * d, 1.0).into(),
        layers: (0..layers).map(|_| layer(&mut gen)).collect(),
        final_norm: vec![1.0; d].into(),
        lm_head: None,
    };
    let config = ModelConfig {
        tie_word_embeddings: true,
        ..ModelConfig::for_test(Family::Llama, layers, d, hq, hkv, hd, f, vocab)
    };
    CpuModel::new(config, weights)
}

/// A hybrid (qwen3_5) model: layers [linear, full, linear], 3 value heads per key head,
/// head_dim 8 with rotary dim 4, gated attention, vocabulary 300.
pub(crate) fn synthetic_hybrid_model() -> CpuModel {
    let (vocab, d, f, hq, hkv, hd) = (300, 32, 48, 4, 2, 8);
    let hc = HybridConfig {
        layer_types: vec![
            LayerKind::LinearAttention,
            LayerKind::FullAttention,
            LayerKind::LinearAttention,
        ],
        rotary_dim: 4,
        linear_num_key_heads: 2,
        linear_num_value_heads: 6,
        linear_key_head_dim: 8,
        linear_value_head_dim: 4,
        linear_conv_kernel_dim: 4,
        output_gate: OutputGate::Silu,
    };
    let mut seed = 11usize;
    let mut gen = |n: usize, scale: f32| -> Vec<f32> {
        seed += 1;
        (0..n)
            .map(|i| ((((i + 7 * seed) * 2_654_435_761) % 2001) as f32 / 1000.0 - 1.0) * scale)
            .collect()
    };
    let mut layers = Vec::new();
    for kind in &hc.layer_types {
        let mixer = match kind {
            LayerKind::FullAttention => Mixer::Attention(Attention {
                qkv: gen((2 * hq * hd + 2 * hkv * hd) * d, 0.3).into(),
                qkv_bias: None,
                q_norm: Some(gen(hd, 0.3).iter().map(|x| 1.0 + x).collect()),
                k_norm: Some(gen(hd, 0.3).iter().map(|x| 1.0 + x).collect()),
                o_proj: gen(d * hq * hd, 0.3).into(),
                gated: true,
            }),
            LayerKind::LinearAttention => Mixer::DeltaNet(DeltaNet {
                in_proj: gen((hc.conv_dim() + hc.value_dim() + 12) * d, 0.3).into(),
                conv: gen(4 * hc.conv_dim(), 0.5).into(), // [K, conv_dim]
                dt_bias: gen(6, 1.0).into(),
                a_log: gen(6, 1.0).into(),
                norm: gen(4, 0.3).iter().map(|x| 1.0 + x).collect(),
                out_proj: gen(d * hc.value_dim(), 0.3).into(),
            }),
        };
        layers.push(Layer {
            norm: gen(d, 0.5).iter().map(|x| 1.0 + x).collect(),
            mixer,
            ffn_norm: gen(d, 0.5).iter().map(|x| 1.0 + x).collect(),
            ffn: Ffn::Dense(SwiGlu {
                gate_up: gen(2 * f * d, 0.3).into(),
                down: gen(d * f, 0.3).into(),
                width: f,
            }),
        });
    }
    let weights = Model {
        embed: gen(vocab * d, 1.0).into(),
        layers,
        final_norm: vec![1.0; d].into(),
        lm_head: None,
    };
    let config = ModelConfig {
        tie_word_embeddings: true,
        qk_norm: true,
        hybrid: Some(hc),
        ..ModelConfig::for_test(Family::Qwen3_5, 3, d, hq, hkv, hd, f, vocab)
    };
    config.validate().unwrap();
    CpuModel::new(config, weights)
}
