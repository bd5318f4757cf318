//! Random-weight artifacts of any supported shape (Qwen3-8B, say), so throughput can be
//! measured at real scale without real weights. `ninfer-pack random` calls [`run_cli`].
//!
//! The file is a valid `.ninfer` artifact (the reader validates it like any other): bf16
//! matrices, f32 norm vectors, a tokenizer, provenance `source_kind = "random"` and a true
//! digest, with the values of [`crate::artifact::random`]. It goes through the packers'
//! writer like any checkpoint, every tensor made only when the streamed writer reaches it,
//! so host memory holds one tensor (one scale group) at a time.

use crate::artifact::random::{byte_tokenizer_json, tensor_bytes};
use crate::artifact::source::{Deferred, PackSource, SourceTensor, TensorData};
use crate::artifact::{WeightFormat, WeightPlan};
use crate::model::config::ModelConfig;
use crate::model::presets::preset;
use crate::quant::Scheme;
use anyhow::{bail, Context, Result};
use safetensors::tensor::Dtype;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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

/// The random model as a pack source whose every tensor is made when the writer reaches it.
pub fn source(spec: &RandomSpec) -> PackSource {
    let seed = spec.seed;
    let tensors = spec
        .config
        .expected_tensors()
        .into_iter()
        .map(|(name, shape)| {
            let (n, s) = (name.clone(), shape.clone());
            SourceTensor {
                data: TensorData::Deferred(Deferred::values(move || {
                    let (dtype, bytes) = tensor_bytes(&n, &s, seed);
                    let dtype = if dtype == "F32" {
                        Dtype::F32
                    } else {
                        Dtype::BF16
                    };
                    Ok(TensorData::Raw { dtype, bytes })
                })),
                name,
                shape,
                origin: PathBuf::from("random"),
            }
        })
        .collect();
    PackSource {
        config: spec.config.clone(),
        tokenizer_json: spec
            .tokenizer_json
            .clone()
            .unwrap_or_else(byte_tokenizer_json),
        tensors,
        source_kind: "random".into(),
        source_files: vec![],
        source_dtypes: BTreeMap::new(),
        notes: vec![],
        quantization: None,
        packer_args: Some(format!("random (seed {seed})")),
    }
}

/// Writes the artifact to `out` (through a temporary file renamed into place) and returns
/// its digest. `progress(done, total)` counts stored tensors.
pub fn write_random_artifact(
    spec: &RandomSpec,
    out: &Path,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<String> {
    let plan = WeightPlan {
        dense: WeightFormat::Bf16,
        quantize: spec.quantize,
        head: false,
    };
    crate::artifact::writer::write_artifact_with(&source(spec), plan, out, progress)
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
            crate::input::read_text_bounded(p, "the tokenizer", 256 << 20)
                .with_context(|| p.display().to_string())?,
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
        "wrote {} ({} {} layers, {:.2}B params, random {weights} weights, {:.2} GB, seed {seed}) in {:.1}s, peak memory {}, digest {digest}",
        out.display(),
        c.family.name(),
        c.num_layers,
        c.num_params() as f64 / 1e9,
        bytes as f64 / 1e9,
        t.elapsed().as_secs_f64(),
        crate::host::peak_resident_bytes()
            .map_or("unknown".into(), |b| format!("{:.1} MB", b as f64 / 1e6)),
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
            packer_args: None,
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
