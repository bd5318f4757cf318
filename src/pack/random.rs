//! Random-weight artifacts of any supported shape (Qwen3-8B, say), so throughput can be
//! measured at real scale without real weights. `ninfer-pack random` calls [`run_cli`].
//!
//! The file is a valid `.ninfer` artifact (the reader validates it like any other): bf16
//! matrices, f32 norm vectors, a tokenizer, provenance `source_kind = "random"` and a true
//! digest, with the values of [`crate::artifact::random`]. It is streamed tensor by tensor,
//! so host memory holds one tensor at a time: the header is written with a placeholder
//! digest of the final length, each tensor is generated, hashed and written in name order
//! (the digest's order), then the header is rewritten with the real digest.

use crate::artifact::digest::DigestBuilder;
use crate::artifact::random::{byte_tokenizer_json, tensor_bytes};
use crate::artifact::{is_vector_tensor, Provenance, FORMAT_VERSION, MAGIC};
use crate::model::config::ModelConfig;
use crate::model::presets::preset;
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

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
