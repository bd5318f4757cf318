//! Qwen3.5 checkpoints (`Qwen3_5ForConditionalGeneration`, and text-only re-saves as
//! `Qwen3_5ForCausalLM`): their config and tensor names, for the Hugging Face reader.
//!
//! The multimodal checkpoint nests the text model's config under `text_config` and its
//! tensors under `model.language_model.`; beside them sit a vision tower (`model.visual.*`)
//! and a multi-token-prediction head (`mtp.*`) that main-head scoring never uses, so the
//! packer drops both and says so. Whether the head is tied is the **top-level**
//! `tie_word_embeddings` of the multimodal config (transformers ignores the text config's).
//! RoPE settings come from `rope_parameters` (a legacy `rope_scaling` replaces it), then
//! from the text config's own `rope_theta` / `partial_rotary_factor`, then from the
//! defaults (10000, 0.25); for text-only input the multimodal RoPE is plain RoPE.

use super::hf::{get_f64, get_usize, need_usize};
use crate::model::config::{Family, HybridConfig, LayerKind, ModelConfig, OutputGate, MAX_LAYERS};
use anyhow::{anyhow, bail, Result};
use serde_json::Value;

/// The architectures this module reads.
pub const ARCHITECTURES: [&str; 5] = [
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3_5MoeForCausalLM",
    "Qwen3NextForCausalLM",
];

