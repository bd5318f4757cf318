//! A window's rows split between two threads for its remaining layers.
//!
//! Why split: when fewer windows than worker threads are left (the end of a stream, or a
//! text of one window), the alternative is to share every op of a window between threads,
//! a fork-join per op, which on a busy 2-core machine is 5-15% slower than two windows side
//! by side (docs/performance.md). Split, rows `..h` run through the remaining layers on one
//! thread and rows `h..` on another, which waits only for the first part's keys and values
//! of each layer ([`Handoff`]).
//!
//! Why the bits do not change: every op computes a row from that row alone (matrix
//! products, norms, RoPE, the KV representation), except attention, whose row results do
//! not depend on which query rows are computed with them as long as the query blocks are
//! the same, and `h` is a multiple of the query block (tested below and in
//! tests/determinism.rs).

use crate::backend::cpu::attention::Q_BLOCK;
use crate::backend::cpu::model::profile::Laps;
use crate::backend::cpu::model::{Bufs, CpuModel, Pass};
use crate::model::error::ForwardError;
use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};

/// Windows shorter than this are never split between threads.
pub(crate) const MIN_SPLIT_ROWS: usize = 4 * Q_BLOCK;

/// Whether a window may be split between two threads, and when.
pub(crate) enum Split<'a> {
    Never,
    /// Ask at each layer boundary (the engine: "is a worker thread free?").
    Ask(&'a (dyn Fn() -> bool + Sync)),
    /// Split before `layer` at row `rows` (tests).
    #[cfg_attr(not(test), allow(dead_code))]
    At {
        layer: usize,
        rows: usize,
    },
}

