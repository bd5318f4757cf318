//! The contract between the engine and a backend's model: score a stream's windows, hand
//! each finished window over in window order, and fail naming the window.
//!
//! Both forward passes honour it the same way: the CPU model (`backend/cpu/model/`, which
//! spreads windows over threads in `schedule.rs`) and the CUDA model
//! (`backend/cuda/model/`, which packs windows into passes in `schedule.rs`). When a window
//! fails, every window before it has been handed over first, as a sequential run would
//! have; the engine then names the failing window in its error. What a backend hands over
//! per window ([`HeadRows`]) and how it fails ([`ScoreError`]) are defined here, below both
//! backends and the engine.

#[cfg(feature = "fault-injection")]
use crate::backend::cpu::model::fault::Faults;
use crate::backend::cpu::model::CpuModel;
use crate::kv::KvDtype;
use crate::model::ForwardError;
use crate::score::Window;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// One scored row: the target's log-probability and, from the same logits, the entropy of
/// the predictive distribution (nats) and its top-1 token with that token's log-probability.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RowScore {
    pub logprob: f32,
    pub entropy: f32,
    pub top1: u32,
    pub top1_logprob: f32,
}

/// What a reference pass says about one position.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PairScore {
    /// The reference's log-probability of the target.
    pub ref_logprob: f32,
    /// KL(reference ‖ run) over the full vocabulary, nats.
    pub kld: f32,
    /// KL(run ‖ reference) over the full vocabulary, nats.
    pub kld_reverse: f32,
    /// The reference's top-1 token (lowest id on ties) and its log-probability.
    pub ref_top1: u32,
    pub ref_top1_logprob: f32,
    /// Jensen–Shannon divergence of the two distributions, nats (at most ln 2).
    pub js: f32,
    /// How many of the run's 5 (10) most likely tokens are among the reference's 5 (10).
    pub top5: u8,
    pub top10: u8,
}

/// What a backend's head gives for a window's targets, in target order.
pub enum HeadRows {
    /// Log-probabilities only (the CUDA head, for now).
    Logprobs(Vec<f32>),
    /// Log-probabilities with each row's entropy and top-1 token (the CPU head).
    Scored(Vec<RowScore>),
    /// The same, with the reference pass's comparison at each row.
    Paired(Vec<RowScore>, Vec<PairScore>),
    /// The same as `Scored`, with the final-normed rows the head read (`[rows, d]`), for
    /// `--save-reference`.
    Hidden(Vec<RowScore>, Vec<f32>),
    /// The same as `Logprobs`, with the final-normed rows (the CUDA head, for
    /// `--save-reference`).
    LogprobsHidden(Vec<f32>, Vec<f32>),
}

/// What a run asks of the head beyond its own rows.
#[derive(Clone, Copy)]
pub enum Extra<'a> {
    Nothing,
    /// Every window's final-normed rows (`--save-reference`).
    Hidden,
    /// Compare every window with a saved reference's rows of it (`--kld-base`): the loader
    /// gives window `i`'s rows (hidden states `[rows, d]` or another engine's
    /// log-probabilities `[rows, vocab]`), or why it cannot (one line naming the file).
    Saved(&'a (dyn Fn(usize) -> Result<crate::score::saved::SavedRows, String> + Sync)),
}

impl HeadRows {
    pub fn logprobs(&self) -> Vec<f32> {
        match self {
            HeadRows::Logprobs(v) | HeadRows::LogprobsHidden(v, _) => v.clone(),
            HeadRows::Scored(r) | HeadRows::Paired(r, _) | HeadRows::Hidden(r, _) => {
                r.iter().map(|r| r.logprob).collect()
            }
        }
    }
}

/// Takes one finished window (its index among the windows given, its rows), in window
/// order; an error stops scoring.
pub type FinishWindow<'a> = dyn FnMut(usize, HeadRows) -> anyhow::Result<()> + 'a;

