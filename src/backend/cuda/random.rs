//! Random-weight artifacts of any supported shape (Qwen3-8B, say), so throughput can be
//! measured at real scale without real weights. `ninfer-pack random` calls
//! [`write_random_artifact`].
//!
//! The file is a valid `.ninfer` artifact (the reader validates it like any other): bf16
//! matrices, f32 norm vectors, a tokenizer, provenance `source_kind = "random"` and a true
//! digest. It is streamed tensor by tensor, so host memory holds one tensor at a time: the
//! header is written with a placeholder digest of the final length, each tensor is
//! generated, hashed and written in name order (the digest's order), then the header is
//! rewritten with the real digest. Values are a pure function of (seed, tensor name,
//! index), generated in parallel: uniform with the standard deviation 1/sqrt(fan in) for
//! matrices (1 for the embedding), 1 for norm weights, 0 for biases.

use crate::artifact::digest::DigestBuilder;
use crate::artifact::{is_vector_tensor, Provenance, FORMAT_VERSION, MAGIC};
use crate::model::config::{Family, ModelConfig};
use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

/// Named shapes. `qwen3-8b` is Qwen3-8B's config.json; `smollm2-135m` SmolLM2-135M's;
/// `qwen3_5-27b` the text model of the Qwen3.5 27B hybrid (docs/hybrid.md): 48 Gated
/// DeltaNet and 16 gated full-attention layers; `qwen3_5-35b-a3b` the text model of the
/// Qwen3.5 35B-A3B mixture of experts (transformers' `Qwen3_5MoeTextConfig` defaults): the
/// same hybrid layout over 40 layers of width 2048, every MLP 256 experts of width 512 with
/// 8 chosen per token and a gated shared expert of width 512.
pub const PRESETS: [&str; 5] = [
    "qwen3-8b",
    "llama3-8b",
    "smollm2-135m",
    "qwen3_5-27b",
    "qwen3_5-35b-a3b",
];

pub fn preset(name: &str) -> Result<ModelConfig> {
    let base = ModelConfig {
        family: Family::Qwen3,
        vocab_size: 151_936,
        hidden_size: 4096,
        intermediate_size: 12288,
        num_layers: 36,
        num_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        rope_scaling: None,
        max_position_embeddings: 40960,
        tie_word_embeddings: false,
        attention_bias: false,
        qk_norm: true,
        bos_token_id: None,
        eos_token_id: None,
        hybrid: None,
        moe: None,
    };
    Ok(match name {
        "qwen3-8b" => base,
        "llama3-8b" => ModelConfig {
            family: Family::Llama,
            vocab_size: 128_256,
            intermediate_size: 14336,
            num_layers: 32,
            rms_norm_eps: 1e-5,
            rope_theta: 500_000.0,
            max_position_embeddings: 8192,
            qk_norm: false,
            ..base
        },
        "smollm2-135m" => ModelConfig {
            family: Family::Llama,
            vocab_size: 49_152,
            hidden_size: 576,
            intermediate_size: 1536,
            num_layers: 30,
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            rms_norm_eps: 1e-5,
            rope_theta: 100_000.0,
            max_position_embeddings: 8192,
            tie_word_embeddings: true,
            qk_norm: false,
            ..base
        },
        "qwen3_5-27b" => {
            use crate::model::config::{HybridConfig, OutputGate};
            ModelConfig {
                family: Family::Qwen3_5,
                vocab_size: 248_320,
                hidden_size: 5120,
                intermediate_size: 17408,
                num_layers: 64,
                num_heads: 24,
                num_kv_heads: 4,
                head_dim: 256,
                rope_theta: 10_000_000.0,
                max_position_embeddings: 262_144,
                hybrid: Some(HybridConfig {
                    layer_types: every_fourth_full(64),
                    rotary_dim: 64,
                    linear_num_key_heads: 16,
                    linear_num_value_heads: 48,
                    linear_key_head_dim: 128,
                    linear_value_head_dim: 128,
                    linear_conv_kernel_dim: 4,
                    output_gate: OutputGate::Silu,
                }),
                ..base
            }
        }
        "qwen3_5-35b-a3b" => {
            use crate::model::config::{HybridConfig, MoeConfig, OutputGate};
            ModelConfig {
                family: Family::Qwen3_5Moe,
                vocab_size: 248_320,
                hidden_size: 2048,
                // Unused: every layer is sparse.
                intermediate_size: 512,
                num_layers: 40,
                num_heads: 16,
                num_kv_heads: 2,
                head_dim: 256,
                rope_theta: 10_000_000.0,
                max_position_embeddings: 262_144,
                hybrid: Some(HybridConfig {
                    layer_types: every_fourth_full(40),
                    rotary_dim: 64,
                    linear_num_key_heads: 16,
                    linear_num_value_heads: 32,
                    linear_key_head_dim: 128,
                    linear_value_head_dim: 128,
                    linear_conv_kernel_dim: 4,
                    output_gate: OutputGate::Silu,
                }),
                moe: Some(MoeConfig {
                    num_experts: 256,
                    num_experts_per_tok: 8,
                    moe_intermediate_size: 512,
                    norm_topk_prob: true,
                    shared_expert_intermediate_size: 512,
                    sparse_layers: vec![true; 40],
                }),
                ..base
            }
        }
        other => bail!("unknown preset `{other}` (valid: {})", PRESETS.join(", ")),
    })
}

