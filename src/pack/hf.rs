//! Hugging Face directory reader: `config.json`, `*.safetensors`, `tokenizer.json`.
//!
//! Supports `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`,
//! `Qwen3MoeForCausalLM` and the Qwen3.5 hybrids (`Qwen3_5ForConditionalGeneration`,
//! `Qwen3_5ForCausalLM`, their `Qwen3_5Moe` twins and `Qwen3NextForCausalLM`; see
//! [`super::qwen3_5`] and, for the experts, [`super::moe`]).
//! Tensor names are (after Qwen3.5's prefix) the ones the artifact uses and RoPE is already
//! rotate-half, so the work is reading the config faithfully (including the defaults
//! transformers applies) and widening the weights to f32 from whatever dtype each tensor's
//! header gives (when the writer reaches each tensor: the reader keeps only where each
//! tensor is). Every `*.safetensors` file of the directory is read; an index, when
//! present, is checked against them.

use super::{PackSource, SourceFile, SourceTensor, TensorData};
use crate::artifact::source::FileRange;
use crate::model::config::{Family, ModelConfig, RopeScaling};
use anyhow::{anyhow, bail, Context, Result};
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// sha256 and size of a file, for provenance; `what` names its role in errors.
pub fn source_file(path: &Path, what: &str) -> Result<SourceFile> {
    use std::io::Read;
    let (mut f, _) =
        crate::input::open_regular(path, what).with_context(|| path.display().to_string())?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("{}: read failed", path.display()))?;
        if n == 0 {
            break;
        }
        bytes += n as u64;
        h.update(&buf[..n]);
    }
    let name = path
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(SourceFile {
        path: name,
        sha256: hex::encode(h.finalize()),
        bytes,
    })
}

pub(crate) fn get_usize(c: &Value, key: &str) -> Result<Option<usize>> {
    match c.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|x| Some(x as usize))
            .ok_or_else(|| anyhow!("config.json: `{key}` must be a non-negative integer")),
    }
}

pub(crate) fn need_usize(c: &Value, key: &str) -> Result<usize> {
    get_usize(c, key)?.ok_or_else(|| anyhow!("config.json: `{key}` is missing"))
}

pub(crate) fn get_f64(c: &Value, key: &str) -> Result<Option<f64>> {
    match c.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| anyhow!("config.json: `{key}` must be a number")),
    }
}

/// A token id field (a number, or a list whose first entry is used); one that does not fit
/// a token id is an error, never a truncated id.
pub(crate) fn first_id(c: &Value, key: &str) -> Result<Option<u32>> {
    let n = match c.get(key) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) => match a.first() {
            None => return Ok(None),
            Some(x) => x,
        },
        Some(x) => x,
    };
    n.as_u64()
        .and_then(|x| u32::try_from(x).ok())
        .map(Some)
        .ok_or_else(|| anyhow!("config.json: `{key}` must be a token id (0..2^32), found {n}"))
}

