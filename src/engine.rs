//! The one scoring engine the CLI and the regression harness share.
//!
//! `Engine::load` opens and validates an artifact, builds its tokenizer and loads the
//! weights for the selected device; `Engine::score` runs the window protocol over one
//! token stream with one Main KV representation. Nothing here knows about corpora,
//! reports or command-line flags.

use crate::artifact::Artifact;
use crate::backend::cuda::CudaModel;
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
        LoadOptions {
            device: DeviceRequest::Cpu,
            threads: 0,
            verify_digest: false,
        }
    }
}

pub struct Engine {
    pub artifact: Artifact,
    pub tokenizer: Tokenizer,
    pub device: Device,
    /// Why `auto` picked what it picked, for the startup log.
    pub device_note: Option<String>,
    model: Model,
    pool: rayon::ThreadPool,
}

/// The loaded model on its backend.
enum Model {
    Cpu(CpuModel),
    // Only constructed when the CUDA backend is built and a device was selected.
    #[allow(dead_code)]
    Cuda(Box<CudaModel>),
}

/// Progress of a stream being scored: targets scored so far and tokens processed.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    pub scored: u64,
    pub processed: u64,
}

impl Engine {
    pub fn load(
        path: &Path,
        opts: &LoadOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Engine> {
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
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            opts.threads
        };
        let (device, device_note) = Device::select(opts.device, threads)?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| anyhow!("cannot start {threads} worker threads: {e}"))?;
        let model = match &device {
            Device::Cpu { .. } => {
                let weights = Weights::load(&artifact, progress)?;
                Model::Cpu(CpuModel::new(artifact.config.clone(), weights))
            }
            Device::Cuda { ordinal, .. } => load_cuda(&artifact, *ordinal, progress)?,
        };
        Ok(Engine {
            artifact,
            tokenizer,
            device,
            device_note,
            model,
            pool,
        })
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Device memory of a CUDA engine (peak allocated and used bytes), for reports.
    pub fn cuda_memory(&self) -> Option<crate::backend::cuda::MemoryReport> {
        match &self.model {
            Model::Cpu(_) => None,
            #[cfg(feature = "cuda")]
            Model::Cuda(m) => Some(m.memory_report()),
            #[cfg(not(feature = "cuda"))]
            Model::Cuda(_) => None,
        }
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
        kv.check_head_dim(self.artifact.config.head_dim)?;
        let ws = windows(tokens.len(), protocol)?;
        let mut totals = NllSum::default();
        let mut out = Vec::with_capacity(ws.len());
        let mut processed = 0u64;
        // Accounts one finished window (the same for every backend).
        let mut finish = |wi: usize, lps: Vec<f32>| -> Result<()> {
            let w = &ws[wi];
            let mut s = NllSum::default();
            for &lp in &lps {
                if !lp.is_finite() {
                    anyhow::bail!(
                        "window {wi} [{}, {}): non-finite log-probability",
                        w.begin,
                        w.end
                    );
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
            on_window(
                &ws,
                Progress {
                    scored: totals.scored,
                    processed,
                },
            );
            out.push(ws);
            Ok(())
        };
        let window_error = |wi: usize, e: &dyn std::fmt::Display| {
            let w = &ws[wi];
            anyhow!(
                "window {wi} [{}, {}) (targets from {}): {e}",
                w.begin,
                w.end,
                w.start
            )
        };
        match &self.model {
            Model::Cpu(model) => {
                for (wi, w) in ws.iter().enumerate() {
                    let lps = self
                        .pool
                        .install(|| {
                            model.window_logprobs(&tokens[w.begin..w.end], w.start - w.begin, kv)
                        })
                        .map_err(|e| window_error(wi, &e))?;
                    finish(wi, lps)?;
                }
            }
            Model::Cuda(model) => score_cuda(model, tokens, &ws, kv, &mut finish, &window_error)?,
        }
        Ok(StreamScore {
            tokens: tokens.len(),
            processed_tokens: processed as usize,
            totals,
            windows: out,
        })
    }
}

#[cfg(feature = "cuda")]
fn load_cuda(
    a: &Artifact,
    ordinal: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Model> {
    let precision = crate::backend::cuda::model::precision_from_env()?;
    Ok(Model::Cuda(Box::new(CudaModel::load(
        a, ordinal, precision, progress,
    )?)))
}

#[cfg(not(feature = "cuda"))]
fn load_cuda(_: &Artifact, _: usize, _: &mut dyn FnMut(usize, usize)) -> Result<Model> {
    anyhow::bail!("this build has no CUDA backend")
}

/// Scores the windows on the GPU in batches and hands each finished window to `finish`.
#[cfg(feature = "cuda")]
fn score_cuda(
    model: &CudaModel,
    tokens: &[u32],
    ws: &[crate::score::Window],
    kv: KvDtype,
    finish: &mut dyn FnMut(usize, Vec<f32>) -> Result<()>,
    window_error: &dyn Fn(usize, &dyn std::fmt::Display) -> anyhow::Error,
) -> Result<()> {
    use crate::backend::cuda::model::ScoreError;
    let r = model.score_windows(tokens, ws, kv, &mut |first, batch| {
        for (j, lps) in batch.into_iter().enumerate() {
            finish(first + j, lps)?;
        }
        Ok(())
    });
    match r {
        Ok(()) => Ok(()),
        Err(ScoreError::Window { index, error }) => Err(window_error(index, &error)),
        Err(ScoreError::Device(e)) => {
            Err(e.context(format!("CUDA scoring ({} windows)", ws.len())))
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn score_cuda(
    model: &CudaModel,
    _: &[u32],
    _: &[crate::score::Window],
    _: KvDtype,
    _: &mut dyn FnMut(usize, Vec<f32>) -> Result<()>,
    _: &dyn Fn(usize, &dyn std::fmt::Display) -> anyhow::Error,
) -> Result<()> {
    let _ = model.config();
    unreachable!("no CUDA model exists without the CUDA backend")
}
