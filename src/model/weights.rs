//! Weights widened to f32 and laid out for the CPU kernels.
//!
//! q/k/v projections are concatenated into one `[q + 2·kv, d]` matrix and gate/up into
//! one `[2·f, d]` matrix, so each block does two large GEMMs instead of five small ones.

use crate::artifact::Artifact;
use crate::model::config::ModelConfig;
use anyhow::Result;

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,      // [d]
    pub wqkv: Vec<f32>,           // [q + 2kv, d]
    pub bqkv: Option<Vec<f32>>,   // [q + 2kv]
    pub q_norm: Option<Vec<f32>>, // [head_dim]
    pub k_norm: Option<Vec<f32>>, // [head_dim]
    pub wo: Vec<f32>,             // [d, q]
    pub mlp_norm: Vec<f32>,       // [d]
    pub wgu: Vec<f32>,            // [2f, d]
    pub wdown: Vec<f32>,          // [d, f]
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
        let c: &ModelConfig = &a.config;
        let total = c.expected_tensors().len();
        let mut done = 0usize;
        let mut get = |name: &str| -> Result<Vec<f32>> {
            let t = a.tensor_f32(name)?;
            done += 1;
            progress(done, total);
            Ok(t)
        };
        let embed = get("model.embed_tokens.weight")?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            let attn_norm = get(&format!("{p}.input_layernorm.weight"))?;
            let mut wqkv = get(&format!("{p}.self_attn.q_proj.weight"))?;
            wqkv.extend(get(&format!("{p}.self_attn.k_proj.weight"))?);
            wqkv.extend(get(&format!("{p}.self_attn.v_proj.weight"))?);
            let bqkv = if c.attention_bias {
                let mut b = get(&format!("{p}.self_attn.q_proj.bias"))?;
                b.extend(get(&format!("{p}.self_attn.k_proj.bias"))?);
                b.extend(get(&format!("{p}.self_attn.v_proj.bias"))?);
                Some(b)
            } else {
                None
            };
            let (q_norm, k_norm) = if c.qk_norm {
                (
                    Some(get(&format!("{p}.self_attn.q_norm.weight"))?),
                    Some(get(&format!("{p}.self_attn.k_norm.weight"))?),
                )
            } else {
                (None, None)
            };
            let wo = get(&format!("{p}.self_attn.o_proj.weight"))?;
            let mlp_norm = get(&format!("{p}.post_attention_layernorm.weight"))?;
            let mut wgu = get(&format!("{p}.mlp.gate_proj.weight"))?;
            wgu.extend(get(&format!("{p}.mlp.up_proj.weight"))?);
            let wdown = get(&format!("{p}.mlp.down_proj.weight"))?;
            layers.push(LayerWeights {
                attn_norm,
                wqkv,
                bqkv,
                q_norm,
                k_norm,
                wo,
                mlp_norm,
                wgu,
                wdown,
            });
        }
        let final_norm = get("model.norm.weight")?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(get("lm_head.weight")?)
        };
        Ok(Weights {
            embed,
            layers,
            final_norm,
            lm_head,
        })
    }
}
