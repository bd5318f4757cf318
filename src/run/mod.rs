//! One evaluator run: prepare the inputs (`inputs`), score them (`score`), build and
//! write the report (`report`).

pub mod inputs;
mod report;
mod score;
mod shard;

use crate::cli::RunConfig;
use crate::report::{table, write, Report};
use crate::ui;
use anyhow::{Context, Result};
use inputs::Inputs;
use std::path::PathBuf;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// What a finished run produced.
pub struct RunOutput {
    pub report: Report,
    pub report_path: PathBuf,
    pub table: String,
}

/// `YYYYMMDDTHHMMSSZ` for a Unix time (UTC, proleptic Gregorian).
pub fn utc_stamp(unix: u64) -> String {
    let days = (unix / 86400) as i64;
    let secs = unix % 86400;
    // Howard Hinnant's civil-from-days.
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    format!(
        "{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z",
        secs / 3600,
        (secs % 3600) / 60,
        secs % 60
    )
}

/// `YYYYMMDD-HHMMSS` (UTC): the seed engine's name for a run's directory.
pub fn seed_stamp(unix: u64) -> String {
    let s = utc_stamp(unix);
    format!("{}-{}", &s[..8], &s[9..15])
}

/// The seed engine's default output folder, without its last (time) component:
/// `profiles/perplexity/<model_id>/<weights_id>/<kv_name>/<corpus_id>/<mode>`, each component
/// made safe ([`write::seed_component`]).
pub fn default_output_base(
    model_id: &str,
    weights_id: &str,
    kv_name: &str,
    corpus_id: &str,
    mode: &str,
) -> PathBuf {
    let mut p = PathBuf::from("profiles/perplexity");
    for c in [model_id, weights_id, kv_name, corpus_id, mode] {
        p.push(write::seed_component(c));
    }
    p
}

/// `cfg` with `fp8-tensor`'s scales read from `path` (for the run's KV format, and the
/// reference pass's when it is `fp8-tensor` too).
fn with_kv_scales(cfg: &RunConfig, path: &std::path::Path, layers: usize) -> Result<RunConfig> {
    let bytes = crate::input::read_bounded(path, "--kv-scales file", 16 << 20)
        .with_context(|| path.display().to_string())?;
    let text = std::str::from_utf8(&bytes)
        .map_err(|_| anyhow::anyhow!("{}: --kv-scales file is not UTF-8", path.display()))?;
    let scales =
        crate::kv::fp8_tensor::TensorScales::parse(text, layers, &path.display().to_string())
            .map_err(|e| anyhow::anyhow!("{}: --kv-scales: {e}", path.display()))?;
    let kv = crate::kv::KvDtype::fp8_tensor_with(scales);
    let mut c = cfg.clone();
    c.kv = kv;
    if let Some(r) = c.reference.as_mut() {
        if r.kv.tensor_scales().is_some() {
            r.kv = kv;
        }
    }
    Ok(c)
}

/// The corpus id and mode a run will report, known before its streams are read.
fn corpus_id_and_mode(cfg: &RunConfig) -> Result<(String, String)> {
    use crate::cli::Input;
    Ok(match &cfg.input {
        Input::Corpus {
            manifest, quick, ..
        } => {
            let c = crate::corpus::Corpus::open(manifest, None)?;
            let mode = if *quick { "quick" } else { "full" };
            (c.manifest.corpus_id, mode.to_string())
        }
        Input::Text(p) => (
            crate::corpus::text_corpus_id(&crate::corpus::text_stream_id(p)),
            "custom".to_string(),
        ),
    })
}

/// A run's id: its UTC start to the millisecond, the artifact digest's first 8 hex digits,
/// the KV format and the process id, so two runs never share one.
pub fn run_id(started_unix_s: f64, digest: &str, kv: &str, pid: u32) -> String {
    let secs = started_unix_s.max(0.0) as u64;
    let ms = ((started_unix_s.max(0.0) - secs as f64) * 1000.0) as u64 % 1000;
    let stamp = utc_stamp(secs);
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    format!(
        "{}.{ms:03}Z-{}-{kv}-{pid}",
        stamp.trim_end_matches('Z'),
        &hex[..hex.len().min(8)]
    )
}