/// Qwen3.5's layer layout: three Gated DeltaNet layers, then a full-attention one.
fn every_fourth_full(layers: usize) -> Vec<crate::model::config::LayerKind> {
    use crate::model::config::LayerKind;
    (0..layers)
        .map(|i| {
            if (i + 1) % 4 == 0 {
                LayerKind::FullAttention
            } else {
                LayerKind::LinearAttention
            }
        })
        .collect()
}

/// GPT-2's byte-to-character map of byte-level BPE.
fn byte_chars() -> Vec<char> {
    let mut out = vec!['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        out[b as usize] = if printable {
            char::from_u32(b).unwrap()
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap()
        };
    }
    out
}

/// A byte-level BPE tokenizer with the 256 byte tokens and no merges: every UTF-8 byte is
/// one token, so any text tokenizes inside any vocabulary of 256 or more.
pub fn byte_tokenizer_json() -> String {
    let vocab: serde_json::Map<String, serde_json::Value> = byte_chars()
        .into_iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), serde_json::json!(i)))
        .collect();
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": []
        }
    })
    .to_string()
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn name_seed(seed: u64, name: &str) -> u64 {
    name.bytes()
        .fold(splitmix(seed), |h, b| splitmix(h ^ b as u64))
}

/// Value `i` of a tensor: uniform on [-a, a) with a = sqrt(3)·std.
fn uniform(tseed: u64, i: u64, amp: f32) -> f32 {
    let u = (splitmix(tseed ^ i.wrapping_mul(0xD6E8_FEB8_6659_FD93)) >> 40) as f32
        / (1u64 << 24) as f32;
    (2.0 * u - 1.0) * amp
}

/// The bytes and dtype name of one tensor.
pub fn tensor_bytes(name: &str, shape: &[usize], seed: u64) -> (&'static str, Vec<u8>) {
    let n: usize = shape.iter().product();
    let tseed = name_seed(seed, name);
    if is_vector_tensor(name, shape) {
        let v = if name.ends_with(".bias") { 0.0f32 } else { 1.0 };
        let data = vec![v; n];
        return ("F32", bytemuck::cast_slice::<f32, u8>(&data).to_vec());
    }
    // Fan in: every dim after the first (a depthwise conv's `[channels, 1, K]`: K).
    let std = if name == crate::model::layout::EMBED {
        1.0
    } else {
        1.0 / (shape[1..].iter().product::<usize>() as f32).sqrt()
    };
    let amp = 3f32.sqrt() * std;
    let mut out = vec![0u16; n];
    out.par_chunks_mut(1 << 16)
        .enumerate()
        .for_each(|(ci, chunk)| {
            let base = (ci << 16) as u64;
            for (j, o) in chunk.iter_mut().enumerate() {
                *o = half::bf16::from_f32(uniform(tseed, base + j as u64, amp)).to_bits();
            }
        });
    ("BF16", bytemuck::cast_slice::<u16, u8>(&out).to_vec())
}

