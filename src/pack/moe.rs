//! Mixture-of-experts checkpoints: their config keys, their two expert layouts, and
//! Qwen3-Next's grouped Gated DeltaNet projections.
//!
//! The published Qwen3-MoE checkpoints store every expert's projections apart
//! (`mlp.experts.E.{gate,up,down}_proj.weight`); transformers 5 and the Qwen3.5-MoE
//! checkpoints store them fused per layer, `mlp.experts.gate_up_proj [E, 2I, H]` (each
//! expert's gate rows, then its up rows) and `mlp.experts.down_proj [E, H, I]`. The artifact
//! holds the per-expert layout, so a fused checkpoint is split here: a reordering of rows, no
//! arithmetic. Which layers are sparse follows transformers' rule for qwen3_moe: layer `i` is
//! sparse unless it is in `mlp_only_layers`, when there are experts and
//! `(i + 1) % decoder_sparse_step == 0` (qwen3_next follows the same rule); every layer of
//! qwen3_5_moe is sparse.

use super::hf::get_usize;
use super::{SourceTensor, TensorData};
use crate::artifact::source::{Deferred, Kind};
use crate::model::config::MoeConfig;
use anyhow::{anyhow, bail, Result};
use serde_json::Value;

/// `num_experts` (transformers 5 writes `num_local_experts`; the published configs say
/// `num_experts`), if given.
fn experts_of(c: &Value) -> Result<Option<usize>> {
    Ok(get_usize(c, "num_experts")?.or(get_usize(c, "num_local_experts")?))
}

/// transformers' rule for qwen3_moe and qwen3_next: layer `i` is sparse unless it is in
/// `mlp_only_layers`, when there are experts and `(i + 1) % decoder_sparse_step == 0`.
fn sparse_layers(c: &Value, layers: usize, experts: usize) -> Result<Vec<bool>> {
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
    Ok((0..layers)
        .map(|i| !only.contains(&i) && experts > 0 && (i + 1) % step == 0)
        .collect())
}

fn norm_topk(c: &Value, default: bool) -> bool {
    c.get("norm_topk_prob")
        .and_then(|v| v.as_bool())
        .unwrap_or(default)
}

/// The MoE part of a qwen3_moe `config.json`, with transformers' defaults.
pub fn qwen3_moe(c: &Value, layers: usize) -> Result<MoeConfig> {
    let experts = experts_of(c)?.unwrap_or(128);
    Ok(MoeConfig {
        num_experts: experts,
        num_experts_per_tok: get_usize(c, "num_experts_per_tok")?.unwrap_or(8),
        moe_intermediate_size: get_usize(c, "moe_intermediate_size")?.unwrap_or(768),
        norm_topk_prob: norm_topk(c, false),
        shared_expert_intermediate_size: 0,
        sparse_layers: sparse_layers(c, layers, experts)?,
    })
}

/// The MoE part of a qwen3_next config: qwen3_moe's rule for dense layers, qwen3_next's
/// defaults (512 experts, top-10, renormalised) and a gated shared expert.
pub fn qwen3_next(c: &Value, layers: usize) -> Result<MoeConfig> {
    let experts = experts_of(c)?.unwrap_or(512);
    Ok(MoeConfig {
        num_experts: experts,
        num_experts_per_tok: get_usize(c, "num_experts_per_tok")?.unwrap_or(10),
        moe_intermediate_size: get_usize(c, "moe_intermediate_size")?.unwrap_or(512),
        norm_topk_prob: norm_topk(c, true),
        shared_expert_intermediate_size: get_usize(c, "shared_expert_intermediate_size")?
            .unwrap_or(512),
        sparse_layers: sparse_layers(c, layers, experts)?,
    })
}

