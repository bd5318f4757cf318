//! GGUF reader for the `llama` architecture.
//!
//! A GGUF file is a little-endian container: the magic `GGUF`, a version (2 and 3 are read
//! here; they differ from version 1 in using 64-bit counts and lengths), the number of
//! tensors and of metadata entries, the metadata (typed key/value pairs, arrays included),
//! one descriptor per tensor (name, dimensions fastest-first, ggml type, offset), padding up
//! to `general.alignment` (32 by default), then the tensor data, each tensor at its offset
//! from the start of that data section.
//!
//! [`read_gguf`] turns such a file into a [`PackSource`]:
//! - the metadata becomes a [`ModelConfig`];
//! - every tensor is dequantized to f32 with ggml's own definitions (F32, F16, BF16, Q8_0,
//!   Q4_0, Q4_1; anything else is refused by name);
//! - tensors get their Hugging Face names and shapes (GGUF lists `ne[0]`, the row length,
//!   first, so the shape is the dimension list reversed);
//! - the Q and K projections are un-permuted: llama.cpp's converter reorders their rows so
//!   that each head's rotary pairs are adjacent (interleaved RoPE); the engine uses the
//!   Hugging Face rotate-half layout, where the pair of row `j` is row `j + head_dim/2`;
//! - the tokenizer is rebuilt as a Hugging Face `tokenizer.json` (see
//!   [`super::gguf_tokenizer`]).

mod file;
mod metadata;
mod types;

pub use file::{GgufFile, GgufTensorInfo, DEFAULT_ALIGNMENT, GGUF_MAGIC};
pub use metadata::{GgufMetadata, GgufValue};
pub use types::{
    dequantize, dequantize_q4_0, dequantize_q4_1, dequantize_q8_0, unpermute_qk, GgmlType,
};

