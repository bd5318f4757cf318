//! The `report.json` of a finished run, assembled from its configuration, inputs and stream
//! results.

use crate::cli::{Input, RunConfig};
use crate::report::{self, aggregate, Report, StreamReport};
use crate::run::inputs::Inputs;

/// When and how long the phases of a run took.
pub struct Clock {
    pub started_unix_s: f64,
    pub score_s: f64,
    pub total_s: f64,
}

/// The report of a run; `run_id` names it.
pub fn build(
    cfg: &RunConfig,
    inputs: &Inputs,
    streams: Vec<StreamReport>,
    run_id: String,
    clock: Clock,
    warnings: Vec<String>,
) -> Report {
    let engine = &inputs.engine;
    let a = &engine.artifact;
    let c = &a.config;
    let domains: Vec<_> = inputs
        .domains
        .iter()
        .map(|(id, title)| {
            let mut d = aggregate(id, title, streams.iter().filter(|s| &s.domain == id));
            d.domain = Some(id.clone());
            d
        })
        .collect();
    let overall = aggregate("overall", "overall", streams.iter());
    let processed = inputs.processed_tokens();
    let score_s = clock.score_s.max(1e-9);
    Report {
        schema: report::SCHEMA.into(),
        schema_version: report::SCHEMA_VERSION,
        metric: report::Metric::of(cfg.protocol.plan),
        execution: report::Execution {
            purpose: "causal_scoring".into(),
            device: match engine.device {
                crate::backend::Device::Cuda { ordinal, .. } => Some(ordinal),
                _ => None,
            },
            context_tokens: cfg.protocol.context,
            stride_tokens: cfg.protocol.stride,
            window_plan: cfg.protocol.plan,
            prefill_chunk_tokens: cfg.protocol.context,
            score_tile_tokens: cfg.protocol.context,
            kv_dtype: cfg.kv.format_name(c.head_dim),
        },
        timing: report::Timing {
            load_seconds: inputs.load_s,
            read_and_tokenize_seconds: inputs.tokenize_s,
            score_seconds: clock.score_s,
            total_seconds: clock.total_s,
            scored_tokens_per_second: overall.totals.scored as f64 / score_s,
        },
        run_id,
        tool: report::Tool {
            name: "ninfer-perplexity".into(),
            version: crate::build_info::VERSION.into(),
            commit: crate::build_info::GIT_COMMIT.into(),
            profile: crate::build_info::PROFILE.into(),
            features: crate::build_info::FEATURES.into(),
        },
        invocation: Some(crate::build_info::Invocation::current()),
        started_unix_s: clock.started_unix_s,
        settings: report::Settings {
            mode: if inputs.corpus.is_some() {
                "corpus".into()
            } else {
                "text".into()
            },
            context: cfg.protocol.context,
            stride: cfg.protocol.stride,
            window_plan: cfg.protocol.plan,
            kv_dtype: cfg.kv.name().into(),
            kv_format: Some(report::KvFormat::of(cfg.kv, c.head_dim)),
            kv_tensor_scales: cfg
                .kv
                .tensor_scales()
                .map(|s| crate::kv::fp8_tensor::TensorScales {
                    source: s.source.clone(),
                    k: (0..c.num_layers).map(|l| s.k(l)).collect(),
                    v: (0..c.num_layers).map(|l| s.v(l)).collect(),
                }),
            kv_bytes_per_token_per_layer: cfg
                .kv
                .bytes_per_token_per_layer(c.num_kv_heads, c.head_dim),
            kv_layers: c.kv_layers(),
            kv_bytes_per_token: c.kv_layers()
                * cfg.kv.bytes_per_token_per_layer(c.num_kv_heads, c.head_dim),
            state_bytes_per_window: c.state_bytes_per_window(),
            quick: matches!(cfg.input, Input::Corpus { quick: true, .. }),
            max_tokens: cfg.max_tokens,
            device: engine.device.describe(),
            device_class: engine.device.class(),
            precision: engine.precision.name().into(),
            threads: engine.threads(),
            test_fault: engine.test_fault(),
            reference: engine
                .reference()
                .map(|(kv, a)| report::ReferenceSettings {
                    kv_dtype: kv.name().into(),
                    artifact_path: a.path().display().to_string(),
                    artifact_digest: a.digest.clone(),
                    weight_format: a.weight_summary(),
                    saved: None,
                })
                .or_else(|| {
                    engine.kld_base().map(|b| {
                        let id = &b.index.identity;
                        report::ReferenceSettings {
                            kv_dtype: id.kv_dtype.clone(),
                            artifact_path: id.artifact_path.clone(),
                            artifact_digest: id.artifact_digest.clone(),
                            weight_format: id.weight_format.clone(),
                            saved: Some(report::SavedReferenceInfo {
                                path: std::path::absolute(&b.path)
                                    .unwrap_or_else(|_| b.path.clone())
                                    .display()
                                    .to_string(),
                                bytes: b.size(),
                                device: id.device.clone(),
                                build: id.build.clone(),
                            }),
                        }
                    })
                }),
        },
        artifact: report::ArtifactInfo {
            path: std::path::absolute(a.path())
                .unwrap_or_else(|_| a.path().to_path_buf())
                .display()
                .to_string(),
            target: engine.device.class(),
            model_id: model_id(a.path()),
            weights_id: weights_id(a),
            digest: a.digest.clone(),
            digest_verified: cfg.verify_artifact,
            file_bytes: a.file_bytes,
            family: c.family.name().into(),
            params: c.num_params(),
            weight_format: a.weight_summary(),
            quantization: a.quantization.as_ref().map(|q| report::Quantization {
                method: q.method.clone(),
                weight_only: true,
                activation_scales: q.activation_scales.len(),
                formats: a
                    .weight_formats()
                    .iter()
                    .map(|u| report::FormatBytes {
                        format: u.format.into(),
                        classes: u.classes.iter().map(|c| c.to_string()).collect(),
                        tensors: u.tensors,
                        bytes: u.bytes,
                    })
                    .collect(),
            }),
            config: c.clone(),
            active_params: c.moe.as_ref().map(|_| c.active_params()),
        },
        tokenizer: report::TokenizerInfo {
            sha256: engine.tokenizer.sha256().into(),
            vocab_size: engine.tokenizer.vocab_size(),
        },
        corpus: Some(corpus_info(cfg, inputs, streams.len())),
        throughput: report::Throughput {
            processed_tokens: processed,
            processed_tokens_per_s: processed as f64 / score_s,
            scored_tokens_per_s: overall.totals.scored as f64 / score_s,
        },
        streams,
        domains,
        overall,
        timings: report::Timings {
            load_s: inputs.load_s,
            tokenize_s: inputs.tokenize_s,
            score_s: clock.score_s,
            total_s: clock.total_s,
        },
        peak_rss_bytes: report::peak_rss_bytes(),
        warnings,
        cuda_memory: engine.cuda_memory(),
        cuda_versions: engine.cuda_versions(),
        cpu_memory: engine.memory_plan.clone(),
        shard: None,
        merged_from: None,
    }
}

