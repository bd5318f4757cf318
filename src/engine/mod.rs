//! The one scoring engine the CLI and the regression harness share.
//!
//! `Engine::load` opens and validates an artifact, builds its tokenizer and loads the
//! weights for the selected device; `Engine::score_windows` runs the window protocol over
//! one token stream with one Main KV representation. Nothing here knows about corpora,
//! reports or command-line flags. How the CPU backend schedules windows over its threads is
//! `cpu`'s job.

mod cpu;

use crate::artifact::Artifact;
use crate::backend::cpu::head::RowScore;
use crate::backend::cpu::head_pair::PairScore;
use crate::backend::cuda::{CudaModel, Target};
use crate::backend::{Device, DeviceRequest, Precision};
use crate::kv::KvDtype;
use crate::model::fault::Faults;
use crate::model::forward::CpuModel;
use crate::score::{
    windows, Calibration, NllSum, Protocol, ReferenceAcc, StreamScore, Window, WindowScore,
};
use crate::tokenizer::Tokenizer;
use anyhow::{anyhow, Context, Result};
use cpu::{cpu_windows_in_flight, score_cpu, CpuSchedule};
use std::path::Path;

pub struct LoadOptions {
    pub device: DeviceRequest,
    /// Worker threads for the CPU backend (0: one per available core).
    pub threads: usize,
    /// Recompute the artifact digest and compare it with the recorded one.
    pub verify_digest: bool,
    /// Compute precision; `None` takes the device's default (CPU f32, CUDA bf16).
    pub precision: Option<Precision>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            device: DeviceRequest::Cpu,
            threads: 0,
            verify_digest: false,
            precision: None,
        }
    }
}

pub struct Engine {
    pub artifact: Artifact,
    pub tokenizer: Tokenizer,
    pub device: Device,
    /// Why `auto` picked what it picked, for the startup log.
    pub device_note: Option<String>,
    /// The arithmetic of the forward pass (CPU: always f32).
    pub precision: Precision,
    /// The test-only perturbation in effect (none outside `fault-injection` builds).
    pub faults: Faults,
    model: Model,
    pool: rayon::ThreadPool,
    /// A second pass every window is compared with ([`Engine::set_reference`]).
    reference: Option<Reference>,
}

/// The reference pass: its KV format and, unless it is this engine's own model, another
/// artifact's engine.
struct Reference {
    kv: KvDtype,
    other: Option<Box<Engine>>,
}

/// The loaded model on its backend.
enum Model {
    Cpu(Box<CpuModel>),
    // Only constructed when the CUDA backend is built and a device was selected.
    #[allow(dead_code)]
    Cuda(Box<CudaModel>),
}

