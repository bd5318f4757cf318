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
use crate::artifact::quantized;
use crate::artifact::random::{byte_tokenizer_json, tensor_bytes};
use crate::artifact::{is_vector_tensor, Provenance, FORMAT_VERSION, MAGIC};
use crate::model::config::ModelConfig;
use crate::model::presets::preset;
use crate::quant::{select, QuantTensor, Scheme};
use anyhow::{bail, Context, Result};
use safetensors::tensor::Dtype;
use std::collections::BTreeMap;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

/// What to generate.
pub struct RandomSpec {
    pub config: ModelConfig,
    pub seed: u64,
    /// A Hugging Face tokenizer.json; the byte tokenizer when None.
    pub tokenizer_json: Option<String>,
    /// The decoder's linear layers quantized as `ninfer-pack --weights fp8|nvfp4` would
    /// quantize them (the values are the bf16 ones of `None`, then quantized); the rest bf16.
    pub quantize: Option<crate::quant::Scheme>,
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
    if let Some(scheme) = spec.quantize {
        let q = crate::quant::Imported {
            method: format!("ninfer-pack --weights {}", scheme.name()),
            activation_scales: Default::default(),
        };
        meta.insert("quantization".into(), serde_json::to_string(&q)?);
    }
    let mut digest = DigestBuilder::new();
    for (k, v) in &meta {
        digest.metadata(k, v);
    }
    let mut plan = Layout::new(c, spec.quantize)?;
    let mut entries = Vec::with_capacity(plan.stored.len());
    let mut off = 0usize;
    for (name, dtype, shape) in &plan.stored {
        let bytes = shape.iter().product::<usize>() * dtype.bitsize() / 8;
        entries.push((
            name.clone(),
            dtype_name(*dtype),
            shape.clone(),
            off,
            off + bytes,
        ));
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
        let total = plan.stored.len();
        for (i, (name, _, shape)) in plan.stored.clone().into_iter().enumerate() {
            let bytes = plan.bytes(&name, &shape, spec.seed)?;
            if bytes.len() != entries[i].4 - entries[i].3 {
                bail!(
                    "internal: tensor `{name}` has {} bytes, its header entry {}",
                    bytes.len(),
                    entries[i].4 - entries[i].3
                );
            }
            digest.tensor(&name, entries[i].1, &shape, &bytes);
            w.write_all(&bytes)?;
            progress(i + 1, total);
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

/// The stored tensors of a random artifact in name order (the file's and the digest's), and
/// the quantized ones' values, made a scale group at a time as the writer reaches them.
struct Layout {
    /// (name, dtype, shape) of every stored tensor, sorted by name.
    stored: Vec<(String, Dtype, Vec<usize>)>,
    quantize: Option<Scheme>,
    /// Each quantized matrix's group (nvfp4: the matrices that share a global scale).
    group_of: BTreeMap<String, String>,
    /// Each group's matrices and shapes, in the config's order.
    groups: BTreeMap<String, Vec<(String, usize, usize)>>,
    /// Stored parts made but not yet written (a group's other matrices come later in name
    /// order; at most one group's at a time, or a few where groups interleave by name).
    ready: BTreeMap<String, Vec<u8>>,
}

impl Layout {
    fn new(c: &ModelConfig, quantize: Option<Scheme>) -> Result<Layout> {
        let mut l = Layout {
            stored: Vec::new(),
            quantize,
            group_of: BTreeMap::new(),
            groups: BTreeMap::new(),
            ready: BTreeMap::new(),
        };
        for (name, shape) in c.expected_tensors() {
            match quantize {
                Some(scheme) if shape.len() == 2 && select::selected(&name, false) => {
                    crate::quant::check_shape(scheme, &name, shape[0], shape[1])
                        .with_context(|| format!("--weights {}", scheme.name()))?;
                    let key = match scheme {
                        Scheme::Nvfp4 => select::group(&name).unwrap_or_else(|| name.clone()),
                        Scheme::Fp8Block => name.clone(),
                    };
                    l.stored
                        .extend(quantized::part_shapes(&name, scheme, shape[0], shape[1]));
                    l.group_of.insert(name.clone(), key.clone());
                    l.groups
                        .entry(key)
                        .or_default()
                        .push((name, shape[0], shape[1]));
                }
                _ => {
                    let dtype = if is_vector_tensor(&name, &shape) {
                        Dtype::F32
                    } else {
                        Dtype::BF16
                    };
                    l.stored.push((name, dtype, shape));
                }
            }
        }
        l.stored.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(l)
    }

    /// The bytes of stored tensor `name` (of `shape`).
    fn bytes(&mut self, name: &str, shape: &[usize], seed: u64) -> Result<Vec<u8>> {
        if let Some(b) = self.ready.remove(name) {
            return Ok(b);
        }
        let Some(key) = self.group_of.get(name).cloned() else {
            return Ok(tensor_bytes(name, shape, seed).1);
        };
        // The group's matrices, from the bf16 random values, quantized together.
        let members = self.groups[&key].clone();
        let values: Vec<Vec<f32>> = members
            .iter()
            .map(|(m, o, i)| {
                tensor_bytes(m, &[*o, *i], seed)
                    .1
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect()
            })
            .collect();
        let cols = members[0].2;
        let qs: Vec<QuantTensor> = match self.quantize.expect("a quantized matrix") {
            Scheme::Nvfp4 => {
                let parts: Vec<&[f32]> = values.iter().map(|v| &v[..]).collect();
                crate::quant::nvfp4::quantize_group(&parts, cols)
                    .into_iter()
                    .map(QuantTensor::Nvfp4)
                    .collect()
            }
            Scheme::Fp8Block => members
                .iter()
                .zip(&values)
                .map(|((_, o, i), v)| {
                    QuantTensor::Fp8(crate::quant::fp8::quantize_block(v, *o, *i))
                })
                .collect(),
        };
        for ((m, ..), q) in members.iter().zip(&qs) {
            for p in quantized::parts(m, q) {
                self.ready.insert(p.name, p.bytes);
            }
        }
        self.ready
            .remove(name)
            .with_context(|| format!("internal: no stored part `{name}`"))
    }
}

fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F32 => "F32",
        Dtype::BF16 => "BF16",
        Dtype::U8 => "U8",
        Dtype::F8_E4M3 => "F8_E4M3",
        _ => unreachable!("a random artifact stores F32, BF16, U8 and F8_E4M3 only"),
    }
}

/// `ninfer-pack random`: writes the artifact and says what it wrote on stderr.
pub fn run_cli(
    out: &Path,
    preset_name: &str,
    layers: Option<usize>,
    seed: u64,
    tokenizer: Option<&Path>,
    weights: &str,
) -> Result<()> {
    let quantize = match weights {
        "bf16" => None,
        "fp8" => Some(Scheme::Fp8Block),
        "nvfp4" => Some(Scheme::Nvfp4),
        other => bail!("--weights: unknown weight format `{other}` (valid: bf16, fp8, nvfp4)"),
    };
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
        quantize,
    };
    let digest = write_random_artifact(&spec, out, &mut |_, _| {})?;
    let c = &spec.config;
    let bytes = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "wrote {} ({} {} layers, {:.2}B params, random {weights} weights, {:.2} GB, seed {seed}) in {:.1}s, digest {digest}",
        out.display(),
        c.family.name(),
        c.num_layers,
        c.num_params() as f64 / 1e9,
        bytes as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::artifact::Artifact;