/// The engine's config for a Qwen3.5 `config.json` (`arch` is its architecture).
pub fn parse_config(c: &Value, arch: &str) -> Result<ModelConfig> {
    let multimodal = arch.ends_with("ForConditionalGeneration");
    let next = arch == "Qwen3NextForCausalLM";
    let moe = arch.starts_with("Qwen3_5Moe") || next;
    let tc = if multimodal {
        c.get("text_config")
            .filter(|t| t.is_object())
            .ok_or_else(|| {
                anyhow!("config.json: `text_config` is missing: a {arch} checkpoint without a text model")
            })?
    } else {
        c
    };
    let key = |k: &str| {
        if multimodal {
            format!("text_config.{k}")
        } else {
            k.to_string()
        }
    };
    let field = |k: &str| -> Result<usize> {
        need_usize(tc, k)
            .map_err(|_| anyhow!("config.json: `{}` is missing or not a whole number", key(k)))
    };
    if let Some(act) = tc.get("hidden_act").and_then(|v| v.as_str()) {
        if act != "silu" {
            bail!(
                "config.json: `{}` is `{act}`; qwen3_5 is read with silu only",
                key("hidden_act")
            );
        }
    }
    if tc.get("attention_bias").and_then(|v| v.as_bool()) == Some(true) {
        bail!(
            "config.json: `{}: true` is not supported for qwen3_5",
            key("attention_bias")
        );
    }
    let layers = field("num_hidden_layers")?;
    if layers > MAX_LAYERS {
        bail!(
            "config.json: `{}` is {layers}, above the largest this engine takes ({MAX_LAYERS})",
            key("num_hidden_layers")
        );
    }
    let layer_types = match tc.get("layer_types") {
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, v)| match v.as_str() {
                Some("linear_attention") => Ok(LayerKind::LinearAttention),
                Some("full_attention") => Ok(LayerKind::FullAttention),
                _ => bail!(
                    "config.json: `{}[{i}]` is {v}; expected \"linear_attention\" or \"full_attention\"",
                    key("layer_types")
                ),
            })
            .collect::<Result<Vec<_>>>()?,
        None | Some(Value::Null) => {
            let every = get_usize(tc, "full_attention_interval")?.unwrap_or(4).max(1);
            (0..layers)
                .map(|i| {
                    if (i + 1) % every == 0 {
                        LayerKind::FullAttention
                    } else {
                        LayerKind::LinearAttention
                    }
                })
                .collect()
        }
        Some(other) => bail!("config.json: `{}` must be a list, found {other}", key("layer_types")),
    };
    let head_dim = get_usize(tc, "head_dim")?.unwrap_or(256);
    // RoPE: rope_scaling (legacy) replaces rope_parameters; then the text config's own keys.
    let rope = tc
        .get("rope_scaling")
        .filter(|v| v.is_object())
        .or_else(|| tc.get("rope_parameters").filter(|v| v.is_object()));
    let rope_f64 = |k: &str| -> Result<Option<f64>> {
        match rope.and_then(|r| r.get(k)) {
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| anyhow!("config.json: rope `{k}` must be a number")),
            None => get_f64(tc, k),
        }
    };
    if let Some(kind) = rope.and_then(|r| r.get("rope_type").or_else(|| r.get("type"))) {
        if kind.as_str() != Some("default") {
            bail!(
                "config.json: RoPE type {kind} is not supported for qwen3_5 (supported: default)"
            );
        }
    }
    let rope_theta = rope_f64("rope_theta")?.unwrap_or(10000.0);
    let factor = rope_f64("partial_rotary_factor")?.unwrap_or(0.25);
    if !(factor > 0.0 && factor <= 1.0) {
        bail!("config.json: `partial_rotary_factor` is {factor}; it must lie in (0, 1]");
    }
    let rotary_dim = (head_dim as f64 * factor) as usize; // Python's int(): truncation
    let output_gate = match tc.get("output_gate_type").and_then(|v| v.as_str()) {
        None | Some("silu") | Some("swish") => OutputGate::Silu,
        Some("sigmoid") => OutputGate::Sigmoid,
        Some(other) => bail!(
            "config.json: `{}` is `{other}` (supported: silu, swish, sigmoid)",
            key("output_gate_type")
        ),
    };
    let tie = if multimodal { c } else { tc }
        .get("tie_word_embeddings")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let heads = field("num_attention_heads")?;
    let cfg = ModelConfig {
        family: if next {
            Family::Qwen3Next
        } else if moe {
            Family::Qwen3_5Moe
        } else {
            Family::Qwen3_5
        },
        vocab_size: field("vocab_size")?,
        hidden_size: field("hidden_size")?,
        // Every qwen3_5_moe layer is sparse: the dense width is never used.
        intermediate_size: if next {
            // The width of qwen3_next's dense layers (`mlp_only_layers`).
            get_usize(tc, "intermediate_size")?.unwrap_or(5632)
        } else if moe {
            get_usize(tc, "intermediate_size")?
                .or(get_usize(tc, "moe_intermediate_size")?)
                .unwrap_or(512)
        } else {
            field("intermediate_size")?
        },
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: get_usize(tc, "num_key_value_heads")?.unwrap_or(heads),
        head_dim,
        rms_norm_eps: get_f64(tc, "rms_norm_eps")?.unwrap_or(1e-6),
        rope_theta,
        rope_scaling: None,
        max_position_embeddings: get_usize(tc, "max_position_embeddings")?.unwrap_or(32768),
        tie_word_embeddings: tie,
        attention_bias: false,
        qk_norm: true,
        bos_token_id: super::hf::first_id(tc, "bos_token_id")?,
        eos_token_id: super::hf::first_id(tc, "eos_token_id")?,
        hybrid: Some(HybridConfig {
            layer_types,
            rotary_dim,
            linear_num_key_heads: get_usize(tc, "linear_num_key_heads")?.unwrap_or(16),
            linear_num_value_heads: get_usize(tc, "linear_num_value_heads")?.unwrap_or(32),
            linear_key_head_dim: get_usize(tc, "linear_key_head_dim")?.unwrap_or(128),
            linear_value_head_dim: get_usize(tc, "linear_value_head_dim")?.unwrap_or(128),
            linear_conv_kernel_dim: get_usize(tc, "linear_conv_kernel_dim")?.unwrap_or(4),
            output_gate,
        }),
        moe: if next {
            Some(super::moe::qwen3_next(tc, layers)?)
        } else if moe {
            Some(super::moe::qwen3_5_moe(tc, layers)?)
        } else {
            None
        },
    };
    Ok(cfg)
}