/// Translates a Hugging Face `config.json` into the engine's config.
pub fn parse_config(c: &Value) -> Result<ModelConfig> {
    let arch = c
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(|a| a.as_str())
        .ok_or_else(|| anyhow!("config.json: `architectures` is missing"))?;
    if super::qwen3_5::ARCHITECTURES.contains(&arch) {
        let cfg = super::qwen3_5::parse_config(c, arch)?;
        cfg.validate().context("config.json")?;
        return Ok(cfg);
    }
    let family = match arch {
        "LlamaForCausalLM" => Family::Llama,
        "Qwen2ForCausalLM" => Family::Qwen2,
        "Qwen3ForCausalLM" => Family::Qwen3,
        "Qwen3MoeForCausalLM" => Family::Qwen3Moe,
        other => bail!(
            "config.json: unsupported architecture `{other}` (supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5ForCausalLM, Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM)"
        ),
    };
    if c.get("mlp_bias").and_then(|v| v.as_bool()) == Some(true) {
        bail!("config.json: `mlp_bias: true` is not supported");
    }
    let hidden = need_usize(c, "hidden_size")?;
    let heads = need_usize(c, "num_attention_heads")?;
    let kv_heads = get_usize(c, "num_key_value_heads")?.unwrap_or(heads);
    if heads == 0 {
        bail!("config.json: `num_attention_heads` must be positive");
    }
    let head_dim = get_usize(c, "head_dim")?.unwrap_or(hidden / heads);
    // transformers 5 moves RoPE settings under `rope_parameters`; 4.x keeps them at top level.
    let rope = c.get("rope_parameters").filter(|v| v.is_object());
    let rope_theta = get_f64(c, "rope_theta")?
        .or(rope
            .and_then(|r| r.get("rope_theta"))
            .and_then(|v| v.as_f64()))
        .unwrap_or(10000.0);
    let scaling_v = c.get("rope_scaling").filter(|v| !v.is_null()).or(rope);
    let rope_scaling = match scaling_v {
        None => None,
        Some(s) => {
            let kind = s
                .get("rope_type")
                .or_else(|| s.get("type"))
                .and_then(|v| v.as_str())
                .unwrap_or("default");
            match kind {
                "default" => None,
                "llama3" => {
                    let f = |k: &str| {
                        s.get(k)
                            .and_then(|v| v.as_f64())
                            .ok_or_else(|| anyhow!("config.json: rope scaling `{k}` is missing"))
                    };
                    Some(RopeScaling {
                        factor: f("factor")?,
                        low_freq_factor: f("low_freq_factor")?,
                        high_freq_factor: f("high_freq_factor")?,
                        original_max_position_embeddings: f("original_max_position_embeddings")?
                            as u64,
                    })
                }
                other => bail!(
                    "config.json: unsupported RoPE scaling `{other}` (supported: default, llama3)"
                ),
            }
        }
    };
    let attention_bias = match family {
        Family::Qwen2 => true,
        _ => c
            .get("attention_bias")
            .and_then(|v| v.as_bool())
            .unwrap_or(false),
    };
    let cfg = ModelConfig {
        family,
        vocab_size: need_usize(c, "vocab_size")?,
        hidden_size: hidden,
        intermediate_size: need_usize(c, "intermediate_size")?,
        num_layers: need_usize(c, "num_hidden_layers")?,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        rms_norm_eps: get_f64(c, "rms_norm_eps")?.unwrap_or(1e-6),
        rope_theta,
        rope_scaling,
        max_position_embeddings: get_usize(c, "max_position_embeddings")?.unwrap_or(2048),
        tie_word_embeddings: c
            .get("tie_word_embeddings")
            .and_then(|v| v.as_bool())
            .unwrap_or(false),
        attention_bias,
        qk_norm: matches!(family, Family::Qwen3 | Family::Qwen3Moe),
        bos_token_id: first_id(c, "bos_token_id")?,
        eos_token_id: first_id(c, "eos_token_id")?,
        hybrid: None,
        moe: match family {
            Family::Qwen3Moe => Some(super::moe::qwen3_moe(
                c,
                need_usize(c, "num_hidden_layers")?,
            )?),
            _ => None,
        },
    };
    cfg.validate().context("config.json")?;
    Ok(cfg)
}