/// Why scoring stopped.
#[derive(Debug)]
pub enum ScoreError {
    /// A window failed the way the CPU reference fails (a token out of range, a non-finite
    /// value): its index among the windows given, and what happened.
    Window { index: usize, error: ForwardError },
    /// The receiver of finished windows refused one (its error, unchanged).
    Finish(anyhow::Error),
    /// The device failed (allocation, launch, execution).
    Device(anyhow::Error),
}

impl std::fmt::Display for ScoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ScoreError::Window { index, error } => write!(f, "window {index}: {error}"),
            ScoreError::Finish(e) | ScoreError::Device(e) => write!(f, "{e:#}"),
        }
    }
}

impl From<anyhow::Error> for ScoreError {
    fn from(e: anyhow::Error) -> Self {
        ScoreError::Device(e)
    }
}

/// Device memory of a run, for reports (backends with a device: CUDA).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryReport {
    /// The most bytes this process had allocated at once (weights, activations, head).
    pub peak_allocated_bytes: u64,
    /// Device memory in use at the fullest point seen (all processes, driver included).
    pub peak_used_bytes: u64,
    pub weights_bytes: u64,
    pub total_bytes: u64,
}

/// The CUDA libraries a GPU run used, as they report their versions, for reports: results
/// on a GPU can change with the driver and cuBLAS (its GEMM algorithms), so a baseline names
/// them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaVersions {
    /// `cuDriverGetVersion`, e.g. "13.0".
    pub driver: String,
    /// `nvrtcVersion`, e.g. "13.0".
    pub nvrtc: String,
    /// `cublasGetProperty` major.minor.patch, e.g. "13.1.0".
    pub cublas: String,
}

/// A loaded model on its backend, as the engine uses it.
pub trait Scorer: Send + Sync {
    /// Scores `windows` of `tokens` (each window's tokens `tokens[w.begin..w.end]`, its
    /// targets from `w.first_target`) through the Main KV representation `kv`, and hands
    /// each window's rows to `finish` in window order. When a window fails, every window
    /// before it has been handed to `finish` first.
    fn score_windows(
        &self,
        tokens: &[u32],
        windows: &[Window],
        kv: KvDtype,
        finish: &mut FinishWindow,
    ) -> Result<(), ScoreError>;

    /// [`Scorer::score_windows`] with more asked of the head ([`Extra`]). Both models
    /// override it; a backend that does not refuses anything beyond plain scoring.
    fn score_windows_extra(
        &self,
        tokens: &[u32],
        windows: &[Window],
        kv: KvDtype,
        extra: Extra,
        finish: &mut FinishWindow,
    ) -> Result<(), ScoreError> {
        match extra {
            Extra::Nothing => self.score_windows(tokens, windows, kv, finish),
            _ => Err(ScoreError::Device(anyhow::anyhow!(
                "--save-reference and --kld-base are not supported by this backend: add --device cpu"
            ))),
        }
    }

    /// Token-to-expert assignments per expert since the last call (summed over the sparse
    /// layers), zeroing them; `None` for a dense model.
    fn take_routing(&self) -> Option<Vec<u64>>;

    /// Device memory (backends with a device).
    fn memory(&self) -> Option<MemoryReport> {
        None
    }

    /// Worker threads the backend computes with on the host.
    fn threads(&self) -> usize;

    /// The CPU model, where this is the CPU backend: it can be another run's reference.
    fn cpu_model(&self) -> Option<Arc<CpuModel>> {
        None
    }

    /// Compares every window scored from now on with `reference`'s pass over the same
    /// tokens through `kv` (the CPU backend only, for now).
    fn set_reference(&mut self, reference: Arc<CpuModel>, kv: KvDtype) -> anyhow::Result<()> {
        let _ = (reference, kv);
        anyhow::bail!("a reference pass (--reference-kv, --reference-artifact) runs on the CPU backend only, for now: add --device cpu")
    }

    /// Runs the model with the test-only perturbation `faults` from now on (the CPU backend
    /// of `fault-injection` builds).
    #[cfg(feature = "fault-injection")]
    fn set_faults(&mut self, faults: Faults) -> anyhow::Result<()> {
        let _ = faults;
        anyhow::bail!("test faults apply to the CPU backend only")
    }
}