/// The seed engine's `model_id`: the artifact's file name without `.ninfer`.
pub fn model_id(path: &std::path::Path) -> String {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    name.strip_suffix(".ninfer").unwrap_or(&name).to_string()
}

/// The seed engine's `weights_id`: the matrices' storage formats, most bytes first, joined
/// by `+`.
pub fn weights_id(a: &crate::artifact::Artifact) -> String {
    let mut uses = a.weight_formats();
    uses.sort_by(|x, y| y.bytes.cmp(&x.bytes).then(x.format.cmp(y.format)));
    let mut out: Vec<&str> = Vec::new();
    for u in &uses {
        if !out.contains(&u.format) {
            out.push(u.format);
        }
    }
    out.join("+")
}

/// The seed engine's `corpus` block (and this project's fields beside it).
fn corpus_info(cfg: &RunConfig, inputs: &Inputs, stream_count: usize) -> report::CorpusInfo {
    let abs = |p: &std::path::Path| {
        std::path::absolute(p)
            .unwrap_or_else(|_| p.to_path_buf())
            .display()
            .to_string()
    };
    match &inputs.corpus {
        Some(c) => report::CorpusInfo {
            id: c.manifest.corpus_id.clone(),
            mode: if matches!(cfg.input, Input::Corpus { quick: true, .. }) {
                "quick"
            } else {
                "full"
            }
            .into(),
            source: abs(&c.manifest_path),
            stream_count,
            name: c.manifest.corpus_id.clone(),
            manifest: Some(c.manifest_path.display().to_string()),
            manifest_sha256: Some(c.manifest_sha256.clone()),
        },
        None => {
            let s = inputs.streams.first().map(|p| &p.stream);
            let id = crate::corpus::text_corpus_id(s.map_or("text", |s| s.id.as_str()));
            report::CorpusInfo {
                id: id.clone(),
                mode: "custom".into(),
                source: s.map(|s| s.report_path.clone()).unwrap_or_default(),
                stream_count,
                name: id,
                manifest: None,
                manifest_sha256: None,
            }
        }
    }
}
