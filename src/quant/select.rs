//! Which matrices the packer quantizes, and which share an nvfp4 global scale.
//!
//! Public recipes (ModelOpt's, the Qwen `*-FP8` releases) quantize the decoder's linear layers
//! and leave the embeddings, norms, output head and the small Gated DeltaNet projections
//! (`in_proj_a`, `in_proj_b`, one value per head) and the conv taps in bf16. The same default
//! here keeps a packed artifact comparable with a downloaded one; `--quantize-head` adds the
//! head. Linears that read the same input share one global amax (ModelOpt's rule): otherwise
//! the q, k and v of one layer could get scales that a fused kernel cannot share. A
//! mixture-of-experts MLP's experts and shared expert are quantized like a dense MLP (each
//! expert's gate and up sharing one amax); its router and the shared expert's gate, one row
//! or a few per expert, stay in bf16 as in ModelOpt's recipes.

/// The linear layers quantized by default, by the last two name components.
const LINEARS: &[(&str, &str)] = &[
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
    ("linear_attn", "in_proj_qkv"),
    ("linear_attn", "in_proj_z"),
    ("linear_attn", "out_proj"),
];

/// The head's tensor name.
pub const HEAD: &str = "lm_head.weight";

/// `model.layers.{i}.{block}.{proj}.weight` split into its parts: `(i, block, proj)`. A
/// mixture-of-experts MLP's experts (`mlp.experts.{e}.{proj}`, `mlp.shared_expert.{proj}`)
/// are linears of `mlp` too; their sub-block (`experts.{e}`, `shared_expert`) is the fourth
/// part, empty for the others.
fn layer_linear(name: &str) -> Option<(&str, &str, &str, &str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let rest = rest.strip_suffix(".weight")?;
    let (layer, rest) = rest.split_once('.')?;
    let (block, rest) = rest.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (sub, proj) = match rest.rsplit_once('.') {
        None => ("", rest),
        Some((sub, proj)) => {
            let expert = sub
                .strip_prefix("experts.")
                .is_some_and(|e| !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit()));
            if block != "mlp" || !(expert || sub == "shared_expert") {
                return None;
            }
            (sub, proj)
        }
    };
    Some((layer, block, proj, sub))
}

/// Whether the packer quantizes `name` (`head`: whether `--quantize-head` was given).
pub fn selected(name: &str, head: bool) -> bool {
    if name == HEAD {
        return head;
    }
    layer_linear(name).is_some_and(|(_, b, p, _)| LINEARS.contains(&(b, p)))
}

/// The nvfp4 scale group of a selected matrix: matrices with the same key share one global
/// amax (they read the same input); `None` for a matrix alone in its group.
pub fn group(name: &str) -> Option<String> {
    let (layer, block, proj, sub) = layer_linear(name)?;
    let shared = match (block, proj) {
        ("self_attn", "q_proj" | "k_proj" | "v_proj") => "qkv",
        ("mlp", "gate_proj" | "up_proj") => "gate_up",
        ("linear_attn", "in_proj_qkv" | "in_proj_z") => "in",
        _ => return None,
    };
    // Each expert's gate and up read the same rows: one group per expert.
    Some(match sub {
        "" => format!("{layer}.{block}.{shared}"),
        sub => format!("{layer}.{block}.{sub}.{shared}"),
    })
}

/// The tensor class a report names: `embeddings`, `head`, `attention`, `mlp`, `deltanet`,
/// `norms` or `other`.
pub fn class(name: &str) -> &'static str {
    if name.ends_with("norm.weight") {
        "norms"
    } else if name.contains("embed_tokens") {
        "embeddings"
    } else if name == HEAD {
        "head"
    } else if name.contains(".self_attn.") {
        "attention"
    } else if name.contains(".mlp.") {
        "mlp"
    } else if name.contains(".linear_attn.") {
        "deltanet"
    } else {
        "other"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_the_decoder_linears() {
        assert!(selected("model.layers.0.self_attn.q_proj.weight", false));
        assert!(selected("model.layers.12.mlp.down_proj.weight", false));
        assert!(selected(
            "model.layers.3.linear_attn.in_proj_z.weight",
            false
        ));
        for kept in [
            "model.embed_tokens.weight",
            "model.layers.3.linear_attn.in_proj_a.weight",
            "model.layers.3.linear_attn.conv1d.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.x.mlp.up_proj.weight",
            HEAD,
        ] {
            assert!(!selected(kept, false), "{kept}");
        }
        assert!(selected(HEAD, true));
    }

    #[test]
    fn inputs_read_together_share_a_group() {
        let g = |n: &str| group(&format!("model.layers.4.{n}.weight"));
        assert_eq!(g("self_attn.q_proj"), g("self_attn.v_proj"));
        assert_eq!(g("mlp.gate_proj"), g("mlp.up_proj"));
        assert_eq!(g("linear_attn.in_proj_qkv"), g("linear_attn.in_proj_z"));
        assert_ne!(g("self_attn.q_proj"), g("mlp.up_proj"));
        assert_ne!(
            group("model.layers.4.mlp.up_proj.weight"),
            group("model.layers.5.mlp.up_proj.weight")
        );
        assert_eq!(g("self_attn.o_proj"), None);
        assert_eq!(g("mlp.down_proj"), None);
        // Experts: gate and up of one expert together, experts apart.
        assert_eq!(g("mlp.experts.3.gate_proj"), g("mlp.experts.3.up_proj"));
        assert_ne!(g("mlp.experts.3.up_proj"), g("mlp.experts.4.up_proj"));
        assert_ne!(g("mlp.experts.3.up_proj"), g("mlp.up_proj"));
        assert_eq!(
            g("mlp.shared_expert.gate_proj"),
            g("mlp.shared_expert.up_proj")
        );
        assert_eq!(g("mlp.experts.3.down_proj"), None);
    }

    #[test]
    fn experts_are_quantized_and_routers_are_not() {
        for q in [
            "model.layers.0.mlp.experts.7.gate_proj.weight",
            "model.layers.0.mlp.experts.7.down_proj.weight",
            "model.layers.0.mlp.shared_expert.up_proj.weight",
        ] {
            assert!(selected(q, false), "{q}");
        }
        for kept in [
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.mlp.shared_expert_gate.weight",
            "model.layers.0.mlp.experts.x.gate_proj.weight",
            "model.layers.0.self_attn.experts.1.q_proj.weight",
        ] {
            assert!(!selected(kept, false), "{kept}");
        }
    }
}
