//! The one scoring engine the CLI and the regression harness share.
//!
//! `Engine::load` opens and validates an artifact, builds its tokenizer and loads the
//! weights for the selected device; `Engine::score` runs the window protocol over one
//! token stream with one Main KV representation. Nothing here knows about corpora,
//! reports or command-line flags.

use crate::artifact::Artifact;
use crate::backend::{Device, DeviceRequest};
use crate::kv::KvDtype;
use crate::model::forward::CpuModel;
use crate::model::weights::Weights;
use crate::score::{windows, NllSum, Protocol, StreamScore, WindowScore};
use crate::tokenizer::Tokenizer;
use anyhow::{anyhow, Context, Result};
use std::path::Path;

pub struct LoadOptions {
    pub device: DeviceRequest,
    /// Worker threads for the CPU backend (0: one per available core).
    pub threads: usize,
    /// Recompute the artifact digest and compare it with the recorded one.
    pub verify_digest: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { device: DeviceRequest::Cpu, threads: 0, verify_digest: false }
    }
}

pub struct Engine {
    pub artifact: Artifact,
    pub tokenizer: Tokenizer,
    pub device: Device,
    /// Why `auto` picked what it picked, for the startup log.
    pub device_note: Option<String>,
    model: CpuModel,
    pool: rayon::ThreadPool,
}

/// Progress of a stream being scored: targets scored so far and tokens processed.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    pub scored: u64,
    pub processed: u64,
}

impl Engine {
    pub fn load(path: &Path, opts: &LoadOptions, progress: &mut dyn FnMut(usize, usize)) -> Result<Engine> {
        let artifact = Artifact::open(path)?;
        if opts.verify_digest {
            artifact.verify_digest()?;
        }
        let tokenizer = Tokenizer::from_json(artifact.tokenizer_json())
            .with_context(|| format!("{}: metadata `tokenizer`", path.display()))?;
        if tokenizer.vocab_size() > artifact.config.vocab_size {
            anyhow::bail!(
                "{}: the tokenizer has {} tokens but the model's vocabulary has {}",
                path.display(),
                tokenizer.vocab_size(),
                artifact.config.vocab_size
            );
        }
        let threads = if opts.threads == 0 {
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
        } else {
            opts.threads
        };
        let (device, device_note) = Device::select(opts.device, threads)?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| anyhow!("cannot start {threads} worker threads: {e}"))?;
        let weights = Weights::load(&artifact, progress)?;
        let model = CpuModel::new(artifact.config.clone(), weights);
        Ok(Engine { artifact, tokenizer, device, device_note, model, pool })
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Scores one stream. `keep_logprobs` keeps every target's log-probability in the
    /// window results. `on_window` sees each window as it finishes. Errors say which
    /// window failed; the caller adds the stream's name.
    pub fn score(
        &self,
        tokens: &[u32],
        protocol: Protocol,
        kv: KvDtype,
        keep_logprobs: bool,
        on_window: &mut dyn FnMut(&WindowScore, Progress),
    ) -> Result<StreamScore> {
        kv.check_head_dim(self.model.config.head_dim)?;
        let ws = windows(tokens.len(), protocol)?;
        let mut totals = NllSum::default();
        let mut out = Vec::with_capacity(ws.len());
        let mut processed = 0u64;
        for (wi, w) in ws.iter().enumerate() {
            let lps = self
                .pool
                .install(|| self.model.window_logprobs(&tokens[w.begin..w.end], w.start - w.begin, kv))
                .map_err(|e| {
                    anyhow!("window {wi} [{}, {}) (targets from {}): {e}", w.begin, w.end, w.start)
                })?;
            let mut s = NllSum::default();
            for &lp in &lps {
                if !lp.is_finite() {
                    anyhow::bail!("window {wi} [{}, {}): non-finite log-probability", w.begin, w.end);
                }
                s.push(lp);
            }
            totals.add(&s);
            processed += w.len() as u64;
            let ws = WindowScore {
                begin: w.begin,
                start: w.start,
                end: w.end,
                scored: s.scored,
                nll_sum: s.nll_sum,
                nll_sq_sum: s.nll_sq_sum,
                logprobs: keep_logprobs.then_some(lps),
            };
            on_window(&ws, Progress { scored: totals.scored, processed });
            out.push(ws);
        }
        Ok(StreamScore {
            tokens: tokens.len(),
            processed_tokens: processed as usize,
            totals,
            windows: out,
        })
    }
}