/// What to generate.
pub struct RandomSpec {
    pub config: ModelConfig,
    pub seed: u64,
    /// A Hugging Face tokenizer.json; the byte tokenizer when None.
    pub tokenizer_json: Option<String>,
}

fn header(
    meta: &BTreeMap<String, String>,
    entries: &[(String, &'static str, Vec<usize>, usize, usize)],
) -> Vec<u8> {
    let mut h = serde_json::Map::new();
    h.insert("__metadata__".into(), serde_json::to_value(meta).unwrap());
    for (name, dtype, shape, a, b) in entries {
        h.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [a, b]}),
        );
    }
    let mut bytes = serde_json::to_vec(&serde_json::Value::Object(h)).unwrap();
    while !bytes.len().is_multiple_of(8) {
        bytes.push(b' ');
    }
    bytes
}

/// Writes the artifact to `out` (through a temporary file renamed into place) and returns
/// its digest. `progress(done, total)` counts tensors.
pub fn write_random_artifact(
    spec: &RandomSpec,
    out: &Path,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<String> {
    let c = &spec.config;
    c.validate()?;
    let tok = spec
        .tokenizer_json
        .clone()
        .unwrap_or_else(byte_tokenizer_json);
    let t = crate::tokenizer::Tokenizer::from_json(&tok).context("tokenizer")?;
    if t.vocab_size() > c.vocab_size {
        bail!(
            "the tokenizer has {} tokens, more than the vocabulary ({})",
            t.vocab_size(),
            c.vocab_size
        );
    }
    let provenance = Provenance {
        packer: format!(
            "ninfer-pack {} random (seed {})",
            env!("CARGO_PKG_VERSION"),
            spec.seed
        ),
        source_kind: "random".into(),
        source_files: vec![],
        source_dtypes: BTreeMap::new(),
    };
    let mut meta: BTreeMap<String, String> = BTreeMap::new();
    meta.insert("format".into(), MAGIC.into());
    meta.insert("format_version".into(), FORMAT_VERSION.to_string());
    meta.insert("config".into(), serde_json::to_string(c)?);
    meta.insert("tokenizer".into(), tok);
    meta.insert("weight_format".into(), "bf16".into());
    meta.insert("provenance".into(), serde_json::to_string(&provenance)?);
    let mut digest = DigestBuilder::new();
    for (k, v) in &meta {
        digest.metadata(k, v);
    }
    let mut tensors = c.expected_tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let mut entries = Vec::with_capacity(tensors.len());
    let mut off = 0usize;
    for (name, shape) in &tensors {
        let n: usize = shape.iter().product();
        let (dtype, bytes) = if is_vector_tensor(name, shape) {
            ("F32", 4 * n)
        } else {
            ("BF16", 2 * n)
        };
        entries.push((name.clone(), dtype, shape.clone(), off, off + bytes));
        off += bytes;
    }
    meta.insert("digest".into(), format!("sha256:{}", "0".repeat(64)));
    let placeholder = header(&meta, &entries);

    let dir = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)
        .with_context(|| format!("{}: cannot create directory", dir.display()))?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir)
        .with_context(|| format!("{}: cannot write", dir.display()))?;
    {
        let f = tmp.as_file_mut();
        let mut w = std::io::BufWriter::with_capacity(8 << 20, &mut *f);
        w.write_all(&(placeholder.len() as u64).to_le_bytes())?;
        w.write_all(&placeholder)?;
        for (i, (name, shape)) in tensors.iter().enumerate() {
            let (dtype, bytes) = tensor_bytes(name, shape, spec.seed);
            debug_assert_eq!(bytes.len(), entries[i].4 - entries[i].3);
            digest.tensor(name, dtype, shape, &bytes);
            w.write_all(&bytes)?;
            progress(i + 1, tensors.len());
        }
        w.flush()?;
    }
    let d = digest.finish();
    meta.insert("digest".into(), d.clone());
    let real = header(&meta, &entries);
    if real.len() != placeholder.len() {
        bail!("internal: header length changed when the digest was filled in");
    }
    let f = tmp.as_file_mut();
    f.seek(SeekFrom::Start(8))?;
    f.write_all(&real)?;
    f.sync_all().ok();
    tmp.persist(out)
        .map_err(|e| anyhow::anyhow!("{}: cannot write: {}", out.display(), e.error))?;
    crate::outfile::set_default_mode(out)?;
    Ok(d)
}

