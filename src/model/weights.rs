//! Weights widened to f32 and laid out for the CPU kernels.
//!
//! The stacked matrices (q/k/v into one `[q + 2·kv, d]`, gate/up into one `[2·f, d]`) are
//! the groups [`super::tensors`] defines, so each block does two large GEMMs instead of five
//! small ones.

use crate::artifact::Artifact;
use crate::model::tensors::{Fused, ModelTensors};
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
        let names = ModelTensors::of(&a.config);
        let mut r = Reader {
            a,
            done: 0,
            total: ModelTensors::count(&a.config),
            progress,
        };
        let embed = r.fused(&names.embed)?;
        let mut layers = Vec::with_capacity(names.layers.len());
        for l in &names.layers {
            let at = &l.attention;
            layers.push(LayerWeights {
                attn_norm: r.one(&at.norm)?,
                wqkv: r.fused(&at.qkv)?,
                bqkv: at.qkv_bias.as_ref().map(|f| r.fused(f)).transpose()?,
                q_norm: at.q_norm.as_ref().map(|n| r.one(n)).transpose()?,
                k_norm: at.k_norm.as_ref().map(|n| r.one(n)).transpose()?,
                wo: r.fused(&at.o_proj)?,
                mlp_norm: r.one(&l.mlp.norm)?,
                wgu: r.fused(&l.mlp.gate_up)?,
                wdown: r.fused(&l.mlp.down)?,
            });
        }
        Ok(Weights {
            embed,
            layers,
            final_norm: r.one(&names.final_norm)?,
            lm_head: names.lm_head.as_ref().map(|f| r.fused(f)).transpose()?,
        })
    }
}

/// Reads tensors widened to f32, counting them for the progress callback.
struct Reader<'a> {
    a: &'a Artifact,
    done: usize,
    total: usize,
    progress: &'a mut dyn FnMut(usize, usize),
}

impl Reader<'_> {
    fn one(&mut self, name: &str) -> Result<Vec<f32>> {
        let t = self.a.tensor_f32(name)?;
        self.done += 1;
        (self.progress)(self.done, self.total);
        Ok(t)
    }

    /// A stacked matrix: its parts' rows, one after another.
    fn fused(&mut self, f: &Fused) -> Result<Vec<f32>> {
        let mut m = Vec::with_capacity(f.rows * f.cols);
        for p in &f.parts {
            m.extend(self.one(p)?);
        }
        Ok(m)
    }
}
