//! One evaluator run: resolve inputs, load once, tokenize everything, score, report.
//!
//! Inputs are validated before the model is loaded and every stream is read, verified and
//! tokenized before the first window is scored, so bad input fails in seconds and a run
//! that starts scoring has everything it needs.

use crate::cli::{Input, RunConfig};
use crate::corpus::{load_text_file, Corpus, LoadedStream};
use crate::engine::{Engine, LoadOptions};
use crate::registry;
use crate::report::{self, aggregate, Report, StreamReport, Totals};
use crate::score::{processed_tokens, windows};
use crate::ui::{Log, Progress};
use anyhow::{anyhow, bail, Result};
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

struct Prepared {
    stream: LoadedStream,
    tokens: Vec<u32>,
    /// Tokens of the whole stream before any --max-tokens cap.
    full_tokens: usize,
}

pub fn run(cfg: &RunConfig) -> Result<RunOutput> {
    let log = Log {
        level: cfg.log_level,
    };
    let t0 = Instant::now();
    let started_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    if let Some(dir) = &cfg.output {
        report::write::check_output_dir(dir)?;
    }
    let artifact_path = registry::resolve_artifact(&cfg.artifact)?;

    // Read and verify the inputs before spending time on the model.
    let (corpus, domains, streams): (Option<Corpus>, Vec<(String, String)>, Vec<LoadedStream>) =
        match &cfg.input {
            Input::Corpus {
                manifest,
                quick,
                streams,
                stream_dir,
            } => {
                let c = Corpus::open(manifest, stream_dir.as_deref())?;
                let sel = c.select(*quick, streams)?;
                let loaded = sel.iter().map(|s| c.load(s)).collect::<Result<Vec<_>>>()?;
                let doms = c
                    .manifest
                    .domains
                    .iter()
                    .filter(|d| loaded.iter().any(|s| s.domain == d.id))
                    .map(|d| (d.id.clone(), d.title.clone()))
                    .collect();
                (Some(c), doms, loaded)
            }
            Input::Text(p) => (None, Vec::new(), vec![load_text_file(p)?]),
        };

    log.info(format!("ninfer-perplexity {}", env!("CARGO_PKG_VERSION")));
    let t_load = Instant::now();
    let opts = LoadOptions {
        device: cfg.device,
        threads: cfg.threads,
        verify_digest: cfg.verify_artifact,
    };
    let mut load_bar = Progress::new("loading weights", 1, "tensors", log);
    let engine = Engine::load(&artifact_path, &opts, &mut |done, total| {
        load_bar.set_total(total as u64);
        load_bar.update(done as u64);
    })?;
    load_bar.finish();
    let load_s = t_load.elapsed().as_secs_f64();
    let a = &engine.artifact;
    let c = &a.config;
    if let Some(note) = &engine.device_note {
        log.info(note);
    }
    cfg.kv.check_head_dim(c.head_dim)?;
    let kv_bytes = cfg.kv.bytes_per_token_per_layer(c.num_kv_heads, c.head_dim);
    log.info(format!(
        "artifact   {} ({:.1} MB)",
        a.path().display(),
        a.file_bytes as f64 / 1e6
    ));
    log.info(format!(
        "           digest {}{}",
        a.digest,
        if cfg.verify_artifact {
            " (verified)"
        } else {
            ""
        }
    ));
    log.info(format!(
        "model      {} {:.1}M params, {} layers, d {}, {}/{} heads, head_dim {}, vocab {}, weights {}",
        c.family.name(),
        c.num_params() as f64 / 1e6,
        c.num_layers,
        c.hidden_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size,
        a.weight_format.name()
    ));
    log.info(format!(
        "kv         {} ({} bytes per token per layer)",
        cfg.kv.name(),
        kv_bytes
    ));
    log.info(format!("device     {}", engine.device.describe()));
    log.info(format!(
        "protocol   context {} stride {}",
        cfg.protocol.context, cfg.protocol.stride
    ));
    log.debug(format!(
        "tokenizer sha256 {} vocab {}",
        engine.tokenizer.sha256(),
        engine.tokenizer.vocab_size()
    ));
    log.debug(format!(
        "weights loaded in {load_s:.2}s; provenance {:?}",
        a.provenance
    ));

    // Tokenize every stream before scoring.
    let t_tok = Instant::now();
    let mut prepared = Vec::with_capacity(streams.len());
    for s in streams {
        let mut tokens = engine
            .tokenizer
            .encode(&s.text)
            .map_err(|e| anyhow!("stream `{}` ({}): {e}", s.id, s.path.display()))?;
        let full_tokens = tokens.len();
        if let Some(m) = cfg.max_tokens {
            tokens.truncate(m);
        }
        if tokens.len() < 2 {
            bail!(
                "stream `{}` ({}): has {} token(s); at least 2 are needed to score anything",
                s.id,
                s.path.display(),
                tokens.len()
            );
        }
        prepared.push(Prepared {
            stream: s,
            tokens,
            full_tokens,
        });
    }
    let tokenize_s = t_tok.elapsed().as_secs_f64();
    let total_bytes: usize = prepared.iter().map(|p| p.stream.text.len()).sum();
    let total_tokens: usize = prepared.iter().map(|p| p.full_tokens).sum();
    let input_tokens: usize = prepared.iter().map(|p| p.tokens.len()).sum();
    let mut total_processed = 0usize;
    for p in &prepared {
        total_processed += processed_tokens(p.tokens.len(), cfg.protocol)?;
    }
    match &corpus {
        Some(c) => log.info(format!(
            "corpus     {} ({}): {} streams, {} bytes, {} tokens{}",
            c.manifest.name,
            c.manifest_path.display(),
            prepared.len(),
            total_bytes,
            total_tokens,
            cfg.max_tokens
                .map(|m| format!(", capped at {m} per stream ({input_tokens} in all)"))
                .unwrap_or_default()
        )),
        None => log.info(format!(
            "text       {}: {} bytes, {} tokens{}",
            prepared[0].stream.path.display(),
            total_bytes,
            total_tokens,
            cfg.max_tokens
                .map(|m| format!(", capped at {m}"))
                .unwrap_or_default()
        )),
    }
    log.info(format!(
        "scoring    {} tokens to process ({} windows)",
        total_processed,
        {
            let mut n = 0;
            for p in &prepared {
                n += windows(p.tokens.len(), cfg.protocol)?.len();
            }
            n
        }
    ));

    // Score.
    let t_score = Instant::now();
    let mut progress = Progress::new("scoring", total_processed as u64, "tokens", log);
    let mut done_before = 0u64;
    let mut stream_reports = Vec::with_capacity(prepared.len());
    for p in &prepared {
        log.debug(format!(
            "stream {} begins: {} tokens",
            p.stream.id,
            p.tokens.len()
        ));
        progress.set_message(&p.stream.id);
        let ts = Instant::now();
        let score = engine
            .score(&p.tokens, cfg.protocol, cfg.kv, false, &mut |_w, pr| {
                progress.update(done_before + pr.processed);
            })
            .map_err(|e| anyhow!("stream `{}`: {e:#}", p.stream.id))?;
        let secs = ts.elapsed().as_secs_f64();
        done_before += score.processed_tokens as u64;
        // Bits per byte count the bytes of the text that was scored.
        let bytes = if p.tokens.len() < p.full_tokens {
            engine
                .tokenizer
                .byte_len_of_prefix(&p.stream.text, p.tokens.len())?
        } else {
            p.stream.text.len() as u64
        };
        let totals = Totals::new(&score.totals, bytes);
        progress.suspend(|| log.info(format!(
            "stream     {:<12} {:>8} tokens {:>8} scored  mean_nll {:.5}  ppl {:.4}  {:.1}s  {:.1} tokens/s",
            p.stream.id,
            p.tokens.len(),
            totals.scored,
            totals.mean_nll,
            totals.ppl,
            secs,
            score.processed_tokens as f64 / secs.max(1e-9)
        )));
        stream_reports.push(StreamReport {
            id: p.stream.id.clone(),
            domain: p.stream.domain.clone(),
            path: p.stream.path.display().to_string(),
            sha256: p.stream.sha256.clone(),
            tokens: p.full_tokens,
            input_tokens: p.tokens.len(),
            processed_tokens: score.processed_tokens,
            totals,
            seconds: secs,
            processed_tokens_per_s: score.processed_tokens as f64 / secs.max(1e-9),
            windows: score.windows,
        });
    }
    progress.finish();
    let score_s = t_score.elapsed().as_secs_f64();

    let domain_rows: Vec<_> = domains
        .iter()
        .map(|(id, title)| aggregate(id, title, stream_reports.iter().filter(|s| &s.domain == id)))
        .collect();
    let overall = aggregate("overall", "overall", stream_reports.iter());
    let run_id = format!(
        "{}-{}-{}",
        utc_stamp(started_unix as u64),
        &a.digest[7..15],
        cfg.kv.name()
    );
    let scored_total = overall.totals.scored;
    let rep = Report {
        schema: report::SCHEMA.into(),
        schema_version: report::SCHEMA_VERSION,
        run_id: run_id.clone(),
        tool: report::Tool {
            name: "ninfer-perplexity".into(),
            version: env!("CARGO_PKG_VERSION").into(),
        },
        started_unix_s: started_unix,
        settings: report::Settings {
            mode: if corpus.is_some() {
                "corpus".into()
            } else {
                "text".into()
            },
            context: cfg.protocol.context,
            stride: cfg.protocol.stride,
            kv_dtype: cfg.kv.name().into(),
            kv_bytes_per_token_per_layer: kv_bytes,
            quick: matches!(cfg.input, Input::Corpus { quick: true, .. }),
            max_tokens: cfg.max_tokens,
            device: engine.device.describe(),
            device_class: engine.device.class(),
            threads: engine.threads(),
        },
        artifact: report::ArtifactInfo {
            path: a.path().display().to_string(),
            digest: a.digest.clone(),
            digest_verified: cfg.verify_artifact,
            file_bytes: a.file_bytes,
            family: c.family.name().into(),
            params: c.num_params(),
            weight_format: a.weight_format.name().into(),
            config: c.clone(),
        },
        tokenizer: report::TokenizerInfo {
            sha256: engine.tokenizer.sha256().into(),
            vocab_size: engine.tokenizer.vocab_size(),
        },
        corpus: corpus.as_ref().map(|c| report::CorpusInfo {
            name: c.manifest.name.clone(),
            manifest: c.manifest_path.display().to_string(),
            manifest_sha256: c.manifest_sha256.clone(),
        }),
        streams: stream_reports,
        domains: domain_rows,
        overall,
        timings: report::Timings {
            load_s,
            tokenize_s,
            score_s,
            total_s: t0.elapsed().as_secs_f64(),
        },
        throughput: report::Throughput {
            processed_tokens: total_processed,
            processed_tokens_per_s: total_processed as f64 / score_s.max(1e-9),
            scored_tokens_per_s: scored_total as f64 / score_s.max(1e-9),
        },
        peak_rss_bytes: report::peak_rss_bytes(),
        cuda_memory: engine.cuda_memory(),
    };
    let dir = cfg
        .output
        .clone()
        .unwrap_or_else(|| PathBuf::from("profiles/perplexity").join(&run_id));
    let json = serde_json::to_string_pretty(&rep)?;
    let report_path = report::write::write_report(&dir, &json)?;
    log.info(format!(
        "done       {} scored tokens in {:.1}s ({:.1} processed tokens/s); report {}",
        scored_total,
        score_s,
        rep.throughput.processed_tokens_per_s,
        report_path.display()
    ));
    let table = report::table::render(&rep);
    Ok(RunOutput {
        report: rep,
        report_path,
        table,
    })
}

#[cfg(test)]
mod tests {
    use super::utc_stamp;

    #[test]
    fn stamps() {
        assert_eq!(utc_stamp(0), "19700101T000000Z");
        assert_eq!(utc_stamp(951782400), "20000229T000000Z");
        assert_eq!(utc_stamp(1796036645), "20261130T110405Z");
    }
}