/// How a part of a window shares keys and values with the other part.
pub(crate) enum Link<'a> {
    /// The whole window: nothing to share.
    Alone,
    /// The first part: gives each layer's keys and values to the second.
    Give(&'a Handoff),
    /// The second part: takes rows `..lo` of each layer's keys and values from the first.
    Take(&'a Handoff),
}

/// Why a part of a window stopped early.
pub(crate) enum Stop {
    Failed(ForwardError),
    /// The first part stopped before giving a layer the second part needs (it failed).
    Abandoned,
}

impl Stop {
    /// For the whole window, which never waits on anything.
    pub(crate) fn into_error(self) -> ForwardError {
        match self {
            Stop::Failed(e) => e,
            Stop::Abandoned => unreachable!("a whole window never waits for keys"),
        }
    }
}

impl From<ForwardError> for Stop {
    fn from(e: ForwardError) -> Stop {
        Stop::Failed(e)
    }
}

impl CpuModel {
    /// Whether to split the window before layer `li`, and where: `Some(h)` gives rows `..h`
    /// to this thread and rows `h..` to another one.
    pub(crate) fn split_here(
        &self,
        split: &Split,
        li: usize,
        t_len: usize,
        first_target: usize,
    ) -> Option<usize> {
        if self.config.hybrid.is_some() {
            // A Gated DeltaNet's State runs through the whole window in order: no split.
            return None;
        }
        match *split {
            Split::Never => None,
            Split::At { layer, rows } => (layer == li).then_some(rows),
            // Asked only when a cut exists: a yes reserves a thread.
            Split::Ask(ask) if t_len >= MIN_SPLIT_ROWS => {
                let h = self.split_point(li, t_len, first_target)?;
                ask().then_some(h)
            }
            Split::Ask(_) => None,
        }
    }

    /// The row at which to cut a window split before layer `from`: the multiple of the
    /// attention's query block that comes closest to giving both parts the same FLOPs
    /// without the first part's being larger (the second part waits for the first at every
    /// layer, so the first should finish first; its thread then helps the second through
    /// work stealing). `None` when the window is too short to cut.
    pub(crate) fn split_point(
        &self,
        from: usize,
        t_len: usize,
        first_target: usize,
    ) -> Option<usize> {
        let c = &self.config;
        let (d, qd, kvd, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let lin = (2 * (d * (qd + 2 * kvd) + qd * d + 3 * d * f)) as f64; // per row
        let kv_only = (2 * d * (qd + 2 * kvd)) as f64; // per row skipped after the last layer
        let att = (4 * c.num_heads * c.head_dim) as f64; // per (row, visible key)
        let pairs = |a: usize, b: usize| ((b * (b + 1) - a * (a + 1)) / 2) as f64;
        let layers = self.weights.layers.len();
        let r0 = first_target - 1;
        // FLOPs of rows a..b over layers from.. (the last layer only for rows from r0 on).
        let cost = |a: usize, b: usize| {
            let full = (layers - from - 1) as f64 * (lin * (b - a) as f64 + att * pairs(a, b));
            let s = r0.clamp(a, b);
            full + kv_only * (s - a) as f64 + lin * (b - s) as f64 + att * pairs(s, b)
        };
        (Q_BLOCK..t_len)
            .step_by(Q_BLOCK)
            .take_while(|&h| cost(0, h) <= cost(h, t_len))
            .last()
    }

    /// Layers `from..` of a window split at row `h`: rows `..h` on this thread, rows `h..`
    /// on whichever worker takes them (or this thread afterwards, when none is free).
    pub(crate) fn split_layers(
        &self,
        from: usize,
        h: usize,
        x: &mut [f32],
        pass: &Pass,
    ) -> Result<(), ForwardError> {
        let c = &self.config;
        let t_len = x.len() / c.hidden_size;
        let layers = self.weights.layers.len();
        let (xa, xb) = x.split_at_mut(h * c.hidden_size);
        let handoff = Handoff::default();
        // One part: rows `rows` of the residual stream (`x`) through layers `from..`.
        let part = |rows: std::ops::Range<usize>, x: &mut [f32], link: Link| {
            let mut laps = Laps::new(self.profile);
            let mut bufs = Bufs::new(c, rows.start, rows.end);
            for li in from..layers {
                self.layer(li, rows.clone(), x, &mut bufs, pass, &link, &mut laps)?;
            }
            let (lo, hi) = (rows.start, rows.end);
            laps.report(&format!(
                "window {t_len} tokens, rows {lo}..{hi}, layers {from}.."
            ));
            Ok(())
        };
        let (a, b) = rayon::join(
            || {
                let _close = CloseOnDrop(&handoff);
                part(0..h, xa, Link::Give(&handoff))
            },
            || part(h..t_len, xb, Link::Take(&handoff)),
        );
        match (a, b) {
            (Ok(()), Ok(())) => Ok(()),
            // Both failed: the error the whole window would have met first.
            (Err(Stop::Failed(ea)), Err(Stop::Failed(eb))) => {
                Err(if eb.order() < ea.order() { eb } else { ea })
            }
            (Err(Stop::Failed(e)), _) | (_, Err(Stop::Failed(e))) => Err(e),
            // The second part gives up only when the first stopped early, i.e. failed.
            (_, Err(Stop::Abandoned)) | (Err(Stop::Abandoned), _) => {
                unreachable!("the second part of a window was abandoned without an error")
            }
        }
    }
}

/// Keys and values passed from the first part of a split window to the second, one layer
/// at a time and in layer order. The first part never waits (buffers are reused once taken,
/// and new ones are made when none is free), so the second part, which may not start until
/// the first is done when no other thread is free, can never hold it up.
#[derive(Default)]
pub(crate) struct Handoff {
    state: Mutex<HandoffState>,
    ready: Condvar,
}

#[derive(Default)]
struct HandoffState {
    /// (layer, keys, values) given and not yet taken, oldest first.
    given: VecDeque<(usize, Vec<f32>, Vec<f32>)>,
    /// Buffers already taken, for reuse.
    spare: Vec<Vec<f32>>,
    /// The first part has stopped (done, failed or unwinding): nothing more will come.
    closed: bool,
}

impl Handoff {
    fn lock(&self) -> std::sync::MutexGuard<'_, HandoffState> {
        // No code panics while holding the lock, so a poisoned state is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn give(&self, layer: usize, k: &[f32], v: &[f32]) {
        let (mut kb, mut vb) = {
            let mut s = self.lock();
            (
                s.spare.pop().unwrap_or_default(),
                s.spare.pop().unwrap_or_default(),
            )
        };
        kb.clear();
        kb.extend_from_slice(k);
        vb.clear();
        vb.extend_from_slice(v);
        self.lock().given.push_back((layer, kb, vb));
        self.ready.notify_all();
    }

    /// Copies the first part's keys and values of `layer` into `k` and `v`, waiting for
    /// them if needed.
    pub(crate) fn take(&self, layer: usize, k: &mut [f32], v: &mut [f32]) -> Result<(), Stop> {
        let mut s = self.lock();
        let (l, kb, vb) = loop {
            if let Some(next) = s.given.pop_front() {
                break next;
            }
            if s.closed {
                return Err(Stop::Abandoned);
            }
            s = self.ready.wait(s).unwrap_or_else(|e| e.into_inner());
        };
        drop(s);
        assert_eq!(l, layer, "layers are handed over in order");
        k.copy_from_slice(&kb[..k.len()]);
        v.copy_from_slice(&vb[..v.len()]);
        let mut s = self.lock();
        s.spare.push(kb);
        s.spare.push(vb);
        Ok(())
    }
}

/// Closes a [`Handoff`] when the first part ends, however it ends, so that the second
/// part never waits for a layer that will not come.
struct CloseOnDrop<'a>(&'a Handoff);