    /// Loads `path` and scores `text` at context 16, stride 8 (bf16 KV): the mean NLL.
    fn mean_nll(path: &std::path::Path, text: &str) -> f64 {
        let e = crate::engine::Engine::load(
            path,
            &crate::engine::LoadOptions::default(),
            &mut |_, _| {},
        )
        .unwrap();
        let ids = e.tokenizer.encode(text).unwrap();
        e.score(
            &ids,
            crate::score::Protocol::new(16, 8).unwrap(),
            crate::kv::KvDtype::Bf16,
            false,
            &mut |_, _| {},
        )
        .unwrap()
        .totals
        .mean_nll()
    }

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
            quantize: None,
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
                quantize: None,
            },
            &p,
            &mut |_, _| {},
        )
        .unwrap();
        let mean = mean_nll(&p, "random weights, real shapes");
        assert!(mean.is_finite() && mean > 0.0, "{mean}");
    }

    /// `--weights fp8|nvfp4` writes, tensor by tensor, exactly the bytes the packer writes
    /// for the same bf16 values (its quantizer, ModelOpt's rules for nvfp4, shared global
    /// scales per group), and the CPU scores it.
    #[test]
    fn quantized_random_artifacts_hold_the_packers_bytes() {
        use crate::artifact::source::{PackSource, SourceTensor, TensorData};
        use crate::artifact::{write_artifact, WeightFormat, WeightPlan};
        let d = tempfile::tempdir().unwrap();
        let spec = |quantize| RandomSpec {
            config: tiny(),
            seed: 3,
            tokenizer_json: None,
            quantize,
        };
        let plain = d.path().join("bf16.ninfer");
        write_random_artifact(&spec(None), &plain, &mut |_, _| {}).unwrap();
        let a = Artifact::open(&plain).unwrap();
        let src = PackSource {
            config: a.config.clone(),
            tokenizer_json: a.tokenizer_json().to_string(),
            tensors: a
                .config
                .expected_tensors()
                .into_iter()
                .map(|(name, shape)| SourceTensor {
                    data: TensorData::Values(a.tensor_f32(&name).unwrap()),
                    name,
                    shape,
                    origin: plain.clone(),
                })
                .collect(),
            source_kind: "test".into(),
            source_files: vec![],
            source_dtypes: Default::default(),
            notes: vec![],
            quantization: None,
        };
        for scheme in [Scheme::Fp8Block, Scheme::Nvfp4] {
            let random = d.path().join(format!("{}.ninfer", scheme.name()));
            write_random_artifact(&spec(Some(scheme)), &random, &mut |_, _| {}).unwrap();
            let packed = d.path().join(format!("packed-{}.ninfer", scheme.name()));
            let plan = WeightPlan {
                dense: WeightFormat::Bf16,
                quantize: Some(scheme),
                head: false,
            };
            write_artifact(&src, plan, &packed).unwrap();
            let (r, p) = (
                Artifact::open(&random).unwrap(),
                Artifact::open(&packed).unwrap(),
            );
            r.verify_digest().unwrap();
            let names: Vec<&str> = r.tensor_names().collect();
            assert_eq!(
                names,
                p.tensor_names().collect::<Vec<_>>(),
                "{}",
                scheme.name()
            );
            assert!(
                names.iter().any(|n| n.ends_with("_scale")),
                "some matrices quantized"
            );
            for n in names {
                assert_eq!(r.tensor_raw(n), p.tensor_raw(n), "{} {n}", scheme.name());
            }
            assert!(mean_nll(&random, "quantized random weights").is_finite());
        }
    }
}
