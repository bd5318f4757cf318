//! Mixture-of-experts checkpoints: their config keys and their two expert layouts.
//!
//! The published Qwen3-MoE checkpoints store every expert's projections apart
//! (`mlp.experts.E.{gate,up,down}_proj.weight`); transformers 5 and the Qwen3.5-MoE
//! checkpoints store them fused per layer, `mlp.experts.gate_up_proj [E, 2I, H]` (each
//! expert's gate rows, then its up rows) and `mlp.experts.down_proj [E, H, I]`. The artifact
//! holds the per-expert layout, so a fused checkpoint is split here: a reordering of rows, no
//! arithmetic. Which layers are sparse follows transformers' rule for qwen3_moe: layer `i` is
//! sparse unless it is in `mlp_only_layers`, when there are experts and
//! `(i + 1) % decoder_sparse_step == 0`; every layer of qwen3_5_moe is sparse.

use super::hf::get_usize;
use super::{SourceTensor, TensorData};
use crate::model::config::MoeConfig;
use anyhow::{anyhow, bail, Result};
use serde_json::Value;

/// The MoE part of a qwen3_moe `config.json`, with transformers' defaults.
pub fn qwen3_moe(c: &Value, layers: usize) -> Result<MoeConfig> {
    // transformers 5 writes `num_local_experts`; the published configs say `num_experts`.
    let experts = get_usize(c, "num_experts")?
        .or(get_usize(c, "num_local_experts")?)
        .unwrap_or(128);
    let step = get_usize(c, "decoder_sparse_step")?.unwrap_or(1);
    if step == 0 {
        bail!("config.json: `decoder_sparse_step` must be at least 1");
    }
    let only: Vec<usize> = match c.get("mlp_only_layers") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_u64().map(|x| x as usize).ok_or_else(|| {
                    anyhow!("config.json: `mlp_only_layers` holds {v}, not a layer index")
                })
            })
            .collect::<Result<_>>()?,
        Some(v) => bail!("config.json: `mlp_only_layers` must be a list, found {v}"),
    };
    Ok(MoeConfig {
        num_experts: experts,
        num_experts_per_tok: get_usize(c, "num_experts_per_tok")?.unwrap_or(8),
        moe_intermediate_size: get_usize(c, "moe_intermediate_size")?.unwrap_or(768),
        norm_topk_prob: c
            .get("norm_topk_prob")
            .and_then(|v| v.as_bool())
            .unwrap_or(false),
        shared_expert_intermediate_size: 0,
        sparse_layers: (0..layers)
            .map(|i| !only.contains(&i) && experts > 0 && (i + 1) % step == 0)
            .collect(),
    })
}

/// The MoE part of a qwen3_5_moe text config (`tc`): every layer sparse, the top-k always
/// renormalised, a shared expert.
pub fn qwen3_5_moe(tc: &Value, layers: usize) -> Result<MoeConfig> {
    Ok(MoeConfig {
        num_experts: get_usize(tc, "num_experts")?
            .or(get_usize(tc, "num_local_experts")?)
            .unwrap_or(256),
        num_experts_per_tok: get_usize(tc, "num_experts_per_tok")?.unwrap_or(8),
        moe_intermediate_size: get_usize(tc, "moe_intermediate_size")?.unwrap_or(512),
        norm_topk_prob: true,
        shared_expert_intermediate_size: get_usize(tc, "shared_expert_intermediate_size")?
            .unwrap_or(512),
        sparse_layers: vec![true; layers],
    })
}

/// Splits fused expert tensors (`P.mlp.experts.gate_up_proj [E, 2I, H]`,
/// `P.mlp.experts.down_proj [E, H, I]`) into per-expert ones, in place.
pub fn unfuse_experts(tensors: &mut Vec<SourceTensor>) -> Result<()> {
    let mut out = Vec::with_capacity(tensors.len());
    for t in std::mem::take(tensors) {
        let Some(prefix) = t
            .name
            .strip_suffix(".mlp.experts.gate_up_proj")
            .map(|p| (p, true))
            .or_else(|| {
                t.name
                    .strip_suffix(".mlp.experts.down_proj")
                    .map(|p| (p, false))
            })
        else {
            out.push(t);
            continue;
        };
        let (p, gate_up) = prefix;
        let from = t.origin.display().to_string();
        let [e, rows, cols] = t.shape[..] else {
            bail!(
                "{from}: fused expert tensor `{}` has shape {:?}; expected [experts, rows, cols]",
                t.name,
                t.shape
            );
        };
        let TensorData::Values(v) = &t.data else {
            bail!(
                "{from}: fused expert tensor `{}` is stored quantized; fused quantized experts are not read yet (a per-expert checkpoint is)",
                t.name
            );
        };
        if gate_up && rows % 2 != 0 {
            bail!(
                "{from}: `{}` has {rows} rows per expert; gate and up need an even number",
                t.name
            );
        }
        let per = rows * cols;
        for x in 0..e {
            let block = &v[x * per..(x + 1) * per];
            let mut push = |proj: &str, vals: &[f32], r: usize| {
                out.push(SourceTensor {
                    name: format!("{p}.mlp.experts.{x}.{proj}.weight"),
                    shape: vec![r, cols],
                    data: TensorData::Values(vals.to_vec()),
                    origin: t.origin.clone(),
                });
            };
            if gate_up {
                let half = rows / 2 * cols;
                push("gate_proj", &block[..half], rows / 2);
                push("up_proj", &block[half..], rows / 2);
            } else {
                push("down_proj", block, rows);
            }
        }
    }
    *tensors = out;
    Ok(())
}
