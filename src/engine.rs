//! The one scoring engine the CLI and the regression harness share.
//!
//! `Engine::load` opens and validates an artifact, builds its tokenizer and loads the
//! weights onto the selected device's backend, a [`Scorer`]; `Engine::score_windows` runs
//! the window protocol over one token stream with one Main KV representation and accounts
//! every window the backend hands over (NLL sums, calibration, a reference pass's
//! comparison, non-finite checks) the same way for every backend. Nothing here knows about
//! corpora, reports or command-line flags, nor which backend it drives.

use crate::artifact::Artifact;
use crate::backend::cpu::model::fault::Faults;
use crate::backend::cpu::model::memory::MemoryPlan;
use crate::backend::cpu::model::schedule::CpuScorer;
use crate::backend::cpu::model::CpuModel;
use crate::backend::{
    cuda, Device, DeviceRequest, HeadRows, MemoryReport, Precision, ScoreError, Scorer,
};
use crate::kv::KvDtype;
use crate::score::{
    windows, Calibration, NllSum, Protocol, ReferenceAcc, StreamScore, Window, WindowScore,
};
use crate::tokenizer::Tokenizer;
use anyhow::{anyhow, Context, Result};
use std::path::Path;

pub struct LoadOptions {
    pub device: DeviceRequest,
    /// Worker threads for the CPU backend (0: one per available core).
    pub threads: usize,
    /// Recompute the artifact digest and compare it with the recorded one.
    pub verify_digest: bool,
    /// Compute precision; `None` takes the device's default (CPU f32, CUDA bf16).
    pub precision: Option<Precision>,
    /// The longest window the run will score (the CPU plans its memory for it before loading
    /// anything); `None`: the CLI's default context, 4096.
    pub window_tokens: Option<usize>,
    /// Memory the CPU may fill, instead of what the machine reports (`--max-memory`).
    pub max_memory: Option<u64>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            device: DeviceRequest::Cpu,
            threads: 0,
            verify_digest: false,
            precision: None,
            window_tokens: None,
            max_memory: None,
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
    /// The CPU run's memory plan (CPU engines).
    pub memory_plan: Option<MemoryPlan>,
    scorer: Box<dyn Scorer>,
    /// The reference pass's KV format and, unless it is this engine's own model, the other
    /// artifact ([`Engine::set_reference`]).
    reference: Option<(KvDtype, Option<Artifact>)>,
    /// `--save-reference`: where every scored window's final-normed rows go.
    save: Option<std::sync::Mutex<Option<crate::score::saved::SavedWriter>>>,
    /// `--kld-base`: the saved reference every window is compared with.
    kld_base: Option<crate::score::saved::SavedReference>,
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
        let mut memory_plan = None;
        let scorer: Box<dyn Scorer> = match &device {
            Device::Cpu { .. } => {
                // Planned before the weights are read: a run that cannot fit stops here.
                let memory = match opts.max_memory {
                    Some(bytes) => Some(crate::host::Limit {
                        bytes,
                        source: "--max-memory".into(),
                    }),
                    None => crate::host::memory_available(),
                };
                let plan = MemoryPlan::new(
                    &artifact.config,
                    artifact.file_bytes,
                    opts.window_tokens.unwrap_or(4096),
                    threads,
                    memory,
                    crate::host::address_space_available(),
                )
                .map_err(|e| anyhow!("{}: {e}", path.display()))?;
                let weights = crate::backend::cpu::model::weights::load(&artifact, progress)?;
                let m = CpuModel::new(artifact.config.clone(), weights).with_faults(faults);
                memory_plan = Some(plan.clone());
                Box::new(CpuScorer::new(m, threads, plan)?)
            }
            Device::Cuda { .. } | Device::Emu { .. } => {
                if faults.active().is_some() {
                    anyhow::bail!("NINFER_TEST_FAULT applies to the CPU backend only");
                }
                let target = match device {
                    Device::Cuda { ordinal, .. } => cuda::Target::Cuda(ordinal),
                    _ => cuda::Target::Emulated,
                };
                cuda::load_scorer(&artifact, target, precision, progress)?
            }
        };
        Ok(Engine {
            artifact,
            tokenizer,
            device,
            device_note,
            precision,
            faults,
            memory_plan,
            scorer,
            reference: None,
            save: None,
            kld_base: None,
        })
    }

    /// Runs the CPU model with `faults` from now on (tests of the `fault-injection` build).
    #[cfg(feature = "fault-injection")]
    pub fn set_faults(&mut self, faults: Faults) -> Result<()> {
        self.scorer.set_faults(faults)?;
        self.faults = faults;
        Ok(())
    }

    /// The test-only perturbation this engine scores under, for reports: a CPU fault
    /// (`NINFER_TEST_FAULT`), or a kernel fault planted in the emulated device
    /// (`NINFER_EMU_FAULT`); `None` outside `fault-injection` builds.
    pub fn test_fault(&self) -> Option<String> {
        if let Some(f) = self.faults.active() {
            return Some(f.describe());
        }
        match self.device {
            #[cfg(feature = "cuda")]
            Device::Emu { .. } => cuda::emu::planted()
                .ok()
                .flatten()
                .map(|f| format!("emulated kernel fault {}: {}", f.name, f.what)),
            _ => None,
        }
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
        self.scorer.threads()
    }

    /// Device memory of a CUDA engine (peak allocated and used bytes), for reports.
    pub fn cuda_memory(&self) -> Option<MemoryReport> {
        self.scorer.memory()
    }

    /// The CUDA libraries' versions of a run on a GPU (none on the CPU or the emulated
    /// device, which use no driver).
    pub fn cuda_versions(&self) -> Option<crate::backend::CudaVersions> {
        match self.device {
            #[cfg(feature = "cuda")]
            Device::Cuda { .. } => Some(crate::backend::cuda::loader::library_versions()),
            _ => None,
        }
    }

    /// Compares every window scored from now on with a reference pass over the same tokens:
    /// this artifact with the KV format `kv` (`other: None`), or another artifact's engine
    /// with it. Both must run on the CPU (the CUDA head has no reference mode yet), and
    /// another artifact must have the same tokenizer and vocabulary.
    pub fn set_reference(&mut self, kv: KvDtype, other: Option<Engine>) -> Result<()> {
        let Some(model) = self.scorer.cpu_model() else {
            anyhow::bail!("a reference pass (--reference-kv, --reference-artifact) runs on the CPU backend only, for now: add --device cpu");
        };
        let (reference, artifact) = match other {
            None => {
                kv.check_head_dim(self.artifact.config.head_dim)?;
                (model.clone(), None)
            }
            Some(o) => {
                let Some(m) = o.scorer.cpu_model() else {
                    anyhow::bail!(
                        "{}: the reference model must run on the CPU",
                        o.artifact.path().display()
                    );
                };
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
                (m, Some(o.artifact))
            }
        };
        drop(model);
        self.scorer.set_reference(reference, kv)?;
        self.reference = Some((kv, artifact));
        Ok(())
    }

    /// The reference pass's KV format and artifact (this engine's own when it is not
    /// another one), if [`Engine::set_reference`] set one.
    pub fn reference(&self) -> Option<(KvDtype, &Artifact)> {
        self.reference
            .as_ref()
            .map(|(kv, other)| (*kv, other.as_ref().unwrap_or(&self.artifact)))
    }

    /// This run's identity as a saved reference names it: what a later `--kld-base` run
    /// must share (the head, the tokenizer, the hidden size) and what it reports.
    pub fn saved_identity(&self, protocol: Protocol, kv: KvDtype) -> crate::score::saved::Identity {
        crate::score::saved::Identity {
            artifact_path: self.artifact.path().display().to_string(),
            artifact_digest: self.artifact.digest.clone(),
            weight_format: self.artifact.weight_summary(),
            head_sha256: self.head_sha256(),
            tokenizer_sha256: self.tokenizer.sha256().to_string(),
            hidden_size: self.artifact.config.hidden_size,
            context: protocol.context,
            stride: protocol.stride,
            window_plan: protocol.plan,
            kv_dtype: kv.name().to_string(),
            device: self.device.describe(),
            build: crate::build_info::LONG_VERSION
                .lines()
                .next()
                .unwrap_or("")
                .to_string(),
        }
    }

    /// sha256 of the output head as stored: its tensors (the tied embedding or `lm_head`,
    /// and their scales when quantized), each as name, dtype, shape and bytes.
    pub fn head_sha256(&self) -> String {
        use sha2::{Digest, Sha256};
        let head = if self.artifact.config.tie_word_embeddings {
            crate::model::layout::EMBED
        } else {
            crate::model::layout::LM_HEAD
        };
        let stem = head.trim_end_matches(".weight");
        let mut h = Sha256::new();
        for name in self.artifact.tensor_names().filter(|n| n.starts_with(stem)) {
            if let Some((dtype, shape, bytes)) = self.artifact.tensor_raw(name) {
                h.update(name.as_bytes());
                h.update(dtype.as_bytes());
                for d in shape {
                    h.update((*d as u64).to_le_bytes());
                }
                h.update(bytes);
            }
        }
        hex::encode(h.finalize())
    }

    /// Saves every scored window's final-normed rows to `writer` from now on
    /// (`--save-reference`; the CUDA backend reads them back from the device).
    pub fn set_save_reference(&mut self, writer: crate::score::saved::SavedWriter) -> Result<()> {
        if self.reference.is_some() {
            anyhow::bail!(
                "--save-reference and a reference pass (--reference-*) do not go together"
            );
        }
        self.save = Some(std::sync::Mutex::new(Some(writer)));
        Ok(())
    }

    /// Finishes the saved reference: its size in bytes (`None` without `--save-reference`).
    pub fn finish_saved_reference(&self) -> Result<Option<u64>> {
        let Some(m) = &self.save else { return Ok(None) };
        let w = m.lock().unwrap_or_else(|e| e.into_inner()).take();
        w.map(|w| w.finish()).transpose()
    }

    /// Compares every window from now on with `saved`'s rows of it (`--kld-base`), refused
    /// unless it was saved with this head, tokenizer and hidden size.
    pub fn set_kld_base(&mut self, saved: crate::score::saved::SavedReference) -> Result<()> {
        if self.reference.is_some() || self.save.is_some() {
            anyhow::bail!("--kld-base goes with neither a reference pass (--reference-*) nor --save-reference");
        }
        let id = &saved.index.identity;
        let shown = saved.path.display();
        if let Some(v) = saved.foreign_vocab() {
            // Another engine's log-probabilities: no head to match, but the same vocabulary,
            // and (per stream, when scoring) the same token ids.
            let ours = self.artifact.config.vocab_size;
            if v != ours {
                anyhow::bail!(
                    "{shown}: log-probabilities over {v} tokens; this artifact's vocabulary has {ours}"
                );
            }
            self.kld_base = Some(saved);
            return Ok(());
        }
        if id.tokenizer_sha256 != self.tokenizer.sha256() {
            anyhow::bail!(
                "{shown}: saved with another tokenizer (sha256 {}, this artifact's is {})",
                id.tokenizer_sha256,
                self.tokenizer.sha256()
            );
        }
        if id.hidden_size != self.artifact.config.hidden_size
            || id.head_sha256 != self.head_sha256()
        {
            anyhow::bail!(
                "{shown}: saved from {} (digest {}), whose output head differs from {}'s: the saved hidden states need the head that made them",
                id.artifact_path,
                id.artifact_digest,
                self.artifact.path().display()
            );
        }
        self.kld_base = Some(saved);
        Ok(())
    }

    /// The saved reference a `--kld-base` run compares with.
    pub fn kld_base(&self) -> Option<&crate::score::saved::SavedReference> {
        self.kld_base.as_ref()
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
        let mut reference =
            (self.reference.is_some() || self.kld_base.is_some()).then(ReferenceAcc::default);
        // --kld-base: this stream's saved windows, which must be these windows.
        let saved = match &self.kld_base {
            None => None,
            Some(b) => {
                let shown = b.path.display();
                let s = b.stream(tokens).ok_or_else(|| {
                    anyhow!(
                        "{shown}: the saved reference has no stream with these {} tokens (it holds {} streams saved with context {} and stride {}; the text, tokenizer or --max-tokens differ)",
                        tokens.len(),
                        b.index.streams.len(),
                        b.index.identity.context,
                        b.index.identity.stride
                    )
                })?;
                let same = s.windows.len() == ws.len()
                    && s.windows.iter().zip(ws).all(|(a, w)| {
                        (a.begin, a.first_target, a.end) == (w.begin, w.first_target, w.end)
                    });
                if !same {
                    anyhow::bail!(
                        "{shown}: this stream was saved with other windows ({} with context {}, stride {} and {} windows; here {}): use the saved run's protocol and shard",
                        s.windows.len(),
                        b.index.identity.context,
                        b.index.identity.stride,
                        b.index.identity.window_plan.name(),
                        ws.len()
                    );
                }
                Some((b, s))
            }
        };
        let mut save = self
            .save
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()));
        if let Some(w) = save.as_mut().and_then(|g| g.as_mut()) {
            w.begin_stream(tokens)?;
        }
        let mut last_finish = std::time::Instant::now();
        // Accounts one finished window (the same for every backend).
        let mut finish = |wi: usize, rows: HeadRows| -> Result<()> {
            let w = &ws[wi];
            if let (
                HeadRows::Hidden(_, hidden) | HeadRows::LogprobsHidden(_, hidden),
                Some(Some(sw)),
            ) = (&rows, save.as_mut().map(|g| g.as_mut()))
            {
                sw.window(w, hidden)?;
            }
            if let (HeadRows::Paired(rs, ps), Some(acc)) = (&rows, reference.as_mut()) {
                if let Some(i) = ps.iter().position(|p| {
                    !p.kld.is_finite()
                        || !p.kld_reverse.is_finite()
                        || !p.js.is_finite()
                        || !p.ref_logprob.is_finite()
                }) {
                    anyhow::bail!(
                        "window {wi} [{}, {}): non-finite KL or Jensen-Shannon divergence or reference log-probability at position {}",
                        w.begin,
                        w.end,
                        w.first_target - 1 + i
                    );
                }
                acc.push_window(rs.iter().zip(ps).enumerate().map(|(i, (r, p))| {
                    crate::score::PositionPair {
                        kld: p.kld,
                        kld_reverse: p.kld_reverse,
                        logprob: r.logprob,
                        ref_logprob: p.ref_logprob,
                        top1_agree: r.top1 == p.ref_top1,
                        depth: w.first_target - w.begin + i,
                        position: w.first_target + i,
                        ref_top1_logprob: p.ref_top1_logprob,
                        js: p.js,
                        top5: p.top5,
                        top10: p.top10,
                    }
                }));
            }
            // Per window first, then added to the stream in window order: a shard's windows
            // then merge into the same sums as an unsharded run's.
            let window_calibration = match (&rows, calibration.as_mut()) {
                (
                    HeadRows::Scored(rs) | HeadRows::Paired(rs, _) | HeadRows::Hidden(rs, _),
                    Some(stream),
                ) => {
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
            let now = std::time::Instant::now();
            let seconds = now.duration_since(last_finish).as_secs_f64();
            last_finish = now;
            let ws = WindowScore {
                index: wi,
                seconds,
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
        self.scorer.take_routing(); // counts start at zero for this stream
        let load = |wi: usize| match &saved {
            Some((b, s)) => b.window_rows(&s.windows[wi]).map_err(|e| format!("{e:#}")),
            None => Err("no saved reference".to_string()),
        };
        let extra = if saved.is_some() {
            crate::backend::Extra::Saved(&load)
        } else if self.save.is_some() {
            crate::backend::Extra::Hidden
        } else {
            crate::backend::Extra::Nothing
        };
        match self
            .scorer
            .score_windows_extra(tokens, ws, kv, extra, &mut finish)
        {
            Ok(()) => {}
            Err(ScoreError::Window { index, error }) => return Err(window_error(index, &error)),
            Err(ScoreError::Finish(e)) => return Err(e),
            Err(ScoreError::Device(e)) => return Err(e),
        }
        let routing = self.scorer.take_routing();
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
