//! How the CPU backend schedules a stream's windows: its [`Scorer`], which spreads windows
//! over its worker threads ([`score_cpu`]). CUDA twin: `backend/cuda/model/schedule.rs`,
//! which packs windows into forward passes.
//!
//! Results never depend on it: a window's log-probabilities depend only on its tokens (see
//! [`score_cpu`] for why, and the tests below and `tests/it/determinism.rs`).

use super::memory::MemoryPlan;
use super::CpuModel;
use crate::backend::{Extra, FinishWindow, HeadRows, ScoreError, Scorer};
use crate::kv::KvDtype;
use crate::model::ForwardError;
use crate::score::Window;
use std::sync::Arc;

/// How many windows the CPU backend scores at once: one per worker thread, as many as the
/// memory plan's allowance holds (`fit`), never more than there are windows, at least one.
pub(super) fn cpu_windows_in_flight(threads: usize, fit: usize, windows: usize) -> usize {
    threads.min(fit).min(windows).max(1)
}

/// The CPU backend as the engine sees it: the model, its worker threads and, for a
/// reference pass (`--reference-kv`, `--reference-artifact`), the model and KV format every
/// window is compared with.
pub struct CpuScorer {
    model: Arc<CpuModel>,
    pool: rayon::ThreadPool,
    /// The run's memory plan: how many windows fit at once.
    plan: MemoryPlan,
    /// The reference pass's KV format, and its model unless it is `model` itself.
    reference: Option<(Option<Arc<CpuModel>>, KvDtype)>,
}

impl CpuScorer {
    /// `threads` worker threads (at least 1).
    /// Refuses a bad `NINFER_CPU_GEMM` (a typo would time the wrong GEMM). `plan` is the
    /// run's memory plan ([`MemoryPlan::new`], for `threads` threads).
    pub fn new(model: CpuModel, threads: usize, plan: MemoryPlan) -> anyhow::Result<CpuScorer> {
        crate::backend::cpu::matmul::Gemm::from_env().map_err(anyhow::Error::msg)?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| anyhow::anyhow!("cannot start {threads} worker threads: {e}"))?;
        Ok(CpuScorer {
            model: Arc::new(model),
            pool,
            plan,
            reference: None,
        })
    }
}

impl Scorer for CpuScorer {
    fn score_windows(
        &self,
        tokens: &[u32],
        ws: &[Window],
        kv: KvDtype,
        finish: &mut FinishWindow,
    ) -> Result<(), ScoreError> {
        self.score_windows_extra(tokens, ws, kv, Extra::Nothing, finish)
    }

    fn score_windows_extra(
        &self,
        tokens: &[u32],
        ws: &[Window],
        kv: KvDtype,
        extra: Extra,
        finish: &mut FinishWindow,
    ) -> Result<(), ScoreError> {
        if self.reference.is_some() && !matches!(extra, Extra::Nothing) {
            return Err(ScoreError::Device(anyhow::anyhow!(
                "a reference pass (--reference-*) and a saved reference (--save-reference, --kld-base) do not go together"
            )));
        }
        let model = &*self.model;
        let longest = ws.iter().map(|w| w.len()).max().unwrap_or(0);
        // A reference pass holds a second window's buffers beside each window.
        let per_window = if self.reference.is_some() || matches!(extra, Extra::Saved(_)) {
            2
        } else {
            1
        };
        let fit = self.plan.windows_that_fit(longest, &model.config) / per_window;
        if fit == 0 {
            return Err(ScoreError::Device(anyhow::anyhow!(
                "windows of {longest} tokens{} do not fit in the {} bytes allowed ({}) beside the {} the run holds anyway (planned for windows of {})",
                if per_window == 2 { " with their reference pass" } else { "" },
                self.plan.allowed_bytes.unwrap_or(0),
                self.plan.allowed_by.as_deref().unwrap_or(""),
                self.plan.fixed_in_allowed,
                self.plan.window_tokens
            )));
        }
        let in_flight = cpu_windows_in_flight(self.threads(), fit, ws.len());
        let reference = self
            .reference
            .as_ref()
            .map(|(m, k)| (m.as_deref().unwrap_or(model), *k));
        let compute = |wi: usize,
                       t: &[u32],
                       first: usize,
                       may_split: &(dyn Fn() -> bool + Sync)| match (
            reference, extra,
        ) {
            (None, Extra::Nothing) => model
                .window_rows_with(t, first, kv, may_split)
                .map(HeadRows::Scored),
            (None, Extra::Hidden) => model
                .window_rows_hidden_with(t, first, kv, may_split)
                .map(|(rows, hidden)| HeadRows::Hidden(rows, hidden)),
            (None, Extra::Saved(load)) => load(wi)
                .map_err(crate::model::ForwardError::SavedRead)
                .and_then(|saved| model.window_pairs_saved_with(t, first, kv, &saved, may_split))
                .map(|(rows, pairs)| HeadRows::Paired(rows, pairs)),
            (Some(r), _) => model
                .window_pairs_with(t, first, kv, r, may_split)
                .map(|(rows, pairs)| HeadRows::Paired(rows, pairs)),
        };
        score_cpu(
            &compute,
            &self.pool,
            CpuSchedule { in_flight, fit },
            tokens,
            ws,
            finish,
        )
    }