/// Un-groups Qwen3-Next's fused Gated DeltaNet projections into the Qwen3.5 layout, in place.
///
/// `in_proj_qkvz [Hk·(2Dk + 2r·Dv), d]` holds, per key head g, `q_g (Dk) | k_g (Dk) | v_g
/// (r·Dv) | z_g (r·Dv)` (the value heads of group g are `g·r .. g·r + r − 1`); it becomes
/// `in_proj_qkv = [q_0..q_{Hk−1} | k_0.. | v_0..]` and `in_proj_z = [z_0..]`. `in_proj_ba
/// [Hk·2r, d]` holds `b_g (r) | a_g (r)` per group and becomes `in_proj_b` and `in_proj_a`.
/// A reordering of rows, no arithmetic; a quantized tensor's rows move with their scales
/// ([`super::rows::gather`]).
pub fn ungroup_qwen3_next(
    tensors: &mut Vec<SourceTensor>,
    h: &crate::model::config::HybridConfig,
) -> Result<()> {
    let (hk, dk, dv) = (
        h.linear_num_key_heads,
        h.linear_key_head_dim,
        h.linear_value_head_dim,
    );
    let r = h.linear_num_value_heads / hk.max(1);
    let mut out = Vec::with_capacity(tensors.len() + tensors.len() / 8);
    for t in std::mem::take(tensors) {
        let (prefix, qkvz) =
            if let Some(p) = t.name.strip_suffix(".linear_attn.in_proj_qkvz.weight") {
                (p.to_string(), true)
            } else if let Some(p) = t.name.strip_suffix(".linear_attn.in_proj_ba.weight") {
                (p.to_string(), false)
            } else {
                out.push(t);
                continue;
            };
        let from = t.origin.display().to_string();
        let group = if qkvz { 2 * dk + 2 * r * dv } else { 2 * r };
        let [rows, cols] = t.shape[..] else {
            bail!(
                "{from}: `{}` has shape {:?}; expected a matrix",
                t.name,
                t.shape
            );
        };
        if rows != hk * group {
            bail!(
                "{from}: `{}` has {rows} rows; the config's {hk} key heads × {group} imply {}",
                t.name,
                hk * group
            );
        }
        // Row ranges within a group, by output: the outputs take their parts part-major
        // (`q` of every group, then `k` of every group, ...).
        let outputs: Vec<(&str, Vec<(usize, usize)>)> = if qkvz {
            vec![
                ("in_proj_qkv", vec![(0, dk), (dk, dk), (2 * dk, r * dv)]),
                ("in_proj_z", vec![(2 * dk + r * dv, r * dv)]),
            ]
        } else {
            vec![("in_proj_b", vec![(0, r)]), ("in_proj_a", vec![(r, r)])]
        };
        for (name, parts) in outputs {
            let spans: Vec<super::rows::Span> = parts
                .iter()
                .flat_map(|&(start, n)| (0..hk).map(move |g| (g * group + start, n)))
                .collect();
            let out_name = format!("{prefix}.linear_attn.{name}.weight");
            let out_rows = spans.iter().map(|s| s.1).sum();
            let take = {
                let (parent, pname, from) = (t.data.clone(), t.name.clone(), from.clone());
                move || {
                    super::rows::gather(&parent, rows, cols, &spans)
                        .map_err(|e| anyhow!("{from}: `{pname}` cannot be un-grouped: {e}"))
                }
            };
            // Values or a quantized matrix in memory are regrouped now; one still in its file
            // when the writer reaches it (a quantized one checked once now, for its layout).
            let data = match &t.data {
                TensorData::Values(_) | TensorData::Quantized(_) | TensorData::Raw { .. } => {
                    take()?
                }
                TensorData::Mapped { .. } => TensorData::Deferred(Deferred::values(take)),
                TensorData::Deferred(d) if *d.kind() == Kind::Values => {
                    TensorData::Deferred(Deferred::values(take))
                }
                TensorData::Deferred(_) => {
                    TensorData::Deferred(Deferred::checked(&out_name, take)?)
                }
            };
            out.push(SourceTensor {
                name: out_name,
                shape: vec![out_rows, cols],
                data,
                origin: t.origin.clone(),
            });
        }
    }
    *tensors = out;
    Ok(())
}