/// Reads a Hugging Face model directory. `tokenizer` overrides `DIR/tokenizer.json`.
pub fn read_hf_dir(dir: &Path, tokenizer: Option<&Path>) -> Result<PackSource> {
    if !dir.is_dir() {
        bail!("{}: not a directory", dir.display());
    }
    let cfg_path = dir.join("config.json");
    let cfg_text = crate::input::read_text_bounded(&cfg_path, "config.json", 16 << 20)
        .with_context(|| cfg_path.display().to_string())?;
    let cfg_json: Value = serde_json::from_str(&cfg_text)
        .with_context(|| format!("{}: invalid JSON", cfg_path.display()))?;
    let config = parse_config(&cfg_json).with_context(|| dir.display().to_string())?;

    let tok_path: PathBuf = tokenizer
        .map(Path::to_path_buf)
        .unwrap_or_else(|| dir.join("tokenizer.json"));
    let tokenizer_json = crate::input::read_text_bounded(&tok_path, "the tokenizer", 256 << 20)
        .with_context(|| {
            format!(
                "{} (pass --tokenizer FILE if it lives elsewhere)",
                tok_path.display()
            )
        })?;
    crate::tokenizer::Tokenizer::from_json(&tokenizer_json)
        .with_context(|| tok_path.display().to_string())?;

    let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("{}: cannot list", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    shards.sort();
    if shards.is_empty() {
        bail!("{}: no *.safetensors files", dir.display());
    }
    let mut source_files = vec![
        source_file(&cfg_path, "config.json")?,
        source_file(&tok_path, "the tokenizer")?,
    ];
    let hybrid = config.family.is_qwen3_5();
    let mut tensors = Vec::new();
    let mut source_dtypes = BTreeMap::new();
    let mut dropped: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut seen: BTreeMap<String, PathBuf> = BTreeMap::new();
    let claim = super::hf_quant::read_claim(dir, &cfg_json)?;
    let mut quant_parts = BTreeMap::new();
    for shard in &shards {
        source_files.push(source_file(shard, "a safetensors shard")?);
        let (file, _) = crate::input::open_regular(shard, "a safetensors shard")
            .with_context(|| shard.display().to_string())?;
        // SAFETY: read-only mapping of a file this process does not modify.
        let mmap = unsafe { memmap2::Mmap::map(&file) }
            .with_context(|| format!("{}: cannot map", shard.display()))?;
        // The mapping is parsed for the header only; tensors are read later with `pread`,
        // one at a time, by the writer.
        let file = std::sync::Arc::new(file);
        let path: std::sync::Arc<Path> = shard.as_path().into();
        let base = mmap.as_ptr() as usize;
        let range = |data: &[u8]| {
            FileRange::new(
                file.clone(),
                path.clone(),
                (data.as_ptr() as usize - base) as u64,
                data.len(),
            )
        };
        let st = SafeTensors::deserialize(&mmap)
            .map_err(|e| anyhow!("{}: invalid safetensors: {e}", shard.display()))?;
        for (stored, view) in st.tensors() {
            if let Some(first) = seen.insert(stored.clone(), shard.clone()) {
                bail!(
                    "{}: tensor `{stored}` is also in {}",
                    shard.display(),
                    first.display()
                );
            }
            let name = if hybrid {
                match super::qwen3_5::tensor_name(&stored) {
                    super::qwen3_5::Rename::Keep(n) => n,
                    super::qwen3_5::Rename::Drop(part) => {
                        *dropped.entry(part).or_insert(0) += 1;
                        continue;
                    }
                }
            } else {
                stored
            };
            if config.tie_word_embeddings && name == "lm_head.weight" {
                continue; // a tied head saved twice
            }
            if name.ends_with("rotary_emb.inv_freq") {
                continue; // a buffer some exporters save; recomputed from the config
            }
            *source_dtypes
                .entry(format!("{:?}", view.dtype()))
                .or_insert(0) += 1;
            if super::hf_quant::is_part(&name, view.dtype()) {
                quant_parts.insert(
                    name,
                    super::hf_quant::Raw {
                        dtype: view.dtype(),
                        shape: view.shape().to_vec(),
                        bytes: range(view.data()),
                        origin: shard.clone(),
                    },
                );
                continue;
            }
            if !matches!(view.dtype(), Dtype::F32 | Dtype::F16 | Dtype::BF16) {
                bail!(
                    "{}: tensor `{name}` has unsupported dtype {:?} (supported: F32, F16, BF16)",
                    shard.display(),
                    view.dtype()
                );
            }
            tensors.push(SourceTensor {
                name,
                shape: view.shape().to_vec(),
                data: TensorData::Mapped {
                    dtype: view.dtype(),
                    bytes: range(view.data()),
                },
                origin: shard.clone(),
            });
        }
    }
    if hybrid && tensors.iter().all(|t| !t.name.starts_with("model.")) && !dropped.is_empty() {
        bail!("{}: the checkpoint has a vision tower but no text model (no model.language_model.* tensors)", dir.display());
    }
    check_index(dir, &seen)?;
    let (quantized, quantization) = super::hf_quant::assemble(quant_parts, claim, &cfg_path)?;
    tensors.extend(quantized);
    if config.family == Family::Qwen3Next {
        let h = config.hybrid.as_ref().expect("qwen3_next is hybrid");
        super::moe::ungroup_qwen3_next(&mut tensors, h)?;
    }
    if config.moe.is_some() {
        super::moe::unfuse_experts(&mut tensors)?;
    }
    let notes = dropped
        .iter()
        .map(|(part, n)| format!("dropped {n} tensors of {part}"))
        .collect();
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(PackSource {
        config,
        tokenizer_json,
        tensors,
        source_kind: "huggingface".into(),
        source_files,
        source_dtypes,
        notes,
        quantization,
        packer_args: None,
    })
}

/// When the directory has a `model.safetensors.index.json`, every tensor it maps must be in
/// the shard it names (a missing or stale shard is an error naming both).
fn check_index(dir: &Path, seen: &BTreeMap<String, PathBuf>) -> Result<()> {
    let index = dir.join("model.safetensors.index.json");
    if !index.exists() {
        return Ok(());
    }
    let bytes = crate::corpus::read_bounded(&index, "index", 64 << 20)
        .with_context(|| index.display().to_string())?;
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| anyhow!("{}: invalid JSON: {e}", index.display()))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| anyhow!("{}: `weight_map` is missing", index.display()))?;
    for (name, shard) in map {
        let shard = shard.as_str().ok_or_else(|| {
            anyhow!(
                "{}: `weight_map.{name}` is not a file name",
                index.display()
            )
        })?;
        match seen.get(name) {
            Some(p) if p.file_name().is_some_and(|f| f == shard) => {}
            Some(p) => bail!(
                "{}: maps `{name}` to {shard}, but it is in {}",
                index.display(),
                p.display()
            ),
            None => bail!(
                "{}: maps `{name}` to {shard}, which does not hold it",
                index.display()
            ),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen3_config_defaults() {
        let c: Value = serde_json::from_str(
            r#"{"architectures":["Qwen3ForCausalLM"],"vocab_size":100,"hidden_size":16,"intermediate_size":32,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,
            "rms_norm_eps":1e-6,"rope_theta":1000000.0,"tie_word_embeddings":true,"eos_token_id":[5,6]}"#,
        )
        .unwrap();
        let m = parse_config(&c).unwrap();
        assert_eq!(m.family, Family::Qwen3);
        assert!(m.qk_norm && !m.attention_bias && m.tie_word_embeddings);
        assert_eq!(m.eos_token_id, Some(5));
    }

    #[test]
    fn token_ids_that_do_not_fit_are_refused() {
        let c: Value = serde_json::from_str(
            r#"{"architectures":["Qwen3ForCausalLM"],"vocab_size":100,"hidden_size":16,"intermediate_size":32,
            "num_hidden_layers":2,"num_attention_heads":4,"bos_token_id":4294967296}"#,
        )
        .unwrap();
        let e = parse_config(&c).unwrap_err().to_string();
        assert!(
            e.contains("`bos_token_id` must be a token id") && e.contains("4294967296"),
            "{e}"
        );
    }

    #[test]
    fn unsupported_architecture_is_named() {
        let c: Value = serde_json::from_str(r#"{"architectures":["MistralForCausalLM"]}"#).unwrap();
        let e = parse_config(&c).unwrap_err().to_string();
        assert!(e.contains("MistralForCausalLM"), "{e}");
    }

    #[test]
    fn transformers5_rope_parameters() {
        let c: Value = serde_json::from_str(
            r#"{"architectures":["LlamaForCausalLM"],"vocab_size":100,"hidden_size":16,"intermediate_size":32,
            "num_hidden_layers":1,"num_attention_heads":2,
            "rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,"factor":8.0,"low_freq_factor":1.0,
            "high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#,
        )
        .unwrap();
        let m = parse_config(&c).unwrap();
        assert_eq!(m.rope_theta, 500000.0);
        assert_eq!(m.rope_scaling.unwrap().factor, 8.0);
        assert_eq!(m.num_kv_heads, 2);
        assert_eq!(m.head_dim, 8);
    }
}