pub fn run(cfg: &RunConfig) -> Result<RunOutput> {
    let t0 = Instant::now();
    let started_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    // The output directory is claimed first, so a bad or busy one fails before any work.
    let resolved = crate::registry::resolve_artifact(&cfg.artifact)?;
    let artifact_path = resolved.path.clone();
    let art = crate::artifact::Artifact::open(&artifact_path)?;
    let digest = art.digest.clone();
    resolved.check_digest(&digest)?;
    let with_scales;
    let cfg = match &cfg.kv_scales {
        Some(p) => {
            with_scales = with_kv_scales(cfg, p, art.config.num_layers)?;
            &with_scales
        }
        None => cfg,
    };
    let run_id = run_id(started_unix, &digest, cfg.kv.name(), std::process::id());
    let out = match &cfg.output {
        Some(dir) => write::OutputDir::claim(dir, write::Claim::AbsentOrEmpty)?,
        None => {
            let (corpus_id, mode) = corpus_id_and_mode(cfg)?;
            let base = default_output_base(
                &report::model_id(&artifact_path),
                &report::weights_id(&art),
                &cfg.kv.format_name(art.config.head_dim),
                &corpus_id,
                &mode,
            );
            write::OutputDir::claim_new_under(&base, &seed_stamp(started_unix as u64))?
        }
    };
    drop(art);
    let mut inputs = inputs::prepare(cfg, &artifact_path)?;
    let shard = match cfg.shard {
        Some(s) => Some(shard::narrow(&mut inputs, s, cfg.protocol)?),
        None => None,
    };
    log_startup(cfg, &inputs);
    if let Some(s) = &shard {
        ui::info(format!(
            "shard      {}/{}: windows {}..{} of the run's {} ({} of {} processed tokens, {} of {} streams)",
            s.index,
            s.count,
            s.windows[0],
            s.windows[1],
            s.run_windows,
            s.processed_tokens,
            s.run_processed_tokens,
            inputs.streams.len(),
            s.run_streams.len()
        ));
    }
    let warnings = warnings(&inputs);
    warnings.iter().for_each(ui::warn);

    let t_score = Instant::now();
    let mut streams = score::score_streams(&inputs, cfg.kv)?;
    if shard.is_none() {
        // Per-window calibration sums are for merging shards only.
        streams
            .iter_mut()
            .flat_map(|s| s.windows.iter_mut())
            .for_each(|w| w.calibration = None);
    }
    let score_s = t_score.elapsed().as_secs_f64();
    if let Some(bytes) = inputs.engine.finish_saved_reference()? {
        let positions: u64 = streams.iter().map(|s| s.totals.scored).sum();
        ui::info(format!(
            "saved      reference {}: {positions} positions, {bytes} bytes ({} per position)",
            cfg.save_reference
                .as_deref()
                .unwrap_or(std::path::Path::new(""))
                .display(),
            4 * inputs.engine.artifact.config.hidden_size
        ));
    }

    let clock = report::Clock {
        started_unix_s: started_unix,
        score_s,
        total_s: t0.elapsed().as_secs_f64(),
    };
    let mut rep = report::build(cfg, &inputs, streams, run_id, clock, warnings);
    rep.shard = shard;
    let json = serde_json::to_string_pretty(&rep)?;
    let plot = if cfg.plot {
        Some(crate::report::plot::run_plot(&rep)?)
    } else {
        None
    };
    let extras: Vec<(&str, &[u8])> = plot.iter().map(|p| ("plot.svg", p.as_bytes())).collect();
    let report_path = out.write_report_with(&json, &extras)?;
    ui::info(format!(
        "done       {} scored tokens in {:.1}s ({:.1} processed tokens/s); report {}",
        rep.overall.totals.scored,
        score_s,
        rep.throughput.processed_tokens_per_s,
        report_path.display()
    ));
    let mut table = table::render(&rep, cfg.show_calibration);
    if let Some(s) = &rep.shard {
        table.insert_str(0, &table::shard_note(s));
    }
    if let Some(t) = table::render_reference(&rep) {
        table.push('\n');
        table.push_str(&t);
    }
    Ok(RunOutput {
        report: rep,
        report_path,
        table,
    })
}

/// What the run should warn about (also recorded in the report).
fn warnings(inputs: &Inputs) -> Vec<String> {
    let trained = inputs.engine.artifact.config.max_position_embeddings;
    let longest = inputs
        .streams
        .iter()
        .flat_map(|p| p.windows.iter().map(|w| w.len()))
        .max()
        .unwrap_or(0);
    let mut w = Vec::new();
    if longest > trained {
        w.push(format!(
            "windows of up to {longest} tokens exceed the model's trained context \
             (max_position_embeddings {trained}): positions past it were never trained"
        ));
    }
    w
}

