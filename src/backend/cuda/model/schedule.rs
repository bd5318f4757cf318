//! How the CUDA backend schedules a stream's windows: its [`Scorer`], which packs
//! consecutive windows into forward passes as large as device memory allows, and delivers
//! the windows before a failing one first. CPU twin: `backend/cpu/model/schedule.rs`,
//! which spreads windows over threads.

use super::{CudaModel, PassHead};
use crate::backend::cuda::kernels::Program;
use crate::backend::cuda::plan::{self, HeadKind};
use crate::backend::{Extra, FinishWindow, HeadRows, MemoryReport, ScoreError, Scorer};
use crate::kv::KvDtype;
use crate::score::saved::SavedRows;
use crate::score::Window;
use anyhow::Result;
use std::sync::atomic::Ordering;

impl CudaModel {
    /// Scores windows of one stream, batching consecutive windows into forward passes sized
    /// from free device memory. `on_batch(first, results)` receives each batch's per-window
    /// log-probabilities in window order; when a window fails, the windows before it are
    /// delivered first.
    pub fn score_batches(
        &self,
        tokens: &[u32],
        windows: &[Window],
        kv: KvDtype,
        on_batch: &mut dyn FnMut(usize, Vec<Vec<f32>>) -> Result<()>,
    ) -> Result<(), ScoreError> {
        self.score_passes(tokens, windows, kv, Extra::Nothing, &mut |first, rows| {
            on_batch(first, rows.iter().map(HeadRows::logprobs).collect())
        })
    }

    /// [`CudaModel::score_batches`] with what `extra` asks of the head: the final-normed
    /// rows read back (`Extra::Hidden`) or every window compared on the device with a saved
    /// reference's rows of it (`Extra::Saved`).
    pub fn score_passes(
        &self,
        tokens: &[u32],
        windows: &[Window],
        kv: KvDtype,
        extra: Extra,
        on_batch: &mut dyn FnMut(usize, Vec<HeadRows>) -> Result<()>,
    ) -> Result<(), ScoreError> {
        if windows.is_empty() {
            return Ok(());
        }
        let mut st = self.state.lock().unwrap();
        let kvn = kv.ident();
        self.gpu.prepare(&[
            Program {
                module: "attention",
                kv: Some(kvn),
            },
            Program {
                module: "qkv",
                kv: Some(kvn),
            },
            Program {
                module: "elementwise",
                kv: None,
            },
            Program {
                module: "head",
                kv: None,
            },
        ])?;
        if self.config.hybrid.is_some() {
            self.gpu.prepare(&[Program {
                module: "delta_net",
                kv: None,
            }])?;
        }
        if self.config.moe.is_some() {
            self.gpu.prepare(&[Program {
                module: "moe",
                kv: None,
            }])?;
        }
        let head_kind = match extra {
            Extra::Saved(_) => HeadKind::Paired,
            Extra::Nothing | Extra::Hidden => HeadKind::Plain,
        };
        let longest = windows.iter().map(|w| w.len()).max().unwrap_or(0);
        self.ensure_buffers(&mut st, longest, head_kind)?;
        self.ensure_rope(&mut st, longest)?;
        let plan = st.bufs.as_ref().expect("allocated").plan.clone();
        let lens: Vec<usize> = windows.iter().map(|w| w.len()).collect();
        // A saved reference's rows for windows `range`, in pass order (hidden states only:
        // another engine's log-probabilities are compared on the CPU).
        let reference_rows = |range: std::ops::Range<usize>| -> Result<Vec<f32>, ScoreError> {
            let mut rows = Vec::new();
            if let Extra::Saved(load) = extra {
                for wi in range {
                    match load(wi).map_err(|e| ScoreError::Device(anyhow::anyhow!(e)))? {
                        SavedRows::Hidden(h) => rows.extend(h),
                        SavedRows::Logprobs(_) => {
                            return Err(ScoreError::Device(anyhow::anyhow!(
                                "another engine's log-probabilities (a llama.cpp file) are compared on the CPU backend only: add --device cpu"
                            )))
                        }
                    }
                }
            }
            Ok(rows)
        };
        for batch in plan::pack_batches(
            &lens,
            plan.max_rows,
            self.max_windows.load(Ordering::Relaxed),
        )? {
            let wins: Vec<(&[u32], usize)> = windows[batch.clone()]
                .iter()
                .map(|w| (&tokens[w.begin..w.end], w.first_target - w.begin))
                .collect();
            let refs = reference_rows(batch.clone())?;
            let head = |n: usize| match extra {
                Extra::Nothing => PassHead::Logprobs,
                Extra::Hidden => PassHead::Hidden,
                // The first n windows' rows lead the batch's.
                Extra::Saved(_) => {
                    let rows: usize = windows[batch.start..batch.start + n]
                        .iter()
                        .map(|w| w.end - w.first_target)
                        .sum();
                    PassHead::Paired(&refs[..(rows * self.config.hidden_size).min(refs.len())])
                }
            };
            match self.forward_batch(&st, &wins, kv, head(wins.len())) {
                Ok(rows) => on_batch(batch.start, rows).map_err(ScoreError::Finish)?,
                Err(ScoreError::Window { index, error }) => {
                    // As on the CPU, the windows before the failing one are delivered
                    // first: windows are independent, so a pass over just those gives them.
                    if index > 0 {
                        match self.forward_batch(&st, &wins[..index], kv, head(index)) {
                            Ok(rows) => on_batch(batch.start, rows).map_err(ScoreError::Finish)?,
                            Err(ScoreError::Window { index: i, error }) => {
                                return Err(ScoreError::Window {
                                    index: batch.start + i,
                                    error,
                                })
                            }
                            Err(e) => return Err(e),
                        }
                    }
                    return Err(ScoreError::Window {
                        index: batch.start + index,
                        error,
                    });
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl Scorer for CudaModel {
    fn score_windows(
        &self,
        tokens: &[u32],
        windows: &[Window],
        kv: KvDtype,
        finish: &mut FinishWindow,
    ) -> Result<(), ScoreError> {
        self.score_windows_extra(tokens, windows, kv, Extra::Nothing, finish)
    }

    fn score_windows_extra(
        &self,
        tokens: &[u32],
        windows: &[Window],
        kv: KvDtype,
        extra: Extra,
        finish: &mut FinishWindow,
    ) -> Result<(), ScoreError> {
        let r = self.score_passes(tokens, windows, kv, extra, &mut |first, rows| {
            for (j, r) in rows.into_iter().enumerate() {
                finish(first + j, r)?;
            }
            Ok(())
        });
        match r {
            Err(ScoreError::Device(e)) => Err(ScoreError::Device(
                e.context(format!("CUDA scoring ({} windows)", windows.len())),
            )),
            other => other,
        }
    }

    fn take_routing(&self) -> Option<Vec<u64>> {
        CudaModel::take_routing(self)
    }

    fn memory(&self) -> Option<MemoryReport> {
        Some(self.memory_report())
    }

    fn threads(&self) -> usize {
        rayon::current_num_threads()
    }
}