use super::{gguf_tokenizer, PackSource, SourceFile, SourceTensor, TensorData};
use crate::artifact::source::Deferred;
use crate::model::config::{Family, ModelConfig};
use anyhow::{anyhow, bail, Context, Result};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// The Hugging Face name of a llama-architecture GGUF tensor, or `None` if unknown.
pub fn hf_tensor_name(gguf_name: &str) -> Option<String> {
    let fixed = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = fixed {
        return Some(n.to_string());
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, suffix) = rest.split_once('.')?;
    // Canonical decimal only: "07" or "+7" would alias another layer's name.
    if layer.is_empty()
        || !layer.bytes().all(|b| b.is_ascii_digit())
        || (layer.len() > 1 && layer.starts_with('0'))
    {
        return None;
    }
    let layer: usize = layer.parse().ok()?;
    let hf = match suffix {
        "attn_norm.weight" => "input_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// The [`ModelConfig`] a llama-architecture GGUF describes. `has_output` says whether the
/// file holds a separate `output.weight` (otherwise the embeddings are tied).
pub fn llama_config(md: &GgufMetadata, has_output: bool) -> Result<ModelConfig> {
    let file = md.file();
    let arch = md.req_str("general.architecture")?;
    if arch != "llama" {
        bail!("GGUF {file}: architecture `{arch}` is not supported (only `llama`)");
    }
    if let Some(kind) = md.opt_str("llama.rope.scaling.type")? {
        if kind != "none" {
            bail!(
                "GGUF {file}: RoPE scaling type `{kind}` (`llama.rope.scaling.type`) is not supported"
            );
        }
    }
    let hidden = md.req_usize("llama.embedding_length")?;
    let heads = md.req_usize("llama.attention.head_count")?;
    if heads == 0 || hidden % heads != 0 {
        bail!("GGUF {file}: embedding_length {hidden} is not a multiple of head_count {heads}");
    }
    // GGUF allows head_count_kv to be an array (one per layer); only a single value is used
    // by this engine.
    let kv_heads = match md.get("llama.attention.head_count_kv") {
        None => heads,
        Some(GgufValue::Array(_)) => {
            bail!("GGUF {file}: per-layer `llama.attention.head_count_kv` is not supported")
        }
        Some(_) => md.req_usize("llama.attention.head_count_kv")?,
    };
    let head_dim = match md.opt_usize("llama.attention.key_length")? {
        Some(k) => k,
        None => hidden / heads,
    };
    if let Some(v) = md.opt_usize("llama.attention.value_length")? {
        if v != head_dim {
            bail!(
                "GGUF {file}: value_length {v} differs from key_length {head_dim} (not supported)"
            );
        }
    }
    if let Some(rot) = md.opt_usize("llama.rope.dimension_count")? {
        if rot != head_dim {
            bail!(
                "GGUF {file}: partial rotary embeddings (rope.dimension_count {rot}, head_dim {head_dim}) are not supported"
            );
        }
    }
    let tokens_len = md.opt_str_array("tokenizer.ggml.tokens")?.map(|t| t.len());
    let vocab_key = md.opt_usize("llama.vocab_size")?;
    let vocab_size = match (tokens_len, vocab_key) {
        (Some(t), Some(v)) if t != v => bail!(
            "GGUF {file}: `llama.vocab_size` is {v} but `tokenizer.ggml.tokens` holds {t} tokens"
        ),
        (Some(t), _) => t,
        (None, Some(v)) => v,
        (None, None) => bail!("GGUF {file}: neither `tokenizer.ggml.tokens` nor `llama.vocab_size` gives the vocabulary size"),
    };
    let to_u32 = |key: &str| -> Result<Option<u32>> {
        match md.opt_u64(key)? {
            None => Ok(None),
            Some(v) => u32::try_from(v)
                .map(Some)
                .map_err(|_| anyhow!("GGUF {file}: `{key}` = {v} does not fit a token id")),
        }
    };
    let config = ModelConfig {
        family: Family::Llama,
        vocab_size,
        hidden_size: hidden,
        intermediate_size: md.req_usize("llama.feed_forward_length")?,
        num_layers: md.req_usize("llama.block_count")?,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        rms_norm_eps: md.req_f64("llama.attention.layer_norm_rms_epsilon")?,
        rope_theta: md.opt_f64("llama.rope.freq_base")?.unwrap_or(10000.0),
        rope_scaling: None,
        max_position_embeddings: md.req_usize("llama.context_length")?,
        tie_word_embeddings: !has_output,
        attention_bias: false,
        qk_norm: false,
        bos_token_id: to_u32("tokenizer.ggml.bos_token_id")?,
        eos_token_id: to_u32("tokenizer.ggml.eos_token_id")?,
        hybrid: None,
        moe: None,
    };
    config
        .validate()
        .with_context(|| format!("GGUF {file}: invalid model configuration"))?;
    Ok(config)
}

/// Read a llama-architecture GGUF file into a [`PackSource`].
pub fn read_gguf(path: &Path) -> Result<PackSource> {
    let gguf = GgufFile::open(path)?;
    let shown = gguf.path.display().to_string();
    let md = &gguf.metadata;

    // Architecture first: every later message assumes llama.
    let arch = md.req_str("general.architecture")?;
    if arch != "llama" {
        bail!("GGUF {shown}: architecture `{arch}` is not supported (only `llama`)");
    }

    // Names and types before any work, so a bad file fails fast and by name.
    let mut by_hf: HashMap<String, &GgufTensorInfo> = HashMap::new();
    for t in &gguf.tensors {
        if !t.ggml_type.is_supported() {
            bail!(
                "GGUF {shown}: tensor `{}` has ggml type {}, which is not supported (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)",
                t.name,
                t.ggml_type
            );
        }
        if t.name == "rope_freqs.weight" {
            bail!("GGUF {shown}: tensor `rope_freqs.weight` (Llama 3 RoPE frequency scaling) is not supported");
        }
        let hf = hf_tensor_name(&t.name).ok_or_else(|| {
            anyhow!(
                "GGUF {shown}: unexpected tensor `{}` for the llama architecture",
                t.name
            )
        })?;
        by_hf.insert(hf, t);
    }
    let has_output = by_hf.contains_key("lm_head.weight");
    let config = llama_config(md, has_output)?;

    // Every expected tensor present with the expected shape, nothing extra.
    let expected = config.expected_tensors();
    if by_hf.len() != expected.len() || expected.iter().any(|(n, _)| !by_hf.contains_key(n)) {
        let missing: Vec<&str> = expected
            .iter()
            .filter(|(n, _)| !by_hf.contains_key(n))
            .map(|(n, _)| n.as_str())
            .collect();
        let want: std::collections::HashSet<&str> =
            expected.iter().map(|(n, _)| n.as_str()).collect();
        let extra: Vec<&str> = gguf
            .tensors
            .iter()
            .filter(|t| !want.contains(hf_tensor_name(&t.name).unwrap().as_str()))
            .map(|t| t.name.as_str())
            .collect();
        bail!(
            "GGUF {shown}: tensors do not match the configuration ({} layers): missing {:?}, unexpected {:?}",
            config.num_layers,
            missing.iter().take(8).collect::<Vec<_>>(),
            extra.iter().take(8).collect::<Vec<_>>()
        );
    }
    for (name, shape) in &expected {
        let t = by_hf[name];
        if &t.hf_shape() != shape {
            bail!(
                "GGUF {shown}: tensor `{}` has dimensions {:?} (Hugging Face shape {:?}), but the configuration expects {:?}",
                t.name,
                t.dims,
                t.hf_shape(),
                shape
            );
        }
        let (block, _) = t.ggml_type.block_layout().unwrap();
        if !(t.dims[0] as usize).is_multiple_of(block) {
            bail!(
                "GGUF {shown}: tensor `{}` rows of {} elements are not whole {} blocks of {block}",
                t.name,
                t.dims[0],
                t.ggml_type
            );
        }
        // Range check for every tensor before dequantizing any.
        gguf.tensor_data(t)?;
    }

    // The tokenizer before the (slow) dequantization: it fails fast too.
    let tokenizer_json = gguf_tokenizer::tokenizer_json(md)?;

    // Each tensor is dequantized when the writer reaches it (one at a time).
    let mut tensors = Vec::with_capacity(expected.len());
    for (name, shape) in &expected {
        let t = by_hf[name];
        let (ty, gname, shape2) = (t.ggml_type, t.name.clone(), shape.clone());
        let at = gguf.tensor_range(t)?;
        let shown = shown.clone();
        let n_head = if name.ends_with("self_attn.q_proj.weight") {
            Some(config.num_heads)
        } else if name.ends_with("self_attn.k_proj.weight") {
            Some(config.num_kv_heads)
        } else {
            None
        };
        let make = move || -> Result<TensorData> {
            let raw = at.read()?;
            let mut data = vec![0f32; shape2.iter().product()];
            dequantize(ty, &raw, &mut data)
                .with_context(|| format!("GGUF {shown}: tensor `{gname}`"))?;
            if let Some(n_head) = n_head {
                data = unpermute_qk(&data, shape2[0], shape2[1], n_head)
                    .with_context(|| format!("GGUF {shown}: tensor `{gname}`"))?;
            }
            Ok(TensorData::Values(data))
        };
        tensors.push(SourceTensor {
            name: name.clone(),
            shape: shape.clone(),
            data: TensorData::Deferred(Deferred::values(make)),
            origin: gguf.path.clone(),
        });
    }

    let mut source_dtypes = BTreeMap::new();
    for t in &gguf.tensors {
        *source_dtypes.entry(t.ggml_type.name()).or_insert(0usize) += 1;
    }
    // Read, not mapped: hashing a mapping would make the whole file resident.
    let sha256 = super::hf::source_file(&gguf.path, "the GGUF file")?.sha256;
    Ok(PackSource {
        config,
        tokenizer_json,
        tensors,
        source_kind: "gguf".to_string(),
        source_files: vec![SourceFile {
            // The file name only: provenance (and so the digest) must not depend on where
            // the input happened to be on the packing machine.
            path: gguf
                .path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| shown.clone()),
            sha256,
            bytes: gguf.bytes().len() as u64,
        }],
        source_dtypes,
        notes: Vec::new(),
        quantization: None,
        packer_args: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_hugging_face() {
        assert_eq!(
            hf_tensor_name("token_embd.weight").unwrap(),
            "model.embed_tokens.weight"
        );
        assert_eq!(
            hf_tensor_name("blk.12.attn_q.weight").unwrap(),
            "model.layers.12.self_attn.q_proj.weight"
        );
        assert_eq!(
            hf_tensor_name("blk.0.ffn_down.weight").unwrap(),
            "model.layers.0.mlp.down_proj.weight"
        );
        assert_eq!(hf_tensor_name("output.weight").unwrap(), "lm_head.weight");
        assert!(hf_tensor_name("blk.01.attn_q.weight").is_none());
        assert!(hf_tensor_name("blk.x.attn_q.weight").is_none());
        assert!(hf_tensor_name("blk.1.attn_q.bias").is_none());
        assert!(hf_tensor_name("rope_freqs.weight").is_none());
    }
}