/// The startup summary on stderr: what is scored, with what, how.
fn log_startup(cfg: &RunConfig, inputs: &Inputs) {
    let engine = &inputs.engine;
    let a = &engine.artifact;
    let c = &a.config;
    if let Some(note) = &engine.device_note {
        ui::info(note);
    }
    if let Some(f) = engine.faults.active() {
        ui::warn(format!(
            "test fault `{}` is active (NINFER_TEST_FAULT): the numbers are deliberately wrong",
            f.describe()
        ));
    }
    ui::info(format!(
        "artifact   {} ({:.1} MB)",
        a.path().display(),
        a.file_bytes as f64 / 1e6
    ));
    ui::info(format!(
        "           digest {}{}",
        a.digest,
        if cfg.verify_artifact {
            " (verified)"
        } else {
            ""
        }
    ));
    ui::info(format!(
        "model      {} {:.1}M params, {} layers, d {}, {}/{} heads, head_dim {}, vocab {}, weights {}",
        c.family.name(),
        c.num_params() as f64 / 1e6,
        c.num_layers,
        c.hidden_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size,
        a.weight_summary()
    ));
    if let Some(m) = &c.moe {
        ui::info(format!(
            "experts    {} per sparse layer ({} of {} layers), top-{}{}{}; {:.2}M of {:.2}M params active per token",
            m.num_experts,
            m.sparse_layers.iter().filter(|&&s| s).count(),
            c.num_layers,
            m.num_experts_per_tok,
            if m.norm_topk_prob { " renormalised" } else { "" },
            if m.shared_expert_intermediate_size > 0 {
                format!(", a gated shared expert {} wide", m.shared_expert_intermediate_size)
            } else {
                String::new()
            },
            c.active_params() as f64 / 1e6,
            c.num_params() as f64 / 1e6
        ));
    }
    if let Some(q) = &a.quantization {
        ui::info(format!(
            "quantized  {}: weight-only (weights dequantized exactly to f32, activations in the compute precision{})",
            q.method,
            match q.activation_scales.len() {
                0 => String::new(),
                n => format!("; the checkpoint's {n} activation scales are not applied"),
            }
        ));
    }
    let per_layer = cfg.kv.bytes_per_token_per_layer(c.num_kv_heads, c.head_dim);
    if c.hybrid.is_some() {
        ui::info(format!(
            "layers     {} linear attention (Gated DeltaNet) + {} full attention",
            c.state_layers(),
            c.kv_layers()
        ));
        ui::info(format!(
            "kv         {} ({per_layer} bytes per token per layer, {} per token over the {} full-attention layers)",
            cfg.kv.name(),
            per_layer * c.kv_layers(),
            c.kv_layers()
        ));
        ui::info(format!(
            "state      {:.1} MiB per window (f32, {} Gated DeltaNet layers; zero at every window's start)",
            c.state_bytes_per_window() as f64 / (1u64 << 20) as f64,
            c.state_layers()
        ));
    } else {
        ui::info(format!(
            "kv         {} ({per_layer} bytes per token per layer)",
            cfg.kv.name()
        ));
    }
    ui::info(format!(
        "device     {}, {} arithmetic",
        engine.device.describe(),
        engine.precision.name()
    ));
    ui::info(format!(
        "protocol   {}",
        crate::report::table::protocol_label(&cfg.protocol)
    ));
    ui::debug(format!(
        "tokenizer sha256 {} vocab {}",
        engine.tokenizer.sha256(),
        engine.tokenizer.vocab_size()
    ));
    if matches!(engine.device, crate::backend::Device::Cpu { .. }) {
        use crate::backend::cpu::matmul::{matrixmultiply_agrees, Gemm};
        ui::debug(format!(
            "cpu gemm {:?}{}",
            Gemm::configured(),
            if matrixmultiply_agrees() {
                " (matrixmultiply and tile16 give the same bits here)"
            } else {
                " (this build's matrixmultiply does not give the engine's bits: tile16 only)"
            }
        ));
    }
    ui::debug(format!(
        "weights loaded in {:.2}s; provenance {:?}",
        inputs.load_s, a.provenance
    ));
    let bytes: usize = inputs.streams.iter().map(|p| p.stream.text.len()).sum();
    let tokens: Option<usize> = inputs.streams.iter().map(|p| p.full_tokens).sum();
    let tokens = tokens.map_or("a prefix tokenized".to_string(), |t| format!("{t} tokens"));
    let input_tokens: usize = inputs.streams.iter().map(|p| p.tokens.len()).sum();
    match &inputs.corpus {
        Some(corpus) => ui::info(format!(
            "corpus     {} ({}): {} streams, {bytes} bytes, {tokens}{}",
            corpus.manifest.corpus_id,
            corpus.manifest_path.display(),
            inputs.streams.len(),
            cfg.max_tokens
                .map(|m| format!(", capped at {m} per stream ({input_tokens} in all)"))
                .unwrap_or_default()
        )),
        None => ui::info(format!(
            "text       {}: {bytes} bytes, {tokens}{}",
            inputs.streams[0].stream.path.display(),
            cfg.max_tokens
                .map(|m| format!(", capped at {m}"))
                .unwrap_or_default()
        )),
    }
    ui::info(format!(
        "scoring    {} tokens to process ({} windows)",
        inputs.processed_tokens(),
        inputs.window_count()
    ));
}

#[cfg(test)]
mod tests {
    use super::utc_stamp;

    #[test]
    fn run_ids_have_milliseconds_and_the_process() {
        let id = super::run_id(1796036645.0425, "sha256:65c3b8b6c7ab", "bf16", 4242);
        assert_eq!(id, "20261130T110405.042Z-65c3b8b6-bf16-4242");
    }

    #[test]
    fn stamps() {
        assert_eq!(utc_stamp(0), "19700101T000000Z");
        assert_eq!(utc_stamp(951782400), "20000229T000000Z");
        assert_eq!(utc_stamp(1796036645), "20261130T110405Z");
    }
}