/// `ninfer-pack random`: writes the artifact and says what it wrote on stderr.
pub fn run_cli(
    out: &Path,
    preset_name: &str,
    layers: Option<usize>,
    seed: u64,
    tokenizer: Option<&Path>,
) -> Result<()> {
    let mut config = preset(preset_name)?;
    if let Some(l) = layers {
        config = config.with_layers(l);
    }
    config.validate().context("--layers")?;
    crate::outfile::check_output(out, &[])?;
    let tokenizer_json = match tokenizer {
        Some(p) => Some(
            std::fs::read_to_string(p).with_context(|| format!("{}: cannot read", p.display()))?,
        ),
        None => None,
    };
    let t = std::time::Instant::now();
    let spec = RandomSpec {
        config,
        seed,
        tokenizer_json,
    };
    let digest = write_random_artifact(&spec, out, &mut |_, _| {})?;
    let c = &spec.config;
    eprintln!(
        "wrote {} ({} {} layers, {:.2}B params, random bf16 weights, seed {seed}) in {:.1}s, digest {digest}",
        out.display(),
        c.family.name(),
        c.num_layers,
        c.num_params() as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::artifact::Artifact;

    fn tiny() -> ModelConfig {
        ModelConfig {
            num_layers: 2,
            hidden_size: 32,
            intermediate_size: 48,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            vocab_size: 300,
            ..preset("qwen3-8b").unwrap()
        }
    }

    #[test]
    fn presets_are_valid_and_have_the_published_sizes() {
        let q = preset("qwen3-8b").unwrap();
        q.validate().unwrap();
        assert!(
            (8.1e9..8.3e9).contains(&(q.num_params() as f64)),
            "{}",
            q.num_params()
        );
        let s = preset("smollm2-135m").unwrap();
        s.validate().unwrap();
        assert!(
            (134e6..135e6).contains(&(s.num_params() as f64)),
            "{}",
            s.num_params()
        );
        preset("llama3-8b").unwrap().validate().unwrap();
        // The Qwen3.5 27B text model: about 27B parameters with its 2 × 1.27B embedding
        // and head, 48 + 16 layers, the State of docs/hybrid.md.
        let h = preset("qwen3_5-27b").unwrap();
        h.validate().unwrap();
        assert!(
            (26.0e9..27.5e9).contains(&(h.num_params() as f64)),
            "{}",
            h.num_params()
        );
        assert_eq!((h.state_layers(), h.kv_layers()), (48, 16));
        // S: 48 × 48 heads × 128 × 128 f32 = 144 MiB; the conv inputs add 5.6 MiB.
        assert_eq!(h.state_bytes_per_window() >> 20, 149);
        // Qwen3.5-35B-A3B's text model: about 35B parameters, about 3B active per token.
        let m = preset("qwen3_5-35b-a3b").unwrap();
        m.validate().unwrap();
        eprintln!(
            "35b-a3b: {} params, {} active",
            m.num_params(),
            m.active_params()
        );
        assert!(
            (34.0e9..36.0e9).contains(&(m.num_params() as f64)),
            "{}",
            m.num_params()
        );
        assert!(
            (2.5e9..3.5e9).contains(&(m.active_params() as f64)),
            "{}",
            m.active_params()
        );
        assert_eq!((m.state_layers(), m.kv_layers()), (30, 10));
        assert!(preset("gpt5").unwrap_err().to_string().contains("qwen3-8b"));
    }

    #[test]
    fn byte_tokenizer_maps_every_byte_to_one_token() {
        let t = crate::tokenizer::Tokenizer::from_json(&byte_tokenizer_json()).unwrap();
        assert_eq!(t.vocab_size(), 256);
        let text = "Hé, 世界!\n\t ok";
        let ids = t.encode(text).unwrap();
        assert_eq!(ids.len(), text.len());
        // Token ids follow byte order.
        assert_eq!(ids, text.bytes().map(u32::from).collect::<Vec<_>>());
    }

    #[test]
    fn artifact_reads_back_verifies_and_is_deterministic() {
        let d = tempfile::tempdir().unwrap();
        let spec = RandomSpec {
            config: tiny(),
            seed: 7,
            tokenizer_json: None,
        };
        let p1 = d.path().join("a.ninfer");
        let p2 = d.path().join("b.ninfer");
        let mut calls = 0;
        let d1 = write_random_artifact(&spec, &p1, &mut |_, _| calls += 1).unwrap();
        let d2 = write_random_artifact(&spec, &p2, &mut |_, _| {}).unwrap();
        assert_eq!(d1, d2);
        assert_eq!(calls, tiny().expected_tensors().len());
        let a = Artifact::open(&p1).unwrap();
        a.verify_digest().unwrap();
        assert_eq!(a.digest, d1);
        assert_eq!(a.config, tiny());
        assert_eq!(a.provenance.source_kind, "random");
        let w = a.tensor_f32("model.layers.1.mlp.down_proj.weight").unwrap();
        let amp = 3f32.sqrt() / 48f32.sqrt();
        assert!(w.iter().all(|v| v.abs() <= amp * 1.01));
        let mean = w.iter().map(|&v| v as f64).sum::<f64>() / w.len() as f64;
        let var = w.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / w.len() as f64;
        assert!(
            (var.sqrt() - 1.0 / 48f64.sqrt()).abs() < 0.02,
            "std {}",
            var.sqrt()
        );
        assert!(a
            .tensor_f32("model.norm.weight")
            .unwrap()
            .iter()
            .all(|&v| v == 1.0));
        let other =
            write_random_artifact(&RandomSpec { seed: 8, ..spec }, &p2, &mut |_, _| {}).unwrap();
        assert_ne!(other, d1);
    }

    #[test]
    fn random_artifact_scores_finitely_on_the_cpu() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("r.ninfer");
        write_random_artifact(
            &RandomSpec {
                config: tiny(),
                seed: 1,
                tokenizer_json: None,
            },
            &p,
            &mut |_, _| {},
        )
        .unwrap();
        let e =
            crate::engine::Engine::load(&p, &crate::engine::LoadOptions::default(), &mut |_, _| {})
                .unwrap();
        let ids = e.tokenizer.encode("random weights, real shapes").unwrap();
        let s = e
            .score(
                &ids,
                crate::score::Protocol::new(16, 8).unwrap(),
                crate::kv::KvDtype::Bf16,
                false,
                &mut |_, _| {},
            )
            .unwrap();
        let mean = s.totals.mean_nll();
        assert!(mean.is_finite() && mean > 0.0, "{mean}");
    }
}