/// Progress of a stream being scored: targets scored so far and tokens processed.
#[derive(Clone, Copy, Debug)]
pub struct ScoreProgress {
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
        let faults = Faults::from_env().map_err(anyhow::Error::msg)?;
        let threads = if opts.threads == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            opts.threads
        };
        let (device, device_note) = Device::select(opts.device, threads)?;
        let precision = device.precision(opts.precision)?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| anyhow!("cannot start {threads} worker threads: {e}"))?;
        let model = match &device {
            Device::Cpu { .. } => {
                let weights = crate::model::weights::load(&artifact, progress)?;
                let m = CpuModel::new(artifact.config.clone(), weights).with_faults(faults);
                Model::Cpu(Box::new(m))
            }
            Device::Cuda { .. } | Device::Emu { .. } => {
                if faults.active().is_some() {
                    anyhow::bail!("NINFER_TEST_FAULT applies to the CPU backend only");
                }
                let target = match device {
                    Device::Cuda { ordinal, .. } => Target::Cuda(ordinal),
                    _ => Target::Emulated,
                };
                load_cuda(&artifact, target, precision, progress)?
            }
        };
        Ok(Engine {
            artifact,
            tokenizer,
            device,
            device_note,
            precision,
            faults,
            model,
            pool,
            reference: None,
        })
    }

    /// Runs the CPU model with `faults` from now on (tests of the `fault-injection` build).
    #[cfg(feature = "fault-injection")]
    pub fn set_faults(&mut self, faults: Faults) -> Result<()> {
        match &mut self.model {
            Model::Cpu(m) => m.set_faults(faults),
            Model::Cuda(_) => anyhow::bail!("test faults apply to the CPU backend only"),
        }
        self.faults = faults;
        Ok(())
    }

    /// The class results are compared within (baselines are kept per class): the device
    /// class, and for CUDA the precision too (`cuda-sm90-bf16`), since it changes results.
    pub fn result_class(&self) -> String {
        match self.device {
            Device::Cpu { .. } => self.device.class(),
            Device::Cuda { .. } | Device::Emu { .. } => {
                format!("{}-{}", self.device.class(), self.precision.name())
            }
        }
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

    /// Compares every window scored from now on with a reference pass over the same tokens:
    /// this artifact with the KV format `kv` (`other: None`), or another artifact's engine
    /// with it. Both must run on the CPU (the CUDA head has no reference mode yet), and
    /// another artifact must have the same tokenizer and vocabulary.
    pub fn set_reference(&mut self, kv: KvDtype, other: Option<Engine>) -> Result<()> {
        if !matches!(self.model, Model::Cpu(_)) {
            anyhow::bail!("a reference pass (--reference-kv, --reference-artifact) runs on the CPU backend only, for now: add --device cpu");
        }
        if let Some(o) = &other {
            if !matches!(o.model, Model::Cpu(_)) {
                anyhow::bail!(
                    "{}: the reference model must run on the CPU",
                    o.artifact.path().display()
                );
            }
            let (a, b) = (&self.artifact, &o.artifact);
            if self.tokenizer.sha256() != o.tokenizer.sha256()
                || a.config.vocab_size != b.config.vocab_size
            {
                anyhow::bail!(
                    "{}: its tokenizer (sha256 {}, vocabulary {}) differs from {}'s (sha256 {}, vocabulary {}); a reference must score the same tokens (artifacts {} and {})",
                    b.path().display(),
                    o.tokenizer.sha256(),
                    b.config.vocab_size,
                    a.path().display(),
                    self.tokenizer.sha256(),
                    a.config.vocab_size,
                    b.digest,
                    a.digest
                );
            }
            kv.check_head_dim(b.config.head_dim)?;
        } else {
            kv.check_head_dim(self.artifact.config.head_dim)?;
        }
        self.reference = Some(Reference {
            kv,
            other: other.map(Box::new),
        });
        Ok(())
    }

    /// The reference pass's KV format and artifact (this engine's own when it is not
    /// another one), if [`Engine::set_reference`] set one.
    pub fn reference(&self) -> Option<(KvDtype, &Artifact)> {
        self.reference.as_ref().map(|r| {
            (
                r.kv,
                r.other.as_ref().map_or(&self.artifact, |e| &e.artifact),
            )
        })
    }

    /// Scores one stream with the windows of `protocol` ([`Engine::score_windows`]).
    pub fn score(
        &self,
        tokens: &[u32],
        protocol: Protocol,
        kv: KvDtype,
        keep_logprobs: bool,
        on_window: &mut dyn FnMut(&WindowScore, ScoreProgress),
    ) -> Result<StreamScore> {
        let ws = windows(tokens.len(), protocol)?;
        self.score_windows(tokens, &ws, kv, keep_logprobs, on_window)
    }

    /// Scores one stream's windows (from [`crate::score::windows`]). `keep_logprobs` keeps
    /// every target's log-probability in the window results. `on_window` sees each window
    /// as it finishes, in window order. Errors say which window failed; the caller adds the
    /// stream's name.
    pub fn score_windows(
        &self,
        tokens: &[u32],
        ws: &[Window],
        kv: KvDtype,
        keep_logprobs: bool,
        on_window: &mut dyn FnMut(&WindowScore, ScoreProgress),
    ) -> Result<StreamScore> {
        kv.check_head_dim(self.artifact.config.head_dim)?;
        if let Some(w) = ws.iter().find(|w| w.end > tokens.len()) {
            anyhow::bail!(
                "window [{}, {}) past the stream's {} tokens",
                w.begin,
                w.end,
                tokens.len()
            );
        }
        let mut totals = NllSum::default();
        let mut out = Vec::with_capacity(ws.len());
        let mut processed = 0u64;
        // Some(..) as long as every window came with entropy and top-1 (one backend per run).
        let mut calibration = Some(Calibration::default());
        let mut reference = self.reference.as_ref().map(|_| ReferenceAcc::default());
        // Accounts one finished window (the same for every backend).
        let mut finish = |wi: usize, rows: HeadRows| -> Result<()> {
            let w = &ws[wi];
            if let (HeadRows::Paired(rs, ps), Some(acc)) = (&rows, reference.as_mut()) {
                if let Some(i) = ps
                    .iter()
                    .position(|p| !p.kld.is_finite() || !p.ref_logprob.is_finite())
                {
                    anyhow::bail!(
                        "window {wi} [{}, {}): non-finite KL divergence or reference log-probability at position {}",
                        w.begin,
                        w.end,
                        w.first_target - 1 + i
                    );
                }
                acc.push_window(
                    rs.iter()
                        .zip(ps)
                        .map(|(r, p)| (p.kld, r.logprob, p.ref_logprob, r.top1 == p.ref_top1)),
                );
            }
            // Per window first, then added to the stream in window order: a shard's windows
            // then merge into the same sums as an unsharded run's.
            let window_calibration = match (&rows, calibration.as_mut()) {
                (HeadRows::Scored(rs) | HeadRows::Paired(rs, _), Some(stream)) => {
                    let mut c = Calibration::default();
                    for (i, r) in rs.iter().enumerate() {
                        if !r.entropy.is_finite() || !r.top1_logprob.is_finite() {
                            anyhow::bail!(
                                "window {wi} [{}, {}): non-finite entropy or top-1 probability at position {}",
                                w.begin,
                                w.end,
                                w.first_target - 1 + i
                            );
                        }
                        let target = tokens[w.first_target + i];
                        c.push(r.entropy, r.top1_logprob, r.top1 == target);
                    }
                    stream.add(&c);
                    Some(c)
                }
                _ => {
                    calibration = None;
                    None
                }
            };
            let lps = rows.logprobs();
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
                first_target: w.first_target,
                end: w.end,
                scored: s.scored,
                nll_sum: s.nll_sum,
                nll_sq_sum: s.nll_sq_sum,
                logprobs: keep_logprobs.then_some(lps),
                calibration: window_calibration,
            };
            on_window(
                &ws,
                ScoreProgress {
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
                w.first_target
            )
        };
        self.take_routing(); // counts start at zero for this stream
        match &self.model {
            Model::Cpu(model) => {
                let longest = ws.iter().map(|w| w.len()).max().unwrap_or(0);
                let window_bytes = model.window_bytes(longest);
                let in_flight = cpu_windows_in_flight(self.threads(), window_bytes, ws.len());
                // The reference pass's model: this one, or the other engine's (a CPU model:
                // `set_reference` refuses anything else).
                let reference = match &self.reference {
                    None => None,
                    Some(r) => match r.other.as_deref().map(|e| &e.model) {
                        None => Some((&**model, r.kv)),
                        Some(Model::Cpu(m)) => Some((&**m, r.kv)),
                        Some(Model::Cuda(_)) => {
                            anyhow::bail!("the reference model must run on the CPU")
                        }
                    },
                };
                let compute = |t: &[u32], first: usize, may_split: &(dyn Fn() -> bool + Sync)| {
                    match reference {
                        None => model
                            .window_rows_with(t, first, kv, may_split)
                            .map(HeadRows::Scored),
                        Some(r) => model
                            .window_pairs_with(t, first, kv, r, may_split)
                            .map(|(rows, pairs)| HeadRows::Paired(rows, pairs)),
                    }
                };
                score_cpu(
                    &compute,
                    &self.pool,
                    CpuSchedule {
                        in_flight,
                        window_bytes,
                    },
                    tokens,
                    ws,
                    &mut finish,
                    &window_error,
                )?
            }
            Model::Cuda(model) => score_cuda(model, tokens, ws, kv, &mut finish, &window_error)?,
        }
        // A reference pass of the same model would count every token twice: no balance then.
        let routing = self.take_routing().filter(|_| self.reference.is_none());
        Ok(StreamScore {
            routing,
            tokens: tokens.len(),
            processed_tokens: processed as usize,
            totals,
            windows: out,
            calibration,
            reference,
        })
    }
}