    fn take_routing(&self) -> Option<Vec<u64>> {
        // A reference pass of the same model would count every token twice: no balance then.
        let counts = self.model.take_routing();
        counts.filter(|_| self.reference.is_none())
    }

    fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    fn cpu_model(&self) -> Option<Arc<CpuModel>> {
        Some(self.model.clone())
    }

    /// `reference`: this scorer's own model, or another with the same vocabulary.
    fn set_reference(&mut self, reference: Arc<CpuModel>, kv: KvDtype) -> anyhow::Result<()> {
        // Its own model is held once, so that test faults still reach both passes.
        let other = (!Arc::ptr_eq(&reference, &self.model)).then_some(reference);
        self.reference = Some((other, kv));
        Ok(())
    }

    #[cfg(feature = "fault-injection")]
    fn set_faults(&mut self, faults: super::fault::Faults) -> anyhow::Result<()> {
        match Arc::get_mut(&mut self.model) {
            Some(m) => {
                m.set_faults(faults);
                Ok(())
            }
            None => anyhow::bail!("test faults are set before a reference pass shares the model"),
        }
    }
}

/// How [`score_cpu`] may use the pool.
pub(super) struct CpuSchedule {
    /// Windows computing at once ([`cpu_windows_in_flight`]).
    pub(super) in_flight: usize,
    /// Windows (or halves of split ones) the memory plan holds at once.
    pub(super) fit: usize,
}

/// One window's computation: its tokens, the first target's index in them, and the split
/// question (`CpuModel::window_rows_with`).
/// Scores one window: its index among the windows given, its tokens, its first target's
/// index in them, and whether it may be split now.
pub(super) type Compute<'a> = dyn Fn(usize, &[u32], usize, &(dyn Fn() -> bool + Sync)) -> Result<HeadRows, ForwardError>
    + Sync
    + 'a;