/// What the reader does with a checkpoint tensor.
#[derive(Debug, PartialEq, Eq)]
pub enum Rename {
    /// Keep it under this name.
    Keep(String),
    /// Drop it; the string names the part it belongs to, for the packer's message.
    Drop(&'static str),
}

/// The artifact name of a Qwen3.5 checkpoint tensor.
pub fn tensor_name(name: &str) -> Rename {
    if let Some(rest) = name.strip_prefix("model.language_model.") {
        Rename::Keep(format!("model.{rest}"))
    } else if name.starts_with("model.visual.") {
        Rename::Drop("model.visual.* (the vision tower)")
    } else if name.starts_with("mtp.") {
        Rename::Drop("mtp.* (the multi-token-prediction head)")
    } else {
        Rename::Keep(name.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(extra: &str) -> Value {
        serde_json::from_str(&format!(
            r#"{{"architectures":["Qwen3_5ForCausalLM"],"vocab_size":100,"hidden_size":16,
            "intermediate_size":32,"num_hidden_layers":4,"num_attention_heads":4,
            "num_key_value_heads":2,"head_dim":16,"linear_num_key_heads":2,
            "linear_num_value_heads":6,"linear_key_head_dim":8,"linear_value_head_dim":6{extra}}}"#
        ))
        .unwrap()
    }

    #[test]
    fn defaults_follow_transformers() {
        let c = parse_config(&text(""), "Qwen3_5ForCausalLM").unwrap();
        let h = c.hybrid.as_ref().unwrap();
        // No layer_types: every 4th layer is full attention.
        assert_eq!(h.layer_types[3], LayerKind::FullAttention);
        assert_eq!(h.layer_types[..3], [LayerKind::LinearAttention; 3]);
        assert_eq!((c.rope_theta, h.rotary_dim), (10000.0, 4)); // 16 · 0.25
        assert_eq!(h.output_gate, OutputGate::Silu);
        assert!(!c.tie_word_embeddings);
        c.validate().unwrap();
    }

    #[test]
    fn rope_parameters_win_and_rope_scaling_replaces_them() {
        let c = parse_config(
            &text(r#","rope_theta":5.0,"rope_parameters":{"rope_type":"default","rope_theta":1e7,"partial_rotary_factor":0.5}"#),
            "x",
        )
        .unwrap();
        assert_eq!((c.rope_theta, c.hybrid.unwrap().rotary_dim), (1e7, 8));
        let c = parse_config(
            &text(r#","rope_parameters":{"rope_theta":1e7},"rope_scaling":{"rope_type":"default","rope_theta":3.0}"#),
            "x",
        )
        .unwrap();
        assert_eq!((c.rope_theta, c.hybrid.unwrap().rotary_dim), (3.0, 4));
    }

    #[test]
    fn bad_fields_are_named() {
        let e = parse_config(
            &text(r#","layer_types":["linear_attention","mamba","x","y"]"#),
            "x",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("`layer_types[1]`") && e.contains("mamba"), "{e}");
        let e = parse_config(&text(r#","output_gate_type":"tanh""#), "x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`output_gate_type` is `tanh`"), "{e}");
        let vlm: Value = serde_json::from_str(
            r#"{"architectures":["Qwen3_5ForConditionalGeneration"],"vision_config":{}}"#,
        )
        .unwrap();
        let e = parse_config(&vlm, "Qwen3_5ForConditionalGeneration")
            .unwrap_err()
            .to_string();
        assert!(e.contains("without a text model"), "{e}");
        let c = parse_config(&text(r#","linear_num_value_heads":5"#), "x").unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("not a multiple of linear_num_key_heads"), "{e}");
    }

    #[test]
    fn names_lose_the_language_model_prefix_and_the_rest_is_dropped() {
        assert_eq!(
            tensor_name("model.language_model.layers.0.linear_attn.A_log"),
            Rename::Keep("model.layers.0.linear_attn.A_log".into())
        );
        assert_eq!(
            tensor_name("lm_head.weight"),
            Rename::Keep("lm_head.weight".into())
        );
        assert_eq!(
            tensor_name("model.norm.weight"),
            Rename::Keep("model.norm.weight".into())
        );
        assert!(matches!(
            tensor_name("model.visual.blocks.0.attn.qkv.weight"),
            Rename::Drop(_)
        ));
        assert!(matches!(tensor_name("mtp.fc.weight"), Rename::Drop(_)));
    }
}
