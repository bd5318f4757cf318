//! Everything a run reads before the first window is scored: the streams (read and
//! verified), the engine (artifact, tokenizer, weights), and every stream's tokens and
//! windows. Bad input therefore fails in seconds, and a run that starts scoring has all it
//! needs.

use crate::cli::{Input, RunConfig};
use crate::corpus::{load_text_file, Corpus, LoadedStream};
use crate::engine::{Engine, LoadOptions};
use crate::score::{windows, Window};
use crate::ui::{self, ProgressLine};
use anyhow::{anyhow, bail, Result};
use std::path::Path;
use std::time::Instant;

/// One stream, ready to score.
pub struct Prepared {
    pub stream: LoadedStream,
    /// The tokens scored over (after a `--max-tokens` cap).
    pub tokens: Vec<u32>,
    /// Tokens of the whole stream before any cap (`None`: a capped run tokenized only the
    /// prefix it needs).
    pub full_tokens: Option<usize>,
    /// UTF-8 bytes of the stream that `tokens` cover.
    pub bytes: u64,
    /// The protocol's windows over `tokens`, computed once.
    pub windows: Vec<Window>,
    /// Index of `windows[0]` in the stream's plan (non-zero in a shard).
    pub first_window: usize,
    /// Tokens fed through the model over all windows.
    pub processed: usize,
}

/// A run's inputs.
pub struct Inputs {
    pub corpus: Option<Corpus>,
    /// `(id, title)` of the domains that have selected streams, in manifest order.
    pub domains: Vec<(String, String)>,
    pub engine: Engine,
    pub streams: Vec<Prepared>,
    pub load_s: f64,
    pub tokenize_s: f64,
}

impl Inputs {
    pub fn processed_tokens(&self) -> usize {
        self.streams.iter().map(|p| p.processed).sum()
    }

    pub fn window_count(&self) -> usize {
        self.streams.iter().map(|p| p.windows.len()).sum()
    }
}

/// Reads, verifies, loads and tokenizes everything `cfg` names (the artifact already
/// resolved to `artifact_path`).
pub fn prepare(cfg: &RunConfig, artifact_path: &Path) -> Result<Inputs> {
    let (corpus, domains, streams) = read_streams(&cfg.input)?;

    ui::info(format!("ninfer-perplexity {}", env!("CARGO_PKG_VERSION")));
    let t_load = Instant::now();
    // A reference pass runs on the CPU only: `auto` means the CPU then.
    let cpu_only = cfg.reference.is_some() || cfg.kld_base.is_some();
    let device = match (cpu_only, cfg.device) {
        (true, crate::backend::DeviceRequest::Auto) => crate::backend::DeviceRequest::Cpu,
        (_, d) => d,
    };
    let opts = LoadOptions {
        device,
        threads: cfg.threads,
        verify_digest: cfg.verify_artifact,
        precision: cfg.precision,
        // The longest window the protocol makes; the CPU plans its memory for it.
        window_tokens: Some(
            cfg.protocol
                .context
                .min(cfg.max_tokens.unwrap_or(usize::MAX)),
        ),
        max_memory: cfg.max_memory,
    };
    let mut load_bar = ProgressLine::new("loading weights", 1, "tensors");
    let mut engine = Engine::load(artifact_path, &opts, &mut |done, total| {
        load_bar.set_total(total as u64);
        load_bar.update(done as u64);
    })?;
    load_bar.finish();
    if let Some(r) = &cfg.reference {
        let other = match &r.artifact {
            None => None,
            Some(name) => {
                let resolved = crate::registry::resolve_artifact(name)
                    .map_err(|e| anyhow!("--reference-artifact: {e:#}"))?;
                let mut bar = ProgressLine::new("loading reference weights", 1, "tensors");
                let e = Engine::load(&resolved.path, &opts, &mut |done, total| {
                    bar.set_total(total as u64);
                    bar.update(done as u64);
                })
                .map_err(|e| anyhow!("--reference-artifact: {e:#}"))?;
                bar.finish();
                resolved.check_digest(&e.artifact.digest)?;
                Some(e)
            }
        };
        if other.is_none() && r.kv == cfg.kv {
            ui::info(format!(
                "reference  the run itself (--reference-kv {} = --kv-dtype): KL divergence 0 and agreement 1 by construction",
                r.kv.name()
            ));
        }
        engine.set_reference(r.kv, other)?;
    }
    if let Some(p) = &cfg.kld_base {
        let saved = crate::score::saved::SavedReference::open(p)
            .map_err(|e| anyhow!("--kld-base: {e:#}"))?;
        let id = &saved.index.identity;
        ui::info(format!(
            "reference  saved: {} ({} streams, kv {}, context {}/{}, {} on {})",
            p.display(),
            saved.index.streams.len(),
            id.kv_dtype,
            id.context,
            id.stride,
            id.build,
            id.device
        ));
        engine
            .set_kld_base(saved)
            .map_err(|e| anyhow!("--kld-base: {e:#}"))?;
    }
    if let Some(p) = &cfg.save_reference {
        let writer = crate::score::saved::SavedWriter::create(
            p,
            engine.saved_identity(cfg.protocol, cfg.kv),
        )
        .map_err(|e| anyhow!("--save-reference: {e:#}"))?;
        engine.set_save_reference(writer)?;
    }
    let load_s = t_load.elapsed().as_secs_f64();
    cfg.kv.check_head_dim(engine.artifact.config.head_dim)?;

    let t_tok = Instant::now();
    let mut prepared = Vec::with_capacity(streams.len());
    for s in streams {
        prepared.push(tokenize(&engine, cfg, s)?);
    }
    Ok(Inputs {
        corpus,
        domains,
        engine,
        streams: prepared,
        load_s,
        tokenize_s: t_tok.elapsed().as_secs_f64(),
    })
}

type Streams = (Option<Corpus>, Vec<(String, String)>, Vec<LoadedStream>);

/// The selected corpus streams (verified against the manifest), or the one text file.
fn read_streams(input: &Input) -> Result<Streams> {
    match input {
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
            Ok((Some(c), doms, loaded))
        }
        Input::Text(p) => Ok((None, Vec::new(), vec![load_text_file(p)?])),
    }
}

/// A stream's tokens (capped at `--max-tokens`) and its windows.
fn tokenize(engine: &Engine, cfg: &RunConfig, s: LoadedStream) -> Result<Prepared> {
    let fail = |e: anyhow::Error| anyhow!("stream `{}` ({}): {e}", s.id, s.path.display());
    let (tokens, full_tokens, bytes) = match cfg.max_tokens {
        // Only what is scored is tokenized.
        Some(m) => {
            let p = engine.tokenizer.encode_prefix(&s.text, m).map_err(fail)?;
            (p.ids, p.whole, p.bytes)
        }
        None => {
            let t = engine.tokenizer.encode(&s.text).map_err(fail)?;
            let n = t.len();
            (t, Some(n), s.text.len() as u64)
        }
    };
    if tokens.len() < 2 {
        bail!(
            "stream `{}` ({}): has {} token(s); at least 2 are needed to score anything",
            s.id,
            s.path.display(),
            tokens.len()
        );
    }
    let windows = windows(tokens.len(), cfg.protocol)?;
    let processed = windows.iter().map(|w| w.len()).sum();
    Ok(Prepared {
        stream: s,
        tokens,
        full_tokens,
        bytes,
        windows,
        first_window: 0,
        processed,
    })
}