/// Scores CPU windows with up to `in_flight` of them computing at once and hands each to
/// `finish` in window order, on the calling thread.
///
/// Why several windows at once: inside one window every matrix product, attention call and
/// elementwise pass is a fork-join over the worker threads, a few hundred barriers per
/// window, and on a shared machine each barrier waits for the slowest thread. A thread that
/// owns a window never waits for the others. Measured on the 2-core development machine
/// (docs/performance.md): 8-14% less wall time at context 1024 and 4096.
///
/// When fewer windows than threads are left (the end of a stream, or a stream of one
/// window), a running window splits its rows between its own thread and a free one at the
/// next layer boundary (`CpuModel::window_logprobs_with`), which keeps the pair of threads
/// working without a barrier per op; a split takes one more window's worth of working
/// memory, so it happens only where the memory plan holds it. Threads still idle after that
/// steal the running windows' column blocks and attention tasks.
///
/// Why the bits do not change: a window's result depends only on its tokens, never on which
/// thread runs which task or where a window is split (every kernel splits its work at fixed
/// boundaries and reduces in a fixed order; tests/determinism.rs compares 1, 2, 3 and 16
/// threads bit for bit).
///
/// Errors: windows start in order, so when the next window in order failed every earlier
/// one succeeded; that first error is returned, no new window starts and the ones already
/// running finish and are dropped.
pub(super) fn score_cpu(
    compute: &Compute,
    pool: &rayon::ThreadPool,
    schedule: CpuSchedule,
    tokens: &[u32],
    ws: &[Window],
    finish: &mut FinishWindow,
) -> Result<(), ScoreError> {
    use std::collections::BTreeMap;
    use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    use std::sync::mpsc;

    let threads = pool.current_num_threads();
    let CpuSchedule { in_flight, fit } = schedule;
    let memory_for = |parts: usize| parts <= fit;
    if in_flight <= 1 {
        // One window at a time: the other threads are free whenever memory allows a split.
        let may_split = || threads > 1 && memory_for(2);
        for (wi, w) in ws.iter().enumerate() {
            let lps = pool
                .install(|| {
                    let (t, first) = (&tokens[w.begin..w.end], w.first_target - w.begin);
                    compute(wi, t, first, &may_split)
                })
                .map_err(|error| ScoreError::Window { index: wi, error })?;
            finish(wi, lps).map_err(ScoreError::Finish)?;
        }
        return Ok(());
    }
    // Windows are taken in order from `next_window` by one loop per worker thread (up to
    // `in_flight` of them), never spawned as jobs: a thread waiting inside a fork-join may
    // run any queued job, and a queued window picked up there would hold the window below
    // it on that thread's stack until it finished. `busy` counts threads running a window
    // or the second part of a split one.
    let next_window = AtomicUsize::new(0);
    let busy = AtomicUsize::new(0);
    // The first window that failed (every window after it is skipped).
    let stop_at = AtomicUsize::new(usize::MAX);
    let run = |wi: usize| {
        let w = &ws[wi];
        let did_split = AtomicBool::new(false);
        // Yes when no window is left to start, a thread is free and memory allows: the
        // free thread is then counted busy until this window ends.
        let may_split = || {
            let yes = next_window.load(SeqCst) >= ws.len()
                && busy
                    .fetch_update(SeqCst, SeqCst, |b| {
                        (b < threads && memory_for(b + 1)).then_some(b + 1)
                    })
                    .is_ok();
            did_split.store(yes, SeqCst);
            yes
        };
        let lps = compute(
            wi,
            &tokens[w.begin..w.end],
            w.first_target - w.begin,
            &may_split,
        );
        busy.fetch_sub(1 + usize::from(did_split.load(SeqCst)), SeqCst);
        lps
    };
    type Outcome = std::thread::Result<Result<HeadRows, ForwardError>>;
    let (tx, rx) = mpsc::channel::<(usize, Outcome)>();
    // Set when this function returns (early, on an error), so that no new window starts.
    struct StopOnDrop<'a>(&'a AtomicUsize);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(0, SeqCst);
        }
    }
    // The scope's body runs here, on the caller's thread (not a pool worker), so it may
    // block on the channel; the windows run on the pool's threads.
    pool.in_place_scope(|scope| {
        let _stop = StopOnDrop(&stop_at);
        let (tx, run, next_window, busy, stop_at) = (&tx, &run, &next_window, &busy, &stop_at);
        scope.spawn_broadcast(move |_, ctx| {
            if ctx.index() >= in_flight {
                return;
            }
            let tx = tx.clone();
            loop {
                // Taking a window and counting its thread busy happen together, so a
                // window never mistakes a thread about to start one for a free thread.
                busy.fetch_add(1, SeqCst);
                let wi = next_window.fetch_add(1, SeqCst);
                // A window before the first failed one still runs: the caller reports
                // errors in window order and needs every earlier result.
                if wi >= ws.len() || wi > stop_at.load(SeqCst) {
                    busy.fetch_sub(1, SeqCst);
                    return;
                }
                let outcome = catch_unwind(AssertUnwindSafe(|| run(wi)));
                if !matches!(outcome, Ok(Ok(_))) {
                    stop_at.fetch_min(wi, SeqCst);
                }
                // The receiver is gone only after an error; then nobody needs this result.
                let _ = tx.send((wi, outcome));
            }
        });
        let mut ready: BTreeMap<usize, Outcome> = BTreeMap::new();
        let mut next = 0;
        while next < ws.len() {
            let (wi, outcome) = rx.recv().expect("a window job ended without a result");
            ready.insert(wi, outcome);
            while let Some(outcome) = ready.remove(&next) {
                let lps = match outcome {
                    Ok(r) => r.map_err(|error| ScoreError::Window { index: next, error })?,
                    Err(panic) => resume_unwind(panic),
                };
                finish(next, lps).map_err(ScoreError::Finish)?;
                next += 1;
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::model::synthetic::synthetic_model;
    use crate::backend::cpu::model::CpuModel;
    use crate::kv::KvDtype;
    use crate::score::{windows, Protocol};

    /// What `score_cpu` handed to `finish` (window index and log-probability bits, in the
    /// order received) and its error, if any.
    type Run = (Vec<(usize, Vec<u32>)>, Option<String>);

    fn run(model: &CpuModel, threads: usize, in_flight: usize, tokens: &[u32]) -> Run {
        // Windows of 300 rows: long enough to be split between threads.
        let p = Protocol::new(300, 150).unwrap();
        let ws = windows(tokens.len(), p).unwrap();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let mut got = Vec::new();
        let compute = |_: usize, t: &[u32], first: usize, may_split: &(dyn Fn() -> bool + Sync)| {
            model
                .window_rows_with(t, first, KvDtype::Int8, may_split)
                .map(HeadRows::Scored)
        };
        let r = score_cpu(
            &compute,
            &pool,
            CpuSchedule {
                in_flight,
                fit: usize::MAX,
            },
            tokens,
            &ws,
            &mut |wi, rows| {
                got.push((wi, rows.logprobs().iter().map(|x| x.to_bits()).collect()));
                Ok(())
            },
        );
        (got, r.err().map(|e| e.to_string()))
    }

    fn stream() -> Vec<u32> {
        (0..1500).map(|i| ((i * 7919) % 299) as u32).collect()
    }

    #[test]
    fn every_schedule_hands_over_the_same_windows_in_order() {
        // One window at a time on one thread (never split) is the reference; several
        // windows at once, splits when threads run out of windows, and more threads than
        // windows in flight must give the same bits, in window order.
        let m = synthetic_model();
        let tokens = stream();
        let (reference, err) = run(&m, 1, 1, &tokens);
        assert_eq!(err, None);
        let n = windows(tokens.len(), Protocol::new(300, 150).unwrap())
            .unwrap()
            .len();
        assert_eq!(
            reference.iter().map(|r| r.0).collect::<Vec<_>>(),
            (0..n).collect::<Vec<_>>()
        );
        for (threads, in_flight) in [(2, 1), (2, 2), (3, 2), (3, 3), (4, 2)] {
            assert!(
                run(&m, threads, in_flight, &tokens) == (reference.clone(), None),
                "{threads} threads, {in_flight} windows in flight"
            );
        }
    }

    #[test]
    fn a_failing_window_is_reported_after_every_earlier_one_and_before_any_later_one() {
        // Token 299's embedding is NaN: the first window holding position 800 fails at
        // layer 0 (so do later ones that may already be running); every earlier window is
        // handed over, in order, and the error names the first failing window.
        let mut m = synthetic_model();
        let d = m.config.hidden_size;
        // An untied copy of the head, so that only windows holding token 299 fail.
        m.weights.lm_head = Some(m.weights.embed.clone());
        m.weights.embed[299 * d..300 * d].fill(f32::NAN);
        let mut tokens = stream();
        tokens[800] = 299;
        let ws = windows(tokens.len(), Protocol::new(300, 150).unwrap()).unwrap();
        let fail = ws
            .iter()
            .position(|w| w.begin <= 800 && 800 < w.end)
            .unwrap();
        assert!(
            fail >= 2 && ws[fail + 1].begin <= 800,
            "the test needs windows around it"
        );
        let expected = format!(
            "window {fail}: non-finite query at layer 0, window position {}, query head 0",
            800 - ws[fail].begin
        );
        for (threads, in_flight) in [(1, 1), (2, 1), (2, 2), (3, 3)] {
            let (got, err) = run(&m, threads, in_flight, &tokens);
            assert_eq!(
                got.iter().map(|g| g.0).collect::<Vec<_>>(),
                (0..fail).collect::<Vec<_>>(),
                "{threads} threads, {in_flight} in flight"
            );
            assert_eq!(err.as_deref(), Some(expected.as_str()));
        }
    }
}