/// The MoE part of a qwen3_5_moe text config (`tc`): every layer sparse, the top-k always
/// renormalised, a shared expert.
pub fn qwen3_5_moe(tc: &Value, layers: usize) -> Result<MoeConfig> {
    Ok(MoeConfig {
        num_experts: experts_of(tc)?.unwrap_or(256),
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
        // Values in memory (tests) are sliced; a tensor still in its file is sliced as byte
        // ranges, each expert read when the writer reaches it.
        let slice = |start: usize, len: usize| -> Result<TensorData> {
            match &t.data {
                TensorData::Values(v) => Ok(TensorData::Values(v[start..start + len].to_vec())),
                TensorData::Mapped { dtype, bytes } => {
                    let size = dtype.bitsize() / 8;
                    Ok(TensorData::Mapped {
                        dtype: *dtype,
                        bytes: bytes.sub(start * size, len * size)?,
                    })
                }
                _ => bail!(
                    "{from}: fused expert tensor `{}` is stored quantized; fused quantized experts are not read yet (a per-expert checkpoint is)",
                    t.name
                ),
            }
        };
        if t.data.values().is_some_and(|v| v.len() != e * rows * cols) {
            bail!(
                "{from}: `{}` holds {} values, not {e}·{rows}·{cols}",
                t.name,
                t.data.values().map_or(0, |v| v.len())
            );
        }
        if gate_up && rows % 2 != 0 {
            bail!(
                "{from}: `{}` has {rows} rows per expert; gate and up need an even number",
                t.name
            );
        }
        let per = rows * cols;
        for x in 0..e {
            let mut push = |proj: &str, start: usize, r: usize| -> Result<()> {
                out.push(SourceTensor {
                    name: format!("{p}.mlp.experts.{x}.{proj}.weight"),
                    shape: vec![r, cols],
                    data: slice(start, r * cols)?,
                    origin: t.origin.clone(),
                });
                Ok(())
            };
            if gate_up {
                let half = rows / 2 * cols;
                push("gate_proj", x * per, rows / 2)?;
                push("up_proj", x * per + half, rows / 2)?;
            } else {
                push("down_proj", x * per, rows)?;
            }
        }
    }
    *tensors = out;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::{HybridConfig, OutputGate};

    fn labelled(name: &str, rows: usize) -> SourceTensor {
        SourceTensor {
            name: name.into(),
            shape: vec![rows, 1],
            data: TensorData::Values((0..rows).map(|r| r as f32).collect()),
            origin: "model.safetensors".into(),
        }
    }

    fn rows(ts: &[SourceTensor], name: &str) -> Vec<f32> {
        let t = ts.iter().find(|t| t.name == name).unwrap();
        t.data.values().unwrap().to_vec()
    }

    /// 2 key heads of dim 1, 2 value heads of dim 1 per key head: each row labelled by its
    /// index, so the output says where every row went.
    #[test]
    fn qwen3_next_projections_are_ungrouped_per_key_head() {
        let h = HybridConfig {
            layer_types: vec![],
            rotary_dim: 2,
            linear_num_key_heads: 2,
            linear_num_value_heads: 4,
            linear_key_head_dim: 1,
            linear_value_head_dim: 1,
            linear_conv_kernel_dim: 4,
            output_gate: OutputGate::Silu,
        };
        let p = "model.layers.0.linear_attn";
        let mut ts = vec![
            labelled(&format!("{p}.in_proj_qkvz.weight"), 12),
            labelled(&format!("{p}.in_proj_ba.weight"), 8),
        ];
        ungroup_qwen3_next(&mut ts, &h).unwrap();
        // group g: q_g | k_g | v_g (2) | z_g (2), 6 rows each
        assert_eq!(
            rows(&ts, &format!("{p}.in_proj_qkv.weight")),
            [0., 6., 1., 7., 2., 3., 8., 9.]
        );
        assert_eq!(
            rows(&ts, &format!("{p}.in_proj_z.weight")),
            [4., 5., 10., 11.]
        );
        // group g: b_g (2) | a_g (2)
        assert_eq!(
            rows(&ts, &format!("{p}.in_proj_b.weight")),
            [0., 1., 4., 5.]
        );
        assert_eq!(
            rows(&ts, &format!("{p}.in_proj_a.weight")),
            [2., 3., 6., 7.]
        );

        let mut bad = vec![labelled(&format!("{p}.in_proj_qkvz.weight"), 10)];
        let e = ungroup_qwen3_next(&mut bad, &h).unwrap_err().to_string();
        assert!(
            e.starts_with("model.safetensors: `model.layers.0.linear_attn.in_proj_qkvz.weight` has 10 rows; the config's 2 key heads × 6 imply 12"),
            "{e}"
        );
    }

    #[test]
    fn fused_experts_split_into_gate_up_and_down() {
        let mut ts = vec![
            SourceTensor {
                name: "model.layers.0.mlp.experts.gate_up_proj".into(),
                shape: vec![2, 4, 1],
                data: TensorData::Values((0..8).map(|r| r as f32).collect()),
                origin: "m.safetensors".into(),
            },
            SourceTensor {
                name: "model.layers.0.mlp.experts.down_proj".into(),
                shape: vec![2, 1, 2],
                data: TensorData::Values((0..4).map(|r| r as f32).collect()),
                origin: "m.safetensors".into(),
            },
        ];
        unfuse_experts(&mut ts).unwrap();
        let e = "model.layers.0.mlp.experts";
        assert_eq!(rows(&ts, &format!("{e}.0.gate_proj.weight")), [0., 1.]);
        assert_eq!(rows(&ts, &format!("{e}.0.up_proj.weight")), [2., 3.]);
        assert_eq!(rows(&ts, &format!("{e}.1.gate_proj.weight")), [4., 5.]);
        assert_eq!(rows(&ts, &format!("{e}.1.up_proj.weight")), [6., 7.]);
        assert_eq!(rows(&ts, &format!("{e}.1.down_proj.weight")), [2., 3.]);
    }
}
