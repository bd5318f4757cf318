//! How the CUDA backend schedules a stream's windows: its [`Scorer`], which packs
//! consecutive windows into forward passes as large as device memory allows, and delivers
//! the windows before a failing one first. CPU twin: `backend/cpu/model/schedule.rs`,
//! which spreads windows over threads.

use super::CudaModel;
use crate::backend::cuda::kernels::Program;
use crate::backend::cuda::plan;
use crate::backend::{FinishWindow, HeadRows, MemoryReport, ScoreError, Scorer};
use crate::kv::KvDtype;
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
        let longest = windows.iter().map(|w| w.len()).max().unwrap_or(0);
        self.ensure_buffers(&mut st, longest)?;
        self.ensure_rope(&mut st, longest)?;
        let plan = st.bufs.as_ref().expect("allocated").plan.clone();
        let lens: Vec<usize> = windows.iter().map(|w| w.len()).collect();
        for batch in plan::pack_batches(
            &lens,
            plan.max_rows,
            self.max_windows.load(Ordering::Relaxed),
        )? {
            let wins: Vec<(&[u32], usize)> = windows[batch.clone()]
                .iter()
                .map(|w| (&tokens[w.begin..w.end], w.first_target - w.begin))
                .collect();
            match self.forward_batch(&st, &wins, kv) {
                Ok(lps) => on_batch(batch.start, lps).map_err(ScoreError::Finish)?,
                Err(ScoreError::Window { index, error }) => {
                    // As on the CPU, the windows before the failing one are delivered
                    // first: windows are independent, so a pass over just those gives them.
                    if index > 0 {
                        match self.forward_batch(&st, &wins[..index], kv) {
                            Ok(lps) => on_batch(batch.start, lps).map_err(ScoreError::Finish)?,
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
        let r = self.score_batches(tokens, windows, kv, &mut |first, batch| {
            for (j, lps) in batch.into_iter().enumerate() {
                finish(first + j, HeadRows::Logprobs(lps))?;
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

    fn score_windows_extra(
        &self,
        tokens: &[u32],
        windows: &[Window],
        kv: KvDtype,
        extra: crate::backend::Extra,
        finish: &mut FinishWindow,
    ) -> Result<(), ScoreError> {
        use crate::backend::Extra;
        match extra {
            Extra::Nothing => self.score_windows(tokens, windows, kv, finish),
            Extra::Hidden => {
                // Every pass hands over its rows with its log-probabilities.
                self.set_keep_hidden(true);
                let r = self.score_batches(tokens, windows, kv, &mut |first, batch| {
                    let mut hidden = self.take_hidden();
                    if hidden.len() != batch.len() {
                        anyhow::bail!("the pass read back {} windows' rows for {}", hidden.len(), batch.len());
                    }
                    for (j, (lps, h)) in batch.into_iter().zip(hidden.drain(..)).enumerate() {
                        finish(first + j, HeadRows::LogprobsHidden(lps, h))?;
                    }
                    Ok(())
                });
                self.set_keep_hidden(false);
                r
            }
            Extra::Saved(_) => Err(ScoreError::Device(anyhow::anyhow!(
                "--kld-base runs on the CPU backend only, for now: add --device cpu (a CUDA run can save a reference for it)"
            ))),
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