impl Drop for CloseOnDrop<'_> {
    fn drop(&mut self) {
        self.0.lock().closed = true;
        self.0.ready.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::model::synthetic::synthetic_model;
    use crate::kv::KvDtype;
    use crate::model::error::Part;

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    #[test]
    fn a_window_split_between_threads_gives_the_same_bits() {
        // Any layer, any cut at a multiple of the query block, any first target (including
        // ones that leave the first part without scored rows in the last layer), KV formats
        // with per-vector scales: the same bits as the whole window.
        let m = synthetic_model();
        let tokens: Vec<u32> = (0..700).map(|i| ((i * 7919) % 300) as u32).collect();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for kv in [KvDtype::Bf16, KvDtype::Int8, KvDtype::Nvfp4] {
            for first in [1, 300, 690] {
                let whole = m.window_logprobs(&tokens, first, kv).unwrap();
                for layer in 0..2 {
                    for rows in [64, 320, 640] {
                        let split = Split::At { layer, rows };
                        let part: Vec<f32> = pool
                            .install(|| m.forward(&tokens, first, kv, split))
                            .unwrap()
                            .iter()
                            .map(|r| r.logprob)
                            .collect();
                        assert!(
                            same_bits(&whole, &part),
                            "{kv:?}, first target {first}, split before layer {layer} at row {rows}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_engine_hint_is_asked_until_it_says_yes_and_then_never() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let m = synthetic_model();
        let tokens: Vec<u32> = (0..700).map(|i| ((i * 31) % 300) as u32).collect();
        let whole = m.window_logprobs(&tokens, 1, KvDtype::Fp8).unwrap();
        let asked = AtomicUsize::new(0);
        let yes_on_second = || asked.fetch_add(1, Ordering::SeqCst) == 1;
        let split = m
            .window_logprobs_with(&tokens, 1, KvDtype::Fp8, &yes_on_second)
            .unwrap();
        assert_eq!(asked.load(Ordering::SeqCst), 2);
        assert!(same_bits(&whole, &split));
        // Too short to split: never asked.
        let short = &tokens[..MIN_SPLIT_ROWS - 1];
        m.window_logprobs_with(short, 1, KvDtype::Fp8, &|| -> bool { unreachable!() })
            .unwrap();
    }

    #[test]
    fn a_split_window_reports_the_error_the_whole_window_would() {
        // Token 299's embedding is NaN, so its query is non-finite from layer 0 on. Cut at row
        // 256 before layer 0: a NaN in the first part only (the second part is abandoned),
        // in the second only, and in both (the earlier position wins, as unsplit).
        let mut m = synthetic_model();
        let d = m.config.hidden_size;
        m.weights.embed[299 * d..300 * d].fill(f32::NAN);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for bad in [vec![100], vec![500], vec![100, 500], vec![500, 600]] {
            let mut tokens: Vec<u32> = (0..700).map(|i| ((i * 7919) % 299) as u32).collect();
            bad.iter().for_each(|&p| tokens[p] = 299);
            let whole = m.window_logprobs(&tokens, 1, KvDtype::Bf16).unwrap_err();
            assert_eq!(
                whole,
                ForwardError::NonFinite {
                    part: Part::Query,
                    layer: 0,
                    pos: bad[0],
                    head: 0
                }
            );
            let split = Split::At {
                layer: 0,
                rows: 256,
            };
            let e = pool
                .install(|| m.forward(&tokens, 1, KvDtype::Bf16, split))
                .unwrap_err();
            assert_eq!(e, whole, "NaN at {bad:?}");
        }
    }

    #[test]
    fn the_cut_is_a_whole_query_block_and_puts_more_rows_first() {
        // Later rows see more keys, so the balanced cut lies past the middle.
        let m = synthetic_model();
        for (t_len, from) in [(700, 0), (4096, 1), (4096, 0)] {
            let h = m.split_point(from, t_len, 1).unwrap();
            assert!(
                h.is_multiple_of(Q_BLOCK) && h > t_len / 2 && h < t_len,
                "{t_len}: {h}"
            );
        }
        assert_eq!(m.split_point(0, Q_BLOCK, 1), None);
    }
}
