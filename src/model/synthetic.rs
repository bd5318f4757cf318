//! A small llama-shaped model (vocabulary 300, 2 layers) with deterministic pseudo-random
//! weights, for unit tests of the forward pass and the engine's scheduler.

use crate::model::config::{Family, ModelConfig};
use crate::model::forward::CpuModel;
use crate::model::weights::{LayerWeights, Weights};

pub(crate) fn synthetic_model() -> CpuModel {
    let (vocab, d, f, layers, hq, hkv, hd) = (300, 32, 48, 2, 4, 2, 8);
    let mut seed = 1usize;
    let mut gen = |n: usize, scale: f32| -> Vec<f32> {
        seed += 1;
        (0..n)
            .map(|i| ((((i + 7 * seed) * 2_654_435_761) % 2001) as f32 / 1000.0 - 1.0) * scale)
            .collect()
    };
    let layer = |gen: &mut dyn FnMut(usize, f32) -> Vec<f32>| LayerWeights {
        attn_norm: gen(d, 0.5).iter().map(|x| 1.0 + x).collect(),
        wqkv: gen((hq * hd + 2 * hkv * hd) * d, 0.3),
        bqkv: None,
        q_norm: None,
        k_norm: None,
        wo: gen(d * hq * hd, 0.3),
        mlp_norm: gen(d, 0.5).iter().map(|x| 1.0 + x).collect(),
        wgu: gen(2 * f * d, 0.3),
        wdown: gen(d * f, 0.3),
    };
    let weights = Weights {
        embed: gen(vocab * d, 1.0),
        layers: (0..layers).map(|_| layer(&mut gen)).collect(),
        final_norm: vec![1.0; d],
        lm_head: None,
    };
    let config = ModelConfig {
        tie_word_embeddings: true,
        ..ModelConfig::for_test(Family::Llama, layers, d, hq, hkv, hd, f, vocab)
    };
    CpuModel::new(config, weights)
}