impl Engine {
    /// Routed tokens per expert since the last call (MoE models), zeroing the counts.
    fn take_routing(&self) -> Option<Vec<u64>> {
        match &self.model {
            Model::Cpu(m) => m.take_routing(),
            Model::Cuda(m) => m.take_routing(),
        }
    }
}

#[cfg(feature = "cuda")]
fn load_cuda(
    a: &Artifact,
    target: Target,
    precision: Precision,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Model> {
    Ok(Model::Cuda(Box::new(CudaModel::load(
        a, target, precision, progress,
    )?)))
}

#[cfg(not(feature = "cuda"))]
fn load_cuda(
    _: &Artifact,
    _: Target,
    _: Precision,
    _: &mut dyn FnMut(usize, usize),
) -> Result<Model> {
    anyhow::bail!("this build has no CUDA backend")
}

/// What a backend's head gives for a window's targets.
pub(crate) enum HeadRows {
    /// Log-probabilities only (the CUDA head, for now).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Logprobs(Vec<f32>),
    /// Log-probabilities with each row's entropy and top-1 token (the CPU head).
    Scored(Vec<RowScore>),
    /// The same, with the reference pass's comparison at each row.
    Paired(Vec<RowScore>, Vec<PairScore>),
}

impl HeadRows {
    pub(crate) fn logprobs(&self) -> Vec<f32> {
        match self {
            HeadRows::Logprobs(v) => v.clone(),
            HeadRows::Scored(r) | HeadRows::Paired(r, _) => r.iter().map(|r| r.logprob).collect(),
        }
    }
}

/// Accounts one finished window (index, head rows), in window order.
type FinishWindow<'a> = dyn FnMut(usize, HeadRows) -> Result<()> + 'a;
/// Names a window in an error that happened while computing it.
type WindowError<'a> = dyn Fn(usize, &dyn std::fmt::Display) -> anyhow::Error + 'a;

/// Scores the windows on the GPU in batches and hands each finished window to `finish`.
#[cfg(feature = "cuda")]
fn score_cuda(
    model: &CudaModel,
    tokens: &[u32],
    ws: &[Window],
    kv: KvDtype,
    finish: &mut FinishWindow,
    window_error: &WindowError,
) -> Result<()> {
    use crate::backend::cuda::model::ScoreError;
    let r = model.score_windows(tokens, ws, kv, &mut |first, batch| {
        for (j, lps) in batch.into_iter().enumerate() {
            finish(first + j, HeadRows::Logprobs(lps))?;
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
    _: &[Window],
    _: KvDtype,
    _: &mut FinishWindow,
    _: &WindowError,
) -> Result<()> {
    let _ = model.config();
    unreachable!("no CUDA model exists without the CUDA backend")
}
